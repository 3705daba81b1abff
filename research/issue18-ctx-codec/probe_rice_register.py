"""entropy.rice_decode with each bitmap word's bits gathered in a register and stored whole (no
read-modify-write of the word per gap): imported by probe_decode_split.py."""
import numpy as np
from numba import njit
from weightsync.codec.entropy import LANES, get_varint, padded_words, clean_end, _rice_get_two, _rice_get
from weightsync.codec.simd import ONE, ZERO, ALL
M = np.uint64

@njit(nogil=True, inline="always")
def _put(words, w0, r, cur, acc, base_full, n_b, lastw, lastmask):
    w = r >> 6
    same = w == cur
    bit = ONE << M(r & 63)
    acc = (acc if same else ZERO) | bit
    base = lastmask if w == lastw else base_full
    words[M(w0 + w)] = base ^ acc
    return w, acc

@njit(nogil=True)
def rice_decode2(data, pos, bl, count, k, n_b, inv, words, w0):
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
    lastw = n_b >> 6
    if inv:
        for q in range(n_b >> 6):
            words[w0 + q] = ALL
        if n_b & 63:
            words[w0 + (n_b >> 6)] = (ONE << np.uint64(n_b & 63)) - ONE
        base_full = ALL
        lastmask = (ONE << np.uint64(n_b & 63)) - ONE
    else:
        base_full = ZERO
        lastmask = ZERO
    r = np.int64(-1)
    cur = np.int64(-1)
    acc = ZERO
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
        cur, acc = _put(words, w0, r0, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r1, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r2, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r3, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r4, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r5, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r6, cur, acc, base_full, n_b, lastw, lastmask)
        cur, acc = _put(words, w0, r, cur, acc, base_full, n_b, lastw, lastmask)
    for j in range(paired, count):
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
        cur, acc = _put(words, w0, r, cur, acc, base_full, n_b, lastw, lastmask)
    if b0 > lim0 or b1 > lim1 or b2 > lim2 or b3 > lim3:
        return 12
    if not (clean_end(s0, b0, lens[0]) and clean_end(s1, b1, lens[1])):
        return 12
    if not (clean_end(s2, b2, lens[2]) and clean_end(s3, b3, lens[3])):
        return 12
    return 0
