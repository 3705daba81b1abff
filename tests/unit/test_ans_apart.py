"""``ans`` blocks whose exception list is apart (docs/FORMAT.md, flag A): the block alone decodes
forward, the block and its reverse part backward; the rANS states carry the Rice sections' first
bytes instead of the list's. What payloads hold since the flag; blocks with the list in them (the
layout before) are test_ans.py's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ans import CROSSING, _crossings, base_of, changed, check_round_trip
from test_nibbles import varint as _varint

from weightsync.codec import ans
from weightsync.errors import FormatError


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
@pytest.mark.parametrize("buckets", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_every_pass_round_trips(dtype, buckets, groups):
    rng = np.random.default_rng(buckets * 10 + groups)
    old = base_of(dtype, 20_000, rng)
    new = changed(old, 0.05, rng)
    split = ([118, 120, 120][: buckets - 1], [119, 121, 121][: groups - 1])
    data, rev, _ = ans.encode_block_apart(dtype, old, new, split=split)
    assert (data[4] & 7, data[7]) == (buckets, groups)
    if dtype == "BF16":  # changes by 17 units and more cross thresholds (in F32 they are too small)
        assert bool(rev) == (buckets * groups > 1)
    check_round_trip(dtype, old, new, data, rev)


def test_the_block_is_the_in_block_layout_less_its_list_and_the_carried_rice_bytes():
    """The same sections as the layout with the list in the block; the list moves to the reverse
    part byte for byte (its count, order byte and bit section), and the states carry the Rice
    sections' first bytes: the block is shorter by the list and by those."""
    rng = np.random.default_rng(7)
    old = base_of("BF16", 200_000, rng)
    new = changed(old, 0.05, rng)
    inside, _ = ans.encode_block("BF16", old, new)
    data, rev, _ = ans.encode_block_apart("BF16", old, new)
    assert inside[4] & ans.EXC_CODED and rev
    ne, pos = _varint(rev, 0)
    p = ans.Parsed("BF16", memoryview(inside), old.size, old.dtype, "test")
    assert ne == p.exc.size and rev[pos] == inside[8 + (inside[4] & 7) - 1 + inside[7] - 1 + len(_enc(ne))]
    assert data[4] & ans.CARRIED and len(data) < len(inside) - (len(rev) - len(_enc(ne)) - 1)
    q = ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test", reverse=rev)
    c = p.dstart[-1]  # the arrays' spare entries past the differences are not the block's
    assert np.array_equal(q.words, p.words) and np.array_equal(q.diffs[:c], p.diffs[:c])
    assert np.array_equal(q.exc, p.exc) and np.array_equal(q.exb, p.exb) and q.derived == p.derived


