"""The stored format: manifest JSON round trip and validation, paths, head pointer, marker, keys."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.errors import FormatError
from weightsync.format.dtypes import ITEMSIZE
from weightsync.format.keys import (
    FORMAT_VERSION,
    MAX_SIZE,
    MAX_VERSION,
    check_path,
    chunk_key,
    parse_version_key,
    version_key,
)
from weightsync.format.manifest import (
    ChunkRef,
    Delta,
    FileEntry,
    Manifest,
    Payload,
    Piece,
    Segment,
    check_marker,
    head_from_json,
    head_to_json,
    manifest_checksum,
    manifest_from_json,
    manifest_to_json,
    marker_to_json,
)

H = [f"{i:032x}" for i in range(1, 40)]  # distinct valid checksums / chunk ids


def seg(role, name, dtype, shape, begin, codec="full", payload=None, changed=0, xxh3=H[0], delta=None):
    end = begin + math.prod(shape) * ITEMSIZE[dtype]
    return Segment(role, name, dtype, tuple(shape), begin, end, xxh3, codec, changed, payload, delta)


def sample_manifest(keyframe: bool = False, deltas: bool = False) -> Manifest:
    """A delta version, or a keyframe (with its parent and deltas from it if ``deltas``): a sharded
    safetensors file, a nested blob, an empty file, payloads spanning chunks."""
    if deltas:
        return _with_deltas(sample_manifest(keyframe=True))
    chunks = (ChunkRef(H[10], 100), ChunkRef(H[11], 64))
    codec = (lambda c: "full") if keyframe else (lambda c: c)
    pay = lambda size, *parts: Payload(size, H[20 + size % 10], tuple(Piece(*p) for p in parts))  # noqa: E731
    st_segs = (
        seg("header", "", "U8", (24,), 0, "full", pay(40, (0, 0, 40))),
        seg("tensor", "a.weight", "BF16", (2, 3), 24, codec("sparse"), pay(30, (0, 40, 30)), changed=2),
        seg("tensor", "b.weight", "F32", (0,), 36, codec("full"), pay(34, (0, 70, 30), (1, 0, 4))),
        seg("tensor", "c.bias", "I64", (), 36, codec("same"), None if not keyframe else pay(10, (1, 4, 10))),
        seg("tensor", "d", "F8_E4M3", (4,), 44, codec("dense"), pay(20, (1, 14, 20)), changed=4),
    )
    files = (
        FileEntry("model-00001-of-00002.safetensors", "safetensors", 48, H[1], st_segs),
        FileEntry("tok/vocab.json", "blob", 7, H[2], (seg("blob", "", "U8", (7,), 0, "full", pay(30, (1, 34, 30))),)),
        FileEntry(
            "empty.txt",
            "blob",
            0,
            H[3],
            (seg("blob", "", "U8", (0,), 0, codec("same"), None if not keyframe else pay(10, (1, 4, 10))),),
        ),
    )
    return Manifest(
        version=7 if not keyframe else 4,
        parent=None if keyframe else 6,
        keyframe=keyframe,
        chain_length=0 if keyframe else 3,
        files=files,
        chunks=chunks,
        created="2026-01-01T00:00:00+00:00",
        codec_config={"level": 3, "block_bytes": 1024},
        stats={"changed": 6, "elements": 13},
    )


def _with_deltas(m: Manifest) -> Manifest:
    chunks = m.chunks + (ChunkRef(H[12], 50),)
    f0 = m.files[0]
    segs = list(f0.segments)
    segs[1] = replace(segs[1], delta=Delta("sparse", 2, Payload(20, H[30], (Piece(2, 0, 20),))))
    segs[3] = replace(segs[3], delta=Delta("same", 0, None))
    segs[4] = replace(segs[4], delta=Delta("dense", 4, Payload(30, H[31], (Piece(2, 20, 30),))))
    files = (replace(f0, segments=tuple(segs)),) + m.files[1:]
    return replace(m, parent=3, files=files, chunks=chunks)


def doc_of(m: Manifest) -> dict:
    return json.loads(manifest_to_json(m))


def load(doc) -> Manifest:
    """Parse a hand-edited document, resealed so that the edit itself is what gets validated."""
    if isinstance(doc, dict) and doc.get("format") == "weightsync.manifest":
        doc = {**doc, "checksum": manifest_checksum(doc)}
    return manifest_from_json(json.dumps(doc).encode())


# --- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("keyframe,deltas", [(False, False), (True, False), (True, True)])
def test_manifest_round_trip(keyframe, deltas):
    m = sample_manifest(keyframe, deltas)
    data = manifest_to_json(m)
    back = manifest_from_json(data)
    assert back == m
    assert manifest_to_json(back) == data  # canonical: sorted keys, compact
    doc = json.loads(data)
    assert doc["format"] == "weightsync.manifest" and doc["format_version"] == FORMAT_VERSION
    assert doc["files"][0]["segments"][2]["payload"]["parts"] == [[0, 70, 30], [1, 0, 4]]


def test_manifest_helpers():
    m = sample_manifest()
    assert m.file("tok/vocab.json").kind == "blob" and m.file("nope") is None
    assert m.raw_bytes == 55
    assert m.payload_bytes == 40 + 30 + 34 + 20 + 30
    s = m.files[0].segments[1]
    assert s.nbytes == 12 and s.key == ("tensor", "a.weight")


def test_empty_manifest_round_trip():
    m = Manifest(0, None, True, 0, (), ())
    assert manifest_from_json(manifest_to_json(m)) == m


def test_optional_fields_tolerate_junk_types():
    doc = doc_of(sample_manifest())
    doc["codec_config"], doc["stats"] = [1, 2], "x"
    del doc["created"]
    m = load(doc)
    assert m.codec_config == {} and m.stats == {} and m.created == ""


# --- paths ---------------------------------------------------------------------------------------
def _short(path: str) -> str:
    return ascii(path) if len(path) <= 40 else f"{ascii(path[:12])}...{len(path)}"


GOOD_PATHS = [
    "model.safetensors",
    "a/b/c.json",
    ".hidden",
    "a/.weightsync",
    "x..y",
    "...",
    "a b/ü.bin",
    "-",
    "/".join(["a"] * 255),
    "x" * 255,
    "ü" * 127,
    "/".join(["d" * 254] * 16)[:4096],
    "bad\udcffbyte",
]
BAD_PATHS = [
    "",
    "../x",
    "..",
    ".",
    "/abs",
    "/",
    "a/../b",
    "a/./b",
    "./a",
    "a//b",
    "a/",
    "a\\b",
    "..\\x",
    "C:\\x",
    "a\x00b",
    ".weightsync",
    ".weightsync/x",
    ".weightsync/state.json",
    "x" * 4097,
    "/".join(["a"] * 256),
    "/".join(["a"] * 2000),
    "x" * 256,
    "ü" * 128,
    "a/" + "é" * 2048,
    "lone\ud800surrogate",
]


@pytest.mark.parametrize("path", GOOD_PATHS, ids=_short)
def test_safe_paths_are_accepted(path):
    assert check_path(path) == path


@pytest.mark.parametrize("path", BAD_PATHS, ids=_short)
def test_unsafe_paths_are_rejected(path):
    with pytest.raises(FormatError):
        check_path(path)


@pytest.mark.parametrize("path", BAD_PATHS, ids=_short)
def test_manifest_with_unsafe_path_is_rejected(path):
    doc = doc_of(sample_manifest())
    doc["files"][1]["path"] = path
    with pytest.raises(FormatError):
        load(doc)


# --- rejection table -----------------------------------------------------------------------------
def _f(doc, i=0):
    return doc["files"][i]


def _s(doc, i=0, j=1):
    return doc["files"][i]["segments"][j]


def _set(getter, key, value):
    def mutate(doc):
        getter(doc)[key] = value

    return mutate


def _del(getter, key):
    def mutate(doc):
        del getter(doc)[key]

    return mutate


def _dup_path(doc):
    _f(doc, 1)["path"] = _f(doc, 0)["path"]


def _file_under_file(doc):
    _f(doc, 1)["path"] = _f(doc, 0)["path"] + "/inner.json"


def _file_over_file(doc):
    _f(doc, 0)["path"] = "tok"  # tok/vocab.json would lie under the file "tok"


def _swap_segments(doc):
    segs = _f(doc)["segments"]
    segs[1], segs[4] = segs[4], segs[1]


def _drop_segment(doc):
    del _f(doc)["segments"][4]


def _dup_segment(doc):
    _s(doc, 0, 4)["name"] = "a.weight"


def _part_beyond_chunk(doc):
    _s(doc)["payload"]["parts"] = [[0, 71, 30]]


def _bad_version(v):
    return _set(lambda d: d, "version", v)


REJECT = {
    # document level
    "wrong format": _set(lambda d: d, "format", "weightsync.head"),
    "missing format": _del(lambda d: d, "format"),
    "format version 2": _set(lambda d: d, "format_version", 2),
    "format version '1'": _set(lambda d: d, "format_version", "1"),
    "format version 1.5": _set(lambda d: d, "format_version", 1.5),
    "version missing": _del(lambda d: d, "version"),
    "version negative": _bad_version(-1),
    "version too large": _bad_version(MAX_VERSION + 1),
    "version float": _bad_version(7.0),
    "version string": _bad_version("7"),
    "version bool": _bad_version(True),
    "parent equal to version": _set(lambda d: d, "parent", 7),
    "parent after version": _set(lambda d: d, "parent", 8),
    "parent negative": _set(lambda d: d, "parent", -1),
    "parent bool": _set(lambda d: d, "parent", False),
    "parent string": _set(lambda d: d, "parent", "6"),
    "parent float": _set(lambda d: d, "parent", 6.0),
    "delta without parent": _set(lambda d: d, "parent", None),
    "keyframe int": _set(lambda d: d, "keyframe", 0),
    "keyframe missing": _del(lambda d: d, "keyframe"),
    "keyframe with delta segments": lambda d: d.update(keyframe=True, chain_length=0),
    "chain_length 0 for a delta": _set(lambda d: d, "chain_length", 0),
    "chain_length bool": _set(lambda d: d, "chain_length", True),
    "chain_length negative": _set(lambda d: d, "chain_length", -1),
    "chain_length missing": _del(lambda d: d, "chain_length"),
    "files not a list": _set(lambda d: d, "files", {}),
    "chunks not a list": _set(lambda d: d, "chunks", None),
    "chunk not an object": lambda d: d["chunks"].append([H[5], 3]),
    "chunk id uppercase": lambda d: d["chunks"][0].update(id=H[10].upper().replace("0", "A")),
    "chunk id short": lambda d: d["chunks"][0].update(id=H[10][:31]),
    "chunk id trailing newline": lambda d: d["chunks"][0].update(id=H[10] + "\n"),
    "chunk size 0": lambda d: d["chunks"][0].update(size=0),
    "chunk size bool": lambda d: d["chunks"][1].update(size=True),
    # files
    "duplicate paths": _dup_path,
    "file under a file": _file_under_file,
    "file over a file": _file_over_file,
    "file not an object": lambda d: d["files"].append("x"),
    "file kind unknown": _set(_f, "kind", "pickle"),
    "file size too small": _set(_f, "size", 47),
    "file size too large": _set(_f, "size", 49),
    "file size negative": _set(_f, "size", -1),
    "file size huge": _set(_f, "size", MAX_SIZE + 1),
    "file checksum bad": _set(_f, "xxh3", "z" * 32),
    "file checksum int": _set(_f, "xxh3", 5),
    "segments not a list": _set(_f, "segments", {}),
    "segments missing": _del(_f, "segments"),
    "segments out of order": _swap_segments,
    "segments leave a gap": _drop_segment,
    "duplicate segment names": _dup_segment,
    "segment not an object": lambda d: _f(d)["segments"].append(3),
    # segments
    "segment role unknown": _set(_s, "role", "weights"),
    "segment codec unknown": _set(_s, "codec", "lz4"),
    "segment dtype unknown": _set(_s, "dtype", "F4"),
    "segment dtype mismatch": _set(_s, "dtype", "F32"),
    "segment shape mismatch": _set(_s, "shape", [3, 3]),
    "segment shape negative": _set(_s, "shape", [-2, -3]),
    "segment shape float": _set(_s, "shape", [2.0, 3]),
    "segment shape bool": _set(_s, "shape", [True, 6]),
    "segment shape not a list": _set(_s, "shape", 6),
    "segment shape too many dims": _set(_s, "shape", [1] * 64 + [6]),
    "segment end before begin": lambda d: _s(d).update(begin=36, end=24),
    "segment end too large": _set(_s, "end", 37),
    "segment changed negative": _set(_s, "changed", -1),
    "segment changed bool": _set(_s, "changed", True),
    "segment changed missing": _del(_s, "changed"),
    "segment checksum 31 digits": _set(_s, "xxh3", H[0][:31]),
    "segment checksum uppercase": _set(_s, "xxh3", "ABCDEF" + H[0][6:]),
    "segment checksum trailing newline": _set(_s, "xxh3", H[0] + "\n"),
    "segment name not a string": _set(_s, "name", None),
    "same with a payload": lambda d: _s(d, 0, 3).update(payload=_s(d, 0, 1)["payload"]),
    "full without payload": _set(lambda d: _s(d, 0, 0), "payload", None),
    # payloads and parts
    "payload not an object": _set(_s, "payload", [40, 30]),
    "payload size mismatch": lambda d: _s(d)["payload"].update(size=31),
    "payload parts not summing": lambda d: _s(d)["payload"].update(parts=[[0, 40, 29]]),
    "part beyond its chunk": _part_beyond_chunk,
    "part in a missing chunk": lambda d: _s(d)["payload"].update(parts=[[2, 0, 30]]),
    "part chunk negative": lambda d: _s(d)["payload"].update(parts=[[-1, 0, 30]]),
    "part offset negative": lambda d: _s(d)["payload"].update(parts=[[0, -1, 30]]),
    "part empty": lambda d: _s(d)["payload"].update(parts=[[0, 40, 30], [0, 70, 0]]),
    "part of two numbers": lambda d: _s(d)["payload"].update(parts=[[0, 40]]),
    "part of floats": lambda d: _s(d)["payload"].update(parts=[[0, 40.0, 30]]),
    "part of bools": lambda d: _s(d)["payload"].update(parts=[[False, 40, 30]]),
    "part as object": lambda d: _s(d)["payload"].update(parts=[{"chunk": 0, "offset": 40, "length": 30}]),
    "payload checksum bad": lambda d: _s(d)["payload"].update(xxh3="g" * 32),
    "payload size bool": lambda d: _s(d)["payload"].update(size=True),
}


@pytest.mark.parametrize("case", sorted(REJECT))
def test_invalid_manifest_is_rejected(case):
    doc = doc_of(sample_manifest())
    load(copy.deepcopy(doc))  # the unmutated document is valid
    REJECT[case](doc)
    with pytest.raises(FormatError):
        load(doc)


# Segments as (begin, end) of a 12-byte file: the last ends at 12 (and in the first two their lengths
# add up to 12), so only the tiling check (each begins where the one before ended) refuses them.
UNTILED = {
    "overlap and gap": [(0, 4), (2, 6), (8, 12)],
    "out of order": [(4, 8), (0, 4), (8, 12)],
    "overlap": [(0, 8), (4, 12)],
    "gap": [(0, 4), (8, 12)],
}


def _file_of(spans: list[tuple[int, int]]) -> Manifest:
    chunks = (ChunkRef(H[10], 100),)
    segs = tuple(
        Segment(
            "tensor", f"t{i}", "U8", (e - b,), b, e, H[i], "full", 0, Payload(e - b, H[20 + i], (Piece(0, b, e - b),))
        )
        for i, (b, e) in enumerate(spans)
    )
    return Manifest(0, None, True, 0, (FileEntry("model.safetensors", "safetensors", 12, H[1], segs),), chunks)


@pytest.mark.parametrize("case", sorted(UNTILED))
def test_segments_that_do_not_tile_their_file_are_refused(case):
    """Overlapping or gapped segments would be trusted by the planner, partial fetch and the torch
    sink: a byte range written twice, or one never written."""
    manifest_from_json(manifest_to_json(_file_of([(0, 4), (4, 8), (8, 12)])))  # the tiled file is valid
    with pytest.raises(FormatError, match="tile"):
        manifest_from_json(manifest_to_json(_file_of(UNTILED[case])))


def test_keyframe_chain_length_must_be_zero():
    doc = doc_of(sample_manifest(keyframe=True))
    load(doc)
    doc["chain_length"] = 1
    with pytest.raises(FormatError):
        load(doc)


def _d(doc, j=1):
    return doc["files"][0]["segments"][j]["delta"]


DELTA_REJECT = {
    "delta on a keyframe without parent": lambda d: d.update(parent=None),
    "delta on a delta version": lambda d: d.update(keyframe=False, chain_length=1),
    "delta codec full": lambda d: _d(d).update(codec="full"),
    "delta codec unknown": lambda d: _d(d).update(codec="xor"),
    "delta codec missing": lambda d: _d(d).pop("codec"),
    "delta not an object": lambda d: d["files"][0]["segments"][1].update(delta=["sparse", 2]),
    "delta without payload": lambda d: _d(d).update(payload=None),
    "delta payload outside its chunk": lambda d: _d(d)["payload"].update(parts=[[2, 40, 20]]),
    "delta payload size mismatch": lambda d: _d(d)["payload"].update(size=21),
    "delta payload bad checksum": lambda d: _d(d)["payload"].update(xxh3="x"),
    "delta changed missing": lambda d: _d(d).pop("changed"),
    "delta changed bool": lambda d: _d(d).update(changed=False),
    "delta changed negative": lambda d: _d(d).update(changed=-1),
    "same delta with a payload": lambda d: _d(d, 3).update(payload=_d(d)["payload"]),
}


@pytest.mark.parametrize("case", sorted(DELTA_REJECT))
def test_invalid_keyframe_delta_is_rejected(case):
    doc = doc_of(sample_manifest(keyframe=True, deltas=True))
    load(copy.deepcopy(doc))
    DELTA_REJECT[case](doc)
    with pytest.raises(FormatError):
        load(doc)


def test_delta_on_a_non_full_segment_is_rejected():
    doc = doc_of(sample_manifest())
    _s(doc)["delta"] = {"codec": "same", "changed": 0, "payload": None}
    with pytest.raises(FormatError):
        load(doc)


def test_keyframe_without_deltas_may_name_a_parent():
    doc = doc_of(sample_manifest(keyframe=True))
    doc["parent"] = 2
    assert load(doc).parent == 2


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"null",
        b"[]",
        b"1",
        b'"manifest"',
        b"true",
        b"{",
        b"\xff\xfe\x00",
        b'{"format": NaN}',
        b'{"format":"weightsync.manifest","format_version":1}',
    ],
)
def test_non_manifest_documents_are_rejected(data):
    with pytest.raises(FormatError):
        manifest_from_json(data)


def test_path_limits_are_named_in_the_error():
    for path, why in (
        ("/".join(["a"] * 2000), "over 255 components"),
        ("é" * 2049, "over 4096 bytes"),
        ("a/" + "b" * 256, "a component over 255 bytes"),
    ):
        with pytest.raises(FormatError, match=f"unsafe file path in manifest \\({why}\\)") as err:
            check_path(path)
        assert len(str(err.value)) < 200


def _stats_nested(n: int) -> bytes:
    """A sealed manifest's bytes with ``stats`` nested ``n`` arrays deep (unsealed past 800)."""
    doc = doc_of(sample_manifest())
    doc.pop("checksum")
    deep = "[" * n + "]" * n
    body = json.dumps(doc)[:-1] + f', "stats": {{"x": {deep}}}}}'
    if n < 800:
        body = body[:-1] + f', "checksum": "{manifest_checksum(json.loads(body))}"}}'
    return body.encode()


