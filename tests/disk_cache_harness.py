"""Helpers for the prompt cache's disk tier tests (H5): real MLX KV, a tier on a folder of the
test's, and an engine on the tiny model with its tier. No tests here."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from shared.limits import Limits
from shared.protocol import DISK_CACHE_AUTO, Finished
from shared.sizes import GiB
from tests.engine_harness import drive, engine_for
from worker import disk_cache, kv_folder
from worker import prompt_cache as pc
from worker.disk_cache import DiskTier
from worker.kv_layout import KVLayout, probe

CACHED = Limits(max_concurrency=8, cache_cap=GiB)
ROOMY = (1000 * GiB, 0, 500 * GiB)  # shutil.disk_usage's (total, used, free) of a roomy disk


def roomy(_path) -> tuple[int, int, int]:
    return ROOMY


def kv(tokens: int, layers: int = 2, heads: int = 2, dim: int = 64, dtype=mx.float32, seed: int = 0) -> list[KVCache]:
    """Real MLX KV of `tokens` tokens in mlx-lm's growing buffers (longer than the tokens)."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        x = mx.random.normal((1, heads, tokens, dim)).astype(dtype)
        c.update_and_fetch(x, x * 2)
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


LAYOUT = KVLayout.of(kv(1))  # what `kv()` makes: the layout a tier of these tests checks entries against


def entry(tokens: int, start: int = 0, **kw) -> pc.Entry:
    return pc.Entry(tuple(range(start, start + tokens)), kv(tokens, **kw))


def files(root: Path) -> list[Path]:
    """What the tier holds under `root`: everything but the budget's lock."""
    return sorted(p for p in root.rglob("*") if p.name != kv_folder.LOCK_NAME)


def tier(root: Path, model: Path, max_bytes: int = DISK_CACHE_AUTO, model_id: str = "m", **kw) -> DiskTier:
    opened = open_tier(root, model, max_bytes, model_id, **kw)
    assert opened is not None
    return opened


def open_tier(root: Path, model: Path, max_bytes: int = DISK_CACHE_AUTO, model_id: str = "m", **kw) -> DiskTier | None:
    """The tier, or None when it refuses to start (as a worker's)."""
    kw.setdefault("disk_usage", roomy)
    kw.setdefault("layout", LAYOUT)
    return DiskTier.open(model_id, model, max_bytes, root=root, **kw)


def saved(t: DiskTier, *entries: pc.Entry) -> int:
    """Write `entries` with a minute to do it; how many were written."""
    return t.save(list(entries), deadline=time.monotonic() + 60).written


def engine_with(loaded, cache_root: Path, model: Path, **kw):
    engine = engine_for(loaded, max_chunk=64)
    engine.step(CACHED, lambda: 0)  # the cap arrives with the first limits, as in a worker
    kw.setdefault("layout", lambda: probe(engine.model))  # as a worker's tier learns it
    engine.use_disk_tier(tier(cache_root, model, **kw))
    return engine


def ask(engine, prompt: list[int], rid: str = "r", max_tokens: int = 12) -> tuple[list[int], Finished]:
    engine.submit(rid, prompt, max_tokens=max_tokens)
    run = drive(engine, CACHED)
    end = run.terminal(rid)
    assert isinstance(end, Finished)
    return run.tokens(rid), end


def save_all(engine):
    """What a stop does: every entry of the engine's memory tier written to its disk tier."""
    assert engine.disk is not None
    return engine.disk.save(engine.prompt_cache.recent_first(), deadline=time.monotonic() + 60)


def long_prompt(engine, words: str = "memory guard worker cache prefix ") -> list[int]:
    prompt = engine.encode_prompt(words * 40)
    assert len(prompt) >= disk_cache.MIN_TOKENS
    return prompt
