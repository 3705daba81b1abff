"""Codec ``ans`` decoded by torch operations (:mod:`weightsync.torch.ansdecode`) against the numpy
reference decoder and the fast pass: every dtype width, every bucket and group count, hostile
blocks. On the CPU here; on CUDA with WEIGHTSYNC_TEST_DEVICE=cuda (benchmarks/gpu.sh)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_ans import VIEW, base_of, changed

from weightsync.codec import ans
from weightsync.errors import FormatError, UsageError
from weightsync.torch.ansdecode import decode_block
from weightsync.torch.dtypes import TORCH_INT

DEVICE = torch.device(os.environ.get("WEIGHTSYNC_TEST_DEVICE", "cpu"))  # benchmarks/gpu.sh: cuda


def on_device(a: np.ndarray) -> torch.Tensor:
    """``a``'s bits as the signed (or uint8) view the torch decoder takes, on DEVICE."""
    return torch.from_numpy(a.view(TORCH_INT_NP[a.itemsize]).copy()).to(DEVICE)


def back(t: torch.Tensor, like: np.ndarray) -> np.ndarray:
    return t.cpu().numpy().view(like.dtype)


TORCH_INT_NP = {1: np.uint8, 2: np.int16, 4: np.int32}


def check(dtype: str, old: np.ndarray, data: bytes) -> np.ndarray:
    """The torch decoder's result, which must be the reference's and the pass's."""
    got = back(decode_block(dtype, data, on_device(old)), old)
    assert np.array_equal(got, ans.decode_reference(dtype, data, old))
    out = np.empty_like(old)
    ans.decode_block(dtype, memoryview(data), old, out, "test")
    assert np.array_equal(got, out)
    return got


@pytest.mark.parametrize("dtype", sorted(VIEW))
@pytest.mark.parametrize("n", [1, 64, 1000, 70_000])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.03, 0.3, 1.0])
def test_blocks_decode_as_the_reference_does(dtype, n, frac):
    rng = np.random.default_rng(n + int(frac * 1000))
    old = base_of(dtype, n, rng)
    new = changed(old, frac, rng)
    data, _ = ans.encode_block(dtype, old, new)
    assert np.array_equal(check(dtype, old, data), new)


@pytest.mark.parametrize("buckets", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_every_bucket_and_group_count(buckets, groups):
    rng = np.random.default_rng(buckets * 10 + groups)
    old = base_of("BF16", 20_000, rng)
    new = changed(old, 0.05, rng)
    split = ([118, 120, 120][: buckets - 1], [119, 121, 121][: groups - 1])
    data, _ = ans.encode_block("BF16", old, new, split=split)
    assert np.array_equal(check("BF16", old, data), new)


def test_another_base_is_refused_or_decodes_as_the_reference_does():
    """A block applied to a base it was not made from: the torch decoder refuses it exactly when the
    reference does, else gives the reference's (wrong) bytes, which the segment's checksum rejects."""
    rng = np.random.default_rng(7)
    refused = 0
    for trial in range(12):
        old = base_of("BF16", 50_000, rng)  # 4 buckets
        data, _ = ans.encode_block("BF16", old, changed(old, 0.05, rng))
        assert data[4] & 7 == 4
        other = changed(old, 0.01 * trial, rng) if trial % 2 else base_of("BF16", 50_000, rng)
        try:
            want = ans.decode_reference("BF16", data, other)
        except FormatError:
            refused += 1
            with pytest.raises(FormatError):
                decode_block("BF16", data, on_device(other))
            continue
        assert np.array_equal(back(decode_block("BF16", data, on_device(other)), other), want)
    assert refused > 0


def test_bad_blocks_and_views_are_refused():
    rng = np.random.default_rng(8)
    old = base_of("BF16", 3000, rng)
    data, _ = ans.encode_block("BF16", old, changed(old, 0.05, rng))
    with pytest.raises(FormatError):
        decode_block("BF16", data[: len(data) // 2], on_device(old))
    with pytest.raises(FormatError):
        decode_block("BF16", data, on_device(old[:-1]))
    with pytest.raises(UsageError, match="1-D"):
        decode_block("BF16", data, on_device(old).to(torch.int32))
    with pytest.raises(UsageError, match="1-D"):
        decode_block("BF16", data, on_device(old).view(1000, 3))
    assert TORCH_INT[2] == torch.int16
