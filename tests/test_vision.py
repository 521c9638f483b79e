"""The vision engine (worker/vision.py) in this process, on a tiny real SmolVLM (CPU): mlx-vlm's own
output, images in the decode batch, the prompt cache keyed on the images' content (H1), and G1 for
an image whose tower does not fit."""

from __future__ import annotations

from collections import defaultdict

import msgspec
import pytest

from shared.limits import Limits
from shared.protocol import Failed, Finished, Generate, NeedMemory, TokenOut
from shared.sizes import GiB, MiB
from tests.image_harness import checked, image_bytes, image_turn
from worker import vision_cost
from worker.vision import VisionEngine, cache_key, load_parts

OPEN = Limits(max_concurrency=8, cache_cap=64 * MiB)  # guard off, a prompt cache
GUARDED = Limits(soft_limit=9 * GiB, hard_limit=10 * GiB, hard_watermark=int(9.5 * GiB),
                 abort_limit=12 * GiB, abort_margin=0.93, prefill_headroom_safety=0.92,
                 static=12 * GiB, dynamic=10 * GiB, ceiling=10 * GiB, binding="dynamic",
                 min_chunk_tokens=4, max_concurrency=4)


@pytest.fixture(scope="module")
def parts(tiny_vlm):
    return load_parts(tiny_vlm)


def engine_of(parts, **kwargs) -> VisionEngine:
    kwargs.setdefault("own_usage_fn", lambda: 0)
    return VisionEngine.build(parts, **kwargs)


def run(engine: VisionEngine, limits: Limits = OPEN, usage=lambda: 0, steps: int = 3000):
    """Every event by request id, and the steps whose tokens went to more than one request."""
    events: dict[str, list] = defaultdict(list)
    shared_steps = 0
    for _ in range(steps):
        if not engine.has_work:
            return events, shared_steps
        out = engine.step(limits, usage)
        shared_steps += len({ev.request_id for ev in out if isinstance(ev, TokenOut)}) > 1
        for ev in out:
            events[ev.request_id].append(ev)
    raise AssertionError("engine still busy")


def tokens(events) -> list[int]:
    return [ev.token_id for ev in events if isinstance(ev, TokenOut)]


def ask(rid: str, messages, images, max_tokens: int = 12) -> Generate:
    return Generate(request_id=rid, messages=messages, images=[checked(i) for i in images], max_tokens=max_tokens,
                    temperature=0.0)


def test_vision_greedy_output_is_mlx_vlms_own_generate(parts, tiny_vlm):
    """The engine's image path (processor, tower, embeddings into mlx-lm's text model, chunked prefill)
    gives mlx-vlm's in-process `generate` token for token on the same image and prompt."""
    import io

    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    picture = image_bytes(200, 120, seed=3)
    engine = engine_of(parts)
    engine.submit_generate(ask("r", [image_turn("Describe this image.")], [picture], max_tokens=16))
    events, _ = run(engine)
    assert isinstance(events["r"][-1], Finished), events["r"][-1]
    prompt = apply_chat_template(parts.processor, parts.vlm.config, "Describe this image.", num_images=1)
    ref = generate(parts.vlm, parts.processor, prompt, image=[Image.open(io.BytesIO(picture))], max_tokens=16,
                   temperature=0.0, verbose=False)
    assert tokens(events["r"]) == list(ref.token_ids)
    assert events["r"][-1].prompt_tokens == ref.prompt_tokens


def test_vision_image_and_text_requests_decode_in_one_batch_with_their_solo_output(parts):
    """An image request joins the decode batch as a row like a text one, and neither's greedy output
    changes for the company."""
    alone = {}
    for rid in ("image", "text"):
        engine = engine_of(parts)
        engine.submit_generate(_request(rid))
        alone[rid] = tokens(run(engine)[0][rid])
    engine = engine_of(parts)
    engine.submit_generate(_request("image"))
    engine.submit_generate(_request("text"))
    events, shared_steps = run(engine)
    assert {rid: tokens(events[rid]) for rid in alone} == alone
    assert shared_steps >= 8, "the two requests' tokens never came out of one decode step"


def _request(rid: str) -> Generate:
    if rid == "image":
        return ask(rid, [image_turn("What is in it?")], [image_bytes(64, 64, seed=1)], max_tokens=16)
    return Generate(request_id=rid, messages=[_user("Tell me a story about a cat.")], max_tokens=16, temperature=0.0)


