"""SPEC H5.3: the caches folder is ours, private and checked; the disk tier trusts nothing else.

Each test pins a hole a hostile (or careless) local user found: the budget deleting a
user's files under kv/ and following folder links, the writer following a link planted at
its temporary name, folders someone else created or can write used as they were, entries
read back unchecked (zeroed, NaN, wrong shape), a folder named like an entry switching the
tier off, two supervisors' budgets deleting each other's entries, and an entry of another
model's identity that nothing showed was never used. Tests run as root here: "another
user's" is a chown to uid 65534, skipped where that is not allowed.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from shared import private_files
from shared.sizes import GiB
from tests.disk_cache_harness import (
    LAYOUT,
    ask,
    engine_with,
    entry,
    kv,
    long_prompt,
    open_tier,
    roomy,
    save_all,
    saved,
    tier,
)
from worker import kv_files, kv_folder
from worker import prompt_cache as pc
from worker.disk_cache import DiskTier, entry_name, folder_name, model_identity

OTHER_UID = 65534  # nobody


def make_another_users(path: Path) -> None:
    try:
        os.chown(path, OTHER_UID, -1, follow_symlinks=False)
    except PermissionError:
        pytest.skip("making a file another user's needs root")


def users_file(path: Path, days_old: float = 365) -> bytes:
    """A user's own safetensors file (not an entry), older than anything the tier writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), {"w": mx.ones((64, 64))}, {"format": "pt"})
    old = time.time() - days_old * 86400
    os.utime(path, (old, old))
    return path.read_bytes()


def off_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "disk tier off" in r.getMessage()]


# ------------------------------------------------------------------ nothing of a user's is removed or followed


def test_h5_budget_eviction_removes_only_entries_and_follows_no_folder_link(tmp_path, tiny_model):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    kept = {
        root / "other" / "my-finetune.safetensors": None,            # a user's folder under kv/
        elsewhere / "important.safetensors": None,                    # behind a folder link
        root / f"notes-{'0' * 16}" / "user.safetensors": None,       # a folder named like ours, a file not ours
    }
    for path in kept:
        kept[path] = users_file(path)
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / f"linked-{'1' * 16}").symlink_to(elsewhere, target_is_directory=True)
    one = entry(200).nbytes + 4096
    t = tier(root, tiny_model, int(1.5 * one))  # room for one entry: each save evicts the one before
    assert saved(t, entry(200)) == 1 and saved(t, entry(200, start=1000)) == 1
    for path, data in kept.items():
        assert path.exists() and path.read_bytes() == data, path
    assert t.stats.evicted_entries == 1 and len(t.entries) == 1
    assert (root / "linked").is_symlink() and t.stats.foreign_files >= 4


