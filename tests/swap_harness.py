"""Two real models, an Arbiter in the test's loop, a ceiling that holds one of them: what the
W tests (thrash, prefetch) share. No tests here."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared import protocol as p
from shared.sizes import MiB
from supervisor.arbiter import Arbiter
from supervisor.config import Config, GuardConfig, ModelConfig, SupervisorConfig
from supervisor.doors.refusals import ServeError

SIZE = 48 * MiB  # float32 weights: MLX computes float16 slowly on a CPU, and a request must stay short
SOFT, HARD = 0.97, 0.99  # the ceiling is sized in MiB above one model's usage


def make_pair(root: Path) -> dict[str, Path]:
    """Models `a` and `b`, 48 MiB of float32 weights each (other seeds, same shapes)."""
    from modelfiles.modelgen import make_model

    paths = {}
    for seed, name in ((31, "a"), (32, "b")):
        paths[name] = root / name
        make_model(paths[name], SIZE, seed, dtype="float32")
    return paths


def pair_config(paths: dict[str, Path], *, pinned: tuple[str, ...] = (), **guard: object) -> Config:
    """Custom tier, no prompt cache and no disk tier (a stop writes nothing, a sample moves little)."""
    settings: dict[str, object] = {"tier": "custom", "soft_threshold": SOFT, "hard_threshold": HARD,
                                   "hot_cache_max": 0, "disk_cache_max": 0, **guard}
    return Config(
        guard=GuardConfig(**settings),  # type: ignore[arg-type]
        supervisor=SupervisorConfig(heartbeat_interval=0.5, heartbeat_timeout=60.0, stop_grace=5.0),
        models=[ModelConfig(id=m, path=str(path), pinned=m in pinned) for m, path in paths.items()],
    )


async def usage(arb: Arbiter, settle: float = 0.5) -> int:
    await asyncio.sleep(settle)
    arb.enforcer.tick(time.monotonic())
    assert arb.enforcer.last is not None
    return arb.enforcer.last.usage


async def ceiling_for_one(arb: Arbiter, loaded: str = "a") -> int:
    """With `loaded` loaded: a custom ceiling whose soft target holds it but not a second model.

    The margin above the usage measured now is 3/4 of a model: the supervisor here is the test's
    own process, whose footprint grows as the test runs, and a worker's limits must leave its
    prompts room to prefill (G1)."""
    await arb.models.load(loaded)
    ceiling = int((await usage(arb) + SIZE * 3 // 4) / SOFT)
    set_ceiling(arb, ceiling)
    return ceiling


@dataclass
class Answer:
    model: str
    asked: float       # time.time() when sent (GuardEvent.t is wall time too)
    answered: float
    worker: str        # the worker that served it ("" when refused before reaching one)
    outcome: str       # "ok", or the failure's code


async def ask(arb: Arbiter, model: str, max_tokens: int = 4) -> Answer:
    asked = time.time()
    try:
        stream = await arb.service.generate(model, p.Generate(request_id="", prompt="the sea is",
                                                              max_tokens=max_tokens))
    except ServeError as exc:
        return Answer(model, asked, time.time(), "", exc.code)
    while True:
        msg = await asyncio.wait_for(stream.queue.get(), 120)
        if isinstance(msg, (p.Finished, p.Failed)):
            outcome = "ok" if isinstance(msg, p.Finished) else msg.code
            return Answer(model, asked, time.time(), stream.worker_id, outcome)


@dataclass
class Lane:
    """Requests for one model, back to back, until stopped."""

    model: str
    answers: list[Answer] = field(default_factory=list)
    stopped: bool = False

    async def run(self, arb: Arbiter) -> None:
        while not self.stopped:
            self.answers.append(await ask(arb, self.model))


def events(arb: Arbiter, kind: str, model: str | None = None) -> list[p.GuardEvent]:
    return [e for e in arb.events if e.kind == kind and (model is None or e.model_id == model)]


def set_ceiling(arb: Arbiter, ceiling: int) -> None:
    arb.service.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=int(ceiling)))


def worker_usage(arb: Arbiter, model: str) -> int:
    handle = arb.pool.worker_for(model)
    sample = arb.ledger.read_sample(handle.slot) if handle is not None else None
    return sample.memory.usage if sample is not None else 0


async def until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)
