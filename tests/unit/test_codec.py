"""Bit-exact tensor codecs: round trips over every dtype, integer helpers, hostile payloads, compression.

Every comparison is on raw bytes (uint8 arrays or integer views), never on float values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec import hashing
from weightsync.codec import sparse as sparse_codec
from weightsync.codec import streams as codec_streams
from weightsync.codec.payload import (
    MAGIC,
    MAX_BLOCK_ELEMS,
    CodecConfig,
    decode_tensor,
    decode_tensor_backward,
    encode_tensor,
    rebuild,
)
from weightsync.codec.streams import from_planes, to_planes, unzigzag, zigzag
from weightsync.demo import to_bf16_bits
from weightsync.errors import ChecksumError, FormatError, UsageError, WeightsyncError
from weightsync.format.dtypes import INT_VIEW, ITEMSIZE, UINT_VIEW, itemsize

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Payload container layout (docs/FORMAT.md "Payloads"), restated here so the tests pin the format:
HEADER = struct.Struct("<4sBBHQQI")  # magic, codec id, elem width, reserved, n elems, block elems, n blocks
SPARSE = struct.Struct("<IBBHI")  # changed count, gap width, reserved, reserved, compressed gaps length
CODEC_ID = {"full": 1, "sparse": 2, "dense": 3, "ac": 4, "ans": 5}

# Bit patterns that float arithmetic would lose or normalise: NaN payloads (quiet and signalling,
# both signs), -0.0, infinities, subnormals, extremes of every integer type.
SPECIALS: dict[str, list[int]] = {
    "BOOL": [0, 1],
    "U8": [0, 1, 0x7F, 0x80, 0xFF],
    "I8": [0, 1, 0x7F, 0x80, 0xFF],
    "F8_E4M3": [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81, 0x07, 0x7E, 0xFE],
    "F8_E5M2": [0x00, 0x80, 0x7C, 0xFC, 0x7D, 0x7E, 0xFF, 0x01, 0x03, 0x7B],
    "F8_E8M0": [0x00, 0x7F, 0xFE, 0xFF],
    "I16": [0, 1, 0x7FFF, 0x8000, 0xFFFF],
    "U16": [0, 1, 0x7FFF, 0x8000, 0xFFFF],
    "F16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7C01, 0xFE55, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF],
    "BF16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x7F81, 0xFFC0, 0x0001, 0x007F, 0x8001, 0x7F7F, 0xFF7F],
    "I32": [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF],
    "U32": [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF],
    "F32": [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00001,
        0x7F800001,
        0xFFFFFFFF,
        0x00000001,
        0x007FFFFF,
        0x80000001,
        0x7F7FFFFF,
        0xFF7FFFFF,
    ],
    "I64": [0, 1, 2**63 - 1, 2**63, 2**64 - 1],
    "U64": [0, 1, 2**63 - 1, 2**63, 2**64 - 1],
    "F64": [
        0,
        2**63,
        0x7FF0000000000000,
        0xFFF0000000000000,
        0x7FF0000000000001,
        0xFFF800000000DEAD,
        0x7FF8000000000000,
        1,
        0x000FFFFFFFFFFFFF,
        0x8000000000000001,
        0x7FEFFFFFFFFFFFFF,
    ],
}
assert set(SPECIALS) == set(ITEMSIZE), "every dtype needs edge values"

DTYPES = sorted(ITEMSIZE)
DENSITIES = ("none", "one", "sparse", "dense", "all")


def raw(values: np.ndarray) -> np.ndarray:
    """The raw little-endian bytes of an integer array as a 1-D uint8 array."""
    return np.ascontiguousarray(values).reshape(-1).view(np.uint8)


def make_tensor(dtype: str, n: int, rng: np.random.Generator, special_frac: float) -> np.ndarray:
    """``n`` random elements of ``dtype`` (as unsigned bit patterns) with some edge values mixed in."""
    width = ITEMSIZE[dtype]
    view = UINT_VIEW[width]
    if dtype == "BOOL":
        vals = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        vals = rng.integers(0, np.iinfo(view).max, n, dtype=view, endpoint=True)
    specials = np.array(SPECIALS[dtype], dtype=view)
    mask = rng.random(n) < special_frac
    vals[mask] = rng.choice(specials, int(mask.sum()))
    return vals


def perturb(dtype: str, old: np.ndarray, density: str, rng: np.random.Generator) -> np.ndarray:
    """A copy of ``old`` with a controlled fraction of elements changed (each changed element differs)."""
    new = old.copy()
    n = old.size
    if density == "none" or n == 0:
        return new
    if density == "one":
        idx = rng.integers(0, n, 1)
    elif density == "sparse":
        idx = np.flatnonzero(rng.random(n) < 0.05)
        if idx.size == 0:
            idx = rng.integers(0, n, 1)
    elif density == "dense":
        idx = np.flatnonzero(rng.random(n) < 0.6)
    else:
        idx = np.arange(n)
    width = ITEMSIZE[dtype]
    view = UINT_VIEW[width]
    if dtype == "BOOL":
        new[idx] = 1 - old[idx]
        return new
    # mix +/-1 ulp steps (the common RL case), wrap-around edges and arbitrary bit changes
    kind = rng.integers(0, 3, idx.size)
    delta = np.ones(idx.size, dtype=view)
    delta[kind == 1] = np.iinfo(view).max  # -1, wrapping
    arbitrary = rng.integers(1, np.iinfo(view).max, idx.size, dtype=view, endpoint=True)
    delta[kind == 2] = arbitrary[kind == 2]
    new[idx] = old[idx] + delta  # wrapping; every delta is non-zero so every chosen element changes
    return new


shapes = st.one_of(
    st.just(()),  # scalar
    st.lists(st.integers(0, 3), min_size=1, max_size=3).map(tuple),  # often empty
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    st.integers(0, 300).map(lambda n: (n,)),
)
configs = st.one_of(
    st.builds(CodecConfig, block_bytes=st.integers(8, 64)),
    st.builds(CodecConfig, block_bytes=st.integers(8, 64), dense_above=st.sampled_from([0.0, 1.0])),
    st.builds(CodecConfig, block_bytes=st.integers(8, 64), entropy_coder=st.just(False)),  # sparse at every width
    st.just(CodecConfig()),
)


@st.composite
def tensor_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    density = draw(st.sampled_from(DENSITIES))
    seed = draw(st.integers(0, 2**32 - 1))
    special_frac = draw(st.sampled_from([0.0, 0.3, 1.0]))
    rng = np.random.default_rng(seed)
    old = make_tensor(dtype, math.prod(shape), rng, special_frac)
    new = perturb(dtype, old, density, rng)
    return dtype, shape, old, new, draw(configs)


def header_of(payload: bytes) -> tuple:
    return HEADER.unpack_from(payload)


# --- round trips ---------------------------------------------------------------------------------
@FAST
@given(tensor_pairs())
def test_full_round_trip_is_byte_identical(case):
    dtype, shape, _, new, cfg = case
    enc = encode_tensor(dtype, raw(new), None, cfg)
    assert enc.codec == "full"
    assert enc.changed == new.size
    out = decode_tensor(dtype, "full", enc.payload, None, new.nbytes)
    assert out.dtype == np.uint8 and out.shape == (new.nbytes,)
    assert np.array_equal(out, raw(new))
    magic, cid, width, _, n, step, n_blocks = header_of(enc.payload)
    assert (magic, cid, width, n) == (MAGIC, CODEC_ID["full"], ITEMSIZE[dtype], new.size)
    assert step == cfg.block_elems(ITEMSIZE[dtype]) and n_blocks == -(-new.size // step)


@FAST
@given(tensor_pairs())
def test_delta_round_trip_is_byte_identical(case):
    dtype, shape, old, new, cfg = case
    enc = encode_tensor(dtype, raw(new), raw(old), cfg)
    changed = int(np.count_nonzero(old != new))
    assert enc.changed == changed
    if changed == 0:
        assert enc.codec == "same" and enc.payload == b""
    else:
        assert enc.codec in ("sparse", "dense", "ac", "ans")
    out = decode_tensor(dtype, enc.codec, enc.payload, raw(old), new.nbytes)
    assert np.array_equal(out, raw(new))


@FAST
@given(tensor_pairs())
def test_decode_into_given_buffer(case):
    dtype, _, old, new, cfg = case
    enc = encode_tensor(dtype, raw(new), raw(old), cfg)
    buf = np.full(new.nbytes, 0xA5, dtype=np.uint8)
    got = decode_tensor(dtype, enc.codec, enc.payload, raw(old), new.nbytes, out=buf)
    assert got is buf
    assert np.array_equal(buf, raw(new))


@contextlib.contextmanager
def slices_of(nbytes: int):
    """Decode in slices of ``nbytes`` (a few elements), so small tensors cross many slice edges."""
    saved, codec_streams.SLICE_BYTES = codec_streams.SLICE_BYTES, nbytes
    try:
        yield
    finally:
        codec_streams.SLICE_BYTES = saved


@FAST
@pytest.mark.parametrize("make", [xxhash.xxh3_128, hashing.hasher], ids=["python-fed", "kernel-fed"])
@given(tensor_pairs(), st.sampled_from([1, 2, 3, 8, 24, 512 << 10]))
def test_decode_feeds_the_hasher_exactly_the_result(make, case, slice_bytes):
    """A pull verifies while decoding: the hasher sees the output bytes once, in order, whatever
    the codec, block size or slice size (changes on, before and after slice edges), fed from
    Python or by the kernels (weightsync.codec.hashing)."""
    dtype, _, old, new, cfg = case
    for base in (None, raw(old)):
        enc = encode_tensor(dtype, raw(new), base, cfg)
        hasher = make()
        with slices_of(slice_bytes):
            out = decode_tensor(dtype, enc.codec, enc.payload, base, new.nbytes, hasher=hasher)
        assert np.array_equal(out, raw(new))
        assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(raw(new))


@FAST
@given(tensor_pairs(), st.sampled_from([2, 24, 512 << 10]))
def test_decode_in_place_overwrites_the_base_with_the_result(case, slice_bytes):
    """``out=old``: every codec decodes into the base itself (what a pull does with the base it
    read), hashing the same bytes; a buffer that only overlaps the base is refused."""
    dtype, _, old, new, cfg = case
    enc = encode_tensor(dtype, raw(new), raw(old), cfg)
    buf = raw(old).copy()
    hasher = xxhash.xxh3_128()
    with slices_of(slice_bytes):
        got = decode_tensor(dtype, enc.codec, enc.payload, buf, new.nbytes, out=buf, hasher=hasher)
    assert got is buf and np.array_equal(buf, raw(new))
    assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(raw(new))
    width = ITEMSIZE[dtype]
    if new.size >= 2:
        room = np.zeros(new.nbytes + width, dtype=np.uint8)
        room[:-width] = raw(old)
        with pytest.raises(UsageError, match="overlaps the base"):
            decode_tensor(dtype, enc.codec, enc.payload, room[:-width], new.nbytes, out=room[width:])


def test_rebuild_in_place_decodes_into_the_base():
    rng = np.random.default_rng(3)
    v0 = make_tensor("BF16", 5000, rng, 0.0)
    v1 = perturb("BF16", v0, 0.03, rng)
    v2 = perturb("BF16", v1, 0.03, rng)
    for cfg in (CodecConfig(), CodecConfig(entropy_coder=False)):
        e1, e2 = encode_tensor("BF16", raw(v1), raw(v0), cfg), encode_tensor("BF16", raw(v2), raw(v1), cfg)
        base = raw(v0).copy()
        out = rebuild(
            "BF16",
            v2.nbytes,
            xxhash.xxh3_128_hexdigest(raw(v2)),
            base,
            [(e1.codec, lambda e=e1: e.payload), (e2.codec, lambda e=e2: e.payload)],
            in_place=True,
        )
        assert out is base and np.array_equal(base, raw(v2))
        kept = raw(v0).copy()
        rebuild("BF16", v1.nbytes, xxhash.xxh3_128_hexdigest(raw(v1)), kept, [(e1.codec, lambda e=e1: e.payload)])
        assert np.array_equal(kept, raw(v0))  # not in place: the base is left as it was


def test_sparse_changes_at_every_slice_edge():
    """Positions 0, the last of a slice, the first of the next and the last element, with gaps of
    one, two and four bytes, across slices of 3 elements."""
    n = 70000  # a 4-byte gap needs more than 65535 unchanged elements in a row
    old = np.arange(n, dtype="<u2")
    for positions in ([0, 2, 3, 5, 6, n - 1], [1, 300, 301], [0, 66000, n - 1]):
        new = old.copy()
        new[positions] += np.array([1, 65535, 7, 2, 3, 9][: len(positions)], dtype="<u2")
        enc = encode_tensor("BF16", raw(new), raw(old), CodecConfig(entropy_coder=False))
        assert enc.codec == "sparse" and enc.changed == len(positions)
        for slice_bytes in (6, 512 << 10):
            hasher = xxhash.xxh3_128()
            with slices_of(slice_bytes):
                out = decode_tensor("BF16", "sparse", enc.payload, raw(old), 2 * n, hasher=hasher)
            assert np.array_equal(out, raw(new)), positions
            assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(raw(new))


@pytest.mark.parametrize("entropy_coder", [True, False])
def test_rebuild_applies_a_chain_and_checks_the_result(entropy_coder):
    """A pull's recipe: a base, then deltas in turn; only the result is checked, and a payload is
    fetched only when its step is decoded."""
    rng = np.random.default_rng(7)
    v0 = make_tensor("BF16", 5000, rng, 0.0)
    v1 = perturb("BF16", v0, 0.03, rng)
    v2 = perturb("BF16", v1, 0.03, rng)
    cfg = CodecConfig(entropy_coder=entropy_coder, block_bytes=4096)
    e1, e2 = encode_tensor("BF16", raw(v1), raw(v0), cfg), encode_tensor("BF16", raw(v2), raw(v1), cfg)
    fetched = []

    def step(enc, name):
        return enc.codec, lambda: fetched.append(name) or enc.payload

    good = xxhash.xxh3_128_hexdigest(raw(v2))
    out = rebuild("BF16", v2.nbytes, good, raw(v0), [step(e1, 1), step(e2, 2)])
    assert np.array_equal(out, raw(v2)) and fetched == [1, 2]
    assert rebuild("BF16", v0.nbytes, xxhash.xxh3_128_hexdigest(raw(v0)), raw(v0), []) is not None
    full = encode_tensor("BF16", raw(v2), None, cfg)
    assert np.array_equal(rebuild("BF16", v2.nbytes, good, None, [step(full, "full")]), raw(v2))
    with pytest.raises(ChecksumError):
        rebuild("BF16", v2.nbytes, xxhash.xxh3_128_hexdigest(raw(v1)), raw(v0), [step(e1, 1), step(e2, 2)])
    with pytest.raises(ChecksumError):  # the chain stopped one step short
        rebuild("BF16", v2.nbytes, good, raw(v0), [step(e1, 1)])
    with pytest.raises(ChecksumError):  # a base alone is checked too
        rebuild("BF16", v0.nbytes, good, raw(v0), [])
    with pytest.raises(FormatError):
        rebuild("BF16", v0.nbytes, good, None, [])


@FAST
@given(tensor_pairs())
def test_dense_is_never_chosen_below_threshold_and_never_larger(case):
    dtype, _, old, new, cfg = case
    enc = encode_tensor(dtype, raw(new), raw(old), cfg)
    if enc.codec == "dense":
        assert enc.changed > cfg.dense_above * new.size
        delta_only = encode_tensor(dtype, raw(new), raw(old), dataclasses.replace(cfg, dense_above=1.0))
        assert delta_only.codec in ("sparse", "ac", "ans") and len(enc.payload) < len(delta_only.payload)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_bytes", [8, 16, 24, 64, 32 << 20])
def test_every_special_value_against_every_other(dtype, block_bytes):
    """All ordered pairs of edge values: each special turned into each other special."""
    view = UINT_VIEW[ITEMSIZE[dtype]]
    sp = np.array(SPECIALS[dtype], dtype=view)
    old = np.repeat(sp, sp.size)
    new = np.tile(sp, sp.size)
    cfg = CodecConfig(block_bytes=block_bytes)
    for a, b in ((old, new), (new, old), (old, old)):
        enc = encode_tensor(dtype, raw(b), raw(a), cfg)
        assert (enc.codec == "same") == np.array_equal(raw(a), raw(b))
        assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, raw(a), b.nbytes), raw(b))
    full = encode_tensor(dtype, raw(new), None, cfg)
    assert np.array_equal(decode_tensor(dtype, "full", full.payload, None, new.nbytes), raw(new))


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_nan_payload_and_signed_zero_changes_are_changes(dtype):
    """Bit-level identity: NaN -> other NaN and 0.0 -> -0.0 are changes, not 'same'."""
    width = ITEMSIZE[dtype]
    view = UINT_VIEW[width]
    sign = 1 << (8 * width - 1)
    nan = {"F16": 0x7E00, "BF16": 0x7FC0, "F32": 0x7FC00000, "F64": 0x7FF8000000000000}[dtype]
    old = np.array([nan, 0, 5], dtype=view)
    new = np.array([nan | 1, sign, 5], dtype=view)
    enc = encode_tensor(dtype, raw(new), raw(old))
    assert enc.codec in ("sparse", "dense", "ac", "ans") and enc.changed == 2
    assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, raw(old), new.nbytes), raw(new))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_scalar_tensors(dtype):
    width = ITEMSIZE[dtype]
    empty = np.zeros(0, dtype=np.uint8)
    enc = encode_tensor(dtype, empty, None)
    assert enc.codec == "full" and enc.changed == 0
    assert decode_tensor(dtype, "full", enc.payload, None, 0).size == 0
    assert encode_tensor(dtype, empty, empty).codec == "same"
    assert decode_tensor(dtype, "same", b"", empty, 0).size == 0
    scalar = raw(np.array([SPECIALS[dtype][-1]], dtype=UINT_VIEW[width]))
    zero = np.zeros(width, dtype=np.uint8)
    for old in (None, zero, scalar):
        enc = encode_tensor(dtype, scalar, old)
        assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, old, width), scalar)


def test_torch_bf16_round_trip_with_torch_equal_on_integer_views():
    g = torch.Generator().manual_seed(0)
    old_t = (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16)
    old_t[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")], dtype=torch.bfloat16)
    new_i = old_t.view(torch.int16).clone()
    new_i[::37] += 1
    new_i[5] = 0x7FC5  # NaN with payload bits
    new_t = new_i.view(torch.bfloat16)
    old_b, new_b = old_t.view(torch.uint8).numpy(), new_t.view(torch.uint8).numpy()
    for cfg in (CodecConfig(), CodecConfig(block_bytes=64)):
        enc = encode_tensor("BF16", new_b, old_b, cfg)
        out = decode_tensor("BF16", enc.codec, enc.payload, old_b, new_b.size)
        got = torch.frombuffer(bytearray(out.tobytes()), dtype=torch.bfloat16)
        assert torch.equal(got.view(torch.int16), new_t.view(torch.int16))


def test_multi_block_payload_has_one_length_per_block():
    old = np.arange(100, dtype="<u4")
    new = old.copy()
    new[[0, 33, 99]] += 7
    enc = encode_tensor("U32", raw(new), raw(old), CodecConfig(block_bytes=40))  # 10 elements per block
    _, cid, width, _, n, step, n_blocks = header_of(enc.payload)
    assert (cid, width, n, step, n_blocks) == (CODEC_ID[enc.codec], 4, 100, 10, 10)
    lengths = np.frombuffer(enc.payload[HEADER.size : HEADER.size + 8 * n_blocks], dtype="<u8")
    assert int(lengths.sum()) == len(enc.payload) - HEADER.size - 8 * n_blocks
    if enc.codec in ("sparse", "ac", "ans"):  # unchanged blocks cost nothing
        assert int(np.count_nonzero(lengths)) == 3


# --- usage errors ----------------------------------------------------------------------------------
def test_encode_usage_errors():
    a = np.zeros(8, dtype=np.uint8)
    with pytest.raises(UsageError):
        encode_tensor("F32", a, np.zeros(12, dtype=np.uint8))  # sizes differ
    with pytest.raises(UsageError):
        encode_tensor("F32", a.view(np.uint16), None)  # not raw bytes
    with pytest.raises(UsageError):
        encode_tensor("F32", a.reshape(2, 4), None)
    with pytest.raises(FormatError):
        encode_tensor("F32", np.zeros(6, dtype=np.uint8), None)  # not whole elements
    with pytest.raises(WeightsyncError):
        encode_tensor("C64", a, None)  # unknown dtype


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(level=0),
        dict(level=23),
        dict(full_level=0),
        dict(block_bytes=7),
        dict(block_bytes=MAX_BLOCK_ELEMS + 1),
        dict(dense_above=-0.1),
        dict(dense_above=1.5),
    ],
)
def test_codec_config_validation(kwargs):
    with pytest.raises(UsageError):
        CodecConfig(**kwargs)


def test_decode_output_buffer_of_wrong_size_or_layout_is_a_usage_error():
    enc = encode_tensor("U8", np.arange(8, dtype=np.uint8), None)
    read_only = np.empty(8, dtype=np.uint8)
    read_only.flags.writeable = False
    for out in (np.empty(9, dtype=np.uint8), np.empty(16, dtype=np.uint8)[::2], read_only):
        with pytest.raises(UsageError):
            decode_tensor("U8", "full", enc.payload, None, 8, out=out)


# --- integer helpers -------------------------------------------------------------------------------
WIDTHS = (1, 2, 4, 8)


@st.composite
def uint_arrays(draw):
    width = draw(st.sampled_from(WIDTHS))
    bits = 8 * width
    edge = st.sampled_from(
        [0, 1, 2, 2 ** (bits - 1) - 1, 2 ** (bits - 1), 2 ** (bits - 1) + 1, 2**bits - 2, 2**bits - 1]
    )
    values = draw(st.lists(st.one_of(edge, st.integers(0, 2**bits - 1)), max_size=64))
    return np.array(values, dtype=UINT_VIEW[width])


@FAST
@given(uint_arrays())
def test_zigzag_round_trip_and_order(values):
    width = values.dtype.itemsize
    code = zigzag(values)
    assert code.dtype == UINT_VIEW[width]
    assert np.array_equal(unzigzag(code), values)
    assert np.array_equal(zigzag(unzigzag(values)), values)  # a bijection
    signed = values.view(INT_VIEW[width]).astype(object)
    expected = [2 * s if s >= 0 else -2 * s - 1 for s in signed]
    assert code.astype(object).tolist() == expected


@pytest.mark.parametrize("width", WIDTHS)
def test_zigzag_small_differences(width):
    diffs = np.array([0, -1, 1, -2, 2], dtype=INT_VIEW[width]).view(UINT_VIEW[width])
    assert zigzag(diffs).tolist() == [0, 1, 2, 3, 4]
    extremes = np.array([np.iinfo(INT_VIEW[width]).max, np.iinfo(INT_VIEW[width]).min], dtype=INT_VIEW[width])
    top = 2 ** (8 * width)
    assert zigzag(extremes.view(UINT_VIEW[width])).tolist() == [top - 2, top - 1]


@FAST
@given(uint_arrays())
def test_planes_round_trip_and_layout(values):
    width = values.dtype.itemsize
    planes = to_planes(values)
    assert len(planes) == values.size * width
    back = from_planes(planes, width, values.size)
    assert back.dtype == UINT_VIEW[width] and np.array_equal(back, values)
    le_bytes = values.astype(values.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, width)
    for byte in range(width):  # plane k holds byte k (little-endian) of every element, in order
        plane = np.frombuffer(planes[byte * values.size : (byte + 1) * values.size], dtype=np.uint8)
        assert np.array_equal(plane, le_bytes[:, byte])


def test_from_planes_result_is_writable_and_owned():
    data = to_planes(np.arange(6, dtype="<u2"))
    out = from_planes(data.tobytes(), 2, 6)
    out[0] = 99  # must not be a read-only view of ``data``
    assert to_planes(np.arange(6, dtype="<u2")).tobytes() == data.tobytes()


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 64, 1000, 70001])
def test_plane_kernels_agree_with_numpys_transpose(width, n):
    """The kernels behind to_planes / from_planes against the transpose they replace, also into a
    slice of a bigger buffer (as a block of a tensor is decoded), with its neighbours untouched."""
    from weightsync.codec.kernels import merge_planes, split_planes

    values = np.random.default_rng(n + width).integers(0, 256, n * width, dtype=np.uint8).view(UINT_VIEW[width])
    reference = np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T).reshape(-1)
    assert np.array_equal(split_planes(values), reference)
    buf = np.full(n + 2, 7, UINT_VIEW[width])
    merge_planes(reference, buf[1:-1])
    assert np.array_equal(buf[1:-1], values) and buf[0] == buf[-1] == 7
    with pytest.raises(ValueError):
        merge_planes(reference[:-1] if n else np.zeros(1, np.uint8), buf[1:-1])
    with pytest.raises(ValueError):
        split_planes(values.view(INT_VIEW[width]))
    if width > 1:
        with pytest.raises(ValueError):
            split_planes(values.astype(values.dtype.newbyteorder(">")))


# --- hostile payloads ------------------------------------------------------------------------------
def _valid(codec: str) -> tuple[bytes, np.ndarray | None, np.ndarray, str]:
    """A valid multi-block payload of ``codec`` for 40 U16 elements in blocks of 8; (payload, old, new, dtype)."""
    rng = np.random.default_rng(1)
    old = rng.integers(0, 2**16, 40, dtype=np.uint16)
    new = old.copy()
    cfg = CodecConfig(block_bytes=16)
    if codec == "full":
        enc = encode_tensor("U16", raw(new), None, cfg)
        return enc.payload, None, raw(new), "U16"
    if codec == "sparse":
        new[[1, 2, 17, 39]] += np.array([1, 65535, 300, 7], dtype=np.uint16)
        enc = encode_tensor(
            "U16", raw(new), raw(old), CodecConfig(block_bytes=16, dense_above=1.0, entropy_coder=False)
        )
    else:
        new += rng.integers(1, 4, 40, dtype=np.uint16)
        enc = encode_tensor(
            "U16", raw(new), raw(old), CodecConfig(block_bytes=16, dense_above=0.0, entropy_coder=False)
        )
    assert enc.codec == codec
    return enc.payload, raw(old), raw(new), "U16"


def _patch_header(payload: bytes, **fields) -> bytes:
    names = ("magic", "cid", "width", "reserved", "n", "step", "n_blocks")
    vals = dict(zip(names, HEADER.unpack_from(payload)))
    vals.update(fields)
    return HEADER.pack(*(vals[k] for k in names)) + payload[HEADER.size :]


def _lengths(payload: bytes) -> np.ndarray:
    n_blocks = HEADER.unpack_from(payload)[-1]
    return np.frombuffer(payload[HEADER.size : HEADER.size + 8 * n_blocks], dtype="<u8").copy()


def _with_lengths(payload: bytes, lengths: np.ndarray) -> bytes:
    return payload[: HEADER.size] + lengths.astype("<u8").tobytes() + payload[HEADER.size + 8 * lengths.size :]


def _decode(codec, payload, old, nbytes, dtype="U16"):
    return decode_tensor(dtype, codec, payload, old, nbytes)


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
def test_valid_payloads_decode(codec):
    payload, old, new, dtype = _valid(codec)
    assert np.array_equal(_decode(codec, payload, old, new.size, dtype), new)


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
def test_every_truncation_is_a_format_error(codec):
    payload, old, new, dtype = _valid(codec)
    for cut in range(len(payload)):
        with pytest.raises(FormatError):
            _decode(codec, payload[:cut], old, new.size, dtype)


HEADER_MUTATIONS = {
    "wrong magic": dict(magic=b"WSP2"),
    "lowercase magic": dict(magic=b"wsp1"),
    "codec id 0": dict(cid=0),
    "codec id 99": dict(cid=99),
    "width 1": dict(width=1),
    "width 4": dict(width=4),
    "width 3": dict(width=3),
    "one element more": dict(n=41),
    "one element less": dict(n=39),
    "no elements": dict(n=0),
    "block elems 0": dict(step=0),
    "block elems too large": dict(step=MAX_BLOCK_ELEMS + 1),
    "block elems changed": dict(step=16),
    "one block less": dict(n_blocks=4),
    "one block more": dict(n_blocks=6),
    "2**32-1 blocks": dict(n_blocks=2**32 - 1),
}


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
@pytest.mark.parametrize("mutation", sorted(HEADER_MUTATIONS))
def test_corrupt_header_is_a_format_error(codec, mutation):
    payload, old, new, dtype = _valid(codec)
    with pytest.raises(FormatError):
        _decode(codec, _patch_header(payload, **HEADER_MUTATIONS[mutation]), old, new.size, dtype)


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
@pytest.mark.parametrize("other", ["full", "sparse", "dense"])
def test_payload_of_another_codec_is_a_format_error(codec, other):
    if codec == other:
        return
    payload, _, new, dtype = _valid(codec)
    with pytest.raises(FormatError):
        _decode(other, payload, new, new.size, dtype)


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
@pytest.mark.parametrize("change", ["plus one", "minus one", "zeroed", "one more than the payload"])
def test_block_lengths_not_adding_up_are_a_format_error(codec, change):
    payload, old, new, dtype = _valid(codec)
    lengths = _lengths(payload)
    if change == "plus one":
        lengths[-1] += 1
    elif change == "minus one":
        lengths[np.flatnonzero(lengths)[-1]] -= 1
    elif change == "zeroed":
        lengths[:] = 0
    else:
        lengths[0] = len(payload)
    with pytest.raises(FormatError):
        _decode(codec, _with_lengths(payload, lengths), old, new.size, dtype)


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
def test_block_lengths_that_only_add_up_modulo_2_64_are_a_format_error(codec):
    """Two lengths of about 2**63 each wrap around a uint64 sum to the real payload size."""
    payload, old, new, dtype = _valid(codec)
    lengths = _lengths(payload)
    lengths[0] += np.uint64(2**63)
    lengths[1] += np.uint64(2**63)
    with pytest.raises(FormatError):
        _decode(codec, _with_lengths(payload, lengths), old, new.size, dtype)


@pytest.mark.parametrize("codec", ["full", "sparse", "dense"])
def test_trailing_bytes_after_a_zstd_frame_are_a_format_error(codec):
    """A block must be exactly one frame: extra bytes inside a declared block are not ignored."""
    payload, old, new, dtype = _valid(codec)
    lengths = _lengths(payload)
    lengths[-1] += 4
    with pytest.raises(FormatError):
        _decode(codec, _with_lengths(payload, lengths) + b"JUNK", old, new.size, dtype)


def _full_payload_with_block(block: bytes, n: int, width: int = 2) -> bytes:
    return HEADER.pack(MAGIC, CODEC_ID["full"], width, 0, n, n, 1) + struct.pack("<Q", len(block)) + block


def _set_frame_content_size(frame: bytes, size: int) -> bytes:
    """Rewrite the Frame_Content_Size field of a zstd frame header (RFC 8878 3.1.1.1)."""
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    assert fcs_flag in (2, 3), "test frames use 4- or 8-byte content sizes"
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    nbytes = 4 if fcs_flag == 2 else 8
    return frame[:pos] + size.to_bytes(nbytes, "little") + frame[pos + nbytes :]


def test_decompression_bomb_is_rejected_before_decompressing():
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # small frame, declares 64 MiB
    assert len(bomb) < 64 << 10
    with pytest.raises(FormatError, match="declares"):
        _decode("full", _full_payload_with_block(bomb, 8), None, 16)


def test_frame_without_content_size_is_rejected():
    frame = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(16))
    with pytest.raises(FormatError):
        _decode("full", _full_payload_with_block(frame, 8), None, 16)


def test_frame_that_lies_about_its_size_is_rejected():
    frame = zstandard.ZstdCompressor(level=1).compress(np.random.default_rng(0).bytes(100_000))
    liar = _set_frame_content_size(frame, 16)  # declares what the decoder expects, holds 100 KB
    with pytest.raises(FormatError):
        _decode("full", _full_payload_with_block(liar, 8), None, 16)


@pytest.mark.parametrize(
    "garbage", [b"", b"\x00", b"\x28\xb5\x2f\xfd", b"\x28\xb5\x2f\xfd" + bytes(20), b"not zstd at all"]
)
def test_garbage_block_is_rejected(garbage):
    with pytest.raises(FormatError):
        _decode("full", _full_payload_with_block(garbage, 8), None, 16)


def _sparse_payload(block: bytes, n: int = 8) -> bytes:
    return HEADER.pack(MAGIC, CODEC_ID["sparse"], 2, 0, n, n, 1) + struct.pack("<Q", len(block)) + block


def _sparse_block(
    gaps: list[int],
    values: list[int],
    gap_width: int = 1,
    count: int | None = None,
    glen_delta: int = 0,
    width: int = 2,
) -> bytes:
    zc = zstandard.ZstdCompressor(level=3, write_content_size=True)
    gz = zc.compress(to_planes(np.array(gaps, dtype=UINT_VIEW[gap_width])))
    vz = zc.compress(to_planes(np.array(values, dtype=UINT_VIEW[width])))
    k = len(gaps) if count is None else count
    return SPARSE.pack(k, gap_width, 0, 0, len(gz) + glen_delta) + gz + vz


def test_handmade_sparse_block_decodes():
    """The sparse layout as documented: gaps between changed positions, zigzag deltas, byte planes."""
    old = raw(np.arange(8, dtype="<u2"))
    payload = _sparse_payload(_sparse_block([1, 3], [2, 1]))  # +1 at position 1, -1 at position 5
    out = _decode("sparse", payload, old, 16).view("<u2")
    assert out.tolist() == [0, 2, 2, 3, 4, 4, 6, 7]


SPARSE_ATTACKS = {
    "position beyond block": dict(gaps=[8], values=[2]),
    "second position beyond block": dict(gaps=[3, 4], values=[2, 2]),
    "large gap width beyond block": dict(gaps=[70000], values=[2], gap_width=4),
    "count larger than block": dict(gaps=[0] * 9, values=[2] * 9),
    "count zero": dict(gaps=[0], values=[2], count=0),
    "count disagrees with streams": dict(gaps=[0, 0], values=[2, 2], count=3),
    "gap width 3": dict(gaps=[0], values=[2], gap_width=1, count=None),
    "gaps length beyond block": dict(gaps=[0], values=[2], glen_delta=1000),
    "gaps length short": dict(gaps=[0], values=[2], glen_delta=-1),
    "values of the wrong width": dict(gaps=[0], values=[2], width=4),
}


@pytest.mark.parametrize("slice_bytes", [6, 512 << 10])
@pytest.mark.parametrize("attack", sorted(SPARSE_ATTACKS))
def test_hostile_sparse_block_is_a_format_error(attack, slice_bytes):
    kwargs = dict(SPARSE_ATTACKS[attack])
    block = _sparse_block(**kwargs)
    if attack == "gap width 3":
        block = block[:4] + b"\x03" + block[5:]
    old = raw(np.arange(8, dtype="<u2"))
    with pytest.raises(FormatError), slices_of(slice_bytes):  # also across slices of 3 elements
        _decode("sparse", _sparse_payload(block), old, 16)


@pytest.mark.parametrize("slice_bytes", [6, 512 << 10])
@pytest.mark.parametrize("gap_width", [0, 3, 5, 8])
def test_a_consistent_sparse_block_of_an_unknown_gap_width_is_a_format_error(gap_width, slice_bytes):
    """The gap stream holds ``k * gap_width`` bytes, as its header says, so only the width check can
    refuse it (a kernel's ValueError must not escape either)."""
    zc = zstandard.ZstdCompressor(level=3, write_content_size=True)
    gz = zc.compress(bytes([1] + [0] * (gap_width - 1)) if gap_width else b"")  # one gap of 1
    vz = zc.compress(to_planes(np.array([2], dtype="<u2")))
    block = SPARSE.pack(1, gap_width, 0, 0, len(gz)) + gz + vz
    old = raw(np.arange(8, dtype="<u2"))
    with pytest.raises(FormatError, match=f"gap width={gap_width}"), slices_of(slice_bytes):
        _decode("sparse", _sparse_payload(block), old, 16)


def test_a_sparse_kernel_error_is_a_format_error(monkeypatch):
    """Whatever the kernel's own checks refuse reaches the caller as a FormatError naming the block."""
    payload, old, new, dtype = _valid("sparse")

    def refuse(*args, **kwargs):
        raise ValueError("apply_sparse: planes, position or end do not fit the output")

    monkeypatch.setattr(sparse_codec, "apply_sparse", refuse)
    with pytest.raises(FormatError, match="bad sparse block"):
        _decode("sparse", payload, old, new.size, dtype)


@pytest.mark.parametrize("cut", range(1, SPARSE.size))
def test_truncated_sparse_block_header_is_a_format_error(cut):
    old = raw(np.arange(8, dtype="<u2"))
    with pytest.raises(FormatError):
        _decode("sparse", _sparse_payload(_sparse_block([0], [2])[:cut]), old, 16)


def test_decode_argument_errors_are_format_errors():
    payload, old, new, dtype = _valid("sparse")
    with pytest.raises(FormatError):
        _decode("sparse", payload, None, new.size)  # delta without a base
    with pytest.raises(FormatError):
        _decode("sparse", payload, old[:-2], new.size)  # base of another size
    with pytest.raises(FormatError):
        _decode("same", b"", None, new.size)
    with pytest.raises(FormatError):
        _decode("same", b"\x00", old, new.size)  # 'same' carries no payload
    with pytest.raises(FormatError):
        _decode("bogus", payload, old, new.size)
    with pytest.raises(FormatError):
        _decode("bogus", payload, None, new.size)
    with pytest.raises(FormatError):
        _decode("sparse", payload, old, new.size + 1)  # not whole elements
    with pytest.raises(FormatError):
        _decode("sparse", payload, old[:-1], new.size)  # base not whole elements


@st.composite
def mutated_payloads(draw):
    codec = draw(st.sampled_from(["full", "sparse", "dense"]))
    payload, old, new, dtype = _valid(codec)
    data = bytearray(payload)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append"]))
        if not data and op not in ("insert", "append"):
            continue
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        else:
            data += draw(st.binary(min_size=1, max_size=8))
    decode_as = draw(st.sampled_from(["full", "sparse", "dense", "same", "other"]))
    base = draw(st.sampled_from(["given", "none", "short"]))
    base_arr = {"given": old if old is not None else new, "none": None, "short": new[:-2]}[base]
    return decode_as, bytes(data), base_arr, new.size


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_payloads())
def test_fuzzed_payloads_decode_or_raise_format_or_usage_errors(case):
    codec, payload, old, nbytes = case
    try:
        out = decode_tensor("U16", codec, payload, old, nbytes)
    except WeightsyncError as exc:
        assert isinstance(exc, (FormatError, UsageError)), type(exc)
    else:
        assert out.dtype == np.uint8 and out.size == nbytes
    if old is not None:  # the same damage decoded backward (a rollback's step), ``old`` as the result
        try:
            out = decode_tensor_backward("U16", codec, payload, old, nbytes)
        except WeightsyncError as exc:
            assert isinstance(exc, (FormatError, UsageError)), type(exc)
        else:
            assert out.dtype == np.uint8 and out.size == nbytes


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["full", "sparse", "dense"]), st.sampled_from(DTYPES))
def test_random_bytes_never_crash_the_decoder(data, codec, dtype):
    nbytes = 8 * ITEMSIZE[dtype]
    prefix = HEADER.pack(MAGIC, CODEC_ID[codec], ITEMSIZE[dtype], 0, 8, 4, 2)
    for payload in (data, prefix + data):
        try:
            decode_tensor(dtype, codec, payload, np.zeros(nbytes, dtype=np.uint8), nbytes)
        except WeightsyncError as exc:
            assert isinstance(exc, (FormatError, UsageError)), type(exc)


