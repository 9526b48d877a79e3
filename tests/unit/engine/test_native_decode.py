"""The native paged decode attention (``pdserve/engine/native``) against the torch path
(gather, then SDPA) it replaces, through ``paged_attention``: GQA groups, head sizes,
block sizes, mixed lengths, sliding windows, threads; and what happens where it cannot
be built or does not fit."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from pdserve.engine import native
from pdserve.engine.attention import (
    KERNEL_PREFILL_MAX_CONTEXT,
    AttentionMetadata,
    PrefillChunk,
    build_decode_buckets,
    paged_attention,
)
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import Transformer
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler import ScheduledBatch


@pytest.fixture(scope="module")
def kernel():
    got = native.decode_kernel()
    assert got is not None, "the native kernel did not build (cc on PATH?): see the log"
    return got


def attend(q, k_cache, v_cache, lens, tables, block_size, window, kernel):
    """``paged_attention`` over decode rows only, as the runner plans them."""
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(lens),
                             block_size=block_size, decode_kernel=kernel)
    meta.decode_buckets = build_decode_buckets(lens, tables, block_size, torch.device("cpu"),
                                               float("inf") if kernel is not None else 8)
    empty = q.new_empty((0, k_cache.shape[1], k_cache.shape[2]))
    meta.slot_mapping = torch.empty(0, dtype=torch.long)
    return paged_attention(q, empty, empty, k_cache, v_cache, meta, q.shape[-1] ** -0.5, None, window)


def case(heads, kv_heads, dim, block_size, lens, seed=0):
    rng = random.Random(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, dtype=torch.bfloat16)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append(free[:need])
        free = free[need:]
    # q as the model has it: a view of the fused qkv rows (row stride past heads * dim).
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
    q = qkv[:, :heads * dim].view(len(lens), heads, dim)
    return q, k_cache, v_cache, tables


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2
    (8, 8, 128, 16),  # no grouping
    (32, 4, 128, 8),  # wide groups, small blocks
    (9, 3, 64, 64),   # blocks of several 16-token score chunks
])
@pytest.mark.parametrize("window", [None, 20])
def test_the_kernel_gives_the_torch_paths_attention(kernel, heads, kv_heads, dim, block_size, window):
    lens = [1, block_size, block_size + 1, 3 * block_size, 57, 200, 7]
    q, k_cache, v_cache, tables = case(heads, kv_heads, dim, block_size, lens)
    want = attend(q, k_cache, v_cache, lens, tables, block_size, window, None)
    got = attend(q, k_cache, v_cache, lens, tables, block_size, window, kernel)
    # Both sum in float32 and round once to bfloat16: within a unit or two of the last place.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("start,num_new,window", [(0, 200, None), (0, 37, 20), (96, 64, None), (5, 1 + 16, 24)])
def test_a_prefill_chunk_read_by_the_kernel_gives_sdpas_attention(kernel, start, num_new, window):
    """A prefill chunk (after a cached prefix of ``start`` tokens, or none) through the
    kernel, each new token a row over its own context, against the SDPA path."""
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    ctx = start + num_new
    q, k_cache, v_cache, [table] = case(heads, kv_heads, dim, block_size, [ctx], seed=start + num_new)
    q = torch.randn(num_new, heads, dim, dtype=torch.bfloat16)
    blocks = torch.tensor(table, dtype=torch.long)
    slots = (blocks.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(len(table)))[:ctx]
    new = slots[start:]
    k, v = k_cache[new], v_cache[new]  # this step's K/V, as the cache write leaves them

    def through(chunk):
        meta = AttentionMetadata(slot_mapping=new, num_decodes=0, block_size=block_size, decode_kernel=kernel,
                                 prefills=[chunk])
        return paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5, None, window)

    if start == 0:
        sdpa = PrefillChunk(0, num_new, ctx, None, None)
    else:
        mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(start, ctx).unsqueeze(1)
        sdpa = PrefillChunk(0, num_new, ctx, slots, mask)
    want = through(sdpa)
    got = through(PrefillChunk(0, num_new, ctx, None, None, blocks.expand(num_new, -1).contiguous(),
                               torch.arange(start + 1, ctx + 1)))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


def test_the_runner_sends_short_prefills_to_the_kernel_and_long_ones_to_sdpa(kernel):
    runner = runner_for(64, 16)
    assert runner.decode_kernel is kernel
    short, long = (Request(name, list(range(1, n + 1)), SamplingParams(max_tokens=1))
                   for name, n in (("short", 40), ("long", KERNEL_PREFILL_MAX_CONTEXT + 1)))
    for i, r in enumerate((short, long)):
        r.block_table = list(range(i * 64, i * 64 + -(-r.num_tokens // 16)))
    _, _, meta, *_ = runner.prepare(ScheduledBatch(items=[(short, 40), (long, long.num_tokens)]))
    kernel_chunk, sdpa_chunk = meta.prefills
    assert kernel_chunk.tables.shape == (40, 3) and kernel_chunk.lens.tolist() == list(range(1, 41))
    assert sdpa_chunk.tables is None


def test_the_bfloat16_pair_scores_give_the_widened_scores_attention(kernel, tmp_path, monkeypatch):
    """Built for AVX-512 BF16 the kernel scores with bfloat16 pair products (vdpbf16ps);
    built without it, with K widened to float32: the same attention within float32
    rounding, so nearly every bfloat16 output is equal. (On a CPU without AVX-512 BF16
    both builds take the widened path.)"""
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-mno-avx512bf16"])
    widened = native.PagedDecode(native.build(tmp_path))
    lens = [1, 15, 16, 17, 33, 64, 65, 200, 301]
    for dim, block_size, window in ((64, 16, None), (128, 64, None), (64, 32, 40)):
        q, k_cache, v_cache, tables = case(8, 2, dim, block_size, lens, seed=dim + block_size)
        got = attend(q, k_cache, v_cache, lens, tables, block_size, window, kernel)
        want = attend(q, k_cache, v_cache, lens, tables, block_size, window, widened)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
        assert (got == want).float().mean() > 0.97


def test_loading_the_kernel_leaves_the_processs_floating_point_alone(kernel):
    # A library built with -ffast-math sets flush-to-zero and denormals-are-zero for the
    # whole process when it loads: subnormal floats would read as 0 everywhere after it.
    subnormal = 1e-310
    assert subnormal * 1.0 > 0.0
    assert torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() > 0.0


def test_the_kernel_travels_pickled_to_tensor_parallel_ranks(kernel):
    assert pickle.loads(pickle.dumps(kernel)) is native.decode_kernel()  # each process its own


def test_rows_split_over_threads_give_the_same_result(kernel):
    lens = [100 + 13 * i for i in range(12)]
    q, k_cache, v_cache, tables = case(9, 3, 64, 16, lens, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, k_cache, v_cache, lens, tables, 16, None, kernel)
        torch.set_num_threads(2)
        two = attend(q, k_cache, v_cache, lens, tables, 16, None, kernel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each row is summed by one thread, in one order


def runner_for(head_dim: int, block_size: int, heads: int = 4, kv_heads: int = 2) -> ModelRunner:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=heads * head_dim,
                      intermediate_size=16, num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256)
    return ModelRunner(Transformer(cfg, torch.bfloat16, torch.device("cpu")), 8, block_size)


@pytest.mark.parametrize(("head_dim", "block_size", "heads"), [(80, 16, 4), (64, 128, 4), (64, 16, 66)])
def test_a_model_the_kernel_was_not_built_for_keeps_the_torch_path(kernel, head_dim, block_size, heads):
    # A head size, block size or head count past the kernel's: the runner never hands it the
    # kernel (its step would fail), and the torch path keeps its length buckets.
    assert not kernel.takes(heads, 2, head_dim, block_size)
    assert runner_for(head_dim, block_size, heads).decode_kernel is None
    assert runner_for(64, 16).decode_kernel is kernel


def test_without_a_compiler_or_with_the_switch_there_is_no_kernel(tmp_path, monkeypatch):
    native.decode_kernel.cache_clear()
    try:
        monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        assert native.decode_kernel() is None
        assert not list(tmp_path.iterdir())  # no half-written library left behind
        native.decode_kernel.cache_clear()
        monkeypatch.delenv("CC")
        monkeypatch.setenv(native.SWITCH, "0")
        assert native.decode_kernel() is None
    finally:
        native.decode_kernel.cache_clear()
