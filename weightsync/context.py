"""Context-modelled sparse coding (codec ``ctx``): the old value's exponent predicts the change.

Both sides hold the old tensor. Between RL steps an element changes when the optimizer's step
crosses a bf16 rounding boundary, so the smaller its magnitude (the finer the spacing) the more
often it flips. Elements are split into streams by the exponent field of their *old* value; in each
stream the changed positions are coded as gaps counted in that stream's own elements, so every
stream's gap statistics are homogeneous and zstd codes each near its own (lower) entropy.

The scans over all elements are numba kernels (one pass each, no temporaries of the block's size);
everything proportional to the number of changed elements is numpy.
"""

from __future__ import annotations

import struct

import numpy as np
from numba import njit

from .errors import FormatError

# dtype -> (shift, bits) of the exponent field within the unsigned view (sign bit excluded)
EXPONENT_FIELD: dict[str, tuple[int, int]] = {
    "BF16": (7, 8),
    "F16": (10, 5),
    "F32": (23, 8),
    "F64": (55, 8),  # the top 8 of 11 exponent bits: plenty of context
}
MAX_STREAMS = 16
MIN_STREAM_CHANGES = 1024  # a context with fewer changes joins the pooled stream 0
MIN_GAIN = 0.03  # split only when the estimate saves at least this fraction of the mask's entropy

_HEAD = struct.Struct("<IBBB")  # changed count, shift, bits, stream count
_STREAM = struct.Struct("<IBII")  # changed count, gap width, compressed gaps length, compressed values length


@njit(cache=True, nogil=True)
def _sample_histograms(old, new, shift, mask, stride):
    """Elements and changed elements per context value, over every ``stride``-th element."""
    every = np.zeros(mask + 1, np.int64)
    changed = np.zeros(mask + 1, np.int64)
    for i in range(0, old.size, stride):
        c = (old[i] >> shift) & mask
        every[c] += 1
        if old[i] != new[i]:
            changed[c] += 1
    return every, changed


@njit(cache=True, nogil=True)
def _count_changed(old, new):
    k = 0
    for i in range(old.size):
        k += old[i] != new[i]
    return k


@njit(cache=True, nogil=True)
def _scan(old, new, shift, mask, lut, n_streams, k):
    """For each of the ``k`` changed elements, in block order: its position, its stream, and its
    rank among the elements of its stream. One pass."""
    idx = np.empty(k, np.int64)
    stream = np.empty(k, np.uint8)
    rank_of = np.empty(k, np.int64)
    rank = np.zeros(n_streams, np.int64)
    j = 0
    for i in range(old.size):
        s = lut[(old[i] >> shift) & mask]
        if old[i] != new[i]:
            idx[j] = i
            stream[j] = s
            rank_of[j] = rank[s]
            j += 1
        rank[s] += 1
    return idx, stream, rank_of


@njit(cache=True, nogil=True)
def _locate(old, shift, mask, lut, starts, ranks):
    """Positions in the block of the elements at the given per-stream ranks (ascending within each
    stream); -1 where a rank lies beyond its stream (a corrupt payload)."""
    n_streams = starts.size - 1
    idx = np.full(starts[n_streams], -1, np.int64)
    rank = np.zeros(n_streams, np.int64)
    ptr = starts[:n_streams].copy()
    nxt = np.full(n_streams, -1, np.int64)  # the rank each stream waits for next
    for s in range(n_streams):
        if starts[s] < starts[s + 1]:
            nxt[s] = ranks[starts[s]]
    for i in range(old.size):
        s = lut[(old[i] >> shift) & mask]
        r = rank[s]
        if r == nxt[s]:
            p = ptr[s]
            idx[p] = i
            p += 1
            ptr[s] = p
            nxt[s] = ranks[p] if p < starts[s + 1] else -1
        rank[s] = r + 1
    return idx