def test_h1_a_follow_up_with_the_same_image_reuses_the_prefix_and_skips_the_tower(parts):
    """Turn two repeats turn one's image: its prompt's image tokens come from the cache (keyed on
    the image's hash), the tower does not run again, and the reply is the one a cold engine gives."""
    picture = image_bytes(96, 64, seed=5)
    engine = engine_of(parts)
    first = [image_turn("What is this?")]
    engine.submit_generate(ask("t1", first, [picture]))
    events, _ = run(engine)
    reply = "".join(ev.text for ev in events["t1"] if isinstance(ev, TokenOut))
    follow_up = [*first, _assistant(reply), _user("And the colours?")]
    engine.submit_generate(ask("t2", follow_up, [picture]))
    events, _ = run(engine)
    warm = events["t2"][-1]
    assert isinstance(warm, Finished)
    media_end = _images_end(engine, follow_up, picture)
    assert warm.cached_tokens >= media_end, (warm.cached_tokens, media_end)
    assert engine.vision.runs == 1, "the tower ran again for an image the cache holds"
    cold = engine_of(parts)
    cold.submit_generate(ask("t2", follow_up, [picture]))
    cold_events, _ = run(cold, Limits(max_concurrency=8))  # no prompt cache
    assert cold_events["t2"][-1].cached_tokens == 0
    assert tokens(events["t2"]) == tokens(cold_events["t2"])


def test_h1_another_image_under_the_same_text_is_never_a_hit(parts):
    engine = engine_of(parts)
    turn = [image_turn("What is this?")]
    engine.submit_generate(ask("a", turn, [image_bytes(96, 64, seed=1)]))
    run(engine)
    engine.submit_generate(ask("b", turn, [image_bytes(96, 64, seed=2)]))
    events, _ = run(engine)
    assert events["b"][-1].cached_tokens < _first_image(engine, turn, image_bytes(96, 64, seed=2))
    assert engine.vision.runs == 2


def test_h1_the_cache_key_chains_the_images_in_order():
    """Each image's tokens carry the hash chain up to it: [A, B] shares A's key with [A]; [B, A] shares
    nothing with [A, B]; no key is a token id; without per-image counts every image token carries
    the chain over all images."""
    ids = [1, 2, 9, 9, 3, 9, 9, 4]
    positions = [2, 3, 5, 6]
    ab = cache_key(ids, positions, ["a" * 64, "b" * 64], [2, 2])
    a_only = cache_key(ids[:4], positions[:2], ["a" * 64], [2])
    ba = cache_key(ids, positions, ["b" * 64, "a" * 64], [2, 2])
    assert ab[:4] == a_only and ab[2] == ab[3] != ab[5] == ab[6]
    assert ba[2] != ab[2] and ba[5] != ab[5]
    assert all(k < 0 for k in ab[2:4] + ab[5:7]) and [ab[i] for i in (0, 1, 4, 7)] == [1, 2, 3, 4]
    whole = cache_key(ids, positions, ["a" * 64, "b" * 64], None)
    assert len({whole[i] for i in positions}) == 1 and whole[2] not in (ab[2], ab[5])


def test_g1_an_image_whose_tower_does_not_fit_asks_for_room_then_is_refused_with_the_figures(parts):
    """The usage leaves room for the prompt's text but not for the tower over its tiles: G1 asks the
    supervisor for the shortfall (image included) and, with nothing freed, refuses with the figures."""
    engine = engine_of(parts)
    engine.submit_generate(ask("r", [image_turn("Describe.")], [image_bytes(128, 128, seed=4)]))
    seq = engine.scheduler.queue[0]
    text_only, with_image = _estimates(engine, seq)
    media = seq.media
    assert with_image - text_only >= vision_cost.peak(engine.vision.cost, media.tiles) - text_only
    usage = GUARDED.hard_limit - (text_only + with_image) // 2  # the text fits, the image does not
    first = engine.step(GUARDED, lambda: usage)
    assert [type(ev) for ev in first] == [NeedMemory]
    assert first[0].need_bytes == usage + with_image - GUARDED.hard_limit
    engine.memory_answer("r", evicted=False)
    events, _ = run(engine, GUARDED, lambda: usage)
    end = events["r"][-1]
    assert isinstance(end, Failed) and end.code == "prefill_memory_exceeded"
    assert end.estimated_bytes == usage + with_image and end.limit_bytes == GUARDED.hard_limit
    assert engine.vision.runs == 0