def test_deep_informational_fields_are_a_format_error_at_every_depth():
    """Nesting deep enough to parse but too deep to serialize again (or to hand on) is a FormatError."""
    for n in range(32, 1100):  # with the stats object itself: 33 deep and more
        with pytest.raises(FormatError, match="nested" if n < 800 else "nested|checksum") as err:
            manifest_from_json(_stats_nested(n))
        assert len(str(err.value)) < 200
    assert manifest_from_json(_stats_nested(31)).stats["x"] == json.loads("[" * 31 + "]" * 31)


def test_deeply_nested_json_is_a_format_error():
    """Hostile JSON nesting must not escape as RecursionError."""
    with pytest.raises(FormatError):
        manifest_from_json(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(FormatError):
        head_from_json(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)


# --- fuzz --------------------------------------------------------------------------------------------
JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.sampled_from(H[:3] + ["../x", "", "a//b", H[0] + "\n"]),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_docs(draw):
    doc = doc_of(sample_manifest(*draw(st.sampled_from([(False, False), (True, False), (True, True)]))))
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "delete", "int", "dup"]))
        last = path[-1]
        if op == "replace":
            parent[last] = draw(JSON_VALUES)
        elif op == "delete":
            del parent[last]
        elif op == "int" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
            parent[last] += draw(st.sampled_from([-1, 1, -(2**62), 2**62]))
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[last]))
    data = json.dumps(doc).encode()
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + draw(st.binary(max_size=4))
    return data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_docs())
