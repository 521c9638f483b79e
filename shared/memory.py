"""One memory reading of one worker: the fact that travels worker -> ledger -> enforcer.

The worker measures it (SPEC U1, H2), writes it into its ledger slot every step
and sends the same struct in its `Sample` report; the supervisor reads it back
from the ledger and hands it, unchanged, to the policy inside each
`WorkerRecord`. One struct keeps the meaning of every field in one place: the
two sides once disagreed about a field that each copied by hand.
"""

from __future__ import annotations

import msgspec


class MemoryReading(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one worker process holds, in bytes.

    `usage` is U1: the footprint as the OS charges it, MLX's pool included,
    never below `mlx_active`. `footprint` is the raw OS figure (0 when it could
    not be read). `cache_bytes` is the prompt cache held (H2, measured from the
    cached arrays) and `cache_releasable` the part of it no running or queued
    request uses, all that a shrink may drop (H3).

    Where the decode batch's memory goes: `batch_bytes` are its KV
    buffers as allocated (rows x positions, free room included) and
    `batch_live_bytes` the live rows' own tokens in them; `batch_relayouts`
    counts the whole-batch copies (growth, compaction) since the worker
    started. `pool_returns` counts the times the worker returned MLX's pool
    itself at a step boundary because it was over the pool cap (M1, where
    the allocator does not bound its pool: MLX's CUDA backend), and
    `pool_returned` the bytes those returns gave back.
    """

    usage: int = 0
    footprint: int = 0
    mlx_active: int = 0   # MLX arrays alive now
    mlx_pool: int = 0     # MLX allocator cache not yet returned to the OS
    mlx_peak: int = 0     # MLX peak active since the process started
    cache_bytes: int = 0
    cache_releasable: int = 0
    batch_bytes: int = 0
    batch_live_bytes: int = 0
    batch_relayouts: int = 0
    pool_returns: int = 0
    pool_returned: int = 0


NO_READING = MemoryReading()
