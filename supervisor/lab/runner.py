"""The lab's harness: one real supervisor per scenario, real workers, a record.

Each scenario gets a fresh in-process Arbiter (the supervisor's loop, with
its pool, bus, ledger and enforcer) in a private runtime directory; workers
are real processes that load generated models with MLX. The guard runs on
the custom tier, and each scenario sets its ceiling from the usage it
measures once its models are loaded, so the same scenario means the same
thing on any machine.

Public names (stable): Check, ModelSpec, Scenario, ScenarioResult, Lab, run_scenarios.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from shared import protocol as p
from shared.sizes import MiB, format_size
from supervisor.arbiter import Arbiter
from supervisor.config import Config, GuardConfig, ModelConfig, SupervisorConfig
from supervisor.lab.timeline import Recorder, Timeline
from supervisor.workers.streams import RequestStream

log = logging.getLogger("memvisor.lab")


class Check(msgspec.Struct, frozen=True):
    name: str
    passed: bool
    detail: str = ""


class ScenarioResult(msgspec.Struct):
    name: str
    rules: str
    passed: bool
    seconds: float
    checks: list[Check]
    figures: dict[str, float] = {}
    png: str = ""
    error: str = ""
    timeline: Timeline | None = None


@dataclass(frozen=True)
class ModelSpec:
    id: str
    size_mib: int = 16
    seed: int = 0
    pinned: bool = False
    ttl: float | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    rules: str
    summary: str
    models: tuple[ModelSpec, ...]
    run: Callable[[Lab], Awaitable[None]]
    pool_max: int = 2 * 1024**3
    restart_max: int = 3
    soft_threshold: float | None = None  # T5 overrides; None: the custom tier's 0.90 / 0.97
    hard_threshold: float | None = None
    # Environment for the scenario's workers (spawned processes inherit it).
    worker_env: tuple[tuple[str, str], ...] = ()
    hot_cache_max: int = 0  # H2's budget ([guard] hot_cache_max); 0: no prompt cache
    thrash_hold: float = 2.0  # W5 ([guard] thrash_hold); 0: loads admitted as before W5
    max_concurrency: int = 1  # each model's (the thrash scenario batches its requests)


@dataclass
class Lab:
    """What a scenario works with: the supervisor, the record, its checks."""

    arb: Arbiter
    rec: Recorder
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    async def load(self, model_id: str):
        handle = await self.arb.models.load(model_id)
        self.rec.note("load", model_id)
        return handle

    async def usage(self, settle: float = 0.3) -> int:
        """Group usage once the latest samples are in (a fresh guard tick)."""
        await asyncio.sleep(settle)
        self.arb.enforcer.tick(time.monotonic())
        assert self.arb.enforcer.last is not None
        return self.arb.enforcer.last.usage

    def level(self) -> str:
        last = self.arb.enforcer.last
        return last.level if last is not None else "ok"

    def last_usage(self) -> int:
        last = self.arb.enforcer.last
        return last.usage if last is not None else 0

    def model_path(self, model_id: str) -> str:
        model = self.arb.config.model(model_id)
        if model is None:
            raise KeyError(model_id)
        return model.path

    def worker_usage(self, model_id: str) -> int:
        h = self.arb.pool.worker_for(model_id)
        s = self.arb.ledger.read_sample(h.slot) if h is not None else None
        return s.memory.usage if s is not None else 0

    def set_ceiling(self, ceiling: int, why: str = "") -> None:
        self.rec.note("ceiling", "", why or f"custom ceiling {ceiling // MiB} MiB")
        self.arb.service.update_guard(p.GuardUpdate(tier="custom", custom_ceiling=int(ceiling)))

    def drill(self, model_id: str, rate: int, to: int) -> None:
        """A fire drill in the model's worker (real MLX allocations), marked on the timeline."""
        self.arb.service.start_drill(p.DrillRequest(model=model_id, rate=rate, to=to))
        self.rec.note("drill", model_id, f"{format_size(rate)}/s")

    async def generate(self, model_id: str, prompt: str, max_tokens: int) -> RequestStream:
        stream = await self.arb.service.generate(model_id, p.Generate(request_id="", prompt=prompt, max_tokens=max_tokens))
        self.rec.note("request", model_id)
        return stream

    async def busy(self, model_id: str, timeout: float = 20.0) -> RequestStream:
        """A long generation, running once this returns."""
        stream = await self.generate(model_id, "tell me a long story about the sea", LAB_MAX_TOKENS)
        handle = self.arb.pool.handles[stream.worker_id]
        await self.until(lambda: handle.sample is not None and handle.sample.running > 0, timeout,
                         f"{model_id} running")
        return stream

    async def until(self, predicate: Callable[[], bool], timeout: float, what: str = "") -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            self.arb.wake()
            await asyncio.sleep(0.02)
        log.info("lab: timed out waiting for %s", what or predicate)
        return predicate()

    @staticmethod
    async def end(stream: RequestStream, timeout: float = 30.0) -> object:
        """The stream's terminal message (Finished or Failed); None on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(stream.queue.get(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return None
            if isinstance(msg, (p.Finished, p.Failed)):
                return msg
        return None


def make_models(root: Path, scenarios: list[Scenario]) -> dict[tuple[int, int], Path]:
    """Generated models, one per (size, seed), cached under `root` between runs.

    Each is made in a child process: training a tokenizer in a process where
    a supervisor has run (its ZeroMQ context being torn down) was seen to hang."""
    paths: dict[tuple[int, int], Path] = {}
    for sc in scenarios:
        for m in sc.models:
            key = (m.size_mib, m.seed)
            path = root / f"lab-{m.size_mib}mib-s{m.seed}"
            if key not in paths and not (path / "config.json").exists():
                subprocess.run([sys.executable, "-c", "import sys; from modelfiles.modelgen import make_model; "
                                "make_model(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))",
                                str(path), str(m.size_mib * MiB), str(m.seed)], check=True, timeout=600)
            _long_context(path)
            paths[key] = path
    return paths


LAB_CONTEXT = 1 << 20  # tokens: the lab's prompts outgrow memory long before a context
LAB_MAX_TOKENS = 100_000  # a "busy" generation that outlasts any scenario


def _long_context(path: Path) -> None:
    """The generated models claim 4,096 tokens of context; the lab's long prompts
    (G1) and long generations (busy models) must meet the memory guard first."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = LAB_CONTEXT
    config_file.write_text(json.dumps(config))


