"""Deltas decoded backward: the base a payload was encoded against, from the tensor it decodes to.

``sparse`` and ``dense`` store the differences themselves, so old = new - difference; ``ac`` codes
the change in the old value's context and ``full`` has no base: neither runs backward. Every
comparison is on raw bytes.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from weightsync.codec import hashing, registry
from weightsync.codec import streams as codec_streams
from weightsync.codec.abc import Codec
from weightsync.codec.payload import (
    CodecConfig,
    _encode_payload,
    decode_tensor,
    decode_tensor_backward,
    encode_tensor,
    rebuild,
)
from weightsync.codec.streams import to_planes
from weightsync.errors import ChecksumError, FormatError, UsageError, WeightsyncError
from weightsync.format.dtypes import ITEMSIZE, UINT_VIEW

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = struct.Struct("<4sBBHQQI")  # docs/FORMAT.md "Payloads": magic, codec id, width, 0, n, B, k
SPARSE = struct.Struct("<IBBHI")  # changed count, gap width, reserved, reserved, compressed gaps length
DTYPES = ["U8", "BF16", "F16", "F32", "I32", "F64", "I64"]


def raw(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8).reshape(-1)


def pair(dtype: str, n: int, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two versions of a tensor of ``n`` elements, ``frac`` of them changed by +-1 or anything
    (wrapping: every width's edges are crossed), as unsigned views."""
    rng = np.random.default_rng(seed)
    view = UINT_VIEW[ITEMSIZE[dtype]]
    old = rng.integers(0, np.iinfo(view).max, n, dtype=view, endpoint=True)
    new = old.copy()
    idx = np.flatnonzero(rng.random(n) < frac)
    step = rng.choice(np.array([1, np.iinfo(view).max, 7], dtype=view), idx.size)
    arbitrary = rng.integers(1, np.iinfo(view).max, idx.size, dtype=view, endpoint=True)
    new[idx] = old[idx] + np.where(rng.random(idx.size) < 0.2, arbitrary, step)
    return old, new


CODECS = ("dense", "sparse", "ans")
SMALL_BLOCKS = CodecConfig(block_bytes=64)  # blocks of a few elements: their edges are crossed too


def encode_with(codec: str, dtype: str, old: np.ndarray, new: np.ndarray) -> tuple[bytes, bytes]:
    """The payload of ``codec`` itself (not whichever ``encode_tensor`` would choose) and its
    reverse payload (``ans``'s exception lists; b"" for the others)."""
    payload, _, reverse = _encode_payload(registry.get(codec), dtype, old, new, SMALL_BLOCKS)
    return bytes(payload), bytes(reverse)


def encoded(codec: str, dtype: str, n: int, frac: float, seed: int) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    old, new = pair(dtype, n, frac, seed)
    return *encode_with(codec, dtype, old, new), old, new


def test_which_codecs_are_invertible():
    assert all(registry.get(name).invertible for name in ("sparse", "dense", "ans"))
    assert not registry.get("ac").invertible  # its contexts are the old values
    assert not registry.get("full").invertible  # no base at all
    assert Codec.invertible is False


def test_the_default_is_not_implemented():
    with pytest.raises(NotImplementedError, match="'ac' cannot decode backward"):
        registry.get("ac").decode_backward("BF16", memoryview(b""), np.zeros(4, "<u2"), np.zeros(4, "<u2"), "t")


