"""Concrete requests: a class's next prompt and output length, from a seeded RNG.

Owns prompt synthesis and dataset reading. Every class draws from its own RNG,
seeded by the workload seed and the class name, so the n-th ``chat`` request is the
same prompt whichever target or round it is sent to, and however the classes
interleave. Synthetic prompts are fresh random token ids (``ids``: N ids in
[0, vocab_size), exactly N prompt tokens, no shared prefixes) or random common
words (``text``: about one token per word with BPE tokenizers; the server's usage
says how many it really was).

Datasets are JSONL (or a JSON array, as ShareGPT ships) of either
``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` rows
(the first human turn is the prompt; without an ``output_tokens`` distribution the
reply's length at ~4 characters per token is the output length), or
``{"prompt": text | [ids], "max_tokens": N}`` rows. Rows are visited in a seeded
shuffled order, cycling.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .workload import RequestClass, WorkloadError

WORDS = ("the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on",
         "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one",
         "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can",
         "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will",
         "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her",
         "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write",
         "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water",
         "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get",
         "come", "made", "may", "part")
CHARS_PER_TOKEN = 4
DEFAULT_OUTPUT_TOKENS = 128


@dataclass(frozen=True)
class PlannedRequest:
    class_name: str
    prompt: str | list[int]
    max_tokens: int
    num_prompt_tokens: int | None = None
    """Known for id prompts; text prompts are counted by the server."""


@dataclass(frozen=True)
class DatasetRow:
    prompt: str | list[int]
    max_tokens: int | None


class ClassSampler:
    """One class's stream of requests. ``next()`` is called by the load generator."""

    def __init__(self, cls: RequestClass, seed: int, prompt_kind: str, vocab_size: int) -> None:
        self.cls = cls
        self.prompt_kind = prompt_kind
        self.vocab_size = vocab_size
        self.rng = random.Random(f"{seed}:{cls.name}")
        self.rows: list[DatasetRow] = []
        if cls.dataset is not None:
            self.rows = load_dataset(cls.dataset)
            self.rng.shuffle(self.rows)
        self.num_drawn = 0

    def next(self) -> PlannedRequest:
        self.num_drawn += 1
        if self.rows:
            row = self.rows[(self.num_drawn - 1) % len(self.rows)]
            dist = self.cls.output_tokens
            max_tokens = dist.sample(self.rng) if dist is not None else \
                (row.max_tokens or DEFAULT_OUTPUT_TOKENS)
            num_prompt = len(row.prompt) if isinstance(row.prompt, list) else None
            return PlannedRequest(self.cls.name, row.prompt, max_tokens, num_prompt)
        assert self.cls.prompt_tokens is not None and self.cls.output_tokens is not None
        n = self.cls.prompt_tokens.sample(self.rng)
        max_tokens = self.cls.output_tokens.sample(self.rng)
        if self.prompt_kind == "ids":
            ids = [self.rng.randrange(self.vocab_size) for _ in range(n)]
            return PlannedRequest(self.cls.name, ids, max_tokens, n)
        text = " ".join(self.rng.choice(WORDS) for _ in range(n))
        return PlannedRequest(self.cls.name, text, max_tokens, None)


class MixSampler:
    """Classes sharing one arrival: each request draws its class by ``share``."""

    def __init__(self, samplers: list[ClassSampler], seed: int) -> None:
        self.samplers = samplers
        self.weights = [s.cls.share for s in samplers]
        self.rng = random.Random(f"{seed}:mix:{','.join(s.cls.name for s in samplers)}")

    def next(self) -> PlannedRequest:
        if len(self.samplers) == 1:
            return self.samplers[0].next()
        return self.rng.choices(self.samplers, weights=self.weights)[0].next()


def load_dataset(path: Path) -> list[DatasetRow]:
    """Read every usable row; a malformed file raises ``WorkloadError`` naming the line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    if text.lstrip().startswith("["):
        try:
            items = list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}: not valid JSON: {exc}") from None
    else:
        items = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    items.append((lineno, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise WorkloadError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
    rows = [row for lineno, item in items if (row := _row(item, f"{path}:{lineno}")) is not None]
    if not rows:
        raise WorkloadError(f"{path}: no usable rows (need 'conversations' with a human turn, "
                            f"or 'prompt')")
    return rows


def _row(item, where: str) -> DatasetRow | None:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected a JSON object")
    if "prompt" in item:
        prompt, max_tokens = item["prompt"], item.get("max_tokens")
        is_ids = isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not is_ids:
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string or token-id list")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise WorkloadError(f"{where}: 'max_tokens' must be an integer >= 1")
        return DatasetRow(prompt, max_tokens)
    turns = item.get("conversations")
    if not isinstance(turns, list):
        raise WorkloadError(f"{where}: expected 'conversations' or 'prompt'")
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") in ("human", "user") and turn.get("value"):
            reply = turns[i + 1] if i + 1 < len(turns) and isinstance(turns[i + 1], dict) else {}
            reply_text = reply.get("value") if isinstance(reply.get("value"), str) else ""
            max_tokens = max(1, round(len(reply_text) / CHARS_PER_TOKEN)) if reply_text else None
            return DatasetRow(str(turn["value"]), max_tokens)
    return None  # ShareGPT has rows without a human turn: skipped, as other benchmarks do
