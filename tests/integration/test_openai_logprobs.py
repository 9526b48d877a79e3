"""Logprobs and echo with the official ``openai`` client, through a PD cluster and a
hybrid one on real engine processes (tiny model, TCP KV transport): greedy tokens and
their logprobs are the same either way, streamed or not, and a stream continued on
another decode engine after a kill keeps them flowing. The kill runs last."""

from __future__ import annotations

import signal

import openai
import pytest

from tests.integration.test_coordinator_pd import TOK, assert_all_free, engine_call, serve
from tests.integration.test_coordinator_pd import engines as engines  # noqa: F401 (fixture)

CLUSTERS = {"pd": ["P1", "D1", "D2"], "hybrid": ["H"]}
PROMPT = "Logprobs say how sure the model was of each token."
CHAT = [{"role": "user", "content": PROMPT}]


def client_for(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)


def chat_logprobs(client: openai.OpenAI, stream: bool):
    """(text, token ids, [(token, logprob, bytes, [(alternative, logprob)])]) of a greedy chat."""
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body={"return_token_ids": True})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        entries, text = choice.logprobs.content, choice.message.content
        ids = choice.model_extra["token_ids"]
    else:
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        ids = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]
        entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    return text, ids, [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
                       for e in entries]


def completion_logprobs(client: openai.OpenAI, stream: bool, echo: bool):
    """(text, token ids, tokens, token_logprobs, top_logprobs, text_offset) of a greedy
    completion."""
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, echo=echo,
                  extra_body={"return_token_ids": True})
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        lp = choice.logprobs
        return (choice.text, choice.model_extra["token_ids"], lp.tokens, lp.token_logprobs,
                lp.top_logprobs, lp.text_offset)
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    return ("".join(c.choices[0].text for c in chunks),
            [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []],
            [t for p in parts for t in p.tokens], [x for p in parts for x in p.token_logprobs],
            [x for p in parts for x in p.top_logprobs], [x for p in parts for x in p.text_offset])