def test_fuzzed_manifests_raise_only_format_errors(data):
    try:
        m = manifest_from_json(data)
    except FormatError:
        return
    again = manifest_to_json(m)  # whatever is accepted re-serializes to a document that loads the same
    assert manifest_to_json(manifest_from_json(again)) == again


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_arbitrary_json_raises_only_format_errors(value):
    for parse in (manifest_from_json, head_from_json, check_marker):
        try:
            parse(json.dumps(value).encode())
        except FormatError:
            pass


# --- head pointer, marker, keys ------------------------------------------------------------------------
@pytest.mark.parametrize("version", [0, 1, 123456789, MAX_VERSION])
def test_head_round_trip(version):
    assert head_from_json(head_to_json(version)) == version


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b'{"format":"weightsync.head"}',
        b'{"format":"weightsync.manifest","version":1}',
        b'{"format":"weightsync.head","version":-1}',
        b'{"format":"weightsync.head","version":true}',
        b'{"format":"weightsync.head","version":"3"}',
        b'{"format":"weightsync.head","version":3.0}',
        b'{"format":"weightsync.head","version":1000000000000000001}',
    ],
)
def test_bad_head_is_rejected(data):
    with pytest.raises(FormatError):
        head_from_json(data)


def test_marker_round_trip():
    check_marker(marker_to_json())
    assert json.loads(marker_to_json()) == {"format": "weightsync.store", "format_version": FORMAT_VERSION}


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{}",
        b"[]",
        b'{"format":"weightsync.store"}',
        b'{"format":"weightsync.store","format_version":2}',
        b'{"format":"weightsync.head","format_version":1}',
        b"not json",
    ],
)
def test_bad_marker_is_rejected(data):
    with pytest.raises(FormatError):
        check_marker(data)


