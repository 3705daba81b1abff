"""The bit and vector helpers of the ``ans`` kernels (:mod:`weightsync.codec.simd`): the portable
``pdep``/``pext``, expand-add and compress-store give the bits of the definitions (and of BMI2's
instructions and LLVM's vector intrinsics where this CPU has them), for masks of every density."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from xml.etree import ElementTree

import numpy as np
import pytest
from numba import njit
from numba.core.codegen import get_host_cpu_features

from weightsync.codec import simd

BITS = np.uint64(1) << np.arange(64, dtype=np.uint64)


def masks(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    return ((rng.random((n, 64)) < density) * BITS).sum(axis=1, dtype=np.uint64)


def pdep_ref(x: int, m: int) -> int:
    out, k = 0, 0
    for j in range(64):
        if m >> j & 1:
            out |= (x >> k & 1) << j
            k += 1
    return out


def pext_ref(x: int, m: int) -> int:
    out, k = 0, 0
    for j in range(64):
        if m >> j & 1:
            out |= (x >> j & 1) << k
            k += 1
    return out


@njit
def _soft(xs, ms, dep, ext):
    for i in range(xs.size):
        dep[i] = simd.pdep_soft(xs[i], ms[i])
        ext[i] = simd.pext_soft(xs[i], ms[i])


@njit
def _hard(xs, ms, dep, ext):
    for i in range(xs.size):
        dep[i] = simd.pdep_bmi2(xs[i], ms[i])
        ext[i] = simd.pext_bmi2(xs[i], ms[i])


@pytest.mark.parametrize("mask_density", [0.0, 0.03, 0.5, 0.97, 1.0])
@pytest.mark.parametrize("x_density", [0.0, 0.02, 0.5, 1.0])
def test_portable_pdep_and_pext_give_the_definitions_bits(mask_density, x_density):
    rng = np.random.default_rng(int(100 * mask_density + 10 * x_density))
    n = 3000
    ms, xs = masks(rng, n, mask_density), masks(rng, n, x_density)
    dep, ext = np.empty(n, np.uint64), np.empty(n, np.uint64)
    _soft(xs, ms, dep, ext)
    for i in range(300):  # the pure-Python definitions are slow: a sample
        assert int(dep[i]) == pdep_ref(int(xs[i]), int(ms[i])), (hex(xs[i]), hex(ms[i]))
        assert int(ext[i]) == pext_ref(int(xs[i]), int(ms[i])), (hex(xs[i]), hex(ms[i]))
    if simd.HAS_BMI2:  # all of them against the instructions
        hdep, hext = np.empty(n, np.uint64), np.empty(n, np.uint64)
        _hard(xs, ms, hdep, hext)
        assert np.array_equal(dep, hdep) and np.array_equal(ext, hext)


@njit
def _words(xs, ms, dep, byt):
    for i in range(xs.shape[0]):
        x, m = xs[i], ms[i]
        dep[i] = simd.deposit_soft(x[0], m[0], x[1], m[1], x[2], m[2], x[3], m[3])
        for b in range(4):
            byt[i, b] = simd.pdep_bytes(x[b], m[b])


@pytest.mark.parametrize("buckets", [1, 2, 3, 4])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.05, 0.2, 1.0])
def test_a_words_buckets_deposited_at_once_give_pdep_of_each(buckets, density):
    """The portable pass deposits every bucket of a word in one call: the
    buckets' masks split the word (some empty, as the unused ones are), each bucket's bits (with
    bits above its size set too, which must be ignored) go into its members in order. Sparse words
    take the loop over the changes, words with more than ``DENSE`` the byte tables."""
    rng = np.random.default_rng(buckets * 31 + int(density * 100))
    n = 4000
    owner = rng.integers(0, buckets, (n, 64))
    owner[: n // 8] = rng.integers(0, 4, 64) % buckets  # the same split in many words, one bucket often empty
    owner[n // 8 : n // 4] = buckets - 1  # one bucket holds all
    owner[n // 4 : n // 2] = rng.choice([0, 3], (n // 4, 64))  # empty buckets between used ones (padded thresholds)
    ms = np.zeros((n, 4), np.uint64)
    for b in range(4):
        ms[:, b] = ((owner == b) * BITS).sum(axis=1, dtype=np.uint64)
    xs = np.stack([masks(rng, n, density) for _ in range(4)], axis=1)
    xs[: n // 16, :4] |= ~np.uint64(0) << np.uint64(40)  # high bits past a bucket's size
    dep, byt = np.empty(n, np.uint64), np.empty((n, 4), np.uint64)
    _words(xs, ms, dep, byt)
    per = np.empty((n, 4), np.uint64)
    for b in range(4):
        _soft(xs[:, b].copy(), ms[:, b].copy(), per[:, b], np.empty(n, np.uint64))
    assert np.array_equal(dep, np.bitwise_or.reduce(per, axis=1))
    assert np.array_equal(byt, per)
    if simd.HAS_BMI2:  # and against the instructions
        hdep = np.empty((n, 4), np.uint64)
        for b in range(4):
            _hard(xs[:, b].copy(), ms[:, b].copy(), hdep[:, b], np.empty(n, np.uint64))
        assert np.array_equal(per, hdep)
    for i in range(0, n, n // 50):  # and a sample against the definitions
        for b in range(4):
            assert int(per[i, b]) == pdep_ref(int(xs[i, b]), int(ms[i, b]))
    changes = np.array([bin(int(d)).count("1") for d in dep])
    if density == 0.05:  # both ways through deposit_soft were taken
        assert (changes > simd.DENSE).any() and (changes <= simd.DENSE).any()


def _expand_kernel(native: bool, groups: int):
    f = (simd.EXPAND_ADD if native else simd.EXPAND_ADD_SOFT)[groups]
    if groups == 1:
        return njit(lambda o, s, b, d, p, m: f(o, s, b, d, p[0], m[0]))
    if groups == 2:
        return njit(lambda o, s, b, d, p, m: f(o, s, b, d, p[0], m[0], p[1], m[1]))
    if groups == 3:
        return njit(lambda o, s, b, d, p, m: f(o, s, b, d, p[0], m[0], p[1], m[1], p[2], m[2]))
    return njit(lambda o, s, b, d, p, m: f(o, s, b, d, p[0], m[0], p[1], m[1], p[2], m[2], p[3], m[3]))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("density", [0.02, 0.5, 1.0])
def test_expand_add_adds_each_groups_next_differences_at_its_bits(dtype, groups, density):
    """``out[base + j] = src[base + j] + d``, wrapping, d the next difference of the group whose mask
    has bit j; in place too. The native kind (LLVM's expand-loads) and the portable one agree."""
    rng = np.random.default_rng(groups * 7 + int(density * 10))
    base = 64 * 3
    src = rng.integers(0, np.iinfo(dtype).max, 64 * 6, dtype=dtype, endpoint=True)
    owner = rng.integers(0, groups, 64)  # each element's group, then which of them changed
    changed = rng.random(64) < density
    m = np.array([((owner == g) & changed) @ BITS for g in range(groups)], np.uint64)
    diffs = rng.integers(0, np.iinfo(dtype).max, 200, dtype=dtype, endpoint=True)
    p = np.array([0, 40, 90, 140][:groups], np.int64)
    want = src.copy()
    nxt = p.copy()
    for j in range(64):
        if changed[j]:
            g = owner[j]
            want[base + j] = (int(src[base + j]) + int(diffs[nxt[g]])) % (1 << 8 * src.itemsize)
            nxt[g] += 1
    for native in (True, False):
        out = np.zeros_like(src)
        out[:base], out[base + 64 :] = src[:base], src[base + 64 :]
        _expand_kernel(native, groups)(out, src, base, diffs, p, m)
        assert np.array_equal(out, want), native
        inplace = src.copy()
        _expand_kernel(native, groups)(inplace, inplace, base, diffs, p, m)
        assert np.array_equal(inplace, want), native


def _compress_kernel(native: bool, groups: int):
    f = (simd.COMPRESS_ZIGZAG if native else simd.COMPRESS_ZIGZAG_SOFT)[groups]
    if groups == 1:
        return njit(lambda o, n, b, d, p, m: f(o, n, b, d[0], p[0], m[0]))
    if groups == 2:
        return njit(lambda o, n, b, d, p, m: f(o, n, b, d[0], p[0], m[0], d[1], p[1], m[1]))
    if groups == 3:
        return njit(lambda o, n, b, d, p, m: f(o, n, b, d[0], p[0], m[0], d[1], p[1], m[1], d[2], p[2], m[2]))
    return njit(
        lambda o, n, b, d, p, m: f(o, n, b, d[0], p[0], m[0], d[1], p[1], m[1], d[2], p[2], m[2], d[3], p[3], m[3])
    )


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_compress_zigzag_stores_each_groups_zigzag_differences_at_its_bits_in_order(dtype, groups, density):
    """Each group's array gets, from its position, the zigzag codes of ``new - old`` (wrapping at the
    width) at its mask's set bits, in order, and nothing else is written before them nor more than
    :data:`simd.SPARE` elements past them (the native kind's register compress stores whole vectors;
    the portable one writes nothing past them); the masks are disjoint and some group's may be empty.
    The native kind (one coding, a compress-store per group) and the portable one agree."""
    rng = np.random.default_rng(int(density * 100) + 10 * groups)
    bits = 8 * np.dtype(dtype).itemsize
    old = rng.integers(0, np.iinfo(dtype).max, 128, dtype=dtype, endpoint=True)
    new = rng.integers(0, np.iinfo(dtype).max, 128, dtype=dtype, endpoint=True)
    owner = rng.integers(0, groups, 64)
    changed = masks(rng, 1, density)[0]
    mask = np.array(
        [sum(1 << j for j in range(64) if int(changed) >> j & 1 and owner[j] == g) for g in range(groups)], np.uint64
    )
    pos = np.array([5, 0, 17, 3][:groups], np.int64)
    for native in (True, False):
        dst = np.full((groups, 17 + 64 + simd.SPARE + 8), 7, dtype)
        _compress_kernel(native, groups)(old, new, 64, dst, pos, mask)
        spare = simd.SPARE if native and simd.COMPRESS_IN_REGISTER else 0
        for g in range(groups):
            idx = [64 + j for j in range(64) if int(mask[g]) >> j & 1]
            d = [(int(new[i]) - int(old[i])) % (1 << bits) for i in idx]  # signed, wrapping at the width
            d = [x - (1 << bits) if x >> (bits - 1) else x for x in d]
            want = [((x << 1) ^ (x >> (bits - 1))) % (1 << bits) for x in d]
            p = pos[g]
            assert dst[g, p : p + len(want)].tolist() == want, (native, g)
            assert (dst[g, :p] == 7).all() and (dst[g, p + len(want) + spare :] == 7).all(), (native, g)


SPARE = simd.SPARE if simd.COMPRESS_IN_REGISTER else 0
"""What the native compress-stores may write past the elements they keep on this CPU."""


@njit
def _ranks(out, pos, x, base):
    simd.compress_ranks(out, pos, x, base)


@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_compress_ranks_lists_base_plus_each_set_bit_in_order(density):
    """From its position, ``base + j`` for each set bit j of the word (both halves of 32 lanes), and
    nothing else written before them nor more than :data:`simd.SPARE` elements past them, at bases up
    to the largest a block's ranks reach."""
    rng = np.random.default_rng(int(density * 100) + 3)
    for x in masks(rng, 20, density):
        for base in (0, 64, (1 << 31) - 64):
            out = np.full(5 + 64 + simd.SPARE + 8, 7, np.uint32)
            _ranks(out, 5, x, np.uint64(base))
            want = [base + j for j in range(64) if int(x) >> j & 1]
            assert out[5 : 5 + len(want)].tolist() == want
            assert (out[:5] == 7).all() and (out[5 + len(want) + SPARE :] == 7).all()


@njit
def _escapes(out, pos, src, base, lim, valid):
    return simd.compress_escapes(out, pos, src, base, lim, valid)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_compress_escapes_stores_the_valid_lanes_at_or_over_the_limit_less_it(dtype):
    """Of 32 elements from ``base``, those in ``valid`` and at or over the limit (unsigned: the top
    values included), each less the limit, in order from the position; returns their count and
    writes nothing before them nor more than :data:`simd.SPARE` elements past them (the limit's
    neighbours planted)."""
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    top = np.iinfo(dtype).max
    for trial in range(60):
        src = np.where(rng.random(96) < rng.random(), rng.integers(0, 16, 96), rng.integers(0, top, 96, endpoint=True))
        src = src.astype(dtype)
        src[rng.integers(0, 96, 3)] = top
        src[rng.integers(0, 96, 3)] = rng.integers(15, 18, 3)  # at the limit
        valid = np.uint64(rng.choice([0xFFFFFFFF, (1 << int(rng.integers(0, 33))) - 1]))
        base = int(rng.integers(0, 64))
        out = np.full(3 + 32 + simd.SPARE + 8, 7, dtype)
        n = _escapes(out, 3, src, base, np.uint64(16), valid)
        want = [int(src[base + j]) - 16 for j in range(32) if int(valid) >> j & 1 and src[base + j] >= 16]
        assert n == len(want) and out[3 : 3 + n].tolist() == want, trial
        assert (out[:3] == 7).all() and (out[3 + n + SPARE :] == 7).all(), trial


@njit
def _masks(ary, base, absmask, lim, other, field):
    return (
        simd.below_mask64(ary, base, absmask, lim),
        simd.ne_mask64(ary, other, base),
        simd.field_ne_mask64(ary, other, base, field),
        simd.zero_mask64(other, base),
    )


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_vector_masks_give_each_elements_compare(dtype):
    """``below_mask64`` compares the magnitude (sign bit masked off) with a limit that leaves the
    sign bit clear, as the kernels' exponent limits do, from 0 to the largest magnitude; elements
    with the sign bit set compare by magnitude too. ``ne_mask64`` and ``field_ne_mask64`` give the
    elements that differ, and those whose field differs; ``zero_mask64`` the zero ones."""
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    top = 1 << (8 * np.dtype(dtype).itemsize - 1)
    absmask = dtype(top - 1)
    field = dtype((top - 1) & ~0xF)  # an exponent-like field: below the sign bit, above the low bits
    ary = rng.integers(0, 2 * top - 1, 64 * 4, dtype=dtype, endpoint=True)
    ary[64 : 64 + 8] = [0, 1, top - 1, top, top + 1, 2 * top - 1, top // 2, top // 2 - 1]
    other = ary.copy()
    flip = rng.random(ary.size) < 0.3
    other[flip] ^= rng.integers(1, 2 * top - 1, ary.size, dtype=dtype, endpoint=True)[flip]
    other[rng.random(ary.size) < 0.2] = 0
    mag = ary.astype(np.int64) & (top - 1)
    for lim in [0, 1, top // 2, top - 1, int(rng.integers(0, top))]:
        for base in (0, 64, 128):
            below, ne, fne, zero = _masks(ary, base, absmask, dtype(lim), other, field)
            w = slice(base, base + 64)
            assert int(below) == int((mag[w] < lim) @ BITS), lim
            assert int(ne) == int((ary[w] != other[w]) @ BITS)
            assert int(fne) == int((((ary[w] ^ other[w]) & field) != 0) @ BITS)
            assert int(zero) == int((other[w] == 0) @ BITS)


def test_kernels_compiled_for_another_cpu_are_portable():
    """With ``NUMBA_CPU_NAME`` (an image's cache built for any x86 CPU) numba does not compile for
    this one: the native kind, whose instructions that CPU may lack, is neither chosen nor offered."""
    probe = (
        "from weightsync.codec import simd; print(simd.NATIVE, simd.KINDS, simd.HAS_BMI2, simd.COMPRESS_IN_REGISTER)"
    )
    env = {**os.environ, "NUMBA_CPU_NAME": "generic"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(simd.PORTABLE), f"({simd.PORTABLE},)", "False", "False"]


def test_the_register_compress_follows_the_features_that_key_the_cache():
    """numba keys a cached kernel by the CPU name and features it compiles for; this CPU's own name in
    ``NUMBA_CPU_NAME`` gives the same key as none, so it must give the same choice of compress-store
    (else one process loads the other's kernel: a memory ``vpcompress`` again, or whole-vector
    stores where its arrays keep no spare)."""
    probe = "from weightsync.codec import simd; print(simd.COMPRESS_IN_REGISTER)"
    env = {**os.environ, "NUMBA_CPU_NAME": simd._HOST_CPU}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(simd.COMPRESS_IN_REGISTER)]


def test_compress_stores_for_another_cpu_write_only_what_they_keep(tmp_path):
    """Compiled for any x86 CPU (LLVM's masked compress-store, no register ``vpcompress``), the
    compress-stores keep the same elements and write nothing past them: this file's tests of them,
    run in such a process."""
    env = {**os.environ, "NUMBA_CPU_NAME": "generic"}
    picked = "compress_ranks or compress_escapes or (compress_zigzag and (0.03-4 or 1.0-2))"
    report = tmp_path / "report.xml"
    args = ["-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", __file__, "-k", picked, f"--junitxml={report}"]
    out = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    ran = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert ran == {"tests": 13, "failures": 0, "errors": 0, "skipped": 0}, ran


_ROUND_TRIP = """
import numpy as np
from weightsync.codec import ans, simd
rng = np.random.default_rng(0)
old = rng.integers(0, 1 << 16, 4096).astype(np.uint16)
new = old.copy()
new[::3] += np.uint16(1000)  # escapes too
new[1::7] += np.uint16(1)
wide_old = np.full(40000, 100 << 7, np.uint16)  # one group of 40000 changes: a wide rANS section
wide_new = wide_old + np.uint16(1)
bytes_old = (np.arange(4096) * 2654435761 % 251).astype(np.uint8)  # 8-bit elements: 256-bit vectors
bytes_new = bytes_old.copy()
bytes_new[::5] += np.uint8(100)  # escapes
for native in dict.fromkeys((*simd.KINDS[:1], simd.NATIVE)):  # the native kind where offered, and the default
    cases = (("BF16", old, new, ([], [64])), ("U8", bytes_old, bytes_new, None), ("BF16", wide_old, wide_new, None))
    for dtype, o, n, split in cases:
        data, changed = ans.encode_block(dtype, o, n, native=native, split=split)
        out = np.empty_like(o)
        ans.decode_block(dtype, memoryview(data), o, out, "t", native=native)
        assert changed == int((o != n).sum()) and (out == n).all()
    assert data[4] & ans.WIDE
print(simd.COMPRESS_IN_REGISTER, simd.NATIVE)
"""


def _host_features_without(*names: str) -> str:
    """The host's feature list with ``names`` turned off, at the end (LLVM reads the list in order,
    and a later ``+avx512vbmi2`` would turn an earlier ``-avx512bw`` on again)."""
    flat = get_host_cpu_features()
    return ",".join([*(f for f in flat.split(",") if f[1:] not in names), *(f"-{n}" for n in names)])


_DROPPED = {"vbmi2": "avx512vbmi2", "vl": "avx512vl", "bw": "avx512bw", "fma": "fma"}


@pytest.mark.parametrize("told", ["avx-off", *(f"features-without-{k}" for k in _DROPPED)])
def test_kernels_compile_for_the_features_numba_is_told(told, tmp_path):
    """Told to compile without AVX (``NUMBA_ENABLE_AVX=0``) or for the host's features but AVX-512
    VBMI2, VL or BW, or FMA (``NUMBA_CPU_FEATURES``), the kernels use only what those leave: blocks
    (one with a wide rANS section) encode and decode with the native kind where it is offered, and
    with the kind chosen by default, ``BMI2`` where VBMI2 is off (the encoder's block code, which
    the kinds share, holds the compress-stores; a register ``vpcompress`` there made LLVM abort the
    process, and so did the wide sections' 16-bit masked compress-store and expand-load without VL;
    LLVM turns VBMI2 off without BW, and all of AVX-512 without FMA; and LLVM's masked
    compress-store and expand-load of 8-bit lanes without VL)."""
    if told == "avx-off":
        setting = {"NUMBA_ENABLE_AVX": "0"}
    else:
        setting = {"NUMBA_CPU_FEATURES": _host_features_without(_DROPPED[told.rsplit("-", 1)[1]])}
    env = {**os.environ, **setting, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _ROUND_TRIP], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    in_register, native = out.stdout.split()
    assert in_register == "False"
    # fast pdep without VBMI2: the BMI2 kind; VBMI2 and fast pdep without VL: the native one
    vector = told == "features-without-vl" and simd._FEATURES.get("avx512vbmi2", False)
    assert native == str((simd.VECTOR if vector else simd.BMI2) if simd._FAST_BMI2 else simd.PORTABLE)


@pytest.mark.skipif(not simd.COMPRESS_IN_REGISTER, reason="a CPU without AVX-512 VBMI2: LLVM's compress-store")
def test_compress_stores_compress_in_a_register():
    """Where the CPU has ``vpcompress`` for every element size, no compress-store goes to memory
    (microcoded on AMD Zen 4, where the encoder ran 3-4x slower with them): each ``vpcompress`` writes
    a register, which a plain vector store writes out."""

    @njit
    def ranks(out, x):
        simd.compress_ranks(out, 1, x, np.uint64(0))

    @njit
    def escapes(out, src):
        return simd.compress_escapes(out, 0, src, 0, np.uint64(16), simd.ALL)

    zig = _compress_kernel(True, 2)
    ranks(np.zeros(128, np.uint32), np.uint64(0xF0F0))
    found = []
    asms = [ranks.inspect_asm(ranks.signatures[-1])]
    for dtype in (np.uint8, np.uint16, np.uint32):
        escapes(np.zeros(96, dtype), np.arange(64, dtype=dtype))
        asms.append(escapes.inspect_asm(escapes.signatures[-1]))
        a = np.arange(128, dtype=dtype)
        zig(a, a[::-1].copy(), 0, np.zeros((2, 128), dtype), np.zeros(2, np.int64), np.array([3, 12], np.uint64))
        asms.append(zig.inspect_asm(zig.signatures[-1]))
    for asm in asms:
        found += [line.strip() for line in asm.splitlines() if line.strip().startswith("vpcompress")]
    assert found, "no vpcompress at all"
    to_memory = [line for line in found if "(" in line.split("#")[0]]  # AT&T: a memory operand has parentheses
    assert not to_memory, to_memory


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's prefetch instructions")
def test_prefetch64_asks_for_each_line_ahead_and_runs_past_the_arrays_end():
    """The passes ask for the lines ahead of them: one prefetch per 64-byte line of the 64 elements
    ``PREFETCH`` ahead must reach the machine code, and it is harmless past the array's end."""

    @njit
    def ask(a, base):
        simd.prefetch64(a, base)

    @njit
    def walk(a):
        total = 0
        for w in range(a.size // 64):
            simd.prefetch64(a, w * 64)  # the last 16 words ask for lines past the end
            total += a[w * 64]
        return total

    for dtype in (np.uint8, np.uint16, np.uint32):
        a = np.arange(1024, dtype=dtype)
        ask(a, 0)
        asm = ask.inspect_asm(ask.signatures[-1])
        found = [line.strip() for line in asm.splitlines() if line.strip().startswith("prefetch")]
        assert len(found) == np.dtype(dtype).itemsize, (dtype, found)  # 64 elements: 1, 2 or 4 lines
        assert walk(a) == a[::64].sum()


@pytest.mark.parametrize(
    ("flat", "on", "off"),
    [
        ("+avx512f,+avx512bw,+avx512vbmi2", {"avx512vbmi2", "avx512bw", "avx512f", "avx2", "fma", "avx"}, set()),
        ("+avx512vbmi2,-avx512bw", {"avx512f"}, {"avx512vbmi2", "avx512bw"}),
        ("+avx512vbmi2,+avx512vl,-fma", {"avx2"}, {"avx512vbmi2", "avx512vl", "avx512bw", "avx512f", "fma"}),
        ("-fma,+avx512vbmi2", {"avx512vbmi2", "fma", "avx512f"}, set()),
        ("+avx512vl,-avx", set(), {"avx512vl", "avx512f", "avx2", "fma", "f16c", "avx"}),
    ],
)
def test_features_are_read_as_llvm_reads_them(flat, on, off):
    """In order, ``+x`` turns on x and what it needs, ``-x`` turns off x and what needs it."""
    got = simd._effective(flat)
    assert all(got.get(f) for f in on) and not any(got.get(f, False) for f in off), got
