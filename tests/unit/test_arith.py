"""The arithmetic-coded ``ac`` codec: bit-exact on every dtype it takes, below the zeroth-order
entropy bound when the old exponent predicts changes, robust against hostile payloads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import CodecConfig, arith, decode_tensor, encode_tensor
from weightsync.demo import to_bf16_bits
from weightsync.errors import FormatError, UsageError
from weightsync.format.dtypes import ITEMSIZE

FLOATS = {"BF16": np.float32, "F16": np.float16, "F32": np.float32}
AC = CodecConfig(coder="ac")  # no longer the default entropy coder (ans is)


def _realistic(dtype: str, n: int, lr: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Old and new raw bytes where a step of ~lr moves small-magnitude elements more often."""
    rng = np.random.default_rng(seed)
    master = (rng.standard_normal(n) * 0.02).astype(np.float64)
    step = lr * np.sign(rng.standard_normal(n))
    if dtype == "BF16":
        old, new = to_bf16_bits(master.astype(np.float32)), to_bf16_bits((master + step).astype(np.float32))
    else:
        t = FLOATS[dtype]
        old, new = master.astype(t), (master + step).astype(t)
    return old.view(np.uint8).copy(), new.view(np.uint8).copy()


def _entropy_bytes(old: np.ndarray, new: np.ndarray, width: int) -> float:
    d = new.view(f"<u{width}") - old.view(f"<u{width}")
    _, counts = np.unique(d, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() * d.size / 8)


@pytest.mark.parametrize("dtype,lr", [("BF16", 1e-6), ("BF16", 1e-5), ("F16", 1e-6), ("F32", 1e-10)])
@pytest.mark.parametrize("block_bytes", [1 << 16, 32 << 20])
def test_ac_round_trips_below_the_zeroth_order_bound(dtype, lr, block_bytes):
    old, new = _realistic(dtype, 1 << 20, lr)
    enc = encode_tensor(dtype, new, old, CodecConfig(block_bytes=block_bytes, dense_above=1.0, coder="ac"))
    assert enc.codec == "ac"
    assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, old, new.size), new)
    assert len(enc.payload) < 0.9 * _entropy_bytes(old, new, ITEMSIZE[dtype])
    plain = encode_tensor(dtype, new, old, CodecConfig(block_bytes=block_bytes, dense_above=1.0, entropy_coder=False))
    assert plain.codec == "sparse" and plain.changed == enc.changed
    assert len(enc.payload) < len(plain.payload)


@pytest.mark.parametrize("dtype", sorted(d for d in ITEMSIZE if ITEMSIZE[d] <= 4))
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5, 1.0])
def test_ac_is_bit_exact_for_every_narrow_dtype_and_density(dtype, density):
    width = ITEMSIZE[dtype]
    rng = np.random.default_rng(int(density * 1000) + width)
    old = rng.integers(0, 256, 4099 * width, dtype=np.uint8)
    new = old.copy().view(f"<u{width}")
    pos = np.flatnonzero(rng.random(new.size) < density)
    new[pos] = rng.integers(0, 2 ** (8 * width), pos.size, dtype=np.uint64).astype(f"<u{width}")
    new = new.view(np.uint8)
    enc = encode_tensor(dtype, new, old, CodecConfig(block_bytes=1024, dense_above=1.0, coder="ac"))
    assert enc.codec in ("ac", "same")
    assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, old, new.size), new)


