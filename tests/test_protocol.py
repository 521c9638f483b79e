"""The wire protocol: one codec per direction, bad frames are reported, never raised."""

from typing import get_args

import msgspec
import pytest

from shared import protocol as p
from shared import vocab
from shared.limits import Limits
from shared.memory import MemoryReading


@pytest.mark.parametrize(
    "union, msg",
    [
        (p.CommandMsg, p.SetLimits(cmd=7, limits=Limits(hard_limit=9, tier="safe"))),
        (p.CommandMsg, p.Generate(cmd=1, request_id="r", messages=[p.ChatMessage(role="user", content="hi")])),
        (p.WorkerReply, p.Hello(worker_id="w1", model_id="m", pid=3, device_info={"device_name": "cpu"})),
        (p.WorkerReply, p.Prompted(request_id="r", prompt_tokens=12, cached_tokens=8)),  # before the first token
        (p.CommandMsg, p.Generate(request_id="r", prompt="x", top_k=5, min_p=0.1, repetition_penalty=1.2,
                                  presence_penalty=-0.5, frequency_context_size=8, logit_bias={3: -100.0, 9: 2.5},
                                  logprobs=True, top_logprobs=4)),
        (p.WorkerReply, p.TokenOut(request_id="r", text="a", token_id=7, logprobs=p.TokenLogprobs(
            token="a", logprob=-0.25, top=[p.TopLogprob(token="a", logprob=-0.25), p.TopLogprob(token="b", logprob=-2.0)]))),
        (p.WorkerReply, p.TokenBatch(request_ids=["r", "s"], texts=["a", "b"], token_ids=[1, 2],
                                     logprobs=[None, p.TokenLogprobs(token="b", logprob=-1.0)])),
        (p.WorkerReply, p.Failed(request_id="r", code="prefill_memory_exceeded", message="x",
                                 estimated_bytes=5, limit_bytes=4, binding="static")),
        (p.WorkerReport, p.Sample(worker_id="w", model_id="m", pid=1, seq=2, t=0.5, memory=MemoryReading(usage=4, footprint=4, mlx_active=1, mlx_pool=2,
                                                                          mlx_peak=3))),
        (p.Published, p.GuardEvent(t=1.0, kind="evict", reason="soft pressure")),
        (p.ControlRequest, p.GuardUpdate(tier="safe")),
        (p.ControlReply, p.ControlError(code="not_found", message="no model x", http_status=404)),
    ],
)
def test_every_direction_round_trips(union, msg):
    codec = p.Codec(union)
    assert codec.decode(codec.encode(msg)) == msg


def test_wrong_protocol_version_is_refused_with_reason():
    codec = p.Codec(p.CommandMsg)
    bad = msgspec.msgpack.encode({"type": "ping", "v": 99, "seq": 1, "cmd": 0})
    got = codec.decode(bad)
    assert isinstance(got, p.Malformed) and got.wrong_version
    assert "v99" in got.reason
    # another version whose layout no longer fits this side's struct
    got = codec.decode(msgspec.msgpack.encode({"type": "ping", "v": 2, "seq": "new-style"}))
    assert isinstance(got, p.Malformed) and got.wrong_version


@pytest.mark.parametrize(
    "frame, cause, fragment",
    [
        (b"\xc1garbage", "undecodable", "undecodable"),
        (msgspec.msgpack.encode({"type": "ping", "seq": "x"}), "invalid_message", "invalid ping"),
        (msgspec.msgpack.encode({"type": "unknown-kind"}), "invalid_message", "invalid unknown-kind"),
        (msgspec.msgpack.encode([1, 2, 3]), "undecodable", "undecodable"),
        (b"", "undecodable", "undecodable"),
        # a message whose own words mimic another cause's: the cause comes from the decoder, not the words
        (msgspec.msgpack.encode({"type": "frame of 1 bytes exceeds"}), "invalid_message", "invalid frame of"),
    ],
)
def test_malformed_frames_are_explained_not_raised(frame, cause, fragment):
    got = p.Codec(p.CommandMsg).decode(frame)
    assert isinstance(got, p.Malformed) and not got.wrong_version
    assert got.cause == cause and fragment in got.reason


def test_oversized_frame_is_refused_before_decoding():
    got = p.Codec(p.CommandMsg).decode(b"\x00" * (p.MAX_FRAME_BYTES + 1))
    assert isinstance(got, p.Malformed) and got.cause == "too_large" and "exceeds" in got.reason


def test_a_message_of_the_wrong_direction_is_malformed():
    """A worker cannot send a command to the supervisor, nor a client a sample."""
    codec = p.Codec(p.WorkerReply)
    got = codec.decode(p.Codec(p.CommandMsg).encode(p.Ping(seq=1)))
    assert isinstance(got, p.Malformed)


def test_every_message_type_has_a_json_schema_and_a_version_field():
    for name, union in p.all_message_types().items():
        schema = msgspec.json.schema(union)
        for struct_name, definition in schema["$defs"].items():
            if "type" in definition.get("properties", {}):
                assert "v" in definition["properties"], (name, struct_name)


def test_every_published_message_has_a_topic():
    assert set(p.TOPIC_OF.values()) == set(p.TOPICS)


def test_the_schema_names_prompted_among_the_worker_replies():
    """`python -m supervisor schema` documents the worker's early prompt count."""
    defs = msgspec.json.schema(p.all_message_types()["WorkerReply"])["$defs"]
    assert defs["Prompted"]["properties"]["type"] == {"enum": ["prompted"]}


