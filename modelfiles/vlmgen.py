"""Generate a small vision-language model folder that `mlx_vlm.load(DIR)` loads offline.

Why: no hub can be reached here, yet the vision worker, its guard and the image
APIs must be tested on a real architecture, end to end. The folder is a SmolVLM
(mlx-vlm's `smolvlm`, the Idefics3 layout): a SigLIP vision tower, a pixel-shuffle
connector, and a llama language model with plain 1-D RoPE. That architecture was
chosen because its text half is an ordinary llama (so memvisor's batched decode,
prompt cache and prefill guard serve it unchanged) while its image token count
still depends on the image (the processor splits an image into tiles by its
aspect ratio: `tiles` per side at most, plus one global view, `tile_tokens` each).

Like modelgen.py it imports no MLX: random weights from numpy (seeded: the same
seed gives the same bytes), the demo's BPE tokenizer with the image tokens the
processor needs added as special tokens, a chat template that renders a message's
`content` as a string or as a list of text and image parts, and transformers'
real SmolVLM image-processor and processor configs (the PIL backend: no torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import numpy as np

from modelfiles.modelgen import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    IM_END,
    INIT_STD,
    PAD,
    SPECIAL_TOKENS,
    ModelGenError,
    _write_tokenizer_files,
    check_target_dir,
    train_tokenizer,
)
from modelfiles.staging import staged_model_dir

FAKE_IMAGE, IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE = (
    "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
# A message's content: a string, or a list of parts in order ({"type": "text", "text": ...} and
# {"type": "image"}), each image becoming the processor's <image> marker (it expands it into tiles).
CONTENT = "{{ message['content'] }}"
PARTS = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
         "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + IMAGE
         + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}")
assert CONTENT in CHAT_TEMPLATE
VISION_TEMPLATE = CHAT_TEMPLATE.replace(CONTENT, PARTS)


class VisionDims(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a generated VLM; the defaults are demo-vision's (about 30 MiB of float32)."""

    hidden: int = 256          # language model
    layers: int = 4
    intermediate: int = 688
    heads: int = 4
    kv_heads: int = 2
    vision_hidden: int = 192   # vision tower (SigLIP)
    vision_layers: int = 4
    vision_intermediate: int = 768
    vision_heads: int = 3
    patch: int = 16
    tile: int = 256            # the tower's input side: every tile is resized to tile x tile
    scale: int = 2             # pixel shuffle: (tile/patch)^2 / scale^2 tokens per tile
    tiles: int = 3             # an image's longest edge is resized to tiles x tile, then split

    @property
    def tile_tokens(self) -> int:
        return (self.tile // self.patch) ** 2 // self.scale ** 2

    def check(self) -> None:
        if self.tile % self.patch or (self.tile // self.patch) % self.scale:
            raise ModelGenError(f"tile {self.tile} must be a multiple of patch x scale ({self.patch} x {self.scale})")
        if self.hidden % self.heads or self.heads % self.kv_heads or self.vision_hidden % self.vision_heads:
            raise ModelGenError("hidden sizes must divide by their heads, and heads by key/value heads")
        if self.tiles < 1:
            raise ModelGenError("tiles must be at least 1")


def image_tokens(dims: VisionDims) -> list[str]:
    """The special tokens SmolVLM's processor writes around an image's tiles."""
    grid = [f"<row_{r}_col_{c}>" for r in range(1, dims.tiles + 1) for c in range(1, dims.tiles + 1)]
    return [FAKE_IMAGE, IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE, *grid]


def _weights(dims: VisionDims, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """mlx-vlm's names (its `sanitize` keeps them as they are): vision_model, connector, language_model."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * INIT_STD).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    vh, p = dims.vision_hidden, dims.patch
    w = {"vision_model.embeddings.patch_embedding.weight": normal(vh, p, p, 3),  # MLX's conv layout
         "vision_model.embeddings.patch_embedding.bias": normal(vh),
         "vision_model.embeddings.position_embedding.weight": normal((dims.tile // p) ** 2, vh)}
    for i in range(dims.vision_layers):
        pre = f"vision_model.encoder.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{pre}.self_attn.{name}.weight"], w[f"{pre}.self_attn.{name}.bias"] = normal(vh, vh), normal(vh)
        for norm in ("layer_norm1", "layer_norm2"):
            w[f"{pre}.{norm}.weight"], w[f"{pre}.{norm}.bias"] = ones(vh), np.zeros(vh, np.float32)
        w[f"{pre}.mlp.fc1.weight"], w[f"{pre}.mlp.fc1.bias"] = normal(dims.vision_intermediate, vh), normal(
            dims.vision_intermediate)
        w[f"{pre}.mlp.fc2.weight"], w[f"{pre}.mlp.fc2.bias"] = normal(vh, dims.vision_intermediate), normal(vh)
    w["vision_model.post_layernorm.weight"], w["vision_model.post_layernorm.bias"] = ones(vh), np.zeros(vh, np.float32)
    w["connector.modality_projection.proj.weight"] = normal(dims.hidden, vh * dims.scale ** 2)
    h, head_dim = dims.hidden, dims.hidden // dims.heads
    w["language_model.embed_tokens.weight"] = normal(vocab, h)
    for i in range(dims.layers):
        pre = f"language_model.layers.{i}"
        w[f"{pre}.self_attn.q_proj.weight"] = normal(h, h)
        w[f"{pre}.self_attn.k_proj.weight"] = normal(dims.kv_heads * head_dim, h)
        w[f"{pre}.self_attn.v_proj.weight"] = normal(dims.kv_heads * head_dim, h)
        w[f"{pre}.self_attn.o_proj.weight"] = normal(h, h)
        w[f"{pre}.mlp.gate_proj.weight"] = normal(dims.intermediate, h)
        w[f"{pre}.mlp.up_proj.weight"] = normal(dims.intermediate, h)
        w[f"{pre}.mlp.down_proj.weight"] = normal(h, dims.intermediate)
        w[f"{pre}.input_layernorm.weight"], w[f"{pre}.post_attention_layernorm.weight"] = ones(h), ones(h)
    w["language_model.norm.weight"] = ones(h)
    w["language_model.lm_head.weight"] = normal(vocab, h)
    return w


def _configs(dims: VisionDims, ids: dict[str, int], vocab: int) -> dict[str, dict]:
    """config.json (mlx-vlm's smolvlm), and the processor's two files (transformers' SmolVLM)."""
    eos = [ids[EOS], ids[IM_END]]
    text = {"model_type": "llama", "hidden_size": dims.hidden, "intermediate_size": dims.intermediate,
            "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads, "head_dim": dims.hidden // dims.heads,
            "num_hidden_layers": dims.layers, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": False}
    vision = {"model_type": "smolvlm_vision", "hidden_size": dims.vision_hidden, "num_attention_heads": dims.vision_heads,
              "patch_size": dims.patch, "num_hidden_layers": dims.vision_layers,
              "intermediate_size": dims.vision_intermediate, "image_size": dims.tile, "num_channels": 3,
              "layer_norm_eps": 1e-6}
    config = {"architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm", "torch_dtype": "float32",
              "scale_factor": dims.scale, "image_token_id": ids[IMAGE], "vocab_size": vocab, "eos_token_id": eos,
              "bos_token_id": ids[BOS], "pad_token_id": ids[PAD], "text_config": text, "vision_config": vision}
    preprocessor = {"image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
                    "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": dims.tiles * dims.tile},
                    "resample": 1, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True,
                    "do_image_splitting": True, "max_image_size": {"longest_edge": dims.tile}}
    processor = {"processor_class": "SmolVLMProcessor", "image_seq_len": dims.tile_tokens}
    return {"config.json": config, "preprocessor_config.json": preprocessor, "processor_config.json": processor}


DEMO_DIMS = VisionDims()


def make_vision_model(target: str | os.PathLike, dims: VisionDims = DEMO_DIMS, seed: int = 0, *,
                      force: bool = False) -> Path:
    """Write the VLM folder at `target` (float32 weights) and return its path."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    dims.check()
    path = Path(target)
    check_target_dir(path, force)
    tokenizer = Tokenizer.from_str(train_tokenizer().to_str())  # a copy: the trained one is cached per process
    extra = image_tokens(dims)
    tokenizer.add_special_tokens(extra)
    vocab = tokenizer.get_vocab_size()
    with staged_model_dir(path) as staging:
        ids = _write_tokenizer_files(tokenizer, staging, [*SPECIAL_TOKENS, *extra])
        tok_config = json.loads((staging / "tokenizer_config.json").read_text())
        tok_config["chat_template"] = VISION_TEMPLATE
        (staging / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        save_file(_weights(dims, vocab, seed), str(staging / "model.safetensors"), metadata={"format": "mlx"})
        configs = _configs(dims, ids, vocab)
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids[BOS], "eos_token_id": configs["config.json"]["eos_token_id"],
             "pad_token_id": ids[PAD]}, indent=2))
        for name, body in configs.items():  # config.json last of all (staged_model_dir moves it last)
            (staging / name).write_text(json.dumps(body, indent=2))
    return path
