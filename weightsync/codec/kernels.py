"""numba kernels of the plain codecs (the range coder's are in :mod:`weightsync.codec.arith`)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from weightsync.codec.jit import njit
from weightsync.codec.simd import trailing_zeros as _trailing_zeros


@njit()
def gap_width(max_gap):
    """Bytes per gap in a ``sparse`` block: the narrowest of 1, 2 and 4 that holds ``max_gap``."""
    return 1 if max_gap < 1 << 8 else 2 if max_gap < 1 << 16 else 4


@njit(nogil=True)
def _sparse_streams(old, new):
    n = old.size
    pos = np.empty(n + 1, np.uint32)  # pages are only touched up to the number of changes (+1:
    diff = np.empty(n + 1, old.dtype)  # a word's branch-free step writes one slot ahead)
    one = np.uint64(1)
    k = 0
    n_words = n // 64
    for w in range(n_words + (n % 64 != 0)):  # positions and differences
        base = w * 64
        mask = np.uint64(0)
        if w < n_words:
            for j in range(64):  # vectorised compares
                mask |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
        else:  # the tail, fewer than 64 elements
            for j in range(n - base):
                mask |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
        for _ in range(4):  # the first four without a branch (a word holds 2 on average at 3% changed)
            i = min(base + (np.int64(_trailing_zeros(mask)) & 63), n - 1)  # in bounds in the tail
            pos[k] = i  # written always, kept only when there was a change
            diff[k] = new[i] - old[i]
            k += mask != 0
            mask &= mask - one
        while mask != 0:
            i = base + np.int64(_trailing_zeros(mask))
            pos[k] = i
            diff[k] = new[i] - old[i]
            k += 1
            mask &= mask - one
    max_gap = np.int64(0)
    prev = np.int64(-1)
    for t in range(k):  # the gaps in place of the positions
        p = np.int64(pos[t])
        gap = p - prev - 1
        max_gap = max(max_gap, gap)
        pos[t] = gap
        prev = p
    gw = gap_width(max_gap)
    width = old.itemsize
    shift = np.uint64(64 - 8 * width)
    out = np.empty(k * (gw + width), np.uint8)
    for j in range(gw):  # byte planes: all low bytes, then the next, ...
        for t in range(k):
            out[j * k + t] = np.uint8((pos[t] >> np.uint32(8 * j)) & np.uint32(0xFF))
    for t in range(k):  # zigzag codes of the differences, in place
        s = np.int64(np.uint64(diff[t]) << shift) >> np.int64(shift)  # sign-extended
        diff[t] = (s << 1) ^ (s >> 63)  # the store keeps the element width
    for j in range(width):
        for t in range(k):
            out[(gw + j) * k + t] = np.uint8((np.uint64(diff[t]) >> np.uint64(8 * j)) & np.uint64(0xFF))
    return out, k, gw


def sparse_streams(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The two streams of a ``sparse`` block in one pass over two unsigned arrays of the same
    length: the gaps between changed positions (each minus one, from position -1) and the zigzag
    codes of the wrapping differences ``new - old`` there, each split into byte planes, back to back
    in one buffer (gaps first); with the number of changes and the gap width in bytes (1, 2 or 4,
    the narrowest that holds the largest gap). What numpy gives through ``flatnonzero``, ``diff``,
    zigzag and a transpose, without their temporaries. Words of 64 elements are compared at once
    into a bit mask whose set bits are then visited: at 2.4% changed 2.2x the speed of a branch-free
    loop over elements, the same at 15%."""
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1 or old.dtype.kind != "u":
        raise ValueError("sparse_streams: two 1-D unsigned arrays of one dtype and length")
    if old.size >= 1 << 32:
        raise ValueError("sparse_streams: gaps are coded in at most 4 bytes")
    return _sparse_streams(old, new)


