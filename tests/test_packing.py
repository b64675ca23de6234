"""Packing b-bit indices into uint32 words (FORMAT.md)."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rq_core.errors import RQError
from rq_core.codec.packing import pack, pack_np, unpack, unpack_np, words_per_row


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]), lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
       n=st.integers(1, 200), seed=st.integers(0, 2**31))
def test_round_trip_random_shapes(bits, lead, n, seed):
    idx = np.random.default_rng(seed).integers(0, 2**bits, (*lead, n)).astype(np.uint32)
    words = pack(mx.array(idx), bits)
    assert words.dtype == mx.uint32 and words.shape == (*lead, words_per_row(n, bits))
    w = np.array(words)
    np.testing.assert_array_equal(w, pack_np(idx, bits))  # MLX matches the bit-by-bit mirror
    np.testing.assert_array_equal(np.array(unpack(words, bits, n)), idx)
    np.testing.assert_array_equal(unpack_np(w, bits, n), idx)


def test_3bit_128_is_48_bytes_and_layout():
    idx = np.arange(128) % 8
    words = pack(mx.array(idx), 3)
    assert words.shape == (12,) and words.nbytes == 48
    w = [int(x) for x in np.array(words)]
    # Index i at bits [3i, 3i+3): value 10 straddles words 0 and 1 (bits 30..32).
    assert w[0] & 0b111 == 0 and (w[0] >> 3) & 0b111 == 1
    assert ((w[0] >> 30) | ((w[1] & 1) << 2)) == idx[10]
    # 32 indices per 3 words: the pattern repeats every 3 words (idx has period 8 → every 32 values).
    assert w[0:3] == w[3:6]


def test_bad_bits():
    for bits in (0, 9):
        with pytest.raises(RQError):
            pack(mx.zeros((4,), mx.uint32), bits)
