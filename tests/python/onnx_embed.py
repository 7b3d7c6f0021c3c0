"""The ONNX Runtime side of the `onnx` bench: all-MiniLM-L6-v2 exported to
ONNX from the PyTorch example's BERT (the same safetensors weights berth's
`embed` runs), then run by ONNX Runtime in this process.

Usage: ``onnx_embed.py MODEL_DIR THREADS``. It exports the model (BERT,
mean pooling and normalisation, all in the graph) to a temporary file,
loads it with ``intra_op_num_threads = THREADS``, prints ``ready``, then
for each line ``BATCH N`` on stdin embeds N requests of BATCH texts (the
bench's texts, as the berth side embeds them) and prints the seconds they
took, one line each; for a line ``VECTOR I`` it prints the vector of text I
alone as JSON, for the bench to compare with berth's."""

import json
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../python/examples"))

from berth_worker import LoadContext, LoadSpec  # noqa: E402
from berth_examples.torch_embed import TorchEmbed  # noqa: E402


def texts(batch):
    return ["text {} of the throughput bench, a sentence of ordinary length".format(i) for i in range(batch)]


class Pooled(torch.nn.Module):
    """The example's BERT with its mean pooling and normalisation."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, ids, types, mask):
        hidden = self.bert.forward(ids, types, mask)
        m = mask.unsqueeze(2).to(hidden.dtype)
        mean = (hidden * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(mean, p=2.0, dim=1)


def export(backend, path):
    enc = backend.tokenizer.encode_batch(texts(2))
    args = tuple(
        torch.tensor([getattr(e, field) for e in enc], dtype=torch.long)
        for field in ("ids", "type_ids", "attention_mask")
    )
    axes = {0: "batch", 1: "length"}
    torch.onnx.export(
        Pooled(backend.model),
        args,
        path,
        input_names=["ids", "types", "mask"],
        output_names=["vectors"],
        dynamic_axes={"ids": axes, "types": axes, "mask": axes, "vectors": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )


def main():
    model_dir, threads = sys.argv[1], int(sys.argv[2])
    backend = TorchEmbed()
    backend.load(LoadSpec("onnx-export", "torch_embed", model_dir, {}), LoadContext.standalone())
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "minilm.onnx")
        export(backend, path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    tokenizer = backend.tokenizer

    def embed(batch):
        enc = tokenizer.encode_batch(batch)
        feed = {
            "ids": np.array([e.ids for e in enc], dtype=np.int64),
            "types": np.array([e.type_ids for e in enc], dtype=np.int64),
            "mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        }
        return session.run(None, feed)[0]

    print("ready", flush=True)
    for line in sys.stdin:
        what, a, *rest = line.split()
        if what == "VECTOR":
            print(json.dumps(embed([texts(int(a) + 1)[int(a)]])[0].tolist()), flush=True)
            continue
        batch, n = int(a), int(rest[0])
        started = time.perf_counter()
        for _ in range(n):
            embed(texts(batch))
        print(time.perf_counter() - started, flush=True)


if __name__ == "__main__":
    main()
