"""Codec ``ans`` (:mod:`weightsync.codec.ans`): round trips through every pass (bucket and group
counts, portable ``pdep``/``pext``, in place, hashed in slices), the numpy reference decoder, the
backward decoder, and hostile input: bases the block was not made from, truncated and corrupted
blocks, which must raise FormatError or decode to other bytes (which the segment's checksum
rejects), never read or write outside their arrays."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import CodecConfig, ans, decode_tensor, encode_tensor, entropy, registry, simd
from weightsync.codec.payload import delta_codec
from weightsync.errors import FormatError, UsageError

VIEW = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32, "U8": np.uint8, "I16": np.uint16, "F8_E4M3": np.uint8}
SPECIAL = np.array([np.nan, np.inf, -0.0, 1e-40, -np.inf, 0.0, 3e38, -1e-45], np.float32)


def base_of(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Weights near 0.02 for the float dtypes (with NaN, infinities, -0.0 and subnormals), random
    bits for the others."""
    t = VIEW[dtype]
    if dtype in ("BF16", "F32", "F16"):
        f = rng.normal(0, 0.02, n).astype(np.float32)
        f[: min(n, 8)] = SPECIAL[: min(n, 8)]
        if dtype == "F16":
            with np.errstate(over="ignore"):  # 3e38 becomes inf
                return f.astype(np.float16).view(np.uint16)
        return f.view(np.uint32) if dtype == "F32" else (f.view(np.uint32) >> 16).astype(np.uint16)
    return rng.integers(0, np.iinfo(t).max, n, dtype=t, endpoint=True)


def changed(old: np.ndarray, frac: float, rng: np.random.Generator) -> np.ndarray:
    """``old`` with about ``frac`` of its elements moved, mostly by one unit, sometimes far."""
    new = old.copy()
    idx = rng.random(old.size) < frac
    delta = rng.choice([1, -1, 1, -1, 2, -3, 17, 1000, -40000], idx.sum()).astype(np.int64)
    new[idx] = (old[idx].astype(np.int64) + delta).astype(old.dtype)
    return new


def check_round_trip(dtype: str, old: np.ndarray, new: np.ndarray, data: bytes, reverse: bytes = b"") -> None:
    """Every decoder of ``ans`` turns ``data`` back into ``new`` (and the backward one, given the
    block's ``reverse`` part where its list is apart, into ``old``)."""
    for native in simd.KINDS:
        out = np.empty_like(old)
        ans.decode_block(dtype, memoryview(data), old, out, "test", native=native)
        assert np.array_equal(out, new), (dtype, old.size, native)
    inplace = old.copy()
    ans.decode_block(dtype, memoryview(data), inplace, inplace, "test")
    assert np.array_equal(inplace, new)
    assert np.array_equal(ans.decode_reference(dtype, data, old), new)
    assert np.array_equal(ans.decode_backward(dtype, data, new, reverse=reverse), old)
    for native in simd.KINDS:
        back = np.empty_like(new)
        hasher = xxhash.xxh3_128()
        ans.decode_block_backward(dtype, memoryview(data), new, back, "test", hasher, native=native, reverse=reverse)
        assert np.array_equal(back, old), (dtype, old.size, native)
        assert hasher.hexdigest() == xxhash.xxh3_128(old.tobytes()).hexdigest()
    inplace = new.copy()
    ans.decode_block_backward(dtype, memoryview(data), inplace, inplace, "test", reverse=reverse)
    assert np.array_equal(inplace, old)


@pytest.mark.parametrize("dtype", sorted(VIEW))
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 70_000])
@pytest.mark.parametrize("frac", [0.001, 0.03, 0.2, 0.6, 1.0])
@pytest.mark.parametrize("apart", [False, True])
def test_round_trips_through_every_decoder(dtype, n, frac, apart):
    """Both layouts: the exception list in the block, and apart (the block's reverse part, what
    payloads hold: test_ans_apart.py)."""
    rng = np.random.default_rng(n + int(frac * 1000))
    old = base_of(dtype, n, rng)
    new = changed(old, frac, rng)
    encode = ans.encode_block_apart if apart else ans.encode_block
    got = encode(dtype, old, new)
    data, rev, k = got if apart else (got[0], b"", got[1])
    assert k == np.count_nonzero(old != new)
    for native in simd.KINDS:  # the native scan and the portable one write the same bytes, with the
        for dense in (False, True):  # branch on a word's changes and without
            assert got == encode(dtype, old, new, native=native, dense=dense), (native, dense)
    assert (len(data) == 0) == (k == 0) and (not rev or k)
    if k:  # apart: no list and no count of it in the block, never the in-block list's flags
        assert bool(data[4] & ans.APART) == apart and not (apart and data[4] & ans.EXC_CODED)
    check_round_trip(dtype, old, new, data, rev)


def test_the_bmi2_kind_scans_a_sparse_block_as_the_portable_kind(monkeypatch):
    """The ``BMI2`` kind (``pdep``/``pext`` without VBMI2's vector steps) scans into bitmaps from one
    change in :data:`~weightsync.codec.ans.SCAN_BITMAPS` elements by the sample's estimate, and lists
    ranks as the portable kind below it (faster there); the other kinds scan as they are, and so does
    a block without an estimate (a forced split, a dtype without an exponent field). Each way writes
    the same bytes."""
    assert ans._scan_kind(simd.BMI2, 99, 99 * ans.SCAN_BITMAPS + 1) == simd.PORTABLE
    assert ans._scan_kind(simd.BMI2, 100, 100 * ans.SCAN_BITMAPS) == simd.BMI2
    assert ans._scan_kind(simd.BMI2, -1, 10**6) == simd.BMI2
    for kind in (simd.VECTOR, simd.PORTABLE, True, False):
        assert ans._scan_kind(kind, 1, 10**6) == kind
    if simd.BMI2 not in simd.KINDS:
        return
    scans = []
    kernel = ans._kernel

    def spy(kind, K, G, native=simd.NATIVE):
        if kind == "scan":
            scans.append(native)
        return kernel(kind, K, G, native)

    monkeypatch.setattr(ans, "_kernel", spy)
    rng = np.random.default_rng(7)
    old = base_of("BF16", 200_000, rng)
    for frac, scan in ((0.002, simd.PORTABLE), (0.3, simd.BMI2)):  # below and above one change in 16
        new = changed(old, frac, rng)
        blocks = {}
        for k in simd.KINDS:
            scans.clear()
            blocks[k] = ans.encode_block("BF16", old, new, native=k)[0]
            assert scans == [scan if k == simd.BMI2 else k], (frac, k, scans)
        assert len(set(blocks.values())) == 1, frac
        check_round_trip("BF16", old, new, blocks[simd.BMI2])
    scans.clear()
    ans.encode_block(
        "U8", old.astype(np.uint8), old.astype(np.uint8) ^ (np.arange(old.size) % 1000 == 0), native=simd.BMI2
    )
    assert scans == [simd.BMI2]  # no sample: bitmaps


