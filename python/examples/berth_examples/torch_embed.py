"""``torch_embed``: sentence embeddings from a sentence-transformers BERT
directory (all-MiniLM-L6-v2, as ``berth fetch minilm`` installs it) in plain
PyTorch: no ``transformers``, no hub download. Mean pooled over the
attention mask and L2-normalised, as the candle ``embed`` backend does, so
the two give the same vectors.

The directory holds ``config.json``, ``model.safetensors``,
``tokenizer.json`` and optionally ``1_Pooling/config.json`` (mean pooling
only).

Options:

- ``load_mode``: ``mmap`` (default) maps ``model.safetensors`` through
  safetensors' memory map, so the weights are file-backed pages the kernel
  can share and drop; ``read`` reads the file into the process's own
  (anonymous) memory. The load report shows which by its file-backed and
  anonymous figures.
- ``threads``: PyTorch's intra-op threads (default: PyTorch's own choice).
- ``max_length``: tokens per text (default 256, the model's training length).
- ``device``: ``cpu``, ``cuda`` or ``cuda:N`` (default: the GPU berth placed
  the worker on, else the CPU).

Requests that arrive while a pass runs are batched (up to 64 requests and
about 8192 tokens, texts sorted by length into passes of 32), each answered
with its own vectors.

Request: ``{"input": "text"}`` or ``{"input": ["text", ...]}``, and
optionally ``"encoding": "f32"``.
Response: ``{"embeddings": [[...], ...], "dim": 384, "tokens": N}``; with
``"encoding": "f32"``, ``{"count": N, "dim": 384, "tokens": T}`` and the
vectors as ``N x dim`` little-endian float32 bulk bytes. Both are the candle
``embed`` backend's shapes, so ``/v1/embeddings`` serves it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from tokenizers import Tokenizer

from berth_worker import (
    Backend,
    BadRequest,
    Batching,
    Cancelled,
    LoadContext,
    LoadFailed,
    LoadSpec,
    Options,
    Request,
    RequestContext,
    Response,
)

#: Texts per forward pass: attention over a padded batch grows with its
#: size, so a request of thousands of texts runs in passes of this many.
PASS = 32


def _read_json(spec: LoadSpec, path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise LoadFailed("model `{}`: cannot read `{}`: {}".format(spec.name, path, e)) from None
    except ValueError as e:
        raise LoadFailed("model `{}`: `{}` is not JSON: {}".format(spec.name, path, e)) from None


def _weights(spec: LoadSpec, path: str, load_mode: str) -> Dict[str, torch.Tensor]:
    """The tensors of ``path``: mapped from the file, or read into memory."""
    try:
        if load_mode == "mmap":
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        with open(path, "rb") as f:
            return load_safetensors_bytes(f.read())
    except Exception as e:  # safetensors raises its own error types
        raise LoadFailed(
            "model `{}`: cannot load weights from `{}`: {}".format(spec.name, path, e)
        ) from None


def _device(spec: LoadSpec, opts: Options, ctx: LoadContext) -> torch.device:
    wanted = opts.str("device")
    if wanted is None:
        wanted = "cuda" if ctx.gpus else "cpu"
    if wanted != "cpu" and not (wanted == "cuda" or wanted.startswith("cuda:")):
        raise BadRequest(
            "model `{}`: option `device={}` is not `cpu`, `cuda` or `cuda:N`".format(
                spec.name, wanted
            )
        )
    if wanted != "cpu" and not torch.cuda.is_available():
        raise LoadFailed(
            "model `{}`: device `{}` asked for, but this PyTorch sees no CUDA device "
            "(build {}); place the model without `gpus` or set `device=cpu`".format(
                spec.name, wanted, torch.__version__
            )
        )
    return torch.device(wanted)


class Bert:
    """BERT's encoder as sentence-transformers' MiniLM uses it, written out
    over a dict of weights so that nothing but PyTorch is needed."""

    def __init__(self, config: Dict[str, Any], w: Dict[str, torch.Tensor]) -> None:
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.hidden = int(config["hidden_size"])
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError("hidden_act `{}` is not `gelu`".format(config.get("hidden_act")))
        self.w = w
        # Fail at load, not at the first request, on a missing tensor.
        for name in self._names():
            if name not in w:
                raise KeyError("tensor `{}` is missing".format(name))

    def _names(self) -> List[str]:
        names = [
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight",
            "embeddings.LayerNorm.bias",
        ]
        for i in range(self.layers):
            p = "encoder.layer.{}.".format(i)
            for part in (
                "attention.self.query",
                "attention.self.key",
                "attention.self.value",
                "attention.output.dense",
                "intermediate.dense",
                "output.dense",
            ):
                names += [p + part + ".weight", p + part + ".bias"]
            for part in ("attention.output.LayerNorm", "output.LayerNorm"):
                names += [p + part + ".weight", p + part + ".bias"]
        return names

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, (self.hidden,), self.w[name + ".weight"], self.w[name + ".bias"], self.eps
        )

    def forward(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, length = ids.shape
        w = self.w
        positions = torch.arange(length, device=ids.device)
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][positions]
            + w["embeddings.token_type_embeddings.weight"][types]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        attend = mask.bool()[:, None, None, :]  # (n, 1, 1, length): True = attend
        d = self.hidden // self.heads
        for i in range(self.layers):
            p = "encoder.layer.{}.".format(i)

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(n, length, self.heads, d).transpose(1, 2)

            q = split(self._linear(x, p + "attention.self.query"))
            k = split(self._linear(x, p + "attention.self.key"))
            v = split(self._linear(x, p + "attention.self.value"))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
            a = a.transpose(1, 2).reshape(n, length, self.hidden)
            x = self._norm(self._linear(a, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
            h = F.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._norm(self._linear(h, p + "output.dense") + x, p + "output.LayerNorm")
        return x


class TorchEmbed(Backend):
    """all-MiniLM-L6-v2 (and its kind) in PyTorch."""

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(["load_mode", "threads", "max_length", "device"])
        self.load_mode = opts.str("load_mode", "mmap")
        if self.load_mode not in ("mmap", "read"):
            raise BadRequest(
                "model `{}`: option `load_mode={}` is not `mmap` or `read`".format(
                    spec.name, self.load_mode
                )
            )
        threads = opts.int("threads", 0, minimum=0)
        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        max_length = opts.int("max_length", 256, minimum=1)
        self.device = _device(spec, opts, ctx)
        if spec.model is None:
            raise LoadFailed(
                "model `{}`: the torch_embed backend needs a model directory "
                "(a sentence-transformers folder such as `berth fetch minilm` installs)".format(
                    spec.name
                )
            )
        self.dir = spec.model
        if not os.path.isdir(self.dir):
            raise LoadFailed("model `{}`: `{}` is not a directory".format(spec.name, self.dir))
        config = _read_json(spec, os.path.join(self.dir, "config.json"))
        pooling = os.path.join(self.dir, "1_Pooling", "config.json")
        if os.path.isfile(pooling) and _read_json(spec, pooling).get("pooling_mode_mean_tokens") is not True:
            raise LoadFailed(
                "model `{}`: `{}` asks for a pooling other than mean pooling, which is all "
                "this backend does".format(spec.name, pooling)
            )
        ctx.progress()
        tokenizer_path = os.path.join(self.dir, "tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as e:
            raise LoadFailed(
                "model `{}`: cannot load `{}`: {}".format(spec.name, tokenizer_path, e)
            ) from None
        self.max_length = min(max_length, int(config.get("max_position_embeddings", 512)))
        # tokenizer.json pads every text to 128; padding to the longest in
        # the batch is what makes single texts cheap.
        self.tokenizer.enable_padding()
        self.tokenizer.enable_truncation(self.max_length)
        ctx.progress()
        weights = _weights(spec, os.path.join(self.dir, "model.safetensors"), self.load_mode)
        if self.device.type != "cpu":
            weights = {k: v.to(self.device) for k, v in weights.items()}
        try:
            self.model = Bert(config, weights)
        except (KeyError, ValueError) as e:
            raise LoadFailed(
                "model `{}`: `{}` is not a BERT this backend runs: {}".format(
                    spec.name, self.dir, e.args[0] if e.args else e
                )
            ) from None
        self.dim = self.model.hidden
        ctx.progress()

    def embed(self, texts: Sequence[str]) -> Tuple[torch.Tensor, List[int]]:
        """Unit-length vectors for ``texts`` in one forward pass, and each
        text's tokens (padding excluded)."""
        encodings = self.tokenizer.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long, device=self.device)
        types = torch.tensor([e.type_ids for e in encodings], dtype=torch.long, device=self.device)
        mask = torch.tensor(
            [e.attention_mask for e in encodings], dtype=torch.long, device=self.device
        )
        with torch.inference_mode():
            hidden = self.model.forward(ids, types, mask)
            m = mask.unsqueeze(2).to(hidden.dtype)
            mean = (hidden * m).sum(1) / m.sum(1)
            vectors = F.normalize(mean, p=2.0, dim=1)
        return vectors, [int(n) for n in mask.sum(1)]

    def _asked(self, request: Request, name: str) -> Tuple[List[str], str]:
        """A request's texts and encoding, or BadRequest naming the model."""
        body = request.body
        texts = body.get("input") if isinstance(body, dict) else None
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadRequest(
                'model `{}`: the request must be {{"input": "text"}} or '
                '{{"input": ["text", ...]}}'.format(name)
            )
        if not texts:
            raise BadRequest("`input` is an empty list; give at least one text")
        encoding = body.get("encoding", "json")
        if encoding not in ("json", "f32"):
            raise BadRequest("`encoding` `{}` is not `json` or `f32`".format(encoding))
        return texts, encoding

    def _embed_all(
        self, texts: List[str], progress: Any, cancelled: Any
    ) -> Tuple[torch.Tensor, List[int]]:
        """Vectors and token counts of ``texts``, in passes of at most
        :data:`PASS`, shortest first so that a pass pads little."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        vectors = torch.empty(len(texts), self.dim, dtype=torch.float32)
        tokens = [0] * len(texts)
        for start in range(0, len(order), PASS):
            if cancelled():
                raise Cancelled("cancelled")
            part = order[start : start + PASS]
            v, t = self.embed([texts[i] for i in part])
            vectors[part] = v.to("cpu", torch.float32)
            for i, n in zip(part, t):
                tokens[i] = n
            progress()
        return vectors, tokens

    def _answer(self, vectors: torch.Tensor, tokens: int, encoding: str) -> Any:
        if encoding == "f32":
            body = {"count": int(vectors.shape[0]), "dim": self.dim, "tokens": tokens}
            return Response(body, vectors.numpy().astype("<f4", copy=False))
        return {"embeddings": vectors.tolist(), "dim": self.dim, "tokens": tokens}

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        texts, encoding = self._asked(request, ctx.name)
        vectors, tokens = self._embed_all(texts, ctx.progress, lambda: ctx.cancelled)
        return self._answer(vectors, sum(tokens), encoding)

    def batching(self) -> Batching:
        """Up to 64 requests and about 8192 tokens in one set of passes."""
        return Batching(max_batch=64, max_cost=32 * 256)

    def cost(self, request: Request) -> int:
        body = request.body if isinstance(request.body, dict) else {}
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list):
            return 1
        return sum(min(len(t) // 4 + 2, self.max_length) for t in texts if isinstance(t, str)) or 1

    def handle_batch(self, requests: List[Request], contexts: List[RequestContext]) -> List[Any]:
        """The texts of every request in one set of passes; each request
        gets its own vectors. Bad input fails alone; a cancelled request
        leaves without its vectors."""
        asked: List[Any] = []
        texts: List[str] = []
        owner: List[int] = []
        for i, (request, ctx) in enumerate(zip(requests, contexts)):
            try:
                t, encoding = self._asked(request, ctx.name)
            except BadRequest as e:
                asked.append(e)
                continue
            asked.append(encoding)
            texts.extend(t)
            owner.extend([i] * len(t))
        out: List[Any] = [a if isinstance(a, BaseException) else None for a in asked]
        if texts:
            vectors, tokens = self._embed_all(
                texts, contexts[0].progress, lambda: all(c.cancelled for c in contexts)
            )
            rows: List[List[int]] = [[] for _ in requests]
            for row, i in enumerate(owner):
                rows[i].append(row)
            for i, encoding in enumerate(asked):
                if isinstance(encoding, BaseException):
                    continue
                if contexts[i].cancelled:
                    out[i] = Cancelled("cancelled")
                    continue
                mine = vectors[rows[i]]
                out[i] = self._answer(mine, sum(tokens[r] for r in rows[i]), encoding)
        return out

    def describe(self) -> Any:
        return {
            "dim": self.dim,
            "dir": self.dir,
            "load_mode": self.load_mode,
            "max_length": self.max_length,
            "threads": self.threads,
            "device": str(self.device),
            "framework": "torch " + torch.__version__,
        }

