"""The Ollama request fields mapped to the worker's Generate, and the model
facts behind /api/tags and /api/show, without a server."""

from __future__ import annotations

import sys

import msgspec
import pytest

from shared import protocol as p
from supervisor.http import ollama, ollama_models
from supervisor.http.errors import ApiError
from supervisor.http.modelfacts import capabilities, digest, parameter_size, read_facts
from supervisor.http.openai_types import DEFAULT_CHAT_MAX_TOKENS, BodyError, decode_body


def chat(**body) -> p.Generate:
    body.setdefault("model", "a")
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return ollama.chat_generate(decode_body(msgspec.json.encode(body), ollama.OllamaChatRequest)).gen


def test_ollama_options_map_to_sampling():
    gen = chat(options={"temperature": 0, "top_p": 0.5, "num_predict": 7, "stop": ["\n"], "seed": 3,
                        "num_ctx": 4096, "num_thread": 8, "num_gpu": 99})
    assert (gen.temperature, gen.top_p, gen.max_tokens, gen.stop, gen.seed) == (0.0, 0.5, 7, ["\n"], 3)
    assert chat(options={"num_predict": -1}).max_tokens == DEFAULT_CHAT_MAX_TOKENS


def test_ollama_sampling_options_map_to_the_same_generate_fields():
    gen = chat(options={"top_k": 5, "min_p": 0.1, "repeat_penalty": 1.3, "presence_penalty": 0.5,
                        "frequency_penalty": -0.25, "repeat_last_n": 16}, logprobs=True, top_logprobs=4)
    assert (gen.top_k, gen.min_p, gen.repetition_penalty, gen.presence_penalty, gen.frequency_penalty) == (
        5, 0.1, 1.3, 0.5, -0.25)
    assert gen.repetition_context_size == gen.presence_context_size == gen.frequency_context_size == 16
    assert (gen.logprobs, gen.top_logprobs) == (True, 4)
    plain = chat()  # Ollama's defaults: top_k 40, the penalties off, no logprobs
    assert (plain.top_k, plain.repetition_penalty, plain.presence_penalty, plain.logprobs) == (40, 1.0, 0.0, False)
    assert chat(options={"repeat_last_n": -1}).repetition_context_size >= 1 << 30  # -1: the whole context
    assert chat(options={"top_k": 0}).top_k == chat(options={"top_k": -1}).top_k == 0  # off, as in Ollama


@pytest.mark.parametrize("option", [{"mirostat": 1}, {"typical_p": 0.5}, {"tfs_z": 0.9}, {"num_keep": 4},
                                    {"temperature": 3}, {"num_predict": 0}, {"seed": 2**64}, {"stop": [""]},
                                    {"top_k": "x"}, {"min_p": 1.5}, {"repeat_penalty": 0}, {"repeat_last_n": -2},
                                    {"presence_penalty": 3}, {"frequency_penalty": "high"}])
def test_ollama_option_we_cannot_honour_is_a_400_naming_it(option):
    with pytest.raises(BodyError) as err:
        chat(options=option)
    assert err.value.param == f"options.{next(iter(option))}"


def test_ollama_format_maps_to_constrained_decoding():
    assert isinstance(chat(format="json").constraint, p.JsonObject)
    schema = chat(format={"type": "object", "properties": {"x": {"type": "integer"}}}).constraint
    assert isinstance(schema, p.JsonSchema) and msgspec.json.decode(schema.schema)["type"] == "object"
    with pytest.raises(BodyError):
        chat(format="yaml")


def test_ollama_keep_alive_uses_the_strict_parser():
    req = decode_body(b'{"model": "a", "keep_alive": "inf"}', ollama.OllamaChatRequest)
    with pytest.raises(BodyError):
        ollama.keep_alive_seconds(req.keep_alive, None)


def test_ollama_tool_turns_answer_their_calls_by_made_up_ids():
    gen = chat(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"c": "x"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "w"}],
        tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}])
    assistant, tool = gen.messages[1], gen.messages[2]
    [call] = msgspec.json.decode(assistant.tool_calls)
    assert call["function"] == {"name": "w", "arguments": {"c": "x"}}
    assert tool.role == "tool" and tool.tool_call_id == call["id"]
    assert gen.tools and gen.constraint is None  # Ollama's tools are always "auto"


