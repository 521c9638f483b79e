"""Reliability's pure parts: refusals that say when to retry (or that retrying
will not help), a model's context read without MLX, JSON nesting."""

from __future__ import annotations

import json

import pytest

from shared.modelinfo import context_length
from supervisor.doors.refusals import LoadError
from supervisor.http.errors import from_serve_error
from supervisor.http.openai_types import BodyError, ChatRequest, decode_body, json_depth_exceeds


def test_a_permanent_503_carries_no_retry_after_and_a_failed_model_says_when():
    permanent = from_serve_error(LoadError("the files are broken", http_status=503, permanent=True))
    assert permanent.status == 503 and "Retry-After" not in permanent.headers
    failed = from_serve_error(LoadError("marked failed; next try in 40 s", code="model_failed", http_status=503,
                                        retry_after=40))
    assert failed.headers["Retry-After"] == "40"
    passing = from_serve_error(LoadError("the worker exited", code="worker_exited", http_status=503))
    assert passing.headers["Retry-After"] == "2"


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 4096}, 4096),
    ({"n_positions": 1024}, 1024),
    ({"text_config": {"max_position_embeddings": 8192}}, 8192),
    ({"max_position_embeddings": True}, None),
    ({"max_position_embeddings": -5}, None),
    ({}, None),
    ([1, 2], None),
])
def test_context_length_is_read_from_config_json(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert context_length(tmp_path) == expected


def test_context_length_of_a_folder_without_config_is_unknown(tmp_path):
    assert context_length(tmp_path) is None
    (tmp_path / "config.json").write_bytes(b"\xff not json")
    assert context_length(tmp_path) is None


def test_json_nesting_is_bounded_and_strings_do_not_count():
    assert json_depth_exceeds(b"[" * 65 + b"]" * 65)
    assert not json_depth_exceeds(b"[" * 64 + b"]" * 64)
    assert not json_depth_exceeds(json.dumps({"a": "[" * 5000}).encode())
    assert not json_depth_exceeds(json.dumps({"a": '\\"' + "{" * 5000}).encode())
    with pytest.raises(BodyError, match="deeper than 64 levels"):
        decode_body(b'{"model": "m", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}", ChatRequest)
