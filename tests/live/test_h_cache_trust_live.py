"""SPEC H5.3 through a real supervisor, real worker processes and real HTTP: a caches folder
others can write leaves the server serving with its disk tier (and BLAS copy) off, a poisoned
entry never changes a greedy reply and is removed, and a caches folder another process holds
with another budget turns this server's tier off with one line (the budget's lock is a real
lock between processes).

The worker's log lines are its stderr (capfd): what a user sees in the supervisor's terminal.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from shared.sizes import GiB, MiB
from supervisor.config import GuardConfig, ModelConfig
from tests.http_harness import LiveServer, make_config, until
from worker import kv_files

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LONG = "The guard keeps the machine's memory in check while models come and go. " * 40  # ~600 tokens


def config(tiny_models, **guard):
    guard.setdefault("hot_cache_max", 64 * MiB)
    return make_config([ModelConfig(id="a", path=str(tiny_models.a))], guard=GuardConfig(**guard))


async def chat(live: LiveServer):
    return await live.openai().chat.completions.create(
        model="a", messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "Go on."}],
        max_tokens=12, temperature=0)


async def unload(live: LiveServer) -> None:
    """Unload `a` and wait for its worker's last cache report (what it wrote at its stop)."""
    handle = live.arbiter.pool.worker_for("a")
    assert handle is not None and await live.arbiter.service.unload("a", admin=True)
    await until(lambda: handle.exited.done(), 60, "the worker to exit")


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "kv").rglob("*.safetensors"))


def worker_lines(capfd, words: str) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if words in line]


def test_h5_a_worker_on_a_caches_folder_others_can_write_serves_with_its_tier_off(tiny_models, runtime_dir,
                                                                                 private_cache_dir, capfd):
    private_cache_dir.chmod(0o777)  # someone made it, or made it so, for everyone
    with LiveServer(config(tiny_models), runtime_dir) as live:
        async def main():
            reply = await chat(live)
            assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
            await unload(live)

        live.run(main(), timeout=180)
    err = capfd.readouterr().err.splitlines()
    (off,) = [line for line in err if "prompt cache disk tier off" in line]
    assert str(private_cache_dir) in off and "mode 0777" in off and "chmod 700" in off
    assert any("renamed copy's folder is refused" in line for line in err)  # nor was its BLAS copy loaded
    assert not (private_cache_dir / "kv").exists()  # nothing written where others could read it
    assert stat.S_IMODE(private_cache_dir.stat().st_mode) == 0o777  # refused, not changed


def _poison(path: Path) -> None:
    """The entry's arrays made NaN, written back as the tier writes (a valid checksum of the NaN)."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    metadata.pop(kv_files.CHECKSUM, None)
    poisoned = {k: v * mx.array(float("nan"), dtype=v.dtype) for k, v in arrays.items()}
    path.unlink()
    kv_files.write_entry(path, poisoned, metadata, deadline=float("inf"))


def test_h5_a_poisoned_entry_never_changes_a_greedy_reply_and_is_removed(tiny_models, runtime_dir, private_cache_dir):
    with LiveServer(config(tiny_models), runtime_dir) as live:
        async def main():
            first = await chat(live)
            await unload(live)
            await until(lambda: live.arbiter.pool.caches.model("a").written_entries == 1, 10, "the write's report")
            (path,) = entries(private_cache_dir)
            _poison(path)
            second = await chat(live)  # a new worker: its prefix is on disk, poisoned
            assert second.choices[0].message.content == first.choices[0].message.content
            details = second.usage.prompt_tokens_details
            assert details.cached_tokens == 0 and details.model_extra["disk_cached_tokens"] == 0
            await until(lambda: live.arbiter.pool.caches.model("a").rejected_entries == 1, 10, "the rejection")
            assert not path.exists()  # removed, not kept for a later worker
            await unload(live)  # the stop writes this worker's own, finite entry, never the NaN one
            await until(lambda: live.arbiter.pool.caches.model("a").written_entries == 1, 10, "the second write")
            assert live.arbiter.service.disk_cache().rejected_entries == 1
            return path

        path = live.run(main(), timeout=300)
    (again,) = entries(private_cache_dir)
    assert again == path and all(mx.all(mx.isfinite(a)).item() for a in mx.load(str(again)).values())


HOLDER = """
import sys
from pathlib import Path
from worker.disk_cache import DiskTier
from worker.kv_layout import KVLayout
tier = DiskTier.open("other", Path(sys.argv[1]), int(sys.argv[2]), layout=KVLayout("F16", ()))
print("held" if tier is not None else "refused", flush=True)
sys.stdin.read()
"""


def test_h5_a_caches_folder_held_with_another_budget_turns_the_tier_off_with_one_line(tiny_models, runtime_dir,
                                                                                     private_cache_dir, capfd):
    """Another supervisor's worker (a process holding the folder with disk_cache_max 1 GiB)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tiny_models.b), str(GiB)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with LiveServer(config(tiny_models, disk_cache_max=2 * GiB), runtime_dir) as live:
            async def main():
                reply = await chat(live)
                assert reply.usage.completion_tokens > 0
                await unload(live)

            live.run(main(), timeout=180)
        (off,) = worker_lines(capfd, "prompt cache disk tier off")
        assert "disk_cache_max = 1 GiB" in off and "this one has 2 GiB" in off
        assert entries(private_cache_dir) == []  # this server wrote nothing: it would have evicted by 2 GiB
    finally:
        holder.communicate("", timeout=30)