def _streams(every: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """Map context values to streams: the busiest contexts get their own, the rest share stream 0."""
    lut = np.zeros(every.size, dtype=np.uint8)
    busy = np.argsort(-changed, kind="stable")[: MAX_STREAMS - 1]
    stream = 1
    for c in sorted(busy.tolist()):
        if changed[c] >= MIN_STREAM_CHANGES:
            lut[c] = stream
            stream += 1
    return lut


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def expected_gain(every: np.ndarray, changed: np.ndarray, lut: np.ndarray, n_streams: int) -> float:
    """Estimated fraction of the change mask's entropy saved by splitting into streams, net of the
    stream table and per-stream headers (from the sampled histograms)."""
    n, k = every.sum(), changed.sum()
    if n == 0 or k == 0:
        return 0.0
    plain = n * _h(np.array([k / n]))[0]
    n_s = np.bincount(lut, weights=every, minlength=n_streams)
    k_s = np.bincount(lut, weights=changed, minlength=n_streams)
    split = float(np.sum(n_s * _h(k_s / np.maximum(n_s, 1))))
    overhead_bits = 8 * (lut.size + 64 * n_streams)
    return (plain - split - overhead_bits) / plain


def encode_block(dtype: str, old: np.ndarray, new: np.ndarray, compress, to_planes, zigzag) -> tuple[bytes, int] | None:
    """One ``ctx`` block, or None when the context would not pay (too few changes to split, or the
    estimated saving from the sampled histograms is below ``MIN_GAIN``: then ``sparse`` is used);
    ``compress``/``to_planes``/``zigzag`` are the codec's own helpers."""
    shift, bits = EXPONENT_FIELD[dtype]
    mask = (1 << bits) - 1
    stride = max(1, min(16, old.size >> 16))
    every, changed = _sample_histograms(old, new, shift, mask, stride)
    every, changed = every * stride, changed * stride  # estimates for the whole block
    lut = _streams(every, changed)
    n_streams = int(lut.max()) + 1
    if n_streams < 2 or expected_gain(every, changed, lut, n_streams) < MIN_GAIN:
        return None
    k = _count_changed(old, new)
    if k == 0:
        return b"", 0
    idx, stream, rank = _scan(old, new, shift, mask, lut, n_streams, k)
    order = np.argsort(stream, kind="stable")
    counts = np.bincount(stream, minlength=n_streams)
    idx, rank = idx[order], rank[order]
    gaps = np.diff(rank, prepend=-1) - 1
    firsts = np.cumsum(counts)[:-1]
    firsts = firsts[firsts < idx.size]
    gaps[firsts] = rank[firsts]  # each stream's first gap counts from its own start
    vals = zigzag(new[idx] - old[idx])
    out = [_HEAD.pack(idx.size, shift, bits, n_streams), lut.tobytes()]
    pos = 0
    for c in counts.tolist():
        g, v = gaps[pos : pos + c], vals[pos : pos + c]
        gw = 1 if c == 0 or g.max() < 1 << 8 else 2 if g.max() < 1 << 16 else 4
        gz = compress(to_planes(g.astype(f"<u{gw}"))) if c else b""
        vz = compress(to_planes(v)) if c else b""
        out += [_STREAM.pack(c, gw, len(gz), len(vz)), gz, vz]
        pos += c
    return b"".join(out), int(idx.size)


def decode_block(dtype: str, block: memoryview, old: np.ndarray, out: np.ndarray, decompress, from_planes, unzigzag, what: str) -> None:
    out[:] = old
    if len(block) == 0:
        return
    if len(block) < _HEAD.size:
        raise FormatError(f"{what}: truncated ctx block")
    k, shift, bits, n_streams = _HEAD.unpack_from(block)
    if (shift, bits) != EXPONENT_FIELD.get(dtype) or not 0 < n_streams <= MAX_STREAMS or not 0 < k <= old.size:
        raise FormatError(f"{what}: bad ctx block header")
    mask = (1 << bits) - 1
    pos = _HEAD.size + mask + 1
    lut = np.frombuffer(block[_HEAD.size : pos], dtype=np.uint8)
    if lut.size != mask + 1 or int(lut.max()) >= n_streams:
        raise FormatError(f"{what}: bad ctx stream table")
    ranks, vals, counts = [], [], []
    width = old.dtype.itemsize
    for _ in range(n_streams):
        if pos + _STREAM.size > len(block):
            raise FormatError(f"{what}: truncated ctx stream header")
        c, gw, gl, vl = _STREAM.unpack_from(block, pos)
        pos += _STREAM.size
        if gw not in (1, 2, 4) or c > old.size or pos + gl + vl > len(block):
            raise FormatError(f"{what}: bad ctx stream header")
        if c:
            g = from_planes(decompress(block[pos : pos + gl], c * gw, what), gw, c).astype(np.int64)
            ranks.append(np.cumsum(g + 1) - 1)
            vals.append(unzigzag(from_planes(decompress(block[pos + gl : pos + gl + vl], c * width, what), width, c)))
        counts.append(c)
        pos += gl + vl
    if pos != len(block) or sum(counts) != k:
        raise FormatError(f"{what}: ctx block sizes do not add up")
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    idx = _locate(old, shift, mask, lut, starts, np.concatenate(ranks))
    if idx.size and int(idx.min()) < 0:
        raise FormatError(f"{what}: ctx positions beyond their streams")
    out[idx] = old[idx] + np.concatenate(vals)
