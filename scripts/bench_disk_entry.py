"""What checking a prompt-cache entry costs when it is read back (SPEC H5.3), as ratios in one run.

    python scripts/bench_disk_entry.py [--tokens 4096] [--layers 8] [--heads 8] [--dim 128] [--runs 5]

A float16 entry of the given shape is written once by the disk tier, then read
back `--runs` times by `DiskTier.load` (header proven ours and matched to the
layout, the data read through the checked descriptor, its xxh3-128 checksum and
finite values checked) and by a plain `mx.load` of the same file, alternately,
both from the page cache (the worst case for the checks: no disk time to hide
them). The write (`kv_files.write_entry`: checksum, O_EXCL, rename) is timed against
`mx.save_safetensors` of the same arrays and metadata, alternately too.

The last line is the headline:

    disk entry: N MiB; read checked/plain X× (A s vs B s); write ours/mx.save_safetensors Y×
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker import blas  # noqa: E402  (OpenBLAS before MLX, as a worker)

blas.preload()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from modelfiles.modelgen import make_model  # noqa: E402
from worker import kv_files  # noqa: E402
from worker import prompt_cache as pc  # noqa: E402
from worker.disk_cache import DiskTier  # noqa: E402
from worker.kv_layout import KVLayout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-disk-entry-"))
    make_model(root / "m", 2 << 20, 0)
    layers = []
    for _ in range(args.layers):
        c = KVCache()
        x = mx.random.normal((1, args.heads, args.tokens, args.dim)).astype(mx.float16)
        c.update_and_fetch(x, x)
        layers.append(c)
    mx.eval([(c.keys, c.values) for c in layers])
    tier = DiskTier.open("m", root / "m", 64 << 30, root=root / "kv", layout=KVLayout.of(layers))
    assert tier is not None
    tier.save([pc.Entry(tuple(range(args.tokens)), layers)], deadline=time.monotonic() + 600)
    (entry,) = tier.entries.values()
    path = tier.folder / entry.name
    arrays, metadata = tier._encoded(pc.Entry(tuple(range(args.tokens)), layers))
    ours, theirs = [], []
    for i in range(args.runs):
        started = time.perf_counter()
        kv_files.write_entry(root / f"ours-{i}.safetensors", arrays, metadata, deadline=time.monotonic() + 600)
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        mx.save_safetensors(str(root / f"theirs-{i}.safetensors"), arrays, metadata)
        theirs.append(time.perf_counter() - started)
    checked, plain = [], []
    for _ in range(args.runs):
        started = time.perf_counter()
        assert tier.load(entry) is not None
        checked.append(time.perf_counter() - started)
        started = time.perf_counter()
        loaded = cast(dict[str, mx.array], mx.load(str(path)))
        mx.eval(list(loaded.values()))
        plain.append(time.perf_counter() - started)
    read, plain_read = statistics.median(checked), statistics.median(plain)
    print(f"disk entry: {entry.nbytes / 2**20:.0f} MiB; read checked/plain {read / plain_read:.2f}x "
          f"({read:.3f} s vs {plain_read:.3f} s); "
          f"write ours/mx.save_safetensors {statistics.median(ours) / statistics.median(theirs):.2f}x")


if __name__ == "__main__":
    main()
