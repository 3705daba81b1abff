"""Nibble-coded positions and carried exception bytes of codec ``ans`` (docs/FORMAT.md, "ans", N and
C; weightsync.codec.nibbles): a plain-Python reader written from the format's text against the
package's parser, sections forged by a plain-Python coder, hostile blocks, and round trips."""

from __future__ import annotations

import numpy as np
import pytest

from weightsync.codec import ans, nibbles, simd
from weightsync.errors import FormatError

POP = [bin(t).count("1") for t in range(16)]


def spec_freq(c_b: int, n_b: int) -> list[int]:
    """A run's frequencies as docs/FORMAT.md gives them."""
    d = min(c_b, n_b - c_b)
    q = min(4095, max(1, (4096 * d + n_b // 2) // n_b))
    f = [0] + [max(1, (q ** POP[t] * (4096 - q) ** (4 - POP[t])) >> 36) for t in range(1, 16)]
    f[0] = 4096 - sum(f)
    return f


def varint(data: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = data[pos]
        pos += 1
        v |= (b & 127) << shift
        shift += 7
        if b < 128:
            return v, pos


def layout(data: bytes) -> dict:
    """A block's header and where its sections lie, read as docs/FORMAT.md lays them out (A = 1: no
    list; the Rice sections' bytes from ``H`` on, the first ``H`` carried by the states)."""
    flags, K, G = data[4], data[4] & 7, data[7]
    pos = 8 + K - 1 + G - 1
    ne = 0
    if not flags & ans.APART:
        ne, pos = varint(data, pos)
    out = {"flags": flags, "K": K, "G": G, "ne": ne, "buckets": [], "groups": [], "X": 0}
    assert flags & ans.EXC_CODED or not ne
    if ne:
        out["order"] = data[pos]
        out["X"], pos = varint(data, pos + 1)
        out["list_at"] = pos
        if not flags & ans.CARRIED:
            pos += out["X"]
    for _ in range(K):
        n_b, pos = varint(data, pos)
        c_b, pos = varint(data, pos)
        nib, R = False, 0
        if c_b and flags & ans.NIBBLES and data[pos] == 62:
            nib, pos = True, pos + 1
        elif c_b:
            R, pos = varint(data, pos + 1)
        out["buckets"].append((n_b, c_b, nib, R))
    out["P"] = 0
    if flags & ans.NIBBLES:
        out["P"], pos = varint(data, pos)
    for _ in range(G):
        m, pos = varint(data, pos)
        freq, E, A = [], 0, 0
        if m:
            s = data[pos] & 31
            pos += 1
            for _ in range(s):
                f, pos = varint(data, pos)
                freq.append(f)
            E, pos = varint(data, pos)
            A, pos = varint(data, pos)
        out["groups"].append((m, freq + [0] * (16 - len(freq)), E, A))
    out["header_end"] = pos
    R = sum(R for *_, R in out["buckets"])
    out["H"] = min(R, 2 * sum(states_of(out))) if flags & ans.APART and flags & ans.CARRIED else 0
    pos += R - out["H"]
    out["nibble_at"] = pos
    pos += out["P"]
    out["group_at"] = []
    for m, _, E, A in out["groups"]:
        out["group_at"].append(pos + E)
        pos += E + A
    out["tail_at"] = pos
    return out


def spec_decode(data: bytes, at: int, length: int, S: int, runs: list[tuple[int, list[int]]]):
    """A rANS section read as the format says: ``runs`` of (symbols, frequencies); symbol j with state
    j mod S. Returns the symbols and each state's end less 2^16, or None if the words do not end
    exactly with the symbols or a state ends at 2^17 or over."""
    xs = [int.from_bytes(data[at + 4 * q : at + 4 * q + 4], "little") for q in range(S)]
    words = [int.from_bytes(data[p : p + 2], "little") for p in range(at + 4 * S, at + length, 2)]
    w, j, syms = 0, 0, []
    for count, freq in runs:
        start = np.concatenate([[0], np.cumsum(freq)])
        for _ in range(count):
            x = xs[j % S]
            slot = x & 4095
            t = int(np.searchsorted(start, slot, side="right") - 1)
            x = freq[t] * (x >> 12) + slot - int(start[t])
            if x < 1 << 16:
                if w >= len(words):
                    return None
                x = (x << 16) | words[w]
                w += 1
            xs[j % S] = x
            syms.append(t)
            j += 1
    if w != len(words) or any(x >= 1 << 17 for x in xs):
        return None
    return syms, [x - (1 << 16) for x in xs]


def spec_section(syms: list[int], runs: list[tuple[int, list[int]]], S: int, carry: list[int]) -> bytes:
    """The section a plain-Python coder writes (the reverse of :func:`spec_decode`), each state
    starting at 2^16 plus what it carries."""
    freqs = [f for count, f in runs for _ in range(count)]
    xs, words = [(1 << 16) + c for c in carry], []
    for j in range(len(syms) - 1, -1, -1):
        s, freq = syms[j], freqs[j]
        start = int(sum(freq[:s]))
        x, f = xs[j % S], freq[s]
        if x >= f << 20:
            words.append(x & 0xFFFF)
            x >>= 16
        xs[j % S] = (x // f) * 4096 + x % f + start
    return b"".join(x.to_bytes(4, "little") for x in xs) + b"".join(w.to_bytes(2, "little") for w in reversed(words))


def nibble_runs(lay: dict) -> tuple[int, list[tuple[int, list[int]]]]:
    runs = [(32 * -(-n_b // 128), spec_freq(c_b, n_b)) for n_b, c_b, nib, _ in lay["buckets"] if nib]
    total = sum(count for count, _ in runs)
    wide = lay["flags"] & ans.WIDE and total >= ans.WIDE_MIN
    return (32 if wide else 4), runs


def states_of(lay: dict) -> list[int]:
    """Each rANS section's state count, in the order their states carry the exception list."""
    S = [nibble_runs(lay)[0]] if lay["flags"] & ans.NIBBLES else []
    wide = lay["flags"] & ans.WIDE
    return S + [32 if wide and m >= ans.WIDE_MIN else 4 for m, *_ in lay["groups"] if m]


def spec_read(data: bytes, n: int) -> tuple[list[np.ndarray], list[int]]:
    """The nibble-coded buckets' bitmaps (bool, over their ranks; None for the others) and the
    exception list's bytes, read from the format's text alone."""
    lay = layout(data)
    S, runs = nibble_runs(lay)
    carried: list[int] = []
    maps: list = [None] * lay["K"]
    if lay["flags"] & ans.NIBBLES:
        got = spec_decode(data, lay["nibble_at"], lay["P"], S, runs)
        assert got is not None
        syms, ends = got
        carried += ends
        at = 0
        for b, (n_b, c_b, nib, _) in enumerate(lay["buckets"]):
            if not nib:
                continue
            count = 32 * -(-n_b // 128)
            bits = np.array([(syms[at + t // 4] >> (t % 4)) & 1 for t in range(4 * count)], bool)
            assert not bits[n_b:].any() and bits.sum() == min(c_b, n_b - c_b)
            maps[b] = ~bits[:n_b] if 2 * c_b > n_b else bits[:n_b]
            at += count
    wide = lay["flags"] & ans.WIDE
    for (m, freq, _, A), at in zip(lay["groups"], lay["group_at"]):
        if m:
            got = spec_decode(data, at, A, 32 if wide and m >= ans.WIDE_MIN else 4, [(m, freq)])
            assert got is not None
            carried += got[1]
    X = lay["X"]
    if not lay["flags"] & ans.CARRIED:
        assert not any(carried)
        return maps, list(data[lay.get("list_at", 0) : lay.get("list_at", 0) + X])
    held = min(X, 2 * len(carried))
    raw = b"".join(c.to_bytes(2, "little") for c in carried)
    assert not any(raw[held:])  # past what they carry, states end at 2^16
    assert lay["tail_at"] + X - held == len(data)
    return maps, list(raw[:held]) + list(data[lay["tail_at"] :])


def exceptions(list_bytes: list[int], ne: int, order: int, tags: int) -> list[int]:
    """The exception positions of a coded list (Exp-Golomb gaps, each followed by ``tags`` bits)."""
    bits = [(b >> i) & 1 for b in list_bytes for i in range(8)]
    p, at, out = -1, 0, []
    for _ in range(ne):
        m = 0
        while bits[at]:
            m, at = m + 1, at + 1
        at += 1
        x = (1 << m) | sum(bits[at + i] << i for i in range(m))
        at += m
        v = ((x - 1) << order) | sum(bits[at + i] << i for i in range(order))
        at += order + tags
        p += v + 1
        out.append(p)
    assert not any(bits[at:])
    return out


def step(n: int, density: float, seed: int, far: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """BF16-like weights and a step: ``density`` of them move by a unit or two, some far (escapes,
    exceptions)."""
    rng = np.random.default_rng(seed)
    old = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    moved = rng.random(n) < density
    units = rng.choice(
        np.array([1, -1, 2, -2, 300], np.int64), moved.sum(), p=[0.45, 0.45, 0.05 - far / 2, 0.05 - far / 2, far]
    )
    new[moved] = (old[moved].astype(np.int64) + units).astype(np.uint16)
    return old, new


def check_both_ways(old: np.ndarray, new: np.ndarray, data: bytes) -> None:
    for kind in simd.KINDS:
        out, back = np.empty_like(old), np.empty_like(old)
        ans.decode_block("BF16", memoryview(data), old, out, "test", native=kind)
        ans.decode_block_backward("BF16", memoryview(data), new, back, "test", native=kind)
        assert np.array_equal(out, new) and np.array_equal(back, old), kind
    assert np.array_equal(ans.decode_reference("BF16", data, old), new)


@pytest.mark.parametrize("d", [1, 2, 3, 7, 100, 1000, 4095, 5000, 50_000, 100_000])
@pytest.mark.parametrize("n_b", [2, 100, 1000, 100_000, 1 << 31])
def test_a_runs_table_is_the_formats(d, n_b):
    d = min(d, n_b // 2)
    for c_b in (d, n_b - d):  # a run of more than half changed codes its unchanged flags
        freq = np.zeros(16, np.int64)
        nibbles.nibble_freq(min(c_b, n_b - c_b), n_b, freq)
        want = spec_freq(c_b, n_b)
        assert freq.tolist() == want and sum(want) == 4096 and min(want) >= 1 and want[0] >= 241


@pytest.mark.parametrize(
    "n, density, seed",
    [(100_000, 0.2, 1), (5_000, 0.3, 2), (1 << 18, 0.15, 3), (777, 0.7, 4), (130, 0.6, 5), (70_001, 0.6, 6)],
)
def test_blocks_read_as_the_format_says_and_round_trip(n, density, seed):
    """Every kind writes the same bytes; a reader written from docs/FORMAT.md finds the bitmaps the
    package parses and the exception list it decodes; the block decodes both ways."""
    old, new = step(n, density, seed)
    blocks = [ans.encode_block("BF16", old, new, native=kind)[0] for kind in simd.KINDS]
    assert all(b == blocks[0] for b in blocks)
    data = blocks[0]
    lay = layout(data)
    maps, list_bytes = spec_read(data, n)
    p = ans.Parsed("BF16", memoryview(data), n, old.dtype, "test")
    for b, bits in enumerate(maps):
        if bits is not None:
            words = p.words[p.wbase[b] : p.wbase[b + 1]].view(np.uint8)
            assert np.array_equal(np.unpackbits(words, bitorder="little")[: bits.size].astype(bool), bits)
    if lay["ne"]:
        tags = 0 if lay["order"] & ans.EXC_DERIVED else 4
        assert exceptions(list_bytes, lay["ne"], lay["order"] & 31, tags) == p.exc.tolist()
    check_both_ways(old, new, data)


def test_dense_steps_use_nibbles_and_carry_the_exceptions_sparse_ones_rice():
    old, new = step(1 << 18, 0.15, 7)
    new[::37] ^= np.uint16(0x80)  # an exponent's lowest bit: across thresholds, a long exception list
    data = ans.encode_block("BF16", old, new)[0]
    lay = layout(data)
    assert data[4] & ans.NIBBLES and data[4] & ans.CARRIED and data[4] & ans.WIDE
    assert all(nib for n_b, c_b, nib, _ in lay["buckets"] if c_b)
    assert nibble_runs(lay)[0] == 32  # its nibble section is wide
    assert lay["X"] > 2 * sum(states_of(lay))  # every state carries 2 bytes, the rest at the end
    sparse = ans.encode_block("BF16", old, np.where(np.arange(old.size) % 50 == 0, new, old))[0]
    assert not sparse[4] & ans.NIBBLES and not any(nib for *_, nib, _ in layout(sparse)["buckets"])
    rice = ans.encode_block("BF16", old, new, nibbles=False)[0]
    assert not rice[4] & ans.NIBBLES and len(rice) > len(data)
    check_both_ways(old, new, rice)


def test_a_short_exception_list_is_carried_whole():
    """Fewer bytes than 2 a state: the states past them end at 2^16, an odd last byte's partner is
    0, and nothing follows the last section."""
    old, new = step(20_000, 0.2, 8, far=0.0)
    new[[10, 11, 5000]] ^= np.uint16(0x80)  # across an exponent: exceptions
    data = ans.encode_block("BF16", old, new)[0]
    lay = layout(data)
    assert 0 < lay["X"] < 2 * sum(states_of(lay)) and lay["tail_at"] == len(data)
    spec_read(data, old.size)
    check_both_ways(old, new, data)


def _forge(data: bytes, syms: list[int] | None = None, carry: list[int] | None = None) -> bytes:
    """``data`` with its nibble section coded again by the plain-Python coder: of ``syms`` (or the
    section's own symbols), its states carrying ``carry`` (or their own)."""
    lay = layout(data)
    S, runs = nibble_runs(lay)
    own, ends = spec_decode(data, lay["nibble_at"], lay["P"], S, runs)
    section = spec_section(own if syms is None else syms, runs, S, ends if carry is None else carry)
    head = bytearray(data[: lay["header_end"]])
    # the header's P: varint after the bucket entries; rebuilt by walking to it
    pos = 8 + lay["K"] - 1 + lay["G"] - 1
    _, pos = varint(head, pos)
    if lay["ne"]:
        _, pos = varint(head, pos + 1)
        if not lay["flags"] & ans.CARRIED:
            pos += lay["X"]
    for _ in range(lay["K"]):
        _, pos = varint(head, pos)
        c, pos = varint(head, pos)
        if c:
            pos = pos + 1 if head[pos] == 62 else varint(head, pos + 1)[1]
    _, end = varint(head, pos)
    size = bytearray()
    v = len(section)
    while True:
        size.append((v & 127) | (128 if v > 127 else 0))
        v >>= 7
        if not v:
            break
    head[pos:end] = size
    return bytes(head) + data[lay["header_end"] : lay["nibble_at"]] + section + data[lay["nibble_at"] + lay["P"] :]


def _refused(data: bytes, old: np.ndarray, check: int | None = None) -> None:
    for kind in simd.KINDS:
        with pytest.raises(FormatError, match=f"check {check}" if check else "check"):
            ans.decode_block("BF16", memoryview(data), old, np.empty_like(old), "test", native=kind)


@pytest.mark.parametrize("n, density", [(20_000, 0.2), (1 << 18, 0.15)])  # 4 states, then 32
def test_forged_nibble_sections(n, density):
    """The plain-Python coder writes the package's section byte for byte; a run with a bit set past
    its bucket's end, or one bit more or less, is refused (12); a bit moved decodes to other bytes
    (for the checksums to catch) or is refused; a carried byte changed moves an exception."""
    old, new = step(n, density, 9)
    data = ans.encode_block("BF16", old, new)[0]
    assert _forge(data) == data
    lay = layout(data)
    S, runs = nibble_runs(lay)
    syms, _ = spec_decode(data, lay["nibble_at"], lay["P"], S, runs)
    b0 = next(b for b, (_, c, nib, _) in enumerate(lay["buckets"]) if nib)
    n_b = lay["buckets"][b0][0]
    first = sum(32 * -(-nb // 128) for nb, _, nib, _ in lay["buckets"][:b0] if nib)
    last = first + 32 * -(-n_b // 128) - 1
    past = list(syms)
    past[last] |= 8  # bit 4 * last + 3: at or past n_b (the run is padded to 128 bits, n_b is not)
    if 4 * last + 3 >= n_b:
        _refused(_forge(data, past), old, 12)
    for at, flip in ((first, 1), (first + 5, 4)):
        more = list(syms)
        more[at] ^= flip  # a bit more or less
        _refused(_forge(data, more), old, 12)
    moved = list(syms)
    t = next(j for j in range(first, last) if moved[j] & 1 and not moved[j] & 2)
    moved[t] ^= 3  # the same count, one rank later
    try:
        out = np.empty_like(old)
        ans.decode_block("BF16", memoryview(_forge(data, moved)), old, out, "test")
        assert not np.array_equal(out, new)
    except FormatError:
        pass
    if lay["ne"] and lay["flags"] & ans.CARRIED:
        got = spec_decode(data, lay["nibble_at"], lay["P"], S, runs)[1]
        got[0] ^= 1  # the list's first byte
        want = ans.Parsed("BF16", memoryview(data), old.size, old.dtype, "test").exc.tolist()
        try:
            assert (
                ans.Parsed("BF16", memoryview(_forge(data, carry=got)), old.size, old.dtype, "t").exc.tolist() != want
            )
        except FormatError:
            pass


def test_flags_and_codes_are_read_strictly():
    """The nibble code without N, N without a nibble-coded bucket, C without a coded list, a state
    that carries a byte in a block without C, and a carried byte past the list: each refused."""
    old, new = step(20_000, 0.2, 10)
    data = ans.encode_block("BF16", old, new)[0]
    lay = layout(data)
    assert data[4] & ans.NIBBLES and data[4] & ans.CARRIED and lay["ne"]
    bad = bytearray(data)
    bad[4] ^= ans.NIBBLES
    _refused(bytes(bad), old)  # the byte 62 read as a Rice parameter of 31
    rice = ans.encode_block("BF16", old, new, nibbles=False)[0]
    bad = bytearray(rice)
    bad[4] |= ans.NIBBLES
    _refused(bytes(bad), old)
    bad = bytearray(rice)
    bad[4] ^= ans.CARRIED  # the states' carried bytes where none may be, the list's length wrong
    _refused(bytes(bad), old)
    plain = ans.encode_block("BF16", old, np.where(np.arange(old.size) % 97 == 0, old + np.uint16(1), old))[0]
    assert not plain[4] & ans.EXC_CODED
    bad = bytearray(plain)
    bad[4] |= ans.CARRIED
    _refused(bytes(bad), old, 2)
    for n, density, seed, far in ((20_000, 0.2, 8, 0.0), (1 << 18, 0.15, 7, 0.02)):  # lists of 2 and 3 bytes
        old, new = step(n, density, seed, far)
        short = ans.encode_block("BF16", old, new)[0]
        lay = layout(short)
        S, runs = nibble_runs(lay)
        assert short[4] & ans.CARRIED and 0 < lay["X"] <= 2 * (S - 1), lay
        ends = spec_decode(short, lay["nibble_at"], lay["P"], S, runs)[1]
        assert ends[-1] == 0
        ends[-1] = 1  # a state past the list's bytes made to carry one
        _refused(_forge(short, carry=ends), old, 13)
        if lay["X"] % 2:  # the partner of the list's odd last byte made other than 0
            ends[-1] = 0
            ends[lay["X"] // 2] |= 1 << 8
            _refused(_forge(short, carry=ends), old, 13)


def test_old_readers_flags_are_spent():
    """The bits N and C take were 0 in every earlier block: the golden payloads of the earlier
    layouts keep decoding, and with either bit set are refused rather than read otherwise."""
    import json
    from pathlib import Path

    import zstandard

    golden = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "ans"
    spec = json.loads((golden / "expected.json").read_text())
    base = zstandard.ZstdDecompressor().decompress((golden.parent / spec["base"]).read_bytes())
    old = np.frombuffer(base, np.uint16)[:32768]
    payload = (golden / "payload2.bin").read_bytes()
    length = int(np.frombuffer(payload, "<u8", 1, 28)[0])
    block = bytearray(payload[44 : 44 + length])
    assert not block[4] & (ans.NIBBLES | ans.CARRIED)
    ans.decode_block("BF16", memoryview(bytes(block)), old, np.empty_like(old), "golden")
    for bit in (ans.NIBBLES, ans.CARRIED):
        bad = bytearray(block)
        bad[4] |= bit
        _refused(bytes(bad), old)


@pytest.mark.parametrize(
    "per, every, nibbles, wide",
    [(32768, 10, True, True), (32768 - 128, 10, False, False), (32768 - 128, 6, True, False)],
)
def test_a_narrow_section_takes_buckets_from_1_in_8(per, every, nibbles, wide):
    """Four buckets of ``per`` elements, one in ``every`` changed: at 1 in 10 they are nibbles when
    their runs make 2^15 nibbles (a wide section) and Rice-coded when 32 fewer would make it narrow;
    at 1 in 6, nibbles in a narrow section too (weightsync.codec.nibbles.NARROW_DENSITY)."""
    rng = np.random.default_rng(every)
    e = np.repeat(np.arange(120, 124), per)  # one exponent a bucket
    rng.shuffle(e)
    old = ((e << 7) | rng.integers(0, 126, e.size)).astype(np.uint16)  # +1 never reaches the exponent
    new = old.copy()
    new[::every] += np.uint16(1)
    data = ans.encode_block("BF16", old, new, split=([121, 122, 123], [121, 122, 123]))[0]
    lay = layout(data)
    assert [nib for *_, nib, _ in lay["buckets"]] == [nibbles] * 4
    assert bool(data[4] & ans.NIBBLES) == nibbles and bool(data[4] & ans.WIDE) == wide
    if nibbles:
        assert nibble_runs(lay)[0] == (32 if wide else 4)
    check_both_ways(old, new, data)
