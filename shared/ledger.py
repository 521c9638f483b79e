"""The shared-memory ledger: current values without a round trip.

ZeroMQ carries events, commands and token streams; the ledger carries the
latest value of things that change every step. A worker writes its memory
sample into its own slot at every step; the supervisor reads all slots each
tick with no syscall and no parse. The supervisor writes each worker's limits
(SPEC G) into a second block that the worker reads before every prefill chunk.

Layout (little endian, one mmap'd file in the private runtime directory):

    header   magic "MVLEDGR1", layout version, slot count
    sups     the supervisor's own footprint and when it was read
    samples  n slots: [seq u64][crc32 u32][pad u32][sample payload]
    limits   n slots: [seq u64][crc32 u32][pad u32][limits payload]

Each slot has one writer. It bumps `seq` to odd, writes the payload and its
CRC, then bumps `seq` to even. A reader copies the slot once, and accepts it
only when seq is even and non-zero and the CRC matches the copied payload;
otherwise it retries. The CRC makes a torn read detectable even where the
CPU may reorder plain stores (Apple silicon), which the sequence number alone
would not guarantee from Python.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgspec

from shared.limits import Limits
from shared.memory import MemoryReading
from shared.vocab import LIMIT_BINDINGS, TIERS, WORKER_PHASES, WorkerPhase

MAGIC = b"MVLEDGR1"
LAYOUT_VERSION = 4  # 2: cache bytes in samples; cache cap, pool max, residency in limits;
# 3: samples are MemoryReading, device watermarks in limits; 4: the decode batch's bytes and
# relayouts, the worker's own pool returns in samples

_HEADER = struct.Struct("<8sII")  # magic, layout version, n_slots
_HEADER_BYTES = 64
_SUPS = struct.Struct("<qd")  # supervisor footprint, t
_SLOT_HEAD = struct.Struct("<QII")  # seq, crc32, pad
_SEQ = struct.Struct("<Q")

_SAMPLE = struct.Struct("<qdqqqqqqqqqqqqqqqq")  # pid, t, MemoryReading (12), running, queued, tokens, phase
_LIMITS = struct.Struct("<qqqqdddqqqqqqqqqqqqqq")

_SAMPLE_SLOT = _SLOT_HEAD.size + _SAMPLE.size
_LIMITS_SLOT = _SLOT_HEAD.size + _LIMITS.size


_READ_TRIES = 64


class LedgerSample(msgspec.Struct, frozen=True, kw_only=True):
    """The latest slot of one worker: its reading (U1, H2) and its load."""

    pid: int
    t: float
    memory: MemoryReading
    running: int
    queued: int
    tokens: int
    phase: WorkerPhase


class LedgerError(RuntimeError):
    pass


def ledger_size(n_slots: int) -> int:
    return _HEADER_BYTES + _SUPS.size + n_slots * (_SAMPLE_SLOT + _LIMITS_SLOT)


class Ledger:
    """One mapping of the ledger file; `create` in the supervisor, `attach` in workers."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, n_slots: int) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self._view = memoryview(mm)
        self.n_slots = n_slots
        self._sups_at = _HEADER_BYTES
        self._samples_at = self._sups_at + _SUPS.size
        self._limits_at = self._samples_at + n_slots * _SAMPLE_SLOT

    @classmethod
    def create(cls, path: Path | str, n_slots: int) -> "Ledger":
        if not 1 <= n_slots <= 4096:
            raise LedgerError(f"slot count must be 1..4096, got {n_slots}")
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        size = ledger_size(n_slots)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        _HEADER.pack_into(mm, 0, MAGIC, LAYOUT_VERSION, n_slots)
        return cls(path, fd, mm, n_slots)

    @classmethod
    def attach(cls, path: Path | str) -> "Ledger":
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER_BYTES:
                raise LedgerError(f"{path} is too short to be a ledger ({size} bytes)")
            mm = mmap.mmap(fd, size)
            magic, version, n_slots = _HEADER.unpack_from(mm, 0)
            if magic != MAGIC or version != LAYOUT_VERSION:
                mm.close()
                raise LedgerError(f"{path} is not a v{LAYOUT_VERSION} memvisor ledger")
            if size < ledger_size(n_slots):
                mm.close()
                raise LedgerError(f"{path} is truncated")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, n_slots)

    def close(self) -> None:
        self._view.release()
        self._mm.close()
        os.close(self._fd)

    # -- seqlocked slots ------------------------------------------------

    def _write(self, off: int, layout: struct.Struct, values: tuple[object, ...]) -> None:
        mm = self._mm
        seq = _SEQ.unpack_from(mm, off)[0]
        seq += 1 if seq % 2 == 0 else 2  # odd: writing
        _SEQ.pack_into(mm, off, seq)
        start = off + _SLOT_HEAD.size
        layout.pack_into(mm, start, *values)
        crc = zlib.crc32(self._view[start : start + layout.size])
        _SLOT_HEAD.pack_into(mm, off, seq, crc, 0)
        _SEQ.pack_into(mm, off, seq + 1)

    def _read(self, off: int, layout: struct.Struct) -> tuple[Any, ...] | None:
        end = off + _SLOT_HEAD.size + layout.size
        for _ in range(_READ_TRIES):
            raw = self._mm[off:end]
            seq, crc, _pad = _SLOT_HEAD.unpack_from(raw, 0)
            if seq == 0:
                return None
            if seq % 2 == 0 and zlib.crc32(raw[_SLOT_HEAD.size :]) == crc:
                return layout.unpack_from(raw, _SLOT_HEAD.size)
            os.sched_yield()
        return None

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise LedgerError(f"slot {slot} outside 0..{self.n_slots - 1}")

    # -- samples (worker writes, supervisor reads) ----------------------

    def write_sample(
        self,
        slot: int,
        *,
        pid: int,
        t: float,
        memory: MemoryReading,
        running: int = 0,
        queued: int = 0,
        tokens: int = 0,
        phase: WorkerPhase = "ready",
    ) -> None:
        self._check(slot)
        m = memory
        values = (
            pid, t, m.usage, m.footprint, m.mlx_active, m.mlx_pool, m.mlx_peak, m.cache_bytes,
            m.cache_releasable, m.batch_bytes, m.batch_live_bytes, m.batch_relayouts, m.pool_returns,
            m.pool_returned, running, queued, tokens, WORKER_PHASES.index(phase),
        )  # fmt: skip
        self._write(self._samples_at + slot * _SAMPLE_SLOT, _SAMPLE, values)

    def read_sample(self, slot: int) -> LedgerSample | None:
        self._check(slot)
        values = self._read(self._samples_at + slot * _SAMPLE_SLOT, _SAMPLE)
        if values is None or values[0] == 0:
            return None
        (pid, t, usage, footprint, active, pool, peak, cache_bytes, cache_releasable, batch_bytes,
         batch_live_bytes, batch_relayouts, pool_returns, pool_returned, running, queued, tokens,
         phase) = values  # fmt: skip
        memory = MemoryReading(
            usage=usage, footprint=footprint, mlx_active=active, mlx_pool=pool, mlx_peak=peak,
            cache_bytes=cache_bytes, cache_releasable=cache_releasable, batch_bytes=batch_bytes,
            batch_live_bytes=batch_live_bytes, batch_relayouts=batch_relayouts, pool_returns=pool_returns,
            pool_returned=pool_returned,
        )
        return LedgerSample(
            pid=pid, t=t, memory=memory, running=running, queued=queued, tokens=tokens,
            phase=WORKER_PHASES[phase] if 0 <= phase < len(WORKER_PHASES) else "empty",
        )

    def clear_slot(self, slot: int) -> None:
        """Forget a stopped worker's sample (and limits), so no sum counts it."""
        self._check(slot)
        zero = (0,) * len(_SAMPLE.format.lstrip("<"))
        self._write(self._samples_at + slot * _SAMPLE_SLOT, _SAMPLE, zero[:1] + (0.0,) + zero[2:])
        self.write_limits(slot, Limits())

    # -- limits (supervisor writes, worker reads) -----------------------

    def write_limits(self, slot: int, limits: Limits) -> None:
        self._check(slot)
        values = (
            limits.soft_limit, limits.hard_limit, limits.hard_watermark, limits.abort_limit,
            limits.abort_margin, limits.prefill_headroom_safety, limits.safe_zone_ratio,
            limits.min_chunk_tokens, limits.ceiling, limits.static, limits.dynamic,
            limits.gpu_cap, _index(LIMIT_BINDINGS, limits.binding), _index(TIERS, limits.tier),
            int(limits.admission_paused), limits.max_concurrency,
            limits.cache_cap, limits.pool_max, limits.residency, limits.device_soft, limits.device_hard,
        )  # fmt: skip
        self._write(self._limits_at + slot * _LIMITS_SLOT, _LIMITS, values)

    def read_limits(self, slot: int) -> Limits | None:
        self._check(slot)
        values = self._read(self._limits_at + slot * _LIMITS_SLOT, _LIMITS)
        if values is None:
            return None
        (soft, hard, hard_wm, abort, margin, headroom, safe_zone, min_chunk,
         ceiling, static, dynamic, gpu_cap, binding, tier, paused, max_conc,
         cache_cap, pool_max, residency, device_soft, device_hard) = values  # fmt: skip
        return Limits(
            soft_limit=soft, hard_limit=hard, hard_watermark=hard_wm, abort_limit=abort,
            abort_margin=margin, prefill_headroom_safety=headroom, safe_zone_ratio=safe_zone,
            min_chunk_tokens=min_chunk, ceiling=ceiling, static=static, dynamic=dynamic,
            gpu_cap=gpu_cap, binding=LIMIT_BINDINGS[binding] if 0 <= binding < len(LIMIT_BINDINGS) else "",
            tier=TIERS[tier] if 0 <= tier < len(TIERS) else "balanced",
            admission_paused=bool(paused), max_concurrency=max_conc,
            cache_cap=cache_cap, pool_max=pool_max, residency=residency,
            device_soft=device_soft, device_hard=device_hard,
        )  # fmt: skip

    # -- the supervisor's own footprint (U2) ----------------------------

    def write_supervisor(self, footprint: int, t: float) -> None:
        """One aligned 16-byte store; readers tolerate a value one tick old."""
        _SUPS.pack_into(self._mm, self._sups_at, footprint, t)

    def read_supervisor(self) -> int:
        return int(_SUPS.unpack_from(self._mm, self._sups_at)[0])

    def group_device_bytes(self) -> int:
        """D1's fallback as a worker can see it: every live slot's MLX active + pool.

        Only meaningful where every worker's arrays live on the device (CUDA);
        the worker asks only when its limits carry device watermarks.
        """
        total = 0
        for slot in range(self.n_slots):
            values = self._read(self._samples_at + slot * _SAMPLE_SLOT, _SAMPLE)
            if values is not None and values[0] != 0:
                total += values[4] + values[5]  # MemoryReading.mlx_active + mlx_pool
        return total

    def group_usage(self) -> int:
        """SPEC U2 as a worker can see it: supervisor + every live slot."""
        total = self.read_supervisor()
        mm, seq_of, at = self._mm, _SEQ.unpack_from, self._samples_at
        for slot in range(self.n_slots):
            off = at + slot * _SAMPLE_SLOT
            if seq_of(mm, off)[0] == 0:  # never written: skip without copying
                continue
            values = self._read(off, _SAMPLE)
            if values is not None and values[0] != 0:
                total += values[2]  # MemoryReading.usage
        return total


def _index(names: tuple[str, ...], name: str) -> int:
    try:
        return names.index(name)
    except ValueError:
        return 0