def test_h5_a_linked_model_folder_is_refused_and_nothing_behind_it_is_removed(tmp_path, tiny_model, caplog):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    users_file(target / "weights.safetensors")
    (target / "readme.txt").write_text("mine")
    (root / folder_name("m", model_identity(tiny_model))).symlink_to(target, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        assert open_tier(root, tiny_model) is None
    assert sorted(os.listdir(target)) == ["readme.txt", "weights.safetensors"]
    (line,) = off_lines(caplog)
    assert "symbolic link" in line and folder_name("m", model_identity(tiny_model)) in line


@pytest.mark.parametrize("at", ["temporary", "final"])
def test_h5_a_link_planted_at_an_entrys_name_is_never_followed_nor_replaced(tmp_path, tiny_model, at):
    t = tier(tmp_path / "kv", tiny_model)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    e = entry(200)
    name = entry_name(e.tokens)
    link = t.folder / (f"{name}{kv_files.TMP_MARK}{os.getpid()}" if at == "temporary" else name)
    link.symlink_to(victim)
    assert saved(t, e) == 0
    assert victim.read_bytes() == b"precious" and link.is_symlink() and os.readlink(link) == str(victim)
    assert t.stats.foreign_files == 1


def test_h5_a_folder_named_like_an_entry_leaves_the_tier_on_and_is_left_alone(tmp_path, tiny_model):
    budget = 10 * entry(200).nbytes
    t = tier(tmp_path, tiny_model, budget)
    assert saved(t, entry(200)) == 1
    odd = t.folder / "x.safetensors"
    odd.mkdir()
    (odd / "keep").write_text("k")
    again = open_tier(tmp_path, tiny_model, budget)
    assert again is not None and again.stats.entries == 1  # the tier is on, its entry indexed
    assert saved(again, *(entry(200, start=1000 * i) for i in range(1, 12))) == 11  # the budget evicts, past it
    assert (odd / "keep").read_text() == "k"


def test_h5_a_file_cut_inside_its_header_is_never_read_nor_removed(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    saved(t, entry(200))
    (found,) = t.entries.values()
    path = t.folder / found.name
    path.write_bytes(path.read_bytes()[:100])  # not provably an entry any more: someone else's bytes
    again = tier(tmp_path, tiny_model)
    assert again.entries == {} and path.exists() and again.stats.foreign_files == 1


def test_h5_a_temporary_file_of_a_dead_process_that_is_not_ours_is_left_alone(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stray = t.folder / f"x.safetensors{kv_files.TMP_MARK}{int(dead.stdout)}"
    stray.write_bytes(b"not a header")
    tier(tmp_path, tiny_model)
    assert stray.read_bytes() == b"not a header"


# ------------------------------------------------------------------ folders and files of ours alone


def test_h5_folders_are_made_0700_and_files_0600_whatever_the_umask(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv(private_files.CACHE_ENV, str(tmp_path / "cache"))
    old = os.umask(0)
    try:
        t = DiskTier.open("m", tiny_model, GiB, layout=LAYOUT, disk_usage=roomy)
        assert t is not None and saved(t, entry(200)) == 1
    finally:
        os.umask(old)
    (written,) = t.entries.values()
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "cache", t.root, t.folder)}
    assert set(modes.values()) == {0o700}, modes
    assert stat.S_IMODE((t.folder / written.name).stat().st_mode) == 0o600
    assert stat.S_IMODE((t.root / kv_folder.LOCK_NAME).stat().st_mode) == 0o600


def _pre_created(tmp_path: Path, tiny_model: Path, level: str) -> Path:
    """The caches folder down to the model's, made first (0700, ours); the folder at `level`."""
    root = tmp_path / "cache"
    folder = root / "kv" / folder_name("m", model_identity(tiny_model))
    folder.mkdir(parents=True, mode=0o700)
    for p in (root, root / "kv"):
        p.chmod(0o700)
    return {"root": root, "kv": root / "kv", "model": folder}[level]


@pytest.mark.parametrize("level", ["root", "kv", "model"])
def test_h5_a_caches_folder_another_user_owns_turns_the_tier_off_with_one_line(tmp_path, tiny_model, monkeypatch,
                                                                              caplog, level):
    theirs = _pre_created(tmp_path, tiny_model, level)
    make_another_users(theirs)
    monkeypatch.setenv(private_files.CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert DiskTier.open("m", tiny_model, GiB, layout=LAYOUT, disk_usage=roomy) is None
    (line,) = off_lines(caplog)
    assert str(theirs) in line and f"uid {OTHER_UID}" in line and "MEMVISOR_CACHE" in line
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("level,mode", [("root", 0o777), ("kv", 0o770), ("model", 0o703)])
def test_h5_a_caches_folder_others_can_write_turns_the_tier_off_with_one_line(tmp_path, tiny_model, monkeypatch,
                                                                             caplog, level, mode):
    shared = _pre_created(tmp_path, tiny_model, level)
    shared.chmod(mode)
    monkeypatch.setenv(private_files.CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert DiskTier.open("m", tiny_model, GiB, layout=LAYOUT, disk_usage=roomy) is None
    (line,) = off_lines(caplog)
    assert str(shared) in line and f"mode {mode:04o}" in line and "chmod 700" in line
    assert stat.S_IMODE(shared.stat().st_mode) == mode  # refused, not changed


def test_h5_our_own_0755_caches_folder_is_made_0700_and_said_once(tmp_path, tiny_model, monkeypatch, caplog):
    root = tmp_path / "cache"
    (root / "kv").mkdir(parents=True)
    for p in (root, root / "kv"):
        p.chmod(0o755)  # as earlier versions left it
    monkeypatch.setenv(private_files.CACHE_ENV, str(root))
    with caplog.at_level(logging.WARNING):
        assert DiskTier.open("m", tiny_model, GiB, layout=LAYOUT, disk_usage=roomy) is not None
        assert DiskTier.open("m", tiny_model, GiB, layout=LAYOUT, disk_usage=roomy) is not None
    assert stat.S_IMODE(root.stat().st_mode) == stat.S_IMODE((root / "kv").stat().st_mode) == 0o700
    said = [r.getMessage() for r in caplog.records if "made 0700" in r.getMessage()]
    assert len(said) == 2 and any(str(root / "kv") in s for s in said)


def test_h5_files_refused_by_the_private_reader(tmp_path):
    ours = tmp_path / "ours"
    ours.write_bytes(b"x")
    ours.chmod(0o644)  # an earlier version's entry: still ours, made 0600 as it is read
    private_files.open_private(ours, 10).close()
    assert stat.S_IMODE(ours.stat().st_mode) == 0o600
    (tmp_path / "link").symlink_to(ours)
    with pytest.raises(private_files.NotPrivate, match="symbolic link"):
        private_files.open_private(tmp_path / "link", 10)
    with pytest.raises(FileExistsError):
        private_files.create_private(tmp_path / "link")
    ours.chmod(0o622)
    with pytest.raises(private_files.NotPrivate, match="writable by group and others"):
        private_files.open_private(ours, 10)
    ours.chmod(0o600)
    make_another_users(ours)
    with pytest.raises(private_files.NotPrivate, match=f"uid {OTHER_UID}"):
        private_files.open_private(ours, 10)


# ------------------------------------------------------------------ what is read back is checked


def _poisoned(t: DiskTier, how: str) -> tuple[int, ...]:
    """An entry of `t` (properly labelled, in its folder) whose contents are bad in one way."""
    if how == "zeroed":  # bytes changed after the write: the checksum no longer matches
        e = entry(200)
        saved(t, e)
        path = t.folder / entry_name(e.tokens)
        data = bytearray(path.read_bytes())
        data[-4096:] = bytes(4096)
        path.write_bytes(bytes(data))
        return e.tokens
    layers = {"nan": lambda: [_nan(c) for c in kv(200)], "shape": lambda: kv(200, heads=3),
              "dtype": lambda: kv(200, dtype=mx.float16), "layers": lambda: kv(200, layers=3)}[how]()
    e = pc.Entry(tuple(range(200)), layers)
    saved(t, e)  # a checksum over what was written: only the check of the contents finds it
    return e.tokens


def _nan(c):
    c.keys = c.keys * mx.array(float("nan"), dtype=c.keys.dtype)
    return c


@pytest.mark.parametrize("how", ["zeroed", "nan", "shape", "dtype", "layers"])
def test_h5_a_bad_entry_is_a_miss_is_removed_and_counted(tmp_path, tiny_model, how):
    tokens = _poisoned(tier(tmp_path, tiny_model), how)
    t = tier(tmp_path, tiny_model)
    found = t.best(tokens, len(tokens) - 1, 0)
    assert found is not None  # indexed: its header is an entry of ours
    assert t.load(found) is None
    assert not (t.folder / found.name).exists() and t.entries == {}
    assert t.stats.rejected_entries == 1 and t.stats.read_entries == 0


def test_h5_an_entry_of_an_earlier_version_without_a_checksum_is_removed_at_the_index(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    e = entry(200)
    arrays, metadata = t._encoded(e)
    mx.save_safetensors(str(t.folder / entry_name(e.tokens)), arrays, metadata)  # as memvisor-kv/1 wrote it
    again = tier(tmp_path, tiny_model)
    assert again.entries == {} and again.stats.rejected_entries == 1
    assert not (t.folder / entry_name(e.tokens)).exists()


def test_h5_an_entry_labelled_with_another_models_identity_is_never_used(tmp_path, tiny_models):
    """The identity check, pinned: an entry of the same tokens, a valid file, labelled for model b,
    in model a's folder is neither indexed nor read (nor removed: it is not provably a's)."""
    root = tmp_path / "kv"
    a, b = tier(root, tiny_models.a), tier(root, tiny_models.b)
    assert a.identity != b.identity and a.folder != b.folder
    e = entry(200)
    saved(b, e)
    name = entry_name(e.tokens)
    shutil.copyfile(b.folder / name, a.folder / name)
    fresh = tier(root, tiny_models.a)
    assert fresh.best(e.tokens, 199, 0) is None
    assert (a.folder / name).exists()
    # ... and one swapped in after the index read a's own entry of those tokens is never loaded
    (a.folder / name).unlink()
    saved(a, entry(200))
    indexed = tier(root, tiny_models.a)
    found = indexed.best(e.tokens, 199, 0)
    assert found is not None
    shutil.copyfile(b.folder / name, a.folder / name)
    assert indexed.load(found) is None and indexed.stats.read_entries == 0
    assert (a.folder / name).read_bytes() == (b.folder / name).read_bytes()  # left alone
    # ... and so is one whose identity differs only past the 16 characters its folder's name shows
    (a.folder / name).unlink()
    arrays, metadata = a._encoded(e)
    metadata["identity"] = a.identity[:16] + ("0000" if a.identity[16:] != "0000" else "1111")
    kv_files.write_entry(a.folder / name, arrays, metadata, deadline=time.monotonic() + 60)
    assert tier(root, tiny_models.a).best(e.tokens, 199, 0) is None
    assert indexed.load(found) is None and indexed.stats.read_entries == 0


def test_h5_a_bad_entry_never_enters_the_memory_cache_so_a_stop_never_writes_it_back(loaded, tiny_model, tmp_path):
    first = engine_with(loaded, tmp_path, tiny_model)
    prompt = long_prompt(first)
    expected, _ = ask(first, prompt)
    assert save_all(first).written == 1
    (written,) = first.disk.entries.values()
    path = first.disk.folder / written.name
    arrays, metadata = mx.load(str(path), return_metadata=True)
    metadata.pop(kv_files.CHECKSUM, None)
    poisoned = {k: v * mx.array(float("nan"), dtype=v.dtype) for k, v in arrays.items()}
    path.unlink()
    kv_files.write_entry(path, poisoned, metadata, deadline=time.monotonic() + 60)  # NaN with a valid checksum

    second = engine_with(loaded, tmp_path, tiny_model)
    tokens, end = ask(second, prompt)
    assert tokens == expected and end.cached_disk_tokens == 0  # the reply of a prefill from scratch
    assert second.disk.stats.rejected_entries == 1
    assert save_all(second).written == 1  # the stop writes what this worker computed ...
    back = mx.load(str(path))
    assert all(mx.all(mx.isfinite(a)).item() for a in back.values())  # ... never the NaN it refused


# ------------------------------------------------------------------ one budget per folder


def test_h5_one_kv_folder_has_one_budget_at_a_time(tmp_path, tiny_models, caplog):
    root = tmp_path / "kv"
    first = tier(root, tiny_models.a, GiB)
    with caplog.at_level(logging.WARNING):
        assert open_tier(root, tiny_models.b, 2 * GiB) is None
    (line,) = off_lines(caplog)
    assert "disk_cache_max = 1 GiB" in line and "this one has 2 GiB" in line and str(root) in line
    same = tier(root, tiny_models.b, GiB)  # the same budget: the folder is shared as before
    assert same.budget == first.budget
    del first, same
    gc.collect()  # their workers are gone: the folder takes the next one's budget
    assert tier(root, tiny_models.b, 2 * GiB).budget == 2 * GiB
