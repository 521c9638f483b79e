"""Admission of a model load (SPEC A1-A4), of a request (P3), and eviction for a prefill (G1).

Pure functions of a Snapshot, like the policy: they say which idle models to
stop first and whether the load may then go ahead. A5 (one load at a time;
requests for a loading model wait for it) is the pool's job: it calls
`admit_load` with no other load in flight, stops the `evict` workers, waits
for them and for `wait_for` (workers already draining) to exit, then loads.

Usage is projected the same way as in `supervisor.policy.pressure`: draining workers
count as gone, each eviction subtracts the victim's usage. Spare workers (W2) are
the first room taken, before any idle model.

Public names (stable): LoadVerdict, admit_load, admits_request, prefill_room, PrefillRoom,
MODEL_TOO_LARGE, INSUFFICIENT_MEMORY.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.sizes import format_size
from shared.vocab import Binding, PoolName, RefusalCode
from supervisor.policy.ceilings import Ceilings, remedy, reserve_message
from supervisor.policy.device import admit_device_load, device_ceilings_for
from supervisor.policy.group import WorkerGroup, ceilings_for, is_idle, lru_key
from supervisor.policy.snapshot import Snapshot, WorkerRecord
from supervisor.policy.spares import room_victims
from supervisor.policy.verdict import HOST_TERMS, INSUFFICIENT_MEMORY, MODEL_TOO_LARGE, LoadVerdict, decide_load

__all__ = [
    "INSUFFICIENT_MEMORY", "MODEL_TOO_LARGE", "FitReport", "LoadVerdict", "admit", "admit_load", "admits_request",
    "PrefillRoom", "fit_report", "prefill_room",
]


def admits_request(paused: bool, running: int) -> bool:
    """SPEC P3: while pressure pauses admission, a worker with nothing running still
    takes one request (so no model starves); one that runs any takes none."""
    return not paused or running == 0

def _projected(g: WorkerGroup) -> int:
    return g.usage - g.draining_usage


def _idle_victims(g: WorkerGroup, exclude_model: str = "", exclude_worker: str = "") -> list[WorkerRecord]:
    return sorted(
        (w for w in g.serving
         if not w.pinned and is_idle(w) and w.model != exclude_model and w.worker != exclude_worker),
        key=lru_key,
    )


def _room(g: WorkerGroup, exclude_model: str = "", exclude_worker: str = "") -> list[WorkerRecord]:
    """A2, G1: what a load or a prefill stops for room, in order: the spares (W2), then idle models by LRU."""
    return room_victims(g) + _idle_victims(g, exclude_model=exclude_model, exclude_worker=exclude_worker)


def _take(victims: list[WorkerRecord], usage: int, need: int, target: int) -> tuple[list[str], int]:
    """Stop victims in order while usage + need > target (A2, G1)."""
    chosen: list[str] = []
    for w in victims:
        if usage + need <= target:
            break
        chosen.append(w.worker)
        usage -= w.usage
    return chosen, usage


def admit_load(s: Snapshot, model_id: str, size_bytes: int) -> LoadVerdict:
    """A1-A4: evict idle LRU models toward the soft target, then admit or refuse.

    A refused load evicts nothing: stopping models for a load that still
    cannot fit would only destroy work. With the guard off (A4) the static
    ceiling is the target and the load is never refused.
    """
    g = WorkerGroup(s)
    c = ceilings_for(s, g)
    usage, size, ceiling = _projected(g), max(0, size_bytes), c.admission_ceiling
    target = min(c.admission_soft_target, ceiling)  # A1

    def refuse(after: int) -> tuple[RefusalCode, str, str]:
        error, text = _refusal(model_id, c, size, after)
        return error, text, remedy("static" if c.reserve_exceeds_total else c.admission_binding, c.tier)

    return decide_load(
        HOST_TERMS, model_id, size=size, usage=usage, ceiling=ceiling, target=target, binding=c.admission_binding,
        enabled=c.enabled, victims=((w.worker, w.usage) for w in _room(g, exclude_model=model_id)),
        wait_for=[w.worker for w in g.live if w.state == "draining"], refuse=refuse)


def admit(s: Snapshot, model_id: str, size_bytes: int) -> LoadVerdict:
    """A and D5 together: where the weights go decides which pool they count against.

    With a discrete device (`s.device_total` > 0: a worker said hello from
    CUDA) MLX copies the weights to the device, so they count against the
    device pool (A1-A4 on device bytes) and nothing of them against host RAM;
    the host rules still run (with size 0) so a host already over its target
    evicts too. The load goes ahead only when both pools admit it; the victims
    and the draining workers to wait for are the union of the two answers.
    Without a device this is `admit_load`.
    """
    if s.device_total <= 0:
        return admit_load(s, model_id, size_bytes)
    g = WorkerGroup(s)
    device = admit_device_load(device_ceilings_for(s, g), g, model_id, size_bytes)
    host = admit_load(s, model_id, 0)
    if not device.admitted:
        return device
    if not host.admitted:
        return host
    evict = device.evict + [w for w in host.evict if w not in device.evict]
    wait_for = device.wait_for + [w for w in host.wait_for if w not in device.wait_for]
    message = device.message if not host.evict else f"{device.message}; host RAM: {host.message}"
    return msgspec.structs.replace(device, evict=evict, wait_for=wait_for, message=message)


def _refusal(model_id: str, c: Ceilings, size: int, after: int) -> tuple[RefusalCode, str]:
    """A3: (error code, words) naming the binding constraint (C1, C6)."""
    ceiling, binding = c.admission_ceiling, c.admission_binding
    if c.reserve_exceeds_total:
        return MODEL_TOO_LARGE, reserve_message(c)
    if size > ceiling:
        return MODEL_TOO_LARGE, (
            f"model {model_id} needs {format_size(size)}, more than the whole {binding} "
            f"ceiling of {format_size(ceiling)}")
    return INSUFFICIENT_MEMORY, (
        f"model {model_id} needs {format_size(size)} but only "
        f"{format_size(max(0, ceiling - after))} of the {binding} ceiling "
        f"{format_size(ceiling)} is free after stopping every idle model")


class PrefillRoom(msgspec.Struct, frozen=True, kw_only=True):
    """G1's answer to a worker's shortfall: the idle workers to `stop`, and the stops already
    under way (`await_exit`) whose memory counts first. Both empty: no room can be made."""

    stop: list[str] = []
    await_exit: list[str] = []

    @property
    def made(self) -> bool:
        return bool(self.stop or self.await_exit)


def prefill_room(s: Snapshot, worker: str, need_bytes: int, *, pool: str = "host") -> PrefillRoom:
    """G1: what to stop, and what to wait for, so that `worker`'s prefill fits.

    `need_bytes` is the worker's shortfall (usage + peak - its hard limit, as
    SPEC G1 words it), not the prefill's whole size: the worker already counted
    the group's usage against its own limit, so what is asked for is what must
    come back. A stop already under way with nothing left to finish (a spare
    stopped for a load, a model a swap has drained) gives its memory back within
    a fraction of a second: it counts first, and the answer waits for its exit
    rather than refusing a prefill that fits once it is gone (the worker still
    sees that memory in the group's usage until then). Then the victims: the
    spare workers first (W2), then idle, non-pinned models, least recently used
    first, never the asking worker, taken until what they held covers the rest.

    With `pool` "device" the shortfall is in the discrete device's pool
    (SPEC D: a prefill's peak on a CUDA worker is device memory): a worker
    covers it with its device bytes, and one that holds none is passed over.

    Empty when the guard is off, when nothing is short, or when all of it would
    still not cover the shortfall (the worker then rejects the request instead
    of costing other models their place for nothing).
    """
    g = WorkerGroup(s)
    need = max(0, need_bytes)
    if ceilings_for(s, g).worker_ceiling <= 0 or need == 0:
        return PrefillRoom()
    device = pool == "device"
    if device:
        dc = device_ceilings_for(s, g)
        if dc is None or dc.ceiling <= 0:
            return PrefillRoom()
    awaited, freed = _cover([w for w in g.draining_idle if w.worker != worker], 0, need, device)
    chosen, freed = _cover(_room(g, exclude_worker=worker), freed, need, device)
    return PrefillRoom(stop=chosen, await_exit=awaited) if freed >= need else PrefillRoom()


def _cover(workers: list[WorkerRecord], freed: int, need: int, device: bool) -> tuple[list[str], int]:
    """Take `workers` in order until what they hold, on top of `freed`, covers `need`."""
    chosen: list[str] = []
    for w in workers:
        if freed >= need:
            break
        held = w.device_bytes if device else w.usage
        if device and held <= 0:  # stopping it frees nothing in this pool
            continue
        chosen.append(w.worker)
        freed += held
    return chosen, freed


class FitReport(msgspec.Struct, frozen=True, kw_only=True):
    """"Will it fit?" (`load --dry-run`): A1-A3 answered without spawning anything.

    `estimated_bytes` is the weights plus the KV cache of `context_tokens`;
    `evict` names the models that would be stopped first; `message` is what a
    real load would say (the 507's words when it would be refused).
    """

    model: str
    fits: bool
    estimated_bytes: int
    weight_bytes: int
    kv_bytes: int
    context_tokens: int
    usage: int
    ceiling: int
    binding: Binding
    evict: list[str]
    message: str
    error: Literal[RefusalCode, ""] = ""
    pool: PoolName = "host"  # D5: the pool the load counts against ("device" on a discrete GPU)


def fit_report(s: Snapshot, model_id: str, weight_bytes: int, kv_per_token: int,
               context_tokens: int) -> FitReport:
    """A dry run of `admit` (the real load's rules, host or device) for the weights
    plus `context_tokens` of KV cache."""
    kv = max(0, kv_per_token) * max(0, context_tokens)
    verdict = admit(s, model_id, weight_bytes + kv)
    by_worker = {w.worker: w.model or f"a spare worker ({w.worker})" for w in s.workers}
    return FitReport(
        model=model_id, fits=verdict.admitted, estimated_bytes=weight_bytes + kv, weight_bytes=weight_bytes,
        kv_bytes=kv, context_tokens=max(0, context_tokens), usage=verdict.usage, ceiling=verdict.ceiling,
        binding=verdict.binding, evict=[by_worker.get(w, w) for w in verdict.evict], message=verdict.message,
        error=verdict.error, pool=verdict.pool,
    )