@FAST
@given(
    st.sampled_from(CODECS),
    st.sampled_from(DTYPES),
    st.integers(0, 300),
    st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    st.integers(0, 2**32 - 1),
    st.sampled_from([2, 24, 512 << 10]),
)
def test_backward_gives_the_base_back_exactly(codec, dtype, n, frac, seed, slice_bytes):
    """Into a fresh buffer, into a given one and in place, hashing exactly the result, across
    blocks of a few elements and slices of a few bytes."""
    assume(registry.get(codec).supports(dtype))  # ans: elements of up to 4 bytes
    payload, rev, old, new = encoded(codec, dtype, n, frac, seed)
    saved, codec_streams.SLICE_BYTES = codec_streams.SLICE_BYTES, slice_bytes
    try:
        out = decode_tensor_backward(dtype, codec, payload, raw(new), new.nbytes, reverse=rev)
        assert np.array_equal(out, raw(old))
        buf = np.full(new.nbytes, 0xA5, np.uint8)
        assert decode_tensor_backward(dtype, codec, payload, raw(new), new.nbytes, out=buf, reverse=rev) is buf
        assert np.array_equal(buf, raw(old))
        inplace = raw(new).copy()
        hasher = xxhash.xxh3_128()
        got = decode_tensor_backward(
            dtype, codec, payload, inplace, new.nbytes, out=inplace, hasher=hasher, reverse=rev
        )
        assert got is inplace and np.array_equal(inplace, raw(old))
        assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(raw(old))
        for into in (None, raw(new).copy()):  # fed by the kernels (weightsync.codec.hashing), fresh and in place
            fed = hashing.hasher()
            got = decode_tensor_backward(
                dtype, codec, payload, raw(new) if into is None else into, new.nbytes, into, hasher=fed, reverse=rev
            )
            assert np.array_equal(got, raw(old)) and fed.hexdigest() == hasher.hexdigest()
    finally:
        codec_streams.SLICE_BYTES = saved
    # and forward again from the base recovered
    assert np.array_equal(decode_tensor(dtype, codec, payload, out, new.nbytes), raw(new))


def test_wrapping_edges_and_specials_run_backward():
    old = np.array([0, 0xFFFF, 0x7FFF, 0x8000, 0x7FC1, 0xFF80, 1, 2], dtype="<u2")
    new = np.array([0xFFFF, 0, 0x8000, 0x7FFF, 0x7FC2, 0x0000, 1, 2], dtype="<u2")
    for codec in CODECS:
        payload, rev = encode_with(codec, "BF16", old, new)
        assert np.array_equal(decode_tensor_backward("BF16", codec, payload, raw(new), 16, reverse=rev), raw(old))


def test_same_runs_backward_as_a_copy():
    new = raw(np.arange(8, dtype="<u2"))
    assert np.array_equal(decode_tensor_backward("BF16", "same", b"", new, 16), new)
    with pytest.raises(FormatError, match="carries no payload"):
        decode_tensor_backward("BF16", "same", b"\x00", new, 16)


@pytest.mark.parametrize("codec", ["ac", "full", "bogus"])
def test_codecs_that_cannot_run_backward_are_refused(codec):
    old, new = pair("BF16", 64, 0.1, 1)
    base = None if codec == "full" else raw(old)
    payload = encode_tensor("BF16", raw(new), base).payload if codec != "bogus" else b""
    with pytest.raises(FormatError, match="cannot be decoded backward|unknown codec"):
        decode_tensor_backward("BF16", codec, payload, raw(new), new.nbytes)


def test_argument_errors():
    payload, _, old, new = encoded("sparse", "BF16", 64, 0.1, 2)
    with pytest.raises(FormatError):
        decode_tensor_backward("BF16", "sparse", payload, raw(new)[:-2], new.nbytes)  # result of another size
    with pytest.raises(FormatError):
        decode_tensor_backward("BF16", "sparse", payload, raw(new), new.nbytes + 1)  # not whole elements
    with pytest.raises(FormatError):
        decode_tensor_backward("F32", "sparse", payload, raw(new), new.nbytes)  # another element width
    with pytest.raises(UsageError, match="output buffer has"):
        decode_tensor_backward("BF16", "sparse", payload, raw(new), new.nbytes, out=np.empty(3, np.uint8))
    room = np.zeros(new.nbytes + 2, np.uint8)
    room[:-2] = raw(new)
    with pytest.raises(UsageError, match="overlaps the result"):
        decode_tensor_backward("BF16", "sparse", payload, room[:-2], new.nbytes, out=room[2:])


def _sparse_payload(block: bytes, n: int = 8) -> bytes:
    return HEADER.pack(b"WSP1", 2, 2, 0, n, n, 1) + struct.pack("<Q", len(block)) + block


def _sparse_block(gaps, values, gap_width=1, count=None, glen_delta=0, width=2) -> bytes:
    zc = zstandard.ZstdCompressor(level=3, write_content_size=True)
    gz = zc.compress(to_planes(np.array(gaps, dtype=UINT_VIEW[gap_width])))
    vz = zc.compress(to_planes(np.array(values, dtype=UINT_VIEW[width])))
    k = len(gaps) if count is None else count
    return SPARSE.pack(k, gap_width, 0, 0, len(gz) + glen_delta) + gz + vz


