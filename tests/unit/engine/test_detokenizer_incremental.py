"""The incremental detokenizer: what it releases joins to exactly the whole output's
decode (multi-byte text, any grouping of tokens per message, stop strings), and each
token costs the same whatever the output's length (the token ids it decodes are counted).
"""

from __future__ import annotations

import random

import pytest

from pdserve.runtime.detokenizer import Detokenizer
from pdserve.runtime.tokenizer import ByteTokenizer

TEXT = "Grüße 😀 汉字かな 👩‍👩‍👧 — naïve café ∑ 𝄞 end " * 3


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, recording how many token ids each ``decode`` call gets."""

    def __init__(self) -> None:
        super().__init__(320)
        self.decoded: list[int] = []

    def decode(self, token_ids: list[int]) -> str:
        self.decoded.append(len(token_ids))
        return super().decode(token_ids)


def release(detok: Detokenizer, ids: list[int], group: int | None = None) -> tuple[str, bool]:
    rng = random.Random(group)
    out, i = [], 0
    while i < len(ids):
        n = 1 if group is None else rng.randint(1, 5)
        text, hit = detok.append(ids[i:i + n])
        out.append(text)
        i += n
        if hit:
            return "".join(out) + detok.flush(), True
    return "".join(out) + detok.flush(), False


@pytest.mark.parametrize("group", [None, 1, 2, 3])
def test_released_text_is_the_whole_decode(group):
    ids = list(TEXT.encode())
    tok = ByteTokenizer(320)
    assert release(Detokenizer(tok, []), ids, group) == (tok.decode(ids), False)
    # A truncated output ends in half a character: the end releases what a decode gives.
    cut = ids[:-1] + list("😀".encode())[:2]
    assert release(Detokenizer(tok, []), cut, group) == (tok.decode(cut), False)


@pytest.mark.parametrize("stop", ["汉字", "👩‍👧", "é ∑", "end G", "zzz"])
@pytest.mark.parametrize("group", [None, 7])
def test_stop_strings_cut_where_the_whole_decode_does(stop, group):
    ids = list(TEXT.encode())
    text, hit = release(Detokenizer(ByteTokenizer(320), [stop, "never"]), ids, group)
    assert hit == (stop in TEXT)
    assert text == TEXT.split(stop)[0]


def test_cost_per_token_does_not_grow_with_the_output():
    tok = CountingTokenizer()
    detok = Detokenizer(tok, ["STOP"])
    ids = list((TEXT * 40).encode())
    for i in ids:
        detok.append([i])
    assert len(ids) > 4000
    # Each token decodes a window of at most one character's bytes plus one of context.
    assert max(tok.decoded) <= 8
    assert len(tok.decoded) == 2 * len(ids)
