"""Pull planning on hand-built manifests: which bytes rebuild each segment, and at what cost."""

from __future__ import annotations

import pytest
import xxhash

from weightsync.errors import FormatError, LazyChunksError
from weightsync.format.manifest import (
    ChunkRef,
    Delta,
    FileEntry,
    Manifest,
    Payload,
    Piece,
    Segment,
    manifest_from_json,
    manifest_to_json,
)
from weightsync.sync.plan import ChunkNeed, merge_ranges, plan_pull, plan_segment


def hx(tag: str) -> str:
    return xxhash.xxh3_128_hexdigest(tag.encode())


def manifest(
    version: int,
    parent: int | None,
    files: dict[str, list[tuple]],
    keyframe: bool | None = None,
    chain_length: int = 0,
    validate: bool = True,
) -> Manifest:
    """A manifest from segment specs ``(name, nbytes, codec, payload_size, content[, (delta codec, size)])``.

    ``content`` names the bytes (equal content, equal checksum). Every payload gets a chunk of its
    own, holding the payload at offset 3; the optional sixth item is a keyframe segment's delta.
    """
    keyframe = parent is None if keyframe is None else keyframe
    chunks: list[ChunkRef] = []

    def payload(tag: str, size: int) -> Payload:
        chunks.append(ChunkRef(hx(f"chunk {version} {tag}"), size + 3))
        return Payload(size, hx(f"payload {version} {tag}"), (Piece(len(chunks) - 1, 3, size),))

    entries = []
    for path, specs in files.items():
        segs, pos = [], 0
        for name, nbytes, codec, psize, content, *rest in specs:
            main = None if codec == "same" else payload(f"{path} {name}", psize)
            delta = None
            if rest:
                dcodec, dsize = rest[0]
                delta = Delta(dcodec, 1, None if dcodec == "same" else payload(f"{path} {name} delta", dsize))
            segs.append(Segment("tensor", name, "U8", (nbytes,), pos, pos + nbytes, hx(content), codec, 0, main, delta))
            pos += nbytes
        entries.append(FileEntry(path, "safetensors", pos, hx(f"file {path} {[s[4] for s in specs]}"), tuple(segs)))
    m = Manifest(version, parent, keyframe, 0 if keyframe else chain_length, tuple(entries), tuple(chunks))
    if validate:
        assert manifest_from_json(manifest_to_json(m)) == m, "test manifests must be valid"
    return m


A, B = "a.safetensors", "b.safetensors"

# Chain 1, keyframe V0 then deltas V1..V3. w changes every version; s never changes; r is reshaped
# (re-encoded in full) at V2; n appears at V2; file B appears at V3.
V0 = manifest(0, None, {A: [("w", 100, "full", 50, "w0"), ("s", 40, "full", 20, "s0"), ("r", 100, "full", 40, "r0")]})
V1 = manifest(
    1, 0, {A: [("w", 100, "sparse", 5, "w1"), ("s", 40, "same", 0, "s0"), ("r", 100, "dense", 3, "r1")]}, chain_length=1
)
V2 = manifest(
    2,
    1,
    {
        A: [
            ("w", 100, "sparse", 6, "w2"),
            ("s", 40, "same", 0, "s0"),
            ("r", 50, "full", 30, "r2"),
            ("n", 10, "full", 8, "n2"),
        ]
    },
    chain_length=2,
)
V3 = manifest(
    3,
    2,
    {
        A: [
            ("w", 100, "dense", 7, "w3"),
            ("s", 40, "same", 0, "s0"),
            ("r", 50, "sparse", 4, "r3"),
            ("n", 10, "sparse", 2, "n3"),
        ],
        B: [("x", 16, "full", 9, "x3")],
    },
    chain_length=3,
)
VS = {m.version: m for m in (V0, V1, V2, V3)}

