"""Codec ``ac`` (id 4): adaptive binary arithmetic coding of a delta, conditioned on the old value's
exponent field, in numba kernels (an LZMA-style range coder; docs/DESIGN.md has the models and
the cost per element)."""

from __future__ import annotations

import struct

import numpy as np

from weightsync.codec.abc import Codec
from weightsync.codec.jit import njit
from weightsync.codec.registry import register
from weightsync.codec.streams import read_only_bytes, unzigzag
from weightsync.errors import FormatError
from weightsync.format.dtypes import EXPONENT_FIELD, ITEMSIZE

_HEAD = struct.Struct("<IBBH")  # changed count, shift, bits, reserved


_TOP = 1 << 24


_PROB_BITS = 16


_ONE = 1 << _PROB_BITS


_LIMIT = 255


_RATE = np.array([_ONE // (n + 2) for n in range(_LIMIT + 1)], dtype=np.int64)


_SLOWEST = int(_RATE[_LIMIT])  # the rate of a model that has seen _LIMIT bits or more


_PREFIX_MODELS = 66


@njit(nogil=True, inline="always")
def _update(p, cnt, m, bit, rate):
    n = cnt[m]
    target = 0 if bit else _ONE
    q = p[m] + (((target - p[m]) * rate[n]) >> _PROB_BITS)
    p[m] = min(max(q, 32), _ONE - 32)
    if n < _LIMIT:
        cnt[m] = n + 1


@njit(nogil=True)
def _shift_low(low, cache, csize, pos, out):
    """Emit the top byte of ``low`` (through the carry cache); returns the new low, cache, cache
    size and output position."""
    if low < 0xFF000000 or low >= (1 << 32):
        carry = low >> 32
        temp = cache
        while True:
            out[pos] = (temp + carry) & 0xFF
            pos += 1
            temp = 0xFF
            csize -= 1
            if csize == 0:
                break
        cache = (low >> 24) & 0xFF
    return (low & 0x00FFFFFF) << 8, cache, csize + 1, pos


@njit(nogil=True)
def _encode(old, new, width_bits, shift, mask, n_ctx, out, rate):
    """Code a block; returns (bytes written or -1 if ``out`` was too small, elements changed).

    The difference of a changed element is taken here, wrapped to ``width_bits`` and zigzagged
    (elements of up to 4 bytes: exact in int64), so no pass over the block is needed beforehand.

    Models: ``2*n_ctx`` change bits (exponent context x previous element changed), then per
    exponent "is +-1" and sign bits, then Exp-Golomb prefix bits of larger differences.

    An unchanged element (most of them) takes a short path: one 0 decision, its model's update
    and renormalisation, with no per-element bookkeeping; the output is the same as coding it
    through the general path."""
    n_mask = 2 * n_ctx
    p = np.full(n_mask + 2 * n_ctx + _PREFIX_MODELS, _ONE // 2, np.int64)
    cnt = np.zeros(p.size, np.int64)
    low, rng, cache, csize, pos = 0, 0xFFFFFFFF, 0, 1, 0
    # the decisions of a changed element after its change bit: (model or -1 for a direct bit, bit)
    mods = np.empty(2 * 64 + 4, np.int64)
    bits = np.empty(2 * 64 + 4, np.int64)
    prev = 0
    limit = out.size - 64
    half, full = 1 << (width_bits - 1), 1 << width_bits
    j = 0
    for i in range(old.size):
        o = old[i]
        x = new[i]
        c = (o >> shift) & mask
        m = 2 * c + prev
        pm = p[m]
        k = cnt[m]
        bound = (rng >> _PROB_BITS) * pm
        r = _SLOWEST
        if k < _LIMIT:  # rarely taken: the load of the rate stays off the critical path
            cnt[m] = k + 1
            r = rate[k]
        if o == x:  # change bit 0
            rng = bound
            p[m] = min(pm + (((_ONE - pm) * r) >> _PROB_BITS), _ONE - 32)
            prev = 0
            if rng < _TOP:
                while rng < _TOP:
                    rng <<= 8
                    low, cache, csize, pos = _shift_low(low, cache, csize, pos, out)
                if pos + csize > limit:  # csize: bytes still held back for a carry
                    return -1, j
            continue
        low += bound  # change bit 1
        rng -= bound
        p[m] = max(pm + ((-pm * r) >> _PROB_BITS), 32)
        while rng < _TOP:
            rng <<= 8
            low, cache, csize, pos = _shift_low(low, cache, csize, pos, out)
        prev = 1
        d = np.int64(x) - np.int64(o)
        if d >= half:
            d -= full
        elif d < -half:
            d += full
        v = (2 * d if d >= 0 else -2 * d - 1) - 1  # zigzag(d) - 1 >= 0
        j += 1
        if v < 2:
            mods[0], bits[0], mods[1], bits[1], nd = n_mask + c, 0, n_mask + n_ctx + c, v, 2
        else:
            mods[0], bits[0], nd = n_mask + c, 1, 1
            w = v - 1
            nbits = 0
            t = w
            while t > 1:
                t >>= 1
                nbits += 1
            for q in range(nbits + 1):
                mods[nd], bits[nd] = n_mask + 2 * n_ctx + min(q, _PREFIX_MODELS - 1), 1 if q < nbits else 0
                nd += 1
            for q in range(nbits - 1, -1, -1):
                mods[nd], bits[nd] = -1, (w >> q) & 1
                nd += 1
        for e in range(nd):
            m, bit = mods[e], bits[e]
            if m >= 0:
                bound = (rng >> _PROB_BITS) * p[m]
                if bit:
                    low += bound
                    rng -= bound
                else:
                    rng = bound
                _update(p, cnt, m, bit, rate)
            else:
                rng >>= 1
                if bit:
                    low += rng
            while rng < _TOP:
                rng <<= 8
                low, cache, csize, pos = _shift_low(low, cache, csize, pos, out)
        if pos + csize > limit:
            return -1, j
    for _ in range(5):
        low, cache, csize, pos = _shift_low(low, cache, csize, pos, out)
    return pos, j


@njit(nogil=True, inline="always")
def _refill(code, rng, pos, data):
    """Normalize the decoder: shift in bytes while the range is below 2^24 (zeros past the end)."""
    while rng < _TOP:
        rng <<= 8
        b = data[pos] if pos < data.size else 0
        pos += 1
        code = ((code << 8) | b) & 0xFFFFFFFF
    return code, rng, pos


@njit(nogil=True, inline="always")
def _dec_bit(code, rng, pos, data, p, cnt, m, rate):
    """One modelled decision; returns (bit, code, range, pos)."""
    bound = (rng >> _PROB_BITS) * p[m]
    if code < bound:
        rng = bound
        bit = 0
    else:
        code -= bound
        rng -= bound
        bit = 1
    _update(p, cnt, m, bit, rate)
    code, rng, pos = _refill(code, rng, pos, data)
    return bit, code, rng, pos


@njit(nogil=True, inline="always")
def _dec_direct(code, rng, pos, data):
    rng >>= 1
    bit = 0
    if code >= rng:
        code -= rng
        bit = 1
    code, rng, pos = _refill(code, rng, pos, data)
    return bit, code, rng, pos


@njit(nogil=True)
def _decode(old, data, width_bits, shift, mask, n_ctx, k, rate, idx, zz):
    """Decode a block's changes: positions into ``idx``, zigzag codes into ``zz``; returns how many
    elements changed (must equal ``k``), -1 if the stream is longer than ``k`` or runs past its end, or
    -2 if it codes a difference wider than the element.

    Like the encoder, an unchanged element takes a short path (one decision, no calls)."""
    n_mask = 2 * n_ctx
    p = np.full(n_mask + 2 * n_ctx + _PREFIX_MODELS, _ONE // 2, np.int64)
    cnt = np.zeros(p.size, np.int64)
    code, rng, pos = 0, 0xFFFFFFFF, 0
    for _ in range(5):
        b = data[pos] if pos < data.size else 0
        pos += 1
        code = ((code << 8) | b) & 0xFFFFFFFF
    end = data.size + 8
    prev = 0
    j = 0
    for i in range(old.size):
        c = (old[i] >> shift) & mask
        m = 2 * c + prev
        pm = p[m]
        n = cnt[m]
        bound = (rng >> _PROB_BITS) * pm
        r = _SLOWEST
        if n < _LIMIT:  # rarely taken: the load of the rate stays off the critical path
            cnt[m] = n + 1
            r = rate[n]
        if code < bound:  # unchanged
            rng = bound
            p[m] = min(pm + (((_ONE - pm) * r) >> _PROB_BITS), _ONE - 32)
            prev = 0
            if rng < _TOP:
                code, rng, pos = _refill(code, rng, pos, data)
                if pos > end:
                    return -1
            continue
        code -= bound
        rng -= bound
        p[m] = max(pm + ((-pm * r) >> _PROB_BITS), 32)
        code, rng, pos = _refill(code, rng, pos, data)
        prev = 1
        if j == k:
            return -1
        bit, code, rng, pos = _dec_bit(code, rng, pos, data, p, cnt, n_mask + c, rate)
        if bit == 0:
            bit, code, rng, pos = _dec_bit(code, rng, pos, data, p, cnt, n_mask + n_ctx + c, rate)
            zz[j] = 1 + bit
        else:
            nbits = 0
            while True:
                bit, code, rng, pos = _dec_bit(
                    code, rng, pos, data, p, cnt, n_mask + 2 * n_ctx + min(nbits, _PREFIX_MODELS - 1), rate
                )
                if bit == 0:
                    break
                nbits += 1
                if nbits >= width_bits:  # the encoder never writes more than width_bits - 1
                    return -2
            w = 1
            for _ in range(nbits):
                bit, code, rng, pos = _dec_direct(code, rng, pos, data)
                w = (w << 1) | bit
            zz[j] = w + 2  # v = w + 1, zz = v + 1
        idx[j] = i
        j += 1
        if pos > end:
            return -1
    return j


def supports(dtype: str) -> bool:
    """Element widths up to 4 bytes (differences fit the kernels' signed 64-bit arithmetic)."""
    return ITEMSIZE[dtype] <= 4


def encode_block(dtype: str, old: np.ndarray, new: np.ndarray) -> tuple[bytes, int]:
    """One ``ac`` block (empty when nothing changed)."""
    if np.array_equal(old, new):
        return b"", 0
    shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
    mask = (1 << bits) - 1
    cap = old.size // 4 + 1024  # 2 bits an element: realistic deltas need a fraction of that
    while True:
        out = np.empty(cap, dtype=np.uint8)
        n, k = _encode(old, new, 8 * old.dtype.itemsize, shift, mask, mask + 1, out, _RATE)
        if n >= 0:
            return _HEAD.pack(k, shift, bits, 0) + out[:n].tobytes(), k
        cap *= 4  # dense or adversarial changes: grow until the block fits


def decode_block(dtype: str, block: memoryview, old: np.ndarray, out: np.ndarray, what: str) -> None:
    """Write the elements the ``ac`` block codes against ``old`` into ``out`` (may be ``old``)."""
    if out.ctypes.data != old.ctypes.data:  # else decoding in place: out is old
        out[:] = old
    if len(block) == 0:
        return
    if len(block) < _HEAD.size:
        raise FormatError(f"{what}: truncated ac block")
    k, shift, bits, _ = _HEAD.unpack_from(block)
    if (shift, bits) != EXPONENT_FIELD.get(dtype, (0, 0)) or not 0 < k <= old.size:
        raise FormatError(f"{what}: bad ac block header")
    mask = (1 << bits) - 1
    data = read_only_bytes(block, _HEAD.size)
    idx = np.empty(k, dtype=np.int64)
    zz = np.empty(k, dtype=np.int64)
    got = _decode(old, data, 8 * old.dtype.itemsize, shift, mask, mask + 1, k, _RATE, idx, zz)
    if got == -1:
        raise FormatError(f"{what}: ac stream holds more than the {k} changes its header says, or runs past its end")
    if got != k:
        raise FormatError(
            f"{what}: ac stream "
            + (
                "codes a difference wider than the element"
                if got == -2
                else f"decodes to {got} changes, header says {k}"
            )
        )
    if int(zz.max()) >= 1 << (8 * old.dtype.itemsize):
        raise FormatError(f"{what}: ac difference wider than the element")
    out[idx] = old[idx] + unzigzag(zz.astype(old.dtype))


@register
class AC(Codec):
    """``ac``: the change mask and the differences, arithmetic-coded with models chosen by the old
    value's exponent (elements of up to 4 bytes)."""

    id = 4
    name = "ac"

    def supports(self, dtype):
        return supports(dtype)

    def encode(self, dtype, old, new, config):
        return encode_block(dtype, old, new)

    def decode(self, dtype, block, old, out, what, hasher=None):
        decode_block(dtype, block, old, out, what)
        if hasher is not None:
            hasher.update(out)
