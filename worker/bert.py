"""A BERT encoder in MLX, with sentence-transformers' pooling.

Why written here rather than taken from mlx-embeddings: that package's every
import goes through `mlx_embeddings.utils`, which imports `mlx_vlm`, and
installing it pulls mlx-vlm, mlx-audio, opencv, datasets, pyarrow, pandas and
scipy into the worker for a six-layer encoder that is these few functions.

The forward is the original BERT (post-norm residual blocks, absolute
positions, token type 0), on right-padded batches: the attention mask keeps
every row from attending to its padding, so a padded row's vector equals the
row alone. Pooling and normalisation follow the folder's sentence-transformers
files (shared.embedding.EmbeddingSpec) and run in float32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import msgspec

from shared.embedding import EmbeddingSpec
from shared.modelinfo import read_config_json

# Checkpoint prefixes of the same encoder (BertForMaskedLM and the like keep it under "bert.").
_PREFIXES = ("bert.", "model.")
# Heads and buffers a sentence embedding does not use.
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")
_ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx, "relu": nn.relu}


class BertError(ValueError):
    """A folder this encoder cannot run; the message names what is missing or unsupported."""


class BertArgs(msgspec.Struct, frozen=True, kw_only=True):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"


class Bert:
    """The encoder's weights by checkpoint name, and its forward."""

    def __init__(self, args: BertArgs, weights: dict[str, mx.array]) -> None:
        if args.hidden_size % args.num_attention_heads:
            raise BertError(f"hidden_size {args.hidden_size} is not a multiple of "
                            f"num_attention_heads {args.num_attention_heads}")
        if args.hidden_act not in _ACTIVATIONS:
            raise BertError(f"hidden_act {args.hidden_act!r} is not supported (only {sorted(_ACTIVATIONS)})")
        self.args = args
        self.w = weights
        self.act = _ACTIVATIONS[args.hidden_act]
        missing = [name for name in self._names() if name not in weights]
        if missing:
            raise BertError(f"the weights lack {len(missing)} tensor(s) of a BERT encoder, e.g. {missing[0]!r}")

    @classmethod
    def load(cls, folder: str | Path) -> Bert:
        config = read_config_json(folder)
        if config is None:
            raise BertError(f"no readable config.json in {folder}")
        if config.get("model_type") != "bert":
            raise BertError(f"model_type {config.get('model_type')!r}: only BERT encoders (model_type \"bert\") "
                            "are served as embedding models")
        fields = {k: config[k] for k in BertArgs.__struct_fields__ if k in config}
        try:
            args = msgspec.convert(fields, BertArgs)
        except msgspec.ValidationError as exc:
            raise BertError(f"config.json: {exc}") from None
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise BertError(f"no .safetensors weights in {folder}")
        weights: dict[str, mx.array] = {}
        for file in files:
            loaded = mx.load(str(file))
            assert isinstance(loaded, dict)  # a safetensors file loads as a dict of arrays
            weights.update(loaded)
        return cls(args, _sanitize(weights))

    def _names(self) -> list[str]:
        names = [f"embeddings.{t}_embeddings.weight" for t in ("word", "position", "token_type")]
        names += ["embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
        for i in range(self.args.num_hidden_layers):
            for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "intermediate.dense", "output.dense"):
                names += [f"encoder.layer.{i}.{part}.weight", f"encoder.layer.{i}.{part}.bias"]
            for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                names += [f"encoder.layer.{i}.{norm}.weight", f"encoder.layer.{i}.{norm}.bias"]
        return names

    @property
    def dtype(self) -> mx.Dtype:
        return self.w["embeddings.word_embeddings.weight"].dtype

    def _linear(self, x: mx.array, name: str) -> mx.array:
        return mx.addmm(self.w[name + ".bias"], x, self.w[name + ".weight"].T)

    def _norm(self, x: mx.array, name: str) -> mx.array:
        return mx.fast.layer_norm(x, self.w[name + ".weight"], self.w[name + ".bias"], self.args.layer_norm_eps)

    def hidden_states(self, ids: mx.array, mask: mx.array) -> mx.array:
        """The last layer's token vectors [rows, tokens, hidden] of right-padded `ids`
        [rows, tokens]; `mask` [rows, tokens] is True on real tokens."""
        a, w = self.args, self.w
        rows, length = ids.shape
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:length]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        heads, head_dim = a.num_attention_heads, a.hidden_size // a.num_attention_heads
        bias = mx.where(mask, 0.0, -math.inf).astype(x.dtype)[:, None, None, :]
        for i in range(a.num_hidden_layers):
            p = f"encoder.layer.{i}"
            q, k, v = (self._linear(x, f"{p}.attention.self.{n}").reshape(rows, length, heads, head_dim)
                       .transpose(0, 2, 1, 3) for n in ("query", "key", "value"))
            att = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5, mask=bias)
            att = att.transpose(0, 2, 1, 3).reshape(rows, length, a.hidden_size)
            x = self._norm(self._linear(att, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            inner = self.act(self._linear(x, f"{p}.intermediate.dense"))
            x = self._norm(self._linear(inner, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
        return x

    def embed(self, ids: mx.array, mask: mx.array, spec: EmbeddingSpec) -> mx.array:
        """Sentence vectors [rows, dims] (float32), pooled and normalised as `spec` says."""
        return pool(self.hidden_states(ids, mask).astype(mx.float32), mask, spec)


def pool(states: mx.array, mask: mx.array, spec: EmbeddingSpec) -> mx.array:
    """sentence-transformers' Pooling (and Normalize) over the real tokens of each row."""
    keep = mask[:, :, None].astype(states.dtype)
    count = mx.maximum(keep.sum(axis=1), 1e-9)
    if spec.pooling == "cls":
        out = states[:, 0]
    elif spec.pooling == "max":
        out = mx.where(keep > 0, states, -math.inf).max(axis=1)
    elif spec.pooling == "mean_sqrt_len":
        out = (states * keep).sum(axis=1) / mx.sqrt(count)
    else:
        out = (states * keep).sum(axis=1) / count
    out = out[:, :spec.dims]
    return normalize(out) if spec.normalize else out


def normalize(vectors: mx.array) -> mx.array:
    """Unit length per row (sentence-transformers' Normalize: L2, with its 1e-12 floor)."""
    return vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


def _sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for name, array in weights.items():
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if not name.startswith(_UNUSED):
            out[name] = array
    return out