def test_wide_dtypes_use_sparse():
    assert not arith.supports("F64") and not arith.supports("I64")
    old = np.zeros(800, dtype=np.uint8)
    new = old.copy()
    new[::80] = 1
    assert encode_tensor("F64", new, old, AC).codec == "sparse"


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(FLOATS)), st.integers(0, 2**32 - 1), st.sampled_from([64, 4096, 1 << 20]))
def test_ac_is_bit_exact_with_special_values(dtype, seed, block_bytes):
    old, new = _realistic(dtype, 1 << 15, {"BF16": 1e-5, "F16": 1e-5, "F32": 1e-8}[dtype], seed % 1000)
    width = ITEMSIZE[dtype]
    specials = {
        2: [0x7FC1, 0xFF80, 0x8000, 0x0001, 0x7F80, 0xFFFF],
        4: [0x7FC00001, 0x80000000, 1, 0x7F800000, 0xFFFFFFFF],
    }
    rng = np.random.default_rng(seed)
    sv = np.array(specials[width], dtype=f"<u{width}")
    o, n = old.view(f"<u{width}"), new.view(f"<u{width}")
    pos = rng.integers(0, o.size, 64)
    o[pos] = rng.choice(sv, pos.size)
    n[pos[::2]] = rng.choice(sv, pos[::2].size)
    enc = encode_tensor(dtype, new, old, CodecConfig(block_bytes=block_bytes, coder="ac"))
    assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, old, new.size), new)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_ac_payloads_raise_only_format_errors(data):
    old, new = _realistic("BF16", 1 << 14, 1e-5, 3)
    enc = encode_tensor("BF16", new, old, AC)
    assert enc.codec == "ac"
    payload = bytearray(enc.payload)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    for p in (bytes(payload), bytes(payload[:cut])):
        try:
            out = decode_tensor("BF16", "ac", p, old, new.size)
        except (FormatError, UsageError):
            continue
        assert out.size == new.size  # a mutation that still decodes is caught by the segment checksum


# Payload hashes written by the first encoder (commit cd5dbbe); faster kernels must write the same bytes.
GOLDEN_ENCODINGS = {
    "BF16": "7c667a0e3d48c8c9",
    "F16": "6eaaa5cab029a929",
    "F32": "4410c9568981fde4",
    "U8": "25d42b1dff8cf15e",
    "I32": "4fdfb8662c22c49e",
}


@pytest.mark.parametrize("dtype", sorted(GOLDEN_ENCODINGS))
def test_the_encoder_writes_the_same_bytes_as_the_first_one(dtype):
    import hashlib

    if dtype in FLOATS:
        old, new = _realistic(dtype, 20000, {"BF16": 1e-6, "F16": 1e-6, "F32": 1e-10}[dtype], seed=3)
    else:  # random bytes: large differences, the Exp-Golomb path
        rng = np.random.default_rng(11)
        width = ITEMSIZE[dtype]
        old = rng.integers(0, 256, 8000 * width, dtype=np.uint8)
        new = old.copy()
        m = rng.random(old.size) < (0.05 if dtype == "U8" else 0.02)
        new[m] = rng.integers(0, 256, int(m.sum()), dtype=np.uint8)
    enc = encode_tensor(dtype, new, old, CodecConfig(block_bytes=16384, coder="ac"))
    assert enc.codec == "ac"
    assert hashlib.sha256(bytes(enc.payload)).hexdigest()[:16] == GOLDEN_ENCODINGS[dtype]
    assert np.array_equal(decode_tensor(dtype, "ac", enc.payload, old, new.size), new)


@pytest.mark.parametrize("dtype", ["U8", "I16", "BF16", "I32"])
def test_an_exp_golomb_prefix_longer_than_the_element_is_refused(dtype):
    """A stream of 0xFF bytes decodes as ever longer prefixes: refused once a difference could no
    longer fit the element, not wrapped around in 64-bit arithmetic."""
    width = ITEMSIZE[dtype]
    old = np.zeros(4 * width, dtype=np.uint8)
    shift, bits = arith.EXPONENT_FIELD.get(dtype, (0, 0))
    block = arith._HEAD.pack(4, shift, bits, 0) + b"\xff" * 2000
    with pytest.raises(FormatError, match="wider than the element"):
        arith.decode_block(dtype, memoryview(block), old.view(f"<u{width}"), np.empty(4, f"<u{width}"), "x")
