"""Parts of a multi-rank publish (pure): part JSON and keys, the owner rule, validation and merge."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace

import pytest

from weightsync.errors import FormatError, UsageError, VersionError
from weightsync.format.keys import parse_part_key, part_key, parts_prefix
from weightsync.format.manifest import (
    ChunkRef,
    Delta,
    FileEntry,
    Manifest,
    PartManifest,
    Payload,
    Piece,
    Segment,
    manifest_checksum,
    manifest_from_json,
    manifest_to_json,
    part_from_json,
    part_to_json,
)
from weightsync.sync.parts import assign_files, merge_parts, rank_poll, same_part

H = [f"{i:032x}" for i in range(1, 200)]


def blob(path: str, size: int, chunk: int, offset: int = 0, codec: str = "full", xxh3: str = H[0]) -> FileEntry:
    payload = None if codec == "same" else Payload(size, H[100 + size % 50], (Piece(chunk, offset, size),))
    return FileEntry(path, "blob", size, xxh3, (Segment("blob", "", "U8", (size,), 0, size, xxh3, codec, 0, payload),))


def part(
    rank: int,
    world: int = 3,
    files=None,
    chunks=None,
    version: int = 5,
    parent: int | None = 4,
    keyframe: bool = False,
    chain: int = 2,
    stats=None,
    created="2026-01-01T00:00:00+00:00",
) -> PartManifest:
    """Rank ``rank``'s part: by default one 10-byte file ``r<rank>.bin`` in one chunk of its own."""
    if files is None:
        files = (blob(f"r{rank}.bin", 10, 0, codec="full" if keyframe else "sparse"),)
    if chunks is None:
        chunks = (ChunkRef(H[10 + rank], 10),)
    stats = {"changed": rank, "elements": 10, "uploaded_bytes": 10} if stats is None else stats
    return PartManifest(
        version,
        parent,
        world,
        rank,
        keyframe,
        0 if keyframe else chain,
        tuple(files),
        tuple(chunks),
        created,
        {"level": 3},
        stats,
    )


def head(version: int = 4, chain: int = 1) -> Manifest:
    return Manifest(version, None if chain == 0 else version - 1, chain == 0, chain, (), ())


def reseal(doc: dict) -> bytes:
    return json.dumps({**doc, "checksum": manifest_checksum(doc)}).encode()


# --- keys and JSON -------------------------------------------------------------------------------
def test_part_keys_round_trip_and_sort_by_rank():
    assert part_key(7, 3, 64) == "parts/00000000000000000007/00003-of-00064.json"
    assert part_key(7, 3, 64).startswith(parts_prefix(7))
    assert parse_part_key(part_key(10**18, 99998, 99999)) == (10**18, 99998, 99999)
    for bad in (
        "parts/7/3-of-64.json",
        "versions/00000000000000000007.json",
        "parts/00000000000000000007/00003-of-00064",
        "parts/00000000000000000007/00003-of-00064.json.tmp",
    ):
        assert parse_part_key(bad) is None
    keys = [part_key(1, r, 12) for r in (11, 2, 0, 10)]
    assert sorted(keys) == [part_key(1, r, 12) for r in (0, 2, 10, 11)]