@pytest.mark.parametrize("kind", [3, -1, 1.0, "native", None])
def test_an_unknown_kind_of_kernel_is_refused(kind):
    old = np.arange(4096, dtype=np.uint16)
    new = old + np.uint16(1)
    data, _ = ans.encode_block("BF16", old, new)
    with pytest.raises(ValueError, match="no kernels of kind"):
        ans.encode_block("BF16", old, new, native=kind)
    for block in (data, b""):  # a block with no change too, where no kernel runs
        with pytest.raises(ValueError, match="no kernels of kind"):
            ans.decode_block("BF16", memoryview(block), old, np.empty_like(old), "test", native=kind)
        with pytest.raises(ValueError, match="no kernels of kind"):
            ans.decode_block_backward("BF16", memoryview(block), new, np.empty_like(new), "test", native=kind)


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
@pytest.mark.parametrize("buckets", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_every_pass_round_trips(dtype, buckets, groups):
    """Blocks with every bucket and group count the format allows (the encoder itself uses only
    some of them), thresholds repeated (empty buckets) included. At 5% changed most words have up
    to 4 changes (the portable scan's one loop) and the others more (its loops per bucket and
    group); in BF16 changes by 17 units and more cross thresholds (the exception list)."""
    rng = np.random.default_rng(buckets * 10 + groups)
    old = base_of(dtype, 20_000, rng)
    new = changed(old, 0.05, rng)
    thresholds = [118, 120, 120]  # exponents of weights near 0.02 lie around 120
    split = (thresholds[: buckets - 1], [119, 121, 121][: groups - 1])
    data, _ = ans.encode_block(dtype, old, new, split=split)
    assert (data[4] & 7, data[7]) == (buckets, groups)
    if dtype == "BF16":  # exceptions; the native scan and the portable one write the same bytes
        assert data[4] & ans.EXC_CODED or buckets == groups == 1
        for native in simd.KINDS:
            for dense in (False, True):
                assert data == ans.encode_block(dtype, old, new, split=split, native=native, dense=dense)[0]
    check_round_trip(dtype, old, new, data)


@pytest.mark.parametrize("split", [([120, 118], []), ([], [121, 119, 130]), ([0], []), ([], [256]), ([], [300, 301])])
def test_a_forced_split_the_parser_would_refuse_is_refused(split):
    """Thresholds out of order, or out of 1..255 for BF16: the kernels' compares assume neither (a
    limit past the sign bit made the portable scan and the native one disagree)."""
    rng = np.random.default_rng(5)
    old = base_of("BF16", 1000, rng)
    with pytest.raises(ValueError, match="not ascending in 1..255"):
        ans.encode_block("BF16", old, changed(old, 0.05, rng), split=split)


@pytest.mark.parametrize("dtype", ["F64", "I64"])
def test_8_byte_elements_are_refused_not_coded_into_a_block_no_decoder_takes(dtype):
    """``supports()`` keeps 8-byte dtypes away from ``ans``; a direct caller of ``encode_block`` is
    refused too (such a block failed the parser's check 14 on every escape)."""
    rng = np.random.default_rng(6)
    old = rng.integers(0, 1 << 62, 5000, dtype=np.uint64)
    new = old.copy()
    new[::7] += np.uint64(1 << 40)
    assert not ans.Ans().supports(dtype)
    with pytest.raises(ValueError, match="elements of 1, 2 or 4 bytes, not 8"):
        ans.encode_block(dtype, old, new)


def test_clustered_changes_and_gaps_beyond_the_rice_escape():
    rng = np.random.default_rng(1)
    old = base_of("BF16", 300_000, rng)
    new = old.copy()
    new[:30_000] += np.uint16(1)  # a run of changes, then a gap of 270k elements
    new[-3:] -= np.uint16(1)
    data, k = ans.encode_block("BF16", old, new)
    assert k == 30_003
    check_round_trip("BF16", old, new, data)


@pytest.mark.parametrize("n", [70_000, 3 << 20])
def test_the_hash_sees_exactly_the_result(n):
    """Large blocks are decoded and hashed slice by slice, small ones whole: the same bytes either way."""
    rng = np.random.default_rng(2)
    old = base_of("BF16", n, rng)
    new = changed(old, 0.03, rng)
    data, _ = ans.encode_block("BF16", old, new)
    hasher = xxhash.xxh3_128()
    out = np.empty_like(old)
    ans.decode_block("BF16", memoryview(data), old, out, "test", hasher)
    assert hasher.hexdigest() == xxhash.xxh3_128(new.tobytes()).hexdigest()


@pytest.mark.parametrize("inv", [False, True])
def test_words_over_their_buckets_count_list_all_their_ranks(inv):
    """The gaps write as many ranks for every word as the bucket's density calls for (4 for a
    sparse bucket, 24 at 24% of a word), and a loop for the rest of a word that has more: a sparse
    bucket with a whole word set, one with 20 and one with 5, at 1% elsewhere (inverted: clear)."""
    assert ans._ranks_per_word(0, 5000) == 4 and ans._ranks_per_word(1200, 5000) == 24
    assert ans._ranks_per_word(2500, 5000) == 44
    rng = np.random.default_rng(5)
    n_b = 5003
    bits = rng.random(n_b) < 0.01
    bits[3 * 64 : 4 * 64] = True
    bits[5 * 64 : 5 * 64 + 40 : 2] = True
    bits[7 * 64 + 59 : 7 * 64 + 64] = True
    coded = bits.copy()
    if inv:
        bits = ~bits
    words = np.packbits(np.pad(bits, (0, -n_b % 64)), bitorder="little").view(np.uint64)
    words = np.concatenate([words, np.zeros(2, np.uint64)])
    c = int(bits.sum())
    assert (2 * c > n_b) == inv
    gaps, k = ans._gaps_of(words, n_b, c, inv)
    assert np.array_equal(gaps, np.diff(np.flatnonzero(coded), prepend=-1) - 1)
    assert k == entropy.rice_parameter(gaps)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.07, 0.3, 0.5, 0.93, 1.0])
