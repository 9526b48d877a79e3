"""Decode attention on CPU: one batch padded to its longest request vs length buckets.

The baseline is the decode path as it was before bucketing, copied below
(``padded_metadata`` + ``padded_decode``): every row's block table padded to the
longest, one masked SDPA over ``[B, KVH, max_blocks * block_size, D]``. The new path
is ``pdserve.engine.attention``: ``build_decode_buckets`` + ``paged_attention``.

Shapes are the ``small`` preset's (8 layers, GQA 8/2 heads, head_dim 64, block 16,
float32). One timed step runs the decode attention of all 8 layers, each on its own
layer of one ``[layers, 2, slots, KVH, D]`` cache, as the engine does, so each layer
reads cold blocks. Block tables are random. The two paths alternate step by step;
the table shows the median of ``--rounds`` steps for each. Building the metadata
(once per step, in the runner) is timed separately.

With ``--engine``, it also times whole decode steps of ``LLMEngine`` (``small``
preset, 7 requests of 64 prompt tokens and one of 2,048) with the attention switched
between the two paths on alternate steps.

    .venv/bin/python benchmarks/decode_attention.py              # kernels, one thread
    .venv/bin/python benchmarks/decode_attention.py --engine     # plus the engine step
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine import attention  # noqa: E402
from pdserve.engine.attention import AttentionMetadata, DecodeBucket  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 2, 64, 16  # `small`
SCALE = HEAD_DIM**-0.5
_rng = random.Random(0)

CASES = {
    "8 short (~64)": [60, 62, 64, 64, 66, 68, 70, 72],
    "7 short + 1 long (2,048)": [60, 62, 64, 66, 2048, 68, 70, 72],
    "8 long (~2,048)": [2048, 2041, 2034, 2027, 2020, 2013, 2006, 1999],
    "32 mixed (16..2,048)": [_rng.randrange(16, 2049) for _ in range(32)],
    "32 mixed (16..512)": [_rng.randrange(16, 513) for _ in range(32)],
}


# -- the baseline: the padded decode path before bucketing ---------------------------


def padded_metadata(ctx_lens: list[int], tables: list[list[int]], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's old decode metadata: [B, max_blocks] tables, 0-padded, and the mask."""
    num_blocks = -(-max(ctx_lens) // bs)
    tables = [t[:num_blocks] for t in tables]
    blocks = torch.tensor([t + [0] * (num_blocks - len(t)) for t in tables], dtype=torch.long)
    lens = torch.tensor(ctx_lens).unsqueeze(1)
    valid = torch.arange(num_blocks * bs).unsqueeze(0) < lens
    return blocks, valid.view(len(ctx_lens), 1, 1, num_blocks * bs)


def padded_decode(q, k_cache, v_cache, blocks, mask, bs: int, scale: float) -> torch.Tensor:
    """The old decode half of ``paged_attention``: one SDPA padded to the longest row."""
    b, kvh, hd = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    length = blocks.shape[1] * bs
    kd = k_cache.view(-1, bs * kvh * hd)[blocks].view(b, length, kvh, hd)
    vd = v_cache.view(-1, bs * kvh * hd)[blocks].view(b, length, kvh, hd)
    kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)
    od = F.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return od.squeeze(2)


# -- kernels -----------------------------------------------------------------------------


