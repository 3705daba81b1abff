"""The entropy coders of codec ``ans`` (docs/FORMAT.md, "ans"), as numba kernels: LEB128 varints,
Exp-Golomb and Rice codes in LSB-first bit streams, and a static rANS coder over 16 symbols with
12-bit frequencies.

Rice sections and rANS sections are interleaved 4 ways (:data:`LANES`): code j goes to stream or
state j % 4, so that a decoder's consecutive codes do not wait on each other (about 2.5x faster
than one stream, docs/DESIGN.md). The lanes are written out by hand: numba helpers that take
arrays cost about 20 ns a call in these loops (reference counting), more than a code.

Every decoder checks what it reads and returns a status (0: success) rather than raising, and never
reads or writes outside its arrays.
"""

from __future__ import annotations

import numpy as np

from weightsync.codec.jit import njit
from weightsync.codec.simd import ALL, ONE, ZERO, leading_zeros, mulhi, store64, trailing_zeros

TWO, THREE, FOUR, FIVE, SIX, SEVEN, EIGHT = (np.uint64(i) for i in range(2, 9))
M8 = np.uint64(0xFF)
M16 = np.uint64(0xFFFF)
M32 = np.uint64(0xFFFFFFFF)
W16, W32 = np.uint64(16), np.uint64(32)

LANES = 4
"""Interleaved Rice streams per section, and rANS states per section."""

NSYM = 16
"""rANS symbols."""

PROB_BITS = 12
PROB_ONE = 1 << PROB_BITS
RANS_L = np.uint32(1 << 16)  # states live in [2^16, 2^32) and renormalise 16 bits at a time
RICE_ESCAPE = 32  # a quotient of 32 or more: 32 one bits, then the value in 32 bits
U32 = np.uint32


# --- bit streams ---------------------------------------------------------------------------------
@njit(nogil=True)
def put_varint(out, pos, v):
    while v >= 0x80:
        out[pos] = (v & 0x7F) | 0x80
        v >>= 7
        pos += 1
    out[pos] = v
    return pos + 1


@njit(nogil=True)
def get_varint(data, pos):
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


@njit(nogil=True, inline="always")
def peek(words, pos):
    """64 bits of a stream (as uint64 words, padded with a zero word) from bit ``pos``."""
    q = pos >> 6
    s = np.uint64(pos & 63)
    return (words[q] >> s) | ((words[q + 1] << ONE) << (np.uint64(63) - s))