# Chain 2, keyframes carrying deltas from their parents: K0 key, K1 delta, K2 keyframe (parent K1)
# with deltas, K3 delta. u's keyframe delta is 'same'; big's keyframe delta is dearer than its full
# encoding; fresh is new at K2 (no delta).
K0 = manifest(
    10,
    None,
    {
        A: [
            ("w", 100, "full", 50, "w0"),
            ("s", 40, "full", 20, "s0"),
            ("u", 30, "full", 15, "u0"),
            ("big", 64, "full", 30, "b0"),
        ]
    },
)
K1 = manifest(
    11,
    10,
    {
        A: [
            ("w", 100, "sparse", 5, "w1"),
            ("s", 40, "same", 0, "s0"),
            ("u", 30, "sparse", 4, "u1"),
            ("big", 64, "dense", 60, "b1"),
        ]
    },
    chain_length=1,
)
K2 = manifest(
    12,
    11,
    {
        A: [
            ("w", 100, "full", 50, "w2", ("sparse", 6)),
            ("s", 40, "full", 20, "s0", ("same", 0)),
            ("u", 30, "full", 15, "u1", ("same", 0)),
            ("big", 64, "full", 30, "b2", ("dense", 80)),
            ("fresh", 8, "full", 7, "f2"),
        ]
    },
    keyframe=True,
)
K3 = manifest(
    13,
    12,
    {
        A: [
            ("w", 100, "sparse", 7, "w3"),
            ("s", 40, "same", 0, "s0"),
            ("u", 30, "sparse", 2, "u3"),
            ("big", 64, "sparse", 3, "b3"),
            ("fresh", 8, "sparse", 1, "f3"),
        ]
    },
    chain_length=1,
)
KS = {m.version: m for m in (K0, K1, K2, K3)}
ALL = {**VS, **KS}


def describe(plan) -> dict[tuple[str, str], tuple]:
    """(path, name) -> (how, ((version, codec, size), ...)); how is copy, local, fresh or keep."""
    out = {}
    for fp in plan.files:
        if fp.keep:
            out[(fp.entry.path, "*")] = ("keep", ())
            continue
        for r in fp.recipes:
            steps = tuple((s.version, s.codec, s.size) for s in r.steps)
            how = "fresh" if r.base is None else "local" if steps else "copy"
            out[(fp.entry.path, r.segment.name)] = (how, steps)
    return out


