"""Prototype codec ``ctx3`` (issue 18, third attempt; not registered): ``bucket.py``'s scheme with
both passes over the elements rebuilt around vector instructions, and the streams decoded without
bit-by-bit work (README.md here: what each change bought).

Decoding a block is two steps. First the streams: per position bucket, its Rice codes into a bitmap
over the bucket's ranks (4 interleaved streams); per value group, its rANS symbols into an array of
differences in position order (4 interleaved states). Then one pass over the elements, 64 at a time:
K-1 vector compares of the old values with the bucket thresholds give each bucket's members,
``pdep`` puts the bucket's next bits there (the changed elements), G-1 more compares split the
changes into the value groups, and one masked expand-load per group adds the group's next
differences (``llvm.masked.expandload``, ``vpexpandw`` on AVX-512 VBMI2): the unchanged majority
costs the compares and the copy, and no step works element by element. A GPU does the same with
prefix sums (ranks, indices of differences) and gathers: :func:`decode_reference` is that, in numpy.
Encoding mirrors it: per 64 elements a vector compare of old and new, ``pext`` of each bucket's
changed flags into its bitmap, a compress-store of each group's zigzag codes.

The value groups are ranges of the old exponent of their own (chosen by dynamic programming on the
sampled value statistics, at most 4, at most 2 below 5% changed): the size of a change's value
depends on its exponent much more finely than the position buckets resolve.

Block layout (little-endian): ``u32 c`` (changed elements), ``u8 K`` (buckets, 1..8), ``u8 shift``,
``u8 bits`` (the exponent field, as ``ac``), ``u8 G`` (value groups, 1..4); ``K-1`` bucket
thresholds then ``G-1`` group thresholds (u8 exponent values, each list ascending; an element's
bucket or group is the number of its thresholds <= its old exponent); LEB128 ``e`` and ``e`` gaps
(p0, then p_j - p_{j-1} - 1) of the changed positions whose bucket or group the change moved, then
``e`` bytes ``old bucket << 4 | old group`` (for the backward decode); per bucket LEB128 ``n_b``,
``c_b``, and when ``c_b > 0`` a byte ``k << 1 | inv`` (inv exactly when more than half changed) and
the LEB128 length of its Rice section; per group LEB128 ``m_g``, and when ``m_g > 0`` a byte
``nsym``, ``nsym`` LEB128 frequencies (sum 4096) and the LEB128 lengths of its escape and rANS
sections; then every bucket's Rice section, then every group's escape and rANS sections.

A Rice section: LEB128 lengths of its first 3 streams, then the 4 streams; gap j (between the
changed ranks, or the unchanged ones when inv) is in stream j % 4, each a sequence of Rice(k) codes
LSB first: q = g >> k one bits, a zero, the k low bits; q >= 32 is 32 ones and g in 32 bits; the
last byte's unused bits are zero. Values: symbol min(zigzag - 1, 15) per change of the group, in
position order; symbol 15 is followed, in the escape section and in order, by the Exp-Golomb-0 code
of zigzag - 16 (as ``bucket.py``). A rANS section: 4 u32 final states, then u16 words in the order
the decoder reads them; symbol j is decoded by state j % 4 (32-bit, in [2^16, 2^32), 12-bit
frequencies): slot = x & 4095, x = f * (x >> 12) + slot - start, then a state below 2^16 reads one
word; every state ends at 2^16 and every word is read.
"""

from __future__ import annotations

import bucket as B
import numpy as np
from bucket import ALL, EXPONENT_FIELD, NSYM, ONE, PROB_BITS, PROB_ONE, ZERO, _below_mask64, _pdep_bmi2, _pop, _tz
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from weightsync.codec.jit import njit
from weightsync.codec.streams import SLICE_BYTES, copy
from weightsync.errors import FormatError
from weightsync.format.dtypes import ITEMSIZE

MAX_K = 8
SLICE = max(64, (SLICE_BYTES // 2) // 64 * 64)  # elements per slice of the pass (hashed while in cache)
CHECK = 4096  # elements between the pass's checks that no bucket ran past its bitmap (+ spare bits)
RANS_L = np.uint32(1 << 16)
LANES = 4  # interleaved rANS states per value group, and Rice streams per bucket
MAX_G = 4  # value groups (contiguous ranges of the old exponent), each its own rANS stream
GROUP_DENSITY = 0.05  # blocks whose changed fraction is below this use at most 2 (a faster pass)
U32 = np.uint32


# --- the pass's vector step ------------------------------------------------------------------------
def _patch_intrinsic(groups: int):
    """``out[base + j] = src[base + j] + d`` for j < 64, where d is, for each of ``groups`` (pointer,
    mask) pairs whose mask has bit j set, the next of ``diffs[p:]`` (masks disjoint), else 0."""

    def typer(typingctx, out, src, base, diffs, *pm):
        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            o = context.make_array(aty)(context, builder, value=args[0])
            s = context.make_array(sig.args[1])(context, builder, value=args[1])
            d = context.make_array(sig.args[3])(context, builder, value=args[3])
            i32, i64 = ir.IntType(32), ir.IntType(64)
            vt = ir.VectorType(context.get_data_type(aty.dtype), 32)  # two halves of 32 lanes
            mt = ir.VectorType(ir.IntType(1), 32)
            align = aty.dtype.bitwidth // 8
            name = f"llvm.masked.expandload.v32i{aty.dtype.bitwidth}"
            pop = builder.module.declare_intrinsic("llvm.ctpop", [i32], ir.FunctionType(i32, [i32]))
            for h in range(2):
                at = builder.add(args[2], ir.Constant(i64, 32 * h))
                x = builder.load(builder.bitcast(builder.gep(s.data, [at]), vt.as_pointer()), align=align)
                for q in range(groups):
                    m = builder.lshr(args[5 + 2 * q], ir.Constant(i64, 32 * h))
                    m32 = builder.trunc(m, i32)
                    ptr = args[4 + 2 * q]
                    if h:
                        low = builder.trunc(args[5 + 2 * q], i32)
                        ptr = builder.add(ptr, builder.zext(builder.call(pop, [low]), i64))
                    ptr = builder.gep(d.data, [ptr])
                    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [ptr.type, mt, vt]), name)
                    e = builder.call(fn, [ptr, builder.bitcast(m32, mt), ir.Constant(vt, None)])
                    x = builder.add(x, e)
                builder.store(x, builder.bitcast(builder.gep(o.data, [at]), vt.as_pointer()), align=align)
            return context.get_dummy_value()

        return types.none(out, src, base, diffs, *pm), codegen

    if groups == 1:
        return intrinsic(
            lambda typingctx, out, src, base, diffs, p0, m0: typer(typingctx, out, src, base, diffs, p0, m0)
        )
    if groups == 2:
        return intrinsic(
            lambda typingctx, out, src, base, diffs, p0, m0, p1, m1: typer(
                typingctx, out, src, base, diffs, p0, m0, p1, m1
            )
        )
    if groups == 3:
        return intrinsic(
            lambda typingctx, out, src, base, diffs, p0, m0, p1, m1, p2, m2: typer(
                typingctx, out, src, base, diffs, p0, m0, p1, m1, p2, m2
            )
        )
    return intrinsic(
        lambda typingctx, out, src, base, diffs, p0, m0, p1, m1, p2, m2, p3, m3: typer(
            typingctx, out, src, base, diffs, p0, m0, p1, m1, p2, m2, p3, m3
        )
    )


_PATCH = {g: _patch_intrinsic(g) for g in range(1, MAX_G + 1)}


@intrinsic
def _pext_bmi2(typingctx, x, m):
    """BMI2's parallel bit extract: the bits of ``x`` at the set bits of ``m``, packed low."""
    return types.uint64(types.uint64, types.uint64), B._int_intrinsic("llvm.x86.bmi.pext.64", 2)


