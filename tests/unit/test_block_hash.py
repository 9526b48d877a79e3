"""Block hashes: the router's ``hash_chain`` gives the engine's ``hash_block`` chain,
and the values stay what every pdserve version computed (engines and Coordinators of
two versions must agree on a prefix)."""

from __future__ import annotations

import pytest

from pdserve.runtime.block_hash import hash_block, hash_chain


def test_known_values():
    assert hash_block(None, [1, 2, 3]).hex() == "abccad42d03c940bc2b249bf5a4e1e3d"
    assert hash_block(b"\x01" * 16, [2**40, -5]).hex() == "bbe16e35c0a498239749c16556f47fd6"
    assert [h.hex() for h in hash_chain(list(range(10)), 4)] == [
        "61abbbbadcb5a29f38974c1405255595", "ceb7796f6f9059e045e6ec8c7df2e484"]


@pytest.mark.parametrize("num_tokens, block_size", [(0, 4), (3, 4), (4, 4), (181, 16), (7, 1)])
def test_the_chain_is_hash_block_block_by_block(num_tokens, block_size):
    tokens = [(i * 7919) % 50000 for i in range(num_tokens)]
    expected, parent = [], None
    for start in range(0, num_tokens - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        expected.append(parent)
    assert hash_chain(tokens, block_size) == expected
    assert len(expected) == num_tokens // block_size
