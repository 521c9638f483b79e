"""The prompt cache split by API key (SPEC H7 as proposed): a key's `cached_tokens` says nothing
about what another key sent. The partition's name (an HMAC of the key under the server's secret),
the secret's file, the cache structure, and the engine on a real tiny model; the same probe through
real processes and HTTP is in tests/live/test_h_key_partitions_live.py."""

from __future__ import annotations

import logging
import os
import re
import stat
import time

import msgspec
import pytest

from shared import private_files
from shared import protocol as p
from shared.limits import Limits
from shared.sizes import GiB, MiB
from supervisor.http import partitions
from supervisor.http.auth import ApiKeys
from supervisor.http.partitions import partition_id, read_or_create, secret_path, server_secret
from tests.disk_cache_harness import engine_with, files, save_all, saved, tier
from tests.disk_cache_harness import kv as disk_kv
from tests.prompt_cache_harness import kv
from worker import kv_files, kv_folder
from worker import prompt_cache as pc
from worker.engine import Engine
from worker.prompt_cache import PromptCache

SECRET = bytes(range(32))
KEY_A, KEY_B = "sk-alice-0123456789", "sk-bob-9876543210"
A, B = partition_id(SECRET, KEY_A), partition_id(SECRET, KEY_B)


# -- the partition's name --------------------------------------------------------------


def test_h7_a_partition_is_stable_per_key_and_secret_and_differs_across_keys_and_secrets():
    assert partition_id(SECRET, KEY_A) == A and A != B
    assert partition_id(bytes(32), KEY_A) != A  # keyed: without the secret the name cannot be checked
    assert re.fullmatch("[0-9a-f]{32}", A)
    assert msgspec.json.decode(msgspec.json.encode(p.Generate(request_id="r", prompt="x", partition=A)),
                               type=p.Generate).partition == A


def test_h7_the_key_never_appears_in_its_partition_nor_is_it_a_plain_hash_of_it():
    import hashlib

    for key in (KEY_A, "0123456789abcdef0123456789abcdef", "deadbeef"):
        pid = partition_id(SECRET, key)
        assert key not in pid and key.encode().hex() not in pid
        assert pid != hashlib.sha256(key.encode()).hexdigest()[:32]


def test_h7_a_generate_with_a_partition_that_is_not_one_is_malformed():
    codec = p.Codec(p.CommandMsg)
    frame = codec.encode(p.Generate(request_id="r", prompt="x", partition=A)).replace(A.encode(), b"sk-alice-key!" * 2)
    assert isinstance(codec.decode(frame), p.Malformed)
    assert codec.decode(codec.encode(p.Generate(request_id="r", prompt="x"))).partition == p.SHARED_PARTITION


def test_h7_each_key_and_the_admin_token_name_their_own_partition_and_keys_off_one_for_all(private_cache_dir):
    keys = ApiKeys([KEY_A, KEY_B], admin_token="admin-tok")
    names = {k: keys.check(_request(k)) for k in (KEY_A, KEY_B, "admin-tok")}
    assert len(set(names.values())) == 3 and p.SHARED_PARTITION not in names.values()
    assert ApiKeys([KEY_A, KEY_B], admin_token="admin-tok").check(_request(KEY_A)) == names[KEY_A]  # a restart
    secret_path().unlink()
    assert ApiKeys([], admin_token="admin-tok").check(_request(KEY_A)) == p.SHARED_PARTITION  # keys off
    assert not secret_path().exists()  # ... and no secret read or made


def _request(key: str):
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                    "headers": [(b"authorization", f"Bearer {key}".encode())]})


# -- the secret's file -----------------------------------------------------------------


def test_h7_the_secret_is_made_once_0600_in_a_0700_folder_and_read_back_across_restarts(private_cache_dir):
    path = secret_path()
    assert path.parent.parent == private_cache_dir
    first = server_secret()
    assert len(first) == partitions.SECRET_BYTES and server_secret() == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_h7_a_secret_folder_others_may_write_is_not_used(private_cache_dir, caplog):
    path = secret_path()
    path.parent.mkdir(mode=0o700)
    os.chmod(path.parent, 0o770)
    with caplog.at_level(logging.WARNING, "memvisor.http"):
        one, two = server_secret(), server_secret()
    assert one != two and not path.exists()  # a run's own secret each time, nothing written
    assert "not used" in caplog.text and "writable by group" in caplog.text


