"""XXH3-128 fed by the kernels (:mod:`weightsync.codec.hashing`, ``kernels.feed``): the digests
``xxhash`` gives, whoever feeds the state, and the decoders' use of it."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from weightsync.codec import ans, hashing, kernels, registry, streams
from weightsync.codec.payload import CodecConfig, decode_tensor, encode_tensor, rebuild
from weightsync.errors import FormatError

pytestmark = pytest.mark.skipif(hashing._LIB is None, reason="this xxhash build exports no XXH3 state functions")

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 128, 240, 241, 1023, 4096, 100_003, 1 << 20])
def test_the_digest_is_xxhash_s_however_the_input_is_split(n):
    data = RNG.integers(0, 256, n, dtype=np.uint8)
    ref = xxhash.xxh3_128(data.tobytes())
    whole, pieces, fed = hashing.Xxh3(), hashing.Xxh3(), hashing.Xxh3()
    whole.update(data.tobytes())
    pieces.update(memoryview(data[: n // 3]))  # a memoryview, a numpy array, a bytearray
    pieces.update(data[n // 3 : n // 2])
    pieces.update(bytearray(data[n // 2 :].tobytes()))
    assert kernels.feed(hashing.UPDATE, fed.state, data, 0, n // 5) == 0
    assert kernels.feed(hashing.UPDATE, fed.state, data, n // 5, n // 5) == 0  # nothing
    assert kernels.feed(hashing.UPDATE, fed.state, data, n // 5, n) == 0
    for h in (whole, pieces, fed):
        assert h.digest() == ref.digest() and h.hexdigest() == ref.hexdigest()


def test_feed_takes_elements_not_bytes_and_strided_input_is_made_contiguous():
    data = RNG.integers(0, 1 << 32, 1000, dtype=np.uint32)
    h = hashing.Xxh3()
    assert kernels.feed(hashing.UPDATE, h.state, data, 10, 700) == 0
    assert h.digest() == xxhash.xxh3_128(data[10:700].tobytes()).digest()
    s = hashing.Xxh3()
    s.update(data[::3])
    assert s.digest() == xxhash.xxh3_128(data[::3].tobytes()).digest()


def test_hasher_falls_back_to_xxhash_without_the_library(monkeypatch):
    assert isinstance(hashing.hasher(), hashing.Xxh3) and hashing.native_state(hashing.hasher())
    monkeypatch.setattr(hashing, "_LIB", None)
    h = hashing.hasher()
    assert isinstance(h, type(xxhash.xxh3_128())) and hashing.native_state(h) == 0


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_copy_feeds_the_copied_bytes(dtype):
    src = RNG.integers(0, 200, 300_001, dtype=dtype)
    dst = np.zeros_like(src)
    h = hashing.Xxh3()
    streams.copy(src, dst, h)
    assert np.array_equal(dst, src) and h.digest() == xxhash.xxh3_128(src.tobytes()).digest()


def test_copy_between_overlapping_buffers_takes_the_safe_path():
    buf = RNG.integers(0, 256, 10_000, dtype=np.uint8)
    want = buf[:6000].copy()
    h = hashing.Xxh3()
    streams.copy(buf[:6000], buf[4000:], h)  # overlapping: memcpy's result would be undefined
    assert np.array_equal(buf[4000:], want) and h.digest() == xxhash.xxh3_128(want.tobytes()).digest()


def _pair(n: int) -> tuple[np.ndarray, np.ndarray]:
    old = (RNG.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32)
    old = (old >> 16).astype(np.uint16)  # bf16 bits
    new = old.copy()
    at = RNG.choice(n, n // 30, replace=False)
    new[at] += RNG.choice(np.array([1, 0xFFFF], np.uint16), at.size)
    return old, new


@pytest.mark.parametrize("n", [5000, ans.HASH_WHOLE + 4099, 3 * ans.SLICE + 64])
def test_ans_decode_feeds_the_hasher_from_the_kernel(n, monkeypatch):
    """A block of any size decodes with the kernel feeding the state (Xxh3.update is never called:
    no slice goes back to Python) and the digest is the result's."""
    old, new = _pair(n)
    block, _ = ans.encode_block("BF16", old, new)

    def refuse(self, data):
        raise AssertionError("the kernel should feed the state, not Python")

    monkeypatch.setattr(hashing.Xxh3, "update", refuse)
    out, h = np.empty_like(old), hashing.Xxh3()
    ans.decode_block("BF16", memoryview(block), old, out, "t", h)
    assert np.array_equal(out, new) and h.digest() == xxhash.xxh3_128(new.tobytes()).digest()


def test_ans_decode_with_a_base_that_does_not_fit_is_refused_on_the_fed_path():
    old, new = _pair(ans.HASH_WHOLE + 4099)
    block, _ = ans.encode_block("BF16", old, new)
    other = old.copy()
    other[::5] ^= np.uint16(0x1000)  # other exponents: other buckets than the block was coded with
    with pytest.raises(FormatError, match="bucket sizes do not match"):
        ans.decode_block("BF16", memoryview(block), other, np.empty_like(old), "t", hashing.Xxh3())


def test_rebuild_verifies_with_either_hasher(monkeypatch):
    old, new = _pair(ans.HASH_WHOLE + 4099)
    raw_old, raw_new = old.view(np.uint8), new.view(np.uint8)
    enc = encode_tensor("BF16", raw_new, raw_old)
    digest = xxhash.xxh3_128_hexdigest(raw_new)
    steps = [(enc.codec, lambda: enc.payload)]
    assert np.array_equal(rebuild("BF16", raw_new.size, digest, raw_old.copy(), steps), raw_new)
    monkeypatch.setattr(hashing, "_LIB", None)  # the Python-fed path
    assert np.array_equal(rebuild("BF16", raw_new.size, digest, raw_old.copy(), steps), raw_new)
    assert np.array_equal(decode_tensor("BF16", enc.codec, enc.payload, raw_old, raw_new.size), raw_new)


def test_sparse_into_a_strided_output_hashes_what_it_wrote():
    """The kernel feeds contiguous memory only: a strided output (a view with a step) is hashed
    from Python, as written."""
    old, new = _pair(50_000)
    codec = registry.get("sparse")
    block, _ = codec.encode("BF16", old, new, CodecConfig())
    big = np.zeros(2 * old.size, np.uint16)
    h = hashing.Xxh3()
    codec.decode("BF16", memoryview(block), old, big[::2], "t", h)
    assert np.array_equal(big[::2], new) and h.digest() == xxhash.xxh3_128(new.tobytes()).digest()
