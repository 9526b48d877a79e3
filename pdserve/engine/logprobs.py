"""Log probabilities of tokens (torch): what ``logprobs`` and ``prompt_logprobs`` report.

The distribution is the model's own: log-softmax of the raw logits in float32, before
logit bias, penalties, temperature, top-k/top-p or min-p (as vLLM reports by default,
and as ``transformers`` computes ``log_softmax(model(ids).logits)``). A sampled token
therefore has the same logprob whatever sampling drew it.

Called by the runner only for the rows of requests that asked: a request without
logprobs costs nothing here. Prompt positions are scored ``CHUNK_ROWS`` at a time, so
a long prompt never holds more than that many rows of vocabulary-sized logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.request import TokenLogprob

CHUNK_ROWS = 128  # prompt positions turned into logits at once


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   num_top: list[int]) -> list[TokenLogprob]:
    """Row ``i`` of ``logits`` ([N, V] float32) scored at ``token_ids[i]``, with its
    ``num_top[i]`` likeliest tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(num_top, default=0)
    if k == 0:
        return [TokenLogprob(t, lp, []) for t, lp in zip(token_ids, chosen, strict=True)]
    top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(t, lp, list(zip(tids[:n], tlps[:n], strict=True)))
        for t, lp, tids, tlps, n in zip(token_ids, chosen, top_ids, top_lps, num_top, strict=True)
    ]


def score_positions(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    targets: list[int], num_top: int) -> list[TokenLogprob]:
    """Each row of ``hidden`` (one prompt position's last hidden state) scored at the
    next prompt token ``targets[i]``: a prompt's logprobs, ``CHUNK_ROWS`` rows at a time."""
    out: list[TokenLogprob] = []
    for i in range(0, len(targets), CHUNK_ROWS):
        logits = compute_logits(hidden[i:i + CHUNK_ROWS])
        out += token_logprobs(logits, targets[i:i + CHUNK_ROWS], [num_top] * len(logits))
    return out