def test_handmade_sparse_block_runs_backward():
    new = raw(np.array([0, 2, 2, 3, 4, 4, 6, 7], dtype="<u2"))
    payload = _sparse_payload(_sparse_block([1, 3], [2, 1]))  # +1 at position 1, -1 at position 5
    assert decode_tensor_backward("BF16", "sparse", payload, new, 16).view("<u2").tolist() == list(range(8))


HOSTILE = {
    "position beyond block": dict(gaps=[8], values=[2]),
    "second position beyond block": dict(gaps=[3, 4], values=[2, 2]),
    "large gap width beyond block": dict(gaps=[70000], values=[2], gap_width=4),
    "count larger than block": dict(gaps=[0] * 9, values=[2] * 9),
    "count zero": dict(gaps=[0], values=[2], count=0),
    "count disagrees with streams": dict(gaps=[0, 0], values=[2, 2], count=3),
    "gaps length beyond block": dict(gaps=[0], values=[2], glen_delta=1000),
    "gaps length short": dict(gaps=[0], values=[2], glen_delta=-1),
    "values of the wrong width": dict(gaps=[0], values=[2], width=4),
}


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("slice_bytes", [6, 512 << 10])
@pytest.mark.parametrize("attack", sorted(HOSTILE) + ["gap width 3", "truncated header"])
def test_hostile_sparse_blocks_backward_are_format_errors(attack, slice_bytes, in_place):
    """What a forward decode refuses, a backward one refuses too, in place or not, and never
    writes outside its output (the guard bytes around it stay as they were)."""
    if attack == "gap width 3":
        block = _sparse_block([0], [2])
        block = block[:4] + b"\x03" + block[5:]
    elif attack == "truncated header":
        block = _sparse_block([0], [2])[:7]
    else:
        block = _sparse_block(**HOSTILE[attack])
    arena = np.full(64, 0x5A, np.uint8)  # guard, new, out, guard
    new = arena[16:32]
    new[:] = raw(np.arange(8, dtype="<u2"))
    out = new if in_place else arena[32:48]
    saved, codec_streams.SLICE_BYTES = codec_streams.SLICE_BYTES, slice_bytes
    try:
        with pytest.raises(FormatError):
            decode_tensor_backward("BF16", "sparse", _sparse_payload(block), new, 16, out=out)
    finally:
        codec_streams.SLICE_BYTES = saved
    assert (arena[:16] == 0x5A).all() and (arena[48:] == 0x5A).all()
    if not in_place:
        assert np.array_equal(new, raw(np.arange(8, dtype="<u2")))


def test_hostile_dense_blocks_backward_are_format_errors():
    payload, _, old, new = encoded("dense", "BF16", 8, 0.5, 3)
    for cut in range(1, len(payload)):
        with pytest.raises(FormatError):
            decode_tensor_backward("BF16", "dense", payload[:cut], raw(new), new.nbytes)


@pytest.mark.parametrize("codec", CODECS)
def test_rebuild_mixes_forward_and_backward_steps_and_checks_the_result(codec):
    """v0 -> v1 -> v2 forward, then v2 back to v1 and v0 by undoing the deltas (in place too); a
    step undone with the wrong payload ends in a ChecksumError, never in other bytes."""
    dtype = "BF16"
    v0, v1 = pair(dtype, 500, 0.05, 4)
    a, b = pair(dtype, 500, 0.05, 5)
    v2 = v1 + (b - a)  # another change on top of v1
    (p1, r1), (p2, r2) = encode_with(codec, dtype, v0, v1), encode_with(codec, dtype, v1, v2)
    back = [(codec, lambda: p2, True, lambda: r2), (codec, lambda: p1, True, lambda: r1)]
    h0 = xxhash.xxh3_128_hexdigest(raw(v0))
    assert np.array_equal(rebuild(dtype, v0.nbytes, h0, raw(v2).copy(), back, "t"), raw(v0))
    base = raw(v2).copy()
    got = rebuild(dtype, v0.nbytes, h0, base, back, "t", in_place=True)
    assert got is base and np.array_equal(base, raw(v0))
    h1 = xxhash.xxh3_128_hexdigest(raw(v1))
    assert np.array_equal(rebuild(dtype, v1.nbytes, h1, raw(v2), back[:1], "t"), raw(v1))
    mixed = [(codec, lambda: p1, False), (codec, lambda: p1, True, lambda: r1)]  # there and back
    assert np.array_equal(rebuild(dtype, v0.nbytes, h0, raw(v0), mixed, "t"), raw(v0))
    # the wrong delta: other bytes, or (ans) a block whose contexts do not fit them
    with pytest.raises(ChecksumError if codec != "ans" else (ChecksumError, FormatError)):
        rebuild(dtype, v1.nbytes, h1, raw(v2), [(codec, lambda: p1, True, lambda: r1)], "t")
    if r2:  # its reverse payload left out, or another's given: refused, never other bytes
        for wrong in (None, lambda: r1):
            with pytest.raises((ChecksumError, FormatError)):
                rebuild(dtype, v1.nbytes, h1, raw(v2), [(codec, lambda: p2, True, wrong)], "t")
    with pytest.raises(FormatError, match="without the bytes it undoes"):
        rebuild(dtype, v1.nbytes, h1, None, back[:1], "t")


