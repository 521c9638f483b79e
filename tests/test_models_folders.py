"""Models folders (`serve --models-dir`, `[supervisor] models_dirs`): a folder that is not
there stops a start (tests/test_serve_errors.py) and refuses a reload, the running config
kept; a model file is listed once whichever way it is named."""

from __future__ import annotations

import json

import httpx

from supervisor.config import Config, ModelConfig, SupervisorConfig
from supervisor.models.discovery import with_discovered
from tests import model_files
from tests.chat_harness import Serving, run_cli


def _served(serving: Serving) -> list[str]:
    return sorted(m["name"] for m in httpx.get(serving.url + "/api/tags").json()["models"])


def test_a_reload_naming_a_missing_models_folder_is_refused_and_the_running_config_stays(tmp_path):
    """Before: the reload went through with a warning and served none of the folder's models."""
    folder = tmp_path / "models"
    folder.mkdir()
    model_files.gguf(folder / "one.gguf")
    toml = f'[supervisor]\nhttp = "127.0.0.1:0"\nmodels_dirs = ["{folder}"]\n'
    with Serving(toml, tmp_path / "serve") as serving:
        assert _served(serving) == ["one"]
        (serving.folder / "memvisor.toml").write_text(toml.replace(str(folder), str(tmp_path / "modles")))
        out = run_cli(serving, "reload")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "configuration refused" in out.stderr and "supervisor.models_dirs[0]" in out.stderr
        assert f"{tmp_path / 'modles'}: no such folder" in out.stderr
        assert _served(serving) == ["one"]
        status = json.loads(run_cli(serving, "status", "--json").stdout)
        assert status["events"][-1]["kind"] == "reload_refused"


def test_a_model_file_that_is_both_an_entry_and_in_a_models_folder_is_listed_once(tmp_path):
    """The [[models]] entry wins: its id, its settings; the folder does not add the file again
    under its file name (before: listed twice, `mine` and `SmolLM2.Q4_1`)."""
    folder = tmp_path / "models"
    folder.mkdir()
    gguf = model_files.gguf(folder / "SmolLM2.Q4_1.gguf")
    model_files.gguf(folder / "other.gguf")
    entry = ModelConfig(id="mine", path=str(tmp_path / "models" / ".." / "models" / gguf.name), pinned=True)
    config, _warnings = with_discovered(Config(supervisor=SupervisorConfig(models_dirs=[str(folder)]),
                                               models=[entry]))
    assert sorted(m.id for m in config.models) == ["mine", "other"]
    assert config.model("mine").pinned


def test_a_model_folder_named_through_a_link_is_listed_once(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    real = folder / "llama-small"
    real.mkdir()
    (real / "config.json").write_text('{"model_type": "llama"}')
    model_files.safetensors(real / "model.safetensors")
    link = tmp_path / "elsewhere"
    link.symlink_to(real)
    config, _warnings = with_discovered(Config(supervisor=SupervisorConfig(models_dirs=[str(folder)]),
                                               models=[ModelConfig(id="small", path=str(link))]))
    assert [m.id for m in config.models] == ["small"]
