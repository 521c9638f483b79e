"""The lab's swap scenarios (SPEC W): two models that fit one at a time, a client that alternates.

Kept beside `scenarios.py` (which lists them all in SCENARIOS) so neither module outgrows a read.

Public names (stable): thrash.
"""

from __future__ import annotations

import asyncio

from shared import protocol as p
from shared.sizes import MiB
from supervisor.doors.refusals import ServeError
from supervisor.lab.runner import Lab

REQUESTS, CALLERS, TOKENS = 24, 4, 4
SOFT = 0.97  # the scenario's soft threshold (SCENARIOS gives it)


async def _ask(lab: Lab, model: str) -> tuple[float, str]:
    """(when it was answered, on the record's clock; "ok" or the failure's code)."""
    try:
        stream = await lab.arb.service.generate(model, p.Generate(request_id="", prompt="the sea is",
                                                                  max_tokens=TOKENS))
    except ServeError as exc:
        return lab.rec.now(), exc.code
    end = await lab.end(stream, 120)
    return lab.rec.now(), "ok" if isinstance(end, p.Finished) else getattr(end, "code", "timeout")


async def _alternate(lab: Lab) -> list[tuple[float, str]]:
    """REQUESTS requests alternating a, b, taken from one queue by CALLERS callers, each sending
    its next as soon as its last is answered (an evaluation harness, an agent's parallel calls)."""
    queue = ["ab"[i % 2] for i in range(REQUESTS)]
    answers: list[tuple[float, str]] = []

    async def caller() -> None:
        while queue:
            answers.append(await _ask(lab, queue.pop(0)))

    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return answers


def _per_swap(requests: int, swaps: int) -> float:
    return requests / swaps if swaps else float(requests)


async def thrash(lab: Lab) -> None:
    """24 requests alternating a, b (4 callers) under a ceiling that holds one of them.

    Every request is served: a load waits for the other model's requests instead of stopping
    it under them (or being refused while it is busy). After more than 3 swaps in 60 s the two
    thrash (an event says so), and from then on a load holds for up to 2 s while the loaded
    model serves its queue, new arrivals included: each swap then serves more requests."""
    size = 32 * MiB
    await lab.load("a")
    u = await lab.usage()
    lab.set_ceiling(int((u + size * 3 // 4) / SOFT), "room for one of a, b")
    await asyncio.sleep(0.3)
    began = lab.rec.now()
    answers = await _alternate(lab)
    lab.figures["seconds"] = lab.rec.now() - began
    t = lab.rec.timeline
    found = next((m.t for m in t.events("thrash") if "evicted each other" in m.reason), None)
    swaps = [m.t for m in t.events("evict") if "to make room for" in m.reason]
    split = found if found is not None else float("inf")
    early = sum(1 for when, _ in answers if when <= split)
    before = _per_swap(early, sum(1 for s in swaps if s <= split))
    after = _per_swap(len(answers) - early, sum(1 for s in swaps if s > split))
    lab.figures.update(swaps=len(swaps), requests_per_swap_before=before, requests_per_swap_after=after)
    failed = [code for _, code in answers if code != "ok"]
    lab.check("W5 every request served", len(answers) == REQUESTS and not failed, str(failed))
    lab.check("W5 a thrash event names a and b", found is not None)
    lab.check("W5 loads hold once they thrash", any("holds up to" in m.reason for m in t.events("thrash")))
    lab.check("W5 the hold cuts swaps: more requests per swap after the thrash event", after > before,
              f"{before:.1f} before, {after:.1f} after")
