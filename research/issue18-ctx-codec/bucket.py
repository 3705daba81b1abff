"""Prototype codec ``bucket`` (issue 18, second attempt; not registered): a delta coded by runs within buckets of the old value's exponent
(layout: README.md here).

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

from weightsync.codec.jit import njit
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
def _histogram(old, new, shift, fmask):
    """Elements and changed elements per exponent value, from every 16th word of 64 elements (every
    element of a block under 64K words), and the sampling step."""
    n = old.size
    per = np.zeros(fmask + 1, np.float64)
    chp = np.zeros(fmask + 1, np.float64)
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
    return per, chp, step


@njit(nogil=True)
def _thresholds(per, chp, k):
    """Exponent thresholds (ascending) splitting the exponents into at most ``k`` contiguous groups
    that minimise the entropy of the change mask given the group (dynamic programming)."""
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
    cost = np.zeros((m + 1, m + 1))
    for a in range(m):
        for b in range(a + 1, m + 1):
            nn = cp[b] - cp[a]
            kk = cc[b] - cc[a]
            c = nn * np.log2(nn)
            if kk > 0:
                c -= kk * np.log2(kk)
            if nn - kk > 0:
                c -= (nn - kk) * np.log2(nn - kk)
            cost[a, b] = c
    dp = np.full((g + 1, m + 1), 1e300)
    arg = np.zeros((g + 1, m + 1), np.int64)
    dp[0, 0] = 0.0
    for q in range(1, g + 1):
        for b in range(q, m + 1):
            for a in range(q - 1, b):
                v = dp[q - 1, a] + cost[a, b]
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
def _lut(thr, fmask):
    lut = np.zeros(fmask + 1, np.int64)
    for e in range(fmask + 1):
        b = 0
        for t in range(thr.size):
            b += e >= thr[t]
        lut[e] = b
    return lut


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
def _counting_sort(key, vals, k, nkeys):
    """``vals[:k]`` grouped by ``key`` (stable) and each group's start (nkeys + 1 of them)."""
    cb = np.zeros(nkeys + 1, np.int64)
    for j in range(k):
        cb[key[j] + 1] += 1
    for b in range(nkeys):
        cb[b + 1] += cb[b]
    fill = cb[:nkeys].copy()
    out = np.empty(k, vals.dtype)
    for j in range(k):
        b = key[j]
        out[fill[b]] = vals[j]
        fill[b] += 1
    return out, cb


@njit(nogil=True)
def _rice_parameter(gaps):
    """The Rice parameter near log2 of the mean gap that codes ``gaps`` in the fewest bits."""
    ng = gaps.size
    if ng == 0:
        return 0
    mean = gaps.sum() / ng
    k0 = 0
    while (1 << (k0 + 1)) <= mean * 0.69:
        k0 += 1
    best = -1
    kr = 0
    for kc in range(max(0, k0 - 1), min(k0 + 2, 31)):
        cost = 0
        for gi in range(ng):
            qq = gaps[gi] >> kc
            cost += qq + 1 + kc if qq < RICE_ESCAPE else RICE_ESCAPE + 32
        if best < 0 or cost < best:
            best = cost
            kr = kc
    return kr


