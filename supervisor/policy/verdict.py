"""A load's admission verdict (SPEC A3, D5): one struct for either memory pool.

Kept apart from `admission` (host rules) and `device` (device rules) so both
build the same answer without importing each other.

Public names (stable): LoadVerdict, MODEL_TOO_LARGE, INSUFFICIENT_MEMORY,
PoolTerms, decide_load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

import msgspec

from shared.sizes import format_size
from shared.vocab import Binding, PoolName, RefusalCode

MODEL_TOO_LARGE: RefusalCode = "model_too_large"
INSUFFICIENT_MEMORY: RefusalCode = "insufficient_memory"


class LoadVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """A3's answer. Refused loads map to HTTP 507 with `error`, `binding`, `remedy`,
    and a message that names the pool (`host` RAM or the discrete `device`)."""

    admitted: bool
    pool: PoolName = "host"
    evict: list[str] = []      # worker ids to stop first, least recently used first
    wait_for: list[str] = []   # draining workers whose memory the verdict counts as free
    error: Literal[RefusalCode, ""] = ""  # "" when admitted
    binding: Binding = ""      # binding of the pool's admission ceiling (C6, D3)
    remedy: str = ""
    message: str = ""
    usage: int = 0             # the pool's projected usage before the load
    size: int = 0              # what the load adds to that pool
    ceiling: int = 0           # the pool's admission ceiling (C7)
    target: int = 0            # A1 evict target


class PoolTerms(NamedTuple):
    """How a pool's figures read in a verdict's message."""

    pool: PoolName
    size_words: str     # after the size: "" or " of device memory"
    ceiling_words: str  # "ceiling" or "device ceiling"
    static_words: str   # "static ceiling" or "device static ceiling"


HOST_TERMS = PoolTerms("host", "", "ceiling", "static ceiling")
DEVICE_TERMS = PoolTerms("device", " of device memory", "device ceiling", "device static ceiling")


def decide_load(
    terms: PoolTerms, model_id: str, *, size: int, usage: int, ceiling: int, target: int, binding: Binding,
    enabled: bool, victims: Iterable[tuple[str, int]], wait_for: list[str],
    refuse: Callable[[int], tuple[RefusalCode, str, str]],
) -> LoadVerdict:
    """A2-A4 on one pool, the same for host RAM and a discrete device.

    `victims` are (worker id, bytes it holds in this pool), in the order A2
    stops them; `refuse(usage after the evictions)` gives (error code, words,
    remedy) for A3's refusal. A refused load evicts nothing.
    """
    evict: list[str] = []
    after = usage
    for worker, held in victims:  # A2
        if after + size <= target:
            break
        evict.append(worker)
        after -= held
    verdict = LoadVerdict(admitted=True, pool=terms.pool, evict=evict, wait_for=wait_for, binding=binding,
                          usage=usage, size=size, ceiling=ceiling, target=target)
    what = f"load {model_id} ({format_size(size)}{terms.size_words})"
    if after + size <= ceiling:  # A3 admit
        return msgspec.structs.replace(verdict, message=(
            f"{what}: fits under the {binding} {terms.ceiling_words} {format_size(ceiling)} "
            f"after stopping {len(evict)} idle model(s)"))
    if not enabled:  # A4 never refuse
        return msgspec.structs.replace(verdict, message=(
            f"{what}: the guard is off, admitted over the {terms.static_words} {format_size(ceiling)}"))
    error, text, fix = refuse(after)
    return msgspec.structs.replace(verdict, admitted=False, evict=[], error=error, remedy=fix,
                                   message=f"{text}; {fix}")
