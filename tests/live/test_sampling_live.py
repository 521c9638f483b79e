"""The sampling options through HTTP, with the openai, anthropic and ollama clients,
against a real supervisor and a real worker (the tiny model as "a").

The tiny model's greedy reply repeats one token, so the penalties' effect is countable;
token ids for logit_bias come from the same model's tokenizer, loaded here.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import ollama
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_front_door_errors")]

ASK = [{"role": "user", "content": "Once upon a time"}]
N = 12


def _repeats(tokens: list[str]) -> int:
    return sum(n - 1 for n in Counter(tokens).values())


async def _chat(client, **kw):
    kw.setdefault("max_tokens", N)
    return await client.chat.completions.create(model="a", messages=ASK, **kw)


def _tokens(reply) -> list[str]:
    return [c.token for c in reply.choices[0].logprobs.content]


def test_top_k_1_is_greedy_at_a_high_temperature_on_every_api(server):
    async def main():
        oa, an, ol = server.openai(), server.anthropic(), ollama.AsyncClient(host=server.url())
        greedy = await _chat(oa, temperature=0)
        hot = await _chat(oa, temperature=1.8, extra_body={"top_k": 1})
        text_greedy = await oa.completions.create(model="a", prompt="Once upon", max_tokens=N, temperature=0)
        text_hot = await oa.completions.create(model="a", prompt="Once upon", max_tokens=N, temperature=1.8,
                                               extra_body={"top_k": 1})
        an_greedy = await an.messages.create(model="a", max_tokens=N, messages=ASK, extra_body={"temperature": 0})
        an_hot = await an.messages.create(model="a", max_tokens=N, messages=ASK,
                                          extra_body={"temperature": 1.0, "top_k": 1})
        ol_greedy = await ol.chat(model="a", messages=ASK, options={"temperature": 0, "num_predict": N})
        ol_hot = await ol.chat(model="a", messages=ASK, options={"temperature": 1.8, "top_k": 1, "num_predict": N})
        noise = await _chat(oa, temperature=1.8, seed=4)
        return (greedy, hot, text_greedy, text_hot, an_greedy, an_hot, ol_greedy, ol_hot, noise)

    greedy, hot, text_greedy, text_hot, an_greedy, an_hot, ol_greedy, ol_hot, noise = server.run(main())
    assert hot.choices[0].message.content == greedy.choices[0].message.content
    assert text_hot.choices[0].text == text_greedy.choices[0].text
    assert an_hot.content[0].text == an_greedy.content[0].text
    assert ol_hot.message.content == ol_greedy.message.content
    assert noise.choices[0].message.content != greedy.choices[0].message.content  # the control


def test_logit_bias_forces_a_token_and_minus_100_bans_it(server, loaded):
    tokenizer = loaded[1]
    texts = {i: tokenizer.decode([i]) for i in range(3, len(tokenizer.vocab))}

    async def main():
        oa = server.openai()
        greedy = await _chat(oa, temperature=0, logprobs=True)
        said = set(_tokens(greedy))
        forced_id = next(i for i, t in texts.items() if t.strip() and t not in said and len(t) > 1)
        forced = await _chat(oa, temperature=0.9, logprobs=True, logit_bias={str(forced_id): 100})
        banned_ids = {str(i): -100 for i, t in texts.items() if t in said}
        banned = await _chat(oa, temperature=0, logprobs=True, logit_bias=banned_ids)
        text = await oa.completions.create(model="a", prompt="Once upon", max_tokens=4, temperature=0, logprobs=1,
                                           logit_bias={str(forced_id): 100})
        return greedy, forced_id, forced, banned, text

    greedy, forced_id, forced, banned, text = server.run(main())
    assert _tokens(forced) == [texts[forced_id]] * N
    assert all(c.logprob > -0.01 for c in forced.choices[0].logprobs.content)  # +100 leaves nothing else
    assert not set(_tokens(banned)) & set(_tokens(greedy)) and len(_tokens(banned)) == N
    assert text.choices[0].logprobs.tokens == [texts[forced_id]] * 4


def test_logprobs_are_well_formed_streamed_and_not_on_every_api(server):
    async def main():
        oa, ol = server.openai(), ollama.AsyncClient(host=server.url())
        whole = await _chat(oa, temperature=0, logprobs=True, top_logprobs=3)
        chunks = [c async for c in await _chat(oa, temperature=0, logprobs=True, top_logprobs=3, stream=True)]
        text = await oa.completions.create(model="a", prompt="Once upon", max_tokens=N, temperature=0, logprobs=3)
        text_chunks = [c async for c in await oa.completions.create(model="a", prompt="Once upon", max_tokens=N,
                                                                     temperature=0, logprobs=3, stream=True)]
        resp = await oa.responses.create(model="a", input="Once upon a time", max_output_tokens=N, temperature=0,
                                         include=["message.output_text.logprobs"], top_logprobs=2)
        ol_whole = await ol.generate(model="a", prompt="Once upon a time", logprobs=True, top_logprobs=2,
                                     options={"temperature": 0, "num_predict": N})
        ol_parts = [part async for part in await ol.generate(model="a", prompt="Once upon a time", logprobs=True,
                                                            top_logprobs=2, stream=True,
                                                            options={"temperature": 0, "num_predict": N})]
        return whole, chunks, text, text_chunks, resp, ol_whole, ol_parts

    whole, chunks, text, text_chunks, resp, ol_whole, ol_parts = server.run(main())
    content = whole.choices[0].logprobs.content
    assert len(content) == N
    for item in content:
        values = [t.logprob for t in item.top_logprobs]
        assert item.logprob <= 0 and len(values) == 3 and values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob  # greedy
        assert item.bytes == list(item.token.encode())
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == N and all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    assert [t for c in text_chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
        == lp.tokens
    part = resp.output[0].content[0]
    assert len(part.logprobs) == N and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in part.logprobs)
    assert len(ol_whole.logprobs) == N and all(x.logprob <= 0 and len(x.top_logprobs) == 2 for x in ol_whole.logprobs)
    assert [x.token for part in ol_parts for x in (part.logprobs or [])] == [x.token for x in ol_whole.logprobs]


def test_penalties_and_min_p_change_the_reply_on_openai_and_ollama(server):
    async def main():
        oa, ol = server.openai(), ollama.AsyncClient(host=server.url())
        kw = dict(temperature=0, logprobs=True, max_tokens=24)
        greedy = await _chat(oa, **kw)
        frequency = await _chat(oa, frequency_penalty=1.0, extra_body={"frequency_context_size": 64}, **kw)
        presence = await _chat(oa, presence_penalty=2.0, extra_body={"presence_context_size": 64}, **kw)
        repetition = await _chat(oa, extra_body={"repetition_penalty": 2.0, "repetition_context_size": 64}, **kw)
        options = {"temperature": 0, "num_predict": 24}
        ol_greedy = await ol.generate(model="a", prompt="Once upon a time", logprobs=True, options=options)
        ol_penalised = await ol.generate(model="a", prompt="Once upon a time", logprobs=True,
                                         options={**options, "repeat_penalty": 2.0, "presence_penalty": 2.0})
        min_p = await _chat(oa, temperature=2.0, seed=2, logprobs=True, top_logprobs=1, max_tokens=24,
                            extra_body={"min_p": 0.3})
        return greedy, frequency, presence, repetition, ol_greedy, ol_penalised, min_p

    greedy, frequency, presence, repetition, ol_greedy, ol_penalised, min_p = server.run(main())
    assert _repeats(_tokens(greedy)) >= 12, "the control: this model's greedy reply repeats itself"
    for penalised in (frequency, presence, repetition):
        assert _repeats(_tokens(penalised)) < _repeats(_tokens(greedy))
    assert _repeats(_tokens(presence)) == 0
    assert _repeats([x.token for x in ol_penalised.logprobs]) < _repeats([x.token for x in ol_greedy.logprobs])
    floor = math.log(0.3) - 0.01  # float16's rounding, as in test_sampling_engine
    assert all(c.logprob - c.top_logprobs[0].logprob >= floor for c in min_p.choices[0].logprobs.content)


def test_requests_batched_together_keep_their_own_settings(server):
    """Four requests at once decode as rows of one batch in the one worker; each gets what it gets alone."""
    asks = {"greedy": dict(temperature=0),
            "logprobs": dict(temperature=0, logprobs=True, top_logprobs=2),
            "forced": dict(temperature=0, logit_bias={"592": 100}),
            "seeded": dict(temperature=1.2, seed=11, frequency_penalty=0.5, extra_body={"top_k": 30, "min_p": 0.02})}

    streams = server.arbiter.pool.streams

    async def main():
        oa = server.openai()
        alone = {rid: await _chat(oa, **kw) for rid, kw in asks.items()}
        before = streams.batches
        together = await asyncio.gather(*(_chat(oa, **kw) for kw in asks.values()))
        return alone, dict(zip(asks, together)), streams.batches - before

    alone, together, batches = server.run(main())
    assert batches > 0, "the worker never decoded them as rows of one batch"
    for rid in asks:
        assert together[rid].choices[0].message.content == alone[rid].choices[0].message.content, rid
    assert together["logprobs"].choices[0].message.content == together["greedy"].choices[0].message.content
    assert together["greedy"].choices[0].logprobs is None and together["logprobs"].choices[0].logprobs.content
    assert [c.logprob for c in together["logprobs"].choices[0].logprobs.content] == \
        [c.logprob for c in alone["logprobs"].choices[0].logprobs.content]


def test_a_bias_past_the_vocabulary_is_a_400_naming_logit_bias(server):
    import openai

    async def main():
        with pytest.raises(openai.BadRequestError) as err:
            await _chat(server.openai(), logit_bias={"999999": 5})
        return err.value

    err = server.run(main())
    assert err.status_code == 400 and "logit_bias" in err.message


TINY = [1e-5, 1e-30, 1e-38, 1e-40, 1e-300, 5e-324]


def test_a_tiny_temperature_is_greedy_on_every_api_whatever_the_seed(server):
    """1e-40 and 1e-300 are in every API's range but overflowed float32 in the sampler, which
    then drew uniformly: the reply changed with the seed. At or below the worker's floor
    (worker/sampling.py GREEDY_AT_OR_BELOW) each API's reply is its temperature-0 reply, for
    every seed (Responses and Messages take none: two unseeded runs)."""

    async def main():
        oa, an, ol = server.openai(), server.anthropic(), ollama.AsyncClient(host=server.url())

        async def replies(temperature: float, seed: int | None) -> tuple[str, ...]:
            seeded = {} if seed is None else {"seed": seed}
            chat = await _chat(oa, temperature=temperature, **seeded)
            text = await oa.completions.create(model="a", prompt="Once upon", max_tokens=N, temperature=temperature,
                                               **seeded)
            response = await oa.responses.create(model="a", input="Once upon a time", max_output_tokens=N,
                                                 temperature=temperature)
            message = await an.messages.create(model="a", max_tokens=N, messages=ASK,
                                             extra_body={"temperature": temperature})
            options = {"temperature": temperature, "num_predict": N, **seeded}
            ol_chat = await ol.chat(model="a", messages=ASK, options=options)
            ol_text = await ol.generate(model="a", prompt="Once upon", options=options)
            return (chat.choices[0].message.content or "", text.choices[0].text, response.output_text,
                    "".join(b.text for b in message.content if b.type == "text"), ol_chat.message.content or "",
                    ol_text.response)

        greedy = await replies(0.0, None)
        return greedy, {(t, seed): await replies(t, seed) for t in TINY for seed in (1, 2)}

    greedy, swept = server.run(main(), timeout=600)
    assert all(greedy)  # six non-empty replies to compare with
    for (temperature, seed), got in swept.items():
        assert got == greedy, (temperature, seed)
