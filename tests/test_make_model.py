"""The local model generator (docs/models.md: `scripts/make_model.py DIR [--size] [--seed]`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelfiles.modelgen import ModelGenError, choose_dims, make_model, smallest_weight_bytes
from shared.sizes import MiB, parse_size
from shared.weights import WeightsError, estimate_weight_bytes

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_model.py"


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_model_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_model_loads_with_mlx_lm_and_generates(tiny_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model))
    text = mlx_lm.generate(model, tokenizer, "Once upon a time", max_tokens=8)
    assert isinstance(text, str)
    assert tokenizer.eos_token_ids  # </s> and <|im_end|> both end a generation
    assert len(tokenizer.eos_token_ids) == 2


def test_generated_model_has_chat_template_that_marks_roles(tiny_model):
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(tiny_model))
    messages = [{"role": "user", "content": "Hello there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_text_through_streaming_detokenizer(tiny_model):
    """mlx_lm picks its fast byte-level BPE detokenizer only for a ByteLevel decoder."""
    import mlx_lm
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    _, tokenizer = mlx_lm.load(str(tiny_model))
    detok = tokenizer.detokenizer
    assert isinstance(detok, BPEStreamingDetokenizer)
    text = "Memory guard: 42 models, naïve café ☕."
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text


def test_same_seed_gives_same_bytes_other_seed_differs(tmp_path):
    make_model(tmp_path / "x", 1 * MiB, 7)
    make_model(tmp_path / "y", 1 * MiB, 7)
    make_model(tmp_path / "z", 1 * MiB, 8)
    names = sorted(os.listdir(tmp_path / "x"))
    assert names == sorted(os.listdir(tmp_path / "y"))
    for name in names:
        assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes(), name
    weights = "model.safetensors"
    assert (tmp_path / "x" / weights).read_bytes() != (tmp_path / "z" / weights).read_bytes()


@pytest.mark.parametrize("size", ["1MiB", "3MiB", "16MiB", "200MB", "1GiB", "8GiB"])
def test_dims_rule_lands_within_20_percent_of_asked_size(size):
    asked = parse_size(size)
    dims = choose_dims(asked, 4096)
    assert 0.8 * asked <= dims.weight_bytes <= 1.2 * asked
    assert dims.hidden_size % 64 == 0
    assert dims.num_attention_heads % dims.num_key_value_heads == 0


def test_written_weights_are_the_asked_size_and_what_mlx_loads(tiny_models):
    """SPEC A2 sizes a model from its files before loading: the estimate must be what MLX holds."""
    import mlx_lm
    from mlx.utils import tree_flatten

    for path in (tiny_models.a, tiny_models.small):
        estimate = estimate_weight_bytes(path)
        model, _ = mlx_lm.load(str(path))
        loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        assert estimate == loaded
    asked = tiny_models.size_bytes
    assert 0.8 * asked <= estimate_weight_bytes(tiny_models.a) <= 1.2 * asked


def test_progress_reports_every_weight_byte_in_order(tmp_path):
    seen: list[tuple[int, int]] = []
    dims = make_model(tmp_path / "m", 1 * MiB, 0, lambda done, total: seen.append((done, total)))
    assert seen, "no progress reported"
    assert all(total == dims.weight_bytes for _, total in seen)
    dones = [done for done, _ in seen]
    assert dones == sorted(dones)
    assert dones[-1] == dims.weight_bytes


def test_too_small_size_is_a_clear_error(tmp_path):
    with pytest.raises(ModelGenError, match="too small"):
        make_model(tmp_path / "m", smallest_weight_bytes(4096) - 1, 0)
    assert not (tmp_path / "m").exists()


def test_non_empty_dir_refused_unless_forced(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ModelGenError, match="not empty"):
        make_model(target, 1 * MiB, 0)
    make_model(target, 1 * MiB, 0, force=True)
    assert (target / "notes.txt").read_text() == "mine"
    assert estimate_weight_bytes(target) > 0
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == [], "staging directory left behind"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--size", "12 parsecs"], "unknown unit"),
        (["--size", "lots"], "not a size"),
        (["--size", "10KiB"], "too small"),
        (["--seed", "-1"], "seed must be"),
    ],
)
def test_cli_bad_arguments_give_one_line_errors(tmp_path, capsys, argv, fragment):
    script = _load_script()
    code = script.main([str(tmp_path / "m"), "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err


def test_cli_refuses_a_file_as_target(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert _load_script().main([str(target), "--quiet"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_script_runs_from_a_checkout_as_documented(tmp_path):
    """docs/models.md documents `python scripts/make_model.py DIR ...` run from the checkout."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "m"), "--size", "1MiB", "--seed", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "llama"


def test_weights_estimate_errors_name_the_problem(tmp_path):
    with pytest.raises(WeightsError, match="not found"):
        estimate_weight_bytes(tmp_path / "missing")
    with pytest.raises(WeightsError, match="no model"):
        estimate_weight_bytes(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json!!!!")
    with pytest.raises(WeightsError, match="unreadable"):
        estimate_weight_bytes(tmp_path)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_dtype_loads_with_that_dtype_and_size(tmp_path, dtype):
    import mlx_lm
    from mlx.utils import tree_flatten

    dims = make_model(tmp_path / dtype, 2 * MiB, 0, dtype=dtype)
    model, _ = mlx_lm.load(str(tmp_path / dtype))
    params = tree_flatten(model.parameters())
    assert {str(v.dtype) for _, v in params} == {f"mlx.core.{dtype}"}
    assert sum(v.nbytes for _, v in params) == dims.weight_bytes
    assert 0.8 * 2 * MiB <= dims.weight_bytes <= 1.2 * 2 * MiB


def test_bfloat16_weights_are_the_float32_draws_rounded(tmp_path):
    """Our own bfloat16 encoder (numpy has none) must round, not garble."""
    import mlx.core as mx

    from modelfiles.modelgen import Dims, write_weights

    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                num_attention_heads=1, num_key_value_heads=1)
    write_weights(tmp_path / "f32.safetensors", Dims(**base, dtype="float32"), 5)
    write_weights(tmp_path / "bf16.safetensors", Dims(**base, dtype="bfloat16"), 5)
    exact = mx.load(str(tmp_path / "f32.safetensors"))
    rounded = mx.load(str(tmp_path / "bf16.safetensors"))
    for name, value in exact.items():
        assert rounded[name].dtype == mx.bfloat16
        assert mx.allclose(rounded[name].astype(mx.float32), value, rtol=2**-8, atol=0).item(), name


def test_unknown_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(ModelGenError, match="unknown dtype"):
        make_model(tmp_path / "m", 1 * MiB, 0, dtype="int4")