@pytest.mark.parametrize("version", [0, 1, 42, 10**19, MAX_VERSION])
def test_version_key_round_trip(version):
    key = version_key(version)
    assert key.startswith("versions/") and key.endswith(".json") and len(key) == len("versions/") + 20 + 5
    assert parse_version_key(key) == version


def test_version_keys_sort_like_versions():
    vs = [0, 9, 10, 99, 100, 12345, MAX_VERSION]
    assert sorted(version_key(v) for v in vs) == [version_key(v) for v in vs]


@pytest.mark.parametrize(
    "key",
    [
        "versions/1.json",
        "versions/0000000000000000001.json",
        "versions/000000000000000000001.json",
        "versions/00000000000000000001.json.tmp",
        "xversions/00000000000000000001.json",
        "versions/0000000000000000000a.json",
        "versions/-0000000000000000001.json",
        "versions/00000000000000000001.JSON",
        "chunks/00/00000000000000000001",
        "versions/" + "\u0660" * 19 + "\u0661" + ".json",
        "versions/00000000000000000001.json\n",
    ],
)
def test_non_version_keys_parse_to_none(key):
    assert parse_version_key(key) is None


def test_chunk_key_fans_out_by_prefix():
    assert chunk_key(H[5]) == f"chunks/00/{H[5]}"
    assert chunk_key("ab" + "0" * 30) == "chunks/ab/ab" + "0" * 30