PLAN_CASES = {
    # chain versions, local version, expected recipes
    "fresh pull of the keyframe": (
        [0],
        None,
        {
            (A, "w"): ("fresh", ((0, "full", 50),)),
            (A, "s"): ("fresh", ((0, "full", 20),)),
            (A, "r"): ("fresh", ((0, "full", 40),)),
        },
    ),
    "fresh pull of the head": (
        [0, 1, 2, 3],
        None,
        {
            (A, "w"): ("fresh", ((0, "full", 50), (1, "sparse", 5), (2, "sparse", 6), (3, "dense", 7))),
            (A, "s"): ("fresh", ((0, "full", 20),)),  # 'same' segments cost nothing
            (A, "r"): ("fresh", ((2, "full", 30), (3, "sparse", 4))),  # shape changed: full encoding mid-chain
            (A, "n"): ("fresh", ((2, "full", 8), (3, "sparse", 2))),
            (B, "x"): ("fresh", ((3, "full", 9),)),
        },
    ),
    "local keyframe, target head": (
        [0, 1, 2, 3],
        0,
        {
            (A, "w"): ("local", ((1, "sparse", 5), (2, "sparse", 6), (3, "dense", 7))),
            (A, "s"): ("copy", ()),
            (A, "r"): ("fresh", ((2, "full", 30), (3, "sparse", 4))),  # reshaped after the local version
            (A, "n"): ("fresh", ((2, "full", 8), (3, "sparse", 2))),
            (B, "x"): ("fresh", ((3, "full", 9),)),
        },
    ),
    "local on the chain": (
        [0, 1, 2, 3],
        1,
        {
            (A, "w"): ("local", ((2, "sparse", 6), (3, "dense", 7))),
            (A, "s"): ("copy", ()),
            (A, "r"): ("fresh", ((2, "full", 30), (3, "sparse", 4))),
            (A, "n"): ("fresh", ((2, "full", 8), (3, "sparse", 2))),
            (B, "x"): ("fresh", ((3, "full", 9),)),
        },
    ),
    "local one behind": (
        [0, 1, 2, 3],
        2,
        {
            (A, "w"): ("local", ((3, "dense", 7),)),
            (A, "s"): ("copy", ()),
            (A, "r"): ("local", ((3, "sparse", 4),)),
            (A, "n"): ("local", ((3, "sparse", 2),)),
            (B, "x"): ("fresh", ((3, "full", 9),)),
        },
    ),
    "local equals target": (
        [0, 1, 2, 3],
        3,
        {
            (A, "w"): ("copy", ()),
            (A, "s"): ("copy", ()),
            (A, "r"): ("copy", ()),
            (A, "n"): ("copy", ()),
            (B, "x"): ("copy", ()),
        },
    ),
    "rollback": (
        [0, 1],
        3,
        {
            (A, "w"): ("fresh", ((0, "full", 50), (1, "sparse", 5))),
            (A, "s"): ("copy", ()),  # identical bytes in the newer local version
            (A, "r"): ("fresh", ((0, "full", 40), (1, "dense", 3))),  # other size locally
        },
    ),
    "rollback to the keyframe": (
        [0],
        2,
        {
            (A, "w"): ("fresh", ((0, "full", 50),)),
            (A, "s"): ("copy", ()),
            (A, "r"): ("fresh", ((0, "full", 40),)),
        },
    ),
    "keyframe: fresh pull": (
        [12, 13],
        None,
        {
            (A, "w"): ("fresh", ((12, "full", 50), (13, "sparse", 7))),
            (A, "s"): ("fresh", ((12, "full", 20),)),
            (A, "u"): ("fresh", ((12, "full", 15), (13, "sparse", 2))),
            (A, "big"): ("fresh", ((12, "full", 30), (13, "sparse", 3))),
            (A, "fresh"): ("fresh", ((12, "full", 7), (13, "sparse", 1))),
        },
    ),
    "keyframe: local is its parent": (
        [11, 12],
        11,
        {
            (A, "w"): ("local", ((12, "sparse", 6),)),  # the keyframe's delta, not its full payload
            (A, "s"): ("copy", ()),
            (A, "u"): ("copy", ()),
            (A, "big"): ("fresh", ((12, "full", 30),)),  # its delta (80) costs more than the full encoding
            (A, "fresh"): ("fresh", ((12, "full", 7),)),
        },
    ),
    "keyframe: local behind it, target after it": (
        [11, 12, 13],
        11,
        {
            (A, "w"): ("local", ((12, "sparse", 6), (13, "sparse", 7))),
            (A, "s"): ("copy", ()),
            (A, "u"): ("local", ((13, "sparse", 2),)),  # 'same' keyframe delta costs nothing
            (A, "big"): ("fresh", ((12, "full", 30), (13, "sparse", 3))),
            (A, "fresh"): ("fresh", ((12, "full", 7), (13, "sparse", 1))),
        },
    ),
    "keyframe: local two behind it": (
        [10, 11, 12, 13],
        10,
        {
            (A, "w"): ("local", ((11, "sparse", 5), (12, "sparse", 6), (13, "sparse", 7))),
            (A, "s"): ("copy", ()),
            (A, "u"): ("local", ((11, "sparse", 4), (13, "sparse", 2))),
            (A, "big"): ("fresh", ((12, "full", 30), (13, "sparse", 3))),
            (A, "fresh"): ("fresh", ((12, "full", 7), (13, "sparse", 1))),
        },
    ),
    "keyframe: local not on the chain": (
        [12, 13],
        11,
        {  # e.g. the store kept no path back
            (A, "w"): ("fresh", ((12, "full", 50), (13, "sparse", 7))),
            (A, "s"): ("copy", ()),
            (A, "u"): ("fresh", ((12, "full", 15), (13, "sparse", 2))),
            (A, "big"): ("fresh", ((12, "full", 30), (13, "sparse", 3))),
            (A, "fresh"): ("fresh", ((12, "full", 7), (13, "sparse", 1))),
        },
    ),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_table(case):
    versions, local, expected = PLAN_CASES[case]
    chain = [ALL[v] for v in versions]
    plan = plan_pull(chain, None if local is None else ALL[local])
    assert plan.manifest is chain[-1] and plan.local_version == local
    assert describe(plan) == expected
    for fp in plan.files:
        assert [r.segment for r in fp.recipes] == list(fp.entry.segments)
        for r in fp.recipes:
            if r.base is not None:  # reads the local file's segment with the same key
                assert r.base.key == r.segment.key
                if not r.steps:
                    assert r.base.xxh3 == r.segment.xxh3
    # every referenced range is covered by a chunk need, each chunk listed once
    needs = {n.chunk.id: n for n in plan.chunks}
    assert len(needs) == len(plan.chunks)
    used = {rng.chunk.id for fp in plan.files for r in fp.recipes for s in r.steps for rng in s.ranges}
    assert set(needs) == used
    for fp in plan.files:
        for r in fp.recipes:
            for s in r.steps:
                for rng in s.ranges:
                    assert any(
                        o <= rng.offset and rng.offset + rng.length <= o + n for o, n in needs[rng.chunk.id].ranges
                    )
    assert plan.payload_bytes == sum(sz for _, steps in expected.values() for _, _, sz in steps)
    assert plan.fetch_bytes == sum(n.fetch_bytes for n in plan.chunks)


def test_steps_point_into_their_own_versions_chunks():
    for chain in ([V0, V1, V2, V3], [K1, K2, K3]):
        plan = plan_pull(chain, None if chain[0].keyframe else chain[0])
        for fp in plan.files:
            for r in fp.recipes:
                for step in r.steps:
                    m = ALL[step.version]
                    seg = next(s for s in m.file(fp.entry.path).segments if s.key == r.segment.key)
                    enc = seg if seg.codec == step.codec else seg.delta
                    assert step.codec == enc.codec and step.xxh3 == enc.payload.xxh3 and step.size == enc.payload.size
                    assert [(g.chunk, g.offset, g.length) for g in step.ranges] == [
                        (m.chunks[p.chunk], p.offset, p.length) for p in enc.payload.parts
                    ]


def test_shared_chunk_ranges_are_merged():
    shared = ChunkRef(hx("shared"), 1000)
    layout = [(0, 5), (5, 5), (500, 5)]  # a, b adjacent; c far away in the same chunk
    segs = tuple(
        Segment(
            "tensor",
            n,
            "U8",
            (10,),
            10 * i,
            10 * i + 10,
            hx(n),
            "full",
            0,
            Payload(ln, hx("p" + n), (Piece(0, off, ln),)),
        )
        for i, (n, (off, ln)) in enumerate(zip("abc", layout))
    )
    m = Manifest(0, None, True, 0, (FileEntry(A, "safetensors", 30, hx("f"), segs),), (shared,))
    assert manifest_from_json(manifest_to_json(m)) == m
    plan = plan_pull([m], None)
    assert plan.chunks == (ChunkNeed(shared, ((0, 10), (500, 5))),) or plan.chunks == (ChunkNeed(shared, ((0, 505),)),)
    assert plan.payload_bytes == 15
    need = plan.chunks[0]
    assert need.needed_bytes <= 505 and not need.whole() and plan.fetch_bytes == need.needed_bytes


@pytest.mark.parametrize(
    "ranges,gap,expected",
    [
        ([], 0, ()),
        ([(0, 10)], 0, ((0, 10),)),
        ([(10, 5), (0, 10)], 0, ((0, 15),)),  # adjacent
        ([(0, 10), (5, 2)], 0, ((0, 10),)),  # contained
        ([(0, 10), (5, 10)], 0, ((0, 15),)),  # overlapping
        ([(0, 4), (0, 4)], 0, ((0, 4),)),  # duplicate
        ([(0, 10), (11, 5)], 0, ((0, 10), (11, 5))),
        ([(0, 10), (11, 5)], 1, ((0, 16),)),
        ([(100, 1), (0, 1), (50, 1)], 10, ((0, 1), (50, 1), (100, 1))),
        ([(100, 1), (0, 1), (50, 1)], 50, ((0, 101),)),
    ],
)
def test_merge_ranges(ranges, gap, expected):
    assert merge_ranges(ranges, gap) == expected


@pytest.mark.parametrize(
    "size,ranges,whole,fetch",
    [
        (100, ((0, 100),), True, 100),
        (100, ((0, 75),), True, 100),
        (100, ((0, 74),), False, 74),
        (100, ((0, 40), (60, 40)), True, 100),
        (100, ((10, 1),), False, 1),
    ],
)
def test_chunk_need_fetches_whole_chunks_when_mostly_needed(size, ranges, whole, fetch):
    need = ChunkNeed(ChunkRef(hx("c"), size), ranges)
    assert need.whole() is whole and need.fetch_bytes == fetch
    assert need.needed_bytes == sum(n for _, n in ranges)


def test_keep_files_are_not_rebuilt():
    plan = plan_pull([V0, V1, V2, V3], V1, keep={B})
    assert describe(plan)[(B, "*")] == ("keep", ())
    fb = next(f for f in plan.files if f.entry.path == B)
    assert fb.keep and fb.recipes == ()
    x_chunk = V3.chunks[V3.file(B).segments[0].payload.parts[0].chunk]
    assert all(n.chunk != x_chunk for n in plan.chunks)
    nothing = plan_pull([V0, V1, V2, V3], V1, keep={A, B})
    assert nothing.chunks == () and nothing.fetch_bytes == 0 and nothing.payload_bytes == 0
    assert plan_pull([V0, V1], V1, keep={"unknown"}) == plan_pull([V0, V1], V1)


def test_local_bytes_win_when_deltas_since_local_exceed_the_full_encoding():
    """Without a newer full encoding, rebuilding from the keyframe needs the same deltas and more."""
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "sparse", 500, "w1")]}, chain_length=1)
    v2 = manifest(2, 1, {A: [("w", 100, "dense", 90, "w2")]}, chain_length=2)
    assert describe(plan_pull([v0, v1, v2], v1)) == {(A, "w"): ("local", ((2, "dense", 90),))}
    assert describe(plan_pull([v0, v1, v2], v0)) == {(A, "w"): ("local", ((1, "sparse", 500), (2, "dense", 90)))}