def random_tables(lens: list[int], num_blocks: int, rng: random.Random) -> list[list[int]]:
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in lens:
        k = -(-n // BLOCK)
        tables.append(pool[used:used + k])
        used += k
    return tables


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_case(
    lens: list[int], kv: torch.Tensor, rounds: int, call_cost: int = attention.DECODE_CALL_COST_BLOCKS
) -> dict[str, float]:
    num_slots = kv.shape[2]
    tables = random_tables(lens, num_slots // BLOCK - 1, random.Random(len(lens)))
    b = len(lens)
    q = torch.randn(LAYERS, b, HEADS, HEAD_DIM)
    spare = torch.arange(num_slots - b, num_slots)  # this step's K/V go to a block no table uses
    k_new = kv[0, 0, spare].clone()

    def old_meta():
        return padded_metadata(lens, tables, BLOCK)

    def new_meta():
        return AttentionMetadata(
            slot_mapping=spare, num_decodes=b, block_size=BLOCK,
            decode_buckets=attention.build_decode_buckets(
                lens, tables, BLOCK, torch.device("cpu"), call_cost
            ),
        )

    blocks, mask = old_meta()
    meta = new_meta()

    def old_step():
        for i in range(LAYERS):
            padded_decode(q[i], kv[i, 0], kv[i, 1], blocks, mask, BLOCK, SCALE)

    def new_step():
        for i in range(LAYERS):
            attention.paged_attention(q[i], k_new, k_new, kv[i, 0], kv[i, 1], meta, SCALE)

    for i in range(LAYERS):  # same numbers, or the comparison means nothing
        torch.testing.assert_close(
            attention.paged_attention(q[i], k_new, k_new, kv[i, 0], kv[i, 1], meta, SCALE),
            padded_decode(q[i], kv[i, 0], kv[i, 1], blocks, mask, BLOCK, SCALE),
            atol=1e-5, rtol=1e-5,
        )
    times: dict[str, list[float]] = {"old": [], "new": [], "old_meta": [], "new_meta": []}
    for _ in range(2):
        old_step(), new_step()
    for r in range(rounds):
        order = (("old", old_step), ("new", new_step)) if r % 2 else (("new", new_step), ("old", old_step))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        for name, fn in (("old_meta", old_meta), ("new_meta", new_meta)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    result = {k: median_us(v) for k, v in times.items()}
    result["buckets"] = len(meta.decode_buckets)
    result["padded_tokens"] = b * blocks.shape[1] * BLOCK
    result["bucket_tokens"] = sum(bk.blocks.shape[0] * bk.context_len for bk in meta.decode_buckets)
    return result


def run_kernels(rounds: int, call_cost: int) -> None:
    max_tokens = max(sum(-(-n // BLOCK) for n in lens) for lens in CASES.values()) * BLOCK
    num_slots = (max_tokens // BLOCK + 64) * BLOCK
    kv = torch.randn(LAYERS, 2, num_slots, KV_HEADS, HEAD_DIM)
    print(f"decode attention, {LAYERS} layers per step, median of {rounds} steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), call cost {call_cost} blocks\n")
    print("| batch | buckets | keys padded (old / new) | old ms | new ms | speedup "
          "| metadata old / new (µs/step) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, lens in CASES.items():
        r = bench_case(lens, kv, rounds, call_cost)
        print(f"| {name} | {r['buckets']} | {r['padded_tokens']:,} / {r['bucket_tokens']:,} "
              f"| {r['old'] / 1e3:.2f} | {r['new'] / 1e3:.2f} | {r['old'] / r['new']:.2f}x "
              f"| {r['old_meta']:.0f} / {r['new_meta']:.0f} |")


# -- the engine step -----------------------------------------------------------------


def run_engine(rounds: int) -> None:
    from pdserve.api.sampling import SamplingParams
    from pdserve.engine import model as model_mod
    from pdserve.engine import runner as runner_mod
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    new_build, new_attention = runner_mod.build_decode_buckets, model_mod.paged_attention

    def old_build(ctx_lens, tables, bs, device):
        blocks, mask = padded_metadata(ctx_lens, tables, bs)
        return [DecodeBucket(None, blocks, blocks.shape[1] * bs, mask)]

    def old_attention(q, k, v, k_cache, v_cache, meta, scale, on_kv_written=None):
        if not meta.num_decodes or meta.prefills:
            return new_attention(q, k, v, k_cache, v_cache, meta, scale, on_kv_written)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if on_kv_written is not None:
            on_kv_written()
        bucket = meta.decode_buckets[0]
        return padded_decode(q, k_cache, v_cache, bucket.blocks, bucket.mask, meta.block_size, scale)

    def use(old: bool) -> None:
        runner_mod.build_decode_buckets = old_build if old else new_build
        model_mod.paged_attention = old_attention if old else new_attention

    engine = LLMEngine(EngineConfig(model="small", num_kv_blocks=512, max_num_batched_tokens=4096))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=rounds * 2 + 8, ignore_eos=True)
    for i, n in enumerate([64] * 7 + [2048]):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(n)], params)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()  # prefill
    times: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for r in range(2 + 2 * rounds):
            name = "old" if r % 2 else "new"
            use(name == "old")
            t0 = time.perf_counter()
            engine.step()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    finally:
        use(False)
    old, new = median_us(times["old"]) / 1e3, median_us(times["new"]) / 1e3
    print(f"\nLLMEngine decode step, small preset, 7 x 64 + 1 x 2,048 tokens, median of {rounds}:")
    print("| | old ms | new ms | speedup |\n|---|---:|---:|---:|")
    print(f"| step | {old:.1f} | {new:.1f} | {old / new:.2f}x |")
    engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--call-cost", type=int, default=attention.DECODE_CALL_COST_BLOCKS,
                        help="bucketing threshold to try (DECODE_CALL_COST_BLOCKS)")
    parser.add_argument("--engine", action="store_true", help="also time LLMEngine decode steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        run_kernels(args.rounds, args.call_cost)
    if args.engine:
        run_engine(args.rounds)


if __name__ == "__main__":
    main()