def test_part_json_round_trip():
    p = part(1, files=(blob("a/x.bin", 10, 0), blob("b.bin", 4, 0, offset=10)), chunks=(ChunkRef(H[3], 14),))
    data = part_to_json(p)
    assert part_from_json(data) == p
    doc = json.loads(data)
    assert doc["format"] == "weightsync.part" and doc["rank"] == 1 and doc["world"] == 3
    assert doc["files"][0]["segments"][0]["payload"]["parts"] == [[0, 0, 10]]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(rank=3), "rank"),
        (lambda d: d.update(rank=-1), "rank"),
        (lambda d: d.update(world=0), "world"),
        (lambda d: d.update(world=100000), "world"),
        (lambda d: d.update(world="3"), "world"),
        (lambda d: d.pop("rank"), "rank"),
        (lambda d: d.update(parent=5), "parent"),
        (lambda d: d.update(keyframe=True), "keyframe holds only full"),
        (lambda d: d.update(chain_length=0), "chain_length"),
        (lambda d: d["files"][0]["segments"][0]["payload"].update(parts=[[1, 0, 10]]), "outside its chunk"),
        (lambda d: d["files"][0]["segments"][0]["payload"].update(parts=[[0, 5, 10]]), "outside its chunk"),
        (lambda d: d["files"][0].update(path="../x"), "unsafe"),
        (lambda d: d["files"].append(dict(d["files"][0])), "duplicate file paths"),
        (lambda d: d.update(format="weightsync.manifest"), "not a weightsync part"),
        (lambda d: d.update(format_version=2), "not a weightsync part"),
    ],
)
def test_part_validation_rejects(edit, message):
    doc = json.loads(part_to_json(part(1)))
    edit(doc)
    with pytest.raises(FormatError, match=message):
        part_from_json(reseal(doc))


def test_part_checksum_catches_damage_that_still_parses():
    doc = json.loads(part_to_json(part(1)))
    doc["files"][0]["xxh3"] = H[7]  # valid, but not what was sealed
    with pytest.raises(FormatError, match="part checksum mismatch"):
        part_from_json(json.dumps(doc).encode())
    with pytest.raises(FormatError, match="checksum mismatch"):
        part_from_json(part_to_json(part(1)).replace(b'"rank":1', b'"rank":2'))
    with pytest.raises(FormatError, match="not valid JSON"):
        part_from_json(part_to_json(part(1))[:-5])
    # a manifest is not a part, and a part is not a manifest
    with pytest.raises(FormatError, match="not a weightsync part"):
        part_from_json(manifest_to_json(head()))
    with pytest.raises(FormatError, match="not a weightsync manifest"):
        manifest_from_json(part_to_json(part(1)))


def test_same_part_ignores_created_and_stats_only():
    a = part(1)
    assert same_part(a, replace(a, created="2030-01-01T00:00:00+00:00", stats={"uploaded_bytes": 0}))
    assert not same_part(a, replace(a, parent=3))
    assert not same_part(a, replace(a, files=(blob("r1.bin", 10, 0, codec="sparse", xxh3=H[9]),)))
    assert not same_part(a, replace(a, chunks=(ChunkRef(H[99], 10),)))


# --- the owner rule ----------------------------------------------------------------------------------
def test_assign_files_round_robin_shards_and_the_rest_to_rank_0():
    paths = ["tokenizer/tok.json", "config.json", "model.safetensors.index.json"] + [
        f"model-{k:05d}-of-00006.safetensors" for k in range(6, 0, -1)
    ]
    split = [assign_files(paths, r, 4) for r in range(4)]
    assert split[0] == [
        "config.json",
        "model-00001-of-00006.safetensors",
        "model-00005-of-00006.safetensors",
        "model.safetensors.index.json",
        "tokenizer/tok.json",
    ]
    assert split[1] == ["model-00002-of-00006.safetensors", "model-00006-of-00006.safetensors"]
    assert split[3] == ["model-00004-of-00006.safetensors"]
    assert sorted(p for s in split for p in s) == sorted(paths)  # each file exactly once
    assert assign_files(["model.safetensors", "config.json"], 1, 2) == []  # a rank may own nothing
    assert assign_files(paths, 0, 1) == sorted(paths)
    with pytest.raises(UsageError):
        assign_files(paths, 4, 4)
    with pytest.raises(UsageError):
        assign_files(paths, 0, 0)


