"""Codec ``ans`` (id 5): a delta coded by runs within contexts of the old value's exponent, with both
passes over the elements built from vector instructions (docs/FORMAT.md has the block layout,
docs/DESIGN.md the design and its measurements).

The elements of a block are split into up to 4 position buckets by thresholds on the old value's
exponent field (chosen per block from a sample: the split that minimises the entropy of the change
mask). Within a bucket, the ranks of the changed elements are Rice-coded gaps, or, in a bucket of 1
in 16 or more changed (1 in 8 where the block's nibbles are too few for a wide section), the
nibbles of its bitmap are rANS-coded with a table its density gives (:mod:`weightsync.codec.nibbles`;
one section for the block's such buckets). The changes' zigzag
differences are rANS-coded per value group, up to 4 other ranges of the old exponent chosen by the
same kind of dynamic program on the sampled values (a group of 2^15 changes or more with 32
interleaved states, coded 16 at a time by vector steps: :mod:`weightsync.codec.lanes`; else 4).

Decoding a block is two steps. First the streams (:mod:`weightsync.codec.entropy`): each bucket's
Rice codes into a bitmap over its ranks, each group's symbols into an array of differences in
position order. Then one pass over the elements, 64 at a time: vector compares of the old values
with the thresholds give each bucket's members, ``pdep`` puts the bucket's next bits there (the
changed elements), more compares split the changes into the value groups, and one masked
expand-load per group adds the group's next differences: the unchanged majority costs the
compares and the copy. The pass is generated per bucket and group count, with its state in
registers. A GPU does the same with prefix sums (ranks, indices of differences) and gathers:
:func:`decode_reference` is that, in numpy. Encoding mirrors it: per 64 elements a vector compare
of old and new, ``pext`` of each bucket's changed flags into its bitmap, a compress-store of each
group's zigzag codes. Both passes come in a native kind and a portable one, which takes one step per
set bit of the changes' masks where ``pdep`` or the vector expand is slow, and a third between them
for a CPU whose ``pdep`` is fast but which lacks the vector expand (:data:`weightsync.codec.simd.KINDS`).

Deltas run backward too (:func:`decode_backward`): a change that moves its element to another
bucket or group is listed, with its old bucket and group unless its new value tells them (the
top bit of its mantissa says from which side it crossed the exponent boundary), so the old block
can be rebuilt from the new one (rollbacks fetch deltas, not keyframes). A pull forward never
reads the list, so it is kept apart (:data:`APART`, :func:`encode_block_apart`): the block's
reverse part, in the payload's reverse payload, which only a rollback fetches. The rANS sections'
states carry the block's Rice sections' first bytes instead, 2 a state (:data:`CARRIED`): a state
starts at 2^16 plus them, which a decoder finds where it ends. (Blocks written before the flag
hold their list, whose first bytes the states carry.)
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np

from weightsync.codec import hashing
from weightsync.codec.abc import Codec
from weightsync.codec.entropy import (
    LANES,
    NSYM,
    PROB_ONE,
    RICE_ESCAPE,
    U32,
    clean_end,
    eg_order,
    eg_section,
    get_eg,
    get_varint,
    normalise,
    padded_words,
    peek,
    put_varint,
    rans_decode_carried,
    rans_encode_carrying,
    rice_best,
    rice_decode,
    rice_low,
    rice_parameter,
    rice_section,
)
from weightsync.codec.jit import njit
from weightsync.codec.kernels import feed
from weightsync.codec.lanes import (
    WIDE_LANES,
    WIDE_MIN,
    rans_decode_runs,
    rans_decode_wide_carried,
    rans_encode_runs,
    rans_encode_wide_carrying,
)
from weightsync.codec.nibbles import DENSITY as NIBBLE_DENSITY
from weightsync.codec.nibbles import NARROW_DENSITY as NIBBLE_NARROW
from weightsync.codec.nibbles import complement, nibbles_of, pack_nibbles, run_symbols
from weightsync.codec.nibbles import runs as nibble_runs
from weightsync.codec.registry import register
from weightsync.codec.simd import (
    ALL,
    BMI2,
    COMPRESS_RANKS,
    COMPRESS_ZIGZAG,
    COMPRESS_ZIGZAG_SOFT,
    DENSE,
    EXPAND_ADD,
    EXPAND_ADD_SOFT,
    HAS_BMI2,
    KIND_NAMES,
    NATIVE,
    ONE,
    PORTABLE,
    SPARE,
    ZERO,
    below_mask64,
    compress_escapes,
    compress_ranks,
    deposit_soft,
    field_ne_mask64,
    kind_of,
    ne_mask64,
    pdep_bmi2,
    pext_bmi2,
    pext_soft,
    popcount,
    prefetch64,
    trailing_zeros,
    uses_bmi2,
    uses_vectors,
    zero_mask64,
)
from weightsync.codec.streams import SLICE_BYTES, copy, read_only_bytes
from weightsync.errors import FormatError
from weightsync.format.dtypes import EXPONENT_FIELD, ITEMSIZE, UINT_VIEW

MAX_K = 4
"""Position buckets per block (the format's limit; each costs the decoder a compare and a ``pdep`` per 64 elements)."""

MAX_G = 4
"""Value groups per block (each costs the decoder a compare and an expand-load per 64 elements)."""

BUCKETS = 4
"""Position buckets the encoder uses at most."""

GROUP_DENSITY = 0.05
"""Blocks whose changed fraction is below this use at most 2 value groups (a faster pass)."""

CHANGES_PER_BUCKET = 256
"""A bucket or a group is worth its header and model when it holds about this many changes."""

TABLE_BITS = 160.0
"""What the plan charges a value group for its frequency table (about 20 bytes)."""

MAX_BLOCK = 1 << 31
"""Elements a block may hold (the payload's limit; the scan keeps ranks in 32 bits)."""

WIDTHS = (1, 2, 4)
"""Element sizes in bytes a block may hold (an 8-byte difference's escape is past what the parser takes)."""

CHECK = 4096
"""Elements between the pass's checks that no bucket ran past its bitmap and no value group past its
differences (each has this much spare)."""

SLICE = max(64, (SLICE_BYTES // 2) // 64 * 64)
"""Elements per slice of the pass when a large block is hashed as it is decoded (a slice stays in cache)."""

HASH_WHOLE = 1 << 20
"""Blocks of up to this many elements are decoded in one call, then hashed (from cache)."""

SAMPLE_HALVED = 1 << 14
"""Blocks of at least this many 64-element words (2^20 elements) are sampled for their plan in every
32nd window of 1024 elements, not every 16th: still 32 windows or more for the changes (8 for the
exponents), and the sample's reads were half of the plan's time. On the 2.03 GiB pair (4 MiB
tensors) the plans took 63 -> 35 ms (of an encode of about 600), and its payloads grew by 229
bytes of 27.4 MB (three of the small model's lr 1e-6 pairs by 0.02%); every 64th window: 21 ms."""

_HEAD = 8  # u32 changed count, u8 buckets (| EXC_CODED), u8 shift, u8 bits, u8 groups

EXC_CODED = 0x80
"""Set in the header's buckets byte: the exception list is Exp-Golomb codes and 4-bit contexts in a
bit section (else varints and a byte each, as the first payloads wrote it)."""

WIDE = 0x10
"""Set in the header's buckets byte: a value group of at least :data:`weightsync.codec.lanes.WIDE_MIN`
changes has a wide rANS section (32 states, coded by vector steps; else 4)."""

NIBBLES = 0x20
"""Set in the header's buckets byte: a bucket whose code byte is :data:`NIBBLE_CODE` has its changed
flags in the block's nibble section (:mod:`weightsync.codec.nibbles`), after the Rice sections."""

CARRIED = 0x40
"""Set in the header's buckets byte (with a coded exception list): the list's bit section is not in
the header; its first bytes are carried by the rANS sections' states (2 bytes a state: each starts
at 2^16 plus them, and a decoder ends there), the rest follow the last section. With
:data:`APART`: the states carry the Rice sections' first bytes, and the block holds the rest."""

APART = 0x08
"""Set in the header's buckets byte: the block holds no exception list (no count, no list); the list
is the block's part of the payload's reverse payload (:func:`encode_block_apart`), which only a
backward decode reads. With :data:`CARRIED` too, the states carry the Rice sections' first bytes
instead (2 a state), and the block holds the rest of them in their place."""

NIBBLE_CODE = 31 << 1
"""A bucket's code byte (a Rice parameter of 31, past the largest) when its positions are nibbles."""

EXC_ORDER = 24
"""The highest order of the exception list's Exp-Golomb codes (gaps are below 2^31)."""

EXC_DERIVED = 0x20
"""Set in the coded exception list's order byte (above the order's 5 bits): no exception carries
its old bucket and group; the backward decoder derives each from the new value
(:func:`_derived`). Written when that is right for every exception of the block."""

ESC_ORDER = 7
"""The highest order of a value group's escape codes (3 bits of its symbol-count byte)."""

TWO, THREE, FOUR, W64 = np.uint64(2), np.uint64(3), np.uint64(4), np.uint64(64)


# --- the block's plan: bucket thresholds and value groups, from a sample -----------------------------


@njit(nogil=True)
def _histogram(old, new, shift, fmask, width_bits):
    """Per exponent value: elements, changed elements and their value symbols, scaled to the block:
    the changes from every 16th window of 1024 elements (every 32nd from blocks of
    :data:`SAMPLE_HALVED` words or more), the elements from every 4th of those; every element of a
    block under 1024 words. Windows, not single words, so that the sample is read
    at the memory's streaming speed (a word every 1 KiB costs a cache miss each: 4x slower in all).
    Returns (elements, changed, symbols, step, dense): elements and changes scaled to the block,
    symbols counted in the sample, where each stands for ``step`` changes of the block, and whether
    the scan should take every word as changed (:func:`_plan`): where consecutive sampled words
    differ, changed or not, at least as often as a word is unchanged."""
    n = old.size
    per = np.zeros(fmask + 1, np.float64)
    chp = np.zeros(fmask + 1, np.float64)
    sym = np.zeros((fmask + 1, NSYM), np.int32)  # half the zeroing of int64 (a sample under 2^31)
    sh = np.uint64(64 - width_bits)
    n_words = n // 64
    win = 16  # words per window
    if n_words < 1024:
        every, end = 1, n  # every window; the exponents of every one
    else:
        every, end = (32 if n_words >= SAMPLE_HALVED else 16), n_words * 64
    total = (end + 63) // 64
    hist = np.zeros(4 * (fmask + 1), np.int64)
    words = changed = pairs = flips = 0  # whole words sampled, those changed; consecutive ones, those that differ
    for k, w0 in enumerate(range(0, total, win * every)):
        count_exponents = every == 1 or k % 4 == 0
        last = False
        for w in range(w0, min(w0 + win, total)):
            a = w * 64
            e = min(a + 64, end)
            if count_exponents:
                for i in range(a, e):
                    hist[(i & 3) * (fmask + 1) + ((np.int64(old[i]) >> shift) & fmask)] += 1
            if e - a == 64:
                c = ne_mask64(old, new, a)
                words += 1
                changed += c != ZERO
                if w > w0:
                    pairs += 1
                    flips += (c != ZERO) != last
                last = c != ZERO
            else:
                c = ZERO
                for i in range(a, e):
                    c |= np.uint64(old[i] != new[i]) << np.uint64(i - a)
            while c != ZERO:  # the changes (a few per word)
                i = a + np.int64(trailing_zeros(c))
                c &= c - ONE
                x = (np.int64(old[i]) >> shift) & fmask
                chp[x] += every
                d = np.int64(np.uint64(new[i] - old[i]) << sh) >> np.int64(sh)
                z = np.uint64((d << 1) ^ (d >> 63))
                sym[x, min(z - ONE, np.uint64(NSYM - 1))] += 1
    scale = 1 if every == 1 else 4 * every
    for x in range(fmask + 1):
        for r in range(4):
            per[x] += scale * hist[r * (fmask + 1) + x]
        per[x] = max(per[x], chp[x])  # the two samples differ: a bin never has more changes than elements
    return per, chp, sym, every, pairs > 0 and flips * words >= (words - changed) * pairs


@njit(nogil=True)
def _partitions(cost, g):
    """Dynamic program over splits of items ``0..m-1`` into contiguous ranges, ``cost[a, b]`` that of
    range ``[a, b)``: ``dp[q, b]``, the least cost of ``[0, b)`` in ``q`` ranges, and ``arg[q, b]``,
    where its last range starts (ties: the first found)."""
    m = cost.shape[0] - 1
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
    return dp, arg


@njit(nogil=True)
def _cuts(arg, q, ex):
    """The thresholds of the best split of all ``m`` items into ``q`` ranges (:func:`_partitions`'s
    ``arg``): the exponent ``ex[a]`` where each range after the first starts, ascending."""
    thr = np.zeros(q - 1, np.int64)
    b = arg.shape[1] - 1
    for r in range(q, 1, -1):
        b = arg[r, b]
        thr[r - 2] = ex[b]
    return thr


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
    _, arg = _partitions(cost, g)
    return _cuts(arg, g, ex)


_NLOGN = np.array([0.0] + [i * np.log2(i) for i in range(1, 4096)])  # n log2 n of small counts


@njit(nogil=True, inline="always")
def _nlogn(c):
    return _NLOGN[c] if c < 4096 else c * np.log2(c)


@njit(nogil=True)
def _bits_of(cum, a, b, table):
    """Bits of an ideal static code for the symbols counted by ``cum[b] - cum[a]``, plus its
    ``table``: t log2 t minus the sum of c log2 c."""
    t = 0
    h = table
    for s in range(NSYM):
        c = cum[b, s] - cum[a, s]
        t += c
        h -= _nlogn(c)
    return 0.0 if t == 0 else h + _nlogn(t)


@njit(nogil=True)
def _split(counts, G, table):
    """The value groups: at most G contiguous ranges of the old exponent whose static codes (with
    their tables) are the smallest (dynamic programming over the exponents that have changes);
    returns the thresholds (ascending; a change is in the group of the number of thresholds <= its
    old exponent). ``counts``: value symbols per old exponent; ``table``: a group's table in bits,
    on the scale of ``counts`` (a sample's counts weigh the table less)."""
    if G <= 1:
        return np.zeros(0, np.int64)
    tot = np.zeros(counts.shape[0], np.int64)  # counts.sum(axis=1) takes numba 6 us here
    for x in range(counts.shape[0]):
        for s in range(NSYM):
            tot[x] += counts[x, s]
    ex = np.flatnonzero(tot)
    m = ex.size
    if m <= 1:
        return np.zeros(0, np.int64)
    cum = np.zeros((m + 1, NSYM), np.int64)
    for i in range(m):
        cum[i + 1] = cum[i] + counts[ex[i]]
    if G == 2:  # one cut or none: what the dynamic program below finds, from the 2 m - 1 ranges at
        # either end instead of all m (m + 1) / 2 (lr 1e-6 pair 0's 127 splits, call by call: 0.60 -> 0.36 ms)
        whole = _bits_of(cum, 0, m, table)
        best, cut = 1e300, 0
        for a in range(1, m):
            v = _bits_of(cum, 0, a, table) + _bits_of(cum, a, m, table)
            if v < best - 1e-9:
                best, cut = v, a
        return np.full(1 if best < whole - 1e-9 else 0, ex[cut], np.int64)
    cost = np.full((m + 1, m + 1), 1e300)
    for a in range(m):
        for b in range(a + 1, m + 1):
            cost[a, b] = _bits_of(cum, a, b, table)
    g = min(G, m)
    dp, arg = _partitions(cost, g)
    best = 1
    for q in range(2, g + 1):
        if dp[q, m] < dp[best, m] - 1e-9:
            best = q
    return _cuts(arg, best, ex)


@njit(nogil=True)
def _lut(thr, fmask):
    """Per exponent value, how many of the ascending thresholds ``thr`` it reaches."""
    lut = np.zeros(fmask + 1, np.int64)
    for t in range(thr.size):
        lut[thr[t] :] += 1
    return lut


@njit(nogil=True)
def _plan(old, new, shift, bits, kmax, width_bits):
    """The block's bucket thresholds and the value groups' split, from a sample, whether the scan
    takes every word as changed (``dense``, :func:`_scan_source`), and the changes the sample
    estimates (-1 for a block without an exponent field: not sampled)."""
    fmask = (1 << bits) - 1
    thr = np.zeros(0, np.int64)
    vthr = np.zeros(0, np.int64)
    dense = False
    est = np.int64(-1)
    if fmask > 0:
        per, chp, vsym, step, dense = _histogram(old, new, shift, fmask, width_bits)
        est = np.int64(chp.sum())
        thr = _thresholds(per, chp, min(kmax, max(1, est // CHANGES_PER_BUCKET)))
        gmax = MAX_G if est >= GROUP_DENSITY * old.size else 2
        vthr = _split(vsym, min(gmax, max(1, est // CHANGES_PER_BUCKET)), TABLE_BITS / step)
    return _padded(thr, MAX_K - 1), _padded(vthr, MAX_G - 1 if vthr.size > 1 else vthr.size), dense, est


SCAN_BITMAPS = 16
"""The ``BMI2`` kind's encoder scans with ``pext`` into bitmaps from 1 change in this many elements (the
sample's estimate), and lists ranks as the portable kind does below it: without VBMI2 both compress
the codes change by change, and a word's ``pext`` per bucket, its bitmaps written and read back,
costs more than a step per change where words have one or two. Whole encodes of every BF16 tensor
of a step pair, compiled for a Cascade Lake's features (no VBMI2) on an AMD Zen 4: with bitmaps from
1 in 32, lr 1e-6 pair 0 (1 change in 32-45) took 8% longer than the portable scan; from 1 in 16
the same time, and at lr 1e-5 (1 in 8-11) 19-22% less. A block of a dtype without an exponent field
is not sampled (no estimate): it scans into bitmaps."""


def _scan_kind(native: int, changes: int, n: int) -> int:
    """The kind of the scan ``encode_block`` runs for kernels of kind ``native`` (:data:`SCAN_BITMAPS`);
    ``changes``: the sample's estimate, or -1 where none was made."""
    if kind_of(native) == BMI2 and 0 <= changes and changes * SCAN_BITMAPS < n:
        return PORTABLE
    return native


@njit(nogil=True)
def _padded(thr, size):
    """``thr`` with its last threshold repeated up to ``size`` (empty buckets or groups): the encoder
    uses only 1 or 4 buckets and 1, 2 or 4 groups, so that few passes need compiling."""
    if thr.size == 0 or thr.size >= size:
        return thr
    out = np.full(size, thr[-1], np.int64)
    out[: thr.size] = thr
    return out


# --- the passes over the elements, generated per bucket and group count ------------------------------


def _regions(name: str, count: int, indent: str) -> list[str]:
    """Lines naming ``name0..`` the members of ``count`` regions split by the masks ``name_m0..``
    (each the elements below a threshold)."""
    if count == 1:
        return [f"{indent}{name}0 = ALL"]
    L = [f"{indent}{name}0 = {name}_m0"]
    L += [f"{indent}{name}{b} = {name}_m{b} & ~{name}_m{b - 1}" for b in range(1, count - 1)]
    return L + [f"{indent}{name}{count - 1} = ~{name}_m{count - 2}"]


def _pass_source(K: int, G: int, name: str, bmi2: bool) -> str:
    """The pass over elements ``a:e`` for K buckets and G value groups, state in locals: per 64
    elements, K-1 vector compares give each bucket's members, ``pdep`` puts the bucket's next bits
    there (the portable kind: all buckets' in one call; one bucket: the bits are the changes), G-1
    more compares split the changes into the groups, and one expand-load per group adds the
    differences. Every CHECK elements it checks that no bucket ran past its bitmap and no
    group past its differences (each has CHECK of spare: a base that does not match the block reads
    zeros or other differences, never out of bounds); the last, partial word goes element by
    element; at the block's end the buckets and groups must be used up exactly. Returns 0, or 1 for
    a block that does not fit its base. Indices are unsigned (numba adds no wraparound for them)."""
    r, rg = range(K), range(G)
    L = [f"def {name}(out, src, a, e, lims, st, words, diffs):", "    absmask, _ = _masks(src, 0, 0)"]
    L += [f"    l{t} = lims[{t}]" for t in range(K - 1)] + [f"    v{t} = lims[{MAX_K + t}]" for t in range(G - 1)]
    L += [f"    o{b} = np.uint64(st[{S_OFF + b}])" for b in r] + [f"    E{b} = np.uint64(st[{S_END + b}])" for b in r]
    L += [f"    d{g} = st[{S_DPTR + g}]" for g in rg] + [f"    D{g} = st[{S_DEND + g}]" for g in rg]
    L += ["    n = src.size", "    whole = min(e, n - n % 64)"]
    past = " or ".join([f"o{b} > E{b}" for b in r] + [f"d{g} > D{g}" for g in rg])
    L += ["    for s in range(a, whole, CHECK):"]
    L += [f"        if {past}:", "            return 1"]
    L += ["        for base in range(s, min(s + CHECK, whole), 64):", "            prefetch64(src, base)"]
    L += [f"            b_m{t} = below_mask64(src, base, absmask, l{t})" for t in range(K - 1)]
    L += _regions("b", K, "            ")
    L += [f"            p{b} = popcount(b{b})" for b in r]
    for b in r:  # the bucket's next p bits from bit o (written out: no array passed to a helper)
        L += [f"            q = o{b} >> SIX", f"            sh = o{b} & M63"]
        L += ["            v = (words[q] >> sh) | ((words[q + ONE] << ONE) << (M63 - sh))"]
        L += [f"            x{b} = v & (ALL >> ((W64 - p{b}) & M63)) & (ZERO - np.uint64(p{b} != ZERO))"]
        L += [f"            o{b} += p{b}"]
    if K == 1:  # the one bucket holds every element: its bits are the changes
        L += ["            ch = x0"]
    elif bmi2:
        L += ["            ch = " + " | ".join(f"_pdep(x{b}, b{b})" for b in r)]
    else:  # all buckets at once (unused ones empty)
        args = ", ".join(f"x{b}, b{b}" if b < K else "ZERO, ZERO" for b in range(MAX_K))
        L += [f"            ch = _deposit({args})"]
    L += [f"            g_m{t} = below_mask64(src, base, absmask, v{t})" for t in range(G - 1)]
    L += _regions("g", G, "            ")
    L += [f"            g{g} &= ch" for g in rg]
    L += ["            _expand_add(out, src, base, diffs, " + ", ".join(f"d{g}, g{g}" for g in rg) + ")"]
    L += [f"            d{g} += np.int64(popcount(g{g}))" for g in rg]
    L += [f"    st[{S_OFF + b}] = np.int64(o{b})" for b in r] + [f"    st[{S_DPTR + g}] = d{g}" for g in rg]
    L += [f"    if {past}:", "        return 1"]
    L += [
        "    if e > whole:",
        f"        off, dptr = st[{S_OFF}:{S_OFF + K}], st[{S_DPTR}:{S_DPTR + G}]",
        f"        lim, vlim = lims[:{MAX_K}], lims[{MAX_K}:{MAX_K + MAX_G}]",
        "        _tail(out, src, max(a, whole), e, lim, vlim, absmask, words, off, dptr, diffs)",
    ]
    L += ["    if e == n:"]
    L += [f"        if st[{S_OFF + b}] != st[{S_END + b}]:\n            return 1" for b in r]
    L += [f"        if st[{S_DPTR + g}] != st[{S_DEND + g}]:\n            return 1" for g in rg]
    L += ["    return 0"]
    # the same over a:e in slices of ``chunk``, each fed to an XXH3 state after it is written (while
    # it is in cache), in one call: no hand-off of the GIL per slice (weightsync.codec.hashing)
    L += [f"def {name}_hashed(out, src, a, e, lims, st, words, diffs, fn, state, chunk):"]
    L += ["    for s in range(a, e, chunk):", "        t = min(s + chunk, e)"]
    L += [f"        if {name}(out, src, s, t, lims, st, words, diffs):", "            return 1"]
    L += ["        if feed(fn, state, out, s, t):", "            return 2", "    return 0"]
    return "\n".join(L) + "\n"


@njit(nogil=True)
def _tail(out, src, a, e, lim, vlim, absmask, words, off, dptr, diffs):
    """The pass element by element (the last, partial word)."""
    for i in range(a, e):
        x = src[i]
        v = x & absmask
        b = 0
        for t in range(off.size - 1):
            b += v >= lim[t]
        r = off[b]
        off[b] = r + 1
        if (words[r >> 6] >> np.uint64(r & 63)) & ONE:
            g = 0
            for t in range(dptr.size - 1):
                g += v >= vlim[t]
            out[i] = x + diffs[dptr[g]]
            dptr[g] += 1
        else:
            out[i] = x


def _exception(indent: str, o: str, x: str) -> list[str]:
    """Lines listing element ``i`` (old value ``o``, new ``x``) if its bucket or group changed."""
    L = [f"eo = (np.int64({o}) >> shift) & fm", f"en = (np.int64({x}) >> shift) & fm"]
    L += ["if blut[eo] != blut[en] or glut[eo] != glut[en]:", "    exc[ne] = i", "    ne += 1"]
    return [indent + line for line in L]


def _scan_source(K: int, G: int, name: str, bmi2: bool) -> str:
    """The encoder's pass over whole words for K buckets and G value groups, state in locals: per
    64 elements, the changed mask (a vector compare of old and new), K-1 compares give the buckets;
    with ``bmi2`` (the native and BMI2 kinds) it ``pext``-s each bucket's changed flags in rank order
    into its bitmap (one bucket: the flags are the changes), the portable kind lists each change's rank in its bucket
    (its bucket's members before the word, plus a ``popcount`` of its bucket's mask below it);
    G-1 compares give the value groups, and the zigzag codes of the word are computed once and
    the changes' compress-stored into their group's stream (the portable kind stores those of a
    word of few changes in its ranks' loop); the changes that move their element to another bucket
    or group are listed (for the backward decode). ``dense`` (the plan's, :func:`_histogram`): the
    ``bmi2`` scan takes every word as changed, without the branch on its changes, which mispredicts where
    changed and unchanged words alternate at random (a word without changes stores nothing: its
    compress-stores keep no lane, its flags are 0; the lr 1e-6 step pairs' scans took 8-13% less
    time, lr 1e-5's 2-3%; where the changes are in runs, as in an embedding's rows, the branch is
    predicted and skips them: there an embedding's scan took 1.9x as long without it)."""
    r, rg = range(K), range(G)
    L = [f"def {name}(old, new, thr, vthr, shift, bits, raw, st, dense):"]
    L += ["    fm = (1 << bits) - 1", "    lim, vlim = _limits(thr, vthr, shift, old[:0])"]
    L += ["    blut, glut = _lut(thr, fm), _lut(vthr, fm)", "    absmask, field = _masks(old, shift, fm)"]
    L += [
        f"    bmap, vals, exc, stride, rk, cap = _views(raw, old, {K})",
        "    v0, v1, v2, v3 = vals[0], vals[1], vals[2], vals[3]",
    ]
    L += [f"    l{t} = lim[{t}]" for t in range(K - 1)] + [f"    u{t} = vlim[{t}]" for t in range(G - 1)]
    if bmi2:
        L += [f"    a{b} = ZERO" for b in r] + [f"    bp{b} = np.uint64({b} * stride) << SIX" for b in r]
    else:  # each bucket's members so far and its changes listed; the groups' codes as one array
        L += [f"    r{b} = ZERO" for b in r] + [f"    c{b} = {b} * cap" for b in r]
        L += ["    row = vals.shape[1]", f"    vf = vals.reshape({MAX_G} * row)", "    zs = 64 - 8 * old.itemsize"]
    L += [f"    k{g} = 0" for g in rg] + [
        "    ne = 0",
        "    for w in range(old.size // 64):",
        "        base = w * 64",
        "        prefetch64(old, base)",
        "        prefetch64(new, base)",
    ]
    L += ["        c = ne_mask64(old, new, base)"]
    L += [f"        b_m{t} = below_mask64(old, base, absmask, l{t})" for t in range(K - 1)]
    L += _regions("b", K, "        ")
    if bmi2:
        L += [f"        f{b} = ZERO" for b in r]
    L += ["        if dense or c != ZERO:" if bmi2 else "        if c != ZERO:"]
    # the word's values by group (compress-stores), and the exceptions: a change can move its element
    # to another bucket or group only if its exponent changed (rare). The portable kind does both
    # change by change in a word of few changes; with more than 2 groups it takes their masks for
    # every changed word (a group chosen per change from 3 thresholds slowed the scan 3-4% at lr 1e-5)
    # The exceptions' mask is taken before the compress-stores: after them the compiler reloads both
    # words (they might have been stored to), and the scan of lr 1e-6 pair 0 took 6% longer
    masks = [f"g_m{t} = below_mask64(old, base, absmask, u{t})" for t in range(G - 1)] + _regions("g", G, "")
    scalar = G <= 2
    values = ["x = field_ne_mask64(old, new, base, field)"] + (list(masks) if bmi2 or scalar else [])
    if not (bmi2 or scalar):
        L += ["            " + line for line in masks]
    values += [f"g{g} &= c" for g in rg]
    values += ["_compress(old, new, base, " + ", ".join(f"v{g}, k{g}, g{g}" for g in rg) + ")"]
    values += [f"k{g} += np.int64(popcount(g{g}))" for g in rg]
    values += ["while x != ZERO:"]
    values += ["    i = base + np.int64(trailing_zeros(x))", "    x &= x - ONE"]
    values += [*_exception("    ", "old[i]", "new[i]")]
    if bmi2:
        L += ["            " + line for line in values]
        if K == 1:  # the one bucket holds every element: its flags are the changes
            L += ["            f0 = c"]
        else:
            L += [f"            f{b} = _pext(c, b{b})" for b in r]
        # append the bucket's flags to its bitmap at its bit position (its word, and its bits in that
        # word, in one register: with a word index and a bit count apart the loop's state spilled to the
        # stack, and the scan took 12% longer); the word is stored every time (branch-free)
        for b in r:
            L += [f"        nn = bp{b} & M63", f"        q = bp{b} >> SIX", f"        word = a{b} | (f{b} << nn)"]
            L += ["        bmap[q] = word", f"        bp{b} += popcount(b{b})"]
            L += [f"        a{b} = word if (bp{b} >> SIX) == q else (f{b} >> ONE) >> (M63 - nn)"]
        L += [f"    st[{E_ACC + b}] = np.int64(a{b})" for b in r]
        L += [f"    st[{E_NACC + b}] = np.int64(bp{b} & M63)" for b in r]
        L += [f"    st[{E_WPOS + b}] = np.int64(bp{b} >> SIX) - {b} * stride" for b in r]
    else:  # a word of many changes: a loop per bucket and per group (fewer operations a change, a
        # mispredicted exit each); of a few: one loop, each change's bucket and group chosen without a
        # branch, its rank listed and its code stored (one exit a word, not one per bucket and group)
        L += ["            if popcount(c) > DENSE:"]
        L += ["                " + line for line in values]
        for b in r:
            y = "c" if K == 1 else f"c & b{b}"
            L += [f"                y = {y}", "                while y != ZERO:"]
            L += [f"                    rk[c{b}] = np.uint32(r{b} + popcount(b{b} & ((y & (ZERO - y)) - ONE)))"]
            L += [f"                    c{b} += 1", "                    y &= y - ONE"]
        L += ["            else:", "                y = c", "                while y != ZERO:"]
        L += ["                    j = trailing_zeros(y)", "                    below = (y & (ZERO - y)) - ONE"]
        L += ["                    y &= y - ONE", "                    m, rr, at = b0, r0, c0"]
        for b in range(1, K):
            L += [f"                    s{b} = np.int64((b{b} >> j) & ONE)"]
            L += [f"                    if s{b}:", f"                        m, rr, at = b{b}, r{b}, c{b}"]
        L += ["                    rk[at] = np.uint32(rr + popcount(m & below))"]
        L += ["                    c0 += 1" + "".join(f" - s{b}" for b in range(1, K))]
        L += [f"                    c{b} += s{b}" for b in range(1, K)]
        L += ["                    i = base + np.int64(j)", "                    o, nw = old[i], new[i]"]
        L += ["                    d = np.int64(np.uint64(nw - o) << zs) >> np.int64(zs)"]
        if G > 1 and scalar:  # the change's group: how many group thresholds its old exponent reaches
            L += ["                    a = o & absmask"]
            L += ["                    h = " + " + ".join(f"np.int64(a >= u{t})" for t in range(G - 1))]
            L += [f"                    t{g} = np.int64(h == {g})" for g in range(1, G)]
        elif G > 1:
            L += [f"                    t{g} = np.int64((g{g} >> j) & ONE)" for g in range(1, G)]
        L += ["                    kv = k0" + "".join(f" + t{g} * ({g} * row + k{g} - k0)" for g in range(1, G))]
        L += ["                    vf[kv] = (d << 1) ^ (d >> 63)"]
        L += ["                    k0 += 1" + "".join(f" - t{g}" for g in range(1, G))]
        L += [f"                    k{g} += t{g}" for g in range(1, G)]
        L += ["                    if (o ^ nw) & field:", *_exception("                        ", "o", "nw")]
        L += [f"        r{b} += popcount(b{b})" for b in r]
    if not bmi2:
        L += [f"    st[{E_MEMB + b}] = np.int64(r{b})" for b in r]
        L += [f"    st[{E_NCH + b}] = c{b} - {b} * cap" for b in r]
    L += [f"    st[{E_NV + g}] = k{g}" for g in rg] + [f"    st[{E_NES}] = ne"]
    return "\n".join(L) + "\n"


_KERNELS: dict[tuple[str, int, int, int], object] = {}


_KERNELS_LOCK = threading.Lock()


def _kernel(kind: str, K: int, G: int, native: int = NATIVE):
    """The pass ``kind`` (``"pass"``: decoding, ``"scan"``: encoding) for K buckets and G value groups,
    of a kind of kernel (:data:`weightsync.codec.simd.KINDS`): the native one (BMI2's ``pdep``/``pext``,
    vector expand-loads and compress-stores), ``BMI2`` (the instructions, the portable vector steps)
    or the portable one (work per change, not per member); the passes' generated sources differ
    only in the deposit line, the scans' in how they keep the changes' ranks (bitmaps by ``pext``,
    or lists), and the helpers bound into them differ.
    Generated and compiled on first use, then kept.
    The source is compiled as if it were in this file, under a name of its own: numba's cache
    (:mod:`weightsync.codec.jit`) then keys it by its bytecode and this package's stamp like any
    kernel here, and a warm cache loads it instead of compiling (about 1 s each). A kind with
    ``pdep`` is refused where BMI2 is missing (:data:`weightsync.codec.simd.HAS_BMI2`)."""
    native = _runnable(native, kind)
    key = (kind, K, G, native)
    fn = _KERNELS.get(key)
    if fn is None:
        if not (1 <= K <= MAX_K and 1 <= G <= MAX_G):
            raise ValueError(f"no {kind} for {K} buckets and {G} value groups")
        with _KERNELS_LOCK:
            fn = _KERNELS.get(key)
            if fn is None:
                name = f"_{kind}_k{K}_g{G}_{KIND_NAMES[native]}"
                bmi2, vec = uses_bmi2(native), uses_vectors(native)
                source = (_pass_source if kind == "pass" else _scan_source)(K, G, name, bmi2)
                ns = dict(_GENERATED_GLOBALS, __name__=__name__)
                ns.update(_limits=_limits, _lut=_lut, _masks=_masks, _views=_views)  # defined further down
                if bmi2:
                    ns.update(_pdep=pdep_bmi2, _pext=pext_bmi2)
                else:
                    ns.update(_deposit=deposit_soft)
                ns.update(_expand_add=(EXPAND_ADD if vec else EXPAND_ADD_SOFT)[G])
                ns.update(_compress=(COMPRESS_ZIGZAG if vec else COMPRESS_ZIGZAG_SOFT)[G])
                exec(compile(source, __file__, "exec"), ns)  # noqa: S102 - our own generated source
                ns[name] = fn = njit(nogil=True)(ns[name])  # before the wrapper that calls it
                if kind == "pass":  # stored first: another thread takes the pass's key, unlocked, as a sign of both
                    _KERNELS["pass_hashed", K, G, native] = njit(nogil=True)(ns[name + "_hashed"])
                _KERNELS[key] = fn
    return fn


def _runnable(native, what: str) -> int:
    """``native`` as a kind's value (:func:`weightsync.codec.simd.kind_of`), refused where it needs BMI2
    and this CPU (or numba's target CPU) lacks it: its ``pdep`` and ``pext`` would be illegal
    instructions. ``what`` names the kernel in the message."""
    native = kind_of(native)
    if uses_bmi2(native) and not HAS_BMI2:
        raise ValueError(f"the {KIND_NAMES[native]} {what} needs BMI2, which this CPU (or numba's target CPU) lacks")
    return native


def _hashed_pass(K: int, G: int, native: int):
    """The pass of :func:`_kernel` that feeds its result to an XXH3 state slice by slice
    (:func:`_pass_source`'s ``_hashed`` wrapper, made with the pass)."""
    _kernel("pass", K, G, native)
    return _KERNELS["pass_hashed", K, G, kind_of(native)]


_GENERATED_GLOBALS = dict(
    np=np,
    ALL=ALL,
    ONE=ONE,
    ZERO=ZERO,
    SIX=np.uint64(6),
    M63=np.uint64(63),
    W64=np.uint64(64),
    CHECK=CHECK,
    DENSE=DENSE,
    below_mask64=below_mask64,
    ne_mask64=ne_mask64,
    field_ne_mask64=field_ne_mask64,
    popcount=popcount,
    prefetch64=prefetch64,
    trailing_zeros=trailing_zeros,
    _tail=_tail,
    feed=feed,
)


# --- encoding -------------------------------------------------------------------------------------


@njit(nogil=True)
def _gaps_of(words, n_b, c, inv):
    """The gaps a bucket's Rice section codes, from its bitmap over ``n_b`` ranks with ``c`` set:
    between its set bits, or its clear ones (``inv``). The ranks are listed first, then differenced.
    A bucket of more than :data:`RANKS_COMPRESSED` coded bits a word lists each word's with two
    compress-stores (:func:`compress_ranks`, where they are single instructions:
    :data:`~weightsync.codec.simd.COMPRESS_RANKS`); a sparser one writes the same number of ranks for every
    word, a multiple of 4 (:func:`_ranks_per_word`), whatever its count, and only a word with more
    takes a loop for the rest: a loop over each word's own set bits mispredicted its exit on most
    words (about 10 ns a gap), and so did the loop past 4 a word in dense buckets. Returns the gaps and
    their Rice parameter, :func:`rice_parameter`'s choice. Indices are unsigned: numba tests every
    signed one for wraparound."""
    count = n_b - c if inv else c
    u = np.uint64(_ranks_per_word(count, n_b))
    dense = COMPRESS_RANKS and u > np.uint64(RANKS_COMPRESSED)
    ranks = np.empty(count + 65, np.uint32)  # rank -1 first; a sparse word writes up to 64 past its last
    ranks[0] = np.uint32(0xFFFFFFFF)
    j = ONE
    base = ZERO
    last = n_b >> 6
    tail = (ONE << np.uint64(n_b & 63)) - ONE
    for q in range((n_b + 63) // 64):
        x = ~words[q] if inv else words[q]
        if q == last:
            x &= tail
        p = popcount(x)
        if dense:
            compress_ranks(ranks, j, x, base)
        else:
            t = ZERO
            while t < u:
                ranks[j + t] = base + trailing_zeros(x)
                x &= x - ONE
                ranks[j + t + ONE] = base + trailing_zeros(x)
                x &= x - ONE
                ranks[j + t + TWO] = base + trailing_zeros(x)
                x &= x - ONE
                ranks[j + t + THREE] = base + trailing_zeros(x)
                x &= x - ONE
                t += FOUR
            while x != ZERO:  # a word over the bucket's count
                ranks[j + t] = base + trailing_zeros(x)
                x &= x - ONE
                t += ONE
        j += p
        base += W64
    gaps = np.empty(count, np.uint64)
    if count == 0:
        return gaps, 0
    # the Rice parameter's costs summed as the gaps are made (:func:`rice_parameter`, without its two
    # passes over them): their sum is the last rank plus one, less their count
    lo = rice_low(np.uint64(ranks[count]) + ONE - np.uint64(count), count)
    k1, k2, k3 = np.uint64(lo), np.uint64(lo + 1), np.uint64(lo + 2)
    cap = np.uint64(RICE_ESCAPE)
    c1 = c2 = c3 = ZERO
    for i in range(np.uint64(count)):  # in 32 bits (numba's own are 64), where rank -1 is 2^32 - 1
        g = np.uint64(np.uint32(ranks[i + ONE] - ranks[i] - np.uint32(1)))
        gaps[i] = g
        c1 += min(g >> k1, cap)
        c2 += min(g >> k2, cap)
        c3 += min(g >> k3, cap)
    return gaps, rice_best(lo, c1, c2, c3, count)


RANKS_COMPRESSED = 8
""":func:`_gaps_of` lists a word's ranks with compress-stores where its bucket writes more than this
many a word (:func:`_ranks_per_word`); at or under it, 4 or 8 a word, the stores one at a time were
faster (a compress-store costs the same at any count). The gaps of the small model's lr 1e-5 pair 0:
4.5 -> 3.5 ms (8 a word and under as before; every bucket compressed: 3.7); lr 1e-6: 1.81 -> 1.73
(every bucket compressed: 2.7); the 2.03 GiB pair: 81 -> 73."""


@njit(nogil=True)
def _ranks_per_word(count, n_b):
    """How many ranks :func:`_gaps_of` writes for every word of a bitmap of ``n_b`` bits with ``count``
    of them coded: the mean count a word plus two standard deviations (binomial) plus one, rounded
    up to a multiple of 4, from 4 to 64; a word over it (under 1% of a bucket's words where its
    changes are spread evenly, more where they cluster) takes a loop for the rest."""
    d = count / max(n_b, 1)
    mean = 64.0 * d
    u = np.int64(np.ceil((mean + 2.0 * np.sqrt(mean * (1.0 - d)) + 1.0) / 4.0)) * 4
    return min(max(u, 4), 64)


@njit(nogil=True)
def _rank_gaps(rk, off, c, n_b, inv):
    """The gaps a bucket's Rice section codes, from its ``c`` changed ranks among ``n_b``
    (ascending, at ``rk[off:]``): between them, or between its unchanged ranks (``inv``: each such
    gap counts the changed ranks since the unchanged rank before)."""
    if not inv:
        gaps = np.empty(c, np.uint64)
        prev = ~ZERO  # rank -1
        for i in range(c):
            r = np.uint64(rk[off + i])
            gaps[i] = r - prev - ONE
            prev = r
        return gaps
    gaps = np.zeros(n_b - c + 1, np.uint64)  # one spare: the store below runs one past the last
    j = 0  # unchanged ranks seen: the gap of the next one is gaps[j]
    nxt = 0  # the lowest rank not yet seen
    run = ZERO  # changed ranks since the last unchanged one
    for i in range(c):  # without a branch: a dense bucket's runs are short and irregular
        r = np.int64(rk[off + i])
        gaps[j] = run  # final when unchanged ranks nxt .. r - 1 lie before r (the others' gaps are 0)
        seen = r - nxt
        j += seen
        run = run * np.uint64(seen == 0) + ONE
        nxt = r + 1
    gaps[j] = run  # the unchanged rank after the last changed one, if any
    return gaps[: n_b - c]


@njit(nogil=True)
def _encode(old, new, shift, bits, width_bits, thr, vthr, raw, st, ranks, vec, nibbles, apart):
    """The block from the pass over its whole words (:func:`_scan_source`: its arrays in ``raw``, its
    state in ``st``; ``ranks``: the scan listed ranks, the portable kind, rather than bitmaps; ``vec``:
    compress-stores and wide rANS sections by vector steps, the native kind): the last, partial word,
    then the header and sections. Returns the block, the changed count and the block's reverse part
    (empty unless ``apart``: the exception list then goes there, not in the block)."""
    n = old.size
    fmask = (1 << bits) - 1
    K = thr.size + 1
    G = vthr.size + 1
    bmap, vals, exc, stride, rk, cap = _views(raw, old, K)
    acc = st[E_ACC : E_ACC + K].view(np.uint64)
    nacc, wpos, nv = st[E_NACC : E_NACC + K], st[E_WPOS : E_WPOS + K], st[E_NV : E_NV + G]
    memb, nch = st[E_MEMB : E_MEMB + K], st[E_NCH : E_NCH + K]
    gvt = _lut(vthr, fmask)  # value group by exponent
    lut = _lut(thr, fmask)
    ne = st[E_NES]
    bm = np.zeros(MAX_K, np.uint64)
    sh = np.uint64(64 - width_bits)
    for w in range(n // 64, (n + 63) // 64):  # the last, partial word, element by element
        base = w * 64
        c = ZERO
        for j in range(n - base):
            i = base + j
            jj = np.uint64(j)
            ch = old[i] != new[i]
            c |= np.uint64(ch) << jj
            eo = (np.int64(old[i]) >> shift) & fmask
            en = (np.int64(new[i]) >> shift) & fmask
            bm[lut[eo]] |= ONE << jj
            if ranks:
                b = lut[eo]
                if ch:
                    rk[b * cap + nch[b]] = memb[b]
                    nch[b] += 1
                memb[b] += 1
            if ch:
                g = gvt[eo]
                s_ = np.int64(np.uint64(new[i] - old[i]) << sh) >> np.int64(sh)
                vals[g, nv[g]] = (s_ << 1) ^ (s_ >> 63)
                nv[g] += 1
                if lut[en] != lut[eo] or gvt[en] != g:
                    exc[ne] = i
                    ne += 1
        for b in range(0 if ranks else K):  # append the bucket's flags (one per member, in order) to its bitmap
            m = bm[b]
            p = np.int64(popcount(m))
            flags = pext_soft(c, m)  # once per block: the portable one
            na = nacc[b]
            word = acc[b] | (flags << np.uint64(na))
            if na + p >= 64:
                bmap[b * stride + wpos[b]] = word
                wpos[b] += 1
                acc[b] = (flags >> ONE) >> np.uint64(63 - na)
                nacc[b] = na + p - 64
            else:
                acc[b] = word
                nacc[b] = na + p
            bm[b] = ZERO
    k = nv.sum()
    if k == 0:
        return np.zeros(0, np.uint8), 0, np.zeros(0, np.uint8)
    cnt = np.zeros(K, np.int64)
    cb = np.zeros(K, np.int64)
    for b in range(K):
        if ranks:
            cnt[b], cb[b] = memb[b], nch[b]
            continue
        bmap[b * stride + wpos[b]] = acc[b]
        bmap[b * stride + wpos[b] + 1] = ZERO
        cnt[b] = 64 * wpos[b] + nacc[b]
        for q in range(wpos[b] + 1):
            cb[b] += np.int64(popcount(bmap[b * stride + q]))
    # values: symbols min(zigzag - 1, 15), escapes (zigzag >= 16) in order, per group
    counts = np.zeros((G, NSYM), np.int64)
    syms = np.empty((G, (nv.max() + 8) // 8 * 8), np.uint8)  # rows of whole 16-bit pairs, aligned
    esc = np.empty(k + 1 + SPARE, vals.dtype)  # each group's escapes (zigzag - NSYM), one after another
    escg = np.zeros(G + 1, np.int64)
    nesc = 0
    hist = np.empty(4 * NSYM * NSYM, np.int64)
    for g in range(G):
        m, z_g, s_g = nv[g], vals[g], syms[g]  # rows as 1-D arrays: the first loop is vectorised
        for j in range(m):
            s_g[j] = min(np.uint64(z_g[j]) - ONE, np.uint64(NSYM - 1))
        _symbol_counts(s_g, m, hist, counts[g])
        if counts[g, NSYM - 1] and vec:  # 32 codes a compress-store (the native kind)
            nx = np.uint64(nesc)
            full = np.uint64(m - m % 32)
            for j in range(ZERO, full, np.uint64(32)):
                nx += compress_escapes(esc, nx, z_g, j, np.uint64(NSYM), ALL)
            if m % 32:
                nx += compress_escapes(esc, nx, z_g, full, np.uint64(NSYM), (ONE << np.uint64(m % 32)) - ONE)
            nesc = np.int64(nx)
        elif counts[g, NSYM - 1]:  # every code stored, the count moved by escapes only: no branch to
            # mispredict (at lr 1e-5 4% of the changes escape)
            nx = np.uint64(nesc)
            for j in range(np.uint64(m)):
                z = np.uint64(z_g[j])
                esc[nx] = z - np.uint64(NSYM)
                nx += np.uint64(z >= np.uint64(NSYM))
            nesc = np.int64(nx)
        escg[g + 1] = nesc
    head = np.zeros(64 + 16 * K + 64 * G + 14 * ne, np.uint8)  # an exception: at most 100 bits
    head[0] = k & 0xFF
    head[1] = (k >> 8) & 0xFF
    head[2] = (k >> 16) & 0xFF
    head[3] = (k >> 24) & 0xFF
    head[4] = K | (APART if apart else EXC_CODED if ne else 0) | (WIDE if nv.max() >= WIDE_MIN else 0)
    head[5] = shift
    head[6] = bits
    head[7] = G
    hp = 8
    for t in range(K - 1):
        head[hp] = thr[t]
        hp += 1
    for t in range(G - 1):
        head[hp] = vthr[t]
        hp += 1
    if not apart:
        hp = put_varint(head, hp, ne)
    xl = 0
    xsec = np.zeros(2, np.uint8)
    rev = np.zeros(0, np.uint8)
    if ne:  # the exceptions: Exp-Golomb codes of their gaps, each followed by its old bucket and group
        gaps = np.empty(ne, np.uint64)
        prevp = -1
        for j in range(ne):
            gaps[j] = exc[j] - prevp - 1
            prevp = exc[j]
        hx, nbits = eg_order(gaps, 0)
        for lo in (8, 16, EXC_ORDER - 7):  # every order to 24: the best is not always near log2 of the mean gap
            if nbits > ne * (1 + lo):  # else no order from lo can win: each of its codes is over lo bits
                o, ob = eg_order(gaps, lo)
                if ob < nbits:
                    hx, nbits = o, ob
        tags = np.empty(ne, np.uint8)
        derived = True
        for j in range(ne):
            eo = (np.int64(old[exc[j]]) >> shift) & fmask
            tags[j] = lut[eo] << 2 | gvt[eo]
            x = _derived(new[exc[j]], shift, fmask)
            if x < 0 or lut[x] != lut[eo] or gvt[x] != gvt[eo]:
                derived = False
        tb = 0 if derived else 4
        xl = (nbits + tb * ne + 7) // 8
        xsec = np.zeros(xl + 2, np.uint8)  # carried by the rANS sections' states, the rest at the block's end
        eg_section(gaps, hx, tags, tb, xsec)
        if apart:  # the reverse part: varint e, the order byte, the bit section
            rev = np.empty(xl + 6, np.uint8)
            rp = put_varint(rev, 0, ne)
            rev[rp] = hx | (EXC_DERIVED if derived else 0)
            rev[rp + 1 : rp + 1 + xl] = xsec[:xl]
            rev = rev[: rp + 1 + xl]
            xl = 0
        else:
            head[hp] = hx | (EXC_DERIVED if derived else 0)
            hp = put_varint(head, hp + 1, xl)
            head[4] |= CARRIED
    # the nibble section: at most a word a nibble, 4 k + 32 K nibbles (its buckets' density is 1/16 or more)
    body = np.empty(64 * K + 64 * G + 20 * k + 16 * nesc + 128 * LANES * K + 4 * WIDE_LANES * (G + 1) + xl, np.uint8)
    bp = 0
    nib_b = np.zeros(K, np.bool_)
    density = NIBBLE_DENSITY  # of the buckets coded as nibbles: fewer when their section would be narrow
    total = 0
    for b in range(K):
        if cb[b] and NIBBLE_DENSITY * min(cb[b], cnt[b] - cb[b]) >= cnt[b]:
            total += run_symbols(cnt[b])
    if total < WIDE_MIN:
        density = NIBBLE_NARROW
    for b in range(K):  # positions: per bucket, Rice codes of rank gaps, or its bitmap's nibbles
        c = cb[b]
        hp = put_varint(head, hp, cnt[b])
        hp = put_varint(head, hp, c)
        if c == 0:
            continue
        if nibbles and density * min(c, cnt[b] - c) >= cnt[b]:
            nib_b[b] = True
            head[hp] = NIBBLE_CODE
            hp += 1
            continue
        inv = 2 * c > cnt[b]
        if ranks:
            gaps = _rank_gaps(rk, b * cap, c, cnt[b], inv)
            kr = rice_parameter(gaps)
        else:
            gaps, kr = _gaps_of(bmap[b * stride : (b + 1) * stride], cnt[b], c, inv)
        rl = rice_section(gaps, kr, body[bp:])
        bp += rl
        head[hp] = kr * 2 + inv
        hp = put_varint(head, hp + 1, rl)
    if apart and bp:  # the states carry the Rice sections' first bytes (left out of the block below)
        xl = bp
        xsec = np.zeros(xl + 2, np.uint8)
        xsec[:xl] = body[:xl]
    # the sections' states, in order, carry the exception list's first bytes (2 a state): how many
    ends, freqs = nibble_runs(nib_b, cnt, cb)
    total = ends[-1] if ends.size else 0
    states = (WIDE_LANES if total >= WIDE_MIN else LANES) if total else 0
    for g in range(G):
        if nv[g]:
            states += WIDE_LANES if nv[g] >= WIDE_MIN else LANES
    held = min(xl, 2 * states)
    if apart and held:
        head[4] |= CARRIED
    ci = 0  # the next carrying state
    if nib_b.any():
        head[4] |= NIBBLES
        nib = np.empty(total + 64, np.uint8)
        r = 0
        for b in range(K):
            if not nib_b[b]:
                continue
            o0 = ends[r - 1] if r else 0
            if ranks:  # the portable scan listed the changed ranks: their bitmap
                bw = np.zeros(run_symbols(cnt[b]) // 16 + 1, np.uint64)
                for i in range(cb[b]):
                    rr = np.uint64(rk[b * cap + i])
                    bw[rr >> np.uint64(6)] |= ONE << (rr & np.uint64(63))
            else:
                bw = bmap[b * stride : (b + 1) * stride]
                if cnt[b] & 63:  # the bits past the bucket's end are zero (the scan's): made sure
                    bw[cnt[b] >> 6] &= (ONE << np.uint64(cnt[b] & 63)) - ONE
                bw[(cnt[b] + 63) >> 6 : run_symbols(cnt[b]) // 16] = ZERO
            if 2 * cb[b] > cnt[b]:  # its unchanged flags
                complement(bw, 0, cnt[b])
            nibbles_of(bw, cnt[b], nib, o0)
            r += 1
        S = WIDE_LANES if total >= WIDE_MIN else LANES
        if S == WIDE_LANES:
            head[4] |= WIDE
        rl = rans_encode_runs(nib, ends, freqs, S, body[bp:], vec, _carried(xsec, held, ci, S))
        ci += S
        bp += rl
        hp = put_varint(head, hp, rl)
    freq = np.zeros(NSYM, np.int64)
    for g in range(G):  # values: per group, rANS of the symbols in position order, then escapes
        m = nv[g]
        hp = put_varint(head, hp, m)
        if m == 0:
            continue
        mine = esc[escg[g] : escg[g + 1]].astype(np.uint64)
        eh = eg_order(mine, 0)[0] if mine.size else 0  # 0..ESC_ORDER
        el = eg_section(mine, eh, mine, 0, body[bp:])
        normalise(counts[g], freq)
        nsym = 0
        for s in range(NSYM):
            if freq[s]:
                nsym = s + 1
        head[hp] = nsym | eh << 5
        hp += 1
        for s in range(nsym):
            hp = put_varint(head, hp, freq[s])
        bp += el
        hp = put_varint(head, hp, el)
        if m >= WIDE_MIN:
            rl = rans_encode_wide_carrying(syms[g], m, freq, body[bp:], vec, _carried(xsec, held, ci, WIDE_LANES))
            ci += WIDE_LANES
        else:
            rl = rans_encode_carrying(syms[g], m, freq, body[bp:], _carried(xsec, held, ci, LANES))
            ci += LANES
        bp += rl
        hp = put_varint(head, hp, rl)
    skip = 0  # the block leaves out the carried Rice bytes
    if apart:
        skip = held
    else:
        body[bp : bp + xl - held] = xsec[held:xl]  # the exception list's bytes no state carries
        bp += xl - held
    out = np.empty(hp + bp - skip, np.uint8)
    out[:hp] = head[:hp]
    out[hp:] = body[skip:bp]
    return out, k, rev


@njit(nogil=True)
def _carried(xsec, held, ci, S):
    """What the ``S`` states of a section from the block's state ``ci`` carry: bytes ``2 i`` and
    ``2 i + 1`` of the exception list's bit section for its state ``i``, the first ``held`` bytes
    (a byte past them is 0)."""
    carry = np.zeros(S, np.uint32)
    for q in range(S):
        i = 2 * (ci + q)
        if i < held:
            carry[q] = np.uint32(xsec[i]) | (np.uint32(xsec[i + 1]) << np.uint32(8) if i + 1 < held else np.uint32(0))
    return carry


FEW_SYMBOLS = 512
""":func:`_symbol_counts` counts a group of fewer symbols one by one."""


@njit(nogil=True)
def _symbol_counts(syms, m, hist, counts):
    """``counts``: how often each of the NSYM symbols occurs in ``syms[:m]`` (a row padded to a
    multiple of 8 bytes; ``hist``: scratch of 4 * NSYM^2). Counted by pairs, a 16-bit load each, into
    four histograms of pairs in turn (consecutive equal pairs do not wait on one count), then
    summed per symbol (either byte order gives the same sums): one count per two symbols (the
    counting alone, over the small model's pair 0 at lr 1e-5: 1.5 ms, against 2.3 with four
    histograms of single symbols, which were 1.5-2.7x faster than one). Under :data:`FEW_SYMBOLS`
    one by one: the histograms' 1024 counts cost more than the symbols."""
    counts[:] = 0
    if m < FEW_SYMBOLS:
        for j in range(m):
            counts[syms[j]] += 1
        return
    hist[:] = 0
    w = syms[: m - m % 8].view(np.uint16)
    n = w.size
    lo, hi, sq = np.uint16(NSYM - 1), np.uint16((NSYM - 1) << 4), NSYM * NSYM
    for j in range(0, n, 4):
        a, b, c, d = w[j], w[j + 1], w[j + 2], w[j + 3]  # two symbols each: the first in the low byte
        hist[(a & lo) | ((a >> 4) & hi)] += 1
        hist[sq + ((b & lo) | ((b >> 4) & hi))] += 1
        hist[2 * sq + ((c & lo) | ((c >> 4) & hi))] += 1
        hist[3 * sq + ((d & lo) | ((d >> 4) & hi))] += 1
    for i in range(4 * sq):
        counts[i % NSYM] += hist[i]
        counts[(i // NSYM) % NSYM] += hist[i]
    for j in range(m - m % 8, m):
        counts[syms[j]] += 1


@njit(nogil=True)
def _derived(u, shift, fmask):
    """The exponent an element most likely held before a change moved it across an exponent
    boundary to ``u``: one below ``u``'s if the top bit of its mantissa is clear (it has just
    crossed upward), else one above; -1 past the field's ends. Right for every change of fewer
    than half an exponent's step (64 units in BF16) that keeps the sign bit (not, say, +0 to the
    NaN one unit below it). :meth:`Parsed.old_exponents` is its reader."""
    x = (np.int64(u) >> shift) & fmask
    x += 1 if (np.int64(u) >> (shift - 1)) & 1 else -1
    return x if 0 <= x <= fmask else -1


@njit(nogil=True)
def _limits(thr, vthr, shift, tmpl):
    """Bucket and group limits on an element with its sign bit cleared (``tmpl``'s dtype): each
    threshold's exponent shifted into place (below the sign bit, as :func:`simd.below_mask64`
    needs). Unused slots hold the sign bit and are never read: a kernel compares with the first K-1
    and G-1 only (the vector compare is signed, so that limit would be below every value)."""
    top = 1 << (8 * tmpl.itemsize - 1)
    lim = np.full(MAX_K, top, tmpl.dtype)
    vlim = np.full(MAX_G, top, tmpl.dtype)
    for t in range(thr.size):
        lim[t] = thr[t] << shift
    for t in range(vthr.size):
        vlim[t] = vthr[t] << shift
    return lim, vlim


@njit(nogil=True)
def _masks(tmpl, shift, fmask):
    """The sign bit's complement and the exponent field, of ``tmpl``'s dtype."""
    m = np.empty(2, tmpl.dtype)
    m[0] = (1 << (8 * tmpl.itemsize - 1)) - 1
    m[1] = fmask << shift
    return m[0], m[1]


# The encoder's state between its pass and the rest of the block (int64): each bucket's bit
# accumulator (its bits), bit count and words written (the bitmaps of the scan with pext), or its members
# and its changes listed (the portable scan's ranks); each group's change count; the exceptions.
E_ACC, E_NACC, E_WPOS, E_NV, E_NES = 0, MAX_K, 2 * MAX_K, 3 * MAX_K, 3 * MAX_K + MAX_G
E_MEMB, E_NCH = E_ACC, E_NACC
E_LEN = E_NES + 1


@njit(nogil=True)
def _layout(n, K, itemsize):
    """Where the encoder's arrays for a block of ``n`` elements and K buckets start in its scratch
    (bytes, each 64-byte aligned), and their end: each bucket's changed flags over its ranks
    (uint64 words, K * ``n // 64 + 4``: the scan with ``pext``); the zigzag codes of each group's changes,
    in order (MAX_G rows of n + 64); the changes that move their element to another bucket or
    group (n + 1 int64); each bucket's changed ranks (uint32, K rows of n + 64: the portable scan)."""
    sizes = (8 * K * (n // 64 + 4), MAX_G * (n + 64) * itemsize, 8 * (n + 1), 4 * K * (n + 64))
    s0 = 0
    s1 = s0 + (sizes[0] + 63) // 64 * 64
    s2 = s1 + (sizes[1] + 63) // 64 * 64
    s3 = s2 + (sizes[2] + 63) // 64 * 64
    return s0, s1, s2, s3, s3 + sizes[3]


@njit(nogil=True)
def _views(raw, tmpl, K):
    """The encoder's arrays in its scratch (:func:`_layout`): bitmaps, zigzag codes (MAX_G rows),
    exceptions, the bitmaps' stride per bucket, ranks, and the ranks' stride per bucket."""
    n = tmpl.size
    s0, s1, s2, s3, end = _layout(n, K, tmpl.itemsize)
    vals = raw[s1 : s1 + MAX_G * (n + 64) * tmpl.itemsize].view(tmpl.dtype).reshape(MAX_G, n + 64)
    exc = raw[s2 : s2 + 8 * (n + 1)].view(np.int64)
    return raw[s0:s1].view(np.uint64), vals, exc, n // 64 + 4, raw[s3:end].view(np.uint32), n + 64


class _Scratch(threading.local):
    """Each thread's buffers for the encoder's pass, kept from block to block. A fresh array this
    large is mapped anew, and each of its pages costs a fault when first written: on the machine
    the benchmarks ran on (2.5 us a fault) the scan of the 2.03 GiB pair's 4 MiB tensors took 1.6-1.7x
    as long with fresh arrays. A thread keeps what its largest block needed: 32.5 bytes of address
    space per BF16 element (40.5 per F32), of which what the scan wrote is resident: the bitmaps'
    eighth to half a byte an element (the scan with ``pext``) or 4 bytes a change (the portable
    scan's ranks), and the changes' codes and exceptions."""

    def __init__(self) -> None:
        self.raw = np.empty(0, np.uint8)  # 64-byte aligned
        self.st = np.zeros(E_LEN, np.int64)

    def take(self, n: int, K: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
        """This thread's scratch for a block of ``n`` elements and K buckets (uninitialised; the
        pass makes its arrays in it, :func:`_views`), and its state array."""
        end = _layout(n, K, itemsize)[4]
        if self.raw.size < end:  # grown to what this block needs (in MiB), plus the alignment
            raw = np.empty(-(-end // (1 << 20)) * (1 << 20) + 64, np.uint8)
            self.raw = raw[(-raw.ctypes.data) % 64 :]  # ctypes costs microseconds: once
        return self.raw, self.st


_SCRATCH = _Scratch()


def encode_block(
    dtype: str,
    old: np.ndarray,
    new: np.ndarray,
    k: int = BUCKETS,
    native: int = NATIVE,
    split=None,
    nibbles: bool = True,
    dense: bool | None = None,
) -> tuple[bytes, int]:
    """The block coding ``new`` against ``old`` (unsigned views of ``dtype``'s width), and how many
    elements changed, with its exception list in the block (the layout before :data:`APART`; what
    a payload holds is :func:`encode_block_apart`'s); at most ``k`` buckets. ``split``: (bucket
    thresholds, group thresholds) to use instead of the planned ones (tests and the warm-up reach
    every pass with it). ``nibbles``: dense buckets' positions as nibbles
    (:mod:`weightsync.codec.nibbles`), else every bucket Rice-coded (tests). ``dense``: whether the
    scan takes every word as changed (the same bytes either way; by default the plan's choice, or
    not with ``split``)."""
    data, changed, _ = _encode_block(dtype, old, new, k, native, split, nibbles, dense, False)
    return data, changed


def encode_block_apart(
    dtype: str,
    old: np.ndarray,
    new: np.ndarray,
    k: int = BUCKETS,
    native: int = NATIVE,
    split=None,
    nibbles: bool = True,
    dense: bool | None = None,
) -> tuple[bytes, bytes, int]:
    """The block coding ``new`` against ``old`` with its exception list apart (:data:`APART`), that
    list (the block's reverse part: empty when it has no exception) and how many elements changed;
    the arguments as :func:`encode_block`'s. A forward decode reads the block alone; a backward one
    the block and its reverse part (:func:`decode_block_backward`)."""
    data, changed, rev = _encode_block(dtype, old, new, k, native, split, nibbles, dense, True)
    return data, rev, changed


def _encode_block(dtype, old, new, k, native, split, nibbles, dense, apart) -> tuple[bytes, int, bytes]:
    if old.size > MAX_BLOCK:  # the format's limit (docs/FORMAT.md): ranks and counts are 32-bit
        raise ValueError(f"ans: a block holds at most 2^31 elements, not {old.size}")
    if old.dtype.itemsize not in WIDTHS:  # the parser refuses 8-byte escapes (check 14)
        raise ValueError(f"ans: elements of 1, 2 or 4 bytes, not {old.dtype.itemsize} ({dtype})")
    old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)  # the kernels load 64 elements at a time
    if old.shape != new.shape or old.dtype != new.dtype:  # the kernels read both up to old's end
        raise ValueError(f"ans: old {old.dtype}{list(old.shape)} and new {new.dtype}{list(new.shape)} differ")
    shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
    width = 8 * old.dtype.itemsize
    scan = native = _runnable(native, "scan")  # refused whichever scan the block would take
    if split is None:
        thr, vthr, planned, est = _plan(old, new, shift, bits, k, width)
        dense = planned if dense is None else dense
        scan = _scan_kind(native, est, old.size)
    else:  # as the parser accepts them: the kernels' compares assume it (a limit past the sign bit, or
        # thresholds out of order, would make the portable scan and the native one disagree)
        thr, vthr = (np.asarray(t, np.int64) for t in split)
        for t in (thr, vthr):
            if t.size and (t[0] < 1 or t[-1] >= 1 << bits or np.any(np.diff(t) < 0)):
                raise ValueError(f"ans: thresholds {t.tolist()} are not ascending in 1..{(1 << bits) - 1}")
    K, G = thr.size + 1, vthr.size + 1
    raw, st = _SCRATCH.take(old.size, K, old.dtype.itemsize)
    # two calls, arrays made in numba: Python-side glue cost about 25 us a block (the trajectory's 127
    # tensors: 5% of their encode)
    _kernel("scan", K, G, scan)(old, new, thr, vthr, shift, bits, raw, st, bool(dense))
    data, changed, rev = _encode(
        old, new, shift, bits, width, thr, vthr, raw, st, not uses_bmi2(scan), uses_vectors(scan), nibbles, apart
    )
    return data.tobytes(), changed, rev.tobytes()


# --- decoding -------------------------------------------------------------------------------------


# The layout of a parsed block's tables (int64): the bucket and group counts, the exceptions, what
# the caller's arrays must hold (after a -1), then the tables at fixed places.
H_K, H_G, H_NE, H_NEED_EXC, H_NEED_WORDS, H_NEED_DIFFS, H_DERIVED = range(7)
H_THR = 8  # bucket thresholds (K - 1)
H_VTHR = H_THR + MAX_K - 1  # group thresholds (G - 1)
H_NB = H_VTHR + MAX_G - 1  # each bucket's size (K)
H_WBASE = H_NB + MAX_K  # each bucket's first word in the bitmaps, and their end (K + 1)
H_DSTART = H_WBASE + MAX_K + 1  # each group's first difference, and their end (G + 1)
H_LEN = H_DSTART + MAX_G + 1

# The pass's state (int64): each bucket's next bit and end in the bitmaps, each group's next and end
# difference, at fixed places whatever the bucket and group counts.
S_OFF, S_END, S_DPTR, S_DEND = 0, MAX_K, 2 * MAX_K, 2 * MAX_K + MAX_G
S_LEN = 2 * MAX_K + 2 * MAX_G
U64, I64, U8 = np.dtype(np.uint64), np.dtype(np.int64), np.dtype(np.uint8)


@njit(nogil=True)
def _parse_into(data, n, width_bits, hdr, words, diffs, exc, exb, vec):
    """Parse a block of ``n`` elements into the caller's arrays: its tables into ``hdr`` (the ``H_``
    layout), the bitmaps into ``words``, the differences into ``diffs``, the exceptions' positions
    and old bucket and group into ``exc`` and ``exb``. Returns 0, the failed check's number, or -1
    when one of the arrays is too small for this block: ``hdr[H_NEED_EXC]``, ``hdr[H_NEED_WORDS]``
    and ``hdr[H_NEED_DIFFS]`` then say how large each must be (the caller grows it and parses again).
    ``vec``: wide rANS sections by vector steps (:mod:`weightsync.codec.lanes`; the same result)."""
    hdr[H_NEED_EXC] = hdr[H_NEED_WORDS] = hdr[H_NEED_DIFFS] = 0
    if data.size < 8:
        return 1
    c = np.int64(data[0]) | np.int64(data[1]) << 8 | np.int64(data[2]) << 16 | np.int64(data[3]) << 24
    K = np.int64(data[4]) & ~(EXC_CODED | WIDE | NIBBLES | CARRIED | APART)
    coded = (np.int64(data[4]) & EXC_CODED) != 0
    apart = (np.int64(data[4]) & APART) != 0
    wide = (np.int64(data[4]) & WIDE) != 0
    nibbles = (np.int64(data[4]) & NIBBLES) != 0
    carried = (np.int64(data[4]) & CARRIED) != 0
    bits = np.int64(data[6])
    G = np.int64(data[7])
    if not (1 <= K <= MAX_K and 1 <= G <= MAX_G and 0 < c <= n and bits <= 8) or (bits == 0 and K + G != 2):
        return 2
    if (carried and not coded and not apart) or (apart and coded):  # a coded list's bit section is carried
        return 2  # where the block holds one, else (apart) its Rice sections' first bytes
    pos = 8
    if data.size < pos + K + G - 2:
        return 3
    hdr[H_K], hdr[H_G] = K, G
    thr = hdr[H_THR : H_THR + K - 1]
    vthr = hdr[H_VTHR : H_VTHR + G - 1]
    for t in range(K + G - 2):
        x = np.int64(data[pos + t])
        first = t == 0 or t == K - 1
        if t < K - 1:
            thr[t] = x
        else:
            vthr[t - K + 1] = x
        if x < 1 or x >= (1 << bits) or (not first and x < data[pos + t - 1]):
            return 4
    pos += K + G - 2
    ne = 0  # apart: no list here (a backward decode reads it from the reverse part)
    if not apart:
        ne, pos = get_varint(data, pos)
    if ne < 0 or ne > c or (coded and (ne == 0 or pos >= data.size or data[pos] & ~EXC_DERIVED > EXC_ORDER)):
        return 5
    hdr[H_NE] = ne
    hdr[H_DERIVED] = coded and (data[pos] & EXC_DERIVED) != 0
    if hdr[H_DERIVED] and bits == 0:  # no exponent to derive from
        return 5
    if exc.size < ne or exb.size < ne:
        hdr[H_NEED_EXC] = ne
        return -1
    p = -1
    hx = tb = xl = 0
    if coded:  # Exp-Golomb codes of the gaps, each followed by 4 bits: old bucket << 2 | old group,
        # or by nothing when those are derived from the new values (the backward decode's business)
        hx = np.int64(data[pos]) & ~EXC_DERIVED
        tb = 0 if hdr[H_DERIVED] else 4
        xl, pos = get_varint(data, pos + 1)
        if xl < 0 or (not carried and pos + xl > data.size):
            return 6
        if not carried:  # here; else read after the sections, whose states carry its first bytes
            bad = _exception_list(padded_words(data, pos, xl), xl, ne, n, hx, tb, K, G, exc, exb)
            if bad:
                return bad
            pos += xl
    else:  # varint gaps, then a byte each: old bucket << 4 | old group
        for j in range(ne):
            g, pos = get_varint(data, pos)
            if g < 0 or p + g + 1 >= n:
                return 6
            p += g + 1
            exc[j] = p
        if data.size < pos + ne:
            return 6
        for j in range(ne):
            exb[j] = data[pos + j]
            if (exb[j] >> 4) >= K or (exb[j] & 15) >= G:
                return 6
        pos += ne
    nb = hdr[H_NB : H_NB + K]
    cb = np.zeros(K, np.int64)
    kr = np.zeros(K, np.int64)
    inv = np.zeros(K, np.int64)
    blen = np.zeros(K, np.int64)
    nib_b = np.zeros(K, np.bool_)
    tot_n = 0
    for b in range(K):
        nb[b], pos = get_varint(data, pos)
        cb[b], pos = get_varint(data, pos)
        if nb[b] < 0 or cb[b] < 0 or cb[b] > nb[b]:
            return 7
        tot_n += nb[b]
        if cb[b] == 0:
            continue
        if pos >= data.size:
            return 7
        if nibbles and data[pos] == NIBBLE_CODE:  # its flags are in the nibble section
            nib_b[b] = True
            pos += 1
            continue
        kr[b] = data[pos] >> 1
        inv[b] = data[pos] & 1
        blen[b], pos = get_varint(data, pos + 1)
        if kr[b] > 30 or (inv[b] == 1) != (2 * cb[b] > nb[b]) or blen[b] < 0:
            return 8
    if tot_n != n or cb.sum() != c:
        return 9
    plen = 0
    if nibbles:  # the nibble section's length; the flag says there is one
        if not nib_b.any():
            return 8
        plen, pos = get_varint(data, pos)
        if plen < 0:
            return 8
    mg = np.zeros(G, np.int64)  # differences per group
    freq = np.zeros((G, NSYM), np.int64)
    order = np.zeros(G, np.int64)  # of the escape codes
    elen = np.zeros(G, np.int64)
    rlen = np.zeros(G, np.int64)
    for g in range(G):
        mg[g], pos = get_varint(data, pos)
        if mg[g] < 0 or mg[g] > c or (g == G - 1 and mg.sum() != c):
            return 10
        if mg[g] == 0:
            continue
        if pos >= data.size:
            return 10
        nsym = np.int64(data[pos]) & 31
        order[g] = np.int64(data[pos]) >> 5
        pos += 1
        if nsym < 1 or nsym > NSYM:
            return 10
        s = 0
        for q in range(nsym):
            freq[g, q], pos = get_varint(data, pos)
            if freq[g, q] < 0:
                return 10
            s += freq[g, q]
        elen[g], pos = get_varint(data, pos)
        rlen[g], pos = get_varint(data, pos)
        if s != PROB_ONE or elen[g] < 0 or rlen[g] < 0 or (order[g] > 0 and freq[g, NSYM - 1] == 0):
            return 10
    states = 0  # the sections' states, in order: with a carried list, they carry its first bytes
    nibble_states = 0
    ends, nf = nibble_runs(nib_b, nb, cb)
    total = ends[-1] if ends.size else 0
    if nibbles:
        nibble_states = WIDE_LANES if wide and total >= WIDE_MIN else LANES
        states += nibble_states
    for g in range(G):
        if mg[g]:
            states += WIDE_LANES if wide and mg[g] >= WIDE_MIN else LANES
    rice_at = pos
    if apart:  # the carried bytes are the Rice sections' first ones
        xl = blen.sum()
    held = min(xl, 2 * states) if carried else 0
    if apart and carried and held == 0:
        return 11
    tail = xl - held if carried and not apart else 0  # the list's bytes no state carries
    if pos + blen.sum() - (held if apart else 0) + plen + elen.sum() + rlen.sum() + tail != data.size:
        return 11
    carry = np.zeros(states, np.uint32)
    ci = 0
    # each bucket's bitmap starts at a word; the pass on a wrong base can run it up to CHECK
    # elements past its end before its next check sees it: that much spare
    wbase = hdr[H_WBASE : H_WBASE + K + 1]
    wbase[0] = 0
    spare = min(n, CHECK) + 128
    for b in range(K):
        wbase[b + 1] = wbase[b] + (nb[b] + spare + 63) // 64
    # the pass on a wrong base can run a group's differences up to CHECK past their end before its
    # next check sees it, and its expand-loads read up to 64 more: that much spare
    nd = c + min(n, CHECK) + 64
    if words.size < wbase[K] + 2 or diffs.size < nd:
        hdr[H_NEED_WORDS], hdr[H_NEED_DIFFS] = wbase[K] + 2, nd
        return -1
    words[: wbase[K] + 2] = 0
    if apart and carried:  # decoded once the states give their first bytes, below
        pos += blen.sum() - held
    else:
        bad = _rice_sections(data, pos, cb, nib_b, nb, inv, kr, blen, words, wbase)
        if bad:
            return bad
        pos += blen.sum()
    if nibbles:  # each nibble bucket's run, in bucket order, into its bitmap
        S = nibble_states
        nib = np.empty(total + 64, np.uint8)
        if rans_decode_runs(data, pos, plen, S, ends, nf, nib, vec, carry[ci : ci + S]):
            return 12
        ci += S
        r = 0
        for b in range(K):
            if nib_b[b]:
                o0 = ends[r - 1] if r else 0
                inv_b = 2 * cb[b] > nb[b]
                if pack_nibbles(nib, o0, ends[r] - o0, words, wbase[b], nb[b]) != (nb[b] - cb[b] if inv_b else cb[b]):
                    return 12
                if inv_b:  # the run held its unchanged flags
                    complement(words, wbase[b], nb[b])
                r += 1
        pos += plen
    dstart = hdr[H_DSTART : H_DSTART + G + 1]
    dstart[0] = 0
    zmax = (ONE << np.uint64(width_bits)) - ONE
    values = np.zeros(NSYM, diffs.dtype)  # symbol -> difference; the escape's 0 is filled in below
    for sym in range(NSYM - 1):
        z = np.uint64(sym + 1)
        values[sym] = (z >> ONE) ^ (ZERO - (z & ONE))
    for g in range(G):
        dstart[g + 1] = dstart[g] + mg[g]
        if mg[g] == 0:
            continue
        esec = padded_words(data, pos, elen[g])
        pos += elen[g]
        if wide and mg[g] >= WIDE_MIN:
            if rans_decode_wide_carried(
                data, pos, rlen[g], freq[g], values, diffs, dstart[g], mg[g], vec, carry[ci : ci + WIDE_LANES]
            ):
                return 13
            ci += WIDE_LANES
        else:
            if rans_decode_carried(
                data, pos, rlen[g], freq[g], values, diffs, dstart[g], mg[g], carry[ci : ci + LANES]
            ):
                return 13
            ci += LANES
        pos += rlen[g]
        bp = 0
        if freq[g, NSYM - 1]:  # escapes left zero differences (no change has one): their codes, in order,
            # found 64 at a time (a test per difference mispredicted: 4% escape at lr 1e-5); the array has 64 spare
            for j in range(dstart[g], dstart[g + 1], 64):
                zs = zero_mask64(diffs, j)
                if dstart[g + 1] - j < 64:
                    zs &= (ONE << np.uint64(dstart[g + 1] - j)) - ONE
                while zs != ZERO:
                    at = j + np.int64(trailing_zeros(zs))
                    zs &= zs - ONE
                    v, bp = get_eg(esec, bp, 8 * elen[g], order[g])
                    if v < 0 or np.uint64(v) > zmax - np.uint64(NSYM):
                        return 14
                    z = np.uint64(v) + np.uint64(NSYM)
                    diffs[at] = (z >> ONE) ^ (ZERO - (z & ONE))
        if not clean_end(esec, bp, elen[g]):
            return 14
    # what the states carried: the exception list's first bytes (apart: the Rice sections'), 2 a
    # state, the rest here; a state past them ends at 2^16 (every state, without carried bytes)
    sec = np.zeros(xl + 2, np.uint8)
    for q in range(states):
        lo, hi = 2 * q, 2 * q + 1
        if (lo >= held and carry[q]) or (hi >= held and carry[q] >> U32(8)):
            return 13
        if lo < held:
            sec[lo] = carry[q] & U32(0xFF)
            sec[hi] = carry[q] >> U32(8)
    if apart and carried:
        sec[held:xl] = data[rice_at : rice_at + xl - held]
        return _rice_sections(sec, 0, cb, nib_b, nb, inv, kr, blen, words, wbase)
    if carried:
        sec[held:xl] = data[pos : pos + tail]
        bad = _exception_list(padded_words(sec, 0, xl), xl, ne, n, hx, tb, K, G, exc, exb)
        if bad:
            return bad
    return 0


@njit(nogil=True)
def _rice_sections(data, pos, cb, nib_b, nb, inv, kr, blen, words, wbase):
    """The Rice sections from ``pos`` in ``data``, in bucket order, into their buckets' bitmaps.
    Returns 0 or the failed check's number."""
    for b in range(cb.size):
        if cb[b] == 0 or nib_b[b]:
            continue
        ng = nb[b] - cb[b] if inv[b] else cb[b]
        bad = rice_decode(data, pos, blen[b], ng, kr[b], nb[b], inv[b], words, wbase[b])
        if bad:
            return bad
        pos += blen[b]
    return 0


@njit(nogil=True)
def _exception_list(sec, xl, ne, n, hx, tb, K, G, exc, exb):
    """The coded exception list (``xl`` bytes, as words: :func:`padded_words`) into ``exc`` and
    ``exb``: Exp-Golomb codes of order ``hx`` of the gaps, each followed by ``tb`` (4 or 0) bits, old
    bucket << 2 | old group. Returns 0 or 6."""
    p = -1
    bp = 0
    for j in range(ne):
        g, bp = get_eg(sec, bp, 8 * xl - tb, hx)
        if g < 0 or p + g + 1 >= n:
            return 6
        p += g + 1
        exc[j] = p
        t = np.int64(peek(sec, bp) & np.uint64(15)) if tb else 0
        bp += tb
        exb[j] = (t >> 2) << 4 | (t & 3)
        if (t >> 2) >= K or (t & 3) >= G:
            return 6
    return 0 if clean_end(sec, bp, xl) else 6


@njit(nogil=True)
def _parse(data, n, width_bits, tmpl, vec):
    """(status, K, bucket thresholds, group thresholds, bucket sizes, bitmaps, each bucket's first
    word, differences, each group's first difference, exception positions, their old bucket << 4 |
    group (0 when derived), whether they are derived from the new values), in arrays of their own;
    status 0 is success, else the failed check's number."""
    hdr = np.zeros(H_LEN, np.int64)
    words = np.zeros(0, np.uint64)
    diffs = tmpl[:0].copy()
    exc = np.zeros(0, np.int64)
    exb = np.zeros(0, np.uint8)
    status = _parse_into(data, n, width_bits, hdr, words, diffs, exc, exb, vec)
    while status == -1:  # sized from the tables, parsed again
        words = np.empty(max(words.size, hdr[H_NEED_WORDS]), np.uint64)
        diffs = np.empty(max(diffs.size, hdr[H_NEED_DIFFS]), tmpl.dtype)
        exc = np.empty(max(exc.size, hdr[H_NEED_EXC]), np.int64)
        exb = np.empty(exc.size, np.uint8)
        status = _parse_into(data, n, width_bits, hdr, words, diffs, exc, exb, vec)
    K, G, ne = hdr[H_K], hdr[H_G], hdr[H_NE]
    if status:
        K = G = ne = 1
    return (
        status,
        K,
        hdr[H_THR : H_THR + K - 1].copy(),
        hdr[H_VTHR : H_VTHR + G - 1].copy(),
        hdr[H_NB : H_NB + K].copy(),
        words,
        hdr[H_WBASE : H_WBASE + K + 1].copy(),
        diffs,
        hdr[H_DSTART : H_DSTART + G + 1].copy(),
        exc[:ne] if status == 0 else exc[:0],
        exb[:ne] if status == 0 else exb[:0],
        hdr[H_DERIVED] != 0,
    )


def _reverse_list(reverse, n: int, c: int, K: int, G: int, bits: int, what: str) -> tuple:
    """A block's reverse part (docs/FORMAT.md, "Reverse payloads"): the exceptions' positions, their
    old bucket << 4 | group (0 when derived) and whether those are derived, for a block of ``n``
    elements, ``c`` of them changed, with ``K`` buckets and ``G`` groups."""
    if not len(reverse):
        return np.zeros(0, np.int64), np.zeros(0, np.uint8), False
    data = read_only_bytes(memoryview(reverse))
    ne, pos = get_varint(data, 0)
    xl = data.size - pos - 1
    order = int(data[pos]) if xl >= 0 else 0
    # each code is at least a bit: a count past that is refused before anything is made for it
    if ne < 1 or ne > c or xl < 0 or ne > 8 * xl or (order & ~EXC_DERIVED) > EXC_ORDER:
        raise FormatError(f"{what}: bad ans reverse part (its count or order)")
    derived = (order & EXC_DERIVED) != 0
    if derived and bits == 0:
        raise FormatError(f"{what}: bad ans reverse part (derived without an exponent)")
    exc, exb = np.empty(ne, np.int64), np.empty(ne, np.uint8)
    sec = padded_words(data, pos + 1, xl)
    if _exception_list(sec, xl, ne, n, order & ~EXC_DERIVED, 0 if derived else 4, K, G, exc, exb):
        raise FormatError(f"{what}: bad ans reverse part (its list)")
    return exc, exb, derived


def _exponent_field(dtype: str, block: memoryview, what: str) -> tuple[int, int]:
    """``dtype``'s exponent field (shift, bits), which the block's header must name."""
    if len(block) < _HEAD:
        raise FormatError(f"{what}: truncated ans block")
    shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
    if block[5] != shift or block[6] != bits:
        raise FormatError(f"{what}: ans block's exponent field ({block[5]}, {block[6]}) is not {dtype}'s")
    return shift, bits


@njit(nogil=True)
def _pass_state(thr, vthr, shift, nb, wbase, dstart, lims, st):
    """The pass's limits and state from a parsed block's tables, into the caller's arrays: ``lims``
    (the elements' dtype), the bucket limits then the group limits from ``MAX_K`` on
    (:func:`_limits`); ``st`` (the ``S_`` layout), each bucket's next bit and end in the bitmaps,
    each group's next difference and end."""
    lim, vlim = _limits(thr, vthr, shift, lims)
    lims[:MAX_K] = lim
    lims[MAX_K : MAX_K + MAX_G] = vlim
    K, G = nb.size, dstart.size - 1
    for b in range(K):
        st[S_OFF + b] = wbase[b] * 64
        st[S_END + b] = wbase[b] * 64 + nb[b]
    for g in range(G):
        st[S_DPTR + g] = dstart[g]
        st[S_DEND + g] = dstart[g + 1]


@njit(nogil=True)
def _prepare(data, n, width_bits, shift, hdr, words, diffs, exc, exb, lims, st, vec):
    """Parse a block into the caller's arrays (:func:`_parse_into`) and set up its pass
    (:func:`_pass_state`), in one call: (status, K, G)."""
    status = _parse_into(data, n, width_bits, hdr, words, diffs, exc, exb, vec)
    K, G = hdr[H_K], hdr[H_G]
    if status == 0:
        thr, vthr = hdr[H_THR : H_THR + K - 1], hdr[H_VTHR : H_VTHR + G - 1]
        nb, wbase, dstart = hdr[H_NB : H_NB + K], hdr[H_WBASE : H_WBASE + K + 1], hdr[H_DSTART : H_DSTART + G + 1]
        _pass_state(thr, vthr, shift, nb, wbase, dstart, lims, st)
    return status, K, G


class _DecodeScratch(threading.local):
    """Each thread's arrays for parsing a block (:func:`_prepare`), kept from block to block: a
    parse into fresh arrays, returned to Python one by one, cost about 20 us a block, most of a
    small block's decode. Arrays larger than ``RETAIN`` bytes are made for the block and let go."""

    RETAIN = 4 << 20

    def __init__(self) -> None:
        self.hdr = np.zeros(H_LEN, np.int64)
        self.st = np.zeros(S_LEN, np.int64)
        self.kept: dict[tuple[str, np.dtype], np.ndarray] = {}
        self.last: dict[np.dtype, tuple] = {}  # what arrays() returns

    def arrays(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This thread's arrays for a block of ``dtype``, as they are (one call: a block's Python-side
        steps cost microseconds each), in :func:`_prepare`'s order: bitmaps, differences, exceptions,
        their contexts, limits."""
        a = self.last.get(dtype)
        if a is None:
            a = self.last[dtype] = (
                self.array("words", U64, 0),
                self.array("diffs", dtype, 0),
                self.array("exc", I64, 0),
                self.array("exb", U8, 0),
                self.array("lims", dtype, MAX_K + MAX_G),
            )
        return a

    def grow(self, dtype: np.dtype, hdr: np.ndarray, arrays: tuple) -> tuple:
        """``arrays`` (:meth:`arrays`' five) with those too small for the block whose tables are in
        ``hdr`` grown."""
        words, diffs, exc, exb, lims = arrays
        if exc.size < hdr[H_NEED_EXC]:
            exc, exb = self.array("exc", I64, hdr[H_NEED_EXC]), self.array("exb", U8, hdr[H_NEED_EXC])
        if words.size < hdr[H_NEED_WORDS]:
            words = self.array("words", U64, hdr[H_NEED_WORDS])
        if diffs.size < hdr[H_NEED_DIFFS]:
            diffs = self.array("diffs", dtype, hdr[H_NEED_DIFFS])
        self.last.clear()  # the next block takes what is kept (arrays above RETAIN are not)
        return words, diffs, exc, exb, lims

    def array(self, name: str, dtype: np.dtype, need: int) -> np.ndarray:
        """An array of at least ``need`` elements: this thread's, grown if it must be."""
        a = self.kept.get((name, dtype))
        if a is not None and a.size >= need:
            return a
        a = np.empty(max(need, 2 * (0 if a is None else a.size), 64), dtype)
        if a.nbytes <= self.RETAIN:
            self.kept[(name, dtype)] = a
        return a


_DSCRATCH = _DecodeScratch()


class Parsed:
    """A block's header and streams, decoded (:func:`_parse`): what the pass, the reference decoder
    and the backward decoder share. Raises :class:`FormatError` naming ``what`` for a block that
    does not parse, or whose exponent field is not ``dtype``'s."""

    def __init__(
        self, dtype: str, block: memoryview, n: int, dt: np.dtype, what: str, native: int = NATIVE, reverse=b""
    ) -> None:
        shift, bits = _exponent_field(dtype, block, what)
        got = _parse(read_only_bytes(block), n, 8 * dt.itemsize, np.zeros(1, dt), uses_vectors(native))
        status, self.K, self.thr, self.vthr, self.nb, self.words, self.wbase, self.diffs, self.dstart, exc, exb, d = got
        if status:
            raise FormatError(f"{what}: bad ans block (check {status} failed)")
        self.G = self.vthr.size + 1
        if block[4] & APART:  # the list is the block's reverse part (empty: no exception)
            exc, exb, d = _reverse_list(reverse, n, int(self.dstart[-1]), self.K, self.G, bits, what)
        elif len(reverse):
            raise FormatError(f"{what}: an ans block that holds its exception list has no reverse part")
        self.shift, self.fmask = shift, (1 << bits) - 1
        self.exc, self.exb = exc, exb  # positions whose bucket or group the change moved; old bucket << 4 | group
        self.derived = bool(d)  # the old buckets and groups are not listed: derived from the new values
        self.what = what

    def old_exponents(self, new: np.ndarray) -> np.ndarray:
        """An exponent of each exception's old bucket and group, given the block's result ``new``:
        derived from its new value (:func:`_derived`), or the smallest exponent of the listed pair."""
        if self.derived:
            u = new[self.exc].astype(np.int64)
            x = ((u >> self.shift) & self.fmask) + np.where((u >> (self.shift - 1)) & 1, 1, -1)
            if np.any((x < 0) | (x > self.fmask)):
                raise FormatError(f"{self.what}: ans block derives an exception's exponent past the field")
            return x
        blut, glut = self.luts()
        rep = np.full((MAX_K, MAX_G), -1, np.int64)  # the smallest exponent of each (bucket, group)
        for x in range(self.fmask, -1, -1):
            rep[blut[x], glut[x]] = x
        x = rep[self.exb >> 4, self.exb & 15]
        if np.any(x < 0):
            raise FormatError(f"{self.what}: ans block lists an exception in a bucket and group no exponent has")
        return x

    def luts(self) -> tuple[np.ndarray, np.ndarray]:
        """Bucket and value group by exponent value."""
        e = np.arange(self.fmask + 1)
        return np.searchsorted(self.thr, e, side="right"), np.searchsorted(self.vthr, e, side="right")

    def contexts(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each element's bucket and value group from its exponent."""
        blut, glut = self.luts()
        e = (values.astype(np.int64) >> self.shift) & self.fmask
        return blut[e], glut[e]

    def changes(self, buckets: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions and differences given each element's bucket and group, by prefix sums and
        gathers (a GPU's steps): an element's rank in its bucket is a prefix sum of membership, its
        changed flag a gather from the bucket's bitmap, the index of its difference a prefix sum of
        the changed flags within its value group."""
        changed = np.zeros(buckets.size, bool)
        for b in range(self.K):
            member = buckets == b
            if np.count_nonzero(member) != self.nb[b]:
                raise FormatError(f"{self.what}: ans block's bucket sizes do not match its base")
            bit = self.wbase[b] * 64 + np.cumsum(member)[member] - 1
            changed[member] = (self.words[bit >> 6] >> (bit & 63).astype(np.uint64)) & ONE != 0
        idx = np.flatnonzero(changed)
        group = groups[idx]
        didx = np.empty(idx.size, np.int64)
        for g in range(self.G):
            sel = group == g
            if np.count_nonzero(sel) != self.dstart[g + 1] - self.dstart[g]:
                raise FormatError(f"{self.what}: ans block's value groups do not match its base")
            didx[sel] = self.dstart[g] + np.cumsum(sel)[sel] - 1
        return idx, self.diffs[didx]


def decode_block(
    dtype: str, block: memoryview, old: np.ndarray, out: np.ndarray, what: str, hasher=None, native: int = NATIVE
) -> None:
    """Decode ``block`` against ``old`` into ``out`` (may be ``old``), feeding ``hasher`` the result:
    a block of up to :data:`HASH_WHOLE` elements in one pass then hashed, a larger one slice by slice
    while each is in cache."""
    if out.shape != old.shape or out.dtype != old.dtype:
        raise ValueError(f"{what}: out is {out.dtype}{out.shape}, not {old.dtype}{old.shape} like the base")
    if not (old.flags.c_contiguous and out.flags.c_contiguous):
        _through_contiguous(decode_block, dtype, block, old, out, what, hasher, native)
        return
    native = kind_of(native)  # refused even where no kernel runs
    if len(block) == 0:
        copy(old, out, hasher)
        return
    shift, _ = _exponent_field(dtype, block, what)
    sc, dt, n = _DSCRATCH, old.dtype, old.size
    data, hdr, st = read_only_bytes(block), sc.hdr, sc.st
    arrays = sc.arrays(dt)
    while True:  # this thread's arrays; one too small is grown to what the block's tables say
        status, K, G = _prepare(data, n, 8 * dt.itemsize, shift, hdr, *arrays, st, uses_vectors(native))
        if status != -1:
            break
        arrays = sc.grow(dt, hdr, arrays)
    words, diffs, _, _, lims = arrays
    if status:
        raise FormatError(f"{what}: bad ans block (check {status} failed)")
    _pass_over(K, G, native, old, out, lims, st, words, diffs, hasher, what)


def _through_contiguous(
    decode, dtype: str, block: memoryview, src: np.ndarray, out: np.ndarray, what: str, hasher, native
):
    """``decode`` of strided ``src`` or ``out`` (a view with a step) through contiguous arrays: the
    kernels load and store 64 elements at a time from an array's first element on, which for a
    strided view are other elements (or, reversed, memory past its buffer). ``out`` may be ``src``;
    it is written only once the block has decoded."""
    tmp = np.empty(src.shape, src.dtype)
    decode(dtype, block, np.ascontiguousarray(src), tmp, what, hasher, native)
    out[...] = tmp


def _run_pass(p: Parsed, src: np.ndarray, out: np.ndarray, diffs: np.ndarray, hasher, native: int) -> None:
    """``out`` = ``src`` plus ``diffs`` at the changes the block's bitmaps place by ``src``'s contexts."""
    lims, st = np.empty(MAX_K + MAX_G, src.dtype), np.empty(S_LEN, np.int64)
    _pass_state(p.thr, p.vthr, p.shift, p.nb, p.wbase, p.dstart, lims, st)
    _pass_over(p.K, p.G, native, src, out, lims, st, p.words, diffs, hasher, p.what)


def _pass_over(K: int, G: int, native: int, src, out, lims, st, words, diffs, hasher, what: str) -> None:
    """Run the pass over every element and hash the result: in one call, then hashed (from cache),
    or slice by slice, each hashed while it is in cache, for a block larger than ``HASH_WHOLE``. A
    hasher whose state the kernel can feed (:func:`weightsync.codec.hashing.native_state`) is fed
    by the kernel itself, in the same call."""
    n = src.size
    chunk = n if hasher is None or n <= HASH_WHOLE else SLICE
    state = hashing.native_state(hasher)
    if state:
        status = _hashed_pass(K, G, native)(
            out, src, 0, n, lims, st, words, diffs, hashing.UPDATE, state, max(chunk, 1)
        )
        if status == 2:
            raise RuntimeError(f"{what}: {hashing.FEED_FAILED}")
        if status:
            raise FormatError(f"{what}: ans block's bucket sizes do not match its base")
        return
    run = _kernel("pass", K, G, native)
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        if run(out, src, a, e, lims, st, words, diffs):
            raise FormatError(f"{what}: ans block's bucket sizes do not match its base")
        if hasher is not None:
            hasher.update(out[a:e])


def decode_block_backward(
    dtype: str,
    block: memoryview,
    new: np.ndarray,
    out: np.ndarray,
    what: str,
    hasher=None,
    native: int = NATIVE,
    reverse=b"",
) -> None:
    """Write into ``out`` (may be ``new``) the base ``block`` was coded against, from its result
    ``new``, by the forward pass: its contexts are ``new``'s but at the listed exceptions, whose
    exponent field is set to one in their old bucket and group; the differences are negated; the
    exceptions, whose values the pass took from that modified copy, are corrected after. Refuses a
    ``new`` whose rebuilt base would not have the contexts the pass used. ``reverse``: the block's
    reverse part, for a block whose list is apart (:func:`encode_block_apart`)."""
    if out.shape != new.shape or out.dtype != new.dtype:
        raise ValueError(f"{what}: out is {out.dtype}{out.shape}, not {new.dtype}{new.shape} like the result")
    if not (new.flags.c_contiguous and out.flags.c_contiguous):
        decode = partial(decode_block_backward, reverse=reverse)
        _through_contiguous(decode, dtype, block, new, out, what, hasher, native)
        return
    native = kind_of(native)  # refused even where no kernel runs
    if len(block) == 0:
        if len(reverse):
            raise FormatError(f"{what}: an empty ans block has no reverse part")
        copy(new, out, hasher)
        return
    p = Parsed(dtype, block, new.size, new.dtype, what, native, reverse)
    ctx = new.copy()
    exc = p.exc
    field = new.dtype.type(p.fmask << p.shift)
    blut, glut = p.luts()
    if exc.size:
        x = p.old_exponents(new)
        ctx[exc] = (ctx[exc] & ~field) | (x << p.shift).astype(new.dtype)
    new_exc = new[exc]  # a copy (fancy indexing): ``out`` may be ``new``
    diffs = np.zeros_like(p.diffs)
    np.subtract(diffs, p.diffs, out=diffs)  # negated, wrapping
    _run_pass(p, ctx, out, diffs, None, native)
    if exc.size:  # the pass wrote ctx - d there
        out[exc] = new_exc - ctx[exc] + out[exc]
    moved = np.flatnonzero((out ^ ctx) & field)  # each must keep the context the pass used
    e_out = (out[moved].astype(np.int64) >> p.shift) & p.fmask
    e_ctx = (ctx[moved].astype(np.int64) >> p.shift) & p.fmask
    if np.any((blut[e_out] != blut[e_ctx]) | (glut[e_out] != glut[e_ctx])):
        raise FormatError(f"{what}: ans block does not code a change to these elements")
    if hasher is not None:
        hasher.update(out)


def decode_reference(dtype: str, block: bytes | memoryview, old: np.ndarray, what: str = "block") -> np.ndarray:
    """The block decoded against ``old`` by prefix sums and gathers only (numpy): the reference a GPU
    kernel is tested against, and the fast pass too."""
    if len(block) == 0:
        return old.copy()
    p = Parsed(dtype, memoryview(block), old.size, old.dtype, what)
    idx, d = p.changes(*p.contexts(old))
    out = old.copy()
    out[idx] = old[idx] + d
    return out


def decode_backward(
    dtype: str, block: bytes | memoryview, new: np.ndarray, what: str = "block", reverse=b""
) -> np.ndarray:
    """The base ``block`` was coded against, from its result ``new``, by prefix sums and gathers
    (numpy; the reference of :func:`decode_block_backward`): each element's bucket and group from
    its new exponent but for the listed exceptions, then the changes subtracted. Refuses a ``new``
    whose rebuilt base would not have had those buckets and groups. ``reverse`` as
    :func:`decode_block_backward`'s."""
    if len(block) == 0:
        if len(reverse):
            raise FormatError(f"{what}: an empty ans block has no reverse part")
        return new.copy()
    p = Parsed(dtype, memoryview(block), new.size, new.dtype, what, reverse=reverse)
    buckets, groups = p.contexts(new)
    if p.exc.size:
        blut, glut = p.luts()
        x = p.old_exponents(new)
        buckets[p.exc], groups[p.exc] = blut[x], glut[x]
    idx, d = p.changes(buckets, groups)
    old = new.copy()
    old[idx] = new[idx] - d
    ob, og = p.contexts(old)  # every element: an exception that did not change keeps its bucket and group too
    if np.any((ob != buckets) | (og != groups)):
        raise FormatError(f"{what}: ans block does not code a change to these elements")
    return old


# --- the codec ------------------------------------------------------------------------------------
@register
class Ans(Codec):
    """``ans``: positions as Rice-coded rank gaps per bucket of the old exponent, values rANS-coded
    per group of the old exponent; decoded by one vector pass; invertible."""

    id = 5
    name = "ans"
    invertible = True
    apart = True

    def supports(self, dtype: str) -> bool:
        return ITEMSIZE.get(dtype) in WIDTHS

    def encode(self, dtype, old, new, config):
        return encode_block(dtype, old, new)

    def decode(self, dtype, block, old, out, what, hasher=None):
        decode_block(dtype, block, old, out, what, hasher)

    def encode_apart(self, dtype, old, new, config):
        return encode_block_apart(dtype, old, new)

    def decode_backward(self, dtype, block, new, out, what, hasher=None, reverse=b""):
        decode_block_backward(dtype, block, new, out, what, hasher, reverse=reverse)


def warm_up_steps() -> list[tuple[str, int, int]]:
    """The pieces of :func:`warm_up`, commonest first: ``(dtype, buckets, groups)`` for 1-, 2- and
    4-byte elements, each a pass and a scan (13 of each). Each piece compiles on its own, so that
    ``python -m weightsync.codec.jit --jobs N`` can spread them over processes."""
    steps = []
    for dtype in ("BF16", "F32", "U8"):  # the commonest first: a delta meanwhile waits for fewer
        bits = EXPONENT_FIELD.get(dtype, (0, 0))[1]
        steps += [(dtype, K, G) for K in ((1, MAX_K) if bits else (1,)) for G in ((1, 2, MAX_G) if bits else (1,))]
    return steps


def warm_up_step(dtype: str, K: int, G: int) -> None:
    """One piece of :func:`warm_up`: a block of ``dtype`` with ``K`` buckets and ``G`` value groups
    encoded, decoded forward (with and without a hasher) and backward."""
    rng = np.random.default_rng(0)
    view = UINT_VIEW[ITEMSIZE[dtype]]
    bits = EXPONENT_FIELD.get(dtype, (0, 0))[1]
    old = rng.integers(0, 1 << (8 * view.itemsize - 1), 4096, dtype=np.uint64).astype(view)
    new = old.copy()
    new[::7] += view.type(1)
    split = (np.arange(1, K) * ((1 << bits) // K), np.arange(1, G) * ((1 << bits) // G))
    shift = EXPONENT_FIELD.get(dtype, (0, 0))[0]
    for i, t in enumerate(np.concatenate(split)):  # a change across each threshold: an exception each
        old[3 + i] = view.type((int(t) - 1) << shift | ((1 << shift) - 1))
        new[3 + i] = old[3 + i] + view.type(1)
    block, rev, _ = encode_block_apart(dtype, old, new, split=split)  # as payloads hold them
    if NATIVE == BMI2 and bits:  # and the portable scan it takes for sparse sampled blocks (:func:`_scan_kind`)
        encode_block_apart(dtype, old, new, split=split, native=PORTABLE)
    out, back, fed = np.empty_like(old), np.empty_like(old), np.empty_like(old)
    decode_block(dtype, memoryview(block), old, out, "warm-up")
    decode_block(dtype, memoryview(block), old, fed, "warm-up", hashing.hasher())  # the pass that hashes
    decode_block_backward(dtype, memoryview(block), new, back, "warm-up", reverse=rev)  # the list's reader too
    if not (np.array_equal(out, new) and np.array_equal(fed, new) and np.array_equal(back, old)):
        raise AssertionError(f"ans warm-up: {dtype} with {K} buckets and {G} groups did not round-trip")


def warm_up() -> None:
    """Compile (or load from numba's cache) the pass and the scan of every bucket and group count the
    encoder uses (:func:`_padded`), for 1-, 2- and 4-byte elements (:func:`warm_up_steps`): most of
    the codecs' CPU time with a cold cache (:func:`weightsync.codec.payload.warm_up`). Blocks from
    another encoder may need another pass: it compiles on first use."""
    for step in warm_up_steps():
        warm_up_step(*step)
