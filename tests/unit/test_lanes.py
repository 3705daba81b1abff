"""Wide rANS sections of codec ``ans`` (weightsync.codec.lanes; docs/FORMAT.md, "ans"): both kinds of
coder against a plain-Python coder written from the format's text, hostile sections, and blocks
that use them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from weightsync.codec import ans, lanes, simd
from weightsync.codec.entropy import NSYM, PROB_ONE, normalise
from weightsync.errors import FormatError

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
W = lanes.WIDE_LANES
SKEWED = np.array([0.41, 0.40, 0.04, 0.035, 0.02, 0.02, 0.01, 0.01, 0.006, 0.006, 0.004, 0.004, 0.003, 0.003, 0.002])
SKEWED = np.append(SKEWED, 1 - SKEWED.sum())


def _freq(syms: np.ndarray) -> np.ndarray:
    freq = np.zeros(NSYM, np.int64)
    normalise(np.bincount(syms, minlength=NSYM).astype(np.int64), freq)
    return freq


def _spec_section(syms: np.ndarray, freq: np.ndarray) -> bytes:
    """The section as docs/FORMAT.md defines it, coded in plain Python: symbol j by state j % 32,
    states in [2^16, 2^32), a state sheds its low 16 bits before coding s when it is at least
    f_s << 20; the words in the order a decoder reads them (the reverse of coding)."""
    start = np.concatenate([[0], np.cumsum(freq)])
    xs, words = [1 << 16] * W, []
    for j in range(len(syms) - 1, -1, -1):
        s, x = int(syms[j]), xs[j % W]
        f = int(freq[s])
        if x >= f << 20:
            words.append(x & 0xFFFF)
            x >>= 16
        xs[j % W] = (x // f) * PROB_ONE + x % f + int(start[s])
    head = b"".join(x.to_bytes(4, "little") for x in xs)
    return head + b"".join(w.to_bytes(2, "little") for w in reversed(words))


def _encode(syms: np.ndarray, freq: np.ndarray, native: bool) -> np.ndarray:
    padded = np.concatenate([syms, np.zeros(64, np.uint8)])  # the encoder's rows carry spare
    out = np.zeros(4 * W + 2 * syms.size + 64, np.uint8)
    return out[: lanes.rans_encode_wide(padded, syms.size, freq, out, native)]


def _decode(section: np.ndarray, freq, values, count: int, native: bool, at: int = 3):
    out = np.zeros(at + count + 64, values.dtype)
    status = lanes.rans_decode_wide(section, 0, section.size, freq, values, out, at, count, native)
    return status, out[at : at + count]


@pytest.mark.parametrize("count", [1, 15, 16, 31, 32, 33, 63, 64, 65, 100, 1000, 4099])
@pytest.mark.parametrize("source", ["skewed", "uniform", "one symbol", "two symbols"])
def test_both_kinds_write_the_sections_the_format_defines_and_read_them_back(count, source):
    rng = np.random.default_rng(count)
    if source == "skewed":
        syms = rng.choice(NSYM, count, p=SKEWED).astype(np.uint8)
    elif source == "uniform":
        syms = rng.integers(0, NSYM, count).astype(np.uint8)
    elif source == "one symbol":  # frequency 2^12: its states never change, never shed a word
        syms = np.full(count, 7, np.uint8)
    else:
        syms = rng.choice(np.array([0, 15], np.uint8), count, p=[0.999, 0.001])
    freq = _freq(syms)
    want = _spec_section(syms, freq)
    for native in (True, False):
        assert _encode(syms, freq, native).tobytes() == want, native
    section = np.frombuffer(want, np.uint8)
    for dtype in (np.uint8, np.uint16, np.uint32):
        values = (np.arange(NSYM) * 37 + 11).astype(dtype)
        for native in (True, False):
            status, got = _decode(section, freq, values, count, native)
            assert status == 0 and np.array_equal(got, values[syms]), (dtype, native)


def test_a_long_section_is_the_same_from_both_kinds():
    rng = np.random.default_rng(5)
    syms = rng.choice(NSYM, 3 * lanes.WIDE_MIN + 17, p=SKEWED).astype(np.uint8)
    freq = _freq(syms)
    native, portable = _encode(syms, freq, True), _encode(syms, freq, False)
    assert np.array_equal(native, portable)
    values = np.arange(NSYM, dtype=np.uint16)
    for kind in (True, False):
        status, got = _decode(native, freq, values, syms.size, kind)
        assert status == 0 and np.array_equal(got, syms)


def test_damaged_sections_are_refused_alike_by_both_kinds():
    """A section cut short, lengthened, with a state under 2^16, or with any byte changed decodes to
    exactly the symbols it codes or is refused (13), the same by both kinds."""
    rng = np.random.default_rng(9)
    count = 2000
    syms = rng.choice(NSYM, count, p=SKEWED).astype(np.uint8)
    freq = _freq(syms)
    good = _encode(syms, freq, False)
    values = np.arange(NSYM, dtype=np.uint16)
    cases = [good[:-2], good[:-1], np.concatenate([good, np.zeros(2, np.uint8)]), good[: 4 * W - 4]]
    low = good.copy()
    low[4 * 5 + 2 : 4 * 5 + 4] = 0  # state 5 below 2^16
    cases.append(low)
    for _ in range(300):
        bad = good.copy()
        at = rng.integers(0, bad.size, rng.integers(1, 4))
        bad[at] ^= rng.integers(1, 256, at.size).astype(np.uint8)
        cases.append(bad)
    refused = 0
    for bad in cases:
        got = [_decode(bad, freq, values, count, kind) for kind in (True, False)]
        assert got[0][0] == got[1][0] and got[0][0] in (0, 13)
        if got[0][0] == 0:
            assert np.array_equal(got[0][1], got[1][1])
        refused += got[0][0] == 13
    assert refused >= len(cases) - 10  # a changed byte almost never leaves the states' ends intact
    for kind in (True, False):  # the wrong count of symbols
        assert _decode(good, freq, values, count - 1, kind)[0] == 13
        assert _decode(good, freq, values, count + 1, kind)[0] == 13


def _block(n: int, seed: int = 0, dtype=np.uint16):
    """A block of ``n`` BF16-like elements of which most change by a unit or two (one value group
    of more than :data:`lanes.WIDE_MIN` changes)."""
    rng = np.random.default_rng(seed)
    old = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(dtype)
    new = old.copy()
    moved = rng.random(n) < 0.6
    new[moved] += rng.choice(
        np.array([1, -1, 2, -2, 40], np.int64), moved.sum(), p=[0.45, 0.45, 0.04, 0.04, 0.02]
    ).astype(dtype)
    return old, new


def test_blocks_with_a_large_value_group_use_a_wide_section_and_decode_both_ways_with_both_kinds():
    old, new = _block(1 << 17)
    blocks = [ans.encode_block("BF16", old, new, native=kind)[0] for kind in simd.KINDS]
    assert all(b == blocks[0] for b in blocks)
    data = blocks[0]
    p = ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test")
    assert data[4] & ans.WIDE and np.diff(p.dstart).max() >= lanes.WIDE_MIN
    for kind in simd.KINDS:
        out, back = np.empty_like(old), np.empty_like(old)
        ans.decode_block("BF16", memoryview(data), old, out, "test", native=kind)
        ans.decode_block_backward("BF16", memoryview(data), new, back, "test", native=kind)
        assert np.array_equal(out, new) and np.array_equal(back, old)
    for vector in (True, False):  # the parse's vector steps need no BMI2
        q = ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test", native=vector)
        assert np.array_equal(q.diffs[: p.dstart[-1]], p.diffs[: p.dstart[-1]])
    assert np.array_equal(ans.decode_reference("BF16", data, old), new)


def test_small_groups_keep_four_states():
    old, new = _block(20000)
    data = ans.encode_block("BF16", old, new)[0]
    assert not data[4] & ans.WIDE


def _golden_block(name: str) -> tuple[np.ndarray, bytearray, dict]:
    import zstandard

    spec = json.loads((GOLDEN / "ans-wide" / "expected.json").read_text())
    base = zstandard.ZstdDecompressor().decompress((GOLDEN / spec["base"]).read_bytes())
    payload = (GOLDEN / "ans-wide" / name).read_bytes()
    length = int(np.frombuffer(payload, "<u8", 1, 28)[0])
    return np.frombuffer(base, np.uint16), bytearray(payload[36 : 36 + length]), spec


@pytest.mark.parametrize("kind", [True, False])
def test_the_wide_golden_block_decodes_with_each_kind(kind):
    old, block, spec = _golden_block("payload2.bin")
    assert block[4] & ans.WIDE
    out = np.empty_like(old)
    ans.decode_block("BF16", memoryview(bytes(block)), old, out, "golden", native=kind and simd.HAS_BMI2)
    assert hashlib.sha256(out.tobytes()).hexdigest() == spec["sha256_new"]
    p = ans.Parsed("BF16", memoryview(bytes(block)), old.size, old.dtype, "golden", native=kind)
    assert np.array_equal(ans.decode_reference("BF16", bytes(block), old), out) and p.G >= 1


def test_a_block_that_says_wide_over_four_state_sections_is_refused():
    """The earlier encoder's block of the same step (4 states for a group of 65536 changes) with the
    wide flag set: its section is read as 32 states and refused, never decoded to other bytes;
    without the flag it decodes (old payloads keep decoding)."""
    old, block, spec = _golden_block("payload.bin")
    assert not block[4] & ans.WIDE
    out = np.empty_like(old)
    ans.decode_block("BF16", memoryview(bytes(block)), old, out, "golden")
    assert hashlib.sha256(out.tobytes()).hexdigest() == spec["sha256_new"]
    block[4] |= ans.WIDE
    for kind in simd.KINDS:
        with pytest.raises(FormatError, match="check 13"):
            ans.decode_block("BF16", memoryview(bytes(block)), old, np.empty_like(old), "golden", native=kind)


def test_the_vector_steps_refuse_strided_arrays():
    """The steps address elements from an array's data pointer: a reversed or strided view (a legal
    argument to the njit functions) is refused when they are typed, never read or written as if it
    were contiguous (a reversed ``out`` was written past its buffer)."""
    from numba.core.errors import TypingError

    syms = np.random.default_rng(0).integers(0, NSYM, 4096).astype(np.uint8)
    freq = _freq(syms)
    section = _encode(syms, freq, True)
    values = np.arange(NSYM, dtype=np.uint16)
    big = np.zeros(3 * 4096, np.uint16)
    with pytest.raises(TypingError, match="C-contiguous"):
        lanes.rans_decode_wide(section, 0, section.size, freq, values, big[4096:8192][::-1], 0, 4096, True)
    assert not big.any()
    spread = np.zeros(2 * syms.size + 128, np.uint8)
    spread[::2][: syms.size] = syms
    with pytest.raises(TypingError, match="C-contiguous"):
        lanes.rans_encode_wide(spread[::2], syms.size, freq, np.zeros(section.size + 64, np.uint8), True)