@pytest.mark.parametrize("body, param", [({"suffix": "x", "system": "s"}, "system"),
                                         ({"template": "{{ .Prompt }}"}, "template"),
                                         ({"context": [1, 2]}, "context"), ({"think": True}, "think"),
                                         ({"images": ["aGk="]}, "images"), ({"width": 64}, "width")])
def test_ollama_generate_refuses_what_it_cannot_honour(body, param):
    req = decode_body(msgspec.json.encode({"model": "a", "prompt": "Hi", **body}), ollama.OllamaGenerateRequest)
    with pytest.raises(BodyError) as err:
        ollama.generate_generate(req)
    assert err.value.param == param


def test_ollama_generate_raw_skips_the_template():
    req = decode_body(b'{"model": "a", "prompt": "Hi", "raw": true}', ollama.OllamaGenerateRequest)
    gen = ollama.generate_generate(req).gen
    assert gen.prompt == "Hi" and gen.messages is None
    req = decode_body(b'{"model": "a", "prompt": "Hi", "system": "S"}', ollama.OllamaGenerateRequest)
    assert [m.role for m in ollama.generate_generate(req).gen.messages] == ["system", "user"]


def test_ollama_error_shape_keeps_status_retry_after_and_figures():
    exc = ApiError(507, "does not fit", code="model_too_large", retry_after=None,
                   extra={"binding": "ceiling", "estimated_bytes": 5})
    reply = ollama.error_response(exc)
    body = msgspec.json.decode(reply.body)
    assert reply.status_code == 507 and body["error"] == "does not fit" and body["binding"] == "ceiling"
    busy = ollama.error_response(ApiError(503, "pressure", retry_after=2))
    assert busy.status_code == 503 and busy.headers["retry-after"] == "2"


def test_model_facts_from_config_and_tokenizer_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 32768, '
                                          '"quantization": {"bits": 4, "group_size": 64}}')
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{% if tools %}x{% endif %}", '
        '"added_tokens_decoder": {"1": {"content": "<|fim_prefix|>"}, "2": {"content": "<|fim_suffix|>"}, '
        '"3": {"content": "<|fim_middle|>"}}}')
    facts = read_facts(str(tmp_path))
    assert (facts.family, facts.context_length, facts.quantization_level) == ("qwen2", 32768, "Q4")
    assert capabilities(facts) == ["completion", "tools", "insert"]
    assert parameter_size(500_000_000, facts) == "1B"  # no weights here: estimated from the bytes and bits
    assert facts.modified == (tmp_path / "config.json").stat().st_mtime
    assert ollama_models.modified_at(facts).endswith("Z")
    bare = read_facts(str(tmp_path / "missing"))
    assert capabilities(bare) == ["completion"] and bare.context_length is None
    assert read_facts(str(tmp_path / "m.gguf")).format == "gguf"


def test_digest_is_stable_per_id_and_path():
    assert digest("a", "/m") == digest("a", "/m") != digest("a", "/n")


def test_ollama_store_routes_say_there_is_no_store():
    exc = ollama_models.no_hub("/api/push")
    assert exc.status == 501 and "push" in exc.message and "models_dirs" in exc.message and "/api/pull" in exc.message
    assert "upload blobs" in ollama_models.no_hub("/api/blobs/sha256:abc").message


def test_ollama_sdk_request_fields_are_all_declared():
    """Every field the official client can send is declared (honoured or refused by name),
    so no SDK call meets a bare 'unknown field'."""
    from ollama import _types as sdk

    for theirs, ours in ((sdk.ChatRequest, ollama.OllamaChatRequest), (sdk.GenerateRequest, ollama.OllamaGenerateRequest),
                         (sdk.Message, ollama.OllamaMessage), (sdk.ShowRequest, ollama_models.ShowRequest)):
        assert set(theirs.model_fields) <= set(ours.__struct_fields__), theirs.__name__