# --- compression requirement -------------------------------------------------------------------------
def test_sparse_bf16_delta_is_much_smaller_than_compressed_xor():
    """Project requirement: ~3% of bf16 elements moving by +/-1 ulp must compress >= 1.5x better
    than zstd(level 3) of the XOR of the whole tensor."""
    rng = np.random.default_rng(42)
    n = 1 << 20
    old = to_bf16_bits(rng.standard_normal(n).astype(np.float32) * np.float32(0.02))
    new = old.copy()
    idx = np.flatnonzero(rng.random(n) < 0.03)
    new[idx] += np.where(rng.random(idx.size) < 0.5, 1, 0xFFFF).astype(np.uint16)  # +/-1 ulp, wrapping
    xor_z = zstandard.ZstdCompressor(level=3).compress((old ^ new).tobytes())
    sparse = encode_tensor("BF16", raw(new), raw(old), CodecConfig(dense_above=1.0, entropy_coder=False))
    assert sparse.codec == "sparse" and sparse.changed == idx.size
    assert len(xor_z) >= 1.5 * len(sparse.payload), (len(xor_z), len(sparse.payload))
    chosen = encode_tensor("BF16", raw(new), raw(old))
    assert len(chosen.payload) <= len(sparse.payload)
    assert np.array_equal(decode_tensor("BF16", chosen.codec, chosen.payload, raw(old), 2 * n), raw(new))