@njit(nogil=True)
def _changed_positions(old, new):
    n = old.size
    out = np.empty(n, np.int64)  # pages are only touched up to the number of changes
    k = 0
    for i in range(n):  # branch-free: write every position, advance past the changed ones
        out[k] = i
        k += old[i] != new[i]
    return out[:k].copy()


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The positions (int64, ascending) where two 1-D unsigned arrays of one dtype and length
    differ: ``np.flatnonzero(old != new)`` in one pass, without the boolean temporary, releasing
    the GIL."""
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1 or old.dtype.kind != "u":
        raise ValueError("changed_positions: two 1-D unsigned arrays of one dtype and length")
    return _changed_positions(old, new)


@njit(nogil=True)
def _split_planes(x, out):
    n = x.size
    for j in range(x.itemsize):  # a plane at a time: each loop is a vectorised narrowing (10x numpy's transpose)
        shift = np.uint64(8 * j)
        base = np.uint64(j * n)
        for i in range(np.uint64(0), np.uint64(n)):  # unsigned indices: no negative-index wrap
            out[base + i] = np.uint8(np.uint64(x[i]) >> shift)


@njit(nogil=True)
def _merge_planes(planes, x):
    n = x.size
    for i in range(np.uint64(0), np.uint64(n)):
        x[i] = planes[i]
    for j in range(1, x.itemsize):
        shift = np.uint64(8 * j)
        base = np.uint64(j * n)
        for i in range(np.uint64(0), np.uint64(n)):
            x[i] |= np.uint64(planes[base + i]) << shift


def split_planes(values: np.ndarray) -> np.ndarray:
    """Byte planes of unsigned little-endian integers (1-D): all low bytes, then the next, ..."""
    if values.ndim != 1 or values.dtype.kind != "u" or not values.dtype.isnative:
        raise ValueError("split_planes: a 1-D array of unsigned integers in native byte order")
    out = np.empty(values.nbytes, np.uint8)
    _split_planes(np.ascontiguousarray(values), out)
    return out


def merge_planes(planes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The integers whose byte planes ``planes`` (uint8, ``out.nbytes`` of them) holds, into ``out``."""
    if (
        out.ndim != 1
        or out.dtype.kind != "u"
        or not out.dtype.isnative
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError("merge_planes: out must be a writable, contiguous 1-D array of unsigned integers")
    if planes.dtype != np.uint8 or planes.ndim != 1 or planes.size != out.nbytes:
        raise ValueError(f"merge_planes: {planes.size} bytes of planes for {out.nbytes} bytes of integers")
    _merge_planes(planes, out)
    return out


@njit(nogil=True)
def _apply_sparse(out, src, start, gaps, gw, vals, k, pos, end, backward):
    if src is not None:
        for i in range(np.uint64(start), np.uint64(end)):  # unsigned: no negative-index wrap, so a memcpy
            out[i] = src[i]
    n = gaps.size // gw
    width = out.itemsize
    while k < n:
        if gw == 1:  # spelled out per width (a predictable branch): a loop over bytes costs 1.5x
            gap = np.int64(gaps[k])
        elif gw == 2:
            gap = np.int64(gaps[k]) | np.int64(gaps[n + k]) << 8
        else:
            gap = (
                np.int64(gaps[k])
                | np.int64(gaps[n + k]) << 8
                | np.int64(gaps[2 * n + k]) << 16
                | np.int64(gaps[3 * n + k]) << 24
            )
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
        if backward:  # a predictable branch: the old value from the new one
            delta = np.uint64(0) - delta
        out[nxt] = out[nxt] + delta  # the store truncates: wraps at the element width
        pos = nxt
        k += 1
    return k, pos


def apply_sparse(
    out: np.ndarray,
    gaps: np.ndarray,
    gap_width: int,
    vals: np.ndarray,
    k: int,
    pos: int,
    end: int,
    src: np.ndarray | None = None,
    start: int = 0,
    backward: bool = False,
) -> tuple[int, int]:
    """Apply changes ``k, k+1, ...`` of a ``sparse`` block to ``out`` (unsigned elements, holding
    the old values) while their positions stay below ``end``; returns the next change and the last
    position applied (-1 before any). ``gaps`` and ``vals`` are the decompressed byte planes (gap
    widths of ``gap_width`` bytes, zigzag codes of the element width); no arrays of positions or
    differences are built. ``src``: the old values are there, not in ``out``; elements
    ``start:end`` are copied from it first, in the same call (the next change must then lie at or
    after ``start``: every change before it was applied by an earlier call). ``backward``: subtract
    each difference instead (``out`` holds the new values; the old ones are written)."""
    n = gaps.size // gap_width if gap_width in (1, 2, 4) else -1
    if (
        n < 0
        or gaps.size != n * gap_width
        or vals.size != n * out.itemsize
        or not 0 <= k <= n
        or not -1 <= pos < end <= out.size
    ):
        raise ValueError(
            "apply_sparse: planes, position or end do not fit the output"
        )  # the kernel does not check bounds
    if src is not None and (
        src.dtype != out.dtype
        or src.shape != out.shape
        or not pos < start <= end
        or k < n
        and pos + 1 + sum(int(gaps[j * n + k]) << 8 * j for j in range(gap_width)) < start
    ):
        raise ValueError("apply_sparse: the source does not fit the output, or the next change lies before the copy")
    return _apply_sparse(out, src, start, gaps, gap_width, vals, k, pos, end, bool(backward))


def apply_sparse_feeding(
    out: np.ndarray,
    gaps: np.ndarray,
    gap_width: int,
    vals: np.ndarray,
    src: np.ndarray | None,
    backward: bool,
    step: int,
    fn: int,
    state: int,
) -> tuple[int, int, int]:
    """Every change of a ``sparse`` block, as :func:`apply_sparse` from the first with ``end`` the
    output's size, in slices of ``step`` elements, each fed to the XXH3 state ``state`` (through
    ``fn``, :func:`feed`) once written, in one call; returns the next change, the last position
    applied and the first failed update's error code (0: none)."""
    apply_sparse(out, gaps, gap_width, vals, 0, -1, 0, src, 0, backward)  # the checks alone: nothing to do
    return _apply_sparse_feeding(out, src, gaps, gap_width, vals, bool(backward), step, fn, state)


@njit(nogil=True)
def _apply_sparse_feeding(out, src, gaps, gw, vals, backward, step, fn, state):
    k, pos, n = 0, -1, out.size
    for a in range(0, n, step):
        b = min(a + step, n)
        k, pos = _apply_sparse(out, src, a, gaps, gw, vals, k, pos, b, backward)
        status = feed(fn, state, out, a, b)
        if status:
            return k, pos, status
    return k, pos, 0


# --- feeding an XXH3 state from a kernel (weightsync.codec.hashing) ------------------------------


@intrinsic
def _call_update(typingctx, fn, state, ptr, nbytes):
    """``((int (*)(void *, const void *, size_t)) fn)(state, ptr, nbytes)``: a call through an
    address known at run time (not baked into the code: numba's cache stays valid across
    processes)."""
    sig = types.int32(types.uint64, types.uint64, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [i8p, i8p, i64])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(target, [builder.inttoptr(args[1], i8p), builder.inttoptr(args[2], i8p), args[3]])

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """libc's ``memcpy(dst, src, nbytes)`` on addresses (numba's slice assignment and an element
    loop copied 2-6x slower than it, for 2- and 1-byte elements)."""
    sig = types.void(types.uint64, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        builder.call(
            builder.module.declare_intrinsic("llvm.memcpy", [i8p, i8p, ir.IntType(64)]),
            [builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2], ir.Constant(ir.IntType(1), 0)],
        )
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, inline="always")
def _address(arr, i):
    """The address of element ``i`` of the contiguous ``arr``."""
    return np.uint64(arr.ctypes.data) + np.uint64(i * arr.itemsize)