def config_for(sc: Scenario, paths: dict[tuple[int, int], Path]) -> Config:
    models = [ModelConfig(id=m.id, path=str(paths[(m.size_mib, m.seed)]), pinned=m.pinned, ttl=m.ttl,
                          max_concurrency=sc.max_concurrency) for m in sc.models]
    return Config(
        # No disk tier (H5): the lab's throwaway models must leave nothing in the user's cache
        # folder, and a stop's write would stretch the stop times its scenarios measure.
        guard=GuardConfig(tier="custom", custom_ceiling=0, pool_max=sc.pool_max, hot_cache_max=sc.hot_cache_max,
                          soft_threshold=sc.soft_threshold, hard_threshold=sc.hard_threshold, disk_cache_max=0,
                          thrash_hold=sc.thrash_hold),
        # A worker's loop answers heartbeats between prefill chunks; on a busy
        # 2-core CI machine one CPU chunk can take seconds.
        # No spare worker (W1): the scenarios measure the guard on their own models' memory.
        supervisor=SupervisorConfig(heartbeat_interval=0.5, heartbeat_timeout=60.0, allow_drills=True,
                                    max_tokens=LAB_MAX_TOKENS,
                                    restart_max=sc.restart_max, restart_period=60.0, spare_workers=0),
        models=models,
    )


async def run_one(sc: Scenario, paths: dict[tuple[int, int], Path], out: Path | None,
                  keep_timeline: bool = True) -> ScenarioResult:
    runtime = Path(tempfile.mkdtemp(prefix="mvlab-"))
    saved = {key: os.environ.get(key) for key, _ in sc.worker_env}
    os.environ.update(dict(sc.worker_env))
    arb = Arbiter(config_for(sc, paths), runtime, max_workers=8, http=False)
    started = time.monotonic()
    task = asyncio.get_running_loop().create_task(arb.run())
    while not arb.running and not task.done():
        await asyncio.sleep(0.01)
    rec = Recorder(arb, sc.name)
    rec.start()
    lab = Lab(arb, rec)
    error = ""
    try:
        await asyncio.wait_for(sc.run(lab), 90)
    except Exception as exc:  # a scenario that breaks is a failed verdict, not a crashed lab
        log.exception("scenario %s failed", sc.name)
        error = f"{type(exc).__name__}: {exc}"
    await asyncio.sleep(0.4)  # the record shows the exits the last decisions caused
    timeline = await rec.stop()
    for t in lab.tasks:
        t.cancel()
    arb.stop()
    try:
        await asyncio.wait_for(task, 30)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    passed = not error and bool(lab.checks) and all(c.passed for c in lab.checks)
    result = ScenarioResult(name=sc.name, rules=sc.rules, passed=passed, seconds=time.monotonic() - started,
                            checks=lab.checks, figures=lab.figures, error=error,
                            timeline=timeline if keep_timeline else None)
    if out is not None:
        from supervisor.lab.plot import draw

        verdict = "PASS" if passed else "FAIL"
        png = draw(timeline, out / f"{sc.name}.png", title=f"{sc.name} ({sc.rules}): {verdict} — {sc.summary}")
        result.png = str(png)
        (out / f"{sc.name}.json").write_bytes(msgspec.json.encode(result))
    return result


async def run_scenarios(scenarios: list[Scenario], out: Path | None, models_dir: Path,
                        on_result: Callable[[ScenarioResult], None] | None = None) -> list[ScenarioResult]:
    paths = make_models(models_dir, scenarios)
    results = []
    for sc in scenarios:
        r = await run_one(sc, paths, out)
        if on_result is not None:
            on_result(r)
        results.append(r)
    return results
