"""Codec ``bucket`` (id 5): a delta coded by runs within buckets of the old value's exponent
(docs/FORMAT.md, "Payloads").

The elements of a block are split into up to 8 buckets by thresholds on the old value's exponent
field. Within a bucket, the changed elements' ranks are coded as Rice-coded gaps, and their zigzag
differences with a static rANS model of the bucket (16 symbols, rarer ones escaped to Exp-Golomb
codes). Decoding is three independent steps: each bucket's stream into a bitmap over its ranks
and an array of differences; then one pass over the block that compares 64 old values at a time
with the thresholds (a vector compare), deposits each bucket's next bits into the changed mask
(``pdep``) and patches the changed elements; the unchanged majority costs the compare and the copy.
On a GPU the same steps are a per-bucket prefix sum of membership (the rank) and gathers.

The payload is invertible: the positions whose bucket the change moved are listed, so the
old tensor can be rebuilt from the new one (:func:`decode_backward`).
"""

from __future__ import annotations

import struct

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from weightsync.codec.abc import Codec
from weightsync.codec.jit import njit
from weightsync.codec.registry import register
from weightsync.codec.streams import SLICE_BYTES, copy, same_memory
from weightsync.errors import FormatError
from weightsync.format.dtypes import ITEMSIZE, UINT_VIEW

# dtype -> (shift, bits) of the exponent field (as ``ac``); other dtypes have one bucket.
EXPONENT_FIELD: dict[str, tuple[int, int]] = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8)}
MAX_BUCKETS = 8
NSYM = 16  # value symbols: zigzag - 1 for 0..14, 15 = escape (Exp-Golomb of zigzag - 16 follows)
PROB_BITS = 12
PROB_ONE = 1 << PROB_BITS
RANS_L = 1 << 23  # rANS state lower bound: states live in [2^23, 2^31), renormalised a byte at a time
RICE_ESCAPE = 32  # a Rice quotient of 32 or more: 32 one bits, then the gap in 32 bits
SAMPLE_WORDS = 16  # thresholds are chosen from every 16th word of 64 elements
CHANGES_PER_BUCKET = 256  # a bucket is worth its header and model when it holds about this many changes
_HEAD = struct.Struct("<IBBBB")  # changed count, buckets, shift, bits, flags

ONE = np.uint64(1)
ZERO = np.uint64(0)
ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


# --- intrinsics ------------------------------------------------------------------------------------
def _int_intrinsic(name: str, nargs: int):
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        if name == "llvm.cttz":
            fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
            fn = builder.module.declare_intrinsic(name, [i64], fnty)
            return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])
        fnty = ir.FunctionType(i64, [i64] * nargs)
        if name == "llvm.ctpop":
            fn = builder.module.declare_intrinsic(name, [i64], fnty)
        else:
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        return builder.call(fn, list(args))

    return codegen


@intrinsic
def _tz(typingctx, x):
    """Index of the lowest set bit (64 for zero)."""
    return types.uint64(types.uint64), _int_intrinsic("llvm.cttz", 1)


@intrinsic
def _pop(typingctx, x):
    """Set bits of a uint64."""
    return types.uint64(types.uint64), _int_intrinsic("llvm.ctpop", 1)


@intrinsic
def _pdep_bmi2(typingctx, x, m):
    """BMI2's parallel bit deposit: the low bits of ``x`` into the set bits of ``m``, in order."""
    return types.uint64(types.uint64, types.uint64), _int_intrinsic("llvm.x86.bmi.pdep.64", 2)


@njit(nogil=True, inline="always")
def _pdep_soft(x, m):
    """``pdep`` without BMI2: one step per set bit of ``m``."""
    out = ZERO
    while m != ZERO:
        low = m & (ZERO - m)
        out |= low & (ZERO - (x & ONE))
        x >>= ONE
        m &= m - ONE
    return out


def _has_bmi2() -> bool:
    try:
        return bool(llvm_binding.get_host_cpu_features().get("bmi2", False))
    except Exception:  # noqa: BLE001 - an LLVM that cannot say: the portable path
        return False


HAS_BMI2 = _has_bmi2()


