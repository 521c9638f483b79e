"""demo-vision in the built-in demo (supervisor/models/demo.py): `serve` with no config has a vision model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shared.vision_families import is_vision_model
from supervisor.http.modelfacts import capabilities, read_facts
from supervisor.models.demo import DEMO_VISION, demo_config, vision_installed

REPO = Path(__file__).resolve().parent.parent


def test_the_demo_serves_demo_vision_where_mlx_vlm_is_installed(tmp_path):
    assert vision_installed()  # the test extra installs it
    models = {m.id: m for m in demo_config(tmp_path).models}
    assert models[DEMO_VISION].path == str(tmp_path / DEMO_VISION) and not models[DEMO_VISION].pinned


def test_demo_vision_is_written_once_as_a_vision_model_with_its_processor(tmp_path):
    # in a child: training the demo tokenizer here after a live supervisor ran can deadlock (conftest)
    subprocess.run([sys.executable, "-c", "from pathlib import Path; from supervisor.models.demo import ensure_vision_model; "
                    f"ensure_vision_model(Path({str(tmp_path / DEMO_VISION)!r}))"], check=True, cwd=REPO,
                   capture_output=True)
    folder = tmp_path / DEMO_VISION
    assert is_vision_model(folder)
    assert {"config.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json",
            "model.safetensors"} <= {f.name for f in folder.iterdir()}
    assert "vision" in capabilities(read_facts(str(folder)))
    assert 20 * 2**20 < (folder / "model.safetensors").stat().st_size < 40 * 2**20  # tens of MiB