@njit(nogil=True)
def _encode(old, new, shift, bits, kp, kv, width_bits):
    """The block coding ``new`` against ``old`` (docs/FORMAT.md) and the number of changed elements."""
    n = old.size
    fmask = (1 << bits) - 1
    thr_p = np.zeros(0, np.int64)
    thr_v = np.zeros(0, np.int64)
    if fmask > 0:
        per, chp, step = _histogram(old, new, shift, fmask)
        est = np.int64(chp.sum()) * step  # changes, estimated: a context is worth its header with ~256
        thr_p = _thresholds(per, chp, min(kp, max(1, est // CHANGES_PER_BUCKET)))
        thr_v = _thresholds(per, chp, min(kv, max(1, est // CHANGES_PER_BUCKET)))
    nthr = thr_p.size
    KP = nthr + 1
    KV = thr_v.size + 1
    lim = np.zeros(max(nthr, 1), old.dtype)
    for t in range(nthr):
        lim[t] = thr_p[t] << shift
    absmask = old.dtype.type((np.uint64(1) << np.uint64(width_bits - 1)) - ONE)
    lut_p = _lut(thr_p, fmask)
    lut_v = _lut(thr_v, fmask)
    # 1. scan: bucket, rank, value context and zigzag code of every changed element, in position order
    bucket = np.empty(n + 1, np.uint8)
    vctx = np.empty(n + 1, np.uint8)
    rank = np.empty(n + 1, np.int64)
    zz = np.empty(n + 1, np.uint64)
    exc = np.empty(n + 1, np.int64)
    masks = np.zeros(MAX_BUCKETS, np.uint64)
    cnt = np.zeros(MAX_BUCKETS, np.int64)
    sh = np.uint64(64 - width_bits)
    k = 0
    ne = 0
    for w in range((n + 63) // 64):
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
            eo = (np.int64(o) >> shift) & fmask
            en = (np.int64(new[i]) >> shift) & fmask
            b = lut_p[eo]
            bucket[k] = b
            vctx[k] = lut_v[eo]
            rank[k] = cnt[b] + np.int64(_pop(masks[b] & ((ONE << j) - ONE)))
            s = np.int64(np.uint64(new[i] - o) << sh) >> np.int64(sh)
            zz[k] = np.uint64((s << 1) ^ (s >> 63))
            if lut_p[en] != b or lut_v[en] != lut_v[eo]:
                exc[ne] = i
                ne += 1
            k += 1
            c &= c - ONE
        for b in range(KP):
            cnt[b] += np.int64(_pop(masks[b]))
    if k == 0:
        return np.zeros(0, np.uint8), 0
    r2, cb = _counting_sort(bucket, rank[:k], k, KP)
    z2, cv = _counting_sort(vctx, zz[:k], k, KV)
    head = np.zeros(64 + 64 * (KP + KV) + 8 * ne, np.uint8)  # varints of at most 5 bytes
    body = np.zeros(64 + 64 * (KP + KV) + 20 * k, np.uint8)  # a gap or escape <= 9 bytes, a symbol <= 2
    head[0] = k & 0xFF
    head[1] = (k >> 8) & 0xFF
    head[2] = (k >> 16) & 0xFF
    head[3] = (k >> 24) & 0xFF
    head[4] = KP
    head[5] = shift
    head[6] = bits
    head[7] = KV
    hp = 8
    for t in range(nthr):
        head[hp] = thr_p[t]
        hp += 1
    for t in range(KV - 1):
        head[hp] = thr_v[t]
        hp += 1
    hp = _put_varint(head, hp, ne)
    prevp = -1
    for j in range(ne):
        hp = _put_varint(head, hp, exc[j] - prevp - 1)
        prevp = exc[j]
    for j in range(ne):
        eo = (np.int64(old[exc[j]]) >> shift) & fmask
        head[hp] = lut_p[eo] << 4 | lut_v[eo]
        hp += 1
    # 2. per position bucket: the rank gaps (of the unchanged ranks when most changed), Rice-coded
    bp = 0
    st = np.zeros(3, np.int64)
    for b in range(KP):
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
        prevr = -1
        if inv:
            q = a
            gi = 0
            for r in range(nb):
                if q < e and r2[q] == r:
                    q += 1
                else:
                    gaps[gi] = r - prevr - 1
                    prevr = r
                    gi += 1
        else:
            for q in range(a, e):
                gaps[q - a] = r2[q] - prevr - 1
                prevr = r2[q]
        kr = _rice_parameter(gaps)
        st[:] = 0
        sub = body[bp:]
        for gi in range(ng):
            _put_rice(sub, st, gaps[gi], kr)
        _flush(sub, st)
        bp += st[2]
        head[hp] = kr * 2 + inv
        hp = _put_varint(head, hp + 1, st[2])
    # 3. per value context: rANS of the value symbols, escapes as Exp-Golomb codes
    counts = np.zeros(NSYM, np.int64)
    freq = np.zeros(NSYM, np.int64)
    for v in range(KV):
        a, e = cv[v], cv[v + 1]
        hp = _put_varint(head, hp, e - a)
        if e == a:
            continue
        counts[:] = 0
        syms = np.empty(e - a, np.int64)
        for q in range(a, e):
            syms[q - a] = min(z2[q] - 1, NSYM - 1)
            counts[syms[q - a]] += 1
        _normalise(counts, freq)
        nsym = 0
        for s in range(NSYM):
            if freq[s]:
                nsym = s + 1
        head[hp] = nsym
        hp += 1
        for s in range(nsym):
            hp = _put_varint(head, hp, freq[s])
        st[:] = 0
        sub = body[bp:]
        for q in range(a, e):
            if z2[q] >= NSYM:
                _put_eg(sub, st, np.int64(z2[q] - NSYM))
        _flush(sub, st)
        bp += st[2]
        hp = _put_varint(head, hp, st[2])
        rl = _rans_encode(syms, freq, body[bp:])
        bp += rl
        hp = _put_varint(head, hp, rl)
    out = np.empty(hp + bp, np.uint8)
    out[:hp] = head[:hp]
    out[hp:] = body[:bp]
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
def _padded_words(data, pos, length):
    sec = np.zeros((length + 7) // 8 + 4, np.uint64)  # reads run up to 2 words past the end
    sec.view(np.uint8)[:length] = data[pos : pos + length]
    return sec


@njit(nogil=True)
def _clean_end(sec, bp, length):
    """Whether a bit section of ``length`` bytes ends at bit ``bp`` (the last byte's rest zero)."""
    limit = 8 * length
    if (bp + 7) // 8 != length:
        return False
    return bp == limit or (_peek(sec, bp) & ((ONE << np.uint64(limit - bp)) - ONE)) == ZERO


@njit(nogil=True)
def _parse(data, n, width_bits):
    """Parse a block and decode its streams. Returns (status, thresholds of the position buckets,
    of the value contexts, each bucket's element count, bitmaps over each bucket's ranks (uint64
    words), each bucket's first bit, zigzag codes grouped by value context, each context's first
    code, exception positions, their old bucket << 4 | context); status 0 is success, else the
    number of the check that failed."""
    z64 = np.zeros(0, np.int64)
    zu = np.zeros(0, np.uint64)
    zb = np.zeros(0, np.uint8)
    if data.size < 8:
        return 1, z64, z64, z64, zu, z64, zu, z64, z64, zb
    c = np.int64(data[0]) | np.int64(data[1]) << 8 | np.int64(data[2]) << 16 | np.int64(data[3]) << 24
    KP = np.int64(data[4])
    bits = np.int64(data[6])
    KV = np.int64(data[7])
    if not (1 <= KP <= MAX_BUCKETS and 1 <= KV <= MAX_BUCKETS and 0 < c <= n and bits <= 8):
        return 2, z64, z64, z64, zu, z64, zu, z64, z64, zb
    if bits == 0 and (KP != 1 or KV != 1):
        return 2, z64, z64, z64, zu, z64, zu, z64, z64, zb
    pos = 8
    if data.size < pos + KP + KV - 2:
        return 3, z64, z64, z64, zu, z64, zu, z64, z64, zb
    thr_p = np.zeros(KP - 1, np.int64)
    thr_v = np.zeros(KV - 1, np.int64)
    for t in range(KP + KV - 2):
        x = np.int64(data[pos + t])
        first = t == 0 or t == KP - 1
        if t < KP - 1:
            thr_p[t] = x
        else:
            thr_v[t - KP + 1] = x
        if x < 1 or x >= (1 << bits) or (not first and x <= data[pos + t - 1]):
            return 4, z64, z64, z64, zu, z64, zu, z64, z64, zb
    pos += KP + KV - 2
    ne, pos = _get_varint(data, pos)
    if ne < 0 or ne > c:
        return 5, z64, z64, z64, zu, z64, zu, z64, z64, zb
    exc = np.empty(ne, np.int64)
    exb = np.empty(ne, np.uint8)
    p = -1
    for j in range(ne):
        g, pos = _get_varint(data, pos)
        if g < 0 or p + g + 1 >= n:
            return 6, z64, z64, z64, zu, z64, zu, z64, z64, zb
        p += g + 1
        exc[j] = p
    if data.size < pos + ne:
        return 6, z64, z64, z64, zu, z64, zu, z64, z64, zb
    for j in range(ne):
        exb[j] = data[pos + j]
        if (exb[j] >> 4) >= KP or (exb[j] & 15) >= KV:
            return 6, z64, z64, z64, zu, z64, zu, z64, z64, zb
    pos += ne
    nb = np.zeros(KP, np.int64)
    cb = np.zeros(KP, np.int64)
    kr = np.zeros(KP, np.int64)
    inv = np.zeros(KP, np.int64)
    blen = np.zeros(KP, np.int64)
    tot_n = 0
    tot_c = 0
    for b in range(KP):
        nb[b], pos = _get_varint(data, pos)
        cb[b], pos = _get_varint(data, pos)
        if nb[b] < 0 or cb[b] < 0 or cb[b] > nb[b]:
            return 7, z64, z64, z64, zu, z64, zu, z64, z64, zb
        tot_n += nb[b]
        tot_c += cb[b]
        if cb[b] == 0:
            continue
        if pos >= data.size:
            return 7, z64, z64, z64, zu, z64, zu, z64, z64, zb
        kr[b] = data[pos] >> 1
        inv[b] = data[pos] & 1
        blen[b], pos = _get_varint(data, pos + 1)
        if kr[b] > 30 or (inv[b] == 1) != (2 * cb[b] > nb[b]) or blen[b] < 0:
            return 8, z64, z64, z64, zu, z64, zu, z64, z64, zb
    if tot_n != n or tot_c != c:
        return 9, z64, z64, z64, zu, z64, zu, z64, z64, zb
    cv = np.zeros(KV, np.int64)
    freq = np.zeros((KV, NSYM), np.int64)
    elen = np.zeros(KV, np.int64)
    rlen = np.zeros(KV, np.int64)
    tot_c = 0
    for v in range(KV):
        cv[v], pos = _get_varint(data, pos)
        if cv[v] < 0:
            return 10, z64, z64, z64, zu, z64, zu, z64, z64, zb
        tot_c += cv[v]
        if cv[v] == 0:
            continue
        if pos >= data.size:
            return 10, z64, z64, z64, zu, z64, zu, z64, z64, zb
        nsym = np.int64(data[pos])
        pos += 1
        if nsym < 1 or nsym > NSYM:
            return 10, z64, z64, z64, zu, z64, zu, z64, z64, zb
        s = 0
        for q in range(nsym):
            freq[v, q], pos = _get_varint(data, pos)
            if freq[v, q] < 0:
                return 10, z64, z64, z64, zu, z64, zu, z64, z64, zb
            s += freq[v, q]
        elen[v], pos = _get_varint(data, pos)
        rlen[v], pos = _get_varint(data, pos)
        if s != PROB_ONE or elen[v] < 0 or rlen[v] < 0:
            return 10, z64, z64, z64, zu, z64, zu, z64, z64, zb
    if tot_c != c or pos + blen.sum() + elen.sum() + rlen.sum() != data.size:
        return 11, z64, z64, z64, zu, z64, zu, z64, z64, zb
    # positions: bucket b's bitmap over its ranks owns words [wstart[b] >> 6, ...), one spare word
    wstart = np.zeros(KP + 1, np.int64)
    for b in range(KP):
        wstart[b + 1] = wstart[b] + 64 * ((nb[b] >> 6) + 2)
    words = np.zeros(wstart[KP] >> 6, np.uint64)
    for b in range(KP):
        if cb[b] == 0:
            continue
        bl = blen[b]
        sec = _padded_words(data, pos, bl)
        pos += bl
        limit = 8 * bl
        w0 = wstart[b] >> 6
        ng = nb[b] - cb[b] if inv[b] else cb[b]
        if inv[b]:
            for q in range(nb[b] >> 6):
                words[w0 + q] = ALL
            if nb[b] & 63:
                words[w0 + (nb[b] >> 6)] = (ONE << np.uint64(nb[b] & 63)) - ONE
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
                return 12, z64, z64, z64, zu, z64, zu, z64, z64, zb
            words[w0 + (r >> 6)] ^= ONE << np.uint64(r & 63)
        if not _clean_end(sec, bp, bl):
            return 12, z64, z64, z64, zu, z64, zu, z64, z64, zb
    # values: per context, the rANS symbols, then the escapes' Exp-Golomb codes
    zz = np.empty(c, np.uint64)
    zstart = np.zeros(KV + 1, np.int64)
    for v in range(KV):
        zstart[v + 1] = zstart[v] + cv[v]
    zmax = (ONE << np.uint64(width_bits)) - ONE
    for v in range(KV):
        if cv[v] == 0:
            continue
        sec = _padded_words(data, pos, elen[v])
        pos += elen[v]
        got = _rans_decode(data[pos : pos + rlen[v]], freq[v], zz[zstart[v] :], cv[v])
        if got != rlen[v]:
            return 13, z64, z64, z64, zu, z64, zu, z64, z64, zb
        pos += rlen[v]
        bp = 0
        for j in range(zstart[v], zstart[v + 1]):
            if zz[j] == NSYM:
                x, bp = _get_eg(sec, bp, 8 * elen[v])
                if x < 0 or np.uint64(x) > zmax - np.uint64(NSYM):
                    return 14, z64, z64, z64, zu, z64, zu, z64, z64, zb
                zz[j] = np.uint64(x) + np.uint64(NSYM)
        if not _clean_end(sec, bp, elen[v]):
            return 14, z64, z64, z64, zu, z64, zu, z64, z64, zb
    return 0, thr_p, thr_v, nb, words, wstart, zz, zstart, exc, exb


@njit(nogil=True, inline="always")
def _take(words, off, p):
    """``p`` (0..64) bits of a bitmap from bit ``off``."""
    q = off >> 6
    s = np.uint64(off & 63)
    v = (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))
    return v & (ALL >> np.uint64((64 - p) & 63)) & (ZERO - np.uint64(p != 0))


@njit(nogil=True)
def _apply3(out, src, a, e, shift, fmask, lut_v, l0, l1, nthr, words, boff, bend, zz, zptr, zend, bmi2):
    """:func:`_apply` for at most 3 position buckets and whole words (``e - a`` a multiple of 64),
    with the pass state in locals."""
    if src is not None:
        for i in range(np.uint64(a), np.uint64(e)):
            out[i] = src[i]
    absmask = out.dtype.type((ONE << np.uint64(8 * out.itemsize - 1)) - ONE)
    o0, o1, o2 = boff[0], boff[1] if nthr >= 1 else 0, boff[2] if nthr >= 2 else 0
    for base in range(a, e, 64):
        if nthr == 0:
            m0, m1, m2 = ALL, ZERO, ZERO
        else:
            lo = _below_mask64(out, base, absmask, l0)
            hi = _below_mask64(out, base, absmask, l1) if nthr == 2 else ALL
            m0, m1, m2 = lo, hi & ~lo, ~hi
        p0, p1, p2 = np.int64(_pop(m0)), np.int64(_pop(m1)), np.int64(_pop(m2))
        if bmi2:
            ch = _pdep_bmi2(_take(words, o0, p0), m0) | _pdep_bmi2(_take(words, o1, p1), m1)
            ch |= _pdep_bmi2(_take(words, o2, p2), m2)
        else:
            ch = _pdep_soft(_take(words, o0, p0), m0) | _pdep_soft(_take(words, o1, p1), m1)
            ch |= _pdep_soft(_take(words, o2, p2), m2)
        o0 += p0
        o1 += p1
        o2 += p2
        if o0 > bend[0] or (nthr >= 1 and o1 > bend[1]) or (nthr >= 2 and o2 > bend[2]):
            return 1
        while ch != ZERO:
            i = base + np.int64(_tz(ch))
            o = out[i]
            c = lut_v[(np.int64(o) >> shift) & fmask]
            zi = zptr[c]
            if zi >= zend[c]:
                return 1
            code = zz[zi]
            out[i] = o + ((code >> ONE) ^ (ZERO - (code & ONE)))
            zptr[c] = zi + 1
            ch &= ch - ONE
    boff[0] = o0
    if nthr >= 1:
        boff[1] = o1
    if nthr >= 2:
        boff[2] = o2
    return 0


@njit(nogil=True)
def _apply(out, src, a, e, shift, fmask, lut_v, lim, nthr, words, boff, bend, zz, zptr, zend, bmi2):
    """Copy elements ``a:e`` of ``src`` into ``out`` (unless ``src`` is None: decoding in place), then
    patch the changed ones; ``a`` is a multiple of 64. ``boff``/``zptr``: each bucket's next bit and
    each value context's next code, advanced. Returns 0, or 1 if bits or codes run out."""
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
            c = lut_v[(np.int64(o) >> shift) & fmask]
            zi = zptr[c]
            if zi >= zend[c]:
                return 1
            code = zz[zi]
            out[i] = o + ((code >> ONE) ^ (ZERO - (code & ONE)))
            zptr[c] = zi + 1
            ch &= ch - ONE
    return 0


# --- the codec ------------------------------------------------------------------------------------
POSITION_BUCKETS = 3  # each costs a vector compare and a bit deposit per 64 elements when decoding
VALUE_CONTEXTS = 8  # cost nothing per unchanged element: a table lookup per changed one


def supports(dtype: str) -> bool:
    """Element widths up to 4 bytes (as ``ac``)."""
    return ITEMSIZE[dtype] <= 4


def encode_block(dtype: str, old: np.ndarray, new: np.ndarray) -> tuple[bytes, int]:
    """One ``bucket`` block (empty when nothing changed) and how many elements changed."""
    shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
    data, k = _encode(old, new, shift, bits, POSITION_BUCKETS, VALUE_CONTEXTS, 8 * old.dtype.itemsize)
    return data.tobytes(), k


class Parsed:
    """A block's streams decoded by :func:`_parse`: what the pass over the elements needs."""

    def __init__(self, dtype: str, block: memoryview, n: int, width: int, what: str) -> None:
        if len(block) < 8:
            raise FormatError(f"{what}: truncated bucket block")
        shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
        if (block[5], block[6]) != (shift, bits):
            raise FormatError(f"{what}: bucket block's exponent field ({block[5]}, {block[6]}) is not {dtype}'s")
        data = np.frombuffer(block, dtype=np.uint8)
        status, thr_p, thr_v, nb, words, wstart, zz, zstart, exc, exb = _parse(data, n, 8 * width)
        if status:
            raise FormatError(f"{what}: bad bucket block (check {status} failed)")
        self.shift, self.fmask, self.thr_p, self.nb = shift, (1 << bits) - 1, thr_p, nb
        self.words, self.wstart, self.zz, self.zstart, self.exc, self.exb = words, wstart, zz, zstart, exc, exb
        self.lut_p = np.searchsorted(thr_p, np.arange(1 << bits), side="right").astype(np.int64)
        self.lut_v = np.searchsorted(thr_v, np.arange(1 << bits), side="right").astype(np.int64)


def decode_block(dtype, block, old, out, what, hasher=None, bmi2=HAS_BMI2) -> None:
    """Write the elements the block codes against ``old`` into ``out`` (may be ``old``), hashing
    each slice of ``out`` while it is in cache. ``bmi2``: use the instruction (else a portable loop)."""
    if len(block) == 0:
        copy(old, out, hasher)
        return
    p = Parsed(dtype, block, old.size, old.dtype.itemsize, what)
    src = None if same_memory(out, old) else old
    lim = np.array([t << p.shift for t in p.thr_p] or [0], dtype=old.dtype)
    boff = p.wstart[:-1].copy()
    bend = p.wstart[:-1] + p.nb
    zptr = p.zstart[:-1].copy()
    zend = p.zstart[1:].copy()
    step = max(64, (SLICE_BYTES // old.dtype.itemsize) // 64 * 64)
    for a in range(0, old.size, step):
        e = min(a + step, old.size)
        nthr = p.thr_p.size
        if nthr <= 2 and (e - a) % 64 == 0:
            bad = _apply3(out, src, a, e, p.shift, p.fmask, p.lut_v, lim[0], lim[-1], nthr, p.words, boff, bend, p.zz, zptr, zend, bmi2)
        else:
            bad = _apply(out, src, a, e, p.shift, p.fmask, p.lut_v, lim, nthr, p.words, boff, bend, p.zz, zptr, zend, bmi2)
        if bad:
            raise FormatError(f"{what}: bucket block's positions do not fit its base")
        if hasher is not None:
            hasher.update(out[a:e])
    if not (np.array_equal(boff, bend) and np.array_equal(zptr, zend)):
        raise FormatError(f"{what}: bucket block's bucket sizes do not match its base")


def _changes(p: Parsed, buckets: np.ndarray, contexts: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions (ascending) and zigzag codes of the changes, given every element's position bucket
    and value context: the rank of an element in its bucket is a prefix sum of membership, its
    changed flag a gather from the bucket's bitmap, the index of its code a prefix sum of changed
    flags within its context (the steps a GPU kernel takes, one thread block per block)."""
    changed = np.zeros(buckets.size, bool)
    for b in range(p.nb.size):
        member = buckets == b
        if np.count_nonzero(member) != p.nb[b]:
            raise FormatError(f"{what}: bucket block's bucket sizes do not match its base")
        rank = np.cumsum(member) - 1
        bit = p.wstart[b] + rank[member]
        changed[member] = (p.words[bit >> 6] >> (bit & 63).astype(np.uint64)) & np.uint64(1) != 0
    idx = np.flatnonzero(changed)
    codes = np.empty(idx.size, np.uint64)
    ctx = contexts[idx]
    for v in range(p.zstart.size - 1):
        sel = ctx == v
        if np.count_nonzero(sel) != p.zstart[v + 1] - p.zstart[v]:
            raise FormatError(f"{what}: bucket block's value contexts do not match its base")
        codes[sel] = p.zz[p.zstart[v] + np.cumsum(sel)[sel] - 1]
    return idx, codes


def _unzigzag(codes: np.ndarray, dtype: np.dtype) -> np.ndarray:
    c = codes.astype(dtype)
    return (c >> dtype.type(1)) ^ (np.zeros_like(c) - (c & dtype.type(1)))


def _exponents(p: Parsed, values: np.ndarray) -> np.ndarray:
    return (values.astype(np.int64) >> p.shift) & p.fmask


def decode_reference(dtype: str, block: bytes, old: np.ndarray, what: str = "block") -> np.ndarray:
    """The new elements from ``old`` and a block, in numpy, by the GPU-shaped steps of
    :func:`_changes`: the reference a CUDA decoder is tested against."""
    if len(block) == 0:
        return old.copy()
    p = Parsed(dtype, memoryview(block), old.size, old.dtype.itemsize, what)
    e = _exponents(p, old)
    idx, codes = _changes(p, p.lut_p[e], p.lut_v[e], what)
    out = old.copy()
    out[idx] = old[idx] + _unzigzag(codes, old.dtype)
    return out


def decode_backward(dtype: str, block: bytes, new: np.ndarray, what: str = "block") -> np.ndarray:
    """The old elements from the new ones and the block that coded new against old (a rollback
    without a keyframe): buckets and contexts come from the new values, except at the listed
    positions whose change moved them."""
    if len(block) == 0:
        return new.copy()
    p = Parsed(dtype, memoryview(block), new.size, new.dtype.itemsize, what)
    e = _exponents(p, new)
    buckets, contexts = p.lut_p[e], p.lut_v[e]
    buckets[p.exc] = p.exb >> 4
    contexts[p.exc] = p.exb & 15
    idx, codes = _changes(p, buckets, contexts, what)
    old = new.copy()
    old[idx] = new[idx] - _unzigzag(codes, new.dtype)
    e_old = _exponents(p, old)
    if np.any((p.lut_p[e_old] != buckets) | (p.lut_v[e_old] != contexts)):
        raise FormatError(f"{what}: bucket block does not code a change to these elements")
    return old
