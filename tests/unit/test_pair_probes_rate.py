"""PairProbes: usable pairs' re-probes stay within ``max_reprobes_per_s`` (the interval
stretches with the number of usable pairs); new and failed pairs are not held back."""

import asyncio

from pdserve.runtime.pair_probes import PairProbes


def ok_ask(ok: bool = True):
    async def ask():
        return ok, "" if ok else "refused", 0.001
    return ask


def probe_all(probes: PairProbes, keys, ok: bool = True) -> None:
    async def go():
        for key in keys:
            await probes.probe(key, "ep", ok_ask(ok))
    asyncio.run(go())


def test_few_usable_pairs_keep_the_interval():
    probes = PairProbes(interval_s=30.0, max_reprobes_per_s=10.0)
    probe_all(probes, [("p", f"d{i}") for i in range(100)])
    checked_s = probes.results[("p", "d0")].checked_s
    assert probes.reprobe_s == 30.0
    assert not probes.is_due(("p", "d0"), "ep", checked_s + 29.0)
    assert probes.is_due(("p", "d0"), "ep", checked_s + 30.0)


def test_many_usable_pairs_stretch_the_interval_to_the_rate():
    probes = PairProbes(interval_s=30.0, max_reprobes_per_s=10.0)
    keys = [(f"p{i % 4}", f"d{i}") for i in range(1000)]
    probe_all(probes, keys)
    checked_s = probes.results[keys[0]].checked_s
    assert probes.reprobe_s == 100.0  # 1,000 usable pairs at 10 a second
    assert not probes.is_due(keys[0], "ep", checked_s + 99.0)
    assert probes.is_due(keys[0], "ep", checked_s + 100.0)
    assert probes.next_due_s() >= checked_s + 100.0
    # a new pair, a failed one, one at a new endpoint, one marked due: not held back
    assert probes.is_due(("p0", "new"), "ep", checked_s)
    assert probes.is_due(keys[1], "elsewhere", checked_s)
    probe_all(probes, [keys[2]], ok=False)
    assert probes.reprobe_s == 99.9
    assert probes.is_due(keys[2], "ep", probes.results[keys[2]].checked_s + probes.retry_s)
    probes.mark_due(keys[3][1])
    assert probes.is_due(keys[3], "ep", checked_s)
    # forgetting usable pairs shrinks it back
    probes.forget(keys[:800])
    assert probes.reprobe_s == 30.0


def test_a_rate_or_interval_that_is_not_positive_is_refused_at_once():
    for bad in ({"max_reprobes_per_s": 0.0}, {"max_reprobes_per_s": -1.0}, {"interval_s": 0.0},
                {"retry_s": -2.0}, {"timeout_s": float("nan")}):
        try:
            PairProbes(**bad)
        except ValueError as exc:
            assert "must all be positive" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")