def test_ollama_calls_come_back_with_object_arguments():
    from supervisor.http import tools

    [out] = ollama._calls_out([tools.Call(id="call_1", name="w", arguments='{"c": "x"}')])
    assert out == {"id": "call_1", "function": {"index": 0, "name": "w", "arguments": {"c": "x"}}}


def _llama_parameters(config: dict) -> int:
    """A llama's parameter count from its dimensions (tied embeddings), worked out apart from
    the weight files, to check the count read from their headers."""
    h, inter, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "vocab_size"))
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    return vocab * h + layers * per_layer + h


def test_ollama_parameter_size_and_quantization_come_from_the_weights(tiny_model, quantized):
    """Before: parameter_size was guessed from A2's estimate and quantization_level empty
    without a torch_dtype; a 4-bit model's packed words are counted unpacked, its scales and
    biases not at all."""
    import json

    for folder, level in ((tiny_model, "F16"), (quantized[4], "Q4"), (quantized[8], "Q8")):
        config = json.loads((folder / "config.json").read_text())
        facts = read_facts(str(folder))
        assert facts.parameters == _llama_parameters(config), folder
        assert (facts.family, facts.quantization_level) == ("llama", level)
        assert facts.file_bytes == sum(f.stat().st_size for f in folder.glob("model*.safetensors"))


def test_ollama_parameter_size_is_written_as_ollama_writes_it():
    from supervisor.http.modelfacts import ModelFacts, human_number

    assert [human_number(n) for n in (134_515_008, 135_000_000, 1_711_376_384, 8_000_000_000, 12_345, 999)] == [
        "134.52M", "135M", "1.7B", "8B", "12K", "999"]
    assert parameter_size(0, ModelFacts(parameters=1_711_376_384)) == "1.7B"
    assert parameter_size(0, ModelFacts()) == ""


def test_ollama_quantization_of_a_gguf_is_its_llama_cpp_file_type(tmp_path):
    from tests import model_files

    facts = read_facts(str(model_files.gguf(tmp_path / "m.gguf")))
    assert (facts.family, facts.parameters, facts.quantization_level) == ("llama", 4, "F32")
    assert facts.file_bytes == (tmp_path / "m.gguf").stat().st_size


def test_ollama_size_is_the_weight_files_not_the_workers_memory(tiny_model):
    """Before: `size` was the worker's usage, which grew from 222 MB to 631 MB in one session for
    a 98 MB model; Ollama gives the model's fixed size."""
    from supervisor.policy.status import ModelInfo

    facts = read_facts(str(tiny_model))
    info = ModelInfo(id="a", path=str(tiny_model), pinned=False, state="ready", usage=631_000_000,
                     estimated_bytes=2_000_000)
    assert ollama_models.size_of(info, facts) == facts.file_bytes
    assert facts.file_bytes == (tiny_model / "model.safetensors").stat().st_size


def test_ollama_size_vram_is_zero_on_the_cpu_and_the_device_share_on_a_gpu():
    from supervisor.policy.snapshot import Snapshot, WorkerRecord

    cpu = Snapshot(now=0.0, workers=[WorkerRecord(worker="a#1", model="a")])
    gpu = Snapshot(now=0.0, device_total=80 << 30, workers=[WorkerRecord(worker="a#1", model="a",
                                                                         device_bytes=900)])
    if sys.platform == "darwin":  # unified memory: the whole model is the GPU's
        assert ollama_models.size_vram(1000, "a#1", cpu) == 1000
        return
    assert ollama_models.size_vram(1000, "a#1", cpu) == 0
    assert ollama_models.size_vram(1000, "a#1", None) == 0
    assert ollama_models.size_vram(1000, "a#1", gpu) == 900
    assert ollama_models.size_vram(500, "a#1", gpu) == 500  # the KV on the device is not the model's size


def test_ollama_never_expires_as_ollama_says_it_for_keep_alive_minus_one():
    """Go's longest duration from now, as Ollama's `ps` gives for keep_alive -1 (its CLI shows
    "Forever"), not the year 9999."""
    assert 292 * 365 * 86400 < ollama_models.FOREVER.total_seconds() < 293 * 365 * 86400
