"""Bit and vector instructions for the numba kernels, as LLVM intrinsics (docs/DESIGN.md, "ans").

Each works on 64 elements or a 64-bit mask at a time: LLVM lowers the vector ones to SSE/AVX
compares and, with AVX-512 VBMI2, to ``vpexpand``/``vpcompress``; elsewhere to scalar code that is
still correct but tests each of the 64 lanes. ``pdep``/``pext`` are BMI2 instructions, microcoded on
AMD CPUs before Zen 3. So the kernels come in kinds that produce the same bits: the native one
(the instructions and intrinsics) where both are fast, and the portable one, whose
deposit (all of a word's buckets in one call), expand-add and compress-store take a step per
change of a delta's sparse masks, or table steps per byte for a word of many changes (the portable
scan lists each change's rank in its bucket instead of extracting, :mod:`weightsync.codec.ans`);
a third kind, for a CPU with fast BMI2 but no VBMI2, takes the instructions and the portable
vector steps (:data:`KINDS`, :data:`NATIVE`: the default).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from weightsync.codec.jit import njit

ONE = np.uint64(1)
ZERO = np.uint64(0)
ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def _int_intrinsic(name: str, nargs: int):
    """The code generator of a call to the 64-bit integer intrinsic ``name``."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        if name in ("llvm.cttz", "llvm.ctlz"):
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
def trailing_zeros(typingctx, x):
    """Index of the lowest set bit of a uint64 (64 for zero): LLVM's cttz, one instruction."""
    return types.uint64(types.uint64), _int_intrinsic("llvm.cttz", 1)


@intrinsic
def leading_zeros(typingctx, x):
    """Zero bits above the highest set bit of a uint64 (64 for zero): LLVM's ctlz, one instruction."""
    return types.uint64(types.uint64), _int_intrinsic("llvm.ctlz", 1)


@intrinsic
def popcount(typingctx, x):
    """Set bits of a uint64."""
    return types.uint64(types.uint64), _int_intrinsic("llvm.ctpop", 1)


@intrinsic
def mulhi(typingctx, x, y):
    """The high 64 bits of the 128-bit product of two uint64s: one ``mul``/``mulx`` on x86-64
    (``umulh`` on AArch64)."""

    def codegen(context, builder, signature, args):
        i128 = ir.IntType(128)
        p = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        return builder.trunc(builder.lshr(p, ir.Constant(i128, 64)), ir.IntType(64))

    return types.uint64(types.uint64, types.uint64), codegen


@intrinsic
def pdep_bmi2(typingctx, x, m):
    """BMI2's parallel bit deposit: the low bits of ``x`` into the set bits of ``m``, in order."""
    return types.uint64(types.uint64, types.uint64), _int_intrinsic("llvm.x86.bmi.pdep.64", 2)


@intrinsic
def pext_bmi2(typingctx, x, m):
    """BMI2's parallel bit extract: the bits of ``x`` at the set bits of ``m``, packed low."""
    return types.uint64(types.uint64, types.uint64), _int_intrinsic("llvm.x86.bmi.pext.64", 2)


