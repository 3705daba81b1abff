"""The context-modelled ``ctx`` codec: bit-exact, chosen when the old exponent predicts changes,
declined when it does not, and robust against hostile payloads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import CodecConfig, decode_tensor, encode_tensor
from weightsync.errors import FormatError, UsageError
from weightsync.synth import to_bf16_bits

FLOATS = {"BF16": np.float32, "F16": np.float16, "F32": np.float32, "F64": np.float64}


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


@pytest.mark.parametrize("dtype,lr", [("BF16", 1e-6), ("BF16", 1e-5), ("F16", 1e-6), ("F32", 1e-10), ("F64", 1e-19)])
@pytest.mark.parametrize("block_bytes", [1 << 20, 32 << 20])
def test_ctx_round_trips_and_beats_sparse_on_magnitude_dependent_changes(dtype, lr, block_bytes):
    old, new = _realistic(dtype, 1 << 20, lr)
    cfg = CodecConfig(block_bytes=block_bytes, ctx_min_elems=1 << 10)
    enc = encode_tensor(dtype, new, old, cfg)
    assert enc.codec == "ctx"
    assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, old, new.size), new)
    plain = encode_tensor(dtype, new, old, CodecConfig(block_bytes=block_bytes, ctx_min_elems=1 << 62, dense_above=1.0))
    assert plain.codec == "sparse" and plain.changed == enc.changed
    assert len(enc.payload) < 0.9 * len(plain.payload), (len(enc.payload), len(plain.payload))


def test_ctx_declines_when_changes_do_not_depend_on_the_exponent():
    rng = np.random.default_rng(1)
    old = to_bf16_bits((rng.standard_normal(1 << 20) * 0.02).astype(np.float32))
    new = old.copy()
    idx = np.flatnonzero(rng.random(old.size) < 0.03)
    new[idx] += np.uint16(1)
    enc = encode_tensor("BF16", new.view(np.uint8), old.view(np.uint8), CodecConfig(ctx_min_elems=1 << 10))
    assert enc.codec == "sparse"


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(FLOATS)), st.integers(0, 2**32 - 1), st.sampled_from([64, 4096, 1 << 20]))
def test_ctx_is_bit_exact_with_special_values(dtype, seed, block_bytes):
    old, new = _realistic(dtype, 1 << 17, {"BF16": 1e-5, "F16": 1e-5, "F32": 1e-8, "F64": 1e-16}[dtype], seed % 1000)
    width = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}[dtype]
    rng = np.random.default_rng(seed)
    specials = {2: [0x7FC1, 0xFF80, 0x8000, 0x0001, 0x7F80], 4: [0x7FC00001, 0x80000000, 1, 0x7F800000], 8: [0x7FF8000000000001, 1 << 63, 1]}
    sv = np.array(specials.get(width if dtype != "F16" else 2), dtype=f"<u{width}")
    o, n = old.view(f"<u{width}"), new.view(f"<u{width}")
    pos = rng.integers(0, o.size, 64)
    o[pos] = rng.choice(sv, pos.size)
    n[pos[::2]] = rng.choice(sv, pos[::2].size)
    enc = encode_tensor(dtype, new, old, CodecConfig(block_bytes=block_bytes, ctx_min_elems=1))
    assert np.array_equal(decode_tensor(dtype, enc.codec, enc.payload, old, new.size), new)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_ctx_payloads_raise_only_format_errors(data):
    old, new = _realistic("BF16", 1 << 16, 1e-5, 3)
    enc = encode_tensor("BF16", new, old, CodecConfig(ctx_min_elems=1))
    assert enc.codec == "ctx"
    payload = bytearray(enc.payload)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    for p in (bytes(payload), bytes(payload[:cut])):
        try:
            out = decode_tensor("BF16", "ctx", p, old, new.size)
        except (FormatError, UsageError):
            continue
        assert out.size == new.size  # a mutation that still decodes is caught by the segment checksum
