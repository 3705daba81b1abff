"""Positions of codec ``ans`` as the nibbles of a bucket's bitmap (docs/FORMAT.md, "ans", N = 1).

A dense bucket's changed flags cost less as 4-bit symbols of its bitmap, rANS-coded with a table
that follows from the bucket's density alone (no table bytes: the flags of a bucket are close to
independent, and a counted table took 0.25% off the model's cost but cost 20 bytes), than as Rice
codes of the gaps between them: Rice's codes are whole bits, 1-2% over the binary entropy at the
densities of lr 1e-5's buckets. A bucket of density d has 1 / (4 d) nibbles a gap; a nibble
decodes in 0.85 ns in a wide section (1.7 in a 4-state one), a Rice gap in 2.6. So the encoder
takes buckets from 1 in 16 where the section is wide, from 1 in 8 where it is not (:data:`DENSITY`,
:data:`NARROW_DENSITY`; docs/DESIGN.md, "Positions as nibbles").

Every nibble-coded bucket of a block shares one rANS section, so its states' bytes are paid once:
bucket b's run is its bitmap's first ``run_symbols(n_b)`` nibbles (a multiple of 32, the bits past
``n_b`` zero), each run with its own table. The section is wide (32 states) under the same rule as
a value group's.
"""

from __future__ import annotations

import numpy as np

from weightsync.codec.entropy import NSYM, PROB_BITS, PROB_ONE
from weightsync.codec.jit import njit
from weightsync.codec.simd import ONE, ZERO, popcount

RUN = 32
"""Nibbles a bucket's run is a multiple of (128 bits of its bitmap): every run starts at state 0."""

DENSITY = 16
"""The encoder codes a bucket as nibbles when at least one in this many of its elements changed
(or stayed) and the block's nibble section is wide: below, nibbles are 4 or more a gap, slower
than Rice codes for about the same size (research/issue18-ctx-codec, "Session 39")."""

NARROW_DENSITY = 8
"""The same for a block whose nibbles would be too few for a wide section (4 states, 1.7 ns a
nibble against 2.4-2.6 for a Rice gap). From 1 in 16 they took lr 1e-6's steps 0.38% smaller
than Rice codes but pair 1's encode 3% and decode 1.5% slower; from 1 in 8, 0.27% smaller within
0-2% of Rice's time; from 1 in 4, 0.06% (research/issue18-ctx-codec, "Session 39")."""


_POP = np.array([bin(t).count("1") for t in range(NSYM)], np.int64)
_FIELD = np.uint64(0x0F0F0F0F0F0F0F0F)


@njit(nogil=True)
def run_symbols(n_b):
    """The nibbles of a bucket of ``n_b`` elements: its bits rounded up to a multiple of 128, by 4."""
    return RUN * ((n_b + 4 * RUN - 1) // (4 * RUN))


@njit(nogil=True)
def nibble_freq(d, n_b, freq):
    """The table of a run of ``n_b`` flags, ``d`` of them set (d <= n_b / 2), into ``freq``
    (int64[16]), as docs/FORMAT.md gives it: with q = min(4095, max(1, round(4096 d / n_b))), a
    nibble of j set bits weighs w_j = q^j (4096 - q)^(4 - j) (below 2^48); each nibble but 0 takes
    max(1, w >> 36), and 0, the likeliest (q <= 2048), the rest of 4096: at least 241."""
    q = min(PROB_ONE - 1, max(1, (d * PROB_ONE + n_b // 2) // n_b))
    rest = 0
    for t in range(1, NSYM):
        j = _POP[t]
        w = np.int64(1)
        for _ in range(j):
            w *= q
        for _ in range(4 - j):
            w *= PROB_ONE - q
        freq[t] = max(1, w >> (3 * PROB_BITS))
        rest += freq[t]
    freq[0] = PROB_ONE - rest


@njit(nogil=True)
def runs(coded, n, c):
    """The block's nibble section: where each run of the buckets flagged in ``coded`` ends (its
    symbols, cumulated in bucket order) and its table (:func:`nibble_freq`), from each bucket's
    elements ``n`` and changed elements ``c``."""
    ends = np.zeros(coded.sum(), np.int64)
    freqs = np.zeros((ends.size, NSYM), np.int64)
    total = 0
    r = 0
    for b in range(coded.size):
        if coded[b]:
            total += run_symbols(n[b])
            ends[r] = total
            nibble_freq(min(c[b], n[b] - c[b]), n[b], freqs[r])
            r += 1
    return ends, freqs


@njit(nogil=True)
def complement(words, w0, n_b):
    """Flip a bucket's flags in its run's words from ``words[w0]``: bits 0 to ``n_b`` - 1 (a run of more
    than half changed codes its unchanged flags, so that its likeliest nibble is 0, as its padding's)."""
    for i in range(run_symbols(n_b) // 16):
        rem = n_b - 64 * i
        keep = ~ZERO if rem >= 64 else ((ONE << np.uint64(rem)) - ONE if rem > 0 else ZERO)
        words[w0 + i] = ~words[w0 + i] & keep


@njit(nogil=True)
def nibbles_of(words, n_b, out, o0):
    """The run of a bitmap over ``n_b`` bits (its bits past ``n_b`` zero): nibble t, bits 4t to 4t + 3,
    to ``out[o0 + t]`` for t below :func:`run_symbols`; returns that count. ``words`` holds the
    run's words (2 per 32 nibbles)."""
    m = run_symbols(n_b)
    by = words[: m // 16].view(np.uint8)
    for i in range(m // 2):  # vectorised
        b = by[i]
        out[o0 + 2 * i] = b & np.uint8(15)
        out[o0 + 2 * i + 1] = b >> np.uint8(4)
    return m


@njit(nogil=True)
def pack_nibbles(nib, o0, m, words, w0, n_b):
    """The ``m`` nibbles at ``nib[o0:]`` (a multiple of 32, ``o0`` a multiple of 8) into the bitmap
    words from ``words[w0]``; returns the number of set bits, or -1 if one is at or past ``n_b``."""
    x = nib.view(np.uint64)
    f, s8, s16 = _FIELD, np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF)
    four, eight, sixteen, low = np.uint64(4), np.uint64(8), np.uint64(16), np.uint64(0xFFFFFFFF)
    b0 = o0 // 8
    c = 0
    for i in range(m // 16):  # 16 nibbles, one a byte, into 64 bits
        a = x[b0 + 2 * i] & f
        b = x[b0 + 2 * i + 1] & f
        a = (a | (a >> four)) & s8
        b = (b | (b >> four)) & s8
        a = (a | (a >> eight)) & s16
        b = (b | (b >> eight)) & s16
        a = (a | (a >> sixteen)) & low
        b = (b | (b >> sixteen)) & low
        w = a | (b << np.uint64(32))
        words[w0 + i] = w
        c += np.int64(popcount(w))
    last = n_b >> 6  # the bits past n_b: in the word holding bit n_b, and the run's words after it
    for i in range(last, m // 16):
        rem = n_b - 64 * i
        keep = (ONE << np.uint64(rem)) - ONE if rem > 0 else ZERO
        if words[w0 + i] & ~keep:
            return -1
    return c
