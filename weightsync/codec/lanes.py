"""Wide rANS sections of codec ``ans`` (docs/FORMAT.md, "ans"): the static rANS coder of
:mod:`weightsync.codec.entropy` with :data:`WIDE_LANES` states instead of 4, coded 16 lanes at a time
by vector instructions.

A 4-state coder is bound by its instructions: about 19 a symbol, 1.7-1.9 ns on an AMD Zen 4, with
the Rice codes half of the codec's time per change at lr 1e-5 (research/issue18-ctx-codec,
"Session 38"). With 32 states
one step of 16 lanes takes, decoding, a compare of each slot with the 15 symbol starts (the symbol
is the count), a permute each for its frequency, start and value, a multiply, and an expand-load of
the words the lanes that renormalise read, in lane order; encoding, a permute each for the bound,
frequency and start, a double-precision division (exact for states below 2^32), and a compress of
the words the lanes shed. Two such steps are independent but for the word position, so the
states' chains overlap. The same layout suits a GPU: a lane a thread, the words a warp's ballot.

Each state costs 4 bytes at the section's head, so only groups of at least :data:`WIDE_MIN` symbols
are wide: their 112 extra bytes are at most 1.6% of such a section at lr 1e-5's 1.7 bits a symbol,
0.22% of the small model's step there (docs/DESIGN.md). Both coders come in the vector kind and a
scalar one (``native`` False) that write and read the same bytes; the vector steps are generic LLVM
code where numba compiles for a CPU without AVX-512 VBMI2
(:data:`weightsync.codec.simd.COMPRESS_IN_REGISTER`), correct but not fast there.

A section of runs (:func:`rans_encode_runs`, the block's nibble-coded positions) carries its
states from run to run, each run with its own frequencies; and every coder takes what its states
carry (``*_carrying``, ``*_carried``): a state that starts at 2^16 + v, v < 2^16, ends a decode
there, which holds 16 bits for less than one of the section (codec ``ans``'s exception list).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from weightsync.codec.entropy import (
    M16,
    NSYM,
    PROB_BITS,
    PROB_ONE,
    RANS_L,
    U32,
    W16,
    W32,
    _rans_table,
    rans_steps,
    read_states,
    settled,
)
from weightsync.codec.jit import njit
from weightsync.codec.simd import COMPRESS_IN_REGISTER, ONE, ZERO, _compress_lanes, _expand_lanes, mulhi

WIDE_LANES = 32
"""States of a wide rANS section (a warp's threads)."""

WIDE_MIN = 1 << 15
"""Symbols from which a group's rANS section is wide, in a block that says so (the format's rule)."""

STEP = 16
"""Lanes a vector step codes (512 bits of 32-bit states)."""

_I32, _I64, _I16 = ir.IntType(32), ir.IntType(64), ir.IntType(16)
_V32 = ir.VectorType(_I32, STEP)
_V16 = ir.VectorType(_I16, STEP)
_M = ir.VectorType(ir.IntType(1), STEP)
_REVERSED = ir.Constant(_V32, list(range(STEP - 1, -1, -1)))


def _data(context, builder, aryty, ary):
    return context.make_array(aryty)(context, builder, value=ary).data


def _load(builder, data, at, vt):
    ptr = builder.bitcast(builder.gep(data, [at]), vt.as_pointer())
    return builder.load(ptr, align=vt.element.width // 8), ptr


def _table(context, builder, aryty, ary):
    """The 16 entries of a uint32 array as one vector."""
    return _load(builder, _data(context, builder, aryty, ary), ir.Constant(_I64, 0), _V32)[0]


def _splat(builder, x):
    s = builder.insert_element(ir.Constant(_V32, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(s, ir.Constant(_V32, ir.Undefined), ir.Constant(_V32, [0] * STEP))


def _lookup(builder, table, idx):
    """``table[idx[i]]`` in each lane (indices below 16): one ``vpermd``, or lane by lane elsewhere."""
    if COMPRESS_IN_REGISTER:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V32, [_V32, _V32]), "llvm.x86.avx512.permvar.si.512"
        )
        return builder.call(fn, [table, idx])
    out = ir.Constant(_V32, ir.Undefined)
    for i in range(STEP):
        lane = ir.Constant(_I32, i)
        out = builder.insert_element(out, builder.extract_element(table, builder.extract_element(idx, lane)), lane)
    return out


def _popcount(builder, m):
    mi = ir.IntType(STEP)
    fn = builder.module.declare_intrinsic("llvm.ctpop", [mi], ir.FunctionType(mi, [mi]))
    return builder.zext(builder.call(fn, [builder.bitcast(m, mi)]), _I64)


def _contiguous(name: str, *arrays) -> None:
    """Refuse, when a kernel is typed, arrays that are not known to be contiguous: the steps address
    an array's elements from its data pointer (a strided view's would be other memory)."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrays):
        raise TypingError(f"lanes.{name} takes C-contiguous arrays only, not {', '.join(str(a) for a in arrays)}")


def _shed_words(builder, x, shed, ptr) -> None:
    """The low 16 bits of the states that shed them, in descending lane order, to memory from ``ptr``
    (all 16 lanes are written: 16 elements from ``ptr`` must be writable)."""
    low = builder.shuffle_vector(builder.trunc(x, _V16), ir.Constant(_V16, ir.Undefined), _REVERSED)
    m = builder.shuffle_vector(shed, ir.Constant(_M, ir.Undefined), _REVERSED)
    if COMPRESS_IN_REGISTER:  # vpcompress to memory is microcoded on AMD Zen 4 (weightsync.codec.simd)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16, [_V16, _V16, _M]), "llvm.x86.avx512.mask.compress.v16i16"
        )
        packed = builder.call(fn, [low, ir.Constant(_V16, None), m])
        builder.store(packed, builder.bitcast(ptr, _V16.as_pointer()), align=2)
        return
    _compress_lanes(builder, low, ptr, m)  # LLVM's 16-bit masked compress-store asserts without VL


def _expand_words(builder, ptr, low):
    """The next words from ``ptr`` into the lanes of the mask ``low``, in lane order (0 elsewhere). A
    masked expand-load where numba compiles for VBMI2 and VL; elsewhere lane by lane (LLVM's masked
    expand-load of 16-bit lanes asserts without VL), reading up to 16 words from ``ptr`` whatever
    the mask (they must be readable)."""
    if COMPRESS_IN_REGISTER:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16, [ptr.type, _M, _V16]), "llvm.masked.expandload.v16i16"
        )
        return builder.zext(builder.call(fn, [ptr, low, ir.Constant(_V16, None)]), _V32)
    return builder.zext(_expand_lanes(builder, ptr, low, _V16), _V32)


@intrinsic
def encode_steps(typingctx, xs, syms, top, bound, freq, start, words, wp, steps):
    """Code ``steps`` whole steps of 32 symbols, the first at ``syms[top:top+32]``, then each 32
    below it, with the states ``xs[0:32]`` (uint32), kept in registers between steps: per 16 lanes
    (the high ones first), a state at or over its symbol's ``bound`` (uint32[16]) sheds its low 16
    bits, which are appended to ``words`` from ``wp`` in descending lane order (the whole section's
    words are reversed at the end, so that a decoder reads them in lane order); then ``x = x + start
    + (x // f) * (PROB_ONE - f)``. Returns the new ``wp``. A step writes 16 elements from ``wp``
    whatever it keeps (``words`` needs 16 past the last it keeps)."""
    _contiguous("encode_steps", xs, syms, bound, freq, start, words)

    def codegen(context, builder, sig, args):
        xsd, sd, wd = (_data(context, builder, sig.args[i], args[i]) for i in (0, 1, 6))
        tables = [_table(context, builder, sig.args[i], args[i]) for i in (3, 4, 5)]
        state = [
            cgutils.alloca_once_value(builder, _load(builder, xsd, ir.Constant(_I64, h * STEP), _V32)[0])
            for h in (0, 1)
        ]
        pos = cgutils.alloca_once_value(builder, args[7])
        vd = ir.VectorType(ir.DoubleType(), STEP)
        with cgutils.for_range(builder, args[8]) as loop:
            at = builder.sub(args[2], builder.mul(loop.index, ir.Constant(_I64, WIDE_LANES)))
            for h in (1, 0):
                x = builder.load(state[h])
                s8 = _load(
                    builder, sd, builder.add(at, ir.Constant(_I64, h * STEP)), ir.VectorType(ir.IntType(8), STEP)
                )
                sym = builder.zext(s8[0], _V32)
                b, f, c = (_lookup(builder, t, sym) for t in tables)
                shed = builder.icmp_unsigned(">=", x, b)
                wp = builder.load(pos)
                _shed_words(builder, x, shed, builder.gep(wd, [wp]))
                builder.store(builder.add(wp, _popcount(builder, shed)), pos)
                x = builder.select(shed, builder.lshr(x, ir.Constant(_V32, [16] * STEP)), x)
                # x // f exactly: x < 2^32 and f <= 2^12 (module doc)
                q = builder.fptoui(builder.fdiv(builder.uitofp(x, vd), builder.uitofp(f, vd)), _V32)
                spare = builder.sub(ir.Constant(_V32, [PROB_ONE] * STEP), f)
                builder.store(builder.add(builder.add(x, c), builder.mul(q, spare)), state[h])
        for h in (0, 1):
            builder.store(builder.load(state[h]), _load(builder, xsd, ir.Constant(_I64, h * STEP), _V32)[1], align=4)
        return builder.load(pos)

    return types.int64(xs, syms, top, bound, freq, start, words, wp, steps), codegen


@intrinsic
def decode_steps(typingctx, xs, starts, freq, values, words, wp, out, at, steps):
    """Decode ``steps`` whole steps of 32 symbols into ``out[at:]`` with the states ``xs[0:32]``
    (uint32), kept in registers between steps: per 16 lanes, each state's symbol is the number of
    ``starts[1..15]`` (uint32[16], the cumulative frequencies) at or below its slot; ``out`` gets
    ``values[symbol]`` (uint32[16], truncated to ``out``'s width); a state that falls under 2^16
    takes the next word of ``words`` from ``wp``, in lane order (:func:`_expand_words`: 16 elements
    from each position must be readable). Returns the new ``wp``."""
    _contiguous("decode_steps", xs, starts, freq, values, words, out)

    def codegen(context, builder, sig, args):
        xsd, wd, od = (_data(context, builder, sig.args[i], args[i]) for i in (0, 4, 6))
        st = _data(context, builder, sig.args[1], args[1])
        starts = [_splat(builder, builder.load(builder.gep(st, [ir.Constant(_I64, s)]))) for s in range(1, NSYM)]
        tables = [_table(context, builder, sig.args[i], args[i]) for i in (2, 1, 3)]  # frequency, start, value
        state = [
            cgutils.alloca_once_value(builder, _load(builder, xsd, ir.Constant(_I64, h * STEP), _V32)[0])
            for h in (0, 1)
        ]
        pos = cgutils.alloca_once_value(builder, args[5])
        ot = ir.VectorType(context.get_data_type(sig.args[6].dtype), STEP)
        with cgutils.for_range(builder, args[8]) as loop:
            base = builder.add(args[7], builder.mul(loop.index, ir.Constant(_I64, WIDE_LANES)))
            for h in (0, 1):
                x = builder.load(state[h])
                slot = builder.and_(x, ir.Constant(_V32, [PROB_ONE - 1] * STEP))
                parts = [builder.zext(builder.icmp_unsigned(">=", slot, c), _V32) for c in starts]
                while len(parts) > 1:  # a tree of adds: the compares do not wait on each other
                    pairs = [parts[i : i + 2] for i in range(0, len(parts), 2)]
                    parts = [builder.add(*pair) if len(pair) == 2 else pair[0] for pair in pairs]
                f, c, v = (_lookup(builder, t, parts[0]) for t in tables)
                x = builder.add(
                    builder.mul(f, builder.lshr(x, ir.Constant(_V32, [PROB_BITS] * STEP))), builder.sub(slot, c)
                )
                low = builder.icmp_unsigned("<", x, ir.Constant(_V32, [int(RANS_L)] * STEP))
                wp = builder.load(pos)
                w = _expand_words(builder, builder.gep(wd, [wp]), low)
                builder.store(builder.add(wp, _popcount(builder, low)), pos)
                builder.store(
                    builder.select(low, builder.or_(builder.shl(x, ir.Constant(_V32, [16] * STEP)), w), x), state[h]
                )
                v = builder.trunc(v, ot) if ot.element.width < 32 else v
                at = builder.add(base, ir.Constant(_I64, h * STEP))
                builder.store(v, builder.bitcast(builder.gep(od, [at]), ot.as_pointer()), align=ot.element.width // 8)
        for h in (0, 1):
            builder.store(builder.load(state[h]), _load(builder, xsd, ir.Constant(_I64, h * STEP), _V32)[1], align=4)
        return builder.load(pos)

    return types.int64(xs, starts, freq, values, words, wp, out, at, steps), codegen


@njit(nogil=True)
def _vectors(freq):
    """The vector steps' tables (uint32[16] each): state bound, frequency, start (cumulative). A symbol
    of frequency 2^12 (the only one) has bound 2^32 - 1, not 2^32: its states never change from 2^16,
    so never shed a word, as in the scalar steps (whose bounds are 64-bit)."""
    bound = np.zeros(NSYM, np.uint32)
    f32 = np.zeros(NSYM, np.uint32)
    start = np.zeros(NSYM, np.uint32)
    s = 0
    for i in range(NSYM):
        f32[i] = freq[i]
        bound[i] = min(np.uint64(freq[i]) << np.uint64(32 - PROB_BITS), np.uint64(0xFFFFFFFF))
        start[i] = s
        s += freq[i]
    return bound, f32, start


@njit(nogil=True)
def rans_encode_wide(syms, c, freq, out, native):
    """:func:`weightsync.codec.entropy.rans_encode` with :data:`WIDE_LANES` states: symbol j is coded
    by state j % 32; the 32 final states first, then the words in the order a decoder reads them.
    ``native``: whole steps by :func:`encode_steps` (the scalar steps write the same bytes). Returns
    the section's length."""
    return rans_encode_wide_carrying(syms, c, freq, out, native, np.zeros(WIDE_LANES, np.uint32))


@njit(nogil=True)
def rans_encode_wide_carrying(syms, c, freq, out, native, carry):
    """:func:`rans_encode_wide` with state q starting at 2^16 + ``carry[q]`` (below 2^16): a decoder
    ends there (:func:`weightsync.codec.entropy.rans_encode_carrying`)."""
    tab = rans_steps(freq)
    W = WIDE_LANES
    words = np.empty(c + 2 * STEP, np.uint16)  # in coding order, reversed below; 16 spare for a step's stores
    u = ZERO  # indices unsigned: numba tests every signed one for wraparound
    xs = np.empty(W, np.uint32)
    for q in range(W):
        xs[q] = RANS_L + carry[q]
    full = np.uint64(c - c % W)
    j = np.uint64(c)
    while j > full:  # the partial last step, its lanes from the highest
        j -= ONE
        xs[j - full], u = _encode_one(xs[j - full], syms[j], tab, words, u)
    if native:
        bound, f32, start = _vectors(freq)
        if full:
            u = np.uint64(
                encode_steps(xs, syms, np.int64(full) - W, bound, f32, start, words, np.int64(u), np.int64(full) // W)
            )
    else:
        u = _scalar_steps(xs, syms, ZERO, j, tab, words, u)
    return _section(xs, words, u, out)


@njit(nogil=True, inline="always")
def _scalar_steps(xs, syms, a, j, tab, words, u):
    """Code ``syms[a:j]`` (whole steps of ``xs.size`` states, a multiple of 4) by scalar steps: lanes
    from the highest, four at a time with their states in registers. Returns the word position."""
    S = np.uint64(xs.size)
    while j > a:
        j -= S
        q = S
        while q > ZERO:
            q -= np.uint64(4)
            x0, x1, x2, x3 = xs[q], xs[q + ONE], xs[q + np.uint64(2)], xs[q + np.uint64(3)]
            x3, u = _encode_one(x3, syms[j + q + np.uint64(3)], tab, words, u)
            x2, u = _encode_one(x2, syms[j + q + np.uint64(2)], tab, words, u)
            x1, u = _encode_one(x1, syms[j + q + ONE], tab, words, u)
            x0, u = _encode_one(x0, syms[j + q], tab, words, u)
            xs[q], xs[q + ONE], xs[q + np.uint64(2)], xs[q + np.uint64(3)] = x0, x1, x2, x3
    return u


@njit(nogil=True, inline="always")
def _section(xs, words, u, out):
    """A coded section into ``out``: the final states, then the ``u`` words (in coding order) in the
    order a decoder reads them. Returns its length."""
    S = xs.size
    for q in range(S):
        for b in range(4):
            out[4 * q + b] = np.uint8((xs[q] >> U32(8 * b)) & U32(0xFF))
    n = np.int64(u)
    body = words[:n]
    body[:] = body[::-1].copy()
    out[4 * S : 4 * S + 2 * n] = body.view(np.uint8)
    return 4 * S + 2 * n


@njit(nogil=True, inline="always")
def _encode_one(x, sym, tab, words, u):
    """One scalar step: state ``x`` (uint32) sheds its low word to ``words[u]`` where it must (the
    position moves only then: no branch), then codes ``sym``; returns the state and the position."""
    s = np.uint64(sym) << np.uint64(2)
    y = np.uint64(x)
    fl = np.uint64(y >= tab[s])
    words[u] = np.uint16(y & M16)
    y >>= fl << np.uint64(4)  # a shift, not a select: LLVM made that a branch, mispredicted (2x slower)
    return np.uint32(y + tab[s + np.uint64(2)] + mulhi(y, tab[s + ONE]) * tab[s + np.uint64(3)]), u + fl


@njit(nogil=True, inline="always")
def _decode_one(x, tab, w16, wp, out, at):
    """One scalar step: the symbol of state ``x`` (its value to ``out[at]``), the state after it, and
    the word position after its renormalisation."""
    en = tab[x & U32(PROB_ONE - 1)]
    x = U32(en & M16) * (x >> U32(PROB_BITS)) + U32((en >> W16) & M16)
    t = U32(x < RANS_L)
    out[at] = en >> W32
    return (x << (t << U32(4))) | (U32(w16[wp]) & (U32(0) - t)), wp + np.uint64(t)


@njit(nogil=True)
def rans_decode_wide(data, pos, length, freq, values, out, o0, count, native):
    """:func:`weightsync.codec.entropy.rans_decode` of a section with :data:`WIDE_LANES` states (symbol
    j with state j % 32); returns 0, or 13 for a section that does not decode to exactly ``count``
    symbols (every state back at 2^16, every word read). ``native``: whole steps by
    :func:`decode_steps`."""
    carry = np.zeros(WIDE_LANES, np.uint32)
    bad = rans_decode_wide_carried(data, pos, length, freq, values, out, o0, count, native, carry)
    return bad if bad else settled(carry)


@njit(nogil=True)
def rans_decode_wide_carried(data, pos, length, freq, values, out, o0, count, native, carry):
    """:func:`rans_decode_wide` of a section whose states may carry 16 bits each: state q's end less
    2^16 goes to ``carry[q]`` (13 for an end at 2^17 or over). A state takes at most one word a
    symbol, and the words are followed by ``count`` zeros (and a step's 16 more), so that a section
    that runs out reads zeros, which the end's checks refuse."""
    W = WIDE_LANES
    if length < 4 * W or (length - 4 * W) % 2:
        return 13
    xs = np.empty(W, np.uint32)
    if not read_states(data, pos, xs):
        return 13
    nw = (length - 4 * W) // 2
    w16 = np.zeros(nw + count + STEP, np.uint16)
    w16.view(np.uint8)[: 2 * nw] = data[pos + 4 * W : pos + length]
    wp = 0
    full = count - count % W
    first = 0
    if native:
        first = full
        bound, f32, start = _vectors(freq)
        v32 = np.zeros(NSYM, np.uint32)
        for s in range(NSYM):
            v32[s] = np.uint32(values[s])
        wp = decode_steps(xs, start, f32, v32, w16, wp, out, o0, full // W)
    tab = _rans_table(freq, values)
    u = _scalar_decode(xs, tab, w16, np.uint64(wp), out, np.uint64(o0), np.uint64(first), np.uint64(full))
    for j in range(np.uint64(full), np.uint64(count)):  # the partial last step
        xs[j - np.uint64(full)], u = _decode_one(xs[j - np.uint64(full)], tab, w16, u, out, np.uint64(o0) + j)
    return _ends(xs, np.int64(u), nw, carry)


@njit(nogil=True, inline="always")
def _scalar_decode(xs, tab, w16, u, out, at, a, e):
    """Decode symbols ``a`` to ``e`` (whole steps of ``xs.size`` states, a multiple of 4) into
    ``out[at + a:]`` by scalar steps: lanes in order, four at a time with their states in
    registers. Returns the word position."""
    S = np.uint64(xs.size)
    for j in range(a, e, S):
        o = at + j
        for q in range(ZERO, S, np.uint64(4)):
            x0, x1, x2, x3 = xs[q], xs[q + ONE], xs[q + np.uint64(2)], xs[q + np.uint64(3)]
            x0, u = _decode_one(x0, tab, w16, u, out, o + q)
            x1, u = _decode_one(x1, tab, w16, u, out, o + q + ONE)
            x2, u = _decode_one(x2, tab, w16, u, out, o + q + np.uint64(2))
            x3, u = _decode_one(x3, tab, w16, u, out, o + q + np.uint64(3))
            xs[q], xs[q + ONE], xs[q + np.uint64(2)], xs[q + np.uint64(3)] = x0, x1, x2, x3
    return u


@njit(nogil=True, inline="always")
def _ends(xs, wp, nw, carry):
    """A section's end: 13 unless every word was read and every state is under 2^17; each state's
    carried 16 bits to ``carry``."""
    for q in range(xs.size):
        if xs[q] >= U32(2 * RANS_L):
            return 13
        carry[q] = xs[q] - RANS_L
    return 0 if wp == nw else 13


@njit(nogil=True)
def rans_encode_runs(syms, ends, freqs, S, out, native, carry):
    """One rANS section of ``S`` states (4 or :data:`WIDE_LANES`) over runs of symbols, each coded with
    its own frequencies: run r is ``syms[ends[r - 1]:ends[r]]`` (from 0 for the first) with
    ``freqs[r]``, a multiple of 32 symbols, so that every run starts at state 0. Symbol j goes with
    state j % S, the states carried from run to run; the S final states first, then the words in the
    order a decoder reads them. ``native`` (S = 32): whole steps by :func:`encode_steps`. State q
    starts at 2^16 + ``carry[q]`` (:func:`rans_encode_wide_carrying`). Returns the section's length."""
    total = ends[ends.size - 1]
    words = np.empty(total + 2 * STEP, np.uint16)  # in coding order, reversed below
    u = ZERO
    xs = np.empty(S, np.uint32)
    for q in range(S):
        xs[q] = RANS_L + carry[q]
    for r in range(ends.size - 1, -1, -1):
        a = np.uint64(ends[r - 1] if r else 0)
        j = np.uint64(ends[r])
        if native and S == WIDE_LANES:
            bound, f32, start = _vectors(freqs[r])
            u = np.uint64(
                encode_steps(xs, syms, np.int64(j) - S, bound, f32, start, words, np.int64(u), np.int64(j - a) // S)
            )
            continue
        u = _scalar_steps(xs, syms, a, j, rans_steps(freqs[r]), words, u)
    return _section(xs, words, u, out)


@njit(nogil=True)
def rans_decode_runs(data, pos, length, S, ends, freqs, out, native, carry):
    """Decode the section :func:`rans_encode_runs` wrote (``S`` states, runs ending at ``ends``, each
    with its ``freqs`` row) into ``out[0:ends[-1]]`` (uint8, each symbol's number); returns 0, or 13
    for a section that does not decode to exactly that many symbols (every word read, every state
    under 2^17: its end less 2^16 to ``carry``). ``native`` (S = 32): whole steps by
    :func:`decode_steps`."""
    if length < 4 * S or (length - 4 * S) % 2:
        return 13
    xs = np.empty(S, np.uint32)
    if not read_states(data, pos, xs):
        return 13
    total = ends[ends.size - 1]
    nw = (length - 4 * S) // 2
    w16 = np.zeros(nw + total + STEP, np.uint16)  # a state takes at most one word a symbol: zeros past the end
    w16.view(np.uint8)[: 2 * nw] = data[pos + 4 * S : pos + length]
    ident = np.arange(NSYM).astype(np.uint32)
    u = ZERO
    for r in range(ends.size):
        a = np.uint64(ends[r - 1] if r else 0)
        e = np.uint64(ends[r])
        if native and S == WIDE_LANES:
            bound, f32, start = _vectors(freqs[r])
            u = np.uint64(decode_steps(xs, start, f32, ident, w16, np.int64(u), out, np.int64(a), np.int64(e - a) // S))
            continue
        u = _scalar_decode(xs, _rans_table(freqs[r], ident), w16, u, out, ZERO, a, e)
    return _ends(xs, np.int64(u), nw, carry)
