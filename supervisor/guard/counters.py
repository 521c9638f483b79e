"""What the supervisor counts: one field per counter, so a misspelt name is a type error.

Each part of the supervisor that counts something (the pool, the arbiter's
loop, reloads, model files, respawns, swaps, prefetches) is handed the one
`SupervisorCounters` the arbiter owns and adds to its own fields. `status`
and `/metrics` read them as `as_dict()` (with the gate's and the guard's
figures beside them: `Service.counters`). The names are a contract: they are
the keys of `/status`'s `counters` and feed `/metrics`.
"""

from __future__ import annotations

import msgspec


class SupervisorCounters(msgspec.Struct, kw_only=True):
    """Counts since the supervisor started; only ever incremented."""

    # worker processes (the pool)
    spawned: int = 0                # worker processes started
    exits: int = 0                  # worker processes that ended, for any cause
    wedged: int = 0                 # killed for missed heartbeats
    samples: int = 0                # memory samples received from workers
    disk_cache_saves: int = 0       # stops whose prompt-cache write left or dropped entries (H5)
    # models
    respawns: int = 0               # pinned models' workers started again after an exit
    model_files_refused: int = 0    # model folders or files refused when read (catalogue)
    reloads_refused: int = 0        # config re-reads refused (the old config stays)
    # swaps (SPEC W)
    swaps: int = 0                  # a loaded model stopped so another could load (W5)
    swap_waits: int = 0             # loads that waited for a busy model instead of a 507
    swap_waits_given_up: int = 0    # ... that waited out queue_deadline
    thrash_holds: int = 0           # requests served in a thrash hold before a swap (W5)
    thrash_episodes: int = 0        # thrash events said
    prefetches: int = 0             # weights read ahead into the page cache (W4)
    prefetch_bytes: int = 0         # ... their bytes
    prefetch_cancelled: int = 0     # ... stopped at soft pressure
    # requests the supervisor turned away itself
    at_capacity: int = 0            # a model's slots and queue were full (429)
    unload_refused: int = 0         # an unload asked by someone who may not (a pinned model: admins only)
    # the supervisor's own loop
    accept_errors: int = 0          # front-door accept() failures (descriptors run out)
    loop_stalls: int = 0            # the loop was late (the watchdog saw a stall)

    def as_dict(self) -> dict[str, int]:
        """The counters that have counted anything, by name (as `/status` has always listed them)."""
        return {name: value for name, value in msgspec.structs.asdict(self).items() if value}
