"""XXH3-128 fed by the kernels (:mod:`weightsync.codec.hashing`, ``kernels.feed``): the digests
``xxhash`` gives, whoever feeds the state, and the decoders' use of it."""

from __future__ import annotations

import ctypes

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


def _refuse(*args, **kwargs):
    raise AssertionError("this path should not run")


def test_copy_feeds_from_the_kernel_and_not_from_python(monkeypatch):
    src = RNG.integers(0, 200, 300_001, dtype=np.uint16)
    dst, h = np.zeros_like(src), hashing.Xxh3()
    monkeypatch.setattr(hashing.Xxh3, "update", _refuse)
    streams.copy(src, dst, h)
    assert np.array_equal(dst, src) and h.digest() == xxhash.xxh3_128(src.tobytes()).digest()


@pytest.mark.parametrize("case", ["overlapping", "read-only"])
def test_copy_takes_the_safe_path_where_memcpy_would_not_be(case, monkeypatch):
    """Overlapping buffers (memcpy's result would be undefined) and a read-only output (numpy
    refuses to write it; memcpy would not) never reach the kernel."""
    monkeypatch.setattr(kernels, "copy_feeding", _refuse)
    buf = RNG.integers(0, 256, 10_000, dtype=np.uint8)
    h = hashing.Xxh3()
    if case == "overlapping":
        want = buf[:6000].copy()
        streams.copy(buf[:6000], buf[4000:], h)
        assert np.array_equal(buf[4000:], want) and h.digest() == xxhash.xxh3_128(want.tobytes()).digest()
    else:
        frozen = np.frombuffer(bytes(10_000), np.uint8)
        with pytest.raises(ValueError, match="read-only"):
            streams.copy(buf, frozen, h)
        assert not frozen.any()


def test_feed_and_copy_feeding_refuse_what_they_cannot_read_safely():
    d = np.arange(16, dtype=np.uint8)
    h = hashing.Xxh3()
    assert kernels.feed(hashing.UPDATE, h.state, d, 10, 40) == -1  # past the end
    assert kernels.feed(hashing.UPDATE, h.state, d[::2], 0, 8) == -1  # a step
    assert kernels.copy_feeding(d, np.zeros(8, np.uint8), hashing.UPDATE, h.state, 4) == -1
    assert kernels.copy_feeding(d, np.zeros(16, np.uint16), hashing.UPDATE, h.state, 4) == -1
    assert kernels.copy_feeding(d[::2], np.zeros(8, np.uint8), hashing.UPDATE, h.state, 4) == -1
    assert h.digest() == xxhash.xxh3_128(b"").digest()  # nothing was fed


def test_a_hasher_cannot_be_copied_or_pickled_and_a_subclass_is_fed_from_python():
    import copy
    import pickle

    h = hashing.Xxh3()
    for clone in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be"):
            clone(h)

    class Logged(hashing.Xxh3):
        __slots__ = ("seen",)

        def update(self, data):
            self.seen = True
            super().update(data)

    sub = Logged()
    assert hashing.native_state(sub) == 0
    streams.copy(np.arange(100, dtype=np.uint16), np.zeros(100, np.uint16), sub)
    assert sub.seen


def test_a_failed_update_is_an_error_on_every_fed_path(monkeypatch):
    """An update that reports an error (here a stub at UPDATE's place) is raised, never ignored:
    the ans pass, sparse's patching and the copy."""
    stub = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(lambda s, p, n: 1)
    monkeypatch.setattr(hashing, "UPDATE", ctypes.cast(stub, ctypes.c_void_p).value)
    old, new = _pair(5000)
    block, _ = ans.encode_block("BF16", old, new)
    with pytest.raises(RuntimeError, match="XXH3"):
        ans.decode_block("BF16", memoryview(block), old, np.empty_like(old), "t", hashing.Xxh3())
    sparse = registry.get("sparse")
    sblock, _ = sparse.encode("BF16", old, new, CodecConfig())
    with pytest.raises(RuntimeError, match="XXH3"):
        sparse.decode("BF16", memoryview(sblock), old, np.empty_like(old), "t", hashing.Xxh3())
    with pytest.raises(RuntimeError, match="XXH3"):
        streams.copy(old, np.empty_like(old), hashing.Xxh3())


def _pair(n: int) -> tuple[np.ndarray, np.ndarray]:
    old = (RNG.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32)
    old = (old >> 16).astype(np.uint16)  # bf16 bits
    new = old.copy()
    at = RNG.choice(n, n // 30, replace=False)
    new[at] += RNG.choice(np.array([1, 0xFFFF], np.uint16), at.size)
    return old, new


@pytest.mark.parametrize("n", [5000, ans.HASH_WHOLE + 4099, ans.HASH_WHOLE + 3 * ans.SLICE + 64])
@pytest.mark.parametrize("codec", ["ans", "sparse"])
@pytest.mark.parametrize("in_place", [False, True])
def test_decode_feeds_the_hasher_from_the_kernel(codec, n, in_place, monkeypatch):
    """A block of one slice or many decodes with the kernel feeding the state (Xxh3.update is never
    called: no slice goes back to Python), into a fresh buffer or in place, and the digest is the
    result's."""
    old, new = _pair(n)
    impl = registry.get(codec)
    block, _ = impl.encode("BF16", old, new, CodecConfig())
    monkeypatch.setattr(hashing.Xxh3, "update", _refuse)
    out, h = old.copy() if in_place else np.empty_like(old), hashing.Xxh3()
    impl.decode("BF16", memoryview(block), out if in_place else old, out, "t", h)
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


def test_the_hashed_pass_is_there_for_a_thread_that_finds_its_pass_made(monkeypatch):
    """Another thread takes a pass's presence (read without the lock) as a sign that its hashed
    wrapper is made too: the wrapper is stored first. Made slow here, the wrapper's making leaves
    a window a second thread falls into."""
    import threading
    import time

    keys = [("pass", 3, 3, ans.NATIVE), ("pass_hashed", 3, 3, ans.NATIVE)]
    saved = {k: ans._KERNELS.pop(k) for k in keys if k in ans._KERNELS}
    real = ans.njit

    def slow_njit(**kw):
        def wrap(fn):
            if fn.__name__.endswith("_hashed"):
                time.sleep(0.5)
            return real(**kw)(fn)

        return wrap

    monkeypatch.setattr(ans, "njit", slow_njit)
    got, errors = [], []

    def take():
        try:
            got.append(ans._hashed_pass(3, 3, ans.NATIVE))
        except Exception as exc:  # noqa: BLE001  reported below
            errors.append(exc)

    first = threading.Thread(target=take)
    first.start()
    time.sleep(0.2)  # inside the first thread's slow making of the wrapper
    take()
    first.join()
    try:
        assert errors == [] and len(got) == 2 and got[0] is got[1]
    finally:
        for k in keys:
            ans._KERNELS.pop(k, None)
        ans._KERNELS.update(saved)
