"""llama.cpp's /infill body as the worker's FIM generation (supervisor/http/infill.py): what
goes before the cursor and after it, the settings' bounds, the reply's stop_type. The route
through a real worker is tests/live/test_api_fim_live.py."""

from __future__ import annotations

import msgspec
import pytest

from shared import protocol as p
from supervisor.http.infill import InfillRequest, _final, infill_generate
from supervisor.http.job import End
from supervisor.http.openai_types import DEFAULT_COMPLETION_MAX_TOKENS, BodyError, decode_body


def _req(**body) -> InfillRequest:
    return decode_body(msgspec.json.encode(body), InfillRequest)


def test_infill_puts_extra_files_prefix_and_the_cursor_line_before_and_the_suffix_after():
    gen = infill_generate(_req(input_extra=[{"filename": "a.py", "text": "A\n"}, {"filename": "b.py", "text": "B\n"}],
                               input_prefix="def f():\n", prompt="    ret", input_suffix="\nf()\n"))
    assert gen.prompt == "A\nB\ndef f():\n    ret" and gen.suffix == "\nf()\n"


def test_infill_with_nothing_after_the_cursor_is_still_fill_in_the_middle():
    assert infill_generate(_req(input_prefix="x = ")).suffix == ""


def test_infill_settings_map_to_the_generation_and_n_predict_minus_one_is_the_default():
    gen = infill_generate(_req(n_predict=7, temperature=0.2, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.25, seed=3, stop=["\n\n"]))
    assert (gen.max_tokens, gen.temperature, gen.top_k, gen.top_p, gen.min_p) == (7, 0.2, 40, 0.9, 0.05)
    assert (gen.repetition_penalty, gen.presence_penalty, gen.frequency_penalty) == (1.1, 0.5, 0.25)
    assert gen.seed == 3 and gen.stop == ["\n\n"]
    assert infill_generate(_req(n_predict=-1)).max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert infill_generate(_req()).max_tokens == DEFAULT_COMPLETION_MAX_TOKENS


def test_infill_accepts_llama_cpp_plugin_knobs_and_refuses_any_other_unknown_field():
    _req(samplers=["top_k"], cache_prompt=True, t_max_prompt_ms=500, t_max_predict_ms=1000, n_indent=4,
         response_fields=["content"], id_slot=0)
    with pytest.raises(BodyError) as err:
        _req(n_probs=3)
    assert err.value.param == "n_probs"


@pytest.mark.parametrize("body, param", [
    ({"input_extra": [{}]}, "input_extra[0]"),
    ({"input_extra": [{"filename": "ok"}]}, "input_extra[0]"),
    ({"input_extra": [{"filename": 123, "text": "abc"}]}, "input_extra[0].filename"),
    ({"input_extra": [{"filename": "a", "text": 456}]}, "input_extra[0].text"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"input_prefix": 5}, "input_prefix"),
])
def test_infill_body_errors_name_the_field(body, param):
    with pytest.raises(BodyError) as err:
        _req(**body)
    assert err.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"n_predict": 0}, "n_predict"), ({"n_predict": -2}, "n_predict"), ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"), ({"seed": 2**64}, "seed"),
])
def test_infill_values_out_of_range_are_refused_naming_the_field(body, param):
    with pytest.raises(BodyError) as err:
        infill_generate(_req(**body))
    assert err.value.param == param


@pytest.mark.parametrize("reason, word, stop_type", [("stop", "", "eos"), ("stop", "\n\n", "word"),
                                                     ("length", "", "limit")])
def test_infill_reply_says_why_it_stopped_as_llama_cpp_does(reason, word, stop_type):
    fin = p.Finished(request_id="r", finish_reason=reason, prompt_tokens=9, completion_tokens=4, cached_tokens=2,
                     stop_sequence=word)
    reply = _final("fim", End(fin, reason))
    assert (reply.stop, reply.stop_type, reply.stopping_word) == (True, stop_type, word)
    assert (reply.tokens_evaluated, reply.tokens_predicted, reply.tokens_cached) == (9, 4, 2)