def _byte_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per byte value m: the position of its r-th set bit at ``[8 m + r]`` (255 past its last), for
    :func:`_select`; and ``pdep(x, m)`` at ``[at[m] + x]`` for each x below ``2**popcount(m)`` (3**8
    bytes in all, so they stay in L1), for :func:`pdep_bytes`."""
    select = np.full(256 * 8, 255, np.uint8)
    at = np.zeros(256, np.uint16)
    deposit: list[int] = []
    for m in range(256):
        bits = [b for b in range(8) if m >> b & 1]
        select[m * 8 : m * 8 + len(bits)] = bits
        at[m] = len(deposit)
        deposit += [sum(1 << b for i, b in enumerate(bits) if x >> i & 1) for x in range(1 << len(bits))]
    return select, at, np.array(deposit, np.uint8)


_SELECT8, _DEPOSIT8_AT, _DEPOSIT8 = _byte_tables()
L8 = np.uint64(0x0101010101010101)
H8 = np.uint64(0x8080808080808080)
DENSE = np.uint64(4)
"""Changes in a word above which :func:`deposit_soft` deposits byte by byte rather than bit by bit."""


@njit(nogil=True, inline="always")
def _low(p):
    """The low ``p`` bits set (0 <= p <= 64)."""
    return (ALL >> ((np.uint64(64) - p) & np.uint64(63))) & (ZERO - np.uint64(p != ZERO))


@njit(nogil=True, inline="always")
def _byte_prefix(m):
    """Each byte of ``m``: the set bits of ``m`` in that byte and the bytes below it (SWAR counts)."""
    s = m - ((m >> ONE) & np.uint64(0x5555555555555555))
    s = (s & np.uint64(0x3333333333333333)) + ((s >> np.uint64(2)) & np.uint64(0x3333333333333333))
    return ((s + (s >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)) * L8


@njit(nogil=True, inline="always")
def _select(m, pre, i):
    """The bit of ``m``'s i-th set bit (``pre``: :func:`_byte_prefix` of ``m``): it is in the byte
    where the counts pass i."""
    k = popcount((((i * L8) | H8) - pre) & H8) << np.uint64(3)
    r = i - (((pre << np.uint64(8)) >> k) & np.uint64(0xFF))
    return ONE << (k + np.uint64(_SELECT8[((m >> k) & np.uint64(0xFF)) * np.uint64(8) + r]))


@njit(nogil=True, inline="always")
def pdep_soft(x, m):
    """``pdep`` without BMI2: one step per set bit of ``x`` that lands in ``m`` (a select among
    ``m``'s set bits by byte counts), so a sparse ``x`` costs little whatever ``m`` holds."""
    x &= _low(popcount(m))
    if x == ZERO:
        return ZERO
    pre = _byte_prefix(m)
    out = ZERO
    while x != ZERO:
        out |= _select(m, pre, trailing_zeros(x))
        x &= x - ONE
    return out


@njit(nogil=True, inline="always")
def pdep_bytes(x, m):
    """``pdep`` without BMI2 and without a branch: eight table steps, one per byte of ``m``."""
    out = ZERO
    for k in range(8):
        mb = (m >> np.uint64(8 * k)) & np.uint64(0xFF)
        c = popcount(mb)
        out |= np.uint64(_DEPOSIT8[np.uint64(_DEPOSIT8_AT[mb]) + (x & _low(c))]) << np.uint64(8 * k)
        x >>= c
    return out


@njit(nogil=True, inline="always")
def deposit_soft(x0, m0, x1, m1, x2, m2, x3, m3):
    """``pdep(x0, m0) | .. | pdep(x3, m3)`` for disjoint masks (a word's buckets; an unused one is
    0), the portable kind: one loop over the word's changes (the buckets' bits side by side in one
    word), each a select in its bucket's mask. Per bucket (:func:`pdep_soft`) there would be a
    loop per bucket, and a mispredicted branch at the end of each."""
    p0, p1, p2 = popcount(m0), popcount(m1), popcount(m2)
    x0 &= _low(p0)
    x1 &= _low(p1)
    x2 &= _low(p2)
    x3 &= _low(popcount(m3))
    q1 = p0  # where each bucket's bits start in v (a bucket starting at 64 is empty, with x 0)
    q2 = q1 + p1
    q3 = q2 + p2
    v = x0 | (x1 << (q1 & np.uint64(63))) | (x2 << (q2 & np.uint64(63))) | (x3 << (q3 & np.uint64(63)))
    if popcount(v) > DENSE:
        return pdep_bytes(x0, m0) | pdep_bytes(x1, m1) | pdep_bytes(x2, m2) | pdep_bytes(x3, m3)
    out = ZERO
    while v != ZERO:
        i = trailing_zeros(v)
        v &= v - ONE
        m, r = m0, i  # the bucket of bit i, without a branch
        if i >= q1:
            m, r = m1, i - q1
        if i >= q2:
            m, r = m2, i - q2
        if i >= q3:
            m, r = m3, i - q3
        out |= _select(m, _byte_prefix(m), r)
    return out


@njit(nogil=True, inline="always")
def pext_soft(x, m):
    """``pext`` without BMI2: one step per set bit of ``x & m`` (its rank among ``m``'s set bits)."""
    y = x & m
    out = ZERO
    while y != ZERO:
        low = y & (ZERO - y)
        out |= ONE << popcount(m & (low - ONE))
        y ^= low
    return out


def _compiled_for() -> tuple[str, dict]:
    """The CPU numba compiles for and its features, as its code generator takes them: the host's, or
    ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` where set (a name alone keeps the host's features,
    but ``generic`` none), and ``NUMBA_ENABLE_AVX=0`` turns off every AVX feature. Code that uses an
    instruction these lack fails to compile, and LLVM aborts the process."""
    try:
        name = config.CPU_NAME or llvm_binding.get_host_cpu_name()
        flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    except Exception:  # noqa: BLE001 - an LLVM that cannot say (or not x86): the portable path
        return "", {}
    return name, _effective(flat)


_NEEDS = {
    "avx512vbmi2": ("avx512bw",),
    "avx512bw": ("avx512f",),
    "avx512vl": ("avx512f",),
    "avx512f": ("avx2", "fma", "f16c"),
    "avx2": ("avx",),
    "fma": ("avx",),
    "f16c": ("avx",),
    "avx": ("sse4.2",),
    "sse4.2": ("sse4.1",),
    "sse4.1": ("ssse3",),
    "ssse3": ("sse3",),
    "sse3": ("sse2",),
}
"""What LLVM's x86 features that the kernels look at need (LLVM's own dependencies, among these)."""


def _effective(flat: str) -> dict:
    """The features a list like ``+avx2,-fma,..`` leaves on, as LLVM reads it: in order, ``+x`` turns on
    x and what it needs, ``-x`` turns off x and what needs it. Read as written, ``-fma`` or ``-avx2``
    or ``-avx512bw`` beside ``+avx512vbmi2`` still made the kernels use AVX-512 VBMI2, which LLVM had
    turned off with them, and it aborted the process on them."""
    on: dict[str, bool] = {}

    def enable(f: str) -> None:
        on[f] = True
        for n in _NEEDS.get(f, ()):
            enable(n)

    def disable(f: str) -> None:
        on[f] = False
        for g, needs in _NEEDS.items():
            if f in needs and on.get(g, True):
                disable(g)

    for f in flat.split(","):
        if len(f) > 1 and f[0] in "+-":
            (enable if f[0] == "+" else disable)(f[1:])
    return on


_HOST_CPU, _FEATURES = _compiled_for()

_FOR_HOST = config.CPU_NAME in (None, "host")  # NUMBA_CPU_NAME: numba compiles for another CPU (a portable cache)

HAS_BMI2 = _FOR_HOST and _FEATURES.get("bmi2", False)
"""Whether this CPU has ``pdep``/``pext`` (x86 BMI2) and numba compiles for it: whether the native
kernels can run here at all."""

SLOW_PDEP_CPUS = ("znver1", "znver2", "bdver4")
"""LLVM's names of CPUs with BMI2 whose ``pdep``/``pext`` are microcoded: about 2-4 cycles per set bit
of the mask (AMD before Zen 3), several times the portable steps on a delta's sparse bits."""

PORTABLE, VECTOR, BMI2 = 0, 1, 2
"""The kinds of kernel, as the ``native`` argument of :mod:`weightsync.codec.ans`'s functions takes them
(``False`` and ``True`` are the first two):

- ``VECTOR`` (the native kind): ``pdep``/``pext`` and AVX-512 VBMI2's vector expand-loads and
  compress-stores, with the wide rANS sections by vector steps (:mod:`weightsync.codec.lanes`);
- ``BMI2``: ``pdep``/``pext`` (the native kind's passes, bitmaps), with the portable expand-add,
  compress and scalar rANS steps: for a CPU with fast BMI2 but no VBMI2 (AMD Zen 3, Intel
  Skylake-SP to Cascade Lake), where LLVM turns each vector expand or compress into 64 tested lanes;
- ``PORTABLE``: no BMI2 at all (a deposit and rank lists by steps per change, :func:`deposit_soft`).

All three write the same bytes."""

KIND_NAMES = {VECTOR: "native", BMI2: "bmi2", PORTABLE: "portable"}

KINDS = (VECTOR, BMI2, PORTABLE) if HAS_BMI2 else (PORTABLE,)
"""The kinds of kernel this CPU can run, for tests that try each."""


def kind_of(native) -> int:
    """``native`` as one of the kinds' values (``True`` and ``False`` are the native and the portable
    kind); anything else is refused with a ValueError."""
    if type(native) is int and native in KIND_NAMES:  # the common case first: a check per block
        return native
    if isinstance(native, (bool, np.bool_)) or (isinstance(native, (int, np.integer)) and native in KIND_NAMES):
        return int(native)
    raise ValueError(f"no kernels of kind {native!r}: one of {sorted(KIND_NAMES)}")


def uses_bmi2(native) -> bool:
    """Whether kernels of kind ``native`` use ``pdep``/``pext`` (and the scan's bitmaps)."""
    return kind_of(native) != PORTABLE


def uses_vectors(native) -> bool:
    """Whether kernels of kind ``native`` use the vector expand-loads and compress-stores (and wide rANS
    sections by vector steps)."""
    return kind_of(native) == VECTOR


_FAST_BMI2 = HAS_BMI2 and _HOST_CPU not in SLOW_PDEP_CPUS

NATIVE = (VECTOR if _FEATURES.get("avx512vbmi2", False) else BMI2) if _FAST_BMI2 else PORTABLE
"""The kind of kernel used by default: the native one (``VECTOR``) on a CPU with fast BMI2 and AVX-512
VBMI2; ``BMI2`` on one with fast BMI2 alone; else ``PORTABLE`` (no BMI2, or a microcoded one). Without
VBMI2, LLVM turns each expand-load or compress-store into 64 tested lanes; without a fast ``pdep``
the portable deposit, one step per set bit of the changes' masks, is several times faster on a delta
(docs/DESIGN.md, "Kinds of kernel"). All write the same bytes."""


COMPRESS_IN_REGISTER = all(_FEATURES.get(f, False) for f in ("avx512f", "avx512vl", "avx512vbmi2"))
"""Whether :func:`_compress_store` compresses in a register and stores the whole vector (numba compiles
for ``vpcompress`` of every element size), rather than with LLVM's masked compress-store. A
``vpcompress`` to memory is microcoded on AMD Zen 4: there the native encoder ran at 0.34-0.46x the
portable one's speed with compress-stores (every BF16 tensor of a step pair; the 2.03 GiB pair's
encode at 1.01 GB/s against `sparse`'s 4.66); on an Intel Xeon the register form measured the same
(docs/DESIGN.md, "Encoding"). It follows from the features alone, which key numba's cache of the
kernels that use it."""

COMPRESS_RANKS = _FEATURES.get("avx512f", False)
"""Whether a compress-store of 32-bit ranks (:func:`compress_ranks`) is one instruction (AVX-512F's
``vpcompressd``); without it LLVM tests each of the 64 lanes, and a loop over the set bits is faster."""

_VBMI2_WITHOUT_VL = _FEATURES.get("avx512vbmi2", False) and not _FEATURES.get("avx512vl", False)

SPARE = 32
"""Elements an array written by :func:`_compress_store` needs past the last one it keeps: the register
form stores every lane of a 32-lane vector."""


def _compress_store(builder, v, ptr, mask) -> None:
    """The lanes of the vector ``v`` whose bit of the <n x i1> ``mask`` is set, in order, to memory
    from ``ptr``. In a register (:data:`COMPRESS_IN_REGISTER`): one ``vpcompress`` per 512 bits and a
    store of all its lanes, so the :data:`SPARE` elements past the last one kept are overwritten;
    else LLVM's masked compress-store, which writes only those kept."""
    n, width = v.type.count, v.type.element.width
    if not _masked_ok(n, width):
        _compress_lanes(builder, v, ptr, mask)
        return
    if not COMPRESS_IN_REGISTER:
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [v.type, ptr.type, mask.type]),
            f"llvm.masked.compressstore.v{n}i{width}",
        )
        builder.call(fn, [v, ptr, mask])
        return
    lanes = min(n, 512 // width)
    vt, mt = ir.VectorType(v.type.element, lanes), ir.VectorType(ir.IntType(1), lanes)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vt, [vt, vt, mt]), f"llvm.x86.avx512.mask.compress.v{lanes}i{width}"
    )
    i32, mi = ir.IntType(32), ir.IntType(lanes)
    pop = builder.module.declare_intrinsic("llvm.ctpop", [mi], ir.FunctionType(mi, [mi]))
    for start in range(0, n, lanes):
        if lanes < n:
            idx = ir.Constant(ir.VectorType(i32, lanes), list(range(start, start + lanes)))
            piece, m = builder.shuffle_vector(v, v, idx), builder.shuffle_vector(mask, mask, idx)
        else:
            piece, m = v, mask
        packed = builder.call(fn, [piece, ir.Constant(vt, None), m])
        builder.store(packed, builder.bitcast(ptr, vt.as_pointer()), align=width // 8)
        if start + lanes < n:
            ptr = builder.gep(ptr, [builder.zext(builder.call(pop, [builder.bitcast(m, mi)]), ir.IntType(64))])


def _masked_ok(lanes: int, width: int) -> bool:
    """Whether LLVM's masked compress-store and expand-load of ``lanes`` elements of ``width`` bits
    compile here: not for 8- or 16-bit elements in under 512 bits where numba compiles for AVX-512
    VBMI2 without VL (LLVM takes them as legal, then asserts, and the process aborts)."""
    return not (_VBMI2_WITHOUT_VL and width < 32 and lanes * width < 512)


def _compress_lanes(builder, v, ptr, mask) -> None:
    """:func:`_masked_ok`'s other way of a compress-store: lane by lane, a kept lane to the next
    position, another to the one after the kept ones (so one element past them must be writable)."""
    n, width = v.type.count, v.type.element.width
    i64, i32, mi = ir.IntType(64), ir.IntType(32), ir.IntType(n)
    pop = builder.module.declare_intrinsic("llvm.ctpop", [mi], ir.FunctionType(mi, [mi]))
    at, spare = ir.Constant(i64, 0), builder.zext(builder.call(pop, [builder.bitcast(mask, mi)]), i64)
    for i in range(n):
        keep = builder.extract_element(mask, ir.Constant(i32, i))
        slot = builder.gep(ptr, [builder.select(keep, at, spare)])
        builder.store(builder.extract_element(v, ir.Constant(i32, i)), slot, align=width // 8)
        at = builder.add(at, builder.zext(keep, i64))


def _expand_lanes(builder, ptr, mask, vt):
    """:func:`_masked_ok`'s other way of a masked expand-load: lane by lane, reading as many elements
    from ``ptr`` as ``vt`` has lanes whatever the mask (they must be readable)."""
    i64, i32 = ir.IntType(64), ir.IntType(32)
    out, at = ir.Constant(vt, None), ir.Constant(i64, 0)
    for i in range(vt.count):
        take = builder.extract_element(mask, ir.Constant(i32, i))
        w = builder.load(builder.gep(ptr, [at]), align=vt.element.width // 8)
        out = builder.insert_element(out, builder.select(take, w, ir.Constant(vt.element, 0)), ir.Constant(i32, i))
        at = builder.add(at, builder.zext(take, i64))
    return out


def _vector_load(context, builder, aryty, ary, base, lanes: int):
    """``lanes`` elements of an array from index ``base``, as one LLVM vector."""
    arr = context.make_array(aryty)(context, builder, value=ary)
    vt = ir.VectorType(context.get_data_type(aryty.dtype), lanes)
    ptr = builder.bitcast(builder.gep(arr.data, [base]), vt.as_pointer())
    return builder.load(ptr, align=aryty.dtype.bitwidth // 8)


def _splat(builder, x, vt):
    """The scalar ``x`` (truncated to the element type) in every lane of ``vt``."""
    x = builder.trunc(x, vt.element) if x.type.width > vt.element.width else x
    s = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vt.count), [0] * vt.count)
    return builder.shuffle_vector(s, ir.Constant(vt, ir.Undefined), zeros)


@intrinsic
def below_mask64(typingctx, ary, base, absmask, lim):
    """Bit j set where ``(ary[base + j] & absmask) < lim`` for j < 64: one vector compare. ``absmask``
    and ``lim`` must leave the element's top bit clear (a magnitude against an exponent's limit): the
    compare is then the same signed or unsigned, and it is made signed, which x86 has for every
    width (an unsigned one takes AVX2 two instructions for one: the encoder's scan ran 5-9% faster)."""

    def codegen(context, builder, sig, args):
        v = _vector_load(context, builder, sig.args[0], args[0], args[1], 64)
        c = builder.icmp_signed(
            "<", builder.and_(v, _splat(builder, args[2], v.type)), _splat(builder, args[3], v.type)
        )
        return builder.bitcast(c, ir.IntType(64))

    return types.uint64(ary, base, absmask, lim), codegen


@intrinsic
def ne_mask64(typingctx, a, b, base):
    """Bit j set where ``a[base + j] != b[base + j]`` for j < 64."""

    def codegen(context, builder, sig, args):
        x = _vector_load(context, builder, sig.args[0], args[0], args[2], 64)
        y = _vector_load(context, builder, sig.args[1], args[1], args[2], 64)
        return builder.bitcast(builder.icmp_unsigned("!=", x, y), ir.IntType(64))

    return types.uint64(a, b, base), codegen


@intrinsic
def zero_mask64(typingctx, a, base):
    """Bit j set where ``a[base + j]`` is zero, for j < 64."""

    def codegen(context, builder, sig, args):
        x = _vector_load(context, builder, sig.args[0], args[0], args[1], 64)
        return builder.bitcast(builder.icmp_unsigned("==", x, ir.Constant(x.type, None)), ir.IntType(64))

    return types.uint64(a, base), codegen


@intrinsic
def field_ne_mask64(typingctx, a, b, base, field):
    """Bit j set where ``(a[base + j] ^ b[base + j]) & field`` is not zero, for j < 64."""

    def codegen(context, builder, sig, args):
        x = _vector_load(context, builder, sig.args[0], args[0], args[2], 64)
        y = _vector_load(context, builder, sig.args[1], args[1], args[2], 64)
        d = builder.and_(builder.xor(x, y), _splat(builder, args[3], x.type))
        return builder.bitcast(builder.icmp_unsigned("!=", d, ir.Constant(x.type, None)), ir.IntType(64))

    return types.uint64(a, b, base, field), codegen


PREFETCH = 1024
"""Elements ahead of a pass's position that :func:`prefetch64` asks the caches for. The passes stream
their arrays (old and new, or the base) from memory, and the hardware's prefetchers alone left the
encoder's scan waiting on it: over every tensor of the 2.03 GiB pair on an Intel Xeon the scan took
547 ms without, 438 with 256 elements ahead, 385 with 512, 364-369 with 1024-2048."""


# The intrinsic's name carries its pointer type: "p0" where LLVM's pointers are opaque (16 on), whatever
# llvmlite calls an i8*
_PREFETCH = "llvm.prefetch.p0" if llvm_binding.llvm_version_info[0] >= 16 else "llvm.prefetch.p0i8"


@intrinsic
def prefetch64(typingctx, ary, base):
    """Ask the caches for the 64 elements of ``ary`` from ``base + PREFETCH`` (each of their 64-byte
    lines, for reading): a hint, which never faults, past the array's end included."""

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, value=args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), _PREFETCH
        )
        at = builder.add(args[1], ir.Constant(ir.IntType(64), PREFETCH))
        for line in range(0, 64 * sig.args[0].dtype.bitwidth // 8, 64):
            ptr = builder.gep(builder.bitcast(builder.gep(arr.data, [at]), i8p), [ir.Constant(ir.IntType(64), line)])
            # read, keep in every level (locality 3), data cache
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(ary, base), codegen


# The masked expand-load and compress-store below work on two halves of 32 lanes: LLVM 22 fails
# ("Cannot emit physreg copy instruction") on some kernels with <64 x i1> masks.
def _half_mask(builder, mask, h: int):
    """The 32 bits of a uint64 mask for half ``h``, as a <32 x i1> vector."""
    i32 = ir.IntType(32)
    m32 = builder.trunc(builder.lshr(mask, ir.Constant(ir.IntType(64), 32 * h)), i32)
    return builder.bitcast(m32, ir.VectorType(ir.IntType(1), 32))


def _half_offset(builder, pos, mask, h: int):
    """``pos`` advanced past the low half's set bits of ``mask`` for half 1."""
    if not h:
        return pos
    i32 = ir.IntType(32)
    pop = builder.module.declare_intrinsic("llvm.ctpop", [i32], ir.FunctionType(i32, [i32]))
    return builder.add(pos, builder.zext(builder.call(pop, [builder.trunc(mask, i32)]), ir.IntType(64)))


def _expand_add(groups: int):
    """The intrinsic ``f(out, src, base, diffs, p0, m0, ..)``: ``out[base + j] = src[base + j] + d``
    for j < 64, where d is, for the one of ``groups`` (pointer, mask) pairs whose mask has bit j set
    (masks disjoint), the next of ``diffs[p:]``, else 0: one masked expand-load per pair."""

    def typer(typingctx, out, src, base, diffs, *pm):
        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            o = context.make_array(aty)(context, builder, value=args[0])
            d = context.make_array(sig.args[3])(context, builder, value=args[3])
            vt = ir.VectorType(context.get_data_type(aty.dtype), 32)
            mt = ir.VectorType(ir.IntType(1), 32)
            name = f"llvm.masked.expandload.v32i{aty.dtype.bitwidth}"
            for h in range(2):
                at = builder.add(args[2], ir.Constant(ir.IntType(64), 32 * h))
                x = _vector_load(context, builder, sig.args[1], args[1], at, 32)
                for q in range(groups):
                    ptr = builder.gep(d.data, [_half_offset(builder, args[4 + 2 * q], args[5 + 2 * q], h)])
                    m = _half_mask(builder, args[5 + 2 * q], h)
                    if _masked_ok(32, aty.dtype.bitwidth):
                        fn = cgutils.get_or_insert_function(
                            builder.module, ir.FunctionType(vt, [ptr.type, mt, vt]), name
                        )
                        x = builder.add(x, builder.call(fn, [ptr, m, ir.Constant(vt, None)]))
                    else:
                        x = builder.add(x, _expand_lanes(builder, ptr, m, vt))
                builder.store(
                    x, builder.bitcast(builder.gep(o.data, [at]), vt.as_pointer()), align=aty.dtype.bitwidth // 8
                )
            return context.get_dummy_value()

        return types.none(out, src, base, diffs, *pm), codegen

    # numba's @intrinsic takes no *args: one signature per group count
    if groups == 1:
        return intrinsic(lambda tc, out, src, base, diffs, p0, m0: typer(tc, out, src, base, diffs, p0, m0))
    if groups == 2:
        return intrinsic(
            lambda tc, out, src, base, diffs, p0, m0, p1, m1: typer(tc, out, src, base, diffs, p0, m0, p1, m1)
        )
    if groups == 3:
        return intrinsic(
            lambda tc, out, src, base, diffs, p0, m0, p1, m1, p2, m2: typer(
                tc, out, src, base, diffs, p0, m0, p1, m1, p2, m2
            )
        )
    return intrinsic(
        lambda tc, out, src, base, diffs, p0, m0, p1, m1, p2, m2, p3, m3: typer(
            tc, out, src, base, diffs, p0, m0, p1, m1, p2, m2, p3, m3
        )
    )


EXPAND_ADD = {g: _expand_add(g) for g in range(1, 5)}
""":func:`_expand_add` for 1 to 4 (pointer, mask) pairs."""


def _compress_zigzag(groups: int):
    """The intrinsic ``f(old, new, base, dst0, pos0, mask0, ..)``: the zigzag codes of ``new - old``
    (wrapping) for the 64 elements from ``base``, computed once, and for each of ``groups`` (array,
    position, mask) triples those at the mask's set bits stored in order into the array from the
    position: a compress-store per group and 32 lanes (:func:`_compress_store`: each array needs
    :data:`SPARE` elements past the last it keeps). (One call per group loaded both arrays
    and coded them again for each: the encoder's scan of the small model at lr 1e-5, 4 groups, took
    15.5 ms against 14.3 with one call; the 2.03 GiB pair's, 2 groups, 329 against 317.)"""

    def typer(typingctx, old, new, base, *dpm):
        def codegen(context, builder, sig, args):
            width = sig.args[0].dtype.bitwidth
            vt = ir.VectorType(ir.IntType(width), 32)
            zs = []  # both halves' codes before any store: else the second half's words are loaded again
            for h in range(2):
                at = builder.add(args[2], ir.Constant(ir.IntType(64), 32 * h))
                a = _vector_load(context, builder, sig.args[0], args[0], at, 32)
                b = _vector_load(context, builder, sig.args[1], args[1], at, 32)
                diff = builder.sub(b, a)
                zs.append(
                    builder.xor(
                        builder.shl(diff, ir.Constant(vt, [1] * 32)),
                        builder.ashr(diff, ir.Constant(vt, [width - 1] * 32)),
                    )
                )
            for h, z in enumerate(zs):
                for q in range(groups):
                    dst, pos, mask = args[3 + 3 * q : 6 + 3 * q]
                    d = context.make_array(sig.args[3 + 3 * q])(context, builder, value=dst)
                    ptr = builder.gep(d.data, [_half_offset(builder, pos, mask, h)])
                    _compress_store(builder, z, ptr, _half_mask(builder, mask, h))
            return context.get_dummy_value()

        return types.none(old, new, base, *dpm), codegen

    # numba's @intrinsic takes no *args: one signature per group count
    if groups == 1:
        return intrinsic(lambda tc, old, new, base, d0, p0, m0: typer(tc, old, new, base, d0, p0, m0))
    if groups == 2:
        return intrinsic(
            lambda tc, old, new, base, d0, p0, m0, d1, p1, m1: typer(tc, old, new, base, d0, p0, m0, d1, p1, m1)
        )
    if groups == 3:
        return intrinsic(
            lambda tc, old, new, base, d0, p0, m0, d1, p1, m1, d2, p2, m2: typer(
                tc, old, new, base, d0, p0, m0, d1, p1, m1, d2, p2, m2
            )
        )
    return intrinsic(
        lambda tc, old, new, base, d0, p0, m0, d1, p1, m1, d2, p2, m2, d3, p3, m3: typer(
            tc, old, new, base, d0, p0, m0, d1, p1, m1, d2, p2, m2, d3, p3, m3
        )
    )


COMPRESS_ZIGZAG = {g: _compress_zigzag(g) for g in range(1, 5)}
""":func:`_compress_zigzag` for 1 to 4 groups."""


@intrinsic
def compress_ranks(typingctx, out, pos, x, base):
    """``base + j`` for each set bit j of the uint64 ``x``, in order, into ``out`` (uint32) from
    ``pos``: a compress-store per 32 lanes, which keeps popcount(x) elements and takes no step per
    bit (:func:`_compress_store`: ``out`` needs :data:`SPARE` elements past the last it keeps)."""

    def codegen(context, builder, sig, args):
        o = context.make_array(sig.args[0])(context, builder, value=args[0])
        i32 = ir.IntType(32)
        vt = ir.VectorType(i32, 32)
        splat = _splat(builder, args[3], vt)
        for h in range(2):
            ranks = builder.add(splat, ir.Constant(vt, [32 * h + j for j in range(32)]))
            ptr = builder.gep(o.data, [_half_offset(builder, args[1], args[2], h)])
            _compress_store(builder, ranks, ptr, _half_mask(builder, args[2], h))
        return context.get_dummy_value()

    return types.none(out, pos, x, base), codegen


@intrinsic
def compress_escapes(typingctx, out, pos, src, base, lim, valid):
    """``src[base + j] - lim`` for each j < 32 set in ``valid`` where ``src[base + j] >= lim``
    (unsigned), in order, into ``out`` (``src``'s dtype) from ``pos``; returns how many: a compare and
    a compress-store of 32 lanes (a value group's escapes; :func:`_compress_store`: ``out`` needs
    :data:`SPARE` elements past the last it keeps)."""

    def codegen(context, builder, sig, args):
        o = context.make_array(sig.args[0])(context, builder, value=args[0])
        v = _vector_load(context, builder, sig.args[2], args[2], args[3], 32)
        limit = _splat(builder, args[4], v.type)
        mask = builder.and_(builder.icmp_unsigned(">=", v, limit), _half_mask(builder, args[5], 0))
        _compress_store(builder, builder.sub(v, limit), builder.gep(o.data, [args[1]]), mask)
        i64 = ir.IntType(64)
        pop = builder.module.declare_intrinsic("llvm.ctpop", [i64], ir.FunctionType(i64, [i64]))
        return builder.call(pop, [builder.zext(builder.bitcast(mask, ir.IntType(32)), i64)])

    return types.uint64(out, pos, src, base, lim, valid), codegen


@intrinsic
def copy64(typingctx, out, src, base):
    """``out[base:base + 64] = src[base:base + 64]``: one vector load and store."""

    def codegen(context, builder, sig, args):
        x = _vector_load(context, builder, sig.args[1], args[1], args[2], 64)
        o = context.make_array(sig.args[0])(context, builder, value=args[0])
        ptr = builder.bitcast(builder.gep(o.data, [args[2]]), x.type.as_pointer())
        builder.store(x, ptr, align=sig.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(out, src, base), codegen


@njit(nogil=True, inline="always")
def _add_at(out, base, diffs, p, m):
    """``out[base + j] += diffs[p:]`` in order at the set bits j of ``m``, one step per bit."""
    while m != ZERO:
        j = base + np.int64(trailing_zeros(m))
        m &= m - ONE
        out[j] = out[j] + diffs[p]
        p += 1


@njit(nogil=True, inline="always")
def _expand_add_soft1(out, src, base, diffs, p0, m0):
    copy64(out, src, base)
    _add_at(out, base, diffs, p0, m0)


@njit(nogil=True, inline="always")
def _expand_add_soft2(out, src, base, diffs, p0, m0, p1, m1):
    copy64(out, src, base)
    _add_at(out, base, diffs, p0, m0)
    _add_at(out, base, diffs, p1, m1)


@njit(nogil=True, inline="always")
def _expand_add_soft3(out, src, base, diffs, p0, m0, p1, m1, p2, m2):
    copy64(out, src, base)
    _add_at(out, base, diffs, p0, m0)
    _add_at(out, base, diffs, p1, m1)
    _add_at(out, base, diffs, p2, m2)


@njit(nogil=True, inline="always")
def _expand_add_soft4(out, src, base, diffs, p0, m0, p1, m1, p2, m2, p3, m3):
    copy64(out, src, base)
    _add_at(out, base, diffs, p0, m0)
    _add_at(out, base, diffs, p1, m1)
    _add_at(out, base, diffs, p2, m2)
    _add_at(out, base, diffs, p3, m3)


EXPAND_ADD_SOFT = {1: _expand_add_soft1, 2: _expand_add_soft2, 3: _expand_add_soft3, 4: _expand_add_soft4}
""":data:`EXPAND_ADD` one step per set bit of the masks, after a vector copy (the portable kind)."""


@njit(nogil=True, inline="always")
def compress_zigzag_soft(old, new, base, dst, pos, mask):
    """:data:`COMPRESS_ZIGZAG` for one group, one step per set bit of ``mask`` (the portable kind)."""
    sh = np.int64(64 - 8 * old.itemsize)
    while mask != ZERO:
        j = base + np.int64(trailing_zeros(mask))
        mask &= mask - ONE
        s = np.int64(np.uint64(new[j] - old[j]) << np.uint64(sh)) >> sh
        dst[pos] = (s << 1) ^ (s >> 63)
        pos += 1


@njit(nogil=True, inline="always")
def _compress_zigzag_soft2(old, new, base, d0, p0, m0, d1, p1, m1):
    compress_zigzag_soft(old, new, base, d0, p0, m0)
    compress_zigzag_soft(old, new, base, d1, p1, m1)


@njit(nogil=True, inline="always")
def _compress_zigzag_soft3(old, new, base, d0, p0, m0, d1, p1, m1, d2, p2, m2):
    compress_zigzag_soft(old, new, base, d0, p0, m0)
    compress_zigzag_soft(old, new, base, d1, p1, m1)
    compress_zigzag_soft(old, new, base, d2, p2, m2)


@njit(nogil=True, inline="always")
def _compress_zigzag_soft4(old, new, base, d0, p0, m0, d1, p1, m1, d2, p2, m2, d3, p3, m3):
    compress_zigzag_soft(old, new, base, d0, p0, m0)
    compress_zigzag_soft(old, new, base, d1, p1, m1)
    compress_zigzag_soft(old, new, base, d2, p2, m2)
    compress_zigzag_soft(old, new, base, d3, p3, m3)


COMPRESS_ZIGZAG_SOFT = {
    1: compress_zigzag_soft,
    2: _compress_zigzag_soft2,
    3: _compress_zigzag_soft3,
    4: _compress_zigzag_soft4,
}
""":data:`COMPRESS_ZIGZAG` one step per set bit of the masks (the portable kind)."""


@intrinsic
def store64(typingctx, buf, pos, value):
    """Store ``value`` as 8 little-endian bytes at byte ``pos`` of a uint8 array (unaligned)."""

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, value=args[0])
        ptr = builder.bitcast(builder.gep(arr.data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return types.none(buf, pos, value), codegen