@pytest.mark.parametrize(
    "delta_size,expected",
    [
        (29, ("local", ((1, "dense", 29),))),
        (30, ("local", ((1, "dense", 30),))),  # ties go to local bytes
        (31, ("fresh", ((1, "full", 30),))),
    ],
)
def test_keyframe_delta_versus_full_encoding(delta_size, expected):
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "full", 30, "w1", ("dense", delta_size))]}, keyframe=True)
    assert describe(plan_pull([v0, v1], v0)) == {(A, "w"): expected}
    assert describe(plan_pull([v1], None)) == {(A, "w"): ("fresh", ((1, "full", 30),))}


def test_full_encoding_after_local_is_used():
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "sparse", 1, "w1")]}, chain_length=1)
    v2 = manifest(2, 1, {A: [("w", 100, "full", 60, "w2")]}, chain_length=2)  # e.g. dtype changed and back
    v3 = manifest(3, 2, {A: [("w", 100, "sparse", 2, "w3")]}, chain_length=3)
    assert describe(plan_pull([v0, v1, v2, v3], v1)) == {(A, "w"): ("fresh", ((2, "full", 60), (3, "sparse", 2)))}


def test_plan_segment_directly():
    target = V3.file(A).segments[0]
    r = plan_segment([V0, V1, V2, V3], A, target, V2)
    assert r.segment is target and r.base == V2.file(A).segments[0] and [s.version for s in r.steps] == [3]
    assert r.fetch_bytes == 7
    assert plan_segment([V0, V1, V2, V3], A, target, None).fetch_bytes == 50 + 5 + 6 + 7