# --- merging -------------------------------------------------------------------------------------------
def test_merge_renumbers_chunks_sorts_files_and_sums_stats():
    parts = [
        part(2, files=(blob("c.bin", 10, 0),), created="2026-01-01T00:00:03+00:00"),
        part(
            0,
            files=(blob("b.bin", 6, 1), blob("a/z.bin", 4, 0, offset=3)),
            chunks=(ChunkRef(H[20], 7), ChunkRef(H[21], 6)),
            created="2026-01-01T00:00:09+00:00",
        ),
        part(1, files=(), chunks=(), stats={"changed": 5, "elements": 1}),
    ]
    m = merge_parts(parts, head())
    assert (m.version, m.parent, m.keyframe, m.chain_length) == (5, 4, False, 2)
    assert [f.path for f in m.files] == ["a/z.bin", "b.bin", "c.bin"]
    assert m.chunks == (ChunkRef(H[20], 7), ChunkRef(H[21], 6), ChunkRef(H[12], 10))  # rank order
    by_path = {f.path: f for f in m.files}
    assert by_path["a/z.bin"].segments[0].payload.parts == (Piece(0, 3, 4),)
    assert by_path["b.bin"].segments[0].payload.parts == (Piece(1, 0, 6),)
    assert by_path["c.bin"].segments[0].payload.parts == (Piece(2, 0, 10),)
    assert m.stats == {"changed": 0 + 5 + 2, "elements": 21, "uploaded_bytes": 20}
    assert m.created == "2026-01-01T00:00:09+00:00" and m.codec_config == {"level": 3}
    assert manifest_from_json(manifest_to_json(m)) == m  # a valid manifest, checksum included
    assert merge_parts(list(reversed(parts)), head()) == m  # the order parts were read in does not matter


def test_merge_lists_a_chunk_stored_by_two_ranks_once_and_keeps_keyframe_deltas():
    shared = ChunkRef(H[50], 20)

    def kf_blob(path, offset):
        f = blob(path, 10, 1, codec="full")
        s = f.segments[0]
        s = replace(s, delta=Delta("sparse", 1, Payload(3, H[60], (Piece(0, offset, 3),))))
        return replace(f, segments=(s,))

    parts = [
        part(r, world=2, keyframe=True, files=(kf_blob(f"f{r}", 3 * r),), chunks=(shared, ChunkRef(H[40 + r], 10)))
        for r in range(2)
    ]
    m = merge_parts(parts, head())
    assert m.chunks == (shared, ChunkRef(H[40], 10), ChunkRef(H[41], 10))
    assert m.files[1].segments[0].payload.parts == (Piece(2, 0, 10),)
    assert m.files[1].segments[0].delta.payload.parts == (Piece(0, 3, 3),)
    assert manifest_from_json(manifest_to_json(m)) == m


def test_merge_renumbers_the_chunks_of_reverse_payloads_too():
    def ans_blob(path):
        f = blob(path, 10, 0, codec="ans")
        s = f.segments[0]
        p = replace(s.payload, reverse=Payload(2, H[61], (Piece(1, 0, 2),)))
        return replace(f, segments=(replace(s, payload=p),))

    parts = [
        part(r, world=2, files=(ans_blob(f"f{r}"),), chunks=(ChunkRef(H[40 + r], 10), ChunkRef(H[44 + r], 2)))
        for r in range(2)
    ]
    m = merge_parts(parts, head())
    assert m.chunks == (ChunkRef(H[40], 10), ChunkRef(H[44], 2), ChunkRef(H[41], 10), ChunkRef(H[45], 2))
    assert m.files[1].segments[0].payload.parts == (Piece(2, 0, 10),)
    assert m.files[1].segments[0].payload.reverse.parts == (Piece(3, 0, 2),)
    assert manifest_from_json(manifest_to_json(m)) == m


def test_merge_of_the_first_version_on_an_empty_store():
    parts = [part(r, world=2, version=0, parent=None, keyframe=True) for r in range(2)]
    m = merge_parts(parts, None)
    assert (m.version, m.parent, m.keyframe, m.chain_length) == (0, None, True, 0)
    with pytest.raises(VersionError, match="stale parent"):
        merge_parts(parts, head(0, chain=0))