def _enc(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append(v & 0x7F | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


@pytest.mark.parametrize("frac", [0.0005, 0.002, 0.01, 0.05])
def test_rice_sections_shorter_or_longer_than_the_states_carry_round_trip(frac):
    """Few changes: Rice sections shorter than the states' 2 bytes each (every byte carried, the
    rest of the states at 2^16); many: longer (the rest in the block)."""
    rng = np.random.default_rng(int(frac * 1e4))
    old = base_of("BF16", 100_000, rng)
    new = changed(old, frac, rng)
    data, rev, _ = ans.encode_block_apart("BF16", old, new, nibbles=False)
    check_round_trip("BF16", old, new, data, rev)


def test_a_block_whose_positions_are_all_nibbles_carries_nothing():
    rng = np.random.default_rng(3)
    old = base_of("BF16", 30_000, rng)
    new = changed(old, 0.5, rng)
    data, rev, _ = ans.encode_block_apart("BF16", old, new, split=([], []))
    assert data[4] & ans.NIBBLES and not data[4] & ans.CARRIED and not rev
    check_round_trip("BF16", old, new, data, rev)


def _crossing_block(dtype: str, far: bool = True) -> tuple[np.ndarray, np.ndarray, bytes, bytes]:
    """test_ans's block of 400 changes across exponent boundaries (``far``: one whose old bucket and
    group cannot be derived from its new value), its list apart."""
    old, new, _, _ = _crossings(dtype, far)
    data, rev, _ = ans.encode_block_apart(dtype, old, new, split=CROSSING[dtype])
    assert rev
    return old, new, data, rev


def _backward(dtype, data, new, rev) -> np.ndarray | None:
    """The backward decode, or None where both decoders refused it with a FormatError."""
    try:
        out = np.empty_like(new)
        ans.decode_block_backward(dtype, memoryview(data), new, out, "hostile", reverse=rev)
    except FormatError:
        with pytest.raises(FormatError):
            ans.decode_backward(dtype, data, new, "hostile", reverse=rev)
        return None
    return out


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_missing_or_foreign_reverse_part_is_refused_not_decoded_to_other_bytes(dtype):
    old, new, data, rev = _crossing_block(dtype)
    assert _backward(dtype, data, new, b"") is None  # its exceptions' old buckets cannot be found
    other_old = base_of(dtype, old.size, np.random.default_rng(5))
    _, other_rev, _ = ans.encode_block_apart(dtype, other_old, changed(other_old, 0.05, np.random.default_rng(6)))
    out = _backward(dtype, data, new, other_rev)
    assert out is None or not np.array_equal(out, old)  # other bytes: the segment's checksum refuses them
    inside, _ = ans.encode_block(dtype, old, new, split=CROSSING[dtype])
    with pytest.raises(FormatError, match="no reverse part"):
        ans.decode_block_backward(dtype, memoryview(inside), new, np.empty_like(new), "hostile", reverse=rev)
    with pytest.raises(FormatError, match="no reverse part"):
        ans.decode_block_backward(dtype, memoryview(b""), new, np.empty_like(new), "hostile", reverse=rev)


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_every_truncation_of_the_block_or_its_reverse_part_is_refused(dtype):
    old, new, data, rev = _crossing_block(dtype)
    for cut in range(1, len(data), max(1, len(data) // 200)):
        with pytest.raises(FormatError):
            ans.decode_block(dtype, memoryview(data[:cut]), old, np.empty_like(old), "hostile")
        assert _backward(dtype, data[:cut], new, rev) is None
    for cut in range(0, len(rev)):
        out = _backward(dtype, data, new, rev[:cut])
        assert out is None or not np.array_equal(out, old)


def test_flags_the_layout_does_not_allow_are_refused():
    old, new, data, rev = _crossing_block("BF16")
    for flags in (ans.EXC_CODED, ans.EXC_CODED | ans.CARRIED):  # apart with the in-block list's flags
        bad = bytearray(data)
        bad[4] |= flags
        with pytest.raises(FormatError, match="check 2"):
            ans.decode_block("BF16", memoryview(bytes(bad)), old, np.empty_like(old), "hostile")


@pytest.mark.parametrize("count", [0, 10**6, 2**34])
def test_a_reverse_part_counting_more_than_its_bytes_hold_is_refused_before_anything_is_made(count):
    old, new, data, rev = _crossing_block("BF16")
    _, pos = _varint(rev, 0)
    with pytest.raises(FormatError, match="reverse part"):
        ans.decode_block_backward(
            "BF16", memoryview(data), new, np.empty_like(new), "hostile", reverse=_enc(count) + rev[pos:]
        )


BLOCKS = [_crossing_block("BF16"), _crossing_block("F32", far=False)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_blocks_and_reverse_parts_raise_only_format_errors(data):
    dtype = data.draw(st.sampled_from(["BF16", "F32"]))
    old, new, block, rev = BLOCKS[dtype == "F32"]
    which = data.draw(st.booleans())
    bad = bytearray(block if which else rev)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(bad) - 1))
        bad[i] ^= 1 << data.draw(st.integers(0, 7))
    bad = bytes(bad[: data.draw(st.integers(0, len(bad)))])
    b, r = (bad, rev) if which else (block, bad)
    try:
        ans.decode_block(dtype, memoryview(b), old, np.empty_like(old), "hostile")
    except FormatError:
        pass
    out = _backward(dtype, b, new, r)
    assert out is None or out.shape == old.shape  # a block that still decodes: the checksum's to catch


# --- a reader written from docs/FORMAT.md ("Apart", "Reverse payloads") --------------------------------
def _spec_rice(data: bytes) -> bytes:
    """An A = 1 block's Rice sections, read as docs/FORMAT.md says: the first ``H`` bytes from the
    states' ends (2 a state, in section order; the states past them end at 2^16), the rest from the
    block, where the Rice sections would be."""
    from test_nibbles import layout, nibble_runs, spec_decode

    lay = layout(data)
    assert lay["flags"] & ans.APART and not lay["flags"] & ans.EXC_CODED
    ends = []
    if lay["flags"] & ans.NIBBLES:
        S, runs = nibble_runs(lay)
        ends += spec_decode(data, lay["nibble_at"], lay["P"], S, runs)[1]
    wide = lay["flags"] & ans.WIDE
    for (m, freq, _, A), at in zip(lay["groups"], lay["group_at"]):
        if m:
            ends += spec_decode(data, at, A, 32 if wide and m >= ans.WIDE_MIN else 4, [(m, freq)])[1]
    assert lay["tail_at"] == len(data)
    raw, H = b"".join(e.to_bytes(2, "little") for e in ends), lay["H"]
    assert not any(raw[H:])
    R = sum(r for *_, r in lay["buckets"])
    return raw[:H] + data[lay["header_end"] : lay["header_end"] + R - H]


def _spec_reverse(rev: bytes) -> tuple[list[int], int]:
    """A reverse part read as docs/FORMAT.md says: the exception positions, and D."""
    from test_nibbles import exceptions, varint

    ne, pos = varint(rev, 0)
    order = rev[pos]
    return exceptions(list(rev[pos + 1 :]), ne, order & 31, 0 if order & ans.EXC_DERIVED else 4), order >> 5


@pytest.mark.parametrize("frac, far", [(0.002, False), (0.03, False), (0.15, True), (0.3, True)])
def test_blocks_read_as_the_format_says(frac, far):
    """The Rice sections a reader finds from the format's text (the states' carried bytes, then the
    block's) are those of the same block with its list inside, and the reverse part's list is that
    list."""
    from test_nibbles import layout, step

    old, new = step(1 << 17, frac, 11, far=0.04 if far else 0.0)
    data, rev, _ = ans.encode_block_apart("BF16", old, new)
    inside, _ = ans.encode_block("BF16", old, new)
    lin = layout(inside)
    R = sum(r for *_, r in lin["buckets"])
    assert _spec_rice(data) == inside[lin["header_end"] : lin["header_end"] + R]
    assert bool(data[4] & ans.CARRIED) == (R > 0) and (R > 0 or frac > 0.1)  # sparse steps: Rice, carried
    if rev:
        got, derived = _spec_reverse(rev)
        assert got == ans.Parsed("BF16", memoryview(inside), old.size, old.dtype, "t").exc.tolist()
    check_round_trip("BF16", old, new, data, rev)
