"""The engine's cumulative counters for the Controller's planner, on a real P/D pair
(TCP) and a hybrid engine: who counts the prefill, who the decode steps and the end."""

from __future__ import annotations

from pdserve.api.sampling import SamplingParams
from tests.unit.engine.pd_harness import make_engine, run_until_idle, submit_pair


def test_p_counts_prefills_and_d_counts_decode_steps_and_finished_generations():
    p, d = make_engine("prefill"), make_engine("decode")
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i in range(3):
            submit_pair(p, d, f"r{i}", list(range(1 + i, 21 + i)), params, "pull")
        run_until_idle(p, d)
        ps, ds = p.stats(), d.stats()
    finally:
        p.close()
        d.close()
    assert ps.num_prefills_total == 3 and ps.num_prompt_tokens_total == 60
    assert ps.prefill_busy_s_total > 0 and ps.prefill_queue_s_total >= 0
    assert ps.num_finished_total == 0 and ps.num_decode_steps_total == 0  # handed off, not ended
    assert ds.num_prefills_total == 0 and ds.prefill_busy_s_total == 0  # the KV came from P
    assert ds.num_finished_total == 3
    # 5 decode tokens each (the first is P's), in steps of 1 to 3 streams
    assert ds.decode_batch_total == 15
    assert 5 <= ds.num_decode_steps_total <= 15
    assert ds.decode_batch_sq_total >= ds.decode_batch_total
    assert ds.decode_step_s_total > 0 and ds.decode_batch_step_s_total >= ds.decode_step_s_total


def test_a_hybrid_engine_counts_both_and_a_prefill_step_never_feeds_the_decode_line():
    e = make_engine("hybrid", transport="none")
    try:
        e.generate([list(range(1, 41)), list(range(2, 12))], SamplingParams(max_tokens=4, ignore_eos=True))
        s = e.stats()
    finally:
        e.close()
    assert s.num_prefills_total == 2 and s.num_finished_total == 2
    # 3 decode tokens each after the prefill's first; steps that mixed a prompt chunk
    # with decodes count as prefill time
    assert s.decode_batch_total <= 6 and s.num_decode_steps_total >= 1
    assert s.prefill_busy_s_total > 0


def test_the_demand_gauges_say_what_is_coming_before_any_of_it_is_served():
    """Prompt tokens waiting at P, and the blocks the requests will hold at their longest
    (P: prompt and first token; D: prompt and all of ``max_tokens``, counted while it
    still waits for the KV); the output budget counts once a generation ends."""
    p, d = make_engine("prefill"), make_engine("decode")
    try:
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        for i in range(3):
            submit_pair(p, d, f"r{i}", list(range(1 + i, 41 + i)), params, "pull")
        ps, ds = p.stats(), d.stats()
        bs = ps.block_size
        assert ps.num_waiting_prompt_tokens == 120 and ds.num_waiting_prompt_tokens == 0
        assert ps.num_kv_blocks_committed == 3 * -(-41 // bs)
        assert ds.num_kv_blocks_committed == 3 * -(-70 // bs) and ds.num_kv_blocks_used == 0
        assert ds.output_budget_total == 0
        run_until_idle(p, d)
        ps, ds = p.stats(), d.stats()
    finally:
        p.close()
        d.close()
    assert ps.num_waiting_prompt_tokens == 0 and ps.num_kv_blocks_committed == 0
    assert ds.num_kv_blocks_committed == 0
    assert ds.output_budget_total == 90 and ps.output_budget_total == 0