def test_copy_needs_same_path_and_size():
    """Identical checksum under another path is not reused; nor a same-named segment of another size."""
    moved = manifest(9, None, {B: [("w", 100, "full", 50, "w1")]})
    assert describe(plan_pull([V0, V1], moved))[(A, "w")] == ("fresh", ((0, "full", 50), (1, "sparse", 5)))
    other_size = manifest(9, None, {A: [("s", 41, "full", 20, "s0")]})
    assert describe(plan_pull([V0, V1], other_size))[(A, "s")] == ("fresh", ((0, "full", 20),))


# --- chain validation ------------------------------------------------------------------------------------
def test_empty_chain_is_rejected():
    with pytest.raises(FormatError):
        plan_pull([], None)


@pytest.mark.parametrize("chain,local", [([V1, V2], None), ([V1, V2], V0), ([V1, V2], V2), ([K1, K2], K0)])
def test_chain_must_start_at_a_keyframe_or_the_local_version(chain, local):
    with pytest.raises(FormatError):
        plan_pull(chain, local)


def test_chain_may_start_at_the_local_version():
    assert describe(plan_pull([V1, V2], V1))[(A, "w")] == ("local", ((2, "sparse", 6),))


@pytest.mark.parametrize(
    "chain",
    [[V0, V2], [V0, V1, V3], [V0, V0], [V0, V2, V1], [K0, K2], [V0, V1, K2]],
    ids=["skip", "skip-late", "repeat", "reorder", "skip-to-keyframe", "other-lineage"],
)
def test_broken_parent_links_are_rejected(chain):
    with pytest.raises(FormatError):
        plan_pull(chain, None)