def test_the_schema_describes_logprobs_and_the_sampling_fields():
    """The token messages' logprobs and Generate's sampling settings are in the schema."""
    replies = msgspec.json.schema(p.all_message_types()["WorkerReply"])["$defs"]
    assert "logprobs" in replies["TokenOut"]["properties"] and "logprobs" in replies["TokenBatch"]["properties"]
    assert replies["TokenLogprobs"]["type"] == "array"  # compact: [token, logprob, top]
    generate = msgspec.json.schema(p.all_message_types()["Command"])["$defs"]["Generate"]["properties"]
    for name in ("top_k", "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty",
                 "frequency_penalty", "logit_bias", "logprobs", "top_logprobs"):
        assert name in generate, name


# -- closed vocabularies (shared/vocab.py) --------------------------------------------------
# The words are the wire's: subscribers, routers and dashboards match on them, so each
# vocabulary is pinned here word for word. Adding a word is a decision (add it here too);
# renaming or dropping one breaks clients and must fail this file.

PINNED_WORDS = {
    "PressureLevel": ("ok", "soft", "hard"),
    "PoolName": ("host", "device"),
    "Tier": ("safe", "balanced", "aggressive", "custom"),
    "HostBinding": ("", "static", "dynamic", "gpu_cap"),
    "LimitBinding": ("", "static", "dynamic", "gpu_cap", "device"),
    "DeviceBinding": ("", "device_static", "device_others"),
    "WorkerEventKind": ("drill", "wired_limit"),
    "GuardEventKind": (
        "drill", "wired_limit", "spawn", "loaded", "load_failed", "exit", "crash", "wedged", "respawn", "unload",
        "import", "refused", "failed", "retry", "level", "admission", "warning", "reclaim", "shrink_cache", "abort",
        "abort_load", "mark_for_unload", "evict", "ttl", "guard", "reload", "reload_refused", "model_added",
        "model_changed", "model_removed", "stall", "disk_cache", "wired_stranded", "spare", "load_progress",
        "load_phases", "thrash", "prefetch"),
    "LoadPhase": ("admit", "spawn", "hello", "spare", "build", "read", "tokenizer", "warm_up", "first_token"),
    "FinishReason": ("stop", "length"),
    "SampleReason": ("tick", "watermark", "shrink"),
    "FailureCode": (
        "invalid_request", "invalid_constraint", "context_length_exceeded", "prefill_memory_exceeded",
        "wrong_model_kind", "fim_unsupported", "invalid_image", "model_lacks_vision", "aborted", "memory_pressure",
        "model_unloading", "worker_exited", "client_disconnected",
        "engine_error", "load_failed"),
    "RefusalCode": ("model_too_large", "insufficient_memory"),
}


@pytest.mark.parametrize("name", sorted(PINNED_WORDS))
def test_each_vocabulary_holds_exactly_its_pinned_words(name):
    assert get_args(getattr(vocab, name)) == PINNED_WORDS[name]


def test_the_ledger_encodes_tiers_and_bindings_by_their_vocabulary_order():
    """The limits block stores a tier and a binding as an index: the order is the layout."""
    assert vocab.TIERS == PINNED_WORDS["Tier"]
    assert vocab.LIMIT_BINDINGS == PINNED_WORDS["LimitBinding"]


@pytest.mark.parametrize(
    "union, fields, field, word",
    [
        (p.Published, {"type": "event", "t": 1.0, "reason": "x"}, "kind", "stop"),  # nothing emits "stop"
        (p.WorkerReply, {"type": "failed", "request_id": "r", "message": "x"}, "code", "oom"),
        (p.WorkerReply, {"type": "finished", "request_id": "r", "prompt_tokens": 1, "completion_tokens": 1},
         "finish_reason", "eos"),
        (p.WorkerReport, {"type": "worker_event", "worker_id": "w", "message": "x"}, "kind", "crash"),
        (p.CommandMsg, {"type": "abort"}, "code", "because"),
        (p.ControlReply, {"type": "error", "message": "x"}, "code", "nope"),
    ],
)
def test_a_word_outside_its_vocabulary_is_malformed_at_the_edge(union, fields, field, word):
    """msgspec checks the Literal when the frame is decoded: the peer's frame is refused, named, counted."""
    codec = p.Codec(union)
    got = codec.decode(msgspec.msgpack.encode({**fields, field: word}))
    assert isinstance(got, p.Malformed) and not got.wrong_version
    assert field in got.reason


@pytest.mark.parametrize("struct, field, vocabulary", [
    ("GuardEvent", "kind", "GuardEventKind"),
    ("Failed", "code", "FailureCode"),
    ("Failed", "binding", "LimitBinding"),
    ("Finished", "finish_reason", "FinishReason"),
    ("CeilingMsg", "tier", "Tier"),
    ("CeilingMsg", "binding", "HostBinding"),
    ("PressureMsg", "level", "PressureLevel"),
    ("Sample", "why", "SampleReason"),
    ("DevicePool", "binding", "DeviceBinding"),
    ("WorkerEvent", "kind", "WorkerEventKind"),
])
def test_the_schema_lists_each_vocabulary_as_an_enum(struct, field, vocabulary):
    """`python -m supervisor schema` tells a client every word it may receive."""
    from supervisor.cli.schema import _unions

    _, defs = msgspec.json.schema_components(list(_unions().values()))
    assert sorted(defs[struct]["properties"][field]["enum"]) == sorted(PINNED_WORDS[vocabulary])


def test_every_error_code_a_door_may_answer_is_one_word_of_the_vocabulary():
    """The codes of worker failures and refused loads are among the API's error codes, once each."""
    assert len(set(vocab.ERROR_CODES)) == len(vocab.ERROR_CODES)
    assert set(PINNED_WORDS["FailureCode"]) | set(PINNED_WORDS["RefusalCode"]) <= set(vocab.ERROR_CODES)