@njit(nogil=True, inline="always")
def _pext_soft(x, m):
    """``pext`` without BMI2: one step per set bit of ``m``."""
    out = ZERO
    k = ZERO
    while m != ZERO:
        low = m & (ZERO - m)
        out |= np.uint64((x & low) != ZERO) << k
        k += ONE
        m &= m - ONE
    return out


@intrinsic
def _field_ne_mask64(typingctx, a, b, base, field):
    """Bit j set where ``(a[base + j] ^ b[base + j]) & field`` is not zero, for j < 64."""

    def codegen(context, builder, sig, args):
        vals = []
        for aryty, ary in zip(sig.args[:2], args[:2]):
            arr = context.make_array(aryty)(context, builder, value=ary)
            ptr = builder.gep(arr.data, [args[2]])
            vt = ir.VectorType(context.get_data_type(aryty.dtype), 64)
            vals.append(builder.load(builder.bitcast(ptr, vt.as_pointer()), align=aryty.dtype.bitwidth // 8))
        vt = vals[0].type
        f = builder.trunc(args[3], vt.element) if args[3].type.width > vt.element.width else args[3]
        splat = builder.shuffle_vector(
            builder.insert_element(ir.Constant(vt, ir.Undefined), f, ir.Constant(ir.IntType(32), 0)),
            ir.Constant(vt, ir.Undefined),
            ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64),
        )
        x = builder.and_(builder.xor(vals[0], vals[1]), splat)
        return builder.bitcast(builder.icmp_unsigned("!=", x, ir.Constant(vt, None)), ir.IntType(64))

    return types.uint64(a, b, base, field), codegen


@intrinsic
def _compress_zz(typingctx, old, new, base, dst, pos, mask):
    """Store the zigzag codes of ``new - old`` (wrapping) at the set bits of ``mask`` (64 elements
    from ``base``), in order, into ``dst`` from ``pos``: a masked compress-store per 32 lanes
    (``vpcompressw`` on AVX-512 VBMI2)."""

    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        o = context.make_array(aty)(context, builder, value=args[0])
        nw = context.make_array(sig.args[1])(context, builder, value=args[1])
        d = context.make_array(sig.args[3])(context, builder, value=args[3])
        width = aty.dtype.bitwidth
        i32, i64, et = ir.IntType(32), ir.IntType(64), ir.IntType(width)
        vt = ir.VectorType(et, 32)
        mt = ir.VectorType(ir.IntType(1), 32)
        pop = builder.module.declare_intrinsic("llvm.ctpop", [i32], ir.FunctionType(i32, [i32]))
        name = f"llvm.masked.compressstore.v32i{width}"
        for h in range(2):
            at = builder.add(args[2], ir.Constant(i64, 32 * h))
            a = builder.load(builder.bitcast(builder.gep(o.data, [at]), vt.as_pointer()), align=width // 8)
            b = builder.load(builder.bitcast(builder.gep(nw.data, [at]), vt.as_pointer()), align=width // 8)
            diff = builder.sub(b, a)
            one = ir.Constant(vt, [1] * 32)
            sign = ir.Constant(vt, [width - 1] * 32)
            z = builder.xor(builder.shl(diff, one), builder.ashr(diff, sign))
            m32 = builder.trunc(builder.lshr(args[5], ir.Constant(i64, 32 * h)), i32)
            ptr = args[4]
            if h:
                ptr = builder.add(ptr, builder.zext(builder.call(pop, [builder.trunc(args[5], i32)]), i64))
            ptr = builder.gep(d.data, [ptr])
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [vt, ptr.type, mt]), name
            )
            builder.call(fn, [z, ptr, builder.bitcast(m32, mt)])
        return context.get_dummy_value()

    return types.none(old, new, base, dst, pos, mask), codegen


def _regions(name: str, count: int, indent: str) -> list[str]:
    """Lines naming ``name0..`` the members of ``count`` regions split by the masks ``name_m0..``
    (each the elements below a threshold)."""
    if count == 1:
        return [f"{indent}{name}0 = ALL"]
    L = [f"{indent}{name}0 = {name}_m0"]
    L += [f"{indent}{name}{b} = {name}_m{b} & ~{name}_m{b - 1}" for b in range(1, count - 1)]
    return L + [f"{indent}{name}{count - 1} = ~{name}_m{count - 2}"]


def _pass_source(K: int, G: int) -> str:
    """The pass over elements ``a:e`` for K buckets and G value groups, state in locals: per 64
    elements, K-1 vector compares give each bucket's members, ``pdep`` puts the bucket's next bits
    there, G-1 more compares split the changes into the groups, and one expand-load per group
    adds the differences. Every CHECK elements it checks that no bucket ran past its bitmap (each
    has CHECK bits of spare: a base that does not match the block reads zeros, never out of
    bounds); the last, partial word goes element by element; at the block's end the buckets and
    groups must be used up exactly. Returns 0, or 1 for a block that does not fit its base.
    Indices are unsigned (numba adds no wraparound for them)."""
    r, rg = range(K), range(G)
    L = ["def _pass(out, src, a, e, lim, vlim, absmask, words, off, ends, dptr, dend, diffs):"]
    L += [f"    l{t} = lim[{t}]" for t in range(K - 1)] + [f"    v{t} = vlim[{t}]" for t in range(G - 1)]
    L += [f"    o{b} = np.uint64(off[{b}])" for b in r] + [f"    E{b} = np.uint64(ends[{b}])" for b in r]
    L += [f"    d{g} = dptr[{g}]" for g in rg] + ["    n = src.size", "    whole = min(e, n - n % 64)"]
    L += ["    for s in range(a, whole, CHECK):"]
    L += ["        if " + " or ".join(f"o{b} > E{b}" for b in r) + ":", "            return 1"]
    L += ["        for base in range(s, min(s + CHECK, whole), 64):"]
    L += [f"            b_m{t} = _below_mask64(src, base, absmask, l{t})" for t in range(K - 1)]
    L += _regions("b", K, "            ")
    L += [f"            p{b} = _pop(b{b})" for b in r]
    for b in r:  # the bucket's next p bits from bit o (written out: no array passed to a helper)
        L += [f"            q = o{b} >> SIX", f"            sh = o{b} & M63"]
        L += ["            v = (words[q] >> sh) | ((words[q + ONE] << ONE) << (M63 - sh))"]
        L += [f"            v &= (ALL >> ((W64 - p{b}) & M63)) & (ZERO - np.uint64(p{b} != ZERO))"]
        L += [f"            c{b} = _pdep(v, b{b})", f"            o{b} += p{b}"]
    L += ["            ch = " + " | ".join(f"c{b}" for b in r)]
    L += [f"            g_m{t} = _below_mask64(src, base, absmask, v{t})" for t in range(G - 1)]
    L += _regions("g", G, "            ")
    L += [f"            g{g} &= ch" for g in rg]
    L += ["            _patch(out, src, base, diffs, " + ", ".join(f"d{g}, g{g}" for g in rg) + ")"]
    L += [f"            d{g} += np.int64(_pop(g{g}))" for g in rg]
    L += [f"    off[{b}] = np.int64(o{b})" for b in r] + [f"    dptr[{g}] = d{g}" for g in rg]
    L += ["    if " + " or ".join(f"o{b} > E{b}" for b in r) + ":", "        return 1"]
    L += ["    if e > whole:", "        _tail(out, src, max(a, whole), e, lim, vlim, absmask, words, off, dptr, diffs)"]
    L += [
        "    if e == n:",
        "        for b in range(off.size):",
        "            if off[b] != ends[b]:",
        "                return 1",
    ]
    L += ["        for g in range(dptr.size):", "            if dptr[g] != dend[g]:", "                return 1"]
    L += ["    return 0"]
    return "\n".join(L) + "\n"


_PASSES: dict = {}


def pass_for(K: int, G: int, bmi2: bool = B.HAS_BMI2):
    """The compiled pass for K buckets and G value groups (compiled on first use)."""
    key = (K, G, bmi2)
    if key not in _PASSES:
        ns = dict(
            np=np, ALL=ALL, ONE=ONE, ZERO=ZERO, SIX=np.uint64(6), M63=np.uint64(63), W64=np.uint64(64), CHECK=CHECK
        )
        ns.update(_below_mask64=_below_mask64, _pop=_pop, _patch=_PATCH[G], _tail=_tail)
        ns["_pdep"] = _pdep_bmi2 if bmi2 else B._pdep_soft
        exec(_pass_source(K, G), ns)
        import numba

        _PASSES[key] = numba.njit(nogil=True)(ns["_pass"])
    return _PASSES[key]


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


# --- bit writing ------------------------------------------------------------------------------------
# --- encoding -------------------------------------------------------------------------------------
def _scan_source(K: int, G: int) -> str:
    """The encoder's pass over whole words for K buckets and G value groups, state in locals: per
    64 elements, the changed mask (a vector compare of old and new), K-1 compares give the buckets,
    ``pext`` takes each bucket's changed flags in rank order into its bitmap; G-1 compares give
    the value groups, and the zigzag codes of the changes are compress-stored into their group's
    stream; the changes that move their element to another bucket or group are listed (for the
    backward decode)."""
    r, rg = range(K), range(G)
    L = ["def _scan(old, new, nfull, lim, vlim, absmask, field, shift, fm, blut, glut, bmap, stride, acc, nacc, wpos,"]
    L[0] += " v0, v1, v2, v3, nv, exc, nes):"
    L += [f"    l{t} = lim[{t}]" for t in range(K - 1)] + [f"    u{t} = vlim[{t}]" for t in range(G - 1)]
    L += [f"    a{b} = acc[{b}]" for b in r] + [f"    n{b} = np.uint64(nacc[{b}])" for b in r]
    L += [f"    w{b} = np.uint64({b} * stride + wpos[{b}])" for b in r]
    L += [f"    k{g} = nv[{g}]" for g in rg] + [
        "    ne = nes[0]",
        "    for w in range(nfull):",
        "        base = w * 64",
    ]
    L += ["        c = _ne_mask64(old, new, base)"]
    L += [f"        b_m{t} = _below_mask64(old, base, absmask, l{t})" for t in range(K - 1)]
    L += _regions("b", K, "        ")
    L += [f"        f{b} = ZERO" for b in r]
    L += ["        if c != ZERO:"]
    L += [f"            g_m{t} = _below_mask64(old, base, absmask, u{t})" for t in range(G - 1)]
    L += _regions("g", G, "            ")
    for g in rg:
        L += [f"            g{g} &= c", f"            _compress_zz(old, new, base, v{g}, k{g}, g{g})"]
        L += [f"            k{g} += np.int64(_pop(g{g}))"]
    # a change can move its element to another bucket or group only if its exponent changed (rare)
    L += ["            x = _field_ne_mask64(old, new, base, field)", "            while x != ZERO:"]
    L += ["                i = base + np.int64(_tz(x))", "                x &= x - ONE"]
    L += [
        "                eo = (np.int64(old[i]) >> shift) & fm",
        "                en = (np.int64(new[i]) >> shift) & fm",
    ]
    L += ["                if blut[eo] != blut[en] or glut[eo] != glut[en]:"]
    L += ["                    exc[ne] = i", "                    ne += 1"]
    L += [f"            f{b} = _pext(c, b{b})" for b in r]
    for b in r:  # append the bucket's flags to its bitmap; the word is stored every time (branch-free)
        L += [f"        p = _pop(b{b})", f"        word = a{b} | (f{b} << n{b})", f"        bmap[w{b}] = word"]
        L += [f"        t = n{b} + p", "        adv = np.uint64(t >= W64)", f"        w{b} += adv"]
        L += [
            f"        a{b} = word if adv == ZERO else (f{b} >> ONE) >> (M63 - n{b})",
            f"        n{b} = t - (adv << SIX)",
        ]
    L += [f"    acc[{b}] = a{b}" for b in r] + [f"    nacc[{b}] = np.int64(n{b})" for b in r]
    L += [f"    wpos[{b}] = np.int64(w{b}) - {b} * stride" for b in r]
    L += [f"    nv[{g}] = k{g}" for g in rg] + ["    nes[0] = ne"]
    return "\n".join(L) + "\n"


_SCANS: dict = {}


def scan_for(K: int, G: int, bmi2: bool = B.HAS_BMI2):
    """The compiled encoder pass for K buckets and G value groups (compiled on first use)."""
    key = (K, G, bmi2)
    if key not in _SCANS:
        ns = dict(np=np, ALL=ALL, ONE=ONE, ZERO=ZERO, SIX=np.uint64(6), M63=np.uint64(63), W64=np.uint64(64))
        ns.update(_below_mask64=_below_mask64, _ne_mask64=B._ne_mask64, _pop=_pop, _tz=_tz, _compress_zz=_compress_zz)
        ns.update(_field_ne_mask64=_field_ne_mask64)
        ns["_pext"] = _pext_bmi2 if bmi2 else _pext_soft
        exec(_scan_source(K, G), ns)
        import numba

        _SCANS[key] = numba.njit(nogil=True)(ns["_scan"])
    return _SCANS[key]


@njit(nogil=True)
def _rice_k(gaps):
    """Rice parameter for the gaps: the best of three around log2 of their mean."""
    ng = gaps.size
    if ng == 0:
        return 0
    total = np.uint64(0)
    for j in range(ng):
        total += gaps[j]
    mean = total / ng
    k0 = 0
    while (1 << (k0 + 1)) <= mean * 0.69:
        k0 += 1
    lo = max(0, k0 - 1)
    best = 0
    bestcost = np.uint64(0)
    for t in range(3):
        kk = np.uint64(lo + t)
        cost = np.uint64(0)
        for j in range(ng):  # vectorised: sum of quotients
            cost += min(gaps[j] >> kk, np.uint64(32))
        cost += np.uint64(ng) * (kk + ONE)
        if t == 0 or cost < bestcost:
            best = lo + t
            bestcost = cost
    return best


@njit(nogil=True)
def _gaps_of(words, n_b, c, inv):
    """The gaps a bucket's Rice section codes, from its bitmap over ``n_b`` ranks with ``c`` set:
    between its set bits, or its clear ones (``inv``)."""
    count = n_b - c if inv else c
    gaps = np.empty(count, np.uint64)
    prev = -1
    j = 0
    for q in range((n_b + 63) // 64):
        x = ~words[q] if inv else words[q]
        if q == n_b >> 6:
            x &= (ONE << np.uint64(n_b & 63)) - ONE
        while x != ZERO:
            r = 64 * q + np.int64(_tz(x))
            gaps[j] = r - prev - 1
            prev = r
            j += 1
            x &= x - ONE
    return gaps


@intrinsic
def _store64(typingctx, buf, pos, value):
    """Store ``value`` as 8 little-endian bytes at byte ``pos`` of a uint8 array (unaligned)."""

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, value=args[0])
        ptr = builder.bitcast(builder.gep(arr.data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return types.none(buf, pos, value), codegen


@njit(nogil=True)
def _rice_stream(gaps, first, k, buf):
    """Rice codes of ``gaps[first::LANES]`` into ``buf`` (uint8, 8 bytes of slack); returns the length
    in bytes. A code is q = g >> k ones, a zero and the k low bits (at most 62 bits); q >= 32 is 32
    ones and g in 32 bits. Fewer than 8 bits wait in ``acc``; each code is or-ed in and the 8 bytes
    stored at once (unaligned), without a branch but for codes over 56 bits."""
    p = 0
    acc = ZERO
    nacc = ZERO
    kk = np.uint64(k)
    low = (ONE << kk) - ONE
    w32 = np.uint64(32)
    m32 = np.uint64(0xFFFFFFFF)
    for j in range(first, gaps.size, LANES):
        g = gaps[j]
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
            _store64(buf, p, acc)
            nb = nacc >> np.uint64(3)
            p += np.int64(nb)
            acc >>= nb << np.uint64(3)
            nacc &= np.uint64(7)
            code >>= w32
            n -= w32
        acc |= code << nacc
        nacc += n
        _store64(buf, p, acc)
        nb = nacc >> np.uint64(3)
        p += np.int64(nb)
        acc = (acc >> (nb << np.uint64(2))) >> (nb << np.uint64(2))  # nb may be 8: two shifts
        nacc &= np.uint64(7)
    return p + np.int64(nacc != ZERO)


@njit(nogil=True)
def _rice_section(gaps, k, out):
    """A bucket's Rice section into ``out`` (uint8): LEB128 lengths of its first LANES - 1 streams,
    then the LANES streams (gap j in stream j % LANES); returns its length."""
    buf = np.empty(8 * (gaps.size // LANES + 1) + 16, np.uint8)  # a code is at most 64 bits
    lens = np.zeros(LANES, np.int64)
    body = np.empty(8 * gaps.size + 64, np.uint8)
    bp = 0
    for q in range(LANES):
        lens[q] = _rice_stream(gaps, q, k, buf)
        body[bp : bp + lens[q]] = buf[: lens[q]]
        bp += lens[q]
    hp = 0
    for q in range(LANES - 1):
        hp = B._put_varint(out, hp, lens[q])
    out[hp : hp + bp] = body[:bp]
    return hp + bp


@njit(nogil=True)
def _rans_table(freq):
    """Per slot: symbol | frequency << 4 | (slot - start) << 17."""
    tab = np.empty(PROB_ONE, np.uint32)
    start = 0
    for s in range(NSYM):
        f = np.int64(freq[s])
        head = U32(s) | (U32(f) << U32(4))
        seg = tab[start : start + f]
        for j in range(f):  # vectorised
            seg[j] = head | (U32(j) << U32(17))
        start += f
    return tab


@njit(nogil=True)
def _rans_encode16(syms, c, freq, out):
    """The rANS section of ``syms[:c]`` into ``out`` (uint8); returns its length. LANES states:
    symbol j is coded by state j % LANES; the final states first, then one word stream. (Lanes are
    written out: helpers that take arrays cost a reference count per call in numba.)"""
    # per symbol: the state bound, and x // f as a multiply and shifts (ryg's rans_byte.h reciprocal)
    xmax = np.zeros(NSYM, np.uint64)
    rcp = np.zeros(NSYM, np.uint64)
    rsh = np.zeros(NSYM, np.uint64)
    bias = np.zeros(NSYM, np.uint64)
    cmpl = np.zeros(NSYM, np.uint64)
    start = 0
    for i in range(NSYM):
        f = np.int64(freq[i])
        xmax[i] = np.uint64(f) << np.uint64(32 - PROB_BITS)
        cmpl[i] = np.uint64(PROB_ONE - f)
        if f < 2:
            rcp[i] = np.uint64(0xFFFFFFFF)
            bias[i] = np.uint64(start + PROB_ONE - 1)
        elif f > 0:
            sh = 0
            while f > (1 << sh):
                sh += 1
            rcp[i] = np.uint64(((1 << (sh + 31)) + f - 1) // f)
            rsh[i] = np.uint64(sh - 1)
            bias[i] = np.uint64(start)
        start += f
    tmp = np.empty(c + 4, np.uint16)  # at most one word per symbol, written backwards
    t = tmp.size
    x0 = np.uint64(RANS_L)  # states below 2^32, in 64-bit registers for the multiply
    x1 = x0
    x2 = x0
    x3 = x0
    full = c - c % LANES
    for j in range(c - 1, full - 1, -1):  # the last, partial group (lanes 0..c % LANES - 1)
        s = syms[j]
        q = j - full
        x = x2 if q == 2 else x1 if q == 1 else x0
        if x >= xmax[s]:
            t -= 1
            tmp[t] = np.uint16(x & np.uint64(0xFFFF))
            x >>= np.uint64(16)
        d = ((x * rcp[s]) >> np.uint64(32)) >> rsh[s]
        x = x + bias[s] + d * cmpl[s]
        if q == 2:
            x2 = x
        elif q == 1:
            x1 = x
        else:
            x0 = x
    for j in range(full - LANES, -1, -LANES):
        s = syms[j + 3]
        if x3 >= xmax[s]:
            t -= 1
            tmp[t] = np.uint16(x3 & np.uint64(0xFFFF))
            x3 >>= np.uint64(16)
        d = ((x3 * rcp[s]) >> np.uint64(32)) >> rsh[s]
        x3 = x3 + bias[s] + d * cmpl[s]
        s = syms[j + 2]
        if x2 >= xmax[s]:
            t -= 1
            tmp[t] = np.uint16(x2 & np.uint64(0xFFFF))
            x2 >>= np.uint64(16)
        d = ((x2 * rcp[s]) >> np.uint64(32)) >> rsh[s]
        x2 = x2 + bias[s] + d * cmpl[s]
        s = syms[j + 1]
        if x1 >= xmax[s]:
            t -= 1
            tmp[t] = np.uint16(x1 & np.uint64(0xFFFF))
            x1 >>= np.uint64(16)
        d = ((x1 * rcp[s]) >> np.uint64(32)) >> rsh[s]
        x1 = x1 + bias[s] + d * cmpl[s]
        s = syms[j + 0]
        if x0 >= xmax[s]:
            t -= 1
            tmp[t] = np.uint16(x0 & np.uint64(0xFFFF))
            x0 >>= np.uint64(16)
        d = ((x0 * rcp[s]) >> np.uint64(32)) >> rsh[s]
        x0 = x0 + bias[s] + d * cmpl[s]
    xs = (x0, x1, x2, x3)
    for q in range(LANES):
        for b in range(4):
            out[4 * q + b] = np.uint8((xs[q] >> np.uint64(8 * b)) & np.uint64(0xFF))
    m = tmp.size - t
    out[4 * LANES : 4 * LANES + 2 * m] = tmp[t:].view(np.uint8)
    return 4 * LANES + 2 * m


@njit(nogil=True)
def _histogram(old, new, shift, fmask, width_bits):
    """Per exponent value: elements (from every 64th word of 64 elements), changed elements and their
    value symbols (from every 16th word), scaled to the block; every element of a block under 1024
    words. Returns (elements, changed, symbols, 1)."""
    n = old.size
    per = np.zeros(fmask + 1, np.float64)
    chp = np.zeros(fmask + 1, np.float64)
    sym = np.zeros((fmask + 1, NSYM), np.int64)
    sh = np.uint64(64 - width_bits)
    n_words = n // 64
    if n_words < 1024:
        s1, s2, end = 1, 1, n
    else:
        s1, s2, end = 64, 16, n_words * 64
    hist = np.zeros(4 * (fmask + 1), np.int64)
    for w in range(0, (end + 63) // 64, s2):
        a = w * 64
        e = min(a + 64, end)
        if w % s1 == 0:
            for i in range(a, e):
                hist[(i & 3) * (fmask + 1) + ((np.int64(old[i]) >> shift) & fmask)] += 1
        if e - a == 64:
            c = B._ne_mask64(old, new, a)
        else:
            c = ZERO
            for i in range(a, e):
                c |= np.uint64(old[i] != new[i]) << np.uint64(i - a)
        while c != ZERO:  # the changes (a few per word)
            i = a + np.int64(_tz(c))
            c &= c - ONE
            x = (np.int64(old[i]) >> shift) & fmask
            chp[x] += s2
            d = np.int64(np.uint64(new[i] - old[i]) << sh) >> np.int64(sh)
            z = np.uint64((d << 1) ^ (d >> 63))
            sym[x, min(z - ONE, np.uint64(NSYM - 1))] += 1
    for x in range(fmask + 1):
        for r in range(4):
            per[x] += s1 * hist[r * (fmask + 1) + x]
        per[x] = max(per[x], chp[x])  # the two samples differ: a bin never has more changes than elements
    return per, chp, sym, 1


@njit(nogil=True)
def _bits_of(counts):
    """Bits of an ideal static code for symbols with these counts, plus its table (~20 bytes)."""
    t = counts.sum()
    if t == 0:
        return 0.0
    h = 160.0
    for c in counts:
        if c > 0:
            h -= c * np.log2(c / t)
    return h


@njit(nogil=True)
def _split(counts, G):
    """The value groups: at most G contiguous ranges of the old exponent whose static codes (with
    their tables) are the smallest (dynamic programming over the exponents that have changes);
    returns the thresholds (ascending; a change is in the group of the number of thresholds <= its
    old exponent). ``counts``: value symbols per old exponent."""
    ex = np.flatnonzero(counts.sum(axis=1))
    m = ex.size
    if m <= 1 or G <= 1:
        return np.zeros(0, np.int64)
    cum = np.zeros((m + 1, NSYM), np.int64)
    for i in range(m):
        cum[i + 1] = cum[i] + counts[ex[i]]
    cost = np.full((m + 1, m + 1), 1e300)
    for a in range(m):
        for b in range(a + 1, m + 1):
            cost[a, b] = _bits_of(cum[b] - cum[a])
    g = min(G, m)
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
    best = 1
    for q in range(2, g + 1):
        if dp[q, m] < dp[best, m] - 1e-9:
            best = q
    thr = np.zeros(best - 1, np.int64)
    b = m
    for q in range(best, 1, -1):
        b = arg[q, b]
        thr[q - 2] = ex[b]
    return thr


@njit(nogil=True)
def _plan(old, new, shift, bits, kmax, width_bits):
    """The block's bucket thresholds and the value groups' split, from a sample."""
    fmask = (1 << bits) - 1
    thr = np.zeros(0, np.int64)
    vthr = np.zeros(0, np.int64)
    if fmask > 0:
        per, chp, vsym, step = _histogram(old, new, shift, fmask, width_bits)
        est = np.int64(chp.sum()) * step
        thr = B._thresholds(per, chp, min(kmax, max(1, est // B.CHANGES_PER_BUCKET)))
        gmax = MAX_G if est >= GROUP_DENSITY * old.size else 2
        vthr = _split(vsym, min(gmax, max(1, est // B.CHANGES_PER_BUCKET)))
    return thr, vthr


@njit(nogil=True)
def _encode(old, new, shift, bits, width_bits, bmi2, thr, vthr, bmap, stride, acc, nacc, wpos, vals, nv, exc, nes):
    """The block from the state of the pass over its whole words (:func:`_scan_source`): the last,
    partial word, then the header and sections."""
    n = old.size
    fmask = (1 << bits) - 1
    K = thr.size + 1
    G = vthr.size + 1
    gvt = B._lut(vthr, fmask)  # value group by exponent
    lut = B._lut(thr, fmask)
    ne = nes[0]
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
            if ch:
                g = gvt[eo]
                s_ = np.int64(np.uint64(new[i] - old[i]) << sh) >> np.int64(sh)
                vals[g, nv[g]] = (s_ << 1) ^ (s_ >> 63)
                nv[g] += 1
                if lut[en] != lut[eo] or gvt[en] != g:
                    exc[ne] = i
                    ne += 1
        for b in range(K):  # append the bucket's flags (one per member, in order) to its bitmap
            m = bm[b]
            p = np.int64(_pop(m))
            flags = _pext_bmi2(c, m) if bmi2 else _pext_soft(c, m)
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
        return np.zeros(0, np.uint8), 0
    cnt = np.zeros(K, np.int64)
    cb = np.zeros(K, np.int64)
    for b in range(K):
        bmap[b * stride + wpos[b]] = acc[b]
        bmap[b * stride + wpos[b] + 1] = ZERO
        cnt[b] = 64 * wpos[b] + nacc[b]
        for q in range(wpos[b] + 1):
            cb[b] += np.int64(_pop(bmap[b * stride + q]))
    # values: symbols min(zigzag - 1, 15), escapes (zigzag >= 16) in order, per group
    counts = np.zeros((G, NSYM), np.int64)
    syms = np.empty((G, nv.max() + 1), np.uint8)
    esc = np.empty(k + 1, np.uint64)
    escg = np.zeros(G + 1, np.int64)
    nesc = 0
    for g in range(G):
        for j in range(nv[g]):  # vectorised
            syms[g, j] = min(np.uint64(vals[g, j]) - ONE, np.uint64(NSYM - 1))
        for j in range(nv[g]):
            counts[g, syms[g, j]] += 1
        if counts[g, NSYM - 1]:
            for j in range(nv[g]):
                z = np.uint64(vals[g, j])
                if z >= np.uint64(NSYM):
                    esc[nesc] = z
                    nesc += 1
        escg[g + 1] = nesc
    head = np.zeros(64 + 16 * K + 64 * G + 6 * ne, np.uint8)
    head[0] = k & 0xFF
    head[1] = (k >> 8) & 0xFF
    head[2] = (k >> 16) & 0xFF
    head[3] = (k >> 24) & 0xFF
    head[4] = K
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
    hp = B._put_varint(head, hp, ne)
    prevp = -1
    for j in range(ne):
        hp = B._put_varint(head, hp, exc[j] - prevp - 1)
        prevp = exc[j]
    for j in range(ne):
        eo = (np.int64(old[exc[j]]) >> shift) & fmask
        head[hp] = lut[eo] << 4 | gvt[eo]
        hp += 1
    body = np.empty(64 * K + 64 * G + 12 * k + 16 * nesc + 64 * LANES * K, np.uint8)
    bp = 0
    for b in range(K):  # positions: per bucket, Rice codes of rank gaps
        c = cb[b]
        hp = B._put_varint(head, hp, cnt[b])
        hp = B._put_varint(head, hp, c)
        if c == 0:
            continue
        inv = 2 * c > cnt[b]
        gaps = _gaps_of(bmap[b * stride : (b + 1) * stride], cnt[b], c, inv)
        kr = _rice_k(gaps)
        rl = _rice_section(gaps, kr, body[bp:])
        bp += rl
        head[hp] = kr * 2 + inv
        hp = B._put_varint(head, hp + 1, rl)
    freq = np.zeros(NSYM, np.int64)
    st = np.zeros(3, np.int64)
    for g in range(G):  # values: per group, rANS of the symbols in position order, then escapes
        m = nv[g]
        hp = B._put_varint(head, hp, m)
        if m == 0:
            continue
        st[:] = 0
        sub = body[bp:]
        for e in range(escg[g], escg[g + 1]):
            B._put_eg(sub, st, np.int64(esc[e] - np.uint64(NSYM)))
        B._flush(sub, st)
        B._normalise(counts[g], freq)
        nsym = 0
        for s in range(NSYM):
            if freq[s]:
                nsym = s + 1
        head[hp] = nsym
        hp += 1
        for s in range(nsym):
            hp = B._put_varint(head, hp, freq[s])
        bp += st[2]
        hp = B._put_varint(head, hp, st[2])
        rl = _rans_encode16(syms[g], m, freq, body[bp:])
        bp += rl
        hp = B._put_varint(head, hp, rl)
    out = np.empty(hp + bp, np.uint8)
    out[:hp] = head[:hp]
    out[hp:] = body[:bp]
    return out, k


# --- decoding -------------------------------------------------------------------------------------
@njit(nogil=True)
def _rans_decode16(data, pos, length, freq, diffs, d0, count, esec, elen, zmax):
    """``count`` differences of a value group from its rANS section (``data[pos:pos+length]``) and escape
    section into ``diffs[d0:]``; returns 0 or a failed check's number."""
    if length < 4 * LANES or (length - 4 * LANES) % 2:
        return 13
    tab = _rans_table(freq)
    xs = np.zeros(LANES, np.uint32)
    for q in range(LANES):
        p = pos + 4 * q
        xs[q] = U32(data[p]) | U32(data[p + 1]) << U32(8) | U32(data[p + 2]) << U32(16) | U32(data[p + 3]) << U32(24)
        if xs[q] < RANS_L:
            return 13
    x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
    nw = (length - 4 * LANES) // 2
    w16 = np.zeros(nw + 1, np.uint16)  # one spare word: the branch-free step reads one ahead
    w16.view(np.uint8)[: 2 * nw] = data[pos + 4 * LANES : pos + length]
    dz = np.zeros(NSYM, diffs.dtype)
    for s in range(NSYM - 1):
        z = np.uint64(s + 1)
        dz[s] = (z >> ONE) ^ (ZERO - (z & ONE))
    wp = ZERO
    nwu = np.uint64(nw)
    nesc = 0
    full = count - count % LANES
    mask = U32(PROB_ONE - 1)
    for j in range(0, full, LANES):
        dj = np.uint64(d0 + j)
        en = tab[x0 & mask]
        x0 = ((en >> U32(4)) & U32(0x1FFF)) * (x0 >> U32(PROB_BITS)) + (en >> U32(17))
        t = U32(x0 < RANS_L)
        x0 = (x0 << (t << U32(4))) | (U32(w16[min(wp, nwu)]) & (U32(0) - t))
        wp += np.uint64(t)
        s = en & U32(15)
        diffs[dj + np.uint64(0)] = dz[s]
        nesc += s == U32(NSYM - 1)
        en = tab[x1 & mask]
        x1 = ((en >> U32(4)) & U32(0x1FFF)) * (x1 >> U32(PROB_BITS)) + (en >> U32(17))
        t = U32(x1 < RANS_L)
        x1 = (x1 << (t << U32(4))) | (U32(w16[min(wp, nwu)]) & (U32(0) - t))
        wp += np.uint64(t)
        s = en & U32(15)
        diffs[dj + np.uint64(1)] = dz[s]
        nesc += s == U32(NSYM - 1)
        en = tab[x2 & mask]
        x2 = ((en >> U32(4)) & U32(0x1FFF)) * (x2 >> U32(PROB_BITS)) + (en >> U32(17))
        t = U32(x2 < RANS_L)
        x2 = (x2 << (t << U32(4))) | (U32(w16[min(wp, nwu)]) & (U32(0) - t))
        wp += np.uint64(t)
        s = en & U32(15)
        diffs[dj + np.uint64(2)] = dz[s]
        nesc += s == U32(NSYM - 1)
        en = tab[x3 & mask]
        x3 = ((en >> U32(4)) & U32(0x1FFF)) * (x3 >> U32(PROB_BITS)) + (en >> U32(17))
        t = U32(x3 < RANS_L)
        x3 = (x3 << (t << U32(4))) | (U32(w16[min(wp, nwu)]) & (U32(0) - t))
        wp += np.uint64(t)
        s = en & U32(15)
        diffs[dj + np.uint64(3)] = dz[s]
        nesc += s == U32(NSYM - 1)
    for j in range(full, count):
        q = j - full
        x = x2 if q == 2 else x1 if q == 1 else x0
        en = tab[x & mask]
        x = ((en >> U32(4)) & U32(0x1FFF)) * (x >> U32(PROB_BITS)) + (en >> U32(17))
        t = U32(x < RANS_L)
        x = (x << (t << U32(4))) | (U32(w16[min(wp, nwu)]) & (U32(0) - t))
        wp += np.uint64(t)
        if q == 2:
            x2 = x
        elif q == 1:
            x1 = x
        else:
            x0 = x
        s = en & U32(15)
        diffs[d0 + j] = dz[s]
        nesc += s == U32(NSYM - 1)
    if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L or wp != nwu:
        return 13
    bp = 0
    if nesc:  # rare: an escape left a zero difference (no change has one); its Exp-Golomb code, in order
        for j in range(d0, d0 + count):
            if diffs[j] == 0:
                v, bp = B._get_eg(esec, bp, 8 * elen)
                if v < 0 or np.uint64(v) > zmax - np.uint64(NSYM):
                    return 14
                z = np.uint64(v) + np.uint64(NSYM)
                diffs[j] = (z >> ONE) ^ (ZERO - (z & ONE))
    if not B._clean_end(esec, bp, elen):
        return 14
    return 0


@njit(nogil=True)
def _rice_decode(data, pos, bl, count, k, n_b, inv, words, w0):
    """A bucket's Rice section into its bitmap (``words`` from word ``w0``); returns 0 or 12."""
    end = pos + bl
    lens = np.zeros(LANES, np.int64)
    for q in range(LANES - 1):
        lens[q], pos = B._get_varint(data, pos)
        if lens[q] < 0:
            return 12
    lens[LANES - 1] = end - pos - lens[: LANES - 1].sum()
    if lens[LANES - 1] < 0:
        return 12
    s0 = B._padded_words(data, pos, lens[0])
    s1 = B._padded_words(data, pos + lens[0], lens[1])
    s2 = B._padded_words(data, pos + lens[0] + lens[1], lens[2])
    s3 = B._padded_words(data, pos + lens[0] + lens[1] + lens[2], lens[3])
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
    full = count - count % LANES
    lim0, lim1, lim2, lim3 = 8 * lens[0], 8 * lens[1], 8 * lens[2], 8 * lens[3]
    w32 = np.uint64(32)
    m32 = np.uint64(0xFFFFFFFF)
    for _ in range(0, full, LANES):
        q = np.uint64(b0) >> np.uint64(6)
        sh = np.uint64(b0 & 63)
        w = (s0[q] >> sh) | ((s0[q + ONE] << ONE) << (np.uint64(63) - sh))
        u = _tz(~w)
        if u < w32:
            g0 = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
            b0 += np.int64(u + ONE + kk)
        else:
            q = (b0 + 32) >> 6
            sh = np.uint64((b0 + 32) & 63)
            g0 = np.int64(((s0[q] >> sh) | ((s0[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
            b0 += 64
        q = np.uint64(b1) >> np.uint64(6)
        sh = np.uint64(b1 & 63)
        w = (s1[q] >> sh) | ((s1[q + ONE] << ONE) << (np.uint64(63) - sh))
        u = _tz(~w)
        if u < w32:
            g1 = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
            b1 += np.int64(u + ONE + kk)
        else:
            q = (b1 + 32) >> 6
            sh = np.uint64((b1 + 32) & 63)
            g1 = np.int64(((s1[q] >> sh) | ((s1[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
            b1 += 64
        q = np.uint64(b2) >> np.uint64(6)
        sh = np.uint64(b2 & 63)
        w = (s2[q] >> sh) | ((s2[q + ONE] << ONE) << (np.uint64(63) - sh))
        u = _tz(~w)
        if u < w32:
            g2 = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
            b2 += np.int64(u + ONE + kk)
        else:
            q = (b2 + 32) >> 6
            sh = np.uint64((b2 + 32) & 63)
            g2 = np.int64(((s2[q] >> sh) | ((s2[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
            b2 += 64
        q = np.uint64(b3) >> np.uint64(6)
        sh = np.uint64(b3 & 63)
        w = (s3[q] >> sh) | ((s3[q + ONE] << ONE) << (np.uint64(63) - sh))
        u = _tz(~w)
        if u < w32:
            g3 = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
            b3 += np.int64(u + ONE + kk)
        else:
            q = (b3 + 32) >> 6
            sh = np.uint64((b3 + 32) & 63)
            g3 = np.int64(((s3[q] >> sh) | ((s3[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
            b3 += 64
        r0 = r + g0 + 1
        r1 = r0 + g1 + 1
        r2 = r1 + g2 + 1
        r = r2 + g3 + 1
        if r >= n_b or b0 > lim0 or b1 > lim1 or b2 > lim2 or b3 > lim3:
            return 12
        words[np.uint64(w0 + (r0 >> 6))] ^= ONE << np.uint64(r0 & 63)
        words[np.uint64(w0 + (r1 >> 6))] ^= ONE << np.uint64(r1 & 63)
        words[np.uint64(w0 + (r2 >> 6))] ^= ONE << np.uint64(r2 & 63)
        words[np.uint64(w0 + (r >> 6))] ^= ONE << np.uint64(r & 63)
    for j in range(full, count):
        lane = j - full
        if lane == 0:
            q = b0 >> 6
            sh = np.uint64(b0 & 63)
            w = (s0[q] >> sh) | ((s0[q + 1] << ONE) << (np.uint64(63) - sh))
            u = _tz(~w)
            if u < w32:
                g = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
                b0 += np.int64(u + ONE + kk)
            else:
                q = (b0 + 32) >> 6
                sh = np.uint64((b0 + 32) & 63)
                g = np.int64(((s0[q] >> sh) | ((s0[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
                b0 += 64
        elif lane == 1:
            q = b1 >> 6
            sh = np.uint64(b1 & 63)
            w = (s1[q] >> sh) | ((s1[q + 1] << ONE) << (np.uint64(63) - sh))
            u = _tz(~w)
            if u < w32:
                g = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
                b1 += np.int64(u + ONE + kk)
            else:
                q = (b1 + 32) >> 6
                sh = np.uint64((b1 + 32) & 63)
                g = np.int64(((s1[q] >> sh) | ((s1[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
                b1 += 64
        else:
            q = b2 >> 6
            sh = np.uint64(b2 & 63)
            w = (s2[q] >> sh) | ((s2[q + 1] << ONE) << (np.uint64(63) - sh))
            u = _tz(~w)
            if u < w32:
                g = np.int64((u << kk) | ((w >> (u + ONE)) & kmask))
                b2 += np.int64(u + ONE + kk)
            else:
                q = (b2 + 32) >> 6
                sh = np.uint64((b2 + 32) & 63)
                g = np.int64(((s2[q] >> sh) | ((s2[q + 1] << ONE) << (np.uint64(63) - sh))) & m32)
                b2 += 64
        r += g + 1
        if r >= n_b:
            return 12
        words[w0 + (r >> 6)] ^= ONE << np.uint64(r & 63)
    if b0 > 8 * lens[0] or b1 > 8 * lens[1] or b2 > 8 * lens[2] or b3 > 8 * lens[3]:
        return 12
    if not (B._clean_end(s0, b0, lens[0]) and B._clean_end(s1, b1, lens[1])):
        return 12
    if not (B._clean_end(s2, b2, lens[2]) and B._clean_end(s3, b3, lens[3])):
        return 12
    return 0


@njit(nogil=True)
def _parse(data, n, width_bits, tmpl):
    """(status, K, split, thresholds, n_b, bitmaps, differences, each group's first difference,
    exception positions, their old buckets); status 0 is success, else the failed check's number."""
    z64 = np.zeros(0, np.int64)
    zu = np.zeros(0, np.uint64)
    zb = np.zeros(0, np.uint8)
    zd = tmpl[:0].copy()
    fail = (z64, z64, z64, zu, z64, zd, z64, z64, zb)
    if data.size < 8:
        return 1, 0, *fail
    c = np.int64(data[0]) | np.int64(data[1]) << 8 | np.int64(data[2]) << 16 | np.int64(data[3]) << 24
    K = np.int64(data[4])
    bits = np.int64(data[6])
    G = np.int64(data[7])
    if not (1 <= K <= MAX_K and 1 <= G <= MAX_G and 0 < c <= n and bits <= 8) or (bits == 0 and K + G != 2):
        return 2, 0, *fail
    pos = 8
    if data.size < pos + K + G - 2:
        return 3, 0, *fail
    thr = np.zeros(K - 1, np.int64)
    vthr = np.zeros(G - 1, np.int64)
    for t in range(K + G - 2):
        x = np.int64(data[pos + t])
        first = t == 0 or t == K - 1
        if t < K - 1:
            thr[t] = x
        else:
            vthr[t - K + 1] = x
        if x < 1 or x >= (1 << bits) or (not first and x <= data[pos + t - 1]):
            return 4, 0, *fail
    pos += K + G - 2
    ne, pos = B._get_varint(data, pos)
    if ne < 0 or ne > c:
        return 5, 0, *fail
    exc = np.empty(ne, np.int64)
    exb = np.empty(ne, np.uint8)
    p = -1
    for j in range(ne):
        g, pos = B._get_varint(data, pos)
        if g < 0 or p + g + 1 >= n:
            return 6, 0, *fail
        p += g + 1
        exc[j] = p
    if data.size < pos + ne:
        return 6, 0, *fail
    for j in range(ne):
        exb[j] = data[pos + j]
        if (exb[j] >> 4) >= K or (exb[j] & 15) >= G:
            return 6, 0, *fail
    pos += ne
    nb = np.zeros(K, np.int64)
    cb = np.zeros(K, np.int64)
    kr = np.zeros(K, np.int64)
    inv = np.zeros(K, np.int64)
    blen = np.zeros(K, np.int64)
    tot_n = 0
    for b in range(K):
        nb[b], pos = B._get_varint(data, pos)
        cb[b], pos = B._get_varint(data, pos)
        if nb[b] < 0 or cb[b] < 0 or cb[b] > nb[b]:
            return 7, 0, *fail
        tot_n += nb[b]
        if cb[b] == 0:
            continue
        if pos >= data.size:
            return 7, 0, *fail
        kr[b] = data[pos] >> 1
        inv[b] = data[pos] & 1
        blen[b], pos = B._get_varint(data, pos + 1)
        if kr[b] > 30 or (inv[b] == 1) != (2 * cb[b] > nb[b]) or blen[b] < 0:
            return 8, 0, *fail
    if tot_n != n or cb.sum() != c:
        return 9, 0, *fail
    mg = np.zeros(G, np.int64)
    freq = np.zeros((G, NSYM), np.int64)
    elen = np.zeros(G, np.int64)
    rlen = np.zeros(G, np.int64)
    for g in range(G):
        mg[g], pos = B._get_varint(data, pos)
        if mg[g] < 0 or mg[g] > c or (g == G - 1 and mg.sum() != c):
            return 10, 0, *fail
        if mg[g] == 0:
            continue
        if pos >= data.size:
            return 10, 0, *fail
        nsym = np.int64(data[pos])
        pos += 1
        if nsym < 1 or nsym > NSYM:
            return 10, 0, *fail
        s = 0
        for q in range(nsym):
            freq[g, q], pos = B._get_varint(data, pos)
            if freq[g, q] < 0:
                return 10, 0, *fail
            s += freq[g, q]
        elen[g], pos = B._get_varint(data, pos)
        rlen[g], pos = B._get_varint(data, pos)
        if s != PROB_ONE or elen[g] < 0 or rlen[g] < 0:
            return 10, 0, *fail
    if pos + blen.sum() + elen.sum() + rlen.sum() != data.size:
        return 11, 0, *fail
    # each bucket's bitmap starts at a word; the pass on a wrong base can run it up to CHECK
    # elements past its end before its next check sees it: that much spare
    wbase = np.zeros(K + 1, np.int64)
    spare = min(n, CHECK) + 128
    for b in range(K):
        wbase[b + 1] = wbase[b] + (nb[b] + spare + 63) // 64
    words = np.zeros(wbase[K] + 2, np.uint64)
    for b in range(K):
        if cb[b] == 0:
            continue
        ng = nb[b] - cb[b] if inv[b] else cb[b]
        bad = _rice_decode(data, pos, blen[b], ng, kr[b], nb[b], inv[b], words, wbase[b])
        if bad:
            return bad, 0, *fail
        pos += blen[b]
    diffs = np.empty(c + 64, tmpl.dtype)
    dstart = np.zeros(G + 1, np.int64)
    zmax = (ONE << np.uint64(width_bits)) - ONE
    for g in range(G):
        dstart[g + 1] = dstart[g] + mg[g]
        if mg[g] == 0:
            continue
        esec = B._padded_words(data, pos, elen[g])
        pos += elen[g]
        bad = _rans_decode16(data, pos, rlen[g], freq[g], diffs, dstart[g], mg[g], esec, elen[g], zmax)
        if bad:
            return bad, 0, *fail
        pos += rlen[g]
    return 0, K, thr, vthr, nb, words, wbase, diffs, dstart, exc, exb


# --- the codec ------------------------------------------------------------------------------------
BUCKETS = 4


def supports(dtype: str) -> bool:
    return ITEMSIZE[dtype] in (1, 2, 4)


def encode_block(
    dtype: str, old: np.ndarray, new: np.ndarray, k: int = BUCKETS, bmi2: bool = B.HAS_BMI2
) -> tuple[bytes, int]:
    shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
    width = 8 * old.dtype.itemsize
    thr, vthr = _plan(old, new, shift, bits, k, width)
    K = thr.size + 1
    n = old.size
    top = 1 << (width - 1)
    lim = np.full(MAX_K, top, old.dtype)
    lim[: K - 1] = thr << shift
    stride = n // 64 + 4
    bmap = np.empty(K * stride, np.uint64)  # each bucket's changed flags over its ranks
    acc, nacc, wpos = np.zeros(K, np.uint64), np.zeros(K, np.int64), np.zeros(K, np.int64)
    G = vthr.size + 1
    vals = np.empty((MAX_G, n + 64), old.dtype)  # zigzag codes of each group's changes, in order
    nv, exc, nes = np.zeros(G, np.int64), np.empty(n + 1, np.int64), np.zeros(1, np.int64)
    scan = scan_for(K, G, bmi2)
    vlim = np.full(MAX_G, top, old.dtype)
    vlim[: G - 1] = vthr << shift
    fmask = (1 << bits) - 1
    blut = np.searchsorted(thr, np.arange(fmask + 1), side="right").astype(np.int64)
    glut = np.searchsorted(vthr, np.arange(fmask + 1), side="right").astype(np.int64)
    scan(
        old,
        new,
        n // 64,
        lim,
        vlim,
        old.dtype.type(top - 1),
        old.dtype.type(fmask << shift),
        shift,
        fmask,
        blut,
        glut,
        bmap,
        stride,
        acc,
        nacc,
        wpos,
        vals[0],
        vals[1],
        vals[2],
        vals[3],
        nv,
        exc,
        nes,
    )
    data, changed = _encode(
        old, new, shift, bits, width, bmi2, thr, vthr, bmap, stride, acc, nacc, wpos, vals, nv, exc, nes
    )
    return data.tobytes(), changed


HASH_WHOLE = 1 << 20  # blocks of up to this many elements are decoded in one call, then hashed (from cache)


class Parsed:
    def __init__(self, dtype: str, block: memoryview, n: int, dt: np.dtype, what: str) -> None:
        if len(block) < 8:
            raise FormatError(f"{what}: truncated ctx3 block")
        shift, bits = EXPONENT_FIELD.get(dtype, (0, 0))
        if block[5] != shift or block[6] != bits:
            raise FormatError(f"{what}: ctx3 block's exponent field ({block[5]}, {block[6]}) is not {dtype}'s")
        got = _parse(np.frombuffer(block, dtype=np.uint8), n, 8 * dt.itemsize, np.zeros(1, dt))
        status, K, thr, vthr, nb, words, wbase, diffs, dstart, exc, exb = got
        if status:
            raise FormatError(f"{what}: bad ctx3 block (check {status} failed)")
        self.K, self.G, self.shift, self.fmask, self.thr, self.vthr, self.nb = (
            K,
            vthr.size + 1,
            shift,
            (1 << bits) - 1,
            thr,
            vthr,
            nb,
        )
        self.words, self.wbase, self.diffs, self.dstart, self.exc, self.exb = words, wbase, diffs, dstart, exc, exb
        self.dt = dt

    @property
    def lut(self) -> np.ndarray:
        return np.searchsorted(self.thr, np.arange(self.fmask + 1), side="right").astype(np.int64)

    @property
    def glut(self) -> np.ndarray:
        return np.searchsorted(self.vthr, np.arange(self.fmask + 1), side="right").astype(np.int64)


def decode_block(dtype, block, old, out, what, hasher=None, bmi2=B.HAS_BMI2) -> None:
    if len(block) == 0:
        copy(old, out, hasher)
        return
    p = Parsed(dtype, block, old.size, old.dtype, what)
    top = 1 << (8 * old.dtype.itemsize - 1)
    lim = np.full(MAX_K, top, old.dtype)
    lim[: p.K - 1] = p.thr << p.shift
    vlim = np.full(MAX_G, top, old.dtype)
    vlim[: p.G - 1] = p.vthr << p.shift
    dptr, dend = p.dstart[:-1].copy(), p.dstart[1:]
    off = p.wbase[:-1] * 64
    ends = off + p.nb
    run = pass_for(p.K, p.G, bmi2)
    step = min(SLICE, max(64, (SLICE_BYTES // old.dtype.itemsize) // 64 * 64))
    absmask = old.dtype.type(top - 1)
    n = old.size
    chunk = n if hasher is None or n <= HASH_WHOLE else step
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        if run(out, old, a, e, lim, vlim, absmask, p.words, off, ends, dptr, dend, p.diffs):
            raise FormatError(f"{what}: ctx3 block's bucket sizes do not match its base")
        if hasher is not None:
            hasher.update(out[a:e])


def _changes(p: Parsed, buckets: np.ndarray, groups: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions and differences, by prefix sums and gathers (the GPU's steps): an element's rank in
    its bucket is a prefix sum of membership, its changed flag a gather from the bucket's bitmap,
    the index of its difference a prefix sum of the changed flags within its value group."""
    changed = np.zeros(buckets.size, bool)
    for b in range(p.K):
        member = buckets == b
        if np.count_nonzero(member) != p.nb[b]:
            raise FormatError(f"{what}: ctx3 block's bucket sizes do not match its base")
        bit = p.wbase[b] * 64 + np.cumsum(member)[member] - 1
        changed[member] = (p.words[bit >> 6] >> (bit & 63).astype(np.uint64)) & np.uint64(1) != 0
    idx = np.flatnonzero(changed)
    group = groups[idx]
    didx = np.empty(idx.size, np.int64)
    for g in range(p.G):
        sel = group == g
        if np.count_nonzero(sel) != p.dstart[g + 1] - p.dstart[g]:
            raise FormatError(f"{what}: ctx3 block's value groups do not match its base")
        didx[sel] = p.dstart[g] + np.cumsum(sel)[sel] - 1
    return idx, p.diffs[didx]


def _exponents(p: Parsed, values: np.ndarray) -> np.ndarray:
    return (values.astype(np.int64) >> p.shift) & p.fmask


def decode_reference(dtype: str, block: bytes, old: np.ndarray, what: str = "block") -> np.ndarray:
    if len(block) == 0:
        return old.copy()
    p = Parsed(dtype, memoryview(block), old.size, old.dtype, what)
    e = _exponents(p, old)
    idx, d = _changes(p, p.lut[e], p.glut[e], what)
    out = old.copy()
    out[idx] = old[idx] + d
    return out


def decode_backward(dtype: str, block: bytes, new: np.ndarray, what: str = "block") -> np.ndarray:
    if len(block) == 0:
        return new.copy()
    p = Parsed(dtype, memoryview(block), new.size, new.dtype, what)
    e = _exponents(p, new)
    buckets, groups = p.lut[e], p.glut[e]
    buckets[p.exc] = p.exb >> 4
    groups[p.exc] = p.exb & 15
    idx, d = _changes(p, buckets, groups, what)
    old = new.copy()
    old[idx] = new[idx] - d
    e = _exponents(p, old)
    if np.any((p.lut[e] != buckets) | (p.glut[e] != groups)):
        raise FormatError(f"{what}: ctx3 block does not code a change to these elements")
    return old
