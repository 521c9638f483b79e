"""GGUF import on a GGUF written here from a generated model, the way llama.cpp lays
one out: q/k rows permuted for its rotary layout, the tokenizer and chat template in metadata.

The real quantized model (SmolLM2 Q4_1) is exercised in live/test_models_gguf_real_live.py (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.gguf import GGUFError, ImportProgress, decode_import_line, read_header
from shared.weights import WeightsError, estimate_weight_bytes
from tests.gguf_harness import _permute, write_gguf

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The memory guard watches every model and steps in before the machine runs out."


@pytest.fixture(scope="module")
def gguf_file(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(tiny_model, out)
    return out


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory) -> Path:
    from modelfiles.gguf_import import import_gguf

    dest = tmp_path_factory.mktemp("imported") / "tiny"
    import_gguf(gguf_file, dest)
    return dest


def test_import_undoes_the_rotary_permutation_output_equals_the_original(tiny_model, imported):
    """Same logits from the original folder and from its GGUF round trip (q/k rows put back)."""
    import mlx.core as mx
    import mlx_lm

    original, tok_a = mlx_lm.load(str(tiny_model))
    again, tok_b = mlx_lm.load(str(imported))
    ids = tok_a.encode(PROMPT)
    assert tok_b.encode(PROMPT) == ids
    a = original(mx.array([ids])).astype(mx.float32)
    b = again(mx.array([ids])).astype(mx.float32)
    assert mx.allclose(a, b, atol=1e-2).item()
    assert mx.argmax(a, axis=-1).tolist() == mx.argmax(b, axis=-1).tolist()


def test_without_undoing_the_permutation_the_output_differs(tiny_model, imported, tmp_path):
    """The test above can fail: a folder whose q rows stay permuted computes something else."""
    import mlx.core as mx
    import mlx_lm

    weights = mx.load(str(imported / "model.safetensors"))
    heads = json.loads((imported / "config.json").read_text())["num_attention_heads"]
    broken = {k: (_permute(v, heads) if "q_proj" in k else v) for k, v in weights.items()}
    for file in imported.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    mx.save_safetensors(str(tmp_path / "model.safetensors"), broken)
    original, tok = mlx_lm.load(str(tiny_model))
    wrong, _ = mlx_lm.load(str(tmp_path))
    ids = mx.array([tok.encode(PROMPT)])
    assert not mx.allclose(original(ids).astype(mx.float32), wrong(ids).astype(mx.float32), atol=1e-2).item()


def test_tokenizer_and_chat_template_come_from_the_gguf_metadata(tiny_model, imported):
    import mlx_lm

    _, original = mlx_lm.load(str(tiny_model))
    _, again = mlx_lm.load(str(imported))
    messages = [{"role": "user", "content": "Hello there, 42 cafés?"}]
    assert again.apply_chat_template(messages, add_generation_prompt=True) == \
        original.apply_chat_template(messages, add_generation_prompt=True)
    assert set(again.eos_token_ids) >= {original.eos_token_id}
    text = "naïve café ☕ <|im_end|> 3.14159"
    assert again.encode(text) == original.encode(text)
    assert again.decode(again.encode(text, add_special_tokens=False)) == text


def test_a2_gguf_estimate_from_the_header_is_what_the_import_writes(gguf_file, imported):
    """SPEC A2 for a .gguf path: sized from its header, without MLX, before importing."""
    assert estimate_weight_bytes(gguf_file) == estimate_weight_bytes(imported)
    header = read_header(gguf_file)
    assert header.metadata["general.architecture"] == "llama"
    assert all(t.type_name == "F32" for t in header.tensors)


@pytest.mark.parametrize(
    "changes, extra, fragment",
    [
        ({"general.architecture": "qwen3moe"}, None, "general.architecture 'qwen3moe'"),
        ({"llama.embedding_length": None}, None, "llama.embedding_length"),
        ({"tokenizer.ggml.model": "llama"}, None, "tokenizer.ggml.model 'llama'"),
        ({"tokenizer.ggml.pre": "martian"}, None, "tokenizer.ggml.pre 'martian'"),
        ({"llama.rope.scaling.type": "yarn"}, None, "llama.rope.scaling.type 'yarn'"),
        ({}, {"blk.0.attn_qkv.weight": "zeros"}, "blk.0.attn_qkv.weight"),
        ({}, {"rope_freqs.weight": "zeros"}, "rope_freqs.weight"),
    ],
)
def test_unsupported_gguf_is_a_clear_error_naming_the_field_or_tensor(tiny_model, tmp_path, changes, extra,
                                                                       fragment):
    import mlx.core as mx

    from modelfiles.gguf_import import import_gguf

    extra = {name: mx.zeros((4, 4)) for name in extra or {}}
    write_gguf(tiny_model, tmp_path / "bad.gguf", metadata_changes=changes, extra_tensors=extra)
    with pytest.raises(GGUFError, match=fragment.replace(".", r"\.")):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_not_a_gguf_and_a_truncated_one_are_clear_errors(gguf_file, tmp_path):
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_header(tmp_path / "text.gguf")
    (tmp_path / "cut.gguf").write_bytes(gguf_file.read_bytes()[:5000])
    with pytest.raises(GGUFError, match="truncated"):
        read_header(tmp_path / "cut.gguf")
    with pytest.raises(WeightsError, match="not found"):
        estimate_weight_bytes(tmp_path / "missing.gguf")


def test_import_gguf_command_streams_progress_and_refuses_bad_input(gguf_file, tmp_path):
    out = subprocess.run([sys.executable, "-m", "supervisor", "import-gguf", str(gguf_file), str(tmp_path / "m"),
                          "--json"], cwd=REPO, capture_output=True, check=True)
    lines = [decode_import_line(raw) for raw in out.stdout.splitlines()]
    assert all(line is not None for line in lines)
    phases = [line.phase for line in lines if isinstance(line, ImportProgress)]
    assert {"convert", "write"} <= set(phases)
    assert type(lines[-1]).__name__ == "ImportDone" and (tmp_path / "m" / "config.json").is_file()
    again = subprocess.run([sys.executable, "-m", "supervisor", "import-gguf", str(gguf_file),
                            str(tmp_path / "m")], cwd=REPO, capture_output=True, text=True, check=False)
    assert again.returncode == 2 and "--force" in again.stderr
    (tmp_path / "x.gguf").write_text("nope")
    bad = subprocess.run([sys.executable, "-m", "supervisor", "import-gguf", str(tmp_path / "x.gguf"),
                          str(tmp_path / "n")], cwd=REPO, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "not a GGUF file" in bad.stderr and "Traceback" not in bad.stderr


def test_decode_import_line_never_raises():
    assert decode_import_line(b"not json") is None
    assert decode_import_line(b'{"type": "progress", "phase": "dance"}') is None
    assert decode_import_line(b'{"type":"note","text":"hi"}').text == "hi"


def test_gguf_cache_is_keyed_on_the_file_and_reused(gguf_file, tmp_path):
    import asyncio

    from supervisor.models.gguf_import_cache import cache_folder, ensure_imported

    copy = tmp_path / "tiny.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    lines: list = []
    folder = asyncio.run(ensure_imported(copy, lines.append, root=tmp_path / "cache"))
    assert folder == cache_folder(copy, tmp_path / "cache") and (folder / "config.json").is_file()
    assert any(isinstance(line, ImportProgress) for line in lines)
    lines.clear()
    assert asyncio.run(ensure_imported(copy, lines.append, root=tmp_path / "cache")) == folder
    assert lines == []  # reused: no second import
    os.utime(copy, ns=(0, 10**9))  # the file changed: a new key, imported afresh
    assert cache_folder(copy, tmp_path / "cache") != folder


def test_config_accepts_a_gguf_model_path():
    from supervisor.config_file import parse_config

    config = parse_config(b'[[models]]\nid = "smol"\npath = "~/models/SmolLM2.Q4_1.gguf"\n')
    assert config.models[0].path.endswith(".gguf")


def test_requantize_quantizes_the_float_matrices_and_the_estimate_follows(tiny_model, gguf_file, tmp_path):
    """`--requantize 8`: every matrix not kept quantized becomes MLX 8-bit affine; the output barely moves."""
    import mlx.core as mx
    import mlx_lm
    from mlx import nn

    from modelfiles.gguf_import import import_gguf

    notes: list = []
    done = import_gguf(gguf_file, tmp_path / "q8", notes.append, requantize=8)
    model, tokenizer = mlx_lm.load(str(tmp_path / "q8"))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.model.layers[0].self_attn.q_proj.bits == 8
    assert done.requantized_tensors > 0 and done.bytes_written == read_header(gguf_file).imported_bytes(8)
    assert estimate_weight_bytes(tmp_path / "q8") == done.bytes_written < estimate_weight_bytes(gguf_file)
    original, _ = mlx_lm.load(str(tiny_model))
    ids = mx.array([tokenizer.encode(PROMPT)])
    a, b = original(ids).astype(mx.float32), model(ids).astype(mx.float32)
    agree = (mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)).astype(mx.float32).mean().item()
    assert agree >= 0.9, agree


def test_qwen2_gguf_keeps_its_rows_and_computes_as_the_original(tiny_model, tmp_path):
    """qwen2 files are not permuted by llama.cpp: imported as they are, with zero biases
    the model computes exactly what the original llama does."""
    import mlx.core as mx
    import mlx_lm

    from modelfiles.gguf_import import import_gguf

    write_gguf(tiny_model, tmp_path / "q.gguf", arch="qwen2")
    import_gguf(tmp_path / "q.gguf", tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen2"
    original, tokenizer = mlx_lm.load(str(tiny_model))
    again, _ = mlx_lm.load(str(tmp_path / "q"))
    ids = mx.array([tokenizer.encode(PROMPT)])
    assert mx.allclose(original(ids).astype(mx.float32), again(ids).astype(mx.float32), atol=1e-2).item()


def test_llama3_rope_freqs_become_the_rope_scaling_mlx_lm_computes_the_same_from(tmp_path):
    """Llama 3.1+ files carry llama.cpp's per-frequency divisors; the recovered parameters make
    mlx_lm's Llama3RoPE use exactly those frequencies."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import initialize_rope

    from modelfiles.gguf_import import llama3_factors, llama3_rope_scaling

    base, head_dim = 500000.0, 64
    for factor, original in ((8.0, 8192), (32.0, 8192)):
        written = llama3_factors(base, head_dim, factor, 1.0, 4.0, original).astype("float32")
        scaling = llama3_rope_scaling(written, base, head_dim)
        assert scaling == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        rope = initialize_rope(head_dim, base, False, scaling, 131072)
        plain = base ** (mx.arange(0, head_dim, 2) / head_dim)
        assert mx.allclose(rope._freqs, plain * mx.array(written), rtol=1e-4).item()
    with pytest.raises(GGUFError, match="rope_freqs.weight"):
        llama3_rope_scaling([1.0] * 31 + [3.7], base, head_dim)


