"""Worker -> supervisor on the report socket (PUSH -> PULL): `WorkerReport`.

What a worker says without being asked: its memory samples, events, the heartbeat
thread's proof of life and the prompt cache's tiers' figures.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from shared.memory import MemoryReading
from shared.messages.envelope import Msg
from shared.vocab import LoadPhase, SampleReason, WorkerEventKind

__all__ = [
    "Sample", "WorkerEvent", "Alive", "DiskCacheCounters", "COUNTER_NAMES", "DiskCacheStats", "CacheReport",
    "WorkerReport",
]


class Sample(Msg, tag="sample", kw_only=True):
    """One memory reading of a worker (SPEC U1, H2) with its load; also published as `sample`.

    `memory` is the very struct the worker wrote into its ledger slot.
    """

    worker_id: str
    model_id: str
    pid: int
    seq: int
    t: float  # time.monotonic() in the worker: shared clock on Linux and macOS
    memory: MemoryReading
    running: int = 0
    queued: int = 0
    tokens: int = 0
    why: SampleReason = "tick"


class WorkerEvent(Msg, tag="worker_event", kw_only=True):
    worker_id: str
    kind: WorkerEventKind
    message: str


# -- liveness from the worker's heartbeat thread ----------------------------
class Alive(Msg, tag="alive", kw_only=True):
    """Pushed by a worker's heartbeat thread (its own socket) every fraction
    of the heartbeat timeout, also while the step loop is inside one long
    engine step (MLX computes with the GIL released). The supervisor decides:
    a worker inside a step is alive until `step_timeout`; a worker whose loop
    is stuck outside a step, or that sends nothing (SIGSTOP), is wedged."""

    worker_id: str
    pid: int
    step_seconds: float  # how long the current engine step has run; 0 between steps
    loop_seconds: float  # since the step loop last passed a step boundary
    steps: int           # step boundaries passed so far (progress)
    tokens: int = 0      # tokens generated so far (progress)
    # W6: while the worker loads its model, the phase it is in and the bytes of weights read so
    # far ("" and 0 once loaded, and on a platform that cannot count its own reads)
    load_phase: Union[LoadPhase, Literal[""]] = ""
    bytes_read: int = 0


# -- the prompt cache's tiers (H5, H6; docs/rules.md) ------------------------------------------
class DiskCacheCounters(msgspec.Struct, frozen=True, kw_only=True):
    """What the prompt cache's tiers did, counted: entries (and bytes, tokens) read back from
    disk by requests, written at a stop, dropped (a stop's deadline came first, H5), evicted
    over the budget, rejected (read back bad and removed, H5.3), and quantized in memory with
    the bytes that returned (H6). One list of
    counters, kept by a worker (`DiskCacheStats`) and summed by the supervisor (`DiskCacheStatus`)."""

    read_entries: int = 0
    read_bytes: int = 0
    read_tokens: int = 0
    written_entries: int = 0
    written_bytes: int = 0
    dropped_entries: int = 0
    dropped_bytes: int = 0
    evicted_entries: int = 0
    evicted_bytes: int = 0
    rejected_entries: int = 0     # read back bad (cut short, checksum, shape, NaN) and removed (H5.3)
    quantized_entries: int = 0
    quantized_bytes: int = 0


COUNTER_NAMES: tuple[str, ...] = DiskCacheCounters.__struct_fields__


class DiskCacheStats(DiskCacheCounters, frozen=True, kw_only=True):
    """One model's prompt-cache disk tier as its worker sees it, and what this worker did with it.

    `entries`/`bytes` are this model's files, `all_bytes` every model's (what
    `budget` bounds). The counters are this worker's since it started: read
    when a request's prefix came from disk, written and dropped (not written
    because the stop's deadline came first, H5) at its stop, evicted to stay
    within the budget. `quantized_*` are the memory tier's shrink before drop (H6).
    """

    folder: str = ""
    entries: int = 0
    bytes: int = 0
    all_bytes: int = 0
    budget: int = 0               # the budget in force; 0 = the tier is off
    foreign_files: int = 0        # files and folders under kv/ not provably ours, left alone (H5.3)
    save_seconds: float = 0.0     # the last stop's write: how long it took ...
    save_deadline: float = 0.0    # ... of how long it was given (Drain.save_seconds)


class CacheReport(Msg, tag="cache_report", kw_only=True):
    """Sent when the tiers' figures change: at start (the folder indexed), after a read
    from disk or a quantization, and once after the stop's write (`final`), just
    before the process exits; the supervisor keeps the last one per model."""

    worker_id: str
    model_id: str
    pid: int
    stats: DiskCacheStats
    final: bool = False


WorkerReport = Union[Sample, WorkerEvent, Alive, CacheReport]
