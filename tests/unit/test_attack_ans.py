"""Hostile and unlucky inputs to codec ``ans`` found by review: each test is a defect that was
fixed (docs/FORMAT.md, "ans"; docs/DESIGN.md, "weightsync.codec.ans")."""

from __future__ import annotations

import numpy as np
import pytest

from weightsync.codec import ans
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
    for bmi2 in {ans.HAS_BMI2, False}:
        with pytest.raises(FormatError):
            ans.decode_block("BF16", memoryview(block), base, np.empty_like(base), "hostile", bmi2=bmi2)
        with pytest.raises(FormatError):
            ans.decode_block_backward("BF16", memoryview(block), base, np.empty_like(base), "hostile", bmi2=bmi2)