# --- serialization: the field-by-field writer agrees with dataclasses.asdict -----------------------
def _asdict_json(obj, fmt: str) -> bytes:
    """The reference: ``dataclasses.asdict`` of the whole object, payload parts as triples."""
    from dataclasses import asdict

    doc = {"format": fmt, "format_version": FORMAT_VERSION, **asdict(obj)}

    def payload(p: dict) -> None:
        p["parts"] = [[x["chunk"], x["offset"], x["length"]] for x in p["parts"]]
        if not p["sha256"]:
            del p["sha256"]  # (written only when set: signed versions)
        if p["reverse"] is None:
            del p["reverse"]  # (written only when there is one: ans)
        else:
            payload(p["reverse"])

    for f in doc["files"]:
        for s in f["segments"]:
            for p in (s["payload"], (s["delta"] or {}).get("payload")):
                if p is not None:
                    payload(p)
    doc["checksum"] = manifest_checksum(doc)
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


@pytest.mark.parametrize("keyframe,deltas", [(False, False), (True, False), (True, True)])
def test_the_manifest_writer_agrees_with_asdict(keyframe, deltas):
    m = sample_manifest(keyframe=keyframe, deltas=deltas)
    assert manifest_to_json(m) == _asdict_json(m, "weightsync.manifest")