@pytest.mark.parametrize("n_b", [1, 5, 63, 64, 65, 128, 5003])
def test_a_bucket_bitmap_becomes_gaps_and_a_rice_section_that_decodes_to_it(density, n_b):
    """The encoder's bitmap (the native scan) or list of changed ranks (the portable one) -> gaps ->
    Rice section, back through the decoder's Rice reader: words with 0-64 set bits, the inverted
    coding of dense buckets, every lane remainder, and stale bits past the bucket's last rank
    (scratch from an earlier block) ignored."""
    rng = np.random.default_rng(int(density * 100) + n_b)
    bits = rng.random(n_b) < density
    bits[: min(n_b, 64)] = density >= 0.5  # a whole word set (or clear)
    words = np.full(n_b // 64 + 2, ~np.uint64(0))  # stale ones past n_b
    words[: -(-n_b // 64)] = np.packbits(np.pad(bits, (0, -n_b % 64)), bitorder="little").view(np.uint64)
    words[n_b // 64] |= ~np.uint64(0) << np.uint64(n_b % 64) if n_b % 64 else np.uint64(0)
    c = int(bits.sum())
    inv = 2 * c > n_b
    gaps, k = ans._gaps_of(words, n_b, c, inv)
    ranks = np.flatnonzero(~bits if inv else bits)
    assert np.array_equal(gaps, np.diff(ranks, prepend=-1) - 1)
    assert k == entropy.rice_parameter(gaps)  # its costs summed as the gaps are made
    listed = np.concatenate([np.full(7, 99, np.uint32), np.flatnonzero(bits).astype(np.uint32)])  # at an offset
    assert np.array_equal(ans._rank_gaps(listed, 7, c, n_b, inv), gaps)
    k = entropy.rice_parameter(gaps)
    section = np.zeros(8 * gaps.size + 64, np.uint8)
    length = entropy.rice_section(gaps, k, section)
    got = np.zeros(n_b // 64 + 2, np.uint64)
    assert entropy.rice_decode(section, 0, length, gaps.size, k, n_b, inv, got, 0) == 0
    want = np.packbits(np.pad(bits, (0, -n_b % 64)), bitorder="little").view(np.uint64)
    assert np.array_equal(got[: want.size], want)


def _rice_reference(gaps: np.ndarray, k: int) -> bytes:
    """A Rice section as docs/FORMAT.md writes it, one bit at a time: gap j in lane j % 4, each q =
    g >> k ones, a zero and k low bits (q >= 32: 32 ones and g in 32 bits), LSB first; the lanes'
    byte lengths (the first three as varints), then the lanes."""
    lanes = [[] for _ in range(entropy.LANES)]
    for j, g in enumerate(int(g) for g in gaps):
        q = g >> k
        bits = (
            [1] * q + [0] + [(g >> i) & 1 for i in range(k)] if q < 32 else [1] * 32 + [(g >> i) & 1 for i in range(32)]
        )
        lanes[j % entropy.LANES] += bits
    data = [np.packbits(np.array(b + [0] * (-len(b) % 8), np.uint8), bitorder="little").tobytes() for b in lanes]
    head = bytearray()
    for d in data[:-1]:
        v = len(d)
        while v >= 0x80:
            head.append(v & 0x7F | 0x80)
            v >>= 7
        head.append(v)
    return bytes(head) + b"".join(data)


@pytest.mark.parametrize("k", range(32))
def test_rice_sections_are_the_formats_bits_at_every_parameter(k):
    """The Rice writer joins each lane's next two codes into one store where both fit in 56 bits
    (parameters up to 27): the same bytes as a bit-at-a-time writer for every parameter, for every
    count of codes past the last whole group of 8 and 4, with pairs that fit, pairs just past 56 bits,
    escapes (q >= 32) and quotients near 32."""
    rng = np.random.default_rng(k)
    typical = rng.geometric(1 / (1 + 2.0**k), 300).astype(np.uint64) - np.uint64(1)
    room = max(54 - 2 * k, 0)  # what two quotients may sum to in one store
    q = np.array([0, 31, 32, 33, room, room + 1, room // 2, room // 2 + 1, 5], np.uint64)
    edges = (q << np.uint64(k)) | (rng.integers(0, 1 << 31, q.size, np.uint64) & np.uint64((1 << k) - 1))
    far = rng.integers(0, 1 << 31, 40, np.uint64)
    gaps = np.minimum(np.concatenate([typical, np.repeat(edges, 3), typical[:50], far, typical[:17]]), (1 << 31) - 1)
    rng.shuffle(gaps[300:])
    for n in [*range(18), 64, 301, gaps.size]:
        g = np.ascontiguousarray(gaps[:n])
        out = np.zeros(8 * n + 64, np.uint8)
        length = entropy.rice_section(g, k, out)
        assert out[:length].tobytes() == _rice_reference(g, k), n


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8, 13, 17])
@pytest.mark.parametrize("inv", [False, True])
def test_rice_sections_decode_to_their_bitmap_with_codes_at_every_place_in_a_64_bit_read(k, inv):
    """The Rice reader takes a lane's second code from the first's 64 bits where it lies whole in
    them and does not escape: quotients from 0 to 40 (escapes past 31), so that pairs end at, just
    before and just past the read's 64 bits, decode to the bitmap they came from; every remainder
    past the last whole group of 8."""
    rng = np.random.default_rng(100 + k)
    ran = 0
    for count in [*range(1, 18), 200, 1000]:
        q = np.where(rng.random(count) < 0.7, rng.integers(0, 4, count), rng.integers(0, 41, count)).astype(np.uint64)
        gaps = (q << np.uint64(k)) | (rng.integers(0, 1 << 31, count, np.uint64) & np.uint64((1 << k) - 1))
        ranks = np.cumsum(gaps.astype(np.int64) + 1) - 1
        n_b = int(ranks[-1]) + 1 + int(rng.integers(0, 70))
        if n_b > 1 << 26:  # the larger parameters: the bitmap kept small
            continue
        ran += 1
        section = np.zeros(8 * count + 64, np.uint8)
        length = entropy.rice_section(gaps, k, section)
        words = np.zeros(n_b // 64 + 2, np.uint64)  # as the parse clears them
        assert entropy.rice_decode(section, 0, length, count, k, n_b, inv, words, 0) == 0
        bits = np.zeros(n_b, bool)
        bits[ranks] = True
        want = np.packbits(np.pad(bits ^ inv, (0, -n_b % 64)), bitorder="little").view(np.uint64)
        assert np.array_equal(words[: want.size], want), count
        assert entropy.rice_decode(section, 0, length - 1, count, k, n_b, inv, words, 0) != 0 or length == 1
    assert ran >= 10
    assert entropy.rice_decode(section, 0, length, count, 31, n_b, inv, words, 0) == 12  # past the format's 30


def test_blocks_encoded_after_larger_ones_and_in_threads_are_byte_identical():
    """The encoder's per-thread scratch: a block coded after a larger, denser one, and blocks coded
    by 4 threads at once, give the bytes they give alone."""
    rng = np.random.default_rng(4)
    pairs = []
    for n, frac in [(70_000, 0.03), (300_000, 0.6), (1000, 0.2), (70_000, 0.001), (200_000, 1.0)]:
        old = base_of("BF16", n, rng)
        pairs.append((old, changed(old, frac, rng)))
    alone = [ans.encode_block("BF16", o, w) for o, w in pairs]
    again = [ans.encode_block("BF16", o, w) for o, w in reversed(pairs)][::-1]
    assert again == alone
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda ow: ans.encode_block("BF16", *ow), pairs * 4)) == alone * 4
    for (old, new), (data, _) in zip(pairs, alone):
        check_round_trip("BF16", old, new, data)


def _outcome(dtype: str, data: bytes, base: np.ndarray):
    """The fast decoder's result of ``data`` against ``base``, or None where it refuses it."""
    out = np.empty_like(base)
    try:
        ans.decode_block(dtype, memoryview(data), base, out, "test", xxhash.xxh3_128())
    except FormatError:
        return None
    return out


def test_blocks_decoded_through_kept_dirty_or_passing_arrays_and_in_threads_give_the_same_bytes(monkeypatch):
    """The decoder's per-thread arrays (``_DecodeScratch``): a block decoded after larger ones of
    other dtypes, after those arrays were filled with random bytes, through arrays made for the block
    alone (larger than ``RETAIN``), and in 4 threads at once, gives what the reference gives; a
    corrupted block is refused, or decodes to the same bytes, whichever arrays it went through."""
    rng = np.random.default_rng(5)
    cases = []
    for dtype, n, frac in [("BF16", 300_000, 0.6), ("F32", 70_000, 0.2), ("U8", 5000, 1.0), ("BF16", 1000, 0.03)]:
        old = base_of(dtype, n, rng)
        new = changed(old, frac, rng)
        cases.append((dtype, old, new, ans.encode_block(dtype, old, new)[0]))

    def decode_all(order):
        return [_outcome(cases[i][0], cases[i][3], cases[i][1]) for i in order]

    want = [ans.decode_reference(dtype, data, old) for dtype, old, _, data in cases]
    for i, (dtype, old, new, data) in enumerate(cases):
        assert np.array_equal(want[i], new)
    order = list(range(len(cases)))
    for got in (decode_all(order), decode_all(order[::-1])[::-1]):
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    for a in ans._DSCRATCH.kept.values():
        a.view(np.uint8)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
    assert all(np.array_equal(g, w) for g, w in zip(decode_all(order), want))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: _outcome(cases[i][0], cases[i][3], cases[i][1]), order * 4))
    assert all(np.array_equal(g, w) for g, w in zip(got, want * 4))

    corrupt = []
    for _ in range(300):
        dtype, old, _, data = cases[rng.integers(len(cases))]
        bad = bytearray(data)
        for i in rng.integers(0, len(bad), rng.integers(1, 4)):
            bad[i] ^= 1 << rng.integers(8)
        corrupt.append((dtype, bytes(bad), old))
    kept = [_outcome(*c) for c in corrupt]  # through this thread's (dirty) arrays
    monkeypatch.setattr(ans._DecodeScratch, "RETAIN", 0)
    monkeypatch.setattr(ans, "_DSCRATCH", ans._DecodeScratch())
    passing = [_outcome(*c) for c in corrupt]  # through arrays made for each block
    assert all((k is None and f is None) or np.array_equal(k, f) for k, f in zip(kept, passing))
    assert not ans._DSCRATCH.kept  # none kept: every array was made for its block
    assert sum(k is None for k in kept) > 100  # most corruptions are refused
    assert all(np.array_equal(g, w) for g, w in zip(decode_all(order), want))


def test_an_output_of_another_size_or_dtype_is_refused_before_anything_is_written():
    rng = np.random.default_rng(6)
    old = base_of("BF16", 100_000, rng)
    new = changed(old, 0.03, rng)
    data = memoryview(ans.encode_block("BF16", old, new)[0])
    buf = np.zeros(old.size, old.dtype)
    for out in (buf[: old.size // 2], np.zeros(old.size + 1, old.dtype), np.zeros(old.size, np.int16)):
        with pytest.raises(ValueError, match="not uint16"):
            ans.decode_block("BF16", data, old, out, "test")
        with pytest.raises(ValueError, match="not uint16"):
            ans.decode_block_backward("BF16", data, new, out, "test")
    assert not buf.any()


def test_a_new_array_of_another_size_or_dtype_is_refused_by_the_encoder():
    """The kernels read ``new`` up to ``old``'s end: a shorter one would be read past its end."""
    rng = np.random.default_rng(8)
    old = base_of("BF16", 1000, rng)
    for new in (old[:999].copy(), np.concatenate([old, old[:1]]), old.astype(np.uint32)):
        with pytest.raises(ValueError, match="differ"):
            ans.encode_block("BF16", old, new)


def test_a_block_over_the_formats_limit_is_refused_before_it_is_read():
    huge = np.broadcast_to(np.zeros(1, np.uint8), (ans.MAX_BLOCK + 1,))  # no memory behind it
    with pytest.raises(ValueError, match="at most 2"):
        ans.encode_block("U8", huge, huge)


def test_the_encoder_still_writes_the_committed_golden_payload():
    """The encoder's bytes are pinned (the decoders' are by tests/unit/test_golden.py): a change meant
    to keep them (speed work) cannot change a plan, a count or a coder unnoticed while still
    round-tripping. A change meant to alter them commits the new payload beside the old ones, which
    must keep decoding (``payload.bin`` is the first layout, ``payload4.bin`` today's, with its
    reverse payload ``reverse4.bin``)."""
    import json
    from pathlib import Path

    import zstandard

    golden = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
    spec = json.loads((golden / "ans" / "expected.json").read_text())
    old = np.frombuffer(zstandard.ZstdDecompressor().decompress((golden / spec["base"]).read_bytes()), np.uint8)
    payload = (golden / "ans" / spec["payloads"][-1]).read_bytes()
    new = decode_tensor("BF16", "ans", payload, old, spec["nbytes"])
    enc = encode_tensor("BF16", new, old, CodecConfig(block_bytes=65536, dense_above=1.0))
    assert enc.codec == "ans" and enc.payload == payload
    assert enc.reverse == (golden / "ans" / spec["reverses"][spec["payloads"][-1]]).read_bytes()
    for earlier in spec["payloads"][:-1]:  # earlier layouts of the same step: larger
        first = (golden / "ans" / earlier).read_bytes()
        assert np.array_equal(decode_tensor("BF16", "ans", first, old, spec["nbytes"]), new)
        assert len(first) > len(payload)


def test_the_default_delta_codec_is_ans_where_it_applies():
    assert delta_codec("BF16", CodecConfig()) == "ans"
    assert delta_codec("U8", CodecConfig()) == "ans"
    assert delta_codec("F64", CodecConfig()) == "sparse"  # 8-byte elements
    assert delta_codec("BF16", CodecConfig(entropy_coder=False)) == "sparse"
    assert delta_codec("BF16", CodecConfig(coder="ac")) == "ac"
    assert registry.get("ans").id == 5 and registry.get_by_id(5).name == "ans"
    with pytest.raises(UsageError):
        CodecConfig(coder="huffman")


@pytest.mark.parametrize("dtype", ["BF16", "F32", "U8"])
def test_payloads_round_trip_forward_and_backward(dtype):
    """Through the payload container: several blocks, each coded and decoded on its own."""
    rng = np.random.default_rng(3)
    old = base_of(dtype, 50_000, rng)
    new = changed(old, 0.02, rng)
    cfg = CodecConfig(block_bytes=16_384)
    enc = encode_tensor(dtype, new.view(np.uint8), old.view(np.uint8), cfg)
    assert enc.codec == "ans" and enc.changed == np.count_nonzero(old != new)
    out = decode_tensor(dtype, "ans", enc.payload, old.view(np.uint8), old.nbytes)
    assert np.array_equal(out, new.view(np.uint8))
    codec = registry.get("ans")
    assert codec.invertible
    back = np.empty_like(new)
    codec.decode_backward(dtype, memoryview(ans.encode_block(dtype, old, new)[0]), new, back, "test")
    assert np.array_equal(back, old)
    inplace = new.copy()
    codec.decode_backward(dtype, memoryview(ans.encode_block(dtype, old, new)[0]), inplace, inplace, "test")
    assert np.array_equal(inplace, old)


# --- hostile input -----------------------------------------------------------------------------------
CROSSING = {"BF16": ([120, 121, 122], [121, 122]), "F32": ([120, 121, 122], [121, 122]), "F16": ([8, 9, 10], [9, 10])}


def _crossings(dtype: str, far: bool) -> tuple[np.ndarray, np.ndarray, bytes, ans.Parsed]:
    """A block of weights near 0.02, 5% of the normal ones moved by a unit or two, and 400 moved by one unit across an
    exponent boundary (up from the top of an exponent's mantissa, down from the bottom), over
    thresholds at those exponents; ``far``: and one moved up by half an exponent's step and one
    unit more (the top bit of its new mantissa set, as if it had come down)."""
    rng = np.random.default_rng(24)
    old = base_of(dtype, 50_000, rng)
    new = old.copy()
    shift = ans.EXPONENT_FIELD[dtype][0]
    idx = 8 + np.flatnonzero(rng.random(old.size - 8) < 0.05)  # not the NaN, infinities and subnormals
    idx = idx[(old[idx].astype(np.int64) & ((1 << (8 * old.itemsize - 1)) - 1)) >= 1 << shift]  # nor through 0
    new[idx] = (old[idx].astype(np.int64) + rng.choice([1, -1, 2, -2], idx.size)).astype(old.dtype)
    top = old.dtype.type((1 << shift) - 1)
    up, down = rng.choice(np.arange(8, old.size), (2, 200), replace=False)
    old[up] |= top
    new[up] = old[up] + old.dtype.type(1)
    old[down] &= ~top
    new[down] = old[down] - old.dtype.type(1)
    if far:  # from the top of the exponent below the middle threshold to its new exponent's upper half
        old[10] = old.dtype.type((CROSSING[dtype][0][1] - 1) << shift) | top
        new[10] = old[10] + old.dtype.type((1 << (shift - 1)) + 1)
    data, _ = ans.encode_block(dtype, old, new, split=CROSSING[dtype])
    return old, new, data, ans.Parsed(dtype, memoryview(data), old.size, old.dtype, "test")


def _blocks() -> list[tuple[str, np.ndarray, np.ndarray, bytes]]:
    rng = np.random.default_rng(4)
    out = []
    for dtype in ("BF16", "F32", "U8"):
        for n, frac in ((1000, 0.03), (20_000, 0.01), (20_000, 0.3), (5000, 0.9)):
            old = base_of(dtype, n, rng)
            new = changed(old, frac, rng)
            out.append((dtype, old, new, ans.encode_block(dtype, old, new)[0]))
    for dtype in ("BF16", "F32"):  # exceptions derived from the new values
        old, new, data, _ = _crossings(dtype, far=False)
        out.append((dtype, old, new, data))
    return out


BLOCKS = _blocks()


def _decode_or_refuse(dtype, data, base, backward=False) -> np.ndarray | None:
    """The decoded block, or None where it was refused with a FormatError (anything else fails)."""
    try:
        out = np.empty_like(base)
        if backward:
            ans.decode_block_backward(dtype, memoryview(data), base, out, "hostile")
            ans.decode_backward(dtype, data, base, "hostile")  # the reference refuses alike or gives an array
        else:
            ans.decode_block(dtype, memoryview(data), base, out, "hostile")
        return out
    except FormatError:
        return None


@pytest.mark.parametrize("case", range(len(BLOCKS)))
def test_a_block_against_another_base_is_refused_or_decodes_to_other_bytes(case):
    dtype, old, new, data = BLOCKS[case]
    rng = np.random.default_rng(case)
    for base in (new, np.roll(old, 1), rng.permutation(old), np.zeros_like(old), np.full_like(old, 0xFF)):
        out = _decode_or_refuse(dtype, data, base)
        assert out is None or not np.array_equal(out, new) or np.array_equal(base, old)
        back = _decode_or_refuse(dtype, data, base, backward=True)  # refused, or some array: never a crash
        assert back is None or back.shape == base.shape


def test_a_block_of_another_dtype_or_size_is_refused():
    dtype, old, new, data = BLOCKS[1]
    with pytest.raises(FormatError, match="exponent field"):
        ans.decode_block("F16", memoryview(data), old, np.empty_like(old), "hostile")
    for n in (old.size - 1, old.size + 1):
        base = np.resize(old, n)
        with pytest.raises(FormatError):
            ans.decode_block(dtype, memoryview(data), base, np.empty_like(base), "hostile")


@pytest.mark.parametrize("case", range(len(BLOCKS)))
def test_every_truncation_is_refused(case):
    dtype, old, new, data = BLOCKS[case]
    step = max(1, len(data) // 300)
    for cut in range(0, len(data), step):
        assert _decode_or_refuse(dtype, data[:cut], old) is None or cut == 0
        assert _decode_or_refuse(dtype, data[:cut], new, backward=True) is None or cut == 0


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_blocks_raise_only_format_errors(data):
    dtype, old, new, block = data.draw(st.sampled_from(BLOCKS))
    bad = bytearray(block)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(bad) - 1))
        bad[i] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(bad)))
    for b in (bytes(bad), bytes(bad[:cut])):
        for out in (_decode_or_refuse(dtype, b, old), _decode_or_refuse(dtype, b, new, backward=True)):
            assert out is None or out.shape == old.shape  # a block that still decodes: the checksum's to catch


def test_escapes_beyond_the_element_width_are_refused():
    """A difference that does not fit the element (an Exp-Golomb code too long) is refused."""
    rng = np.random.default_rng(5)
    old = base_of("U8", 4000, rng)
    new = old.copy()
    new[::50] += np.uint8(100)  # zigzag codes >= 16: escaped
    data = bytearray(ans.encode_block("U8", old, new)[0])
    out = np.empty_like(old)
    ans.decode_block("U8", memoryview(bytes(data)), old, out, "test")
    assert np.array_equal(out, new)
    refused = 0
    for i in range(8, len(data)):  # every single-byte change of the sections decodes or is refused
        for v in (0x00, 0xFF):
            bad = bytearray(data)
            bad[i] = v
            refused += _decode_or_refuse("U8", bytes(bad), old) is None
    assert refused > 0


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = data[pos]
        v |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if b < 0x80:
            return v, pos


def _tables(data: bytes) -> dict[str, list[int]]:
    """Where a block's header keeps its exception list's order byte (``"list"``, empty for the first
    layout or no exceptions) and each value group's symbol-count byte (``"groups"``)."""
    K, G = data[4] & 7, data[7]
    ne, pos = _varint_at(data, 8 + K - 1 + G - 1)
    at: dict[str, list[int]] = {"list": [], "groups": []}
    if data[4] & ans.EXC_CODED:
        at["list"].append(pos)
        length, pos = _varint_at(data, pos + 1)
        pos += length
    else:
        for _ in range(ne):
            _, pos = _varint_at(data, pos)
        pos += ne
    for _ in range(K):
        _, pos = _varint_at(data, pos)
        c, pos = _varint_at(data, pos)
        if c and data[4] & ans.NIBBLES and data[pos] == ans.NIBBLE_CODE:
            pos += 1
        elif c:
            _, pos = _varint_at(data, pos + 1)
    if data[4] & ans.NIBBLES:  # the nibble section's length
        _, pos = _varint_at(data, pos)
    for _ in range(G):
        m, pos = _varint_at(data, pos)
        if m:
            at["groups"].append(pos)
            pos += 1
            for _ in range((data[pos - 1] & 31) + 2):  # its frequencies, E_g and A_g
                pos = _varint_at(data, pos)[1]
    return at


def test_large_escapes_are_coded_with_a_higher_order():
    """4,000 bytes moved by 100 (zigzag 200: escapes of 184): Exp-Golomb of order 0 takes 15 bits an
    escape, of order 6 nine. Against the same positions moved by 1 (no escapes), the escapes'
    block is about 9 bits an escape larger, and its group's byte names the order."""
    rng = np.random.default_rng(8)
    old = base_of("U8", 200_000, rng)
    at = rng.choice(old.size, 4000, replace=False)
    far, near = old.copy(), old.copy()
    far[at] += np.uint8(100)
    near[at] += np.uint8(1)
    big, small = ans.encode_block("U8", old, far)[0], ans.encode_block("U8", old, near)[0]
    check_round_trip("U8", old, far, big)
    assert 4000 * 8 / 8 < len(big) - len(small) < 4000 * 10 / 8
    (g,) = _tables(big)["groups"]
    (h,) = _tables(small)["groups"]
    assert big[g] >> 5 == 6 and small[h] >> 5 == 0  # no escapes: order 0


def _eg_bits(values: np.ndarray, order: int) -> int:
    """Bits of the Exp-Golomb codes of ``values`` of order ``order``, from docs/FORMAT.md's definition."""
    x = (values.astype(np.int64) >> order) + 1
    return int((2 * np.floor(np.log2(x)).astype(np.int64) + 1 + order).sum())


@pytest.mark.parametrize("clustered", [False, True])
def test_the_exception_list_takes_the_order_that_codes_its_gaps_in_the_fewest_bits(clustered):
    """Checked against every order to EXC_ORDER. Clustered exceptions (a run of neighbours crossing
    an exponent boundary, and one far away) have gaps of 0 and one large: their best order is 0,
    far below log2 of the mean gap, where a search near the mean would not look."""
    rng = np.random.default_rng(11)
    old = base_of("BF16", 200_000, rng)
    new = changed(old, 0.03, rng)
    if clustered:
        new = old.copy()
        run = np.arange(1000, 1400)
        old[run] = np.uint16(121 << 7 | 127)  # the top of exponent 121: +1 moves it to 122
        new[run] = old[run] + np.uint16(1)
        old[150_000] = np.uint16(121 << 7 | 127)
        new[150_000] = old[150_000] + np.uint16(1)
    data, _ = ans.encode_block("BF16", old, new, split=([122], []))
    p = ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test")
    gaps = np.diff(np.concatenate([[-1], p.exc])) - 1
    costs = [_eg_bits(gaps, o) for o in range(ans.EXC_ORDER + 1)]
    (at,) = _tables(data)["list"]
    order = data[at] & ~ans.EXC_DERIVED
    assert p.exc.size > 1 and costs[order] == min(costs)
    assert (order == 0) if clustered else (order > 0)
    check_round_trip("BF16", old, new, data)


def test_a_changed_escape_order_or_exception_list_is_refused_or_decodes_to_other_bytes():
    """The orders are read as strictly as the rest: an escape order in a group without escapes, an
    exception list's order over EXC_ORDER, or a coded list flag on a block without exceptions is
    refused; on this block another order decodes to other bytes (the checksum's to catch) or is
    refused (a code whose last bits are zero can read the same under two orders: not here)."""
    rng = np.random.default_rng(9)
    old = base_of("BF16", 60_000, rng)
    new = changed(old, 0.05, rng)
    data, _ = ans.encode_block("BF16", old, new)
    at = _tables(data)
    assert data[4] & ans.EXC_CODED and at["list"] and at["groups"]
    bad = bytearray(data)
    bad[at["list"][0]] = ans.EXC_ORDER + 1
    assert _decode_or_refuse("BF16", bytes(bad), old) is None
    mode = data[at["list"][0]] & ans.EXC_DERIVED
    for order in range(ans.EXC_ORDER + 1):
        if order | mode != data[at["list"][0]]:  # the list is read by the backward decode only
            bad[at["list"][0]] = order | mode
            back = _decode_or_refuse("BF16", bytes(bad), new, backward=True)
            assert back is None or not np.array_equal(back, old)
    for g in at["groups"]:
        for order in range(8):
            if order != data[g] >> 5:
                bad = bytearray(data)
                bad[g] = (data[g] & 31) | order << 5
                out = _decode_or_refuse("BF16", bytes(bad), old)
                assert out is None or not np.array_equal(out, new)
    step = old.copy()
    step[::97] += np.uint16(1)  # by one unit: no escapes
    plain = ans.encode_block("BF16", old, step, split=([], []))[0]  # one bucket and group: no exceptions
    (g,) = _tables(plain)["groups"]
    assert not plain[4] & ans.EXC_CODED and plain[g] & 31 < 16  # no escape symbol
    for where, bit in ((4, ans.EXC_CODED), (g, 1 << 5)):
        bad = bytearray(plain)
        bad[where] |= bit
        assert _decode_or_refuse("BF16", bytes(bad), old) is None


@pytest.mark.parametrize("dtype", sorted(CROSSING))
@pytest.mark.parametrize("far", [False, True])
def test_exceptions_carry_their_old_bucket_and_group_only_when_the_new_value_does_not_tell_it(dtype, far):
    """A change of less than half an exponent's step that moves an element across a threshold
    leaves the top bit of its mantissa saying which way it came: the block's exception list then
    holds only the positions (4 bits an exception less). One change that does not (``far``) makes
    the block list every exception's old bucket and group, as before; both decode both ways."""
    old, new, data, p = _crossings(dtype, far)
    at = _tables(data)["list"][0]
    gaps = np.diff(np.concatenate([[-1], p.exc])) - 1
    length, _ = _varint_at(data, at + 1)
    tags = 4 * p.exc.size if far else 0
    shift, bits = ans.EXPONENT_FIELD[dtype]
    ctx = [
        [np.searchsorted(t, (v.astype(np.int64) >> shift) & ((1 << bits) - 1), side="right") for t in CROSSING[dtype]]
        for v in (old, new)
    ]
    moved = np.flatnonzero((ctx[0][0] != ctx[1][0]) | (ctx[0][1] != ctx[1][1]))
    assert moved.size > 100 and np.array_equal(p.exc, moved)
    assert p.derived == (not far) and bool(data[at] & ans.EXC_DERIVED) == (not far)
    assert length == -(-(_eg_bits(gaps, data[at] & ~ans.EXC_DERIVED) + tags) // 8)
    assert not far or 10 in p.exc
    check_round_trip(dtype, old, new, data)


def test_an_exception_in_the_blocks_last_partial_word_is_checked_before_the_list_is_derived():
    """The encoder codes the last, partial word element by element; an exception there that the new
    value does not tell (up by 65 units, its new mantissa's top bit set) keeps the list explicit."""
    old = np.full(1000, (120 << 7) | 0x7F, np.uint16)  # the top of exponent 120
    new = old.copy()
    new[::3] += np.uint16(1)  # up to exponent 121: derivable
    new[995] = old[995] + np.uint16(65)  # in the tail (1000 = 15 * 64 + 40): derives 122, was 120
    data, _ = ans.encode_block("BF16", old, new, split=([121, 122], [121, 122]))
    p = ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test")
    assert 995 in p.exc and not p.derived
    check_round_trip("BF16", old, new, data)
    new[995] = old[995] + np.uint16(1)  # derivable too: the list is derived
    data, _ = ans.encode_block("BF16", old, new, split=([121, 122], [121, 122]))
    assert ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test").derived
    check_round_trip("BF16", old, new, data)


def test_a_derived_exponent_past_the_field_or_a_flipped_derived_flag_is_refused_or_decodes_to_other_bytes():
    """The backward decoder refuses a result whose exception derives an exponent below 0 or above
    the field's top (the encoder lists the exceptions of such a block instead), and a derived list
    in a block of a dtype without an exponent field; flipping the flag
    either way misreads the list: refused, or other bytes (the checksum's to catch). The forward
    decode never reads the exceptions' buckets and groups."""
    old, new, data, p = _crossings("BF16", far=False)
    for value in (0x0001, 0x7FC0):  # exponent 0, mantissa's top bit clear; exponent 255, set
        bad = new.copy()
        bad[p.exc[0]] = value
        for decode in (ans.decode_block_backward, ans.decode_backward):
            args = (np.empty_like(bad), "hostile") if decode is ans.decode_block_backward else ("hostile",)
            with pytest.raises(FormatError, match="derives an exception's exponent past the field"):
                decode("BF16", memoryview(data), bad, *args)
    at = _tables(data)["list"][0]
    for bit in (0x40, 0x80):  # the order byte's other spare bits
        bad = bytearray(data)
        bad[at] |= bit
        assert _decode_or_refuse("BF16", bytes(bad), old) is None
        assert _decode_or_refuse("BF16", bytes(bad), new, backward=True) is None
    for far in (False, True):
        o, n, block, _ = _crossings("BF16", far)
        flipped = bytearray(block)
        flipped[_tables(block)["list"][0]] ^= ans.EXC_DERIVED
        out = _decode_or_refuse("BF16", bytes(flipped), o)
        assert out is None or np.array_equal(out, n)
        back = _decode_or_refuse("BF16", bytes(flipped), n, backward=True)
        assert back is None or not np.array_equal(back, o)
    u8 = np.arange(5000, dtype=np.uint8)  # no exponent field: a derived list (one exception at 0) is refused
    plain = ans.encode_block("U8", u8, u8 + np.uint8(1))[0]
    assert plain[8] == 0  # no exceptions
    listed = plain[:4] + bytes([1 | ans.EXC_CODED]) + plain[5:8] + bytes([1, ans.EXC_DERIVED, 1, 0]) + plain[9:]
    with pytest.raises(FormatError, match="check 5 failed"):
        ans.decode_backward("U8", listed, u8 + np.uint8(1), "hostile")


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_smaller_than_the_zeroth_order_bound_and_than_sparse(lr):
    """On a realistic step (elements near 0.02 moved by ~lr: the small ones change most often)."""
    rng = np.random.default_rng(6)
    master = rng.standard_normal(1 << 20) * 0.02
    step = lr * np.sign(rng.standard_normal(master.size))
    old = (master.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = ((master + step).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    _, counts = np.unique(new - old, return_counts=True)
    p = counts / counts.sum()
    bound = float(-(p * np.log2(p)).sum() * old.size / 8)
    enc = encode_tensor("BF16", new.view(np.uint8), old.view(np.uint8), CodecConfig(dense_above=1.0))
    plain = encode_tensor("BF16", new.view(np.uint8), old.view(np.uint8), CodecConfig(entropy_coder=False))
    assert enc.codec == "ans" and 0 < enc.changed == plain.changed
    assert len(enc.payload) < 0.9 * bound
    assert len(enc.payload) < 0.8 * len(plain.payload)


@pytest.mark.parametrize("n", [(1 << 20) - 64, 1 << 20])  # every 16th window sampled, and every 32nd
def test_a_sampled_block_gets_the_value_groups_its_changes_pay_for(n):
    """A block large enough that the plan samples it: 1,500 changes, by 1 unit where the old
    exponent is 100 and by 5 where it is 120, so two value groups save about a bit a change
    (about 1,500 bits against a table of 160). The plan must weigh the table at the sample's scale,
    not the block's; weighed at the block's it takes one group."""
    rng = np.random.default_rng(18)
    high = rng.random(n) < 0.5
    old = (np.where(high, 120, 100) << 7 | rng.integers(8, 120, n)).astype(np.uint16)
    at = rng.choice(n, 1500, replace=False)
    step = np.where(high[at], 5, 1) * rng.choice([-1, 1], at.size)
    new = old.copy()
    new[at] = (old[at].astype(np.int64) + step).astype(np.uint16)
    data, count = ans.encode_block("BF16", old, new)
    assert count == at.size and data[7] == 2  # the header's value groups
    p = ans.Parsed("BF16", memoryview(data), n, old.dtype, "test")
    one_group, _ = ans.encode_block("BF16", old, new, split=(p.thr, []))
    assert len(data) < len(one_group) - 100
    check_round_trip("BF16", old, new, data)


@pytest.mark.parametrize("words, step", [(ans.SAMPLE_HALVED - 1, 16), (ans.SAMPLE_HALVED, 32)])
def test_the_plan_samples_large_blocks_more_thinly_and_scales_to_the_block(words, step):
    """From SAMPLE_HALVED words a block's changes are sampled in every 32nd window, not every 16th:
    the counts are still scaled to the whole block (elements per old exponent within 5%, changes
    within 4 standard deviations of the sampled count), the sample spans the block (two exponents
    occur only in its second half), and three buckets split the exponents exactly where the change
    densities differ (three bands of two exponents each: 1%, 10% and 40% changed; with the change
    counts replaced by a uniform density the cuts fall elsewhere)."""
    rng = np.random.default_rng(words)
    n = 64 * words
    half = n // 2
    ex = np.concatenate([rng.choice(np.arange(100, 104), half), rng.choice(np.array([104, 105]), n - half)])
    density = {100: 0.01, 101: 0.01, 102: 0.1, 103: 0.1, 104: 0.4, 105: 0.4}
    share = {e: (half / 4 if e < 104 else (n - half) / 2) for e in density}
    old = (ex << 7 | rng.integers(8, 120, n)).astype(np.uint16)
    new = old.copy()
    hit = rng.random(n) < np.array([density[e] for e in range(100, 106)])[ex - 100]
    new[hit] += 1
    per, chp, _, got, _ = ans._histogram(old, new, 7, 255, 16)
    assert got == step
    for e, d in density.items():
        assert abs(per[e] - share[e]) < 0.05 * share[e], e
        assert abs(chp[e] - d * share[e]) < 4 * np.sqrt(d * share[e] * step), e  # 4 sd: the sample's count
    thr, _, _, _ = ans._plan(old, new, 7, 8, 3, 16)  # three buckets: the cuts between the bands, exactly
    assert set(thr.tolist()) == {102, 104}
    data, count = ans.encode_block("BF16", old, new)
    assert count == int(hit.sum())
    check_round_trip("BF16", old, new, data)


def _split_by_the_whole_program(counts, G, table):
    """The value groups' split as :func:`ans._split` makes it for more than 2 groups: every range's
    cost, then the dynamic program over them."""
    ex = np.flatnonzero(counts.sum(axis=1))
    m = ex.size
    if m <= 1 or G <= 1:
        return np.zeros(0, np.int64)
    cum = np.zeros((m + 1, entropy.NSYM), np.int64)
    cum[1:] = np.cumsum(counts[ex], axis=0)
    cost = np.full((m + 1, m + 1), 1e300)
    for a in range(m):
        for b in range(a + 1, m + 1):
            cost[a, b] = ans._bits_of(cum, a, b, table)
    dp, arg = ans._partitions(cost, min(G, m))
    best = 1
    for q in range(2, min(G, m) + 1):
        if dp[q, m] < dp[best, m] - 1e-9:
            best = q
    return ans._cuts(arg, best, ex)


def test_two_value_groups_are_split_where_the_whole_dynamic_program_splits_them():
    """For 2 groups the plan tries only the ranges at either end (one cut or none): the same
    thresholds as the whole dynamic program, on counts from one exponent to 40, equal rows, rows of
    one symbol, palindromes (cuts that tie: the first is taken), and tables from free to dearer than
    any cut saves."""
    rng = np.random.default_rng(40)
    cut = 0
    for i in range(1500):
        counts = np.zeros((256, entropy.NSYM), np.int32)
        rows = rng.choice(256, rng.integers(1, 41), replace=False)
        for r in rows:
            top = rng.choice([2, 5, 50, 1000])
            counts[r] = rng.integers(0, top, entropy.NSYM) * (rng.random(entropy.NSYM) < rng.random())
        if i % 4 == 0:
            counts[rows] = counts[rows[0]]
        elif i % 4 == 1:
            counts[rows, rng.integers(0, entropy.NSYM)] += rng.integers(1, 100)
        elif i % 4 == 2:  # the rows read the same backwards: cuts at mirrored places cost the same
            rows.sort()
            counts[rows[::-1][: rows.size // 2]] = counts[rows[: rows.size // 2]]
        table = float(rng.choice([0.0, 10.0, 160.0, 1e4]))
        got = ans._split(counts, 2, table)
        assert np.array_equal(got, _split_by_the_whole_program(counts, 2, table)), i
        cut += got.size
    assert 300 < cut < 1200  # both answers occur


@pytest.mark.parametrize("n", [1000, 70_000, 64 * ans.SAMPLE_HALVED])
def test_the_plan_scans_without_the_branch_on_a_words_changes_where_it_would_mispredict(n):
    """The scan takes every word as changed where the sample's consecutive words differ (changed or
    not) at least as often as a word is unchanged: changes spread at random in most words (2% and
    20% of the elements), or in every word; not where few words change, nor where the changed words
    come in runs (an embedding's rows), nor without changes."""
    rng = np.random.default_rng(n)
    old = base_of("BF16", n, rng)

    def dense(new):
        return ans._plan(old, new, 7, 8, 4, 16)[2]

    assert dense(changed(old, 0.02, rng)) and dense(changed(old, 0.2, rng)) and dense(changed(old, 1.0, rng))
    assert not dense(old.copy()) and not dense(changed(old, 0.002, rng))
    rows = np.repeat(rng.random(-(-n // 256)) < 0.5, 256)[:n]  # rows of 256 elements, half of them changed
    new = old.copy()
    new[rows] = changed(old[rows], 0.2, rng)
    assert not dense(new)


def test_rans_round_trips_with_every_frequency_a_symbol_can_have():
    """The encoder's division by a symbol's frequency (the high half of a multiply by a reciprocal) is
    exact for every frequency from 1 to PROB_ONE at every state it meets: symbol 0 takes each frequency
    in turn, symbol 1 the rest, and a sequence drawn from them (states over their whole range) decodes."""
    rng = np.random.default_rng(7)
    c = 3000
    out = np.zeros(2 * c + 64, np.uint8)
    got = np.zeros(c, np.uint8)
    values = np.arange(entropy.NSYM, dtype=np.uint8)
    for f in range(1, entropy.PROB_ONE + 1):
        freq = np.zeros(entropy.NSYM, np.int64)
        freq[0], freq[1] = f, entropy.PROB_ONE - f
        syms = (rng.random(c) >= f / entropy.PROB_ONE).astype(np.uint8)
        syms[rng.integers(0, c, 3)] = 0  # every table's symbol 0 is coded, however rare
        if f == entropy.PROB_ONE:
            syms[:] = 0
        length = entropy.rans_encode(syms, c, freq, out)
        assert entropy.rans_decode(out, 0, length, freq, values, got, 0, c) == 0, f
        assert np.array_equal(got, syms), f


def test_symbol_counts_by_pairs_count_every_symbol():
    """The encoder counts a group's symbols two at a time (16-bit loads into histograms of pairs),
    or one by one under FEW_SYMBOLS: the same counts as bincount, for lengths with every remainder
    past the last whole 8 bytes on either side of FEW_SYMBOLS, none at all, and runs of one symbol."""
    rng = np.random.default_rng(13)
    hist = np.empty(4 * entropy.NSYM * entropy.NSYM, np.int64)
    counts = np.empty(entropy.NSYM, np.int64)
    few = ans.FEW_SYMBOLS
    for m in [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, few - 1, few, few + 1, few + 7, 1000, 4099]:
        for kind in ("uniform", "skewed", "one"):
            row = np.full((m + 8) // 8 * 8, 99, np.uint8)  # padding past m is never counted
            if kind == "uniform":
                row[:m] = rng.integers(0, entropy.NSYM, m)
            elif kind == "skewed":
                row[:m] = np.minimum(rng.geometric(0.6, m) - 1, entropy.NSYM - 1)
            else:
                row[:m] = entropy.NSYM - 1
            ans._symbol_counts(row, m, hist, counts)
            assert np.array_equal(counts, np.bincount(row[:m], minlength=entropy.NSYM)), (m, kind)


@numba.njit
def _rans_steps_at(xs, tab, s, out):
    """The encoder's step (:func:`entropy.rans_encode`) of symbol ``s`` from each state of ``xs``."""
    for i in range(xs.size):
        x = xs[i]
        out[i] = x + tab[4 * s + 2] + simd.mulhi(x, tab[4 * s + 1]) * tab[4 * s + 3]


def test_the_rans_encoders_step_is_exact_at_every_frequency_and_state():
    """A step is (x // f) << PROB_BITS + x % f + start, with x // f the high half of x times
    ceil(2^64 / f) (:func:`entropy.rans_steps`; f = 1 as 2^64 - 1 and a start PROB_ONE - 1 higher):
    checked against integer division for every frequency (symbol 0 takes f, symbol 1 the rest) at the
    states where the quotient moves (each multiple of f near both ends of the states' range and one
    below it), at the range's ends and at random states below 2^32."""
    rng = np.random.default_rng(11)
    one = entropy.PROB_ONE
    for f in range(1, one + 1):
        freq = np.zeros(entropy.NSYM, np.int64)
        freq[0], freq[1] = f, one - f
        tab = entropy.rans_steps(freq)
        for s, fs, start in ((0, f, 0), (1, one - f, f)):
            if fs == 0:
                continue
            top = ((1 << 32) - 1) // fs * fs
            edges = [1, 2, fs - 1, fs, fs + 1, 2 * fs - 1, 2 * fs, 1 << 16, top - fs, top - 1, top, (1 << 32) - 1]
            xs = np.concatenate(
                [np.array([e for e in edges if e >= 1], np.uint64), rng.integers(1, 1 << 32, 32, np.uint64)]
            )
            got = np.empty_like(xs)
            _rans_steps_at(xs, tab, s, got)
            f64 = np.uint64(fs)
            want = (xs // f64) * np.uint64(one) + xs % f64 + np.uint64(start)
            assert np.array_equal(got, want), (f, s)


@pytest.mark.parametrize("width", [np.uint8, np.uint16, np.uint32])
def test_rans_sections_decode_each_symbols_value_and_refuse_short_long_or_miscounted_ones(width):
    """The decoder writes each symbol's value (the table carries it; values up to the widest
    difference) and refuses a section whose words run out (shortened by a word or more: the steps
    then read the zeros past them), one with a word to spare, and a count one off either way, without
    reading or writing outside its arrays; an empty section decodes to nothing."""
    rng = np.random.default_rng(np.dtype(width).itemsize)
    c = 5001
    freq = np.zeros(entropy.NSYM, np.int64)
    entropy.normalise(rng.integers(1, 100, entropy.NSYM), freq)
    syms = rng.choice(entropy.NSYM, c, p=freq / freq.sum()).astype(np.uint8)
    out = np.zeros(2 * c + 64, np.uint8)
    length = entropy.rans_encode(syms, c, freq, out)
    values = rng.integers(0, np.iinfo(width).max, entropy.NSYM, dtype=width, endpoint=True)
    values[0] = np.iinfo(width).max
    got = np.full(c + 8, 7, width)
    assert entropy.rans_decode(out, 0, length, freq, values, got, 3, c) == 0
    assert np.array_equal(got[3 : 3 + c], values[syms]) and (got[:3] == 7).all() and (got[3 + c :] == 7).all()
    for cut in (2, 4, 64, length - 4 * entropy.LANES):
        data = out[: length - cut].copy()  # exactly as long as the section: nothing readable past it
        assert entropy.rans_decode(data, 0, data.size, freq, values, got, 0, c) == 13, cut
    data = np.concatenate([out[:length], np.zeros(2, np.uint8)])
    assert entropy.rans_decode(data, 0, data.size, freq, values, got, 0, c) == 13
    for count in (c - 1, c + 1, 0):
        assert entropy.rans_decode(out, 0, length, freq, values, np.zeros(c + 8, width), 0, count) == 13, count
    empty = np.zeros(4 * entropy.LANES, np.uint8)  # no symbols: four states at 2^16, no words
    for q in range(entropy.LANES):
        empty[4 * q + 2] = 1
    untouched = np.full(4, 7, width)
    assert entropy.rans_decode(empty, 0, empty.size, freq, values, untouched, 0, 0) == 0 and (untouched == 7).all()


@pytest.mark.parametrize("top", [4095, 4094, 4000, 2049])
def test_rans_round_trips_with_states_in_the_upper_half_of_their_range(top):
    """The encoder divides a state by a symbol's frequency through a reciprocal; states reach
    [2^31, 2^32), where the reciprocal alone overshoots by one for some frequencies (4095 did):
    a block that no decoder accepts. A dominant symbol keeps states high."""
    rng = np.random.default_rng(top)
    freq = np.zeros(entropy.NSYM, np.int64)
    freq[0], freq[1:] = top, 0
    rest = entropy.PROB_ONE - top
    freq[1 : 1 + min(rest, entropy.NSYM - 1)] = 1
    freq[1] += rest - min(rest, entropy.NSYM - 1)
    c = 400_000
    p = freq / freq.sum()
    syms = rng.choice(entropy.NSYM, c, p=p).astype(np.uint8)
    out = np.zeros(2 * c + 64, np.uint8)
    length = entropy.rans_encode(syms, c, freq, out)
    got = np.full(c, 99, np.uint8)
    values = np.arange(entropy.NSYM, dtype=np.uint8)
    assert entropy.rans_decode(out, 0, length, freq, values, got, 0, c) == 0
    assert np.array_equal(got, syms)
