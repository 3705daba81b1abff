"""Hostile and unlucky inputs to codec ``ans`` found by review: each test is a defect that was
fixed (docs/FORMAT.md, "ans"; docs/DESIGN.md, "weightsync.codec.ans")."""

from __future__ import annotations

import numpy as np
import pytest

from weightsync.codec import ans, simd
from weightsync.errors import FormatError


def test_a_base_that_puts_every_change_in_a_small_group_is_refused_without_reading_past_the_differences():
    """A block whose group 1 holds one change, decoded (forward and backward) against a base whose
    every element lies in group 1: the pass took all the changes' differences from group 1's and
    read up to a block's worth past the array of differences (a segfault)."""
    n = 1 << 20
    old = np.full(n, 50 << 7, np.uint16)  # BF16, exponent 50: group 0
    old[-1] = 120 << 7  # exponent 120: group 1
    new = old + np.uint16(1)
    block, c = ans.encode_block("BF16", old, new, split=([], [100]))
    assert c == n
    base = np.full(n, 120 << 7, np.uint16)
    for native in simd.KINDS:
        with pytest.raises(FormatError):
            ans.decode_block("BF16", memoryview(block), base, np.empty_like(base), "hostile", native=native)
        with pytest.raises(FormatError):
            ans.decode_block_backward("BF16", memoryview(block), base, np.empty_like(base), "hostile", native=native)


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    return bytes(out + bytes([v]))


def test_the_reference_backward_decoder_refuses_an_exception_whose_element_did_not_change():
    """An exception listed at an unchanged element, with a bucket its value does not have: the fast
    backward decoder refused it, the numpy reference returned a base the block does not decode from."""
    from weightsync.codec import entropy

    n = 64
    new = np.full(n, 10 << 7, np.uint16)  # BF16, exponent 10: bucket 0 of the threshold 100
    rice = np.zeros(64, np.uint8)
    rice = rice[: entropy.rice_section(np.array([5], np.uint64), 0, rice)].tobytes()  # rank 5 changed
    freq = np.zeros(16, np.int64)
    freq[1] = 4096
    rans = np.zeros(64, np.uint8)
    rans = rans[: entropy.rans_encode(np.array([1], np.uint8), 1, freq, rans)].tobytes()  # zigzag 2: +1
    head = (1).to_bytes(4, "little") + bytes([2, 7, 8, 1, 100])  # c, K = 2, BF16's field, G = 1, threshold
    head += _varint(1) + _varint(7) + bytes([1 << 4])  # element 7 listed in bucket 1: it is in bucket 0
    head += _varint(63) + _varint(1) + bytes([0]) + _varint(len(rice)) + _varint(1) + _varint(0)
    head += _varint(1) + bytes([2]) + _varint(0) + _varint(4096) + _varint(0) + _varint(len(rans))
    block = head + rice + rans
    with pytest.raises(FormatError):
        ans.decode_block_backward("BF16", memoryview(block), new, np.empty_like(new), "hostile")
    with pytest.raises(FormatError):
        ans.decode_backward("BF16", block, new, "hostile")


@pytest.mark.parametrize("kind", [True, simd.VECTOR, simd.BMI2])
def test_the_kinds_with_pdep_are_refused_where_bmi2_is_missing(monkeypatch, kind):
    """The native or the ``BMI2`` kind on a CPU without BMI2 (or with numba compiling for another one)
    would run ``pdep``, an illegal instruction there: refused before any kernel runs."""
    monkeypatch.setattr(ans, "HAS_BMI2", False)
    old = np.arange(4096, dtype=np.uint16)
    new = old + np.uint16(1)
    sparse = old.copy()
    sparse[::100] += np.uint16(1)  # a block the BMI2 kind would scan as the portable kind does
    for n in (new, sparse):
        with pytest.raises(ValueError, match="BMI2"):
            ans.encode_block("BF16", old, n, native=kind)
    block, _ = ans.encode_block("BF16", old, new, native=False)
    with pytest.raises(ValueError, match="BMI2"):
        ans.decode_block("BF16", memoryview(block), old, np.empty_like(old), "t", native=kind)