def test_the_manifest_writer_rewrites_the_golden_store_byte_for_byte():
    from pathlib import Path

    versions = sorted((Path(__file__).parents[1] / "fixtures" / "golden" / "store" / "versions").glob("*.json"))
    assert versions
    for path in versions:
        data = path.read_bytes()
        m = manifest_from_json(data)
        assert manifest_to_json(m) == data == _asdict_json(m, "weightsync.manifest")


def test_the_writer_covers_every_field():
    """A field added to a dataclass must be added to the writer too (or this fails)."""
    from dataclasses import fields

    import weightsync.format.manifest as fmt

    m = sample_manifest(keyframe=True, deltas=True)
    seg_ = next(s for f in m.files for s in f.segments if s.delta is not None and s.payload is not None)
    assert set(fmt._segment_doc(seg_)) == {f.name for f in fields(Segment)}
    assert set(fmt._file_doc(m.files[0])) == {f.name for f in fields(FileEntry)}
    unset = {"sha256", "reverse"}  # left out
    assert set(fmt._payload_doc(seg_.payload)) == {f.name for f in fields(Payload)} - unset
    signed = replace(seg_.payload, sha256="0" * 64, reverse=replace(seg_.payload, sha256="1" * 64))
    assert set(fmt._payload_doc(signed)) == {f.name for f in fields(Payload)}
    assert fmt._payload(fmt._payload_doc(signed), m.chunks, "p", "ans") == signed  # and read back
    with pytest.raises(FormatError, match="sha256"):
        fmt._payload({**fmt._payload_doc(signed), "sha256": "XYZ"}, m.chunks, "p")
    assert set(fmt._segment_doc(seg_)["delta"]) == {f.name for f in fields(Delta)}
    assert set(fmt._shallow(m)) == {f.name for f in fields(Manifest)}