@intrinsic
def _below_mask64(typingctx, ary, base, absmask, lim):
    """Bit j set where ``(ary[base + j] & absmask) < lim`` (unsigned) for j < 64: one vector compare."""

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        arr = context.make_array(aryty)(context, builder, value=args[0])
        ptr = builder.gep(arr.data, [args[1]])
        elt = context.get_data_type(aryty.dtype)
        vt = ir.VectorType(elt, 64)
        v = builder.load(builder.bitcast(ptr, vt.as_pointer()), align=aryty.dtype.bitwidth // 8)

        def splat(x):
            x = builder.trunc(x, elt) if x.type.width > elt.width else x
            s = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
            return builder.shuffle_vector(s, ir.Constant(vt, ir.Undefined), zeros)

        c = builder.icmp_unsigned("<", builder.and_(v, splat(args[2])), splat(args[3]))
        return builder.bitcast(c, ir.IntType(64))

    return types.uint64(ary, base, absmask, lim), codegen


@intrinsic
def _ne_mask64(typingctx, a, b, base):
    """Bit j set where ``a[base + j] != b[base + j]`` for j < 64."""

    def codegen(context, builder, sig, args):
        vals = []
        for aryty, ary in zip(sig.args[:2], args[:2]):
            arr = context.make_array(aryty)(context, builder, value=ary)
            ptr = builder.gep(arr.data, [args[2]])
            vt = ir.VectorType(context.get_data_type(aryty.dtype), 64)
            vals.append(builder.load(builder.bitcast(ptr, vt.as_pointer()), align=aryty.dtype.bitwidth // 8))
        return builder.bitcast(builder.icmp_unsigned("!=", vals[0], vals[1]), ir.IntType(64))

    return types.uint64(a, b, base), codegen


# --- bit streams ---------------------------------------------------------------------------------
@njit(nogil=True, inline="always")
def _put(buf, st, value, nbits):
    """Append the low ``nbits`` (<= 32) of ``value`` to a bit stream, LSB first; ``st`` = [accumulator,
    bits held, bytes written]."""
    st[0] |= (value & ((1 << nbits) - 1)) << st[1]
    st[1] += nbits
    while st[1] >= 8:
        buf[st[2]] = st[0] & 0xFF
        st[2] += 1
        st[0] >>= 8
        st[1] -= 8


@njit(nogil=True)
def _flush(buf, st):
    if st[1] > 0:
        buf[st[2]] = st[0] & 0xFF
        st[2] += 1
    st[0] = 0
    st[1] = 0


@njit(nogil=True, inline="always")
def _peek(words, pos):
    """64 bits of a stream (as uint64 words, padded with a zero word) from bit ``pos``."""
    q = pos >> 6
    s = np.uint64(pos & 63)
    return (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))


@njit(nogil=True)
def _put_rice(buf, st, g, k):
    q = g >> k
    if q >= RICE_ESCAPE:
        _put(buf, st, (1 << RICE_ESCAPE) - 1, RICE_ESCAPE)
        _put(buf, st, g, 32)
    else:
        _put(buf, st, (1 << q) - 1, q + 1)  # q ones, then a zero
        if k:
            _put(buf, st, g & ((1 << k) - 1), k)


@njit(nogil=True)
def _put_eg(buf, st, v):
    """Exp-Golomb (order 0) of v >= 0, LSB first: n ones, a zero, then the n bits of v + 1 below its top bit."""
    x = v + 1
    n = 0
    while (x >> (n + 1)) != 0:
        n += 1
    _put(buf, st, (1 << n) - 1, n + 1)
    if n > 16:
        _put(buf, st, x & 0xFFFF, 16)
        _put(buf, st, (x >> 16) & ((1 << (n - 16)) - 1), n - 16)
    elif n:
        _put(buf, st, x & ((1 << n) - 1), n)


@njit(nogil=True, inline="always")
def _get_eg(words, pos, limit):
    """Returns (value, new position), or (-1, pos) for a code that does not fit or runs past ``limit``."""
    w = _peek(words, pos)
    n = np.int64(_tz(~w))
    if n > 32:
        return -1, pos
    pos += n + 1
    x = np.int64(1) << n
    if n > 0:
        lo = np.int64(_peek(words, pos) & ((ONE << np.uint64(n)) - ONE))
        x |= lo
        pos += n
    if pos > limit:
        return -1, pos
    return x - 1, pos


# --- rANS ----------------------------------------------------------------------------------------
@njit(nogil=True)
def _normalise(counts, freq):
    """Frequencies summing to PROB_ONE, at least 1 for every symbol that occurs (deterministic)."""
    total = counts.sum()
    s = 0
    for i in range(NSYM):
        f = 0
        if counts[i] > 0:
            f = max(1, (counts[i] * PROB_ONE + total // 2) // total)
        freq[i] = f
        s += f
    while s != PROB_ONE:
        best = 0
        for i in range(NSYM):
            if freq[i] > freq[best]:
                best = i
        if s > PROB_ONE:
            # take from the largest that can give (largest keeps > 1 while s > ONE: 16 symbols, 4096 slots)
            freq[best] -= 1
            s -= 1
        else:
            freq[best] += 1
            s += 1


@njit(nogil=True)
def _rans_encode(syms, freq, out):
    """Bytes of the rANS stream coding ``syms`` (decoded first to last), in ``out``; returns its length.
    Layout: the final state (u32 LE), then the renormalisation bytes in the order the decoder reads them."""
    start = np.zeros(NSYM + 1, np.int64)
    for i in range(NSYM):
        start[i + 1] = start[i] + freq[i]
    tmp = np.empty(syms.size + 8, np.uint8)  # bytes, written backwards
    t = tmp.size
    x = np.int64(RANS_L)
    for j in range(syms.size - 1, -1, -1):
        s = syms[j]
        f = freq[s]
        x_max = ((RANS_L >> PROB_BITS) << 8) * f
        while x >= x_max:
            t -= 1
            tmp[t] = x & 0xFF
            x >>= 8
        x = ((x // f) << PROB_BITS) + (x % f) + start[s]
    for b in range(4):
        out[b] = (x >> (8 * b)) & 0xFF
    m = tmp.size - t
    out[4 : 4 + m] = tmp[t:]
    return 4 + m


@njit(nogil=True)
def _rans_decode(data, freq, zz, count):
    """Decode ``count`` symbols into ``zz`` (as symbol + 1); returns bytes consumed, or -1 for a bad stream."""
    if data.size < 4:
        return -1
    start = np.zeros(NSYM + 1, np.int64)
    for i in range(NSYM):
        start[i + 1] = start[i] + freq[i]
    lut = np.empty(PROB_ONE, np.uint8)
    for i in range(NSYM):
        lut[start[i] : start[i + 1]] = i
    x = np.int64(data[0]) | np.int64(data[1]) << 8 | np.int64(data[2]) << 16 | np.int64(data[3]) << 24
    if x < RANS_L or x >= RANS_L << 8:
        return -1
    pos = 4
    n = data.size
    mask = PROB_ONE - 1
    for j in range(count):
        slot = x & mask
        s = lut[slot]
        x = freq[s] * (x >> PROB_BITS) + slot - start[s]
        while x < RANS_L:
            if pos >= n:
                return -1
            x = (x << 8) | data[pos]
            pos += 1
        zz[j] = s + 1
    if x != RANS_L:  # the encoder's initial state: the stream is exactly what was coded
        return -1
    return pos


# --- encoding -------------------------------------------------------------------------------------
@njit(nogil=True)
def _thresholds(old, new, shift, fmask, kmax):
    """Exponent thresholds (ascending) splitting the block into at most ``kmax`` buckets that minimise
    the entropy of the change mask, from sampled words (all elements of a small block)."""
    n = old.size
    nexp = fmask + 1
    per = np.zeros(nexp, np.float64)
    chp = np.zeros(nexp, np.float64)
    n_words = n // 64
    step = SAMPLE_WORDS if n_words >= 64 * SAMPLE_WORDS else 1
    if step == 1:
        for i in range(n):
            e = (np.int64(old[i]) >> shift) & fmask
            per[e] += 1
            chp[e] += old[i] != new[i]
    else:
        for w in range(0, n_words, step):
            for i in range(w * 64, w * 64 + 64):
                e = (np.int64(old[i]) >> shift) & fmask
                per[e] += 1
                chp[e] += old[i] != new[i]
    est = chp.sum() * step
    k = min(kmax, max(1, np.int64(est) // CHANGES_PER_BUCKET))
    ex = np.flatnonzero(per)
    m = ex.size
    g = min(k, m)
    if g <= 1:
        return np.zeros(0, np.int64)
    cp = np.zeros(m + 1)
    cc = np.zeros(m + 1)
    for i in range(m):
        cp[i + 1] = cp[i] + per[ex[i]]
        cc[i + 1] = cc[i] + chp[ex[i]]
    dp = np.full((g + 1, m + 1), 1e300)
    arg = np.zeros((g + 1, m + 1), np.int64)
    dp[0, 0] = 0.0
    for q in range(1, g + 1):
        for b in range(q, m + 1):
            for a in range(q - 1, b):
                nn = cp[b] - cp[a]
                kk = cc[b] - cc[a]
                c = nn * np.log2(nn)
                if kk > 0:
                    c -= kk * np.log2(kk)
                if nn - kk > 0:
                    c -= (nn - kk) * np.log2(nn - kk)
                v = dp[q - 1, a] + c
                if v < dp[q, b] - 1e-9:
                    dp[q, b] = v
                    arg[q, b] = a
    cuts = np.zeros(g + 1, np.int64)
    cuts[g] = m
    b = m
    for q in range(g, 0, -1):
        b = arg[q, b]
        cuts[q - 1] = b
    thr = np.zeros(g - 1, np.int64)
    for t in range(g - 1):
        thr[t] = ex[cuts[t + 1]]
    return thr


@njit(nogil=True)
def _put_varint(out, pos, v):
    while v >= 0x80:
        out[pos] = (v & 0x7F) | 0x80
        v >>= 7
        pos += 1
    out[pos] = v
    return pos + 1


@njit(nogil=True)
def _masks_word(old, base, count, absmask, lim, nthr, masks):
    """The bucket masks of ``count`` (<= 64) elements from ``base``: bit j of masks[b] set where
    element base + j is in bucket b."""
    prev = ZERO
    valid = ALL if count == 64 else (ONE << np.uint64(count)) - ONE
    for t in range(nthr):
        if count == 64:
            m = _below_mask64(old, base, absmask, lim[t])
        else:
            m = ZERO
            for j in range(count):
                m |= np.uint64((old[base + j] & absmask) < lim[t]) << np.uint64(j)
        masks[t] = m & ~prev
        prev = m
    masks[nthr] = valid & ~prev


@njit(nogil=True)
def _encode(old, new, shift, bits, kmax, width_bits):
    """The block's bytes (without the leading changed count and header fields the caller adds) and
    the number of changed elements; see docs/FORMAT.md for the layout."""
    n = old.size
    fmask = (1 << bits) - 1
    if fmask > 0:
        thr = _thresholds(old, new, shift, fmask, kmax)
    else:
        thr = np.zeros(0, np.int64)
    nthr = thr.size
    K = nthr + 1
    lim = np.zeros(max(nthr, 1), old.dtype)
    for t in range(nthr):
        lim[t] = thr[t] << shift
    absmask = old.dtype.type((np.uint64(1) << np.uint64(width_bits - 1)) - ONE)
    lut = np.zeros(fmask + 1, np.int64)
    for e in range(fmask + 1):
        b = 0
        for t in range(nthr):
            b += e >= thr[t]
        lut[e] = b
    # 1. scan: bucket, rank and zigzag code of every changed element, in position order
    bucket = np.empty(n + 1, np.uint8)
    rank = np.empty(n + 1, np.int64)
    zz = np.empty(n + 1, np.uint64)
    exc = np.empty(n + 1, np.int64)
    masks = np.zeros(MAX_BUCKETS, np.uint64)
    cnt = np.zeros(MAX_BUCKETS, np.int64)
    sh = np.uint64(64 - width_bits)
    k = 0
    ne = 0
    n_words = (n + 63) // 64
    for w in range(n_words):
        base = w * 64
        count = min(64, n - base)
        if count == 64:
            c = _ne_mask64(old, new, base)
        else:
            c = ZERO
            for j in range(count):
                c |= np.uint64(old[base + j] != new[base + j]) << np.uint64(j)
        _masks_word(old, base, count, absmask, lim, nthr, masks)
        while c != ZERO:
            j = _tz(c)
            i = base + np.int64(j)
            o = old[i]
            b = lut[(np.int64(o) >> shift) & fmask]
            bucket[k] = b
            rank[k] = cnt[b] + np.int64(_pop(masks[b] & ((ONE << j) - ONE)))
            s = np.int64(np.uint64(new[i] - o) << sh) >> np.int64(sh)
            zz[k] = np.uint64((s << 1) ^ (s >> 63))
            if lut[(np.int64(new[i]) >> shift) & fmask] != b:
                exc[ne] = i
                ne += 1
            k += 1
            c &= c - ONE
        for b in range(K):
            cnt[b] += np.int64(_pop(masks[b]))
    if k == 0:
        return np.zeros(0, np.uint8), 0
    # 2. counting sort by bucket (stable: ranks stay ascending)
    cb = np.zeros(K + 1, np.int64)
    for j in range(k):
        cb[bucket[j] + 1] += 1
    for b in range(K):
        cb[b + 1] += cb[b]
    fill = cb[:K].copy()
    r2 = np.empty(k, np.int64)
    z2 = np.empty(k, np.uint64)
    for j in range(k):
        b = bucket[j]
        p = fill[b]
        r2[p] = rank[j]
        z2[p] = zz[j]
        fill[b] = p + 1
    # 3. per bucket: Rice-coded rank gaps + escapes (bit section), rANS of value symbols
    head = np.zeros(64 + 64 * K + 8 * ne, np.uint8)  # varints of at most 5 bytes
    body = np.zeros(64 + 64 * K + 20 * k, np.uint8)  # a gap or escape <= 9 bytes, a symbol <= 2
    hp = 0
    for t in range(nthr):
        head[hp] = thr[t]
        hp += 1
    hp = _put_varint(head, hp, ne)
    prevp = -1
    for j in range(ne):
        hp = _put_varint(head, hp, exc[j] - prevp - 1)
        prevp = exc[j]
    for j in range(ne):
        head[hp] = lut[(np.int64(old[exc[j]]) >> shift) & fmask]
        hp += 1
    bp = 0
    st = np.zeros(3, np.int64)
    counts = np.zeros(NSYM, np.int64)
    freq = np.zeros(NSYM, np.int64)
    for b in range(K):
        a, e = cb[b], cb[b + 1]
        nb = cnt[b]
        cbk = e - a
        hp = _put_varint(head, hp, nb)
        hp = _put_varint(head, hp, cbk)
        if cbk == 0:
            continue
        inv = 2 * cbk > nb
        ng = nb - cbk if inv else cbk
        gaps = np.empty(ng, np.int64)
        if inv:
            q = a
            gi = 0
            prevr = -1
            for r in range(nb):
                if q < e and r2[q] == r:
                    q += 1
                else:
                    gaps[gi] = r - prevr - 1
                    prevr = r
                    gi += 1
        else:
            prevr = -1
            for q in range(a, e):
                gaps[q - a] = r2[q] - prevr - 1
                prevr = r2[q]
        kr = 0
        if ng:
            mean = gaps.sum() / ng
            k0 = 0
            while (1 << (k0 + 1)) <= mean * 0.69:
                k0 += 1
            best = -1
            for kc in range(max(0, k0 - 1), min(k0 + 2, 31)):
                cost = 0
                for gi in range(ng):
                    qq = gaps[gi] >> kc
                    cost += qq + 1 + kc if qq < RICE_ESCAPE else RICE_ESCAPE + 32
                if best < 0 or cost < best:
                    best = cost
                    kr = kc
        counts[:] = 0
        for q in range(a, e):
            counts[min(z2[q] - 1, NSYM - 1)] += 1
        _normalise(counts, freq)
        nsym = 0
        for s in range(NSYM):
            if freq[s]:
                nsym = s + 1
        head[hp] = kr * 2 + inv
        head[hp + 1] = nsym
        hp += 2
        for s in range(nsym):
            hp = _put_varint(head, hp, freq[s])
        st[:] = 0
        sub = body[bp:]
        for gi in range(ng):
            _put_rice(sub, st, gaps[gi], kr)
        for q in range(a, e):
            if z2[q] >= NSYM:
                _put_eg(sub, st, np.int64(z2[q] - NSYM))
        _flush(sub, st)
        nbits_bytes = st[2]
        bp += nbits_bytes
        syms = np.empty(cbk, np.int64)
        for q in range(a, e):
            syms[q - a] = min(z2[q] - 1, NSYM - 1)
        rl = _rans_encode(syms, freq, body[bp:])
        bp += rl
        hp = _put_varint(head, hp, nbits_bytes)
        hp = _put_varint(head, hp, rl)
    out = np.empty(hp + bp + 8, np.uint8)
    out[0] = k & 0xFF
    out[1] = (k >> 8) & 0xFF
    out[2] = (k >> 16) & 0xFF
    out[3] = (k >> 24) & 0xFF
    out[4] = K
    out[5] = shift
    out[6] = bits
    out[7] = 0
    out[8 : 8 + hp] = head[:hp]
    out[8 + hp :] = body[:bp]
    return out, k


# --- decoding -------------------------------------------------------------------------------------
@njit(nogil=True, inline="always")
def _get_varint(data, pos):
    """(value, next position), or (-1, pos) for a varint that is longer than 5 bytes or runs past the end."""
    v = np.int64(0)
    for j in range(5):
        if pos >= data.size:
            return -1, pos
        b = np.int64(data[pos])
        pos += 1
        v |= (b & 0x7F) << (7 * j)
        if b < 0x80:
            return v, pos
    return -1, pos


@njit(nogil=True)
def _parse(data, n, width_bits):
    """Parse a block and decode its bucket streams. Returns (status, K, thresholds, per-bucket
    element counts, bitmaps over each bucket's ranks (uint64 words), each bucket's first bit,
    differences as zigzag codes in bucket then rank order, each bucket's first code, exception
    positions, their old buckets); status 0 is success, else the number of the check that failed."""
    z64 = np.zeros(0, np.int64)
    zu = np.zeros(0, np.uint64)
    zb = np.zeros(0, np.uint8)
    if data.size < 8:
        return 1, 0, z64, z64, zu, z64, zu, z64, z64, zb
    c = np.int64(data[0]) | np.int64(data[1]) << 8 | np.int64(data[2]) << 16 | np.int64(data[3]) << 24
    K = np.int64(data[4])
    bits = np.int64(data[6])
    if not (1 <= K <= MAX_BUCKETS) or data[7] != 0 or not (0 < c <= n) or bits > 8 or (bits == 0 and K != 1):
        return 2, 0, z64, z64, zu, z64, zu, z64, z64, zb
    pos = 8
    if data.size < pos + K - 1:
        return 3, 0, z64, z64, zu, z64, zu, z64, z64, zb
    thr = np.zeros(K - 1, np.int64)
    for t in range(K - 1):
        thr[t] = data[pos + t]
        if thr[t] < 1 or thr[t] >= (1 << bits) or (t > 0 and thr[t] <= thr[t - 1]):
            return 4, 0, z64, z64, zu, z64, zu, z64, z64, zb
    pos += K - 1
    ne, pos = _get_varint(data, pos)
    if ne < 0 or ne > c:
        return 5, 0, z64, z64, zu, z64, zu, z64, z64, zb
    exc = np.empty(ne, np.int64)
    exb = np.empty(ne, np.uint8)
    p = -1
    for j in range(ne):
        g, pos = _get_varint(data, pos)
        if g < 0 or p + g + 1 >= n:
            return 6, 0, z64, z64, zu, z64, zu, z64, z64, zb
        p += g + 1
        exc[j] = p
    if data.size < pos + ne:
        return 6, 0, z64, z64, zu, z64, zu, z64, z64, zb
    for j in range(ne):
        exb[j] = data[pos + j]
        if exb[j] >= K:
            return 6, 0, z64, z64, zu, z64, zu, z64, z64, zb
    pos += ne
    nb = np.zeros(K, np.int64)
    cb = np.zeros(K, np.int64)
    kr = np.zeros(K, np.int64)
    inv = np.zeros(K, np.int64)
    freq = np.zeros((K, NSYM), np.int64)
    blen = np.zeros(K, np.int64)
    rlen = np.zeros(K, np.int64)
    tot_n = 0
    tot_c = 0
    for b in range(K):
        nb[b], pos = _get_varint(data, pos)
        cb[b], pos = _get_varint(data, pos)
        if nb[b] < 0 or cb[b] < 0 or cb[b] > nb[b]:
            return 7, 0, z64, z64, zu, z64, zu, z64, z64, zb
        tot_n += nb[b]
        tot_c += cb[b]
        if cb[b] == 0:
            continue
        if pos + 2 > data.size:
            return 7, 0, z64, z64, zu, z64, zu, z64, z64, zb
        kr[b] = data[pos] >> 1
        inv[b] = data[pos] & 1
        nsym = np.int64(data[pos + 1])
        pos += 2
        if kr[b] > 30 or nsym < 1 or nsym > NSYM or (inv[b] == 1 and 2 * cb[b] <= nb[b]):
            return 8, 0, z64, z64, zu, z64, zu, z64, z64, zb
        s = 0
        for q in range(nsym):
            freq[b, q], pos = _get_varint(data, pos)
            if freq[b, q] < 0:
                return 8, 0, z64, z64, zu, z64, zu, z64, z64, zb
            s += freq[b, q]
        if s != PROB_ONE:
            return 8, 0, z64, z64, zu, z64, zu, z64, z64, zb
        blen[b], pos = _get_varint(data, pos)
        rlen[b], pos = _get_varint(data, pos)
        if blen[b] < 0 or rlen[b] < 0:
            return 9, 0, z64, z64, zu, z64, zu, z64, z64, zb
    if tot_n != n or tot_c != c or pos + blen.sum() + rlen.sum() != data.size:
        return 10, 0, z64, z64, zu, z64, zu, z64, z64, zb
    # bitmaps: bucket b owns words [wstart[b] >> 6, ...) with one spare word
    wstart = np.zeros(K + 1, np.int64)
    for b in range(K):
        wstart[b + 1] = wstart[b] + 64 * ((nb[b] >> 6) + 2)
    words = np.zeros(wstart[K] >> 6, np.uint64)
    zz = np.empty(c, np.uint64)
    zstart = np.zeros(K + 1, np.int64)
    for b in range(K):
        zstart[b + 1] = zstart[b] + cb[b]
    zmax = np.uint64(-1) if width_bits == 64 else (ONE << np.uint64(width_bits)) - ONE
    for b in range(K):
        if cb[b] == 0:
            continue
        bl = blen[b]
        sec = np.zeros((bl + 7) // 8 + 4, np.uint64)  # reads run up to 2 words past the end
        sec.view(np.uint8)[:bl] = data[pos : pos + bl]
        pos += bl
        limit = 8 * bl
        w0 = wstart[b] >> 6
        ng = nb[b] - cb[b] if inv[b] else cb[b]
        if inv[b]:
            for r in range(nb[b]):
                words[w0 + (r >> 6)] |= ONE << np.uint64(r & 63)
        r = -1
        bp = 0
        k = np.uint64(kr[b])
        kmask = (ONE << k) - ONE
        for _ in range(ng):
            w = _peek(sec, bp)
            q = np.int64(_tz(~w))
            if q >= RICE_ESCAPE:
                bp += RICE_ESCAPE
                g = np.int64(_peek(sec, bp) & np.uint64(0xFFFFFFFF))
                bp += 32
            else:
                bp += q + 1
                g = (q << kr[b]) | np.int64(_peek(sec, bp) & kmask)
                bp += kr[b]
            r += g + 1
            if r >= nb[b] or bp > limit:
                return 11, 0, z64, z64, zu, z64, zu, z64, z64, zb
            words[w0 + (r >> 6)] ^= ONE << np.uint64(r & 63)
        got = _rans_decode(data[pos : pos + rlen[b]], freq[b], zz[zstart[b] :], cb[b])
        if got != rlen[b]:
            return 12, 0, z64, z64, zu, z64, zu, z64, z64, zb
        pos += rlen[b]
        for j in range(zstart[b], zstart[b + 1]):
            if zz[j] == NSYM:
                v, bp = _get_eg(sec, bp, limit)
                if v < 0 or np.uint64(v) > zmax - np.uint64(NSYM):
                    return 13, 0, z64, z64, zu, z64, zu, z64, z64, zb
                zz[j] = np.uint64(v) + np.uint64(NSYM)
        if (bp + 7) // 8 != bl or (bp < limit and (_peek(sec, bp) & ((ONE << np.uint64(limit - bp)) - ONE)) != ZERO):
            return 14, 0, z64, z64, zu, z64, zu, z64, z64, zb
    return 0, K, thr, nb, words, wstart, zz, zstart, exc, exb


@njit(nogil=True)
def _apply(out, src, a, e, shift, fmask, lut, lim, nthr, words, boff, bend, zz, zptr, zend, sh, bmi2):
    """Copy elements ``a:e`` of ``src`` into ``out`` (unless ``src`` is None: decoding in place), then
    patch the changed ones; ``a`` is a multiple of 64. ``boff``/``zptr``: each bucket's next bit and
    next code, advanced. Returns 0, or 1 if a bucket's bits or codes run out."""
    if src is not None:
        for i in range(np.uint64(a), np.uint64(e)):
            out[i] = src[i]
    K = nthr + 1
    absmask = out.dtype.type((ONE << np.uint64(8 * out.itemsize - 1)) - ONE)
    masks = np.zeros(MAX_BUCKETS, np.uint64)
    for base in range(a, e, 64):
        count = min(64, e - base)
        _masks_word(out, base, count, absmask, lim, nthr, masks)
        ch = ZERO
        over = False
        for b in range(K):
            m = masks[b]
            p = np.int64(_pop(m))
            off = boff[b]
            q = off >> 6
            s = np.uint64(off & 63)
            v = (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))
            v &= (ALL >> np.uint64((64 - p) & 63)) & (ZERO - np.uint64(p != 0))
            if bmi2:
                ch |= _pdep_bmi2(v, m)
            else:
                ch |= _pdep_soft(v, m)
            boff[b] = off + p
            over |= off + p > bend[b]
        if over:
            return 1
        while ch != ZERO:
            i = base + np.int64(_tz(ch))
            o = out[i]
            b = lut[(np.int64(o) >> shift) & fmask]
            zi = zptr[b]
            if zi >= zend[b]:
                return 1
            code = zz[zi]
            out[i] = o + ((code >> ONE) ^ (ZERO - (code & ONE)))
            zptr[b] = zi + 1
            ch &= ch - ONE
    return 0


# --- the codec ------------------------------------------------------------------------------------
def supports(dtype: str) -> bool:
    """Element widths up to 4 bytes (as ``ac``)."""
    return ITEMSIZE[dtype] <= 4


def encode_block(dtype: str, old: np.ndarray, new: np.ndarray) -> tuple[bytes, int]:
    """One ``bucket`` block (empty when nothing changed) and how many elements changed."""
    shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
    data, k = _encode(old, new, shift, bits, MAX_BUCKETS, 8 * old.dtype.itemsize)
    return data.tobytes(), k


class Parsed:
    """A block's streams decoded (:func:`parse`): what the pass over the elements needs."""

    def __init__(self, dtype: str, block: memoryview, n: int, width: int, what: str) -> None:
        if len(block) < 8:
            raise FormatError(f"{what}: truncated bucket block")
        shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
        if (block[5], block[6]) != (shift, bits):
            raise FormatError(f"{what}: bucket block's exponent field ({block[5]}, {block[6]}) is not {dtype}'s")
        data = np.frombuffer(block, dtype=np.uint8)
        status, K, thr, nb, words, wstart, zz, zstart, exc, exb = _parse(data, n, 8 * width)
        if status:
            raise FormatError(f"{what}: bad bucket block (check {status} failed)")
        self.shift, self.bits, self.K, self.thr, self.nb = shift, bits, K, thr, nb
        self.words, self.wstart, self.zz, self.zstart, self.exc, self.exb = words, wstart, zz, zstart, exc, exb
        self.lut = np.searchsorted(thr, np.arange(1 << bits), side="right").astype(np.int64)


def decode_block(dtype, block, old, out, what, hasher=None, bmi2=HAS_BMI2) -> None:
    """Write the elements the block codes against ``old`` into ``out`` (may be ``old``), hashing
    each slice of ``out`` while it is in cache."""
    if len(block) == 0:
        copy(old, out, hasher)
        return
    p = Parsed(dtype, block, old.size, old.dtype.itemsize, what)
    src = None if same_memory(out, old) else old
    lim = np.array([t << p.shift for t in p.thr] or [0], dtype=old.dtype)
    boff = p.wstart[:-1].copy()
    bend = p.wstart[:-1] + p.nb
    zptr = p.zstart[:-1].copy()
    zend = p.zstart[1:].copy()
    step = max(64, (SLICE_BYTES // old.dtype.itemsize) // 64 * 64)
    fmask = (1 << p.bits) - 1
    for a in range(0, old.size, step):
        e = min(a + step, old.size)
        if _apply(out, src, a, e, p.shift, fmask, p.lut, lim, p.K - 1, p.words, boff, bend, p.zz, zptr, zend, 0, bmi2):
            raise FormatError(f"{what}: bucket block's positions do not fit its base")
        if hasher is not None:
            hasher.update(out[a:e])
    if not (np.array_equal(boff, bend) and np.array_equal(zptr, zend)):
        raise FormatError(f"{what}: bucket block's bucket sizes do not match its base")


def _bucket_of(p: Parsed, values: np.ndarray) -> np.ndarray:
    return p.lut[(values.astype(np.int64) >> p.shift) & ((1 << p.bits) - 1)]


def _changes(p: Parsed, buckets: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions (ascending) and zigzag codes of the changes, given every element's bucket: per
    bucket, the rank of each member is a prefix sum of membership and its changed flag a gather from
    the bucket's bitmap (the steps a GPU kernel takes, one thread block per block)."""
    idx, codes = [], []
    for b in range(p.K):
        members = np.flatnonzero(buckets == b)
        if members.size != p.nb[b]:
            raise FormatError(f"{what}: bucket block's bucket sizes do not match its base")
        ranks = np.arange(members.size)
        w0 = p.wstart[b]
        bit = ((w0 + ranks) & 63).astype(np.uint64)
        flags = (p.words[(w0 + ranks) >> 6] >> bit) & np.uint64(1)
        changed = members[flags.astype(bool)]
        idx.append(changed)
        codes.append(p.zz[p.zstart[b] : p.zstart[b + 1]])
    idx_all, codes_all = np.concatenate(idx), np.concatenate(codes)
    order = np.argsort(idx_all, kind="stable")
    return idx_all[order], codes_all[order]


def _unzigzag(codes: np.ndarray, dtype: np.dtype) -> np.ndarray:
    c = codes.astype(dtype)
    return (c >> dtype.type(1)) ^ (np.zeros_like(c) - (c & dtype.type(1)))


def decode_reference(dtype: str, block: bytes, old: np.ndarray, what: str = "block") -> np.ndarray:
    """The new elements from ``old`` and a block, in numpy, by the GPU-shaped steps (every element's
    bucket, prefix sums and gathers): the reference a CUDA decoder is tested against."""
    if len(block) == 0:
        return old.copy()
    p = Parsed(dtype, memoryview(block), old.size, old.dtype.itemsize, what)
    idx, codes = _changes(p, _bucket_of(p, old), what)
    out = old.copy()
    out[idx] = old[idx] + _unzigzag(codes, old.dtype)
    return out


def decode_backward(dtype: str, block: bytes, new: np.ndarray, what: str = "block") -> np.ndarray:
    """The old elements from the new ones and the block that coded new against old: buckets are
    taken from the new values, except at the listed positions whose change moved them (a rollback
    without a keyframe)."""
    if len(block) == 0:
        return new.copy()
    p = Parsed(dtype, memoryview(block), new.size, new.dtype.itemsize, what)
    buckets = _bucket_of(p, new)
    buckets[p.exc] = p.exb
    idx, codes = _changes(p, buckets, what)
    old = new.copy()
    old[idx] = new[idx] - _unzigzag(codes, new.dtype)
    if np.any(_bucket_of(p, old[p.exc]) != p.exb):
        raise FormatError(f"{what}: bucket block's exceptions do not match the rebuilt base")
    return old


@register
class Bucket(Codec):
    """``bucket``: changes coded per bucket of the old value's exponent, Rice-coded rank gaps and
    rANS-coded differences (elements of up to 4 bytes)."""

    id = 5
    name = "bucket"

    def supports(self, dtype):
        return supports(dtype)

    def encode(self, dtype, old, new, config):
        return encode_block(dtype, old, new)

    def decode(self, dtype, block, old, out, what, hasher=None):
        decode_block(dtype, block, old, out, what, hasher)
