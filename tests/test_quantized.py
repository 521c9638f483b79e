"""Quantized MLX models: generated as mlx_lm.convert writes them, sized right before loading,
and costed right by the prefill guard's prior."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modelfiles.modelgen import QUANT_GROUP, choose_dims
from shared.sizes import MiB
from shared.weights import estimate_weight_bytes

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_model_is_written_as_mlx_lm_convert_writes_it(quantized, bits):
    import mlx_lm
    from mlx import nn

    config = json.loads((quantized[bits] / "config.json").read_text())
    assert config["quantization"] == {"group_size": QUANT_GROUP, "bits": bits, "mode": "affine"}
    model, tokenizer = mlx_lm.load(str(quantized[bits]))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear) and layer.mlp.down_proj.bits == bits
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(mlx_lm.generate(model, tokenizer, "Once upon a time", max_tokens=4), str)


@pytest.mark.parametrize("bits", [4, 8])
def test_a2_estimate_of_a_quantized_model_is_what_mlx_holds(quantized, bits):
    """SPEC A2: the size from the safetensors headers equals the loaded parameters' bytes."""
    import mlx_lm
    from mlx.utils import tree_flatten

    model, _ = mlx_lm.load(str(quantized[bits]))
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert estimate_weight_bytes(quantized[bits]) == loaded
    assert 0.8 * 4 * MiB <= loaded <= 1.2 * 4 * MiB


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_dims_land_within_20_percent_and_split_into_groups(bits):
    for asked in (2 * MiB, 64 * MiB, 1024 * MiB):
        dims = choose_dims(asked, 4096, bits=bits)
        assert 0.8 * asked <= dims.weight_bytes <= 1.2 * asked
        assert dims.intermediate_size % QUANT_GROUP == 0 and dims.hidden_size % QUANT_GROUP == 0
    # packed weights hold more parameters in the same bytes
    assert choose_dims(64 * MiB, 4096, bits=bits).param_count > choose_dims(64 * MiB, 4096).param_count


def test_g1_prior_cost_of_a_quantized_model_uses_the_activation_width(quantized):
    """The packed weights are uint32; KV and activations are in the scales' float16."""
    import mlx_lm

    from worker.prefill_cost import prior_cost as _prior_cost

    model, _ = mlx_lm.load(str(quantized[4]))
    args = model.args
    kv = 2 * len(model.layers) * args.num_key_value_heads * args.head_dim * 2
    assert _prior_cost(model, 512).kv_per_token == kv


def test_measured_memory_after_loading_a_quantized_model_matches_the_estimate(quantized):
    """In a fresh process (as a worker is): MLX's active bytes after the load are the estimate."""
    code = (
        "import sys, mlx.core as mx, mlx_lm\n"
        "model = mlx_lm.load(sys.argv[1]); print(mx.get_active_memory())\n"
    )
    for bits in (4, 8):
        out = subprocess.run([sys.executable, "-c", code, str(quantized[bits])], cwd=REPO,
                             capture_output=True, text=True, check=True)
        active = int(out.stdout.split()[-1])
        estimate = estimate_weight_bytes(quantized[bits])
        assert estimate <= active <= estimate * 1.1 + 1 * MiB, (bits, estimate, active)


def test_make_model_cli_quantize_flag(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "make_model.py"), str(tmp_path / "m"),
                          "--size", "2MiB", "--quantize", "4", "--quiet"],
                         capture_output=True, text=True, check=True)
    assert "4-bit affine" in out.stdout
    assert json.loads((tmp_path / "m" / "config.json").read_text())["quantization"]["bits"] == 4
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "make_model.py"), str(tmp_path / "n"),
                          "--quantize", "3"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--quantize" in bad.stderr
