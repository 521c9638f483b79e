"""The wire protocol: one codec per direction, bad frames are reported, never raised."""

import msgspec
import pytest

from shared import protocol as p
from shared.limits import Limits
from shared.memory import MemoryReading


@pytest.mark.parametrize(
    "union, msg",
    [
        (p.CommandMsg, p.SetLimits(cmd=7, limits=Limits(hard_limit=9, tier="safe"))),
        (p.CommandMsg, p.Generate(cmd=1, request_id="r", messages=[p.ChatMessage(role="user", content="hi")])),
        (p.WorkerReply, p.Hello(worker_id="w1", model_id="m", pid=3, device_info={"device_name": "cpu"})),
        (p.WorkerReply, p.Prompted(request_id="r", prompt_tokens=12, cached_tokens=8)),  # issue 23
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
    "frame, fragment",
    [
        (b"\xc1garbage", "undecodable"),
        (msgspec.msgpack.encode({"type": "ping", "seq": "x"}), "invalid ping"),
        (msgspec.msgpack.encode({"type": "unknown-kind"}), "invalid unknown-kind"),
        (msgspec.msgpack.encode([1, 2, 3]), "undecodable"),
        (b"", "undecodable"),
    ],
)
def test_malformed_frames_are_explained_not_raised(frame, fragment):
    got = p.Codec(p.CommandMsg).decode(frame)
    assert isinstance(got, p.Malformed) and not got.wrong_version
    assert fragment in got.reason


def test_oversized_frame_is_refused_before_decoding():
    got = p.Codec(p.CommandMsg).decode(b"\x00" * (p.MAX_FRAME_BYTES + 1))
    assert isinstance(got, p.Malformed) and "exceeds" in got.reason


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
    """Issue 23: `python -m supervisor schema` documents the worker's early prompt count."""
    defs = msgspec.json.schema(p.all_message_types()["WorkerReply"])["$defs"]
    assert defs["Prompted"]["properties"]["type"] == {"enum": ["prompted"]}


def test_the_schema_describes_logprobs_and_the_sampling_fields():
    """Issue 23: the token messages' logprobs and Generate's sampling settings are in the schema."""
    replies = msgspec.json.schema(p.all_message_types()["WorkerReply"])["$defs"]
    assert "logprobs" in replies["TokenOut"]["properties"] and "logprobs" in replies["TokenBatch"]["properties"]
    assert replies["TokenLogprobs"]["type"] == "array"  # compact: [token, logprob, top]
    generate = msgspec.json.schema(p.all_message_types()["Command"])["$defs"]["Generate"]["properties"]
    for name in ("top_k", "min_p", "repetition_penalty", "repetition_context_size", "presence_penalty",
                 "frequency_penalty", "logit_bias", "logprobs", "top_logprobs"):
        assert name in generate, name