def test_delta_without_base_is_rejected():
    v1 = manifest(
        1,
        0,
        {
            A: [
                ("w", 100, "sparse", 5, "w1"),
                ("s", 40, "same", 0, "s0"),
                ("r", 100, "sparse", 3, "r1"),
                ("ghost", 8, "sparse", 2, "g1"),
            ]
        },
        chain_length=1,
    )
    with pytest.raises(FormatError, match="without a base"):
        plan_pull([V0, v1], None)


def test_same_without_base_is_rejected():
    v1 = manifest(1, 0, {A: [("w", 100, "same", 0, "w0")], B: [("x", 8, "same", 0, "x0")]}, chain_length=1)
    with pytest.raises(FormatError):
        plan_pull([V0, v1], None)


def test_delta_on_a_base_of_another_size_is_rejected():
    v1 = manifest(1, 0, {A: [("w", 50, "sparse", 5, "w1")]}, chain_length=1)
    with pytest.raises(FormatError):
        plan_pull([V0, v1], None)


def test_delta_without_base_after_the_local_version_is_rejected():
    v2 = manifest(2, 1, {A: [("ghost", 8, "dense", 2, "g2")]}, chain_length=2)
    with pytest.raises(FormatError):
        plan_pull([V1, v2], V1)


def test_chain_without_any_full_encoding_is_rejected():
    """A keyframe object that (wrongly) holds a delta: the walk reaches the start without a full encoding."""
    bad = manifest(0, None, {A: [("w", 100, "sparse", 5, "w0")]}, keyframe=False, validate=False)
    bad = Manifest(0, None, True, 0, bad.files, bad.chunks)
    with pytest.raises(FormatError, match="no full encoding"):
        plan_pull([bad], None)


