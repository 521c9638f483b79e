"""GGUF files written from a real tiny model, for the GGUF and infill tests (no tests here)."""

from __future__ import annotations

import json
from pathlib import Path


def _permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf.py's permute: the layout the importer must undo."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    name = name.replace("model.embed_tokens", "token_embd").replace("model.norm", "output_norm")
    name = name.replace("model.layers.", "blk.")
    for hf, gg in _NAMES.items():
        name = name.replace(hf, gg)
    return name


def write_gguf(model_dir: Path, out: Path, *, metadata_changes: dict | None = None,
               extra_tensors: dict | None = None, arch: str = "llama") -> None:
    """A GGUF (float32 tensors) of a generated MLX model, as llama.cpp would write it.

    `arch="qwen2"`: the same weights under qwen2's metadata, rows not permuted
    (llama.cpp permutes only llama's), and the zero q/k/v biases qwen2 has.
    """
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    weights = mx.load(str(model_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arrays = {}
    for name, w in weights.items():
        w = w.astype(mx.float32)
        if arch != "llama":
            pass
        elif "q_proj" in name:
            w = _permute(w, heads)
        elif "k_proj" in name:
            w = _permute(w, kv_heads)
        arrays[_gguf_name(name)] = w
    if arch == "qwen2":
        for layer in range(config["num_hidden_layers"]):
            for part in ("q", "k", "v"):
                rows = arrays[f"blk.{layer}.attn_{part}.weight"].shape[0]
                arrays[f"blk.{layer}.attn_{part}.bias"] = mx.zeros((rows,))
    arrays.update(extra_tensors or {})
    u32 = lambda v: mx.array(v, dtype=mx.uint32)
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.context_length": u32(config["max_position_embeddings"]),
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv_heads),
        "llama.rope.dimension_count": u32(config["head_dim"]),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in specials else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(vocab[tok_config["bos_token"]]),
        "tokenizer.ggml.eos_token_id": u32(vocab[tok_config["eos_token"]]),
        "tokenizer.ggml.add_bos_token": mx.array(True),
        "tokenizer.chat_template": tok_config["chat_template"],
    }
    metadata = {key.replace("llama.", f"{arch}.", 1): value for key, value in metadata.items()}
    metadata["general.architecture"] = arch
    for key, value in (metadata_changes or {}).items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    mx.save_gguf(str(out), arrays, metadata)