@njit(nogil=True)
def feed(fn, state, arr, a, e):
    """Feed elements ``a:e`` of the contiguous ``arr`` to the XXH3 state ``state`` through
    ``XXH3_128bits_update`` at ``fn`` (:data:`weightsync.codec.hashing.UPDATE`); returns its error code (0: done),
    or -1 for a range outside ``arr`` or an ``arr`` with a step (nothing is read then)."""
    if e <= a:
        return 0
    if a < 0 or e > arr.size or arr.strides[0] != arr.itemsize:
        return -1
    return _call_update(np.uint64(fn), np.uint64(state), _address(arr, a), np.uint64((e - a) * arr.itemsize))


@njit(nogil=True)
def copy_feeding(src, dst, fn, state, step):
    """``dst[:] = src`` slice by slice of ``step`` elements, each fed to ``state`` (as :func:`feed`)
    while it is in cache; returns 0, the first failed update's error code, or -1 (nothing copied) for
    arrays of other sizes or element widths, or with a step."""
    n = src.size
    if dst.size != n or dst.itemsize != src.itemsize:
        return -1
    if n > 0 and (src.strides[0] != src.itemsize or dst.strides[0] != dst.itemsize):
        return -1
    for a in range(0, n, step):
        b = min(a + step, n)
        _memcpy(_address(dst, a), _address(src, a), np.uint64((b - a) * src.itemsize))
        status = feed(fn, state, dst, a, b)
        if status:
            return status
    return 0