def _streams_reference(old: np.ndarray, new: np.ndarray) -> tuple[bytes, int, int]:
    """The ``sparse`` streams as numpy spells them: positions, gaps, zigzag codes, byte planes."""
    idx = np.flatnonzero(old != new)
    gaps = np.diff(idx, prepend=-1) - 1
    gw = 1 if not idx.size or gaps.max() < 1 << 8 else 2 if gaps.max() < 1 << 16 else 4
    streams = to_planes(gaps.astype(UINT_VIEW[gw])).tobytes() + to_planes(zigzag(new[idx] - old[idx])).tobytes()
    return streams, idx.size, gw


def _check_streams(old: np.ndarray, new: np.ndarray) -> tuple[int, int]:
    from weightsync.codec.kernels import sparse_streams

    streams, k, gw = sparse_streams(old, new)
    assert streams.dtype == np.uint8 and (streams.tobytes(), k, gw) == _streams_reference(old, new)
    payload = sparse_codec.encode_block(old, new, 1)[0]  # the block written from them, and from numpy's
    assert payload == sparse_codec.block_from_changes(np.flatnonzero(old != new), (new - old)[old != new], 1)
    return k, gw


@FAST
@given(width=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_sparse_streams_agree_with_numpy(width, data):
    """The sparse encoder's one-pass kernel writes the gap and code planes numpy gives, byte for byte."""
    dt = UINT_VIEW[width]
    n = data.draw(st.integers(0, 300))
    old = np.frombuffer(data.draw(st.binary(min_size=n * width, max_size=n * width)), dtype=dt).copy()
    new = old.copy()
    for i in data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []:
        new[i] = data.draw(st.integers(0, (1 << (8 * width)) - 1))
    _check_streams(old, new)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_sparse_streams_at_every_bit_of_a_word(width):
    """The kernel visits 64-element words by their bit masks, the first four changes of a word
    without a branch: one change at each position of three words and a tail, two to six in one
    word, every element changed (with and without a tail), and nothing at all."""
    dt = UINT_VIEW[width]
    for n in (3 * 64 + 5, 3 * 64, 0):
        old = np.arange(n, dtype=dt)
        cases = [[i] for i in range(n)] + [list(range(n)), []]
        cases += [[0, 63], [1, 2, 3], [60, 61, 62, 63], [64, 70, 100, 127, 128], [0, 1, 2, 3, 4, 5]] if n else []
        for where in cases:
            new = old.copy()
            new[where] -= 1  # wraps at 0
            assert _check_streams(old, new)[0] == len(where)


@pytest.mark.parametrize("gap, width", [(255, 1), (256, 2), (65535, 2), (65536, 4)])
def test_sparse_streams_gap_width_is_the_narrowest_that_holds_the_largest_gap(gap, width):
    old = np.zeros(gap + 3, np.uint16)
    new = old.copy()
    new[[0, gap + 1]] = 1
    assert _check_streams(old, new) == (2, width)


def test_sparse_streams_and_apply_sparse_refuse_what_their_kernels_would_misread():
    """The kernels do not check bounds: their wrappers refuse arguments that do not fit."""
    from weightsync.codec.kernels import apply_sparse, sparse_streams

    a = np.zeros(8, np.uint16)
    with pytest.raises(ValueError):
        sparse_streams(a, np.zeros(9, np.uint16))  # lengths differ
    with pytest.raises(ValueError):
        sparse_streams(a, a.astype(np.int16))  # not unsigned
    gaps, vals = np.array([1], np.uint8), np.array([2, 0], np.uint8)  # +1 at position 1
    out = np.zeros(8, np.uint16)
    for bad in (
        {"src": np.zeros(7, np.uint16)},
        {"src": np.zeros(8, np.uint32)},
        {"src": a, "start": 9},
        {"src": a, "start": 0, "pos": 0},
        {"end": 9},
        {"k": 2},
        {"src": a, "start": 4},
    ):  # the change at position 1 lies before the copy: never applied
        kw = {"k": 0, "pos": -1, "end": 8, **bad}
        with pytest.raises(ValueError):
            apply_sparse(out, gaps, 1, vals, kw.pop("k"), kw.pop("pos"), kw.pop("end"), **kw)
    src = np.arange(8, dtype=np.uint16)
    assert apply_sparse(out, gaps, 1, vals, 0, -1, 4, src, 0) == (1, 1)
    assert out.tolist() == [0, 2, 2, 3, 0, 0, 0, 0]  # copied up to the end, patched


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F64", "U8"])
def test_payload_changes_are_the_sparse_delta_without_a_base(dtype):
    """What an in-place patch needs from a ``sparse`` payload: every changed position and the
    wrapping difference there, across blocks, without decoding the unchanged elements."""
    from weightsync.codec.payload import payload_changes

    width = itemsize(dtype)
    rng = np.random.default_rng(width)
    old = rng.integers(0, 256, 5000 * width, dtype=np.uint8)
    new = old.copy()
    new.view(UINT_VIEW[width])[rng.random(5000) < 0.03] -= 1  # wraps at zero
    new.view(UINT_VIEW[width])[-1] += 7  # the last element of the last block
    cfg = CodecConfig(entropy_coder=False, block_bytes=1024 * width)  # five blocks
    enc = encode_tensor(dtype, new, old, cfg)
    assert enc.codec == "sparse"
    idx, diff = payload_changes(dtype, enc.codec, enc.payload, new.size)
    o, n = old.view(UINT_VIEW[width]), new.view(UINT_VIEW[width])
    assert np.array_equal(idx, np.flatnonzero(o != n))
    assert np.array_equal(o[idx] + diff, n[idx])
    assert payload_changes(dtype, "same", b"", new.size)[0].size == 0
    if width < 8:
        for coder in ("ac", "ans"):  # their positions depend on the base
            payload = encode_tensor(dtype, new, old, CodecConfig(coder=coder)).payload
            assert payload_changes(dtype, coder, payload, new.size) is None
    bad = bytearray(enc.payload)
    bad[-3] ^= 0xFF
    with pytest.raises(FormatError):
        payload_changes(dtype, enc.codec, bytes(bad[:-1]), new.size)