def assert_same(a, b) -> None:
    """Equal, floats within 1e-4 (two batch shapes round differently)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, float):
        assert a == pytest.approx(b, abs=1e-4)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def on_each_cluster(engines, loop, ask) -> dict:
    """``ask(client)`` through a Coordinator on the PD engines, then on the hybrid one."""
    _, addrs = engines
    results = {}
    for name, names in CLUSTERS.items():
        with serve(loop, addrs, names) as app:
            results[name] = ask(client_for(app))
    return results


def test_chat_logprobs_are_the_same_through_pd_and_hybrid(engines, loop):
    _, addrs = engines
    results = on_each_cluster(engines, loop,
                              lambda c: [chat_logprobs(c, stream) for stream in (False, True)])
    for name in CLUSTERS:
        (text, ids, entries), streamed = results[name]
        assert len(entries) == len(ids) == 12 and text == TOK.decode(ids)
        assert_same(streamed, results[name][0])
        for token_id, (token, logprob, token_bytes, top) in zip(ids, entries, strict=True):
            assert token == TOK.decode([token_id]) and token_bytes == list(token.encode())
            assert len(top) == 3 and top[0][0] == token  # greedy: the likeliest
            assert logprob == pytest.approx(top[0][1]) and logprob <= 0
    assert_same(results["pd"], results["hybrid"])
    assert_all_free(addrs, "P1", "D1", "D2", "H")


def test_completion_echo_puts_the_prompt_and_its_logprobs_first(engines, loop):
    _, addrs = engines

    def ask(client):
        plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                          temperature=0, echo=True)
        assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
        return {(stream, echo): completion_logprobs(client, stream, echo)
                for stream in (False, True) for echo in (False, True)}

    results = on_each_cluster(engines, loop, ask)
    for name in CLUSTERS:
        got = results[name]
        text, ids, tokens, token_lps, top, offsets = got[(False, False)]
        assert len(ids) == 10 and text == TOK.decode(ids)
        assert tokens == [TOK.decode([t]) for t in ids]  # each token's text decoded alone
        # 2 alternatives and the token itself (texts of different ids may coincide: U+FFFD)
        assert all(1 <= len(t) <= 3 and token in t for t, token in zip(top, tokens, strict=True))
        assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        e_text, e_ids, e_tokens, e_lps, e_top, e_offsets = got[(False, True)]
        assert e_text == PROMPT + text and e_ids == ids
        prompt_ids = TOK.encode(PROMPT)
        assert e_tokens == [TOK.decode([t]) for t in prompt_ids] + tokens
        assert e_lps[0] is None and e_top[0] is None  # nothing predicts the first token
        assert all(x is not None for x in e_lps[1:]) and all(x <= 0 for x in e_lps[1:])
        assert_same(e_lps[len(prompt_ids):], token_lps)
        assert e_offsets == [sum(map(len, e_tokens[:i])) for i in range(len(e_tokens))]
        for echo in (False, True):
            assert_same(got[(True, echo)], got[(False, echo)])
    assert_same(results["pd"], results["hybrid"])
    assert_all_free(addrs, "P1", "D1", "D2", "H")


def kill_the_running_decode(app, procs, addrs) -> str:
    """SIGKILL the decode engine the Coordinator has the request on; returns its name."""
    for name in ("D1", "D2"):
        if app.deps.registry.get(addrs[name]).num_inflight:
            procs[name].signal(signal.SIGKILL)
            return name
    raise AssertionError("no decode engine was running the request")


def test_n_choices_share_one_prefill_and_match_between_pd_and_hybrid(engines, loop):
    """n = 3 seeded choices: the same through PD and hybrid, streamed or not; choices
    1 and 2 find the prompt in the prefill engine's cache (one prefill); best_of picks
    the choice with the highest total logprob."""
    _, addrs = engines
    prompt = PROMPT * 3  # 150 tokens: 18 full blocks of 8
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=7, n=3)

    def hits(name: str) -> int:
        return engine_call(addrs[name], lambda c: c.stats()).prefix_cache_hit_tokens

    def ask(client):
        before = {n: hits(n) for n in ("P1", "H")}
        whole = client.completions.create(**kwargs, logprobs=1)
        after = {n: hits(n) - before[n] for n in before}
        chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
        streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                    for i in range(3)]
        best = client.completions.create(**{**kwargs, "n": 1}, best_of=3)
        return whole, after, streamed, best

    results = on_each_cluster(engines, loop, ask)
    texts = {}
    for name, (whole, after, streamed, best) in results.items():
        assert [c.index for c in whole.choices] == [0, 1, 2]
        texts[name] = [c.text for c in whole.choices]
        assert streamed == texts[name]
        assert len(set(texts[name])) > 1  # each choice samples from its own seed
        assert whole.usage.completion_tokens == 3 * 8 and whole.usage.prompt_tokens == 150
        prefill = "P1" if name == "pd" else "H"
        assert after[prefill] >= 2 * 144  # choices 1 and 2: every full prompt block cached
        totals = [sum(c.logprobs.token_logprobs) for c in whole.choices]
        assert best.choices[0].text == texts[name][totals.index(max(totals))]
        assert best.choices[0].logprobs is None and best.usage.completion_tokens == 24
    assert texts["pd"] == texts["hybrid"]
    assert_all_free(addrs, "P1", "D1", "D2", "H")


def test_logprobs_keep_flowing_when_the_decode_engine_dies_mid_stream(engines, loop):
    procs, addrs = engines
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    with serve(loop, addrs, ["H"]) as app:
        want = client_for(app).completions.create(**kwargs).choices[0].logprobs
    with serve(loop, addrs, ["P1", "D1", "D2"], kv_mode="layerwise") as app:
        tokens, token_lps, killed = [], [], None
        for chunk in client_for(app).completions.create(**kwargs, stream=True):
            lp = chunk.choices[0].logprobs if chunk.choices else None
            if lp is not None:
                tokens += lp.tokens
                token_lps += lp.token_logprobs
            if killed is None and tokens:
                killed, num_before = kill_the_running_decode(app, procs, addrs), len(tokens)
        assert app.deps.metrics.registry.get_sample_value(
            "pdserve_coordinator_continuations_total") == 1
    assert num_before < 400
    assert tokens == want.tokens
    assert_same(token_lps, want.token_logprobs)
    assert_all_free(addrs, "P1", "D2" if killed == "D1" else "D1")
