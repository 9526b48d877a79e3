"""Token sampling (torch): logit bias, penalties, greedy, temperature, min-p, top-k,
top-p, seeded.

Order per row, as vLLM's: the grammar's mask (constrained requests, ``guided.py``),
banned tokens (``min_tokens``) and ``logit_bias``, then the
repetition, frequency and presence penalties (these two affect greedy requests too),
then temperature, min-p, top-k and top-p for sampled requests.

Randomness is counter-based (see ``api/sampling.py``): output token ``i`` of a
request is drawn with a generator seeded from ``(seed, i)`` using the exponential-race
trick (argmax of p / Exp(1) noise samples exactly from p). The same request therefore
draws the same tokens whatever batch it shares and whichever engine runs the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.api.sampling import SamplingParams
from pdserve.engine.guided import GuidedMatcher, apply_masks

_MASK64 = (1 << 63) - 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of the largest value along the last dim, the first of equal ones, as
    ``Tensor.argmax``, which on CPU is several times slower over a vocabulary
    (docs/benchmarks.md, "Engine throughput")."""
    return x.max(-1).indices


def _stream_seed(seed: int, index: int) -> int:
    # splitmix64-style mixing so nearby (seed, index) pairs give unrelated streams.
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


@dataclass(frozen=True)
class TokenHistory:
    """What a penalized row's penalties read: every token seen (prompt and output, for
    the repetition penalty) and the generated ones (presence and frequency)."""

    all_token_ids: list[int]
    generated_token_ids: list[int]


def _adjust(row: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> None:
    """Logit bias and penalties, in place on one row of logits."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype,
                                 device=row.device)
    if history is None:
        return
    if params.repetition_penalty != 1.0 and history.all_token_ids:
        seen = torch.tensor(history.all_token_ids, dtype=torch.long, device=row.device).unique()
        logits = row[seen]
        row[seen] = torch.where(logits > 0, logits / params.repetition_penalty,
                                logits * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and history.generated_token_ids:
        out = torch.tensor(history.generated_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[-1]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if params.min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (keep at least one).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
    banned: list[tuple[int, ...]] | None = None,
    histories: list[TokenHistory | None] | None = None,
    guided: list[GuidedMatcher | None] | None = None,
) -> list[int]:
    """One token per row of ``logits`` ([N, V] float32). Called by the runner once per step.

    ``indices[i]`` is the output index of the token being drawn for row ``i``;
    ``banned[i]`` lists token ids row ``i`` may not draw (``min_tokens`` not reached);
    ``histories[i]`` is row ``i``'s token history, given where it has penalties;
    ``guided[i]`` is row ``i``'s grammar matcher, given where it is constrained.
    """
    has_banned = banned is not None and any(banned)
    adjusted = [i for i, p in enumerate(params) if p.logit_bias or p.has_penalties]
    constrained = [i for i, g in enumerate(guided) if g is not None] if guided else []
    if has_banned or adjusted or constrained:
        logits = logits.clone()
    if constrained:
        apply_masks(logits, constrained, [guided[i] for i in constrained])
    if has_banned:
        for row, ids in enumerate(banned):
            if ids:
                logits[row, list(ids)] = float("-inf")
    for i in adjusted:
        _adjust(logits[i], params[i], histories[i] if histories is not None else None)
    if all(p.is_greedy for p in params):
        return argmax(logits).tolist()
    out = []
    for row, p, index in zip(logits, params, indices, strict=True):
        if p.is_greedy:
            out.append(int(argmax(row)))
            continue
        probs = _filter(row, p).softmax(-1)
        gen = torch.Generator(device=row.device).manual_seed(_stream_seed(p.seed or 0, index))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out.append(int(argmax(probs / noise)))
    return out