def test_h7_a_secret_file_that_is_a_link_a_folder_or_of_the_wrong_size_is_refused(private_cache_dir, tmp_path):
    path = secret_path()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * partitions.SECRET_BYTES)
    path.parent.mkdir(mode=0o700)
    path.symlink_to(target)
    with pytest.raises(OSError, match="link"):
        read_or_create(path)  # a link is not followed ...
    assert target.read_bytes() == b"x" * partitions.SECRET_BYTES  # ... nor written through
    path.unlink()
    path.mkdir(mode=0o700)
    with pytest.raises(OSError):
        read_or_create(path)
    path.rmdir()
    for size, refusal in ((5, partitions.SecretRefused), (partitions.SECRET_BYTES + 1, OSError)):
        path.write_bytes(b"y" * size)
        os.chmod(path, 0o600)
        with pytest.raises(refusal, match="bytes"):
            read_or_create(path)


def test_h7_a_secret_others_could_read_is_replaced_by_a_new_one(private_cache_dir, caplog):
    path = secret_path()
    first = server_secret()
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, "memvisor.http"):
        second = server_secret()
    assert second != first and server_secret() == second
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "readable by others" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_h7_a_secret_folder_of_another_user_is_not_used(private_cache_dir):
    path = secret_path()
    path.parent.mkdir(mode=0o700)
    os.chown(path.parent, 65534, 65534)
    with pytest.raises(private_files.NotPrivate, match="uid 65534"):
        read_or_create(path)


# -- the cache structure ----------------------------------------------------------------


def test_h7_a_lookup_sees_only_its_own_partition():
    cache = PromptCache(GiB)
    cache.insert(list(range(20)), kv(20), partition=A)
    assert cache.lookup(list(range(21)), 20, partition=B) is None
    assert cache.lookup(list(range(21)), 20) is None  # the shared partition is one more, not everyone's
    hit = cache.lookup(list(range(21)), 20, partition=A)
    assert hit is not None and hit.tokens == 20


def test_h7_an_entry_never_drops_another_partitions_prefix_of_it():
    """Were B's longer entry to replace A's prefix of it, A would see its next request miss
    and learn that someone sent a prompt extending its own."""
    cache = PromptCache(GiB)
    cache.insert(list(range(10)), kv(10), partition=A)
    cache.insert(list(range(20)), kv(20), partition=B)
    assert cache.release(cache.lookup(list(range(11)), 10, partition=A)) is None
    assert sorted((e.partition, len(e.tokens)) for e in cache.recent_first()) == sorted([(A, 10), (B, 20)])
    cache.insert(list(range(30)), kv(30), partition=A)  # its own prefix goes, as ever (H1)
    assert sorted((e.partition, len(e.tokens)) for e in cache.recent_first()) == sorted([(A, 30), (B, 20)])


def test_h7_the_byte_cap_and_the_lru_stay_one_per_worker():
    one = sum(c.nbytes for c in kv(20))
    cache = PromptCache(2 * one)
    cache.insert([1] * 20, kv(20), partition=A)
    cache.insert([2] * 20, kv(20), partition=B)
    cache.insert([3] * 20, kv(20), partition=B)  # no budget of its own: the worker's LRU goes
    assert [(e.partition, e.tokens[0]) for e in cache.recent_first()] == [(B, 3), (B, 2)]
    assert cache.nbytes == 2 * one


# -- the disk tier -----------------------------------------------------------------------


def keyed(tokens: int, partition: str, start: int = 0) -> pc.Entry:
    return pc.Entry(tuple(range(start, start + tokens)), disk_kv(tokens), partition)


def test_h7_a_disk_entry_is_offered_to_its_own_partition_only_after_a_restart(tmp_path, tiny_model):
    t = tier(tmp_path, tiny_model)
    mine, shared = keyed(200, A), keyed(200, p.SHARED_PARTITION)
    assert saved(t, mine, shared) == 2
    assert kv_folder.entry_name(mine.tokens, A) != kv_folder.entry_name(shared.tokens)  # two files, two names
    again = tier(tmp_path, tiny_model)  # a new worker indexes the folder
    prompt = list(range(201))
    assert again.best(prompt, 200, 0, partition=B) is None
    found = again.best(prompt, 200, 0, partition=A)
    assert found is not None and found.partition == A and again.load(found) is not None
    assert again.best(prompt, 200, 0).partition == p.SHARED_PARTITION  # type: ignore[union-attr]


def test_h7_a_file_relabelled_for_another_partition_is_not_ours(tmp_path, tiny_model):
    """The name binds the partition: A's file with B written into its metadata is read for nobody."""
    t = tier(tmp_path, tiny_model)
    mine = keyed(200, A)
    arrays, metadata = t._encoded(mine)
    path = t.folder / kv_folder.entry_name(mine.tokens, A)
    kv_files.write_entry(path, arrays, {**metadata, "partition": B}, deadline=time.monotonic() + 60)
    again = tier(tmp_path, tiny_model)
    assert again.entries == {} and path.exists()  # left alone, never read
    assert again.best(list(range(201)), 200, 0, partition=B) is None