def test_fuzzed_backward_payloads_decode_or_raise_format_errors():
    """Random damage to valid payloads: decoding backward gives a result of the right size or a
    FormatError/UsageError, never anything else (hypothesis-driven in test_codec's fuzz test too)."""
    rng = np.random.default_rng(6)
    for codec in CODECS:
        old, new = pair("BF16", 2000, 0.3, 7)
        payload, _, rev = _encode_payload(registry.get(codec), "BF16", old, new, CodecConfig(block_bytes=8192))
        payload, rev = bytes(payload), bytes(rev)
        assert rev or codec != "ans"  # ans: a few blocks of 4096 elements, whose exception lists are apart
        for _ in range(300):
            which = bool(rev) and rng.random() < 0.5  # the payload or its reverse payload damaged
            data = bytearray(rev if which else payload)
            for _ in range(rng.integers(1, 4)):
                pos = int(rng.integers(0, len(data)))
                data[pos] ^= 1 << int(rng.integers(0, 8))
            p, r = (payload, bytes(data)) if which else (bytes(data), rev)
            try:
                out = decode_tensor_backward("BF16", codec, p, raw(new), new.nbytes, reverse=r)
            except WeightsyncError as exc:
                assert isinstance(exc, (FormatError, UsageError)), type(exc)
            else:
                assert out.size == new.nbytes


def test_a_reverse_payload_is_refused_where_it_does_not_belong():
    """One given to a codec that has none, one of another payload's block layout, a forward payload
    given as one: refused before anything is decoded."""
    old, new = pair("BF16", 6000, 0.3, 8)
    ans = registry.get("ans")
    payload, _, rev = _encode_payload(ans, "BF16", old, new, CodecConfig(block_bytes=8192))  # 2 blocks
    whole, _, one = _encode_payload(ans, "BF16", old, new, CodecConfig())  # one block
    sparse, _ = encode_with("sparse", "BF16", old, new)
    assert rev and one
    with pytest.raises(FormatError, match="has no reverse payload"):
        decode_tensor_backward("BF16", "sparse", sparse, raw(new), new.nbytes, reverse=rev)
    with pytest.raises(FormatError, match="reverse payload"):
        decode_tensor_backward("BF16", "ans", payload, raw(new), new.nbytes, reverse=payload)
    with pytest.raises(FormatError, match="blocks are not the payload's"):
        decode_tensor_backward("BF16", "ans", payload, raw(new), new.nbytes, reverse=one)
    assert np.array_equal(decode_tensor_backward("BF16", "ans", payload, raw(new), new.nbytes, reverse=rev), raw(old))
    assert np.array_equal(decode_tensor_backward("BF16", "ans", whole, raw(new), new.nbytes, reverse=one), raw(old))


def test_a_reverse_payload_that_lists_no_exception_is_refused():
    """The encoder writes none (a payload without exceptions has no reverse payload): one given,
    even to a payload whose blocks hold their lists, is refused rather than taken as empty."""
    old, new = pair("BF16", 6000, 0.3, 8)
    payload, _, rev = _encode_payload(registry.get("ans"), "BF16", old, new, CodecConfig(block_bytes=8192))
    empty = HEADER.pack(b"WSR1", 5, 2, 0, 6000, 4096, 2) + struct.pack("<QQ", 0, 0)
    with pytest.raises(FormatError, match="lists no exception"):
        decode_tensor_backward("BF16", "ans", payload, raw(new), new.nbytes, reverse=empty)
    with pytest.raises(FormatError, match="not a reverse payload of 'ans'"):
        decode_tensor_backward("BF16", "ans", payload, raw(new), new.nbytes, reverse=b"WSP1" + bytes(rev)[4:])
