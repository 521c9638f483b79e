"""One model load's phases as the supervisor times them (SPEC W3), and its progress (W6).

Why: a swap is where a multi-model server is judged, and "it took 3.8 s" says
nothing about where. A load is timed phase by phase, from what each side sees:

    admit        the load began (supervisor.models.life) -> its worker was chosen
    spawn        a fresh process started -> it entered the worker's code
    hello        ... -> MLX and the engine imported, hello received
    spare        a spare was handed the model -> it began loading (W1)
    build        \\
    read          | the worker's own phases, timed by worker/loader.py and
    tokenizer     | sent with `Loaded`
    warm_up      /
    first_token  the load ended -> the first token of the request that waited for it

The worker's timestamps are its `time.monotonic()`, the same clock as the
supervisor's on Linux and macOS (`Sample.t` relies on it too). A load that no
request was waiting for (an explicit load, a pinned model) has no
`first_token`: it is closed `FIRST_REQUEST_WINDOW` after it ended.

While a load runs, the worker's heartbeat reports its phase and the bytes it
has read; `progress` says when that is worth an event: each new phase, and
while reading, once a second. These are pure functions of times and messages;
the pool keeps one `LoadClock` per worker, and supervisor.workers.load_timer says what
they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import protocol as p
from shared.sizes import format_size
from shared.vocab import LOAD_PHASES, LoadPhase

FIRST_REQUEST_WINDOW = 1.0  # seconds: a request opened this soon after the load ended was waiting for it
PROGRESS_EVERY = 1.0  # seconds between progress events within one phase (while the weights are read)


@dataclass(slots=True)
class LoadClock:
    began: float      # monotonic: the model's load began (before admission)
    chosen: float     # ... its worker was spawned, or a spare was handed the model
    spare: bool       # W1: a spare took it
    estimate: int     # A2's estimate of its weights, for the progress
    phase: LoadPhase
    phases: dict[LoadPhase, float] = field(default_factory=dict)
    bytes_read: int = 0
    loaded_at: float = 0.0   # the worker said `Loaded` (0: still loading)
    first_request: str = ""  # the request whose first token closes the load
    closed: bool = False
    said_at: float = 0.0     # the last progress event

    @property
    def loaded(self) -> bool:
        return self.loaded_at > 0


def begin(began: float, chosen: float, *, spare: bool, estimate: int) -> LoadClock:
    """A worker was chosen for a load that began at `began`: admission's part is over."""
    clock = LoadClock(began=began, chosen=chosen, spare=spare, estimate=estimate, phase="spare" if spare else "spawn")
    clock.phases["admit"] = max(0.0, chosen - began)
    return clock


def hello(clock: LoadClock, started: float, now: float) -> None:
    """A fresh worker said hello: `started` is when it entered the worker's code (0: not said)."""
    if started > 0:
        clock.phases["spawn"] = max(0.0, started - clock.chosen)
        clock.phases["hello"] = max(0.0, now - started)
    else:
        clock.phases["spawn"] = max(0.0, now - clock.chosen)
    clock.phase = "build"


def loaded(clock: LoadClock, msg: p.Loaded, now: float) -> None:
    """The worker loaded the model: its own phases join the supervisor's."""
    if clock.spare:
        clock.phases["spare"] = max(0.0, msg.began - clock.chosen) if msg.began else 0.0
    clock.phases.update(msg.phases)
    clock.loaded_at = now
    clock.phase = "first_token"


def request_opened(clock: LoadClock, request_id: str, now: float) -> None:
    """A request reached the worker: the first one within the window is the one the load served."""
    if clock.loaded and not clock.closed and not clock.first_request and now - clock.loaded_at <= FIRST_REQUEST_WINDOW:
        clock.first_request = request_id


def first_token(clock: LoadClock, now: float) -> None:
    clock.phases["first_token"] = max(0.0, now - clock.loaded_at)


def progress(clock: LoadClock, alive: p.Alive, now: float) -> bool:
    """Take the worker's heartbeat; True when its progress is worth an event now."""
    if clock.loaded or not alive.load_phase:
        return False
    # the heartbeat and the hello travel on two sockets: a phase the clock has passed stays passed
    moved = LOAD_PHASES.index(alive.load_phase) > LOAD_PHASES.index(clock.phase)
    if moved:
        clock.phase = alive.load_phase
    clock.bytes_read = max(clock.bytes_read, alive.bytes_read)
    if moved or now - clock.said_at >= PROGRESS_EVERY:
        clock.said_at = now
        return True
    return False


def report(clock: LoadClock, now: float) -> p.LoadReport:
    ordered = {name: round(clock.phases[name], 4) for name in LOAD_PHASES if name in clock.phases}
    return p.LoadReport(phase=clock.phase, bytes_read=clock.bytes_read, estimate_bytes=clock.estimate,
                        elapsed=round(max(0.0, now - clock.began), 4), phases=ordered, spare=clock.spare)


def progress_words(r: p.LoadReport) -> str:
    """`read: 24 MiB of 64 MiB, 0.8 s so far` (the weights' part only while they are read)."""
    if r.phase == "read" and r.bytes_read:
        of = f" of {format_size(r.estimate_bytes)}" if r.estimate_bytes else ""
        return f"{r.phase}: {format_size(r.bytes_read)}{of} read, {r.elapsed:.1f} s so far"
    return f"{r.phase}, {r.elapsed:.1f} s so far"


def phase_words(r: p.LoadReport) -> str:
    """`spare 0.002 s, build 0.010 s, read 0.035 s, ...; 0.214 s in all (a spare took it)`."""
    parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.3f} s" for name, seconds in r.phases.items())
    how = "a spare took it" if r.spare else "a fresh worker"
    return f"{parts}; {sum(r.phases.values()):.3f} s in all ({how})"

