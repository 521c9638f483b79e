"""A model's load in phases (SPEC W3), and how far it has come (W6).

Why not `mlx_lm.load` in one call: it builds the model, reads the weights and
builds the tokenizer in one go, so nobody can say which of them a slow load
spent its time in, and a client waiting for a large model sees nothing. This
does the same steps with the same defaults (a local folder, no adapter, weights
read before it returns), each timed as a phase, and names the phase in progress
on the worker's `StepClock`, which its heartbeat thread reports with the bytes
read so far (`Alive.load_phase`, `Alive.bytes_read`).

The bytes read are the process's own (`/proc/self/io`'s rchar, Linux; `worker.heartbeat` reads them): MLX
reads the weight files with read(), so the count grows as the weights come in.
Where there is no such count, 0 is reported and the supervisor shows the
footprint's growth instead.

MLX is imported inside the functions, never at module level (the supervisor
imports worker.main, which imports this module's importers).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.vocab import LoadPhase

if TYPE_CHECKING:
    from worker.heartbeat import StepClock

# Tests only: seconds the `read` phase lasts after the weights are in (a client watching the
# load's progress sees the phase and the bytes read; the delays of worker/loop.py come before).
READ_DELAY_ENV = "MEMVISOR_TEST_READ_DELAY"


def _read_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(READ_DELAY_ENV, "0")))
    except ValueError:
        return 0.0


class LoadMeter:
    """The seconds each phase of one load took, and the phase in progress on `clock`."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.phases: dict[LoadPhase, float] = {}
        clock.start_load()

    @contextlib.contextmanager
    def phase(self, name: LoadPhase) -> Iterator[None]:
        self.clock.load_phase = name
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - started

    def done(self) -> None:
        """The load is over (loaded or failed): the heartbeat reports no phase from now on."""
        self.clock.load_phase = ""


def load_generator(directory: Path, meter: LoadMeter | None) -> tuple[Any, Any]:
    """(model, tokenizer) as `mlx_lm.load(directory)` gives them, one phase at a time."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    with _phase(meter, "build"):
        model, config = load_model(directory, lazy=True)  # the graph and the weights' places, nothing read
    with _phase(meter, "read"):
        mx.eval(model.parameters())
        time.sleep(_read_delay())  # tests only: a slow disk, the weights in and the phase not over yet
    with _phase(meter, "tokenizer"):
        tokenizer = load_tokenizer(directory, None, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer


def _phase(meter: LoadMeter | None, name: LoadPhase) -> contextlib.AbstractContextManager[None]:
    return meter.phase(name) if meter is not None else contextlib.nullcontext()
