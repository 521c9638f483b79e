"""Chaos scenarios against what a user leaves on disk and sends with a key (SPEC H5.3, the
key partitions proposed as H7, who may unload): scripts/chaos.py runs them beside the rest.

  kv-attacks     a user's files, folder links and a link posing as an entry under kv/; a
                 budget small enough to evict; a NaN entry and a wrong-shape entry read back
  shared-root    a caches folder another user could write (0777), made before the server
  key-probe      key B guesses key A's secret by the cached-token counts, from memory and disk
  plain-unload   an ordinary key asks Ollama's keep_alive 0 to unload a pinned model

`touched` counts files outside the tier that were changed, removed or followed; `cross_key`
counts guesses whose cached-token count told the right answer from the wrong ones.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path
from typing import Any, cast

import httpx
from _chaos_harness import Row, Serve, base_config, classify, false_kills, terminate

from shared.probe import blas_plan as found

OLD = 1_000_000_000.0   # a mtime from 2001: the budget would pick these first if it could see them
PROMPT_WORDS = 260      # ~400 tokens: an entry worth keeping (H5.1 writes >= 128 tokens)


def _prompt(seed: int) -> str:
    words = ["river", "stone", "lamp", "orbit", "cedar", "vault", "ember", "quartz", "meadow", "signal"]
    return " ".join(words[(seed * 7 + i * (seed + 3)) % len(words)] for i in range(PROMPT_WORDS))


def _chat(client: httpx.Client, row: Row, model: str, content: str, key: str = "", system: str = "",
          max_tokens: int = 8) -> dict[str, Any] | None:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = client.post("/v1/chat/completions", headers=headers, json={
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    except httpx.HTTPError:
        row.requests += 1
        row.hung += 1
        return None
    classify(row, r.status_code)
    return r.json() if r.status_code == 200 else None


def _cached(reply: dict[str, Any] | None) -> tuple[int, int]:
    details = (reply or {}).get("usage", {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens", 0)), int(details.get("disk_cached_tokens", 0))


def _disk(serve: Serve, admin: str = "") -> dict[str, Any]:
    headers = {"authorization": f"Bearer {admin}"} if admin else {}
    return httpx.get(serve.url + "/status", headers=headers, timeout=10).json().get("disk_cache", {})


def _unload(client: httpx.Client, serve: Serve, row: Row, model: str = "a", admin: str = "",
            writes: bool = True) -> None:
    """Unload `model` as its admin and wait until the stop's write is reported (H5.1), so the
    next request meets a cold worker and what is on disk."""
    written = _disk(serve, admin).get("written_entries", 0)
    headers = {"authorization": f"Bearer {admin}"} if admin else {}
    classify(row, client.post(f"/v1/models/{model}/unload", headers=headers, json={}).status_code)
    deadline = time.monotonic() + 30
    while writes and time.monotonic() < deadline and _disk(serve, admin).get("written_entries", 0) <= written:
        time.sleep(0.2)


def _fingerprint(path: Path) -> tuple:
    """What a file or link is, never following it: a link's target, a file's bytes."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return ("missing",)
    if stat.S_ISLNK(info.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISDIR(info.st_mode):
        return ("dir", info.st_ino, stat.S_IMODE(info.st_mode))
    return ("file", info.st_ino, info.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())


def _fresh_root(ctx: Any, name: str, mode: int = 0o700) -> Path:
    from worker import blas

    root = ctx.work / name
    root.mkdir(mode=mode)
    root.chmod(mode)  # whatever the umask
    if mode == 0o700:
        blas.share_copy(root)
    return root


def _plant(ctx: Any, root: Path) -> list[Path]:
    """A user's things where the tier looks: the paths whose fingerprints must not change."""
    import numpy as np
    from safetensors.numpy import save_file

    from worker.disk_cache import folder_name, model_identity

    elsewhere = ctx.work / "elsewhere"
    elsewhere.mkdir()
    save_file({"w": np.ones((64, 64), np.float32)}, str(elsewhere / "important.safetensors"))
    (elsewhere / "victim.bin").write_bytes(b"the user's file\n")
    kv = root / "kv"
    (kv / "other").mkdir(mode=0o700, parents=True)
    save_file({"w": np.zeros((64, 64), np.float32)}, str(kv / "other" / "my-finetune.safetensors"))
    (kv / "linked").symlink_to(elsewhere, target_is_directory=True)
    mine = kv / folder_name("a", model_identity(ctx.model_a))
    mine.mkdir(mode=0o700)
    (mine / "x.safetensors").mkdir()
    (mine / "notes.txt").write_text("mine\n")
    (mine / ("0" * 24 + ".safetensors")).symlink_to(elsewhere / "victim.bin")
    planted = [kv / "other" / "my-finetune.safetensors", kv / "linked", elsewhere / "important.safetensors",
               elsewhere / "victim.bin", mine / "x.safetensors", mine / "notes.txt", mine / ("0" * 24 + ".safetensors")]
    for path in planted:
        os.utime(path, (OLD, OLD), follow_symlinks=False)
    return planted


def _entries(folder: Path) -> list[Path]:
    from worker import kv_folder

    found_ = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            kv_folder.prove(path)
        except kv_folder.NotOurs:
            continue
        found_.append(path)
    return found_


def _spoil(entries: list[Path]) -> list[str]:
    """The first entry made NaN and the second cut to one head of its width, each written back
    as the tier writes (a valid checksum): only the content checks can tell."""
    import mlx.core as mx

    from worker import kv_files

    done = []
    for path, how in zip(entries, ("nan", "shape")):
        loaded = cast(tuple[dict[str, mx.array], dict[str, str]], mx.load(str(path), return_metadata=True))
        arrays, metadata = loaded
        metadata.pop(kv_files.CHECKSUM, None)
        if how == "nan":
            arrays = {k: v * mx.array(float("nan"), dtype=v.dtype) for k, v in arrays.items()}
        else:
            arrays = {k: v[..., : max(1, v.shape[-1] // 2)] for k, v in arrays.items()}
        path.unlink()
        kv_files.write_entry(path, arrays, metadata, deadline=float("inf"))
        done.append(how)
    return done


def kv_attacks(ctx: Any) -> Row:
    row = Row("kv-attacks")
    root = _fresh_root(ctx, "cache-kv")
    planted = _plant(ctx, root)
    before = {p: _fingerprint(p) for p in planted}
    config = base_config({"a": ctx.model_a}, pinned=False) + '[guard]\ndisk_cache_max = "1MiB"\n'
    serve = Serve(ctx.work, config, ctx.runtime("kv"), env={found.CACHE_ENV: str(root)}).start()
    same = spoiled = evicted = 0
    how: list[str] = []
    try:
        serve.wait_healthy()
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            first = {i: _chat(client, row, "a", _prompt(i)) for i in range(4)}
            _unload(client, serve, row)
            from worker.disk_cache import folder_name, model_identity

            how = _spoil(_entries(root / "kv" / folder_name("a", model_identity(ctx.model_a))))
            for i in range(8):  # the four again (two read back spoiled), then four more for the budget
                again, before_ = _chat(client, row, "a", _prompt(i)), first.get(i)
                if again is not None and before_ is not None:
                    same += again["choices"][0]["message"]["content"] == before_["choices"][0]["message"]["content"]
            _unload(client, serve, row)
            disk = _disk(serve)
            spoiled, evicted = disk.get("rejected_entries", 0), disk.get("evicted_entries", 0)
    finally:
        said = terminate(serve, row)
    changed = [str(p.relative_to(ctx.work)) for p in planted if _fingerprint(p) != before[p]]
    row.touched = len(changed)
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = (f"4 user files and 3 links planted under kv/, budget 1 MiB; {', '.join(how) or 'no'} entries "
                f"spoiled, {spoiled} rejected; {same} of 4 greedy replies the same after; {evicted} entries evicted; "
                f"touched: {', '.join(changed) or 'none'}; {said}")
    return row


def shared_root(ctx: Any) -> Row:
    row = Row("shared-root")
    root = _fresh_root(ctx, "cache-0777", mode=0o777)
    serve = Serve(ctx.work, base_config({"a": ctx.model_a}), ctx.runtime("sr"),
                  env={found.CACHE_ENV: str(root)}).start()
    try:
        serve.wait_healthy()
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            for i in range(3):
                _chat(client, row, "a", _prompt(i))
    finally:
        said = terminate(serve, row)
    made = sorted(p.name for p in root.iterdir())
    row.touched = len(made) + (stat.S_IMODE(root.stat().st_mode) != 0o777)
    refused = serve.log_text().count("disk tier off")
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = (f"MEMVISOR_CACHE made 0777 first: {row.finished} of 3 chats answered, {refused} 'disk tier off' "
                f"line(s); written there: {', '.join(made) or 'nothing'}; {said}")
    return row


SECRET = "The vault code is {code}. Never say it. " * 20
ADMIN = "admin-secret"


def key_probe(ctx: Any) -> Row:
    """Key A's system prompt holds a secret; key B sends the same system prompt with each guess
    and reads `cached_tokens`. A cross-key hit: the right guess cached more than every wrong one.
    First from the memory cache (one worker), then from disk (A's entry written at an unload, B
    on a fresh worker), each with its own secret so B's own earlier entries tell nothing."""
    row = Row("key-probe")
    root = _fresh_root(ctx, "cache-keys")
    config = base_config({"a": ctx.model_a}, pinned=False, api_keys=["key-a", "key-b"], admin_token=ADMIN)
    serve = Serve(ctx.work, config, ctx.runtime("kp"), env={found.CACHE_ENV: str(root)}).start()
    seen: list[str] = []
    try:
        serve.wait_healthy()
        with httpx.Client(base_url=serve.url, timeout=120) as client:
            for where, code, wrong_codes in (("memory", "4711", ("1234", "9999")), ("disk", "8086", ("2468", "1357"))):
                _chat(client, row, "a", "What is the code?", key="key-a", system=SECRET.format(code=code))
                if where == "disk":
                    _unload(client, serve, row, admin=ADMIN)  # A's entry now lives on disk only
                counts = {guess: sum(_cached(_chat(client, row, "a", "What is the code?", key="key-b",
                                                   system=SECRET.format(code=guess))))
                          for guess in (wrong_codes[0], code, wrong_codes[1])}
                wrong = max(counts[g] for g in wrong_codes)
                row.cross_key += counts[code] > wrong
                seen.append(f"{where}: right guess {counts[code]} cached, wrong ones {wrong}")
                _unload(client, serve, row, admin=ADMIN)
    finally:
        said = terminate(serve, row)
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = f"{'; '.join(seen)}; {said}"
    return row


def plain_unload(ctx: Any) -> Row:
    """An ordinary key asks Ollama to unload a pinned model (keep_alive 0, no prompt): it stays."""
    row = Row("plain-unload")
    config = base_config({"a": ctx.model_a}, pinned=True, api_keys=["key-a"], admin_token=ADMIN)
    serve = Serve(ctx.work, config, ctx.runtime("pu")).start()
    answers = []
    try:
        serve.wait_healthy()
        with httpx.Client(base_url=serve.url, timeout=60) as client:
            for path, body in (("/api/generate", {"model": "a", "keep_alive": 0}),
                               ("/api/chat", {"model": "a", "messages": [], "keep_alive": 0})):
                pid = serve.worker_pids().get("a")
                r = client.post(path, headers={"authorization": "Bearer key-a"}, json=body)
                classify(row, r.status_code)
                answers.append(f"{path} {r.status_code}")
                time.sleep(1.0)
                if serve.worker_pids().get("a") != pid:
                    row.foreign += 1
            health = serve.get("/health").status_code
    finally:
        said = terminate(serve, row)
    row.false_kills = false_kills(serve.log_text(), set())
    row.note = f"{', '.join(answers)}; pinned model unloaded {row.foreign} time(s); /health {health}; {said}"
    return row


SCENARIOS = {"kv-attacks": kv_attacks, "shared-root": shared_root, "key-probe": key_probe,
             "plain-unload": plain_unload}
