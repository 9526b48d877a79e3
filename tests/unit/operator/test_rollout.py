"""A settings rollout replaces one Pod per pool at a time and never empties two pools."""

from __future__ import annotations

from pdserve.operator.rollout import EnginePod, choose_replacements


def pods(pool: str, n: int, *, stale: set[int] = frozenset(), down: set[int] = frozenset(),
         terminating: set[int] = frozenset()) -> list[EnginePod]:
    return [EnginePod(f"c-{pool}-{i}", pool, i, is_current=i not in stale,
                      is_serving=i not in down and i not in terminating, is_terminating=i in terminating)
            for i in range(n)]


def test_nothing_stale_nothing_replaced():
    assert choose_replacements(pods("prefill", 2) + pods("decode", 2),
                               {"prefill": 2, "decode": 2, "hybrid": 0}) == []


def test_one_pod_per_pool_and_the_lowest_ordinal_first():
    everything = pods("prefill", 3, stale={0, 1, 2}) + pods("decode", 2, stale={0, 1})
    assert choose_replacements(everything, {"prefill": 3, "decode": 2, "hybrid": 0}) == [
        "c-prefill-0", "c-decode-0"]


def test_the_next_pod_waits_for_the_new_one_to_serve():
    desired = {"prefill": 3, "decode": 0, "hybrid": 0}
    # c-prefill-0 was replaced: its new Pod is not Ready yet, or not created yet
    assert choose_replacements(pods("prefill", 3, stale={1, 2}, down={0}), desired) == []
    assert choose_replacements(pods("prefill", 3, stale={1, 2})[1:], desired) == []
    assert choose_replacements(pods("prefill", 3, stale={1, 2}, terminating={0}), desired) == []
    assert choose_replacements(pods("prefill", 3, stale={1, 2}), desired) == ["c-prefill-1"]


def test_a_stale_pod_that_serves_nothing_goes_at_once():
    everything = pods("prefill", 2, stale={0, 1}, down={1}) + pods("decode", 1, stale={0}, down={0})
    assert choose_replacements(everything, {"prefill": 2, "decode": 1, "hybrid": 0}) == [
        "c-prefill-1", "c-decode-0"]


def test_the_last_prefill_and_the_last_decode_never_go_together():
    desired = {"prefill": 1, "decode": 1, "hybrid": 0}
    assert choose_replacements(pods("prefill", 1, stale={0}) + pods("decode", 1, stale={0}),
                               desired) == ["c-prefill-0"]
    # prefill's new Pod serves: now decode's turn
    assert choose_replacements(pods("prefill", 1) + pods("decode", 1, stale={0}), desired) == [
        "c-decode-0"]
    # while prefill has none serving, decode keeps its last Pod
    assert choose_replacements(pods("prefill", 1, down={0}) + pods("decode", 1, stale={0}), desired) == []


def test_a_pool_of_two_rolls_beside_a_pool_of_one():
    """Two prefill, one decode: prefill keeps one serving, so decode may roll meanwhile."""
    everything = pods("prefill", 2, stale={0, 1}) + pods("decode", 1, stale={0})
    assert choose_replacements(everything, {"prefill": 2, "decode": 1, "hybrid": 0}) == [
        "c-prefill-0", "c-decode-0"]