def test_manifest_bytes_not_written_canonically_are_checked_canonically():
    data = manifest_to_json(sample_manifest(keyframe=True, deltas=True))
    doc = json.loads(data)
    pretty = json.dumps(dict(reversed(doc.items())), indent=2).encode()  # another tool's spacing and key order
    assert manifest_from_json(pretty) == manifest_from_json(data)
    damaged = {**doc, "stats": {"changed": 12345}}
    with pytest.raises(FormatError, match="checksum mismatch"):
        manifest_from_json(json.dumps(damaged, indent=2).encode())


def test_duplicate_keys_are_refused_whatever_the_checksum_covers():
    """Parsers disagree on which of two equal keys wins; a checksum over the bytes as written would
    bind neither reading, so the checksum is over the canonical form of what was parsed."""
    import xxhash

    data = manifest_to_json(sample_manifest())
    doc = json.loads(data)
    body = json.dumps({k: v for k, v in doc.items() if k != "checksum"}, separators=(",", ":"), sort_keys=True)
    twice = body[:-1] + ',"version":7}'  # "version" twice; Python keeps the last
    forged = twice[:-1] + f',"checksum":"{xxhash.xxh3_128_hexdigest(twice.encode())}"}}'
    with pytest.raises(FormatError, match="checksum mismatch"):
        manifest_from_json(forged.encode())


