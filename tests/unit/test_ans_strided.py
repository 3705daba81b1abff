"""Codec ``ans`` on strided arrays: its kernels load and store 64 elements at a time from an array's
first element on, so a view with a step (``a[::2]``, ``a[::-1]``) must be coded as its contiguous
copy would be, never read or written as if it were contiguous (other elements, or memory past the
buffer for a reversed view). A 1- or 2-byte dtype's raw bytes reach the codec as such a view
through :func:`weightsync.codec.encode_tensor` and :func:`weightsync.codec.decode_tensor`."""

from __future__ import annotations

import numpy as np
import pytest
from test_ans import base_of, changed

from weightsync.codec import CodecConfig, ans, decode_tensor, encode_tensor, simd
from weightsync.codec.payload import decode_tensor_backward


def strided(a: np.ndarray, how: str) -> np.ndarray:
    """A view of a copy of ``a`` with a step: every other element of a buffer twice as long, or reversed."""
    if how == "step":
        buf = np.zeros(2 * a.size, a.dtype)
        buf[::2] = a
        return buf[::2]
    return a[::-1].copy()[::-1]


@pytest.mark.parametrize("how", ["step", "reversed"])
@pytest.mark.parametrize("dtype", ["BF16", "U8", "F32"])
def test_strided_blocks_code_and_decode_as_their_contiguous_copies(dtype, how):
    rng = np.random.default_rng(11)
    old = base_of(dtype, 5000, rng)
    new = changed(old, 0.05, rng)
    data, k = ans.encode_block(dtype, old, new)
    assert k > 0
    assert ans.encode_block(dtype, strided(old, how), strided(new, how)) == (data, k)
    for native in simd.KINDS:
        out = np.empty_like(old)
        ans.decode_block(dtype, memoryview(data), strided(old, how), out, "test", native=native)
        assert np.array_equal(out, new)
        out = strided(np.zeros_like(old), how)
        ans.decode_block(dtype, memoryview(data), old, out, "test", native=native)
        assert np.array_equal(out, new)
        inplace = strided(old, how)
        ans.decode_block(dtype, memoryview(data), inplace, inplace, "test", native=native)
        assert np.array_equal(inplace, new)
        back = np.empty_like(new)
        ans.decode_block_backward(dtype, memoryview(data), strided(new, how), back, "test", native=native)
        assert np.array_equal(back, old)
        back = strided(np.zeros_like(new), how)
        ans.decode_block_backward(dtype, memoryview(data), new, back, "test", native=native)
        assert np.array_equal(back, old)


@pytest.mark.parametrize("how", ["step", "reversed"])
def test_strided_raw_bytes_of_a_one_byte_dtype_through_the_payload_functions(how):
    rng = np.random.default_rng(12)
    old = base_of("U8", 70_000, rng)
    new = changed(old, 0.03, rng)
    want = encode_tensor("U8", new, old, CodecConfig())
    assert want.codec == "ans"
    got = encode_tensor("U8", strided(new, how), strided(old, how), CodecConfig())
    assert (got.codec, bytes(got.payload)) == (want.codec, bytes(want.payload))
    out = decode_tensor("U8", "ans", want.payload, strided(old, how), old.size)
    assert np.array_equal(out, new)
    out = decode_tensor_backward("U8", "ans", want.payload, strided(new, how), new.size)
    assert np.array_equal(out, old)
