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
    """

    usage: int = 0
    footprint: int = 0
    mlx_active: int = 0   # MLX arrays alive now
    mlx_pool: int = 0     # MLX allocator cache not yet returned to the OS
    mlx_peak: int = 0     # MLX peak active since the process started
    cache_bytes: int = 0
    cache_releasable: int = 0


NO_READING = MemoryReading()
