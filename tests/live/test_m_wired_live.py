"""SPEC M3 (macOS, revised 2026-12-05) through real worker processes on Linux.

No Mac here. The stop escalation runs on real processes with the macOS rule
forced by the pool's switch (`macos_stop_rule`): a worker is never SIGKILLed
first, and SIGKILL comes only the whole `stop_grace` after SIGTERM. The
wired-memory watch runs in a real supervisor against a stand-in for the OS's
wired count (`Kernel`, which keeps or returns an exited worker's memory) and
a worker that claims a Metal device: the re-read comes 5 s after the exit on
a timer, without holding the loop, and what did not come back is an event and
comes off the static ceiling.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from shared import probe
from shared.sizes import GiB, MiB
from shared.states import LOADING_STATES
from supervisor.config import ModelConfig
from supervisor.policy import wired as wired_policy
from supervisor.workers.process import WorkerHandle
from tests.arbiter_harness import Running, make_config
from tests.http_harness import until

pytestmark = pytest.mark.slow

GRACE = 7.0  # over the 5 s after which SIGKILL followed SIGTERM on the code before M3
METAL = {"max_recommended_working_set_size": 48 * GiB, "memory_size": 64 * GiB}  # what a Mac's hello says
BASE = 3 * GiB  # wired by the kernel and other apps


def _share(h: WorkerHandle) -> int:
    s = h.sample
    return probe.gpu_share_of_usage(h.device_info, s.memory.mlx_active, s.memory.mlx_pool) if s else 0


class Kernel:
    """The OS's wired count as a Mac keeps it: its own, our workers' GPU memory, and, when `keeps`,
    what an exited worker held at its last reading (a stranding, oMLX #2184); else that comes back."""

    def __init__(self, pool, keeps: bool) -> None:
        self.pool, self.keeps, self.held = pool, keeps, {}

    def wired(self) -> int:
        live = {h.worker_id: _share(h) for h in self.pool.handles.values()}
        gone = {w: held for w, held in self.held.items() if w not in live and self.keeps}
        self.held = {**live, **gone}
        return BASE + sum(self.held.values())


async def _loop_gaps(stop: asyncio.Event) -> float:
    """The longest the loop went without running this task (it asks every 50 ms)."""
    longest, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.05)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


def test_m3_a_wedged_worker_gets_sigterm_first_and_sigkill_only_after_the_whole_stop_grace(tiny_models, runtime_dir):
    """A SIGSTOPped worker (wedged: it cannot obey SIGTERM) is killed as the heartbeat finds it. On
    the code before, SIGKILL followed SIGTERM after min(stop_grace, 5 s); on macOS a worker that
    may hold a residency set gets the whole grace (a kill can strand its wired memory)."""
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], stop_grace=GRACE)

    async def main():
        async with Running(config, runtime_dir) as arb:
            arb.pool.macos_stop_rule = True
            handle = await arb.models.load("a")
            os.kill(handle.pid, signal.SIGSTOP)
            await until(lambda: handle.exited.done(), timeout=30, what="the wedged worker killed")
            wedged = next(e for e in arb.events if e.kind == "wedged")
            exited = next(e for e in arb.events if e.kind in ("exit", "crash") and e.worker_id == handle.worker_id)
            return handle, exited.t - wedged.t

    handle, took = asyncio.run(main())
    assert handle.signals_sent == [signal.SIGTERM, signal.SIGKILL]
    assert GRACE <= took < GRACE + 5


def test_m3_an_aborted_load_is_stopped_with_sigterm_never_sigkill_first(tiny_models, runtime_dir, monkeypatch):
    """P6.4's aborted load skips the drain (the worker is inside its load) but not SIGTERM."""
    from worker.main import LOAD_DELAY_ENV

    monkeypatch.setenv(LOAD_DELAY_ENV, "30.0")
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))], stop_grace=GRACE)

    async def main():
        async with Running(config, runtime_dir) as arb:
            arb.pool.macos_stop_rule = True
            loading = asyncio.get_running_loop().create_task(arb.models.load("a"))
            await until(lambda: (h := arb.pool.worker_for("a")) is not None and h.state in LOADING_STATES
                        and h.state != "starting", timeout=30, what="the worker loading")
            handle = arb.pool.worker_for("a")
            await arb.pool.kill(handle, "load aborted: memory pressure (test)", cause="load_abort")
            loading.cancel()
            return handle

    handle = asyncio.run(main())
    assert handle.signals_sent == [signal.SIGTERM]  # it obeyed SIGTERM; no SIGKILL at all
    assert handle.exited.result() == 143


@pytest.mark.parametrize("keeps", [True, False])
def test_m3_wired_memory_an_exit_did_not_give_back_is_an_event_and_comes_off_the_ceiling(
        tiny_models, runtime_dir, monkeypatch, keeps):
    monkeypatch.setattr(wired_policy, "STRANDED_NOISE", MiB)  # a tiny CPU model holds a few MiB, not GiB
    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))])

    async def main():
        async with Running(config, runtime_dir) as arb:
            kernel = Kernel(arb.pool, keeps)
            arb.enforcer.read_wired = kernel.wired
            handle = await arb.models.load("a")
            handle.set_device_info(METAL)  # its MLX buffers are GPU memory, as on a Mac
            await until(lambda: _share(handle) > 0 and kernel.held.get(handle.worker_id), what="a wired reading")
            static = arb.enforcer.status().static
            stop = asyncio.Event()
            gaps = asyncio.get_running_loop().create_task(_loop_gaps(stop))
            assert await arb.service.unload("a", admin=True)
            exited = time.time()
            await asyncio.sleep(wired_policy.WIRED_RETURN_SECONDS + 2)
            stop.set()
            events = [e for e in arb.events if e.kind == "wired_stranded"]
            return events, exited, static, arb.enforcer.status(), await gaps

    events, exited, static, status, gap = asyncio.run(main())
    assert gap < 1.0  # the re-read waited on a timer, never on the loop
    if not keeps:
        assert not events and status.wired_stranded == 0 and status.static == static
        return
    [event] = events
    stranded = int(event.reason.split()[0])  # "<bytes> bytes (...) of wired memory did not come back ..."
    assert MiB <= stranded and event.model_id == "a" and "did not come back 5 s after a#" in event.reason
    assert event.t - exited >= wired_policy.WIRED_RETURN_SECONDS - 0.5
    assert status.wired_stranded == stranded and status.static == static - stranded


def test_m2_with_wire_weights_a_kernel_cap_below_the_suggestion_is_said_once(tiny_models, runtime_dir):
    """The C13 line, once in the log and events however many ticks see it, and in status all along."""
    from supervisor.config import GuardConfig

    config = make_config([ModelConfig(id="a", path=str(tiny_models.a))],
                         guard=GuardConfig(hot_cache_max=0, wire_weights=True))

    async def main():
        async with Running(config, runtime_dir) as arb:
            handle = await arb.models.load("a")
            total = arb.enforcer.status().total
            handle.set_device_info({**METAL, "max_recommended_working_set_size": total // 2})
            for _ in range(3):  # three ticks (and their P7 re-checks) see the low cap
                arb.enforcer.tick(time.monotonic())
            return [e for e in arb.events if e.kind == "warning" and "sysctl" in e.reason], arb.enforcer.status()

    said, status = asyncio.run(main())
    assert len(said) == 1 and "sudo sysctl iogpu.wired_limit_mb=" in said[0].reason
    assert status.wire_weights and status.wired_advice == said[0].reason