# --- chunks the store notes as not copied yet (docs/FORMAT.md section 1, lazy chunks) ---------------
def full_chunk(m: Manifest, name: str) -> str:
    """The chunk of ``name``'s full payload in ``m``."""
    seg = next(s for f in m.files for s in f.segments if s.name == name)
    return m.chunks[seg.payload.parts[0].chunk].id


@pytest.mark.parametrize("delta_size", [29, 31, 500])
def test_a_follower_reads_the_keyframe_delta_when_its_full_encoding_is_noted(delta_size):
    """Even where the full encoding is cheaper (31, 500), a noted one is never read."""
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "full", 30, "w1", ("dense", delta_size))]}, keyframe=True)
    plan = plan_pull([v0, v1], v0, avoid=frozenset({full_chunk(v1, "w")}))
    assert describe(plan) == {(A, "w"): ("local", ((1, "dense", delta_size),))}


def test_a_fresh_plan_walks_past_a_noted_full_encoding_to_an_older_keyframe():
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0"), ("s", 40, "full", 20, "s0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "sparse", 3, "w1"), ("s", 40, "same", 0, "s0")]}, chain_length=1)
    v2 = manifest(
        2, 1, {A: [("w", 100, "full", 30, "w2", ("dense", 9)), ("s", 40, "full", 20, "s0", ("same", 0))]}, keyframe=True
    )
    v3 = manifest(3, 2, {A: [("w", 100, "sparse", 4, "w3"), ("s", 40, "same", 0, "s0")]}, chain_length=1)
    noted = frozenset({full_chunk(v2, "w"), full_chunk(v2, "s")})
    assert describe(plan_pull([v0, v1, v2, v3], None, avoid=noted)) == {
        (A, "w"): ("fresh", ((0, "full", 10), (1, "sparse", 3), (2, "dense", 9), (3, "sparse", 4))),
        (A, "s"): ("fresh", ((0, "full", 20),)),
    }
    # not noted: the keyframe's own full encoding, as before
    assert describe(plan_pull([v0, v1, v2, v3], None))[(A, "w")] == ("fresh", ((2, "full", 30), (3, "sparse", 4)))
    # a chain that starts at the noted keyframe: nothing else serves
    with pytest.raises(LazyChunksError) as err:
        plan_pull([v2, v3], None, avoid=noted)
    assert err.value.version == 3 and err.value.chunks and err.value.chunks <= noted
    # unless the noted chunks may be read elsewhere
    assert describe(plan_pull([v2, v3], None, avoid=noted, use_avoided=True))[(A, "w")] == (
        "fresh",
        ((2, "full", 30), (3, "sparse", 4)),
    )


def test_a_tensor_new_at_a_noted_keyframe_has_no_recipe_without_its_chunk():
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "full", 30, "w1", ("dense", 9)), ("n", 8, "full", 7, "n1")]}, keyframe=True)
    noted = frozenset({full_chunk(v1, "w"), full_chunk(v1, "n")})
    with pytest.raises(LazyChunksError) as err:
        plan_pull([v0, v1], v0, avoid=noted)
    assert err.value.chunks == {full_chunk(v1, "n")}
    plan = plan_pull([v0, v1], v0, avoid=noted, use_avoided=True)
    assert describe(plan) == {(A, "w"): ("local", ((1, "dense", 9),)), (A, "n"): ("fresh", ((1, "full", 7),))}


def test_a_noted_delta_is_avoided_too():
    """The rule is about chunks, not codecs: a plan reading no noted chunk wins whatever it reads."""
    v0 = manifest(0, None, {A: [("w", 100, "full", 10, "w0")]})
    v1 = manifest(1, 0, {A: [("w", 100, "full", 30, "w1", ("dense", 9))]}, keyframe=True)
    delta_chunk = v1.chunks[v1.files[0].segments[0].delta.payload.parts[0].chunk].id
    assert describe(plan_pull([v0, v1], v0, avoid=frozenset({delta_chunk}))) == {
        (A, "w"): ("fresh", ((1, "full", 30),))
    }
