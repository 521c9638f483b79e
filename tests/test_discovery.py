"""Discovery and aliases, without processes: what a models folder
and a Hugging Face cache tree turn into, and how aliases are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.config import Config, ModelConfig, SupervisorConfig
from supervisor.config_file import ConfigError, parse_config
from supervisor.models.discovery import discover, with_discovered
from tests import model_files


def _fake_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    model_files.safetensors(folder / "model.safetensors")
    return folder


def _fake_hf_repo(cache: Path, org: str, name: str, revisions: list[str], main: str | None) -> Path:
    repo = cache / f"models--{org}--{name}"
    for rev in revisions:
        _fake_model(repo / "snapshots" / rev)
    if main is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(main + "\n")
    return repo


def test_models_folder_ids_come_from_folder_and_file_names(tmp_path):
    _fake_model(tmp_path / "llama-small")
    _fake_model(tmp_path / "nested" / "coder")
    model_files.gguf(tmp_path / "SmolLM2.Q4_1.gguf")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "readme.txt").write_text("hi")
    found, warnings = discover([str(tmp_path)], known=set())
    assert {f.id: Path(f.path).name for f in found} == {
        "llama-small": "llama-small", "coder": "coder", "SmolLM2.Q4_1": "SmolLM2.Q4_1.gguf"}
    assert warnings == []


def test_hugging_face_cache_layout_becomes_org_slash_name_at_refs_main(tmp_path):
    _fake_hf_repo(tmp_path, "mlx-community", "Qwen3-4B-4bit", ["aaa", "bbb"], main="aaa")
    _fake_hf_repo(tmp_path, "someone", "no-ref", ["only"], main=None)
    found, _ = discover([str(tmp_path)], known=set())
    paths = {f.id: f.path for f in found}
    assert set(paths) == {"mlx-community/Qwen3-4B-4bit", "someone/no-ref"}
    assert paths["mlx-community/Qwen3-4B-4bit"].endswith("snapshots/aaa")
    assert paths["someone/no-ref"].endswith("snapshots/only")


def test_config_entries_win_over_discovered_ones_and_their_aliases_too(tmp_path):
    _fake_model(tmp_path / "assistant")
    _fake_model(tmp_path / "gpt-4o-mini")
    _fake_model(tmp_path / "extra")
    config = Config(supervisor=SupervisorConfig(models_dirs=[str(tmp_path)]),
                    models=[ModelConfig(id="assistant", path="/elsewhere", aliases=["gpt-4o-mini"])])
    merged, warnings = with_discovered(config)
    assert [(m.id, m.path) for m in merged.models] == [
        ("assistant", "/elsewhere"), ("extra", str(tmp_path / "extra"))]
    assert merged.model("gpt-4o-mini").id == "assistant"
    assert warnings == []


def test_a_missing_models_folder_is_a_warning_not_a_crash(tmp_path):
    found, warnings = discover([str(tmp_path / "nope")], known=set())
    assert found == [] and "does not exist" in warnings[0]


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[[models]]\nid="a"\npath="/x"\naliases=["g"]\n[[models]]\nid="b"\npath="/y"\naliases=["g"]',
         "models[1].aliases[0]: alias 'g' of model 'b' collides with an alias of models[0] ('a')"),
        ('[[models]]\nid="a"\npath="/x"\n[[models]]\nid="b"\npath="/y"\naliases=["a"]',
         "models[1].aliases[0]: alias 'a' of model 'b' collides with the id of models[0]"),
        ('[[models]]\nid="a"\npath="/x"\naliases=["a"]', "models[0].aliases[0]: alias 'a' repeats the model's own id"),
    ],
)
def test_alias_collisions_are_config_errors_naming_both(toml, message):
    with pytest.raises(ConfigError) as err:
        parse_config(toml)
    assert message in str(err.value)


def test_alias_resolves_to_its_model():
    config = parse_config('[[models]]\nid="coder"\npath="/x"\naliases=["gpt-4o-mini", "codex"]')
    assert config.model("codex").id == "coder" and config.model("coder").id == "coder"
    assert config.model("nope") is None