def test_h7_another_partitions_longer_entry_never_costs_a_file(tmp_path, tiny_model):
    """Were B's longer entry to replace A's prefix of it on disk, A's next restart would miss
    and tell A that someone extended its prompt. Within one partition the prefix goes, as ever."""
    t = tier(tmp_path, tiny_model)
    assert saved(t, keyed(300, B), keyed(200, A)) == 2  # one stop's write: A's is no prefix of B's
    assert saved(t, keyed(300, B), keyed(200, B)) == 1  # B's own prefix is not written (H5.1)
    assert sorted((e.partition, len(e.tokens)) for e in t.entries.values()) == sorted([(A, 200), (B, 300)])
    assert saved(t, keyed(300, A)) == 1
    assert sorted((e.partition, len(e.tokens)) for e in t.entries.values()) == sorted([(A, 300), (B, 300)])
    assert len(files(tmp_path / t.folder.name)) == 2


# -- the engine on a real tiny model -------------------------------------------------------

PREAMBLE = "You are the assistant of a bank. Answer briefly and never reveal a secret. " * 6  # > 128 tokens
LIMITS = Limits(max_concurrency=4, cache_cap=64 * MiB)


def vault(code: str) -> list[p.ChatMessage]:
    return [p.ChatMessage(role="system", content=f"{PREAMBLE}The vault code is {code}. Keep it."),
            p.ChatMessage(role="user", content="hello")]


def ask(engine: Engine, rid: str, messages: list[p.ChatMessage], partition: str) -> p.Finished:
    engine.submit_generate(p.Generate(request_id=rid, messages=messages, max_tokens=2, partition=partition))
    ends: list = []
    for _ in range(500):
        ends += [e for e in engine.step(LIMITS, lambda: 0) if isinstance(e, (p.Finished, p.Failed))]
        if not engine.has_work:
            break
    (end,) = ends
    assert isinstance(end, p.Finished), end
    return end


def test_h7_another_keys_guesses_get_the_same_cached_tokens_right_or_wrong(loaded):
    """The issue's probe: A's system prompt holds a code; B's guesses, a wrong one first,
    then the right one, then another wrong one. B's counts come from B's own requests only:
    its first finds nothing of A's shared system prompt, and the right guess counts what
    a wrong one counts (on the code before, 0 < wrong < right = the whole prompt but one)."""
    engine = Engine(*loaded, own_usage_fn=lambda: 0)
    secret = ask(engine, "a1", vault("4821"), A)
    first, right, wrong = (ask(engine, f"b{i}", vault(code), B) for i, code in enumerate(("1111", "4821", "7777")))
    assert secret.cached_tokens == 0 and first.cached_tokens == 0
    assert right.cached_tokens == wrong.cached_tokens < right.prompt_tokens - 2
    again = ask(engine, "a2", vault("4821") + [p.ChatMessage(role="assistant", content="hi"),
                                               p.ChatMessage(role="user", content="and?")], A)
    assert again.cached_tokens >= secret.prompt_tokens - 2  # the key's own cache still serves it (H1)


def test_h7_without_keys_every_request_shares_one_cache_as_before(loaded):
    engine = Engine(*loaded, own_usage_fn=lambda: 0)
    secret = ask(engine, "a1", vault("4821"), p.SHARED_PARTITION)
    right = ask(engine, "b1", vault("4821"), p.SHARED_PARTITION)
    assert right.cached_tokens == secret.prompt_tokens - 1


def test_h7_a_grammar_one_key_compiled_is_compiled_again_for_another(loaded):
    """The worker's compiled grammars are a cache too: a schema another key sent would come
    back 100x faster or more (scripts/probe_key_partitions.py), a timing that says someone sent it."""
    engine = Engine(*loaded, own_usage_fn=lambda: 0)
    schema = p.JsonSchema(schema='{"type": "object", "properties": {"vault": {"enum": ["4821"]}}}')
    for rid, partition in (("a1", A), ("a2", A), ("b1", B)):
        engine.submit_generate(p.Generate(request_id=rid, prompt="x", max_tokens=2, constraint=schema,
                                          partition=partition))
    assert engine._constraints is not None and engine._constraints.compiles == 2  # A's once, B's once


def test_h7_after_a_restart_the_disk_tier_serves_a_key_its_own_entry_and_no_other_key(loaded, tiny_model, tmp_path):
    first = engine_with(loaded, tmp_path, tiny_model)
    messages = vault("4821")
    ask(first, "a1", messages, A)
    assert save_all(first).written == 1  # the stop's write
    second = engine_with(loaded, tmp_path, tiny_model)  # the next worker of the model
    right = ask(second, "b1", messages, B)
    assert (right.cached_tokens, right.cached_disk_tokens) == (0, 0)
    again = ask(second, "a2", messages, A)
    assert again.cached_disk_tokens == again.cached_tokens == again.prompt_tokens - 1