def test_reading_and_writing_restore_the_garbage_collector():
    import gc

    data = manifest_to_json(sample_manifest())
    assert gc.isenabled()
    manifest_from_json(data)
    assert gc.isenabled()
    with pytest.raises(FormatError):
        manifest_from_json(data.replace(b'"version":', b'"version":-'))
    assert gc.isenabled()
    gc.disable()
    try:
        manifest_from_json(data)
        manifest_to_json(sample_manifest())
        assert not gc.isenabled()  # an application's own choice is kept
    finally:
        gc.enable()


def test_overlapping_pauses_from_many_threads_leave_the_collector_on():
    import gc
    import sys
    import threading

    from weightsync.format.manifest import no_gc

    def work():
        for _ in range(5000):
            with no_gc():
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to interleave pause and resume
    try:
        for _ in range(5):
            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert gc.isenabled()
    finally:
        sys.setswitchinterval(interval)


# --- reverse payloads (ans's exception lists apart) --------------------------------------------------
def _with_reverse(keyframe: bool) -> Manifest:
    """sample_manifest with an ``ans`` payload (a delta's, or a keyframe delta's) that has a reverse payload."""
    m = sample_manifest(keyframe=keyframe, deltas=keyframe)
    rev = Payload(4, H[33], (Piece(1, 60, 4),))
    f0 = m.files[0]
    segs = list(f0.segments)
    if keyframe:
        d = segs[1].delta
        segs[1] = replace(segs[1], delta=Delta("ans", d.changed, replace(d.payload, reverse=rev)))
    else:
        segs[1] = replace(segs[1], codec="ans", payload=replace(segs[1].payload, reverse=rev))
    return replace(m, files=(replace(f0, segments=tuple(segs)), *m.files[1:]))


@pytest.mark.parametrize("keyframe", [False, True])
def test_a_reverse_payload_round_trips_and_is_one_of_the_manifests_payloads(keyframe):
    m = _with_reverse(keyframe)
    data = manifest_to_json(m)
    assert b'"reverse":{' in data and manifest_from_json(data) == m
    assert data == _asdict_json(m, "weightsync.manifest")
    rev = [p.reverse for p in Payload.all_in(m) if p.reverse is not None]
    assert len(rev) == 1 and rev[0] in list(Payload.all_in(m))  # gc, mirrors and signatures see it


def _edit_reverse(data: bytes, edit) -> bytes:
    doc = json.loads(data)
    for f in doc["files"]:
        for s in f["segments"]:
            for p in (s["payload"], (s["delta"] or {}).get("payload")):
                if p is not None and "reverse" in p:
                    edit(s, p)
    doc.pop("checksum")
    doc["checksum"] = manifest_checksum(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s, p: s.update(codec="sparse"), "only a payload of ans has a reverse payload"),
        (lambda s, p: p["reverse"].update(reverse=dict(p["reverse"])), "a reverse payload has none of its own"),
        (lambda s, p: p["reverse"].update(parts=[[1, 62, 4]]), "outside its chunk"),
        (lambda s, p: p["reverse"].update(size=5), "add up to"),
        (lambda s, p: p["reverse"].update(xxh3="x"), "xxh3"),
        (lambda s, p: p.update(reverse=[]), "must be an object"),
    ],
)
def test_a_bad_reverse_payload_is_refused(edit, message):
    data = manifest_to_json(_with_reverse(False))
    with pytest.raises(FormatError, match=message):
        manifest_from_json(_edit_reverse(data, edit))


def test_a_lazy_mirror_never_leaves_out_a_keyframe_deltas_reverse_payload():
    from weightsync.format.manifest import lazy_candidates

    m = _with_reverse(True)
    rev = next(p.reverse for p in Payload.all_in(m) if p.reverse is not None)
    no_deltas = tuple(replace(f, segments=tuple(replace(s, delta=None) for s in f.segments)) for f in m.files)
    full_only = replace(m, files=no_deltas)
    assert m.chunks[rev.parts[0].chunk].id not in lazy_candidates(m)
    assert lazy_candidates(full_only) == frozenset()  # a keyframe without deltas: nothing lazy
