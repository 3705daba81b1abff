"""numba kernels of the plain codecs (the range coder's are in :mod:`weightsync.arith`)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _trailing_zeros(typingctx, x):
    """Index of the lowest set bit of a uint64 (64 for zero): LLVM's cttz, one instruction."""

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(1)])
        fn = builder.module.declare_intrinsic("llvm.cttz", [ir.IntType(64)], fnty)
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

    return types.uint64(types.uint64), codegen


@njit(cache=True, nogil=True)
def _changes(old, new, idx, diff):
    k = 0
    n_words = old.size // 64
    one = np.uint64(1)
    for w in range(n_words):
        base = w * 64
        mask = np.uint64(0)
        for j in range(64):  # vectorised compares
            mask |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
        for _ in range(2):  # the first two changes without a branch (most words have at most two at 1-5%)
            i = base + (np.int64(_trailing_zeros(mask)) & 63)
            idx[k] = i  # written always, kept only when there was a change
            diff[k] = new[i] - old[i]
            k += mask != 0
            mask &= mask - one
        while mask != 0:
            i = base + np.int64(_trailing_zeros(mask))
            idx[k] = i
            diff[k] = new[i] - old[i]
            k += 1
            mask &= mask - one
    for i in range(n_words * 64, old.size):
        o = old[i]
        x = new[i]
        idx[k] = i
        diff[k] = x - o
        k += o != x
    return k


def find_changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions where two unsigned arrays of the same length differ (ascending, int64) and the
    wrapping differences ``new - old`` there, in one pass over both; what
    ``np.flatnonzero(old != new)`` and a gather give. Words of 64 elements are compared at once
    into a bit mask whose set bits are then visited: on the codec trajectory 2.2x the speed of a
    branch-free loop over elements at 2.4% changed (4.9 -> 10.9 GB/s), the same at 15%."""
    idx = np.empty(old.size, np.int64)  # pages are only touched up to the number of changes
    diff = np.empty(old.size, old.dtype)
    k = _changes(old, new, idx, diff)
    return idx[:k], diff[:k]


@njit(cache=True, nogil=True)
def _apply_sparse(out, gaps, gw, vals, k, pos, end):
    n = gaps.size // gw
    width = out.itemsize
    while k < n:
        if gw == 1:  # spelled out per width (a predictable branch): a loop over bytes costs 1.5x
            gap = np.int64(gaps[k])
        elif gw == 2:
            gap = np.int64(gaps[k]) | np.int64(gaps[n + k]) << 8
        else:
            gap = (np.int64(gaps[k]) | np.int64(gaps[n + k]) << 8 | np.int64(gaps[2 * n + k]) << 16
                   | np.int64(gaps[3 * n + k]) << 24)
        nxt = pos + gap + 1
        if nxt >= end:
            break
        if width == 2:
            code = np.uint64(vals[k]) | np.uint64(vals[n + k]) << np.uint64(8)
        else:
            code = np.uint64(0)
            for j in range(width):
                code |= np.uint64(vals[j * n + k]) << np.uint64(8 * j)
        delta = (code >> np.uint64(1)) ^ (np.uint64(0) - (code & np.uint64(1)))  # zigzag back
        out[nxt] = out[nxt] + delta  # the store truncates: wraps at the element width
        pos = nxt
        k += 1
    return k, pos


def apply_sparse(out: np.ndarray, gaps: np.ndarray, gap_width: int, vals: np.ndarray, k: int, pos: int,
                 end: int) -> tuple[int, int]:
    """Apply changes ``k, k+1, ...`` of a ``sparse`` block to ``out`` (unsigned elements, holding
    the old values) while their positions stay below ``end``; returns the next change and the last
    position applied (-1 before any). ``gaps`` and ``vals`` are the decompressed byte planes (gap
    widths of ``gap_width`` bytes, zigzag codes of the element width); no arrays of positions or
    differences are built."""
    n = gaps.size // gap_width if gap_width in (1, 2, 4) else -1
    if n < 0 or gaps.size != n * gap_width or vals.size != n * out.itemsize or not 0 <= k <= n or not -1 <= pos < end <= out.size:
        raise ValueError("apply_sparse: planes, position or end do not fit the output")  # the kernel does not check bounds
    return _apply_sparse(out, gaps, gap_width, vals, k, pos, end)
