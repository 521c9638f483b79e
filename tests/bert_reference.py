"""An independent sentence embedding for tests: numpy, not MLX.

The reference that memvisor's vectors are checked against shares nothing with
worker/bert.py but the weights file: the weights are read with
`safetensors.numpy`, the text is tokenized by transformers' pure-Python
`BertTokenizer` from the folder's `vocab.txt` (the worker uses the Rust
`tokenizers` with tokenizer.json), and the forward is plain numpy in float64,
one sentence at a time (no padding, no mask), with exact (erf) GELU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_erf = np.vectorize(math.erf)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


class NumpyBert:
    """all-MiniLM-L6-v2 style: BERT, mean pooling, L2 normalisation."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import BertTokenizer

        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        self.w = {k.removeprefix("bert."): v.astype(np.float64)
                  for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.tokenizer = BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def embed(self, text: str) -> np.ndarray:
        return self.embed_ids(self.tokens(text))

    def embed_ids(self, ids: list[int]) -> np.ndarray:
        c, w = self.config, self.w
        eps = c.get("layer_norm_eps", 1e-12)
        n = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        heads = c["num_attention_heads"]
        d = c["hidden_size"] // heads

        def lin(v: np.ndarray, name: str) -> np.ndarray:
            return v @ w[name + ".weight"].T + w[name + ".bias"]

        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}"
            q, k, v = (lin(x, f"{p}.attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            att = (scores @ v).transpose(1, 0, 2).reshape(n, heads * d)
            x = _layer_norm(lin(att, f"{p}.attention.output.dense") + x,
                            w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"], eps)
            inner = _gelu(lin(x, f"{p}.intermediate.dense"))
            x = _layer_norm(lin(inner, f"{p}.output.dense") + x,
                            w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], eps)
        vec = x.mean(0)
        return vec / np.linalg.norm(vec)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
