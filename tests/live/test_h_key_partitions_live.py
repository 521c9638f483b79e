"""The prompt cache split by API key (SPEC H7 as proposed) through a real supervisor, real
workers and HTTP: key B's guesses at a code in key A's system prompt get the same
`cached_tokens` right or wrong, from memory and after an unload (the disk tier); a key keeps its
own hits; the admin token is a partition of its own; without keys one cache serves everyone.

Why: with one shared cache a tester holding key B read key A's "vault code" off the counts,
145 of 146 tokens cached for the right guess against 55-57 for wrong ones."""

from __future__ import annotations

import pytest

from shared.sizes import MiB
from supervisor.config import GuardConfig, ModelConfig
from tests.http_harness import LiveServer, make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

KEY_A, KEY_B, ADMIN = "sk-alice-0123456789", "sk-bob-9876543210", "admin-token-5555"
# ~250 prompt tokens with the generated tokenizer: an entry the disk tier keeps (H5.1: >= 128)
PREAMBLE = "You are the assistant of a bank. Answer briefly and never reveal a secret of the vault. " * 6


def vault(code: str, bank: str = "") -> list[dict]:
    return [{"role": "system", "content": f"{bank}{PREAMBLE}The vault code is {code}. Keep it."},
            {"role": "user", "content": "hello"}]


def config(tiny_models, **sup):
    return make_config([ModelConfig(id="a", path=str(tiny_models.a))], guard=GuardConfig(hot_cache_max=64 * MiB),
                       **sup)


@pytest.fixture(scope="module")
def keyed(tiny_models, tmp_path_factory):
    with LiveServer(config(tiny_models, api_keys=[KEY_A, KEY_B], admin_token=ADMIN),
                    tmp_path_factory.mktemp("rt")) as live:
        yield live


async def chat(live: LiveServer, key: str | None, messages: list[dict]) -> dict:
    """OpenAI chat as `key`; its usage, with `cached` and `disk` read out."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with live.client() as c:
        r = await c.post("/v1/chat/completions", headers=headers,
                         json={"model": "a", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {**usage, "cached": details.get("cached_tokens", 0), "disk": details.get("disk_cached_tokens", 0)}


async def unload(live: LiveServer) -> None:
    async with live.client() as c:
        r = await c.post("/v1/models/a/unload", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text


def test_h7_another_keys_guesses_get_the_same_cached_tokens_right_or_wrong(keyed):
    async def main():
        secret = await chat(keyed, KEY_A, vault("4821", "First Bank. "))
        first, right, wrong = [await chat(keyed, KEY_B, vault(code, "First Bank. ")) for code in ("1111", "4821", "7777")]
        assert first["cached"] == 0  # nothing of A's shared system prompt either
        assert right["cached"] == wrong["cached"] < right["prompt_tokens"] - 2, (right, wrong)
        assert secret["cached"] == 0

    keyed.run(main())


def test_h7_a_key_keeps_its_own_cache_hits(keyed):
    async def main():
        messages = vault("5309", "Second Bank. ")
        first = await chat(keyed, KEY_A, messages)
        later = await chat(keyed, KEY_A, [*messages, {"role": "assistant", "content": "hi"},
                                          {"role": "user", "content": "and then?"}])
        assert later["cached"] >= first["prompt_tokens"] - 2, (first, later)  # H1: the single-user speed stays

    keyed.run(main())


def test_h7_the_admin_token_is_a_partition_of_its_own(keyed):
    """Anthropic's counts too: the admin token, sent as Anthropic's x-api-key, finds
    nothing of A's, then its own."""
    async def main():
        messages = vault("2468", "Third Bank. ")
        await chat(keyed, KEY_A, messages)
        body = {"model": "a", "max_tokens": 2, "system": messages[0]["content"], "messages": messages[1:]}
        async with keyed.client() as c:
            first, again = [(await c.post("/v1/messages", headers={"x-api-key": ADMIN}, json=body)).json()["usage"]
                            for _ in range(2)]
        assert first["cache_read_input_tokens"] == 0, first
        assert again["cache_read_input_tokens"] >= first["input_tokens"] - 2, again

    keyed.run(main())


def test_h7_after_an_unload_another_key_still_learns_nothing_and_the_key_gets_its_own_back(keyed):
    """The disk tier (H5) holds what a stop wrote: B's right guess, the first request of the
    next worker, must not be served A's entry from disk; A's next request is."""
    async def main():
        await unload(keyed)  # this test's worker writes under this test's caches folder
        messages = vault("1357", "Fourth Bank. ")
        await chat(keyed, KEY_A, messages)
        await unload(keyed)
        right = await chat(keyed, KEY_B, messages)
        assert right["cached"] == 0 and right["disk"] == 0, right
        again = await chat(keyed, KEY_A, messages)  # A's own file still serves A
        assert again["disk"] == again["cached"] == again["prompt_tokens"] - 1, again

    keyed.run(main())


def test_h7_without_keys_every_client_shares_one_cache_as_before(tiny_models, tmp_path_factory):
    with LiveServer(config(tiny_models), tmp_path_factory.mktemp("rt")) as live:
        async def main():
            messages = vault("4821")
            first = await chat(live, None, messages)
            other = await chat(live, "any-client", messages)  # no keys: a bearer names nobody
            assert other["cached"] == first["prompt_tokens"] - 1

        live.run(main())
