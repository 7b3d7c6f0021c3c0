"""Models with the shapes of real ones and random weights, made where they
are measured (the GPU machine reaches no registry and no hub): BERT
encoders in sentence-transformers' layout, which both `torch_embed` and
candle's `embed` read, from numpy and the carried MiniLM tokenizer.

    BERT-large: 24 layers, hidden 1024, 16 heads, 4096 inner: 1.34 GB float32
    MiniLM-L6:  6 layers, hidden 384, 12 heads, 1536 inner: 90 MB float32
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Dict, Tuple

SHAPES = {
    "bert-large": {"layers": 24, "hidden": 1024, "heads": 16, "inner": 4096},
    "minilm": {"layers": 6, "hidden": 384, "heads": 12, "inner": 1536},
}
VOCAB, POSITIONS, TYPES = 30522, 512, 2


def tensors(layers: int, hidden: int, inner: int) -> Dict[str, Tuple[int, ...]]:
    """Every tensor's name and shape, as sentence-transformers' BertModel
    names them."""
    out: Dict[str, Tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (VOCAB, hidden),
        "embeddings.position_embeddings.weight": (POSITIONS, hidden),
        "embeddings.token_type_embeddings.weight": (TYPES, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
        "pooler.dense.weight": (hidden, hidden),
        "pooler.dense.bias": (hidden,),
    }
    for i in range(layers):
        p = "encoder.layer.{}.".format(i)
        for part in ("query", "key", "value"):
            out[p + "attention.self.{}.weight".format(part)] = (hidden, hidden)
            out[p + "attention.self.{}.bias".format(part)] = (hidden,)
        out[p + "attention.output.dense.weight"] = (hidden, hidden)
        out[p + "attention.output.dense.bias"] = (hidden,)
        out[p + "attention.output.LayerNorm.weight"] = (hidden,)
        out[p + "attention.output.LayerNorm.bias"] = (hidden,)
        out[p + "intermediate.dense.weight"] = (inner, hidden)
        out[p + "intermediate.dense.bias"] = (inner,)
        out[p + "output.dense.weight"] = (hidden, inner)
        out[p + "output.dense.bias"] = (hidden,)
        out[p + "output.LayerNorm.weight"] = (hidden,)
        out[p + "output.LayerNorm.bias"] = (hidden,)
    return out


def make(name: str, dest: str, tokenizer: str, seed: int = 0) -> str:
    """The model folder `dest` for shape `name`, made once (random float32
    weights, LayerNorm scales of one); its path."""
    import numpy as np

    shape = SHAPES[name]
    marker = os.path.join(dest, "model.safetensors")
    if os.path.exists(marker):
        return dest
    os.makedirs(os.path.join(dest, "1_Pooling"), exist_ok=True)
    config = {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
        "hidden_size": shape["hidden"], "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"], "intermediate_size": shape["inner"],
        "vocab_size": VOCAB, "max_position_embeddings": POSITIONS, "type_vocab_size": TYPES,
        "layer_norm_eps": 1e-12, "pad_token_id": 0, "position_embedding_type": "absolute",
    }
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(dest, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": shape["hidden"], "pooling_mode_mean_tokens": True}, f)
    shutil.copy(tokenizer, os.path.join(dest, "tokenizer.json"))
    rng = np.random.default_rng(seed)
    specs = tensors(shape["layers"], shape["hidden"], shape["inner"])
    header: Dict[str, object] = {}
    at = 0
    for key, dims in specs.items():
        n = 4
        for d in dims:
            n *= d
        header[key] = {"dtype": "F32", "shape": list(dims), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    tmp = marker + ".part"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, dims in specs.items():
            if "LayerNorm.weight" in key:
                array = np.ones(dims, dtype=np.float32)
            elif key.endswith(".bias") or "LayerNorm" in key:
                array = np.zeros(dims, dtype=np.float32)
            else:
                array = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
            f.write(array.tobytes())
    os.rename(tmp, marker)
    return dest


if __name__ == "__main__":
    import sys

    print(make(sys.argv[1], sys.argv[2], sys.argv[3]))
