"""SPEC W4 carried out: the weights of the model likely asked for next, read ahead
into the OS page cache while there is room and no pressure.

`supervisor.policy.prefetch` says which model and whether now; this reads.
The reading runs on a daemon thread (`supervisor.wiring.offloop`), never on the
loop, in bounded chunks: each chunk is asked of the OS ahead of time
(`posix_fadvise(WILLNEED)` where it exists) and then read into one small
buffer that is reused (so the supervisor's own footprint grows by that
buffer only, never by the weights: page cache is file-backed and counts in
no process's usage). Between two chunks the thread looks at the guard's last
verdict (a frozen result that each tick replaces whole) and stops as soon
as the level is not ok; the loop also cancels it at its next turn. So a
prefetch stops at soft within one chunk's read.

What it did is said as `prefetch` events, counted (`prefetches`,
`prefetch_bytes`, `prefetch_cancelled` in `status`), and shown per model in
`ps` (bytes read ahead since the model was last loaded).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.gguf import is_gguf_path
from shared.modelinfo import FileRefused, open_regular
from shared.sizes import MiB, format_size
from shared.weights import WeightsError, weight_files
from supervisor.config import Config, ModelConfig
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.enforcer import Enforcer
from supervisor.guard.eventlog import Emit
from supervisor.models.catalog import Catalog
from supervisor.policy.prefetch import Candidate, likely_next, may_prefetch, room
from supervisor.wiring.offloop import OffLoopTimeout, off_loop
from supervisor.workers.pool import Pool

log = logging.getLogger("memvisor.prefetch")

CHUNK = 8 * MiB     # asked of the OS at once; the level is looked at between two
BUFFER = 1 * MiB    # what one read copies into (the only memory a prefetch holds)
SEQUENCE = 64       # the models asked for, remembered for the prediction
TIMEOUT = 600.0     # the loop stops waiting for a reading after this (the thread is told to stop)


@dataclass
class Reading:
    """One prefetch in progress; the thread writes `done` (an int: one store) and reads `cancel`."""

    model: str
    size: int
    cancel: threading.Event = field(default_factory=threading.Event)
    done: int = 0
    why: str = ""


def _files(path: str) -> list[Path]:
    """What a load reads: the weight files of a folder, or the GGUF file itself."""
    return [Path(path)] if is_gguf_path(path) else weight_files(path)


def read_ahead(files: list[Path], reading: Reading, keep_going: Callable[[], bool]) -> str:
    """On a thread: the files into the page cache, chunk by chunk; "done" or why it stopped."""
    fadvise = getattr(os, "posix_fadvise", None)
    willneed = getattr(os, "POSIX_FADV_WILLNEED", 0)
    buffer = memoryview(bytearray(BUFFER))
    for file in files:
        with open_regular(file, sys.maxsize) as handle:
            fd = handle.fileno()
            size = os.fstat(fd).st_size
            if fadvise is not None:
                fadvise(fd, 0, min(CHUNK, size), willneed)
            offset = 0
            while offset < size:
                if reading.cancel.is_set():
                    return reading.why or "cancelled"
                if not keep_going():
                    return "the memory level left ok"
                end = min(size, offset + CHUNK)
                if fadvise is not None and end < size:  # the next chunk is on its way while this one is read
                    fadvise(fd, end, min(CHUNK, size - end), willneed)
                while offset < end:
                    got = os.preadv(fd, [buffer[:min(BUFFER, end - offset)]], offset)
                    if got <= 0:  # the file shrank under us: what is there has been read
                        end = size = offset
                        break
                    offset += got
                    reading.done += got
    return "done"


class Prefetcher:
    def __init__(self, config: Config, *, catalog: Catalog, pool: Pool, enforcer: Enforcer, emit: Emit,
                 counters: SupervisorCounters) -> None:
        self.config = config
        self.catalog = catalog
        self.pool = pool
        self.enforcer = enforcer
        self.emit = emit
        self.counters = counters
        self.sequence: collections.deque[str] = collections.deque(maxlen=SEQUENCE)
        self.read: dict[str, int] = {}  # model -> bytes read ahead since it was last loaded
        self.reading: Reading | None = None
        self.loaded_at = 0.0  # when a load was last seen in flight: a decision needs a guard tick after it

    def note_request(self, model_id: str) -> None:
        """A request asked for this model (the sequence the prediction reads)."""
        if not self.sequence or self.sequence[-1] != model_id:
            self.sequence.append(model_id)

    def note_load(self, model_id: str) -> None:
        """Its load began: what was read ahead is the load's now."""
        self.read.pop(model_id, None)

    def bytes_for(self, model_id: str) -> int:
        """What `ps` shows: bytes read ahead for it (growing while its prefetch runs)."""
        reading = self.reading
        if reading is not None and reading.model == model_id:
            return reading.done
        return self.read.get(model_id, 0)

    def tick(self, now: float, *, loading: bool, failed: set[str]) -> None:
        """Cancel a prefetch once the level is not ok; else maybe start one (not while a load runs,
        nor before the guard has measured the group since the last load)."""
        reading = self.reading
        if reading is not None:
            if not self._level_ok():
                reading.why = "the memory level left ok"
                reading.cancel.set()
            return
        if loading:
            self.loaded_at = now
        last, seen = self.enforcer.last, self.enforcer.last_snapshot
        if not self.config.guard.prefetch or loading or last is None or seen is None or seen.now <= self.loaded_at:
            return  # a tick from before a load's end has not seen the new worker's usage
        candidates = self._candidates(failed)
        choice = likely_next(candidates, list(self.sequence))
        if choice is None:
            return
        size = next(c.size for c in candidates if c.model == choice)
        c = last.ceilings
        if may_prefetch(level=last.level, room_bytes=room(dynamic=c.dynamic, static=c.static, usage=last.usage),
                        size=size):
            model = self.config.model(choice)
            if model is not None:
                self._start(model, size)

    def _candidates(self, failed: set[str]) -> list[Candidate]:
        """Known models with no worker, not failed, not read ahead already."""
        found = []
        for m in self.config.models:
            if m.id in self.read or m.id in failed or self.pool.worker_for(m.id) is not None:
                continue
            last = self.pool.reaped.get(m.id)
            found.append(Candidate(model=m.id, size=self.catalog.estimate(m),
                                   last_used=last.last_access if last is not None else 0.0))
        return found

    def _level_ok(self) -> bool:
        """The guard's last verdict (safe to read from the reading thread: replaced whole, never changed)."""
        last = self.enforcer.last
        return last is not None and last.level == "ok"

    def _start(self, model: ModelConfig, size: int) -> None:
        reading = self.reading = Reading(model=model.id, size=size)
        self.counters.prefetches += 1
        why = f"reading ahead {format_size(size)} of {model.id}'s weights into the page cache (likely next)"
        log.info("Prefetch: %s", why)
        self.emit("prefetch", why, model_id=model.id)
        asyncio.get_running_loop().create_task(self._run(model, reading))

    async def _run(self, model: ModelConfig, reading: Reading) -> None:
        began = time.monotonic()
        try:
            outcome = await off_loop(lambda: read_ahead(_files(model.path), reading, self._level_ok), TIMEOUT,
                                     f"prefetch {model.id}")
        except OffLoopTimeout:
            reading.cancel.set()
            outcome = f"not done after {TIMEOUT:.0f} s"
        except (OSError, WeightsError, FileRefused) as exc:
            outcome = f"cannot read its files: {exc}"
        except asyncio.CancelledError:  # the loop is closing: the thread stops at its next chunk
            reading.cancel.set()
            raise
        finally:
            if self.reading is reading:
                self.reading = None
        self.read[model.id] = reading.done
        self.counters.prefetch_bytes += reading.done
        took = time.monotonic() - began
        if outcome == "done":
            words = f"read ahead {format_size(reading.done)} of {model.id}'s weights in {took:.2f} s"
        else:
            self.counters.prefetch_cancelled += 1
            words = f"prefetch of {model.id} stopped after {format_size(reading.done)} ({took:.2f} s): {outcome}"
        log.info("Prefetch: %s", words)
        self.emit("prefetch", words, model_id=model.id)
