"""Model runner (all torch): owns the KV cache tensor, turns a scheduled batch into
tensors, runs the model and samples.

The KV cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
allocated once from the configured budget; nothing else on the hot path allocates
per-token memory that outlives a step.

Logits are computed for the rows that sample, and, for a request that asked for
prompt logprobs, for the prompt positions of its chunk not yet scored; the logprobs
(``logprobs.py``) go onto the request (``Request.new_logprobs``, ``prompt_logprobs``).
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.attention import (
    DECODE_CALL_COST_BLOCKS,
    KERNEL_PREFILL_MAX_CONTEXT,
    AttentionMetadata,
    PrefillChunk,
    build_decode_buckets,
)
from pdserve.engine.logprobs import score_positions, token_logprobs
from pdserve.engine.model import Transformer, use_native
from pdserve.engine.request import Request
from pdserve.engine.sampler import TokenHistory, sample
from pdserve.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self, model: Transformer, num_blocks: int, block_size: int, allocate=None, on_step=None
    ) -> None:
        """``allocate(shape, dtype)`` places the KV cache (e.g. in shared memory);
        ``on_step(ids, positions, meta)`` gets each step's inputs before the forward (the
        other tensor-parallel ranks run the same one: ``parallel.TPWorkers.send_step``)."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.on_step = on_step
        self.device = model.embed_tokens.device
        kv_heads = model.num_kv_heads  # this rank's, with tensor parallelism
        shape = (cfg.num_hidden_layers, 2, num_blocks, block_size, kv_heads, cfg.head_dim)
        dtype = model.embed_tokens.dtype
        if allocate is None:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            self.kv_cache = allocate(shape, dtype)
        # Flattened slot view used by attention: [layers, 2, num_slots, kv_heads, head_dim].
        self.kv_slots = self.kv_cache.view(
            cfg.num_hidden_layers, 2, num_blocks * block_size, kv_heads, cfg.head_dim
        )
        self._slot_offsets = torch.arange(block_size, device=self.device)
        # Decode attention read in place by the native kernel where it runs (CPU, bfloat16)
        # and was built for the model's shapes; else the torch path, its rows bucketed by length.
        # The same for the norms and rotary of eager steps (native.Elementwise).
        self.decode_kernel = None
        if self.device.type == "cpu" and dtype == torch.bfloat16:
            from pdserve.engine.native import decode_kernel, elementwise_kernels

            kernel = decode_kernel()
            heads = model.layers[0].self_attn.num_heads
            if kernel is not None and kernel.takes(heads, kv_heads, cfg.head_dim, block_size):
                self.decode_kernel = kernel
            use_native(model, elementwise_kernels())

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _slots_for(self, block_tables: list[list[int]], max_len: int) -> torch.Tensor:
        """Cache slots of the first ``max_len`` positions of each block table: [B, max_len]."""
        num_blocks = -(-max_len // self.block_size)
        padded = [bt[:num_blocks] + [0] * (num_blocks - len(bt[:num_blocks])) for bt in block_tables]
        bt = torch.tensor(padded, dtype=torch.long, device=self.device)
        slots = bt.unsqueeze(-1) * self.block_size + self._slot_offsets
        return slots.view(len(block_tables), -1)[:, :max_len]

    def prepare(self, batch: ScheduledBatch):
        """Flatten the batch: decodes (one new token) first, then prefill chunks."""
        bs = self.block_size
        items = sorted(batch.items, key=lambda it: it[1] != 1)
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        # (request, first row, first and end position) of prompt positions to score: position p
        # predicts prompt token p + 1.
        scored: list[tuple[Request, int, int, int]] = []
        decodes = [(r, n) for r, n in items if n == 1]
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decodes=len(decodes),
                                 block_size=bs, decode_kernel=self.decode_kernel)
        for request, n in items:
            start = request.num_computed_tokens
            tokens = request.all_token_ids[start : start + n]
            pos = range(start, start + n)
            row0 = len(token_ids)
            token_ids.extend(tokens)
            positions.extend(pos)
            bt = request.block_table
            slot_mapping.extend(bt[p // bs] * bs + p % bs for p in pos)
            if start + n == request.num_tokens:
                sample_rows.append(row0 + n - 1)
                sampled.append(request)
            if request.needs_prompt_logprobs:
                first = max(start, len(request.prompt_logprobs))
                end = min(start + n, request.num_prompt_tokens - 1)
                if first < end:
                    scored.append((request, row0 + first - start, first, end))
            if n != 1:
                ctx = start + n
                if self.decode_kernel is not None and ctx <= KERNEL_PREFILL_MAX_CONTEXT:
                    table = torch.tensor(bt[:-(-ctx // bs)], dtype=torch.long, device=self.device)
                    meta.prefills.append(PrefillChunk(row0, n, ctx, None, None, table.expand(n, -1).contiguous(),
                                                      torch.arange(start + 1, ctx + 1, device=self.device)))
                elif start == 0:
                    meta.prefills.append(PrefillChunk(row0, n, ctx, None, None))
                else:
                    slots = self._slots_for([bt], ctx)[0]
                    q_pos = torch.arange(start, ctx, device=self.device).unsqueeze(1)
                    k_pos = torch.arange(ctx, device=self.device).unsqueeze(0)
                    meta.prefills.append(PrefillChunk(row0, n, ctx, slots, k_pos <= q_pos))
        if decodes:
            meta.decode_buckets = build_decode_buckets(
                [r.num_computed_tokens + 1 for r, _ in decodes],
                [r.block_table for r, _ in decodes], bs, self.device,
                # The kernel reads each row's own length: one bucket, no padding cost.
                math.inf if self.decode_kernel is not None else DECODE_CALL_COST_BLOCKS,
            )
        meta.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, meta, sample_rows, sampled, scored

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, kv_ready=None) -> dict[str, int]:
        """Run one step; returns the sampled token for each request that completed its tokens.

        Called by the engine once per step. ``kv_ready(i)`` fires as soon as layer ``i``'s
        KV is in the cache, before its attention and MLP (the layer-wise sender hooks in).
        """
        ids, positions, meta, rows, sampled, scored = self.prepare(batch)
        if self.on_step is not None:
            self.on_step(ids, positions, meta)
        hidden = self.model(ids, positions, self.kv_slots, meta, kv_ready)
        for request, row, first, end in scored:
            request.prompt_logprobs += score_positions(
                hidden[row:row + end - first], self.model.compute_logits,
                request.prompt_token_ids[first + 1:end + 1], request.sampling_params.top_logprobs)
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        # Rows of the requests that report logprobs, copied (indexing with a list copies)
        # before sampling: the raw distribution, whatever sampling does to its logits.
        lp_rows = [i for i, r in enumerate(sampled) if r.sampling_params.logprobs]
        raw = logits[lp_rows] if lp_rows else None
        tokens = sample(
            logits,
            [r.sampling_params for r in sampled],
            [r.sampling_params.sample_offset + len(r.output_token_ids) for r in sampled],
            [_banned_tokens(r) for r in sampled],
            [_history(r) for r in sampled],
            [r.guided for r in sampled],
        )
        if raw is not None:
            entries = token_logprobs(raw, [tokens[i] for i in lp_rows],
                                     [sampled[i].sampling_params.top_logprobs for i in lp_rows])
            for i, entry in zip(lp_rows, entries, strict=True):
                sampled[i].new_logprobs.append(entry)
        return {r.request_id: t for r, t in zip(sampled, tokens, strict=True)}


def _history(request: Request) -> TokenHistory | None:
    """The tokens a penalized request's penalties count; None (no copy) for the rest."""
    if not request.sampling_params.has_penalties:
        return None
    return TokenHistory(request.all_token_ids, request.generated_token_ids)


def _banned_tokens(request: Request) -> tuple[int, ...]:
    """Token ids that may not be sampled now: a request below ``min_tokens`` cannot end."""
    params = request.sampling_params
    if len(request.output_token_ids) >= params.min_tokens:
        return ()
    return (*request.eos_token_ids, *params.stop_token_ids)