@pytest.mark.parametrize(
    "parts, message",
    [
        ([part(0), part(1)], r"missing \[2\]"),
        ([part(0), part(1), part(1)], r"missing \[2\], repeated \[1\]"),
        ([part(0), part(1), part(2), part(2)], r"repeated \[2\]"),
        ([part(0), part(1), part(2), part(3, world=3)], "expected ranks 0..2"),
        ([part(0), part(1), part(2, world=4)], "disagree on world"),
        ([part(0), part(1), part(2, version=6)], "disagree on version"),
        ([part(0), part(1), part(2, parent=3, chain=1)], "disagree on"),
        ([part(0), part(1, parent=3), part(2)], "disagree on parent"),
        ([part(0), part(1, keyframe=True), part(2)], "disagree on keyframe"),
        ([part(0), part(1, chain=3), part(2)], "disagree on chain_length"),
        ([part(r, parent=3) for r in range(3)], "built on version 3 but the head is 4: a stale parent"),
        ([part(r, chain=5) for r in range(3)], "chain length 5 does not follow"),
        ([part(r, version=4) for r in range(3)], "stale parent|not after the head"),
        (
            [part(0, files=(blob("x.bin", 10, 0),)), part(1), part(2, files=(blob("x.bin", 10, 0),))],
            "'x.bin' is in the parts of ranks 0 and 2",
        ),
        ([part(0, files=(blob("d", 10, 0),)), part(1, files=(blob("d/e", 10, 0),)), part(2)], "lies under file 'd'"),
        ([], "no parts"),
    ],
)
def test_merge_refuses(parts, message):
    with pytest.raises(VersionError, match=message):
        merge_parts(parts, head())


def test_merge_refuses_a_parent_that_is_not_the_head_in_both_directions():
    parts = [part(r) for r in range(3)]
    merge_parts(parts, head(4, chain=1))
    with pytest.raises(VersionError, match="stale parent"):
        merge_parts(parts, head(5, chain=1))  # the head moved on
    with pytest.raises(VersionError, match="stale parent"):
        merge_parts(parts, None)  # the store was emptied
    with pytest.raises(VersionError, match="chain length 2 does not follow the head's \\(4 expected\\)"):
        merge_parts(parts, head(4, chain=3))


def test_merge_refuses_to_drop_a_file_of_the_head_unless_allowed():
    """A rank's --files list that came up short would commit a checkpoint without that file."""
    parent = replace(
        head(),
        files=(blob("r0.bin", 10, 0), blob("r1.bin", 10, 0), blob("r2.bin", 10, 0), blob("tokenizer.json", 10, 0)),
    )
    parts = [part(r) for r in range(3)]
    with pytest.raises(
        VersionError,
        match="no rank published tokenizer.json of version 4; nothing committed. "
        "Parts are create-only: publish every rank again as version 6",
    ):
        merge_parts(parts, parent)
    assert [f.path for f in merge_parts(parts, parent, allow_removed=True).files] == ["r0.bin", "r1.bin", "r2.bin"]
    merge_parts(parts, replace(parent, files=parent.files[:3]))  # every file there: fine
    many = replace(parent, files=tuple(blob(f"gone{i}.bin", 10, 0) for i in range(8)) + parent.files[:3])
    with pytest.raises(VersionError, match=r"gone0.bin, gone1.bin, gone2.bin, gone3.bin, gone4.bin and 3 more"):
        merge_parts(parts, many)


def test_the_part_writer_agrees_with_asdict():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_format import _asdict_json

    for p in (part(0), part(2, keyframe=True)):
        assert part_to_json(p) == _asdict_json(p, "weightsync.part")


def test_a_large_jobs_waiting_ranks_poll_the_store_less_often_and_not_in_step():
    rng = random.Random(7)
    small = [rank_poll(0.25, 8, rng) for _ in range(2000)]
    assert 0.125 <= min(small) < 0.14 and 0.36 < max(small) <= 0.375  # the poll asked for, +-50%
    assert 0.24 < statistics.mean(small) < 0.26
    large = [rank_poll(0.25, 2048, rng) for _ in range(2000)]
    assert 1.024 <= min(large) and max(large) <= 3.072
    # the job's ranks together: about JOB_READS_PER_SECOND reads a second, not 8,192
    assert 900 < 2048 / statistics.mean(large) < 1100
    assert len({round(x, 6) for x in large}) > 1900  # no two ranks in step
