"""A model's load in phases (SPEC W3), and how far it has come (W6).

Why not `mlx_lm.load` in one call: it builds the model, reads the weights and
builds the tokenizer in one go, so nobody can say which of them a slow load
spent its time in, and a client waiting for a large model sees nothing. This
does the same steps with the same defaults (a local folder, no adapter, weights
read before it returns), each timed as a phase, and names the phase in progress
on the worker's `StepClock`, which its heartbeat thread reports with the bytes
read so far (`Alive.load_phase`, `Alive.bytes_read`).

The bytes read are the process's own (`/proc/self/io`'s rchar, Linux): MLX
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

_PROC_IO = Path("/proc/self/io")
# Tests only: seconds the `read` phase lasts after the weights are in (a client watching the
# load's progress sees the phase and the bytes read; the delays of worker/loop.py come before).
READ_DELAY_ENV = "MEMVISOR_TEST_READ_DELAY"


def _read_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(READ_DELAY_ENV, "0")))
    except ValueError:
        return 0.0


def bytes_read_so_far() -> int:
    """Bytes this process has read through read() and its kind (0 where the OS does not count them)."""
    try:
        with _PROC_IO.open("rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class LoadMeter:
    """The seconds each phase of one load took, and the phase in progress on `clock`."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.phases: dict[LoadPhase, float] = {}
        clock.start_load(bytes_read_so_far())

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


def prepare_engine() -> str:
    """What a spare does before any model is named (SPEC W1): import MLX, mlx-lm, the
    tokenizer stack and the engine, and run one tiny computation on the default device
    (the CPU's BLAS and threads, or a GPU's context, set up). Also what a fresh worker
    does first, so both load from the same point. Returns the default device's name."""
    import mlx.core as mx
    import mlx_lm.models.llama  # noqa: F401  (the architecture of most models, and of the demo's)
    import mlx_lm.tokenizer_utils  # noqa: F401
    import mlx_lm.utils  # noqa: F401

    import worker.engine  # noqa: F401  (the engine and everything a request touches first)
    import worker.tokens  # noqa: F401

    _import_what_the_first_tokenizer_does()
    a = mx.ones((64, 64))
    mx.eval(a @ a)
    return str(mx.default_device())


# What transformers imports the first time a process builds a tokenizer (4.57: PIL through its
# image and video processors' modules, a llama config's module): 10 ms of CPU, and 50-90 ms
# of a loaded 2-core machine's wall clock, that a spare pays before the load instead of during it.
FIRST_TOKENIZER_IMPORTS = ("transformers.image_utils", "transformers.video_utils", "transformers.image_transforms",
                           "transformers.utils.type_validators", "transformers.models.llama.configuration_llama")


def _import_what_the_first_tokenizer_does() -> None:
    import importlib

    for name in FIRST_TOKENIZER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers: its first tokenizer pays what it pays
            pass