def test_a_gguf_with_rope_freqs_imports_with_llama3_rope_scaling(tiny_model, tmp_path):
    import mlx.core as mx
    import mlx_lm

    from modelfiles.gguf_import import import_gguf, llama3_factors

    config = json.loads((tiny_model / "config.json").read_text())
    factors = llama3_factors(config["rope_theta"], config["head_dim"], 8.0, 1.0, 4.0, 8192)
    write_gguf(tiny_model, tmp_path / "r.gguf", extra_tensors={"rope_freqs.weight": mx.array(factors.astype("float32"))})
    done = import_gguf(tmp_path / "r.gguf", tmp_path / "r")
    assert json.loads((tmp_path / "r" / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert done.bytes_written == estimate_weight_bytes(tmp_path / "r.gguf")
    model, tokenizer = mlx_lm.load(str(tmp_path / "r"))
    assert isinstance(mlx_lm.generate(model, tokenizer, "Once", max_tokens=2), str)


def test_a2_estimate_of_a_gguf_path_under_home_expands_the_tilde(gguf_file, tmp_path, monkeypatch):
    """`path = "~/models/x.gguf"` in the config is sized (and imported) like any other path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.gguf").write_bytes(gguf_file.read_bytes())
    assert estimate_weight_bytes("~/x.gguf") == estimate_weight_bytes(gguf_file)


def test_a_large_import_is_written_in_shards_that_mlx_lm_loads(tiny_model, gguf_file, tmp_path, monkeypatch):
    """One shard in memory at a time; the folder holds model-0000i-of-0000n files mlx_lm reads."""
    import mlx.core as mx
    import mlx_lm

    from modelfiles import gguf_import

    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 1024 * 1024)
    done = gguf_import.import_gguf(gguf_file, tmp_path / "s")
    shards = sorted(p.name for p in (tmp_path / "s").glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert estimate_weight_bytes(tmp_path / "s") == done.bytes_written == estimate_weight_bytes(gguf_file)
    original, tokenizer = mlx_lm.load(str(tiny_model))
    again, _ = mlx_lm.load(str(tmp_path / "s"))
    ids = mx.array([tokenizer.encode(PROMPT)])
    assert mx.allclose(original(ids).astype(mx.float32), again(ids).astype(mx.float32), atol=1e-2).item()