@njit(nogil=True)
def padded_words(data, pos, length):
    sec = np.zeros((length + 7) // 8 + 4, np.uint64)  # a Rice lane reads up to 3 words past its last
    sec.view(np.uint8)[:length] = data[pos : pos + length]
    return sec


@njit(nogil=True)
def clean_end(sec, bp, length):
    """Whether a bit section of ``length`` bytes ends at bit ``bp`` (the last byte's rest zero)."""
    limit = 8 * length
    if (bp + 7) // 8 != length:
        return False
    return bp == limit or (peek(sec, bp) & ((ONE << np.uint64(limit - bp)) - ONE)) == ZERO


@njit(nogil=True, inline="always")
def _bits(out, p, acc, nacc, value, n):
    """Append the ``n`` (<= 56 - ``nacc``) low bits of ``value`` to a stream at byte ``p`` of ``out``
    whose last ``nacc`` < 8 bits wait in ``acc``; returns the new (p, acc, nacc)."""
    acc |= (value & ((ONE << n) - ONE)) << nacc
    nacc += n
    while nacc >= EIGHT:
        out[p] = np.uint8(acc & M8)
        p += 1
        acc >>= EIGHT
        nacc -= EIGHT
    return p, acc, nacc


@njit(nogil=True)
def eg_section(vals, h, tags, tag_bits, out):
    """Exp-Golomb codes of order ``h`` (<= 31) of ``vals`` (uint64, each below 2^32 << h) into ``out``
    (uint8), least significant bit first: the order-0 code of ``v >> h`` (n ones, a zero, then the n
    bits of ``(v >> h) + 1`` below its top bit), then the ``h`` low bits of v, then the ``tag_bits``
    (<= 8) low bits of ``tags[j]`` (none read for 0). Returns the bytes written; the last byte's
    unused bits are zero. ``out`` holds at least (2 * 32 + 1 + h + tag_bits) / 8 + 1 bytes a value.
    One call a section: a helper taking arrays costs a reference count per call."""
    hh = np.uint64(h)
    tb = np.uint64(tag_bits)
    p = 0
    acc = nacc = ZERO
    for j in range(vals.size):
        v = vals[j]
        x = (v >> hh) + ONE
        n = np.uint64(63) - leading_zeros(x)
        p, acc, nacc = _bits(out, p, acc, nacc, (ONE << n) - ONE, n + ONE)
        p, acc, nacc = _bits(out, p, acc, nacc, x, n)
        p, acc, nacc = _bits(out, p, acc, nacc, v, hh)
        if tag_bits:
            p, acc, nacc = _bits(out, p, acc, nacc, np.uint64(tags[j]), tb)
    if nacc:
        out[p] = np.uint8(acc & M8)
        p += 1
    return p


@njit(nogil=True, inline="always")
def get_eg(words, pos, limit, h):
    """The Exp-Golomb code of order ``h`` (<= 24: values below 2^57) at bit ``pos``: (value, new
    position), or (-1, pos) for a code that does not fit or runs past ``limit``. A code of up to 64
    bits is read from one peek: its prefix, then the n bits below the top of ``(v >> h) + 1`` and
    the h low bits of v as one field."""
    w = peek(words, pos)
    n = np.int64(trailing_zeros(~w))
    if n > 32:
        return -1, pos
    m = n + h  # the field's bits
    if n + 1 + m <= 64:
        f = np.int64((w >> np.uint64(n + 1)) & ((ONE << np.uint64(m)) - ONE))
    else:  # long: the field from a second peek
        f = np.int64(peek(words, pos + n + 1) & ((ONE << np.uint64(m)) - ONE))
    pos += n + 1 + m
    if pos > limit:
        return -1, pos
    hi = (np.int64(1) << n) | (f & ((np.int64(1) << n) - 1))  # (v >> h) + 1
    return ((hi - 1) << h) | (f >> n), pos


@njit(nogil=True)
def eg_order(vals, lo):
    """(order, bits): the order in ``lo..lo + 7`` (``lo`` <= 56) whose Exp-Golomb codes of ``vals``
    (uint64) take the fewest bits (the lowest of equals), and those bits: one pass, the eight costs
    summed in registers."""
    c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = np.int64(0)
    h = np.uint64(lo)
    for j in range(vals.size):
        v = vals[j] >> h
        c0 += np.int64(leading_zeros(v + ONE))
        c1 += np.int64(leading_zeros((v >> ONE) + ONE))
        c2 += np.int64(leading_zeros((v >> TWO) + ONE))
        c3 += np.int64(leading_zeros((v >> THREE) + ONE))
        c4 += np.int64(leading_zeros((v >> FOUR) + ONE))
        c5 += np.int64(leading_zeros((v >> FIVE) + ONE))
        c6 += np.int64(leading_zeros((v >> SIX) + ONE))
        c7 += np.int64(leading_zeros((v >> SEVEN) + ONE))
    # order lo + q costs size * (127 + lo + q) - 2 c_q bits: the fewest is the largest 2 c_q - size * q
    best, most = 0, np.int64(-1) << 62
    for q, c in enumerate((c0, c1, c2, c3, c4, c5, c6, c7)):
        score = 2 * c - vals.size * q
        if score > most:
            best, most = q, score
    return lo + best, vals.size * (127 + lo) - most


# --- Rice codes (positions) ------------------------------------------------------------------------
@njit(nogil=True)
def rice_parameter(gaps):
    """Rice parameter for the gaps: the best of three around log2 of their mean (:func:`rice_low`,
    :func:`rice_best`; the three costs are summed in one pass)."""
    ng = gaps.size
    if ng == 0:
        return 0
    total = np.uint64(0)
    for j in range(ng):
        total += gaps[j]
    lo = rice_low(total, ng)
    k1, k2, k3 = np.uint64(lo), np.uint64(lo + 1), np.uint64(lo + 2)
    cap = np.uint64(RICE_ESCAPE)
    c1 = c2 = c3 = np.uint64(0)
    for j in range(ng):  # vectorised: sums of quotients
        g = gaps[j]
        c1 += min(g >> k1, cap)
        c2 += min(g >> k2, cap)
        c3 += min(g >> k3, cap)
    return rice_best(lo, c1, c2, c3, ng)


@njit(nogil=True, inline="always")
def rice_low(total, ng):
    """The lowest of the three Rice parameters tried for ``ng`` > 0 gaps summing to ``total``: one
    below log2 of 0.69 times their mean, at least 0."""
    mean = total / ng
    k0 = 0
    while (1 << (k0 + 1)) <= mean * 0.69:
        k0 += 1
    return max(0, k0 - 1)


@njit(nogil=True, inline="always")
def rice_best(lo, c1, c2, c3, ng):
    """Of the Rice parameters lo, lo + 1 and lo + 2 for ``ng`` gaps, the one whose codes are shortest,
    from each one's sum of quotients capped at RICE_ESCAPE (ties: the smaller)."""
    n = np.uint64(ng)
    c1 += n * (np.uint64(lo) + ONE)
    c2 += n * (np.uint64(lo) + TWO)
    c3 += n * (np.uint64(lo) + THREE)
    best, cost = lo, c1
    if c2 < cost:
        best, cost = lo + 1, c2
    if c3 < cost:
        best = lo + 2
    return best


@njit(nogil=True, inline="always")
def _rice_put(buf, p, acc, nacc, g, kk, low):
    """Append the Rice code of ``g`` (parameter ``kk``, ``low`` = 2^kk - 1) to a stream at byte ``p``
    of ``buf`` (8 bytes of slack) whose last ``nacc`` < 8 bits wait in ``acc``; returns the new
    (p, acc, nacc). A code is q = g >> k ones, a zero and the k low bits (at most 62 bits); q >= 32
    is 32 ones and g in 32 bits. Each code is or-ed in and the 8 bytes stored at once (unaligned),
    without a branch but for codes over 56 bits."""
    w32 = np.uint64(32)
    m32 = np.uint64(0xFFFFFFFF)
    qq = g >> kk
    if qq < w32:
        code = ((ONE << qq) - ONE) | ((g & low) << (qq + ONE))
        n = qq + ONE + kk
    else:
        code = m32 | ((g & m32) << w32)
        n = np.uint64(64)
    if n > np.uint64(56):  # rare: the low 32 bits first
        acc |= (code & m32) << nacc
        nacc += w32
        store64(buf, p, acc)
        nb = nacc >> np.uint64(3)
        p += np.int64(nb)
        acc >>= nb << np.uint64(3)
        nacc &= np.uint64(7)
        code >>= w32
        n -= w32
    acc |= code << nacc
    nacc += n
    store64(buf, p, acc)
    nb = nacc >> np.uint64(3)
    p += np.int64(nb)
    acc = (acc >> (nb << np.uint64(2))) >> (nb << np.uint64(2))  # nb may be 8: two shifts
    nacc &= np.uint64(7)
    return p, acc, nacc


PAIRED_K = 27
"""The highest Rice parameter whose codes :func:`_rice_put_two` can join: two codes of quotient 0
take 2 * (k + 1) bits, at most 56."""


@njit(nogil=True, inline="always")
def _rice_put_two(buf, p, acc, nacc, ga, gb, kk, low, k1, room):
    """:func:`_rice_put` of ``ga`` then ``gb`` (``k1`` = kk + 1, ``room`` = 54 - 2 kk: what their
    quotients may sum to), as one code of at most 56 bits where neither escapes and both fit: one
    store for two codes. The rest take :func:`_rice_put` each (rare where the parameter fits the
    gaps)."""
    qa = ga >> kk
    qb = gb >> kk
    if (qa | qb) < np.uint64(RICE_ESCAPE) and qa + qb <= room:
        na = qa + k1
        code = ((ONE << qa) - ONE) | ((ga & low) << (qa + ONE))
        code |= (((ONE << qb) - ONE) | ((gb & low) << (qb + ONE))) << na
        acc |= code << nacc
        nacc += na + qb + k1
        store64(buf, p, acc)
        nb = nacc >> np.uint64(3)  # nacc < 64: at most 7 bytes
        p += np.int64(nb)
        acc >>= nb << np.uint64(3)
        nacc &= np.uint64(7)
        return p, acc, nacc
    p, acc, nacc = _rice_put(buf, p, acc, nacc, ga, kk, low)
    return _rice_put(buf, p, acc, nacc, gb, kk, low)


@njit(nogil=True)
def rice_section(gaps, k, out):
    """A bucket's Rice section into ``out`` (uint8): LEB128 lengths of its first LANES - 1 streams,
    then the LANES streams (gap j in stream j % LANES); returns its length. The lanes are coded in
    one loop, each into its own part of a buffer: their bit appends do not wait on each other. Up to
    :data:`PAIRED_K` each lane takes its next two codes at once (:func:`_rice_put_two`): the coder is
    bound by its instructions, and a store, its byte count and shifts shared by two codes took the
    small model's lr 1e-5 pair 0 from 8.1 to 6.6 ms of Rice codes (1.7 to 1.4 ns a code on the 2.03
    GiB pair's)."""
    ng = gaps.size
    cap = 8 * (ng // LANES + 1) + 16  # a code is at most 64 bits
    buf = np.empty(LANES * cap, np.uint8)
    kk = np.uint64(k)
    low = (ONE << kk) - ONE
    p0, p1, p2, p3 = 0, cap, 2 * cap, 3 * cap
    a0 = a1 = a2 = a3 = ZERO
    n0 = n1 = n2 = n3 = ZERO
    paired = 0
    if k <= PAIRED_K:  # each lane's next two codes at once
        k1, room = kk + ONE, np.uint64(54 - 2 * k)
        paired = ng - ng % (2 * LANES)
        for j in range(0, paired, 2 * LANES):
            p0, a0, n0 = _rice_put_two(buf, p0, a0, n0, gaps[j], gaps[j + 4], kk, low, k1, room)
            p1, a1, n1 = _rice_put_two(buf, p1, a1, n1, gaps[j + 1], gaps[j + 5], kk, low, k1, room)
            p2, a2, n2 = _rice_put_two(buf, p2, a2, n2, gaps[j + 2], gaps[j + 6], kk, low, k1, room)
            p3, a3, n3 = _rice_put_two(buf, p3, a3, n3, gaps[j + 3], gaps[j + 7], kk, low, k1, room)
    full = ng - ng % LANES
    for j in range(paired, full, LANES):
        p0, a0, n0 = _rice_put(buf, p0, a0, n0, gaps[j], kk, low)
        p1, a1, n1 = _rice_put(buf, p1, a1, n1, gaps[j + 1], kk, low)
        p2, a2, n2 = _rice_put(buf, p2, a2, n2, gaps[j + 2], kk, low)
        p3, a3, n3 = _rice_put(buf, p3, a3, n3, gaps[j + 3], kk, low)
    if ng > full:
        p0, a0, n0 = _rice_put(buf, p0, a0, n0, gaps[full], kk, low)
    if ng > full + 1:
        p1, a1, n1 = _rice_put(buf, p1, a1, n1, gaps[full + 1], kk, low)
    if ng > full + 2:
        p2, a2, n2 = _rice_put(buf, p2, a2, n2, gaps[full + 2], kk, low)
    lens = (
        p0 + np.int64(n0 != ZERO),
        p1 - cap + np.int64(n1 != ZERO),
        p2 - 2 * cap + np.int64(n2 != ZERO),
        p3 - 3 * cap + np.int64(n3 != ZERO),
    )
    hp = 0
    for q in range(LANES - 1):
        hp = put_varint(out, hp, lens[q])
    for q in range(LANES):
        out[hp : hp + lens[q]] = buf[q * cap : q * cap + lens[q]]
        hp += lens[q]
    return hp


@njit(nogil=True, inline="always")
def _rice_get(s, b, kk, kmask):
    """The Rice code at bit ``b`` of stream ``s`` (uint64 words, padded): (gap, the next code's bit)."""
    q = np.uint64(b) >> np.uint64(6)
    sh = np.uint64(b & 63)
    w = (s[q] >> sh) | ((s[q + ONE] << ONE) << (np.uint64(63) - sh))
    u = trailing_zeros(~w)
    if u < np.uint64(RICE_ESCAPE):
        return np.int64((u << kk) | ((w >> (u + ONE)) & kmask)), b + np.int64(u + ONE + kk)
    q = np.uint64(b + 32) >> np.uint64(6)
    sh = np.uint64((b + 32) & 63)
    return np.int64(((s[q] >> sh) | ((s[q + ONE] << ONE) << (np.uint64(63) - sh))) & M32), b + 64


@njit(nogil=True, inline="always")
def _rice_get_two(s, b, kk, kmask):
    """The Rice codes at bit ``b`` of stream ``s`` and after it: (gap, gap, the next code's bit). The
    second is read from the first's 64 bits where it lies whole in them and does not escape (most
    codes where the parameter fits the gaps), else as :func:`_rice_get` reads it."""
    q = np.uint64(b) >> np.uint64(6)
    sh = np.uint64(b & 63)
    w = (s[q] >> sh) | ((s[q + ONE] << ONE) << (np.uint64(63) - sh))
    u = trailing_zeros(~w)
    if u < np.uint64(RICE_ESCAPE):
        ga = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
        na = u + ONE + kk  # at most 63
        w >>= na
        v = trailing_zeros(~w)  # at most 64 - na: the shifted-in zeros end the run
        nb = v + ONE + kk
        if v < np.uint64(RICE_ESCAPE) and na + nb <= np.uint64(64):
            return ga, np.int64((v << kk) | ((w >> (v + ONE)) & kmask)), b + np.int64(na + nb)
        b += np.int64(na)
    else:
        q = np.uint64(b + 32) >> np.uint64(6)
        sh = np.uint64((b + 32) & 63)
        ga = np.int64(((s[q] >> sh) | ((s[q + ONE] << ONE) << (np.uint64(63) - sh))) & M32)
        b += 64
    gb, b = _rice_get(s, b, kk, kmask)
    return ga, gb, b


@njit(nogil=True)
def rice_decode(data, pos, bl, count, k, n_b, inv, words, w0):
    """A bucket's Rice section into its bitmap (``words`` from word ``w0``); returns 0 or 12. Each
    lane's next two codes are read from one load where they fit (:func:`_rice_get_two`). A lane's
    position may run past its end by two codes before the check after them: its words are padded
    (:func:`padded_words`). A parameter over 30 is refused here too (the parser refuses it first):
    the reads' shifts assume it."""
    if not 0 <= k <= 30:
        return 12
    end = pos + bl
    lens = np.zeros(LANES, np.int64)
    for q in range(LANES - 1):
        lens[q], pos = get_varint(data, pos)
        if lens[q] < 0:
            return 12
    lens[LANES - 1] = end - pos - lens[: LANES - 1].sum()
    if lens[LANES - 1] < 0:
        return 12
    s0 = padded_words(data, pos, lens[0])
    s1 = padded_words(data, pos + lens[0], lens[1])
    s2 = padded_words(data, pos + lens[0] + lens[1], lens[2])
    s3 = padded_words(data, pos + lens[0] + lens[1] + lens[2], lens[3])
    if inv:
        for q in range(n_b >> 6):
            words[w0 + q] = ALL
        if n_b & 63:
            words[w0 + (n_b >> 6)] = (ONE << np.uint64(n_b & 63)) - ONE
    r = np.int64(-1)
    b0 = np.int64(0)
    b1 = np.int64(0)
    b2 = np.int64(0)
    b3 = np.int64(0)
    kk = np.uint64(k)
    kmask = (ONE << kk) - ONE
    lim0, lim1, lim2, lim3 = 8 * lens[0], 8 * lens[1], 8 * lens[2], 8 * lens[3]
    paired = count - count % (2 * LANES)
    for _ in range(0, paired, 2 * LANES):
        g0, g4, b0 = _rice_get_two(s0, b0, kk, kmask)
        g1, g5, b1 = _rice_get_two(s1, b1, kk, kmask)
        g2, g6, b2 = _rice_get_two(s2, b2, kk, kmask)
        g3, g7, b3 = _rice_get_two(s3, b3, kk, kmask)
        r0 = r + g0 + 1
        r1 = r0 + g1 + 1
        r2 = r1 + g2 + 1
        r3 = r2 + g3 + 1
        r4 = r3 + g4 + 1
        r5 = r4 + g5 + 1
        r6 = r5 + g6 + 1
        r = r6 + g7 + 1
        if r >= n_b or b0 > lim0 or b1 > lim1 or b2 > lim2 or b3 > lim3:
            return 12
        words[np.uint64(w0 + (r0 >> 6))] ^= ONE << np.uint64(r0 & 63)
        words[np.uint64(w0 + (r1 >> 6))] ^= ONE << np.uint64(r1 & 63)
        words[np.uint64(w0 + (r2 >> 6))] ^= ONE << np.uint64(r2 & 63)
        words[np.uint64(w0 + (r3 >> 6))] ^= ONE << np.uint64(r3 & 63)
        words[np.uint64(w0 + (r4 >> 6))] ^= ONE << np.uint64(r4 & 63)
        words[np.uint64(w0 + (r5 >> 6))] ^= ONE << np.uint64(r5 & 63)
        words[np.uint64(w0 + (r6 >> 6))] ^= ONE << np.uint64(r6 & 63)
        words[np.uint64(w0 + (r >> 6))] ^= ONE << np.uint64(r & 63)
    for j in range(paired, count):  # the last 0-7, lane by lane
        lane = j % LANES
        if lane == 0:
            g, b0 = _rice_get(s0, b0, kk, kmask)
        elif lane == 1:
            g, b1 = _rice_get(s1, b1, kk, kmask)
        elif lane == 2:
            g, b2 = _rice_get(s2, b2, kk, kmask)
        else:
            g, b3 = _rice_get(s3, b3, kk, kmask)
        r += g + 1
        if r >= n_b:
            return 12
        words[w0 + (r >> 6)] ^= ONE << np.uint64(r & 63)
    if b0 > lim0 or b1 > lim1 or b2 > lim2 or b3 > lim3:
        return 12
    if not (clean_end(s0, b0, lens[0]) and clean_end(s1, b1, lens[1])):
        return 12
    if not (clean_end(s2, b2, lens[2]) and clean_end(s3, b3, lens[3])):
        return 12
    return 0


# --- rANS (values) ------------------------------------------------------------------------------------
@njit(nogil=True)
def normalise(counts, freq):
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
def _rans_table(freq, values):
    """The decoder's table, per slot: its symbol's frequency, the slot less the symbol's start << 16,
    and ``values[symbol]`` << 32 (the decoder writes it without a second lookup)."""
    tab = np.empty(PROB_ONE, np.uint64)
    start = 0
    for s in range(NSYM):
        f = np.int64(freq[s])
        head = np.uint64(f) | (np.uint64(values[s]) << np.uint64(32))
        seg = tab[start : start + f]
        for j in range(f):  # vectorised
            seg[j] = head | (np.uint64(j) << np.uint64(16))
        start += f
    return tab


@njit(nogil=True)
def rans_steps(freq):
    """The encoder's table: per symbol s, at ``4 s`` to ``4 s + 3``, the state bound f << 20, ceil(2^64 / f),
    its start and PROB_ONE - f. A step is then x + start + (x // f) * (PROB_ONE - f), which is
    (x // f) << PROB_BITS + x % f + start, with x // f the high half of x * ceil(2^64 / f): exact for
    every state below 2^32, since f <= 2^12 leaves an error below 2^-32 < 1 / f. f = 1 takes 2^64 - 1,
    which gives x - 1: its start carries the missing PROB_ONE - 1. (The division is one multiply on
    the states' chain, where Granlund and Montgomery's 32-bit reciprocal took a multiply, an add and
    two shifts: coding took 0.95 against 1.34 ns a symbol on the Intel Xeon of the benchmarks. The
    four side by side: one base register, where four tables spilled the states to the stack.)"""
    tab = np.zeros(4 * NSYM, np.uint64)
    start = 0
    for i in range(NSYM):
        f = np.int64(freq[i])
        tab[4 * i] = np.uint64(f) << np.uint64(32 - PROB_BITS)
        tab[4 * i + 1] = ALL if f == 1 else (ALL // np.uint64(f) + ONE if f > 1 else ZERO)
        tab[4 * i + 2] = np.uint64(start + (PROB_ONE - 1 if f == 1 else 0))
        tab[4 * i + 3] = np.uint64(PROB_ONE - f)
        start += f
    return tab


@njit(nogil=True)
def rans_encode(syms, c, freq, out):
    """The rANS section of ``syms[:c]`` into ``out`` (uint8); returns its length. LANES states:
    symbol j is coded by state j % LANES; the final states first, then one word stream."""
    return rans_encode_carrying(syms, c, freq, out, np.zeros(LANES, np.uint32))


@njit(nogil=True)
def rans_encode_carrying(syms, c, freq, out, carry):
    """:func:`rans_encode` with state q starting at 2^16 + ``carry[q]`` (below 2^16) instead of 2^16:
    a decoder ends there, so the section carries those 16 bits a state for less than a bit each
    (codec ``ans``'s carried exception bytes, docs/FORMAT.md). (Lanes are written out: helpers that
    take arrays cost a reference count per call in numba.)"""
    tab = rans_steps(freq)
    # at most one word per symbol, written backwards; each step stores its state's low word at t - 1
    # and moves t only when the state must shed it, without a branch (when a state sheds a word is not
    # predictable: the branch cost 2.3-2.4 ns a symbol against 1.5 on an Intel Xeon, at the trajectory's
    # probabilities, before the division above).
    # Indices are unsigned: numba tests every signed one for wraparound.
    tmp = np.empty(c + 4, np.uint16)
    t = np.uint64(tmp.size)
    x0 = np.uint64(RANS_L) + np.uint64(carry[0])  # states below 2^32, in 64-bit registers
    x1 = np.uint64(RANS_L) + np.uint64(carry[1])
    x2 = np.uint64(RANS_L) + np.uint64(carry[2])
    x3 = np.uint64(RANS_L) + np.uint64(carry[3])
    full = c - c % LANES
    for j in range(c - 1, full - 1, -1):  # the last, partial group (lanes 0..c % LANES - 1)
        s = np.uint64(syms[np.uint64(j)]) << TWO
        q = j - full
        x = x2 if q == 2 else x1 if q == 1 else x0
        fl = x >= tab[s]
        tmp[t - ONE] = np.uint16(x & M16)
        t -= np.uint64(fl)
        x = (x >> W16) if fl else x
        x += tab[s + TWO] + mulhi(x, tab[s + ONE]) * tab[s + THREE]
        if q == 2:
            x2 = x
        elif q == 1:
            x1 = x
        else:
            x0 = x
    j = np.uint64(full)
    while j > ZERO:
        j -= FOUR
        s = np.uint64(syms[j + THREE]) << TWO
        fl = x3 >= tab[s]
        tmp[t - ONE] = np.uint16(x3 & M16)
        t -= np.uint64(fl)
        x3 = (x3 >> W16) if fl else x3
        x3 += tab[s + TWO] + mulhi(x3, tab[s + ONE]) * tab[s + THREE]
        s = np.uint64(syms[j + TWO]) << TWO
        fl = x2 >= tab[s]
        tmp[t - ONE] = np.uint16(x2 & M16)
        t -= np.uint64(fl)
        x2 = (x2 >> W16) if fl else x2
        x2 += tab[s + TWO] + mulhi(x2, tab[s + ONE]) * tab[s + THREE]
        s = np.uint64(syms[j + ONE]) << TWO
        fl = x1 >= tab[s]
        tmp[t - ONE] = np.uint16(x1 & M16)
        t -= np.uint64(fl)
        x1 = (x1 >> W16) if fl else x1
        x1 += tab[s + TWO] + mulhi(x1, tab[s + ONE]) * tab[s + THREE]
        s = np.uint64(syms[j]) << TWO
        fl = x0 >= tab[s]
        tmp[t - ONE] = np.uint16(x0 & M16)
        t -= np.uint64(fl)
        x0 = (x0 >> W16) if fl else x0
        x0 += tab[s + TWO] + mulhi(x0, tab[s + ONE]) * tab[s + THREE]
    xs = (x0, x1, x2, x3)
    for q in range(LANES):
        for b in range(4):
            out[4 * q + b] = np.uint8((xs[q] >> np.uint64(8 * b)) & np.uint64(0xFF))
    m = tmp.size - np.int64(t)
    out[4 * LANES : 4 * LANES + 2 * m] = tmp[np.int64(t) :].view(np.uint8)
    return 4 * LANES + 2 * m


@njit(nogil=True)
def read_states(data, pos, xs):
    """A rANS section's ``xs.size`` states, little-endian u32 from ``data[pos]``, into ``xs``; False if
    one is under 2^16."""
    for q in range(xs.size):
        p = pos + 4 * q
        xs[q] = U32(data[p]) | U32(data[p + 1]) << U32(8) | U32(data[p + 2]) << U32(16) | U32(data[p + 3]) << U32(24)
        if xs[q] < RANS_L:
            return False
    return True


@njit(nogil=True)
def rans_decode(data, pos, length, freq, values, out, o0, count):
    """Decode ``count`` symbols of the rANS section ``data[pos:pos+length]`` (frequencies ``freq``) and
    write ``values[symbol]`` for each into ``out[o0:]``; returns 0, or 13 for a section that does not
    decode to exactly ``count`` symbols (every state back at 2^16, every word read)."""
    carry = np.zeros(LANES, np.uint32)
    bad = rans_decode_carried(data, pos, length, freq, values, out, o0, count, carry)
    return bad if bad else settled(carry)


@njit(nogil=True, inline="always")
def settled(carry):
    """13 unless every state of a section ended at 2^16 (carried nothing), else 0."""
    for q in range(carry.size):
        if carry[q]:
            return 13
    return 0


@njit(nogil=True)
def rans_decode_carried(data, pos, length, freq, values, out, o0, count, carry):
    """:func:`rans_decode` of a section whose states may carry 16 bits each
    (:func:`rans_encode_carrying`): state q's end less 2^16 goes to ``carry[q]``; 13 also for an end
    at 2^17 or over. A step reads
    the next 16-bit word whether it renormalises or not, and takes it only if it does: the words
    are followed by ``count`` zeros, so that a section that runs out reads zeros without a bound
    checked per step (a state takes at most one word a symbol), and the end's checks refuse it."""
    if length < 4 * LANES or (length - 4 * LANES) % 2:
        return 13
    tab = _rans_table(freq, values)
    xs = np.zeros(LANES, np.uint32)
    if not read_states(data, pos, xs):
        return 13
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    nw = (length - 4 * LANES) // 2
    w16 = np.zeros(nw + count + 1, np.uint16)
    w16.view(np.uint8)[: 2 * nw] = data[pos + 4 * LANES : pos + length]
    wp = ZERO
    nwu = np.uint64(nw)
    full = count - count % LANES
    mask = U32(PROB_ONE - 1)
    for j in range(0, full, LANES):
        dj = np.uint64(o0 + j)
        en = tab[x0 & mask]
        x0 = U32(en & M16) * (x0 >> U32(PROB_BITS)) + U32((en >> W16) & M16)
        t = U32(x0 < RANS_L)
        x0 = (x0 << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t))
        wp += np.uint64(t)
        out[dj] = en >> W32
        en = tab[x1 & mask]
        x1 = U32(en & M16) * (x1 >> U32(PROB_BITS)) + U32((en >> W16) & M16)
        t = U32(x1 < RANS_L)
        x1 = (x1 << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t))
        wp += np.uint64(t)
        out[dj + np.uint64(1)] = en >> W32
        en = tab[x2 & mask]
        x2 = U32(en & M16) * (x2 >> U32(PROB_BITS)) + U32((en >> W16) & M16)
        t = U32(x2 < RANS_L)
        x2 = (x2 << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t))
        wp += np.uint64(t)
        out[dj + np.uint64(2)] = en >> W32
        en = tab[x3 & mask]
        x3 = U32(en & M16) * (x3 >> U32(PROB_BITS)) + U32((en >> W16) & M16)
        t = U32(x3 < RANS_L)
        x3 = (x3 << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t))
        wp += np.uint64(t)
        out[dj + np.uint64(3)] = en >> W32
    for j in range(full, count):
        q = j - full
        x = x2 if q == 2 else x1 if q == 1 else x0
        en = tab[x & mask]
        x = U32(en & M16) * (x >> U32(PROB_BITS)) + U32((en >> W16) & M16)
        t = U32(x < RANS_L)
        x = (x << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t))
        wp += np.uint64(t)
        if q == 2:
            x2 = x
        elif q == 1:
            x1 = x
        else:
            x0 = x
        out[o0 + j] = en >> W32
    top = U32(2 * RANS_L)
    if x0 >= top or x1 >= top or x2 >= top or x3 >= top or wp != nwu:
        return 13
    carry[0], carry[1], carry[2], carry[3] = x0 - RANS_L, x1 - RANS_L, x2 - RANS_L, x3 - RANS_L
    return 0
