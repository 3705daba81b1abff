"""Chunk packing: bounded chunks, exact reassembly, no needless splits, deterministic ids."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.errors import UsageError
from weightsync.format.chunking import ChunkPacker, chunk_id
from weightsync.format.manifest import ChunkRef, Piece


def payload(i: int, size: int) -> bytes:
    """Distinct, recognisable bytes for payload ``i``."""
    return bytes((i * 31 + k) % 251 for k in range(size))


def pack(sizes: list[int], chunk_bytes: int):
    """Pack payloads of ``sizes``; returns (payloads, parts per payload, sealed chunks in order, packer)."""
    packer = ChunkPacker(chunk_bytes)
    payloads = [payload(i, n) for i, n in enumerate(sizes)]
    parts, sealed = [], []
    for p in payloads:
        ps, new = packer.add(p)
        parts.append(ps)
        sealed.extend(new)
    sealed.extend(packer.finish())
    return payloads, parts, sealed, packer


def check_packing(sizes: list[int], chunk_bytes: int):
    payloads, parts, sealed, packer = pack(sizes, chunk_bytes)
    # chunks are sealed in index order, each once, and match the refs
    assert [c.index for c in sealed] == list(range(len(sealed)))
    assert packer.refs == [ChunkRef(c.id, len(c.data)) for c in sealed]
    for c in sealed:
        assert 0 < len(c.data) <= chunk_bytes
        assert c.id == chunk_id(c.data) == xxhash.xxh3_128_hexdigest(c.data)
    # every payload reassembles exactly from its parts
    for p, ps in zip(payloads, parts):
        assert all(isinstance(x, Piece) and x.length > 0 for x in ps)
        assert b"".join(sealed[x.chunk].data[x.offset : x.offset + x.length] for x in ps) == p
        if len(p) == 0:
            assert ps == ()
        elif len(p) <= chunk_bytes:
            assert len(ps) == 1, "a payload that fits in a fresh chunk is never split"
        else:
            assert len(ps) <= -(-len(p) // chunk_bytes) + 1
    # chunks hold nothing but payload bytes, in order
    assert b"".join(c.data for c in sealed) == b"".join(payloads)
    # parts are consecutive within the chunk stream
    flat = [x for ps in parts for x in ps]
    for a, b in zip(flat, flat[1:]):
        assert (b.chunk, b.offset) in ((a.chunk, a.offset + a.length), (a.chunk + 1, 0))
    return payloads, parts, sealed


CASES = [
    ([], 16),
    ([0], 16),
    ([0, 0, 0], 16),
    ([1], 16),
    ([16], 16),
    ([17], 16),
    ([15, 1], 16),  # exactly fills one chunk
    ([15, 2], 16),  # second starts a fresh chunk rather than splitting
    ([8, 8, 8], 16),
    ([10, 10, 10], 16),
    ([5, 40, 5], 16),  # large payload fills the open chunk first, then whole chunks
    ([16, 16, 16], 16),
    ([33], 16),
    ([48], 16),
    ([1, 0, 15, 0, 16, 0], 16),
    ([3] * 20, 16),
    ([100, 1, 100], 7),
    ([1] * 5, 1),
    ([4, 1, 4], 1),
    ([1000, 3000, 5000, 12], 4096),
]


@pytest.mark.parametrize("sizes,chunk_bytes", CASES, ids=[f"{s}/{c}" for s, c in CASES])
def test_packing_table(sizes, chunk_bytes):
    check_packing(sizes, chunk_bytes)


@pytest.mark.parametrize(
    "sizes,chunk_bytes,chunks",
    [
        ([], 16, 0),
        ([0], 16, 0),
        ([16], 16, 1),
        ([17], 16, 2),
        ([15, 1], 16, 1),
        ([15, 2], 16, 2),
        ([8, 8, 8], 16, 2),
        ([10, 10, 10], 16, 3),
        ([5, 40, 5], 16, 4),
        ([33], 16, 3),
        ([3] * 20, 16, 4),
    ],
)
def test_chunk_counts(sizes, chunk_bytes, chunks):
    _, _, sealed, _ = pack(sizes, chunk_bytes)
    assert len(sealed) == chunks


def test_small_payload_starts_a_fresh_chunk():
    packer = ChunkPacker(16)
    assert packer.add(b"a" * 10) == ((Piece(0, 0, 10),), [])
    parts, sealed = packer.add(b"b" * 10)
    assert parts == (Piece(1, 0, 10),)
    assert [s.data for s in sealed] == [b"a" * 10]
    assert [s.data for s in packer.finish()] == [b"b" * 10]


def test_large_payload_tops_up_the_open_chunk():
    packer = ChunkPacker(16)
    packer.add(b"a" * 10)
    parts, sealed = packer.add(b"b" * 30)
    assert parts == (Piece(0, 10, 6), Piece(1, 0, 16), Piece(2, 0, 8))
    assert [s.data for s in sealed] == [b"a" * 10 + b"b" * 6, b"b" * 16]


def test_chunks_are_sealed_as_soon_as_they_fill():
    packer = ChunkPacker(8)
    parts, sealed = packer.add(b"x" * 8)
    assert parts == (Piece(0, 0, 8),) and [s.index for s in sealed] == [0]
    assert packer.finish() == []


def test_finish_twice_and_empty_packer():
    packer = ChunkPacker(8)
    assert packer.finish() == [] and packer.refs == []
    packer.add(b"abc")
    assert [s.data for s in packer.finish()] == [b"abc"]
    assert packer.finish() == []


def test_accepts_memoryview_and_copies_it():
    packer = ChunkPacker(8)
    buf = bytearray(b"abcdef")
    packer.add(memoryview(buf))
    buf[:] = b"XXXXXX"  # the caller may reuse its buffer
    assert packer.finish()[0].data == b"abcdef"


def test_ids_are_deterministic_and_content_addressed():
    sizes = [100, 3, 4000, 17, 0, 9000]
    a = pack(sizes, 4096)
    b = pack(sizes, 4096)
    assert [c.id for c in a[2]] == [c.id for c in b[2]] and a[1] == b[1]
    other = pack([100, 3, 4000, 18, 0, 9000], 4096)
    assert [c.id for c in other[2]] != [c.id for c in a[2]]


@pytest.mark.parametrize("size", [0, -1])
def test_chunk_size_must_be_positive(size):
    with pytest.raises(UsageError):
        ChunkPacker(size)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 80), max_size=25), st.integers(1, 40))
def test_packing_properties(sizes, chunk_bytes):
    check_packing(sizes, chunk_bytes)


# --- packers sharing one chunk index space (a keyframe's full payloads apart from its deltas) -----
def test_shared_refs_keep_payload_kinds_in_separate_chunks():
    main = ChunkPacker(16)
    side = ChunkPacker(16, main.refs)
    assert side.refs is main.refs
    sealed = []
    p1, s = main.add(b"A" * 10)
    sealed += s
    d1, s = side.add(b"d" * 4)
    sealed += s
    p2, s = main.add(b"B" * 4)  # joins A's chunk, not the delta chunk opened after it
    sealed += s
    d2, s = side.add(b"e" * 20)
    sealed += s
    sealed += main.finish() + side.finish()
    assert p1 == (Piece(0, 0, 10),) and d1 == (Piece(1, 0, 4),) and p2 == (Piece(0, 10, 4),)
    assert d2 == (Piece(1, 4, 12), Piece(2, 0, 8))
    assert None not in main.refs and len(main.refs) == 3
    by_index = {c.index: c for c in sealed}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[0].data == b"A" * 10 + b"B" * 4
    assert by_index[1].data == b"d" * 4 + b"e" * 12 and by_index[2].data == b"e" * 8
    for i, ref in enumerate(main.refs):
        assert ref == ChunkRef(by_index[i].id, len(by_index[i].data))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=30), st.integers(1, 32))
def test_shared_refs_properties(ops, chunk_bytes):
    packers = [ChunkPacker(chunk_bytes)]
    packers.append(ChunkPacker(chunk_bytes, packers[0].refs))
    sealed, placed = [], []
    for i, (which, size) in enumerate(ops):
        data = payload(i, size)
        parts, new = packers[which].add(data)
        sealed += new
        placed.append((which, data, parts))
    sealed += packers[0].finish() + packers[1].finish()
    refs = packers[0].refs
    chunks = {c.index: c for c in sealed}
    assert sorted(chunks) == list(range(len(refs))) and None not in refs
    owner = {}
    for which, data, parts in placed:
        assert b"".join(chunks[p.chunk].data[p.offset : p.offset + p.length] for p in parts) == data
        for p in parts:
            assert owner.setdefault(p.chunk, which) == which, "a chunk holds payloads of one packer only"
    for i, ref in enumerate(refs):
        assert ref == ChunkRef(chunks[i].id, len(chunks[i].data)) and 0 < ref.size <= chunk_bytes
