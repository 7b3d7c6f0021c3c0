"""The in-process side of the PyTorch embeddings bench: loads the
``torch_embed`` example in this process and, for each line ``BATCH N`` on
stdin, embeds N requests of BATCH texts (the bench's texts, as the berth
side sends them) and answers the seconds they took, one line each."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../python/examples"))

from berth_worker import LoadContext, LoadSpec, Request, RequestContext  # noqa: E402
from berth_examples.torch_embed import TorchEmbed  # noqa: E402


def texts(batch):
    return ["text {} of the throughput bench, a sentence of ordinary length".format(i) for i in range(batch)]


def main():
    backend = TorchEmbed()
    backend.load(LoadSpec("inprocess", "torch_embed", sys.argv[1], {}), LoadContext.standalone())
    print("ready", flush=True)
    for line in sys.stdin:
        batch, n = (int(x) for x in line.split())
        body = {"input": texts(batch), "encoding": "f32"}
        started = time.perf_counter()
        for i in range(n):
            backend.handle(Request(i, body), RequestContext.standalone())
        print(time.perf_counter() - started, flush=True)


if __name__ == "__main__":
    main()
