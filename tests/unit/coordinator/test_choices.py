"""``n`` and ``best_of``: n choices with their indices, streamed or not, every choice
after the first on the first's engines, usage summed, and the limits as 400s."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from tests.unit.coordinator.harness import serve


def test_n_choices_run_on_the_first_choices_engines(loop, stubs):
    engines = [stubs(num_tokens=3), stubs(num_tokens=3)]
    with serve(loop, engines) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="tiny", n=3, max_tokens=3,
                                             messages=[{"role": "user", "content": "hi"}])
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert all(c.message.content == "ABC" for c in out.choices)
        assert out.usage.completion_tokens == 9
        # Every choice ran where the first did (its prompt is in that engine's cache).
        counts = sorted(len(stubs.by_address[a].request_ids) for a in engines)
        assert counts == [0, 3]
        ids = next(stubs.by_address[a].request_ids for a in engines if stubs.by_address[a].request_ids)
        assert ids[1:] == [f"{ids[0]}-1", f"{ids[0]}-2"] and out.id == "chat" + ids[0]


def test_streamed_choices_carry_their_index_and_end_with_summed_usage(loop, stubs):
    with serve(loop, [stubs(num_tokens=3)]) as app:
        r = httpx.post(app.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}})
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [orjson.loads(line[6:]) for line in lines[:-1]]
    by_index = {0: "", 1: ""}
    ends = []
    for e in events[:-1]:
        (choice,) = e["choices"]
        by_index[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            ends.append(choice["index"])
    assert by_index == {0: "ABC", 1: "ABC"} and sorted(ends) == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("extra, param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"best_of": 17}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
])
def test_choice_limits_are_a_400_naming_the_field(loop, stubs, extra, param):
    with serve(loop, [stubs(num_tokens=2)]) as app:
        r = httpx.post(app.url + "/v1/completions", timeout=10,
                       json={"model": "tiny", "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_best_of_returns_n_of_the_sampled_choices(loop, stubs):
    address = stubs(num_tokens=2)
    with serve(loop, [address]) as app:
        r = httpx.post(app.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 4})
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # ranked by them, not asked for
    assert body["usage"]["completion_tokens"] == 8  # every sampled choice is paid for
    assert len(stubs.by_address[address].request_ids) == 4