def test_g1_the_same_image_fits_when_the_room_is_there_and_the_tower_runs_once(parts):
    engine = engine_of(parts)
    engine.submit_generate(ask("r", [image_turn("Describe.")], [image_bytes(128, 128, seed=4)]))
    _, with_image = _estimates(engine, engine.scheduler.queue[0])
    usage = int(GUARDED.soft_limit * GUARDED.safe_zone_ratio) - with_image  # below G2's safe zone after it
    events, _ = run(engine, GUARDED, lambda: usage)
    assert isinstance(events["r"][-1], Finished) and engine.vision.runs == 1


def test_images_for_a_text_model_fail_with_model_lacks_vision(loaded):
    from worker.engine import Engine

    engine = Engine(*loaded, own_usage_fn=lambda: 0)
    engine.submit_generate(ask("r", [image_turn("hi")], [image_bytes()]))
    out = engine.step(OPEN, lambda: 0)
    assert [(type(ev), ev.code) for ev in out] == [(Failed, "model_lacks_vision")]


def test_an_image_the_front_door_did_not_check_is_refused(parts):
    engine = engine_of(parts)
    engine.submit_generate(Generate(request_id="r", messages=[image_turn("hi")], temperature=0.0,
                                    images=[msgspec.structs.replace(checked(image_bytes()), digest="")]))
    out = engine.step(OPEN, lambda: 0)
    assert isinstance(out[0], Failed) and out[0].code == "invalid_request" and "not checked" in out[0].message


# -- helpers ------------------------------------------------------------------------------------


def _assistant(text: str):
    return msgspec.structs.replace(image_turn(text, images=0), role="assistant", parts=None)


def _user(text: str):
    return msgspec.structs.replace(image_turn(text, images=0), parts=None)


def _media(engine, messages, picture):
    return engine.media(ask("probe", messages, [picture]))


def _images_end(engine, messages, picture) -> int:
    return _media(engine, messages, picture).images_end


def _first_image(engine, messages, picture) -> int:
    media = _media(engine, messages, picture)
    return next(i for i, k in enumerate(media.key) if k < 0)


def _estimates(engine, seq) -> tuple[int, int]:
    """G1's peak for the queued request without its images counted, and with them (usage 0)."""
    pool = engine.prefill.pool(GUARDED, lambda: 0)
    with_image = engine.prefill.verdict(seq, pool).estimated_bytes
    media, seq.media = seq.media, None
    try:
        text_only = engine.prefill.verdict(seq, pool).estimated_bytes
    finally:
        seq.media = media
    return text_only, with_image


def test_a_request_behind_an_image_prefill_goes_first_and_is_not_held_by_the_tower(parts):
    """An image's prefill (its tower, then its image tokens) is longer than its token count says: the
    tower runs only on a prefill turn nothing else used, so a short request behind it prefills first
    and streams before the tower has run (without that rule the tower ran in the short one's turn)."""
    engine = engine_of(parts)
    engine.submit_generate(ask("image", [image_turn("What is in it?")], [image_bytes(128, 128, seed=1)], 4))
    engine.submit_generate(_request("text"))
    towers_before_first = None
    for _ in range(200):
        out = engine.step(OPEN, lambda: 0)
        if any(isinstance(ev, TokenOut) and ev.request_id == "text" for ev in out):
            towers_before_first = engine.vision.runs
            break
    assert towers_before_first == 0
    events, _ = run(engine)
    assert isinstance(events["image"][-1], Finished)
    baseline = engine_of(parts)
    baseline.submit("prompt", list(range(5, 5 + len(engine.media(ask("p", [image_turn("What is in it?")],
                                                                     [image_bytes(128, 128, seed=1)])).ids))), 4)
    baseline.submit_generate(_request("text"))
    steps = next(i for i in range(200) if any(isinstance(ev, TokenOut) and ev.request_id == "text"
                                              for ev in baseline.step(Limits(max_concurrency=8), lambda: 0)))
    assert steps >= 2  # behind text, it waits for at least the other prompt's chunk


def test_h1_the_same_image_under_another_api_keys_partition_is_never_a_hit(parts):
    """The image's hash keys its tokens within the request's prompt-cache partition (one per API key):
    another key sending the same image and text prefills it all, tower included."""
    engine = engine_of(parts)
    turn = [image_turn("What is this?")]
    picture = image_bytes(96, 64, seed=8)
    for rid, partition in (("a1", "a" * 32), ("a2", "a" * 32), ("b1", "b" * 32)):
        engine.submit_generate(msgspec.structs.replace(ask(rid, turn, [picture]), partition=partition))
        events, _ = run(engine)
        assert isinstance(events[rid][-1], Finished)
        cached = events[rid][-1].cached_tokens
        assert (cached > 0) == (rid == "a2"), (rid, cached)
    assert engine.vision.runs == 2
