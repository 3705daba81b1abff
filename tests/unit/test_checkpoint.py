"""Reading checkpoints: safetensors headers (real library files, hostile files) and directory scans."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from weightsync.demo import write_safetensors
from weightsync.errors import CheckpointError
from weightsync.format.dtypes import ITEMSIZE
from weightsync.format.safetensors import MAX_HEADER, parse_safetensors_header
from weightsync.local.checkpoint import (
    CheckpointChanged,
    check_header,
    check_unchanged,
    describe_file,
    open_source,
    read_range,
    scan_checkpoint,
    still_as_scanned,
)

TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


def parse_file(path: Path):
    data = path.read_bytes()
    return parse_safetensors_header(data, len(data), path.name)


def raw_file(header: object | bytes, data: bytes = b"", length: int | None = None, pad: bool = True) -> bytes:
    """A safetensors-like file: 8-byte little-endian header length, header, data."""
    hdr = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        hdr += b" " * (-len(hdr) % 8)
    n = len(hdr) if length is None else length
    return n.to_bytes(8, "little") + hdr + data


def parse_bytes(data: bytes):
    return parse_safetensors_header(data, len(data), "test.safetensors")


def check_layout(segs, data: bytes, header: dict):
    """Segments tile the file; tensor segments match the header's dtypes, shapes and offsets."""
    n = int.from_bytes(data[:8], "little")
    assert segs[0].role == "header" and (segs[0].begin, segs[0].end, segs[0].dtype) == (0, 8 + n, "U8")
    assert segs[0].shape == (8 + n,)
    pos = 0
    for s in segs:
        assert s.begin == pos and s.nbytes == s.end - s.begin
        pos = s.end
    assert pos == len(data)
    tensors = {s.name: s for s in segs[1:]}
    assert set(tensors) == set(header) - {"__metadata__"}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s = tensors[name]
        assert s.role == "tensor" and s.key == ("tensor", name)
        assert (s.dtype, list(s.shape)) == (info["dtype"], info["shape"])
        assert (s.begin - 8 - n, s.end - 8 - n) == tuple(info["data_offsets"])
    assert [s.begin for s in segs[1:]] == sorted(s.begin for s in segs[1:])


# --- files written by real writers -------------------------------------------------------------------
def test_accepts_files_from_the_safetensors_library(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, (name, dt) in enumerate(sorted(TORCH_DTYPES.items())):
        base = torch.randint(0, 100, (3, i + 1), generator=g)
        tensors[f"t.{name}"] = (
            base.to(dt) if dt not in (torch.uint16, torch.uint32, torch.uint64) else base.to(torch.int64).to(dt)
        )
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.float32)
    tensors["empty2"] = torch.zeros(0, dtype=torch.bfloat16)
    tensors["big"] = torch.randn(64, 33, generator=g).to(torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "ü"})
    data = path.read_bytes()
    segs = parse_file(path)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    check_layout(segs, data, header)
    by_name = {s.name: s for s in segs[1:]}
    for name, t in tensors.items():
        s = by_name[name]
        assert s.dtype in ITEMSIZE and s.nbytes == t.numel() * ITEMSIZE[s.dtype]
        expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert data[s.begin : s.end] == expected
    assert describe_file(path, "model.safetensors").segments == segs


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}])
def test_accepts_files_from_synth_write_safetensors(tmp_path, metadata):
    rng = np.random.default_rng(0)
    tensors = {
        "w": ("BF16", (4, 5), rng.integers(0, 2**16, 20, dtype=np.uint16).tobytes()),
        "step": ("I64", (), np.int64(7).tobytes()),
        "none": ("F32", (0,), b""),
        "mask": ("BOOL", (3,), bytes([0, 1, 1])),
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, metadata)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    check_layout(parse_file(path), data, json.loads(data[8 : 8 + n]))
    assert n % 8 == 0


def test_header_only_file_is_accepted():
    segs = parse_bytes(raw_file({}))
    assert len(segs) == 1 and segs[0].role == "header"
    segs = parse_bytes(
        raw_file({"__metadata__": {"a": "b"}, "e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})
    )
    assert [s.name for s in segs] == ["", "e"] and segs[1].nbytes == 0


def test_prefix_longer_than_the_header_is_fine():
    """The parser may be handed more than the header (the first bytes of a large file)."""
    data = raw_file({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"abcd")
    assert parse_safetensors_header(data, len(data), "x") == parse_safetensors_header(data[:-4], len(data), "x")


# --- hostile files -----------------------------------------------------------------------------------------
def T(dtype="F32", shape=(2,), offsets=(0, 8)):  # noqa: N802
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


REJECT: dict[str, bytes] = {
    "empty file": b"",
    "shorter than the length prefix": b"\x02\x00\x00",
    "header length beyond file": raw_file({"a": T()}, bytes(8), length=10_000),
    "header length one past the file": raw_file({}, b"", length=9),
    "header length above the limit": (MAX_HEADER + 1).to_bytes(8, "little") + b"{}",
    "header length 2**64-1": (2**64 - 1).to_bytes(8, "little") + b"{}",
    "header length zero": raw_file(b"", b""),
    "invalid JSON": raw_file(b"{not json}", b""),
    "truncated JSON": raw_file(b'{"a": {"dtype": "F32"', b""),
    "invalid UTF-8": raw_file(b'{"\xff\xfe": 1}', b""),
    "NUL padding": raw_file(b"{}" + b"\x00" * 6, b"", pad=False),
    "header a list": raw_file([], b""),
    "header a string": raw_file("x", b""),
    "header null": raw_file(None, b""),
    "duplicate tensor names": raw_file(
        b'{"a":' + json.dumps(T()).encode() + b',"a":' + json.dumps(T(offsets=(8, 16))).encode() + b"}", bytes(16)
    ),
    "duplicate keys inside a tensor": raw_file(
        b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)
    ),
    "hole between tensors": raw_file({"a": T(offsets=(0, 8)), "b": T(offsets=(12, 20))}, bytes(20)),
    "hole at the start": raw_file({"a": T(offsets=(4, 12))}, bytes(12)),
    "overlapping tensors": raw_file({"a": T(offsets=(0, 8)), "b": T(offsets=(4, 12))}, bytes(12)),
    "same range twice": raw_file({"a": T(offsets=(0, 8)), "b": T(offsets=(0, 8))}, bytes(8)),
    "offsets too short for shape": raw_file({"a": T(offsets=(0, 4))}, bytes(4)),
    "offsets too long for shape": raw_file({"a": T(offsets=(0, 12))}, bytes(12)),
    "offsets for another dtype": raw_file({"a": T(dtype="BF16", offsets=(0, 8))}, bytes(8)),
    "offsets reversed": raw_file({"a": T(offsets=(8, 0))}, bytes(8)),
    "offsets negative": raw_file({"a": T(offsets=(-8, 0))}, b""),
    "offsets three numbers": raw_file({"a": T(offsets=(0, 8, 8))}, bytes(8)),
    "offsets floats": raw_file({"a": T(offsets=(0.0, 8.0))}, bytes(8)),
    "offsets bools": raw_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, bytes(1)),
    "offsets missing": raw_file({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
    "offsets a string": raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": "0,8"}}, bytes(8)),
    "unknown dtype F4": raw_file({"a": T(dtype="F4", offsets=(0, 1))}, bytes(1)),
    "unknown dtype C64": raw_file({"a": T(dtype="C64", offsets=(0, 16))}, bytes(16)),
    "lowercase dtype": raw_file({"a": T(dtype="f32")}, bytes(8)),
    "dtype missing": raw_file({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "dtype not a string": raw_file({"a": T(dtype=4)}, bytes(8)),
    "dtype a list": raw_file({"a": T(dtype=["F32"])}, bytes(8)),
    "dtype an object": raw_file({"a": T(dtype={"F32": 1})}, bytes(8)),
    "trailing garbage": raw_file({"a": T()}, bytes(9)),
    "truncated data": raw_file({"a": T()}, bytes(7)),
    "data after an empty header": raw_file({}, b"x"),
    "negative shape": raw_file({"a": T(shape=(-2,), offsets=(0, 0))}, b""),
    "negative dims cancelling": raw_file({"a": T(shape=(-2, -1), offsets=(0, 8))}, bytes(8)),
    "float shape": raw_file({"a": T(shape=(2.0,))}, bytes(8)),
    "bool shape": raw_file({"a": T(dtype="U8", shape=(True,), offsets=(0, 1))}, bytes(1)),
    "string shape": raw_file({"a": T(shape=("2",))}, bytes(8)),
    "shape not a list": raw_file({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, bytes(8)),
    "shape missing": raw_file({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8)),
    "tensor entry a list": raw_file({"a": ["F32", [2], [0, 8]]}, bytes(8)),
    "metadata a list": raw_file({"__metadata__": ["a"]}, b""),
    "metadata with a number": raw_file({"__metadata__": {"a": 1}}, b""),
    "metadata with null": raw_file({"__metadata__": {"a": None}}, b""),
}


@pytest.mark.parametrize("case", sorted(REJECT))
def test_hostile_headers_are_rejected(case):
    with pytest.raises(CheckpointError):
        parse_bytes(REJECT[case])


def test_prefix_shorter_than_the_declared_header_is_rejected():
    data = raw_file({"a": T()}, bytes(8))
    with pytest.raises(CheckpointError):
        parse_safetensors_header(data[:20], len(data), "x")


def test_deeply_nested_header_is_a_checkpoint_error():
    """Hostile JSON nesting must not escape as RecursionError."""
    with pytest.raises(CheckpointError):
        parse_bytes(raw_file(b"[" * 100_000 + b"]" * 100_000))
    with pytest.raises(CheckpointError):
        parse_bytes(raw_file(b'{"a":' * 50_000 + b"1" + b"}" * 50_000))


def _valid_file() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "b": T("BF16", (3,), (8, 14)),
        "a": T(),
        "s": T("I64", (), (14, 22)),
        "e": T("U8", (0, 2), (22, 22)),
    }
    return raw_file(header, bytes(range(22)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_files_raise_only_checkpoint_errors(data):
    buf = bytearray(_valid_file())
    for _ in range(data.draw(st.integers(1, 5))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "length"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = data.draw(st.sampled_from(list(b'{}[]",:-0123456789.eE \x00\xff')))
        elif op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=6))
        elif op == "delete":
            del buf[pos : pos + data.draw(st.integers(1, 6))]
        elif op == "truncate":
            del buf[pos:]
        elif op == "length" and len(buf) >= 8:
            buf[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    size = data.draw(st.sampled_from([len(buf), len(buf) + 1, max(0, len(buf) - 1), 2**40]))
    try:
        segs = parse_safetensors_header(bytes(buf), size, "fuzz")
    except CheckpointError:
        return
    assert segs[0].begin == 0 and segs[-1].end == size


JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**65), 2**65),
        st.floats(),
        st.text(max_size=8),
        st.sampled_from(list(ITEMSIZE) + ["F4", "dtype", "shape", "data_offsets", "__metadata__"]),
    ),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "a", "b"]) | st.text(max_size=4),
            kids,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(JSON, st.integers(0, 64))
def test_arbitrary_json_headers_raise_only_checkpoint_errors(header, data_len):
    try:
        parse_bytes(raw_file(json.dumps(header).encode(), bytes(data_len)))
    except CheckpointError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 200))
def test_arbitrary_bytes_raise_only_checkpoint_errors(data, size):
    try:
        parse_safetensors_header(data, size, "x")
    except CheckpointError:
        pass


# --- directory scan ----------------------------------------------------------------------------------------
def make_tree(root: Path) -> None:
    write_safetensors(root / "model.safetensors", {"w": ("F32", (2,), bytes(8))})
    (root / "sub" / "deeper").mkdir(parents=True)
    write_safetensors(root / "sub" / "part.safetensors", {"x": ("U8", (3,), b"abc"), "y": ("I16", (1,), b"\x01\x02")})
    (root / "sub" / "deeper" / "tok.json").write_text('{"a": 1}')
    (root / "config.json").write_text("{}")
    (root / "empty.bin").write_bytes(b"")
    (root / ".hidden").write_text("h")
    (root / "sub" / ".weightsync").mkdir()  # only the top-level state folder is skipped
    (root / "sub" / ".weightsync" / "kept").write_text("k")
    (root / ".weightsync" / "staging").mkdir(parents=True)
    (root / ".weightsync" / "state.json").write_text("{}")
    (root / ".weightsync" / "staging" / "model.safetensors").write_bytes(b"junk")
    (root / "emptydir").mkdir()


def test_scan_nested_directories(tmp_path):
    make_tree(tmp_path)
    files = scan_checkpoint(tmp_path)
    assert [f.path for f in files] == sorted(
        [
            ".hidden",
            "config.json",
            "empty.bin",
            "model.safetensors",
            "sub/.weightsync/kept",
            "sub/deeper/tok.json",
            "sub/part.safetensors",
        ]
    )
    by = {f.path: f for f in files}
    for f in files:
        assert f.abspath == tmp_path / f.path and f.size == os.path.getsize(f.abspath)
        assert f.segments[0].begin == 0 and f.segments[-1].end == f.size
    assert by["sub/part.safetensors"].kind == "safetensors"
    assert [s.name for s in by["sub/part.safetensors"].segments] == ["", "x", "y"]
    blob = by["sub/deeper/tok.json"]
    assert blob.kind == "blob" and len(blob.segments) == 1
    seg = blob.segments[0]
    assert (seg.role, seg.name, seg.dtype, seg.shape, seg.begin, seg.end) == ("blob", "", "U8", (8,), 0, 8)
    assert by["empty.bin"].segments[0].nbytes == 0


def test_scan_reads_the_bytes_it_describes(tmp_path):
    make_tree(tmp_path)
    f = next(f for f in scan_checkpoint(tmp_path) if f.path == "sub/part.safetensors")
    fd = os.open(f.abspath, os.O_RDONLY)
    try:
        got = {s.name: read_range(fd, s.begin, s.end, f.path).tobytes() for s in f.segments[1:]}
    finally:
        os.close(fd)
    assert got == {"x": b"abc", "y": b"\x01\x02"}


def test_read_range_of_a_shrunk_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError):
            read_range(fd, 0, 10, "f")
    finally:
        os.close(fd)


def test_scan_missing_directory(tmp_path):
    with pytest.raises(CheckpointError):
        scan_checkpoint(tmp_path / "nope")


def test_scan_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError):
        scan_checkpoint(tmp_path / "f")


@pytest.mark.parametrize("layout", ["nothing", "empty dirs", "only state"])
def test_scan_empty_directory(tmp_path, layout):
    if layout == "empty dirs":
        (tmp_path / "a" / "b").mkdir(parents=True)
    elif layout == "only state":
        (tmp_path / ".weightsync").mkdir()
        (tmp_path / ".weightsync" / "state.json").write_text("{}")
    with pytest.raises(CheckpointError):
        scan_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "content",
    [b"", b"\x01", REJECT["hole between tensors"], REJECT["trailing garbage"], REJECT["header length beyond file"]],
)
def test_scan_rejects_a_broken_safetensors_file(tmp_path, content):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError):
        scan_checkpoint(tmp_path)


def test_scan_rejects_a_file_name_that_cannot_be_stored(tmp_path):
    """A name the manifest could not hold (a backslash) is a checkpoint problem, reported as one."""
    (tmp_path / "a\\b.json").write_text("{}")
    with pytest.raises(CheckpointError):
        scan_checkpoint(tmp_path)


def test_scan_follows_symlinks_to_folders_as_to_files(tmp_path):
    """Hugging Face cache snapshots are symlinks: a linked folder is published as if it were there."""
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_tree(elsewhere)
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "shards").symlink_to(elsewhere / "sub")
    (ckpt / "again").symlink_to("shards")  # the same folder reached twice: published under both names
    (ckpt / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    paths = [f.path for f in scan_checkpoint(ckpt)]
    linked = [".weightsync/kept", "deeper/tok.json", "part.safetensors"]
    assert paths == sorted(
        ["config.json", "model.safetensors", *(f"shards/{p}" for p in linked), *(f"again/{p}" for p in linked)]
    )


@pytest.mark.parametrize("target", [".", "..", "../.."], ids=["itself", "its parent", "the root"])
def test_scan_refuses_a_symlink_loop(tmp_path, target):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.json").write_text("{}")
    (tmp_path / "a" / "b" / "loop").symlink_to(target)
    with pytest.raises(CheckpointError, match="loop"):
        scan_checkpoint(tmp_path)


def test_scan_refuses_a_dangling_symlink(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="gone"):
        scan_checkpoint(tmp_path)


@pytest.mark.parametrize("kind", ["file", "symlink to a folder", "symlink to a file"])
def test_scan_refuses_a_top_level_weightsync_that_is_not_the_state_folder(tmp_path, kind):
    """The name is reserved (a version cannot hold it): refused, not left out without a word."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    if kind == "file":
        (tmp_path / ".weightsync").write_text("mine")
    else:
        (tmp_path / ".weightsync").symlink_to(
            tmp_path / ("elsewhere" if kind == "symlink to a folder" else "config.json")
        )
    with pytest.raises(CheckpointError, match=r"\.weightsync.*reserved"):
        scan_checkpoint(tmp_path)
    assert ".weightsync" not in [f.path for f in scan_checkpoint(tmp_path, ignore=(".weightsync",))]


def test_scan_of_a_very_deep_tree(tmp_path):
    d = str(tmp_path)
    for _ in range(1100):  # deeper than Python's recursion limit
        d += "/d"
        os.mkdir(d)
    Path(d, "x.json").write_text("{}")
    try:  # walked without recursion, then refused in one line: no version can hold such a path
        with pytest.raises(CheckpointError, match="over 255 components"):
            scan_checkpoint(tmp_path)
    finally:  # shutil.rmtree recurses too: take the tree down level by level
        os.unlink(Path(d, "x.json"))
        while d != str(tmp_path):
            os.rmdir(d)
            d = os.path.dirname(d)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder")
def test_scan_refuses_an_unreadable_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "x.json").write_text("{}")
    (tmp_path / "locked").chmod(0)
    try:
        with pytest.raises(CheckpointError, match="locked"):
            scan_checkpoint(tmp_path)
    finally:
        (tmp_path / "locked").chmod(0o755)


# --- a file that changes between the scan and the read ------------------------------------------------------
def _scanned_shard(tmp_path: Path):
    write_safetensors(tmp_path / "m.safetensors", {"a": ("F32", (4,), bytes(16)), "b": ("U8", (8,), bytes(8))})
    return describe_file(tmp_path / "m.safetensors", "m.safetensors")


def _replace(p: Path) -> None:
    write_safetensors(p, {"a": ("F32", (4,), bytes(16)), "b": ("U8", (8,), bytes(8))}, {"moved": "offsets"})


def _append(p: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"x")


def _truncate(p: Path) -> None:
    os.truncate(p, 10)


def _touch(p: Path) -> None:
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


@pytest.mark.parametrize(
    "change", [_replace, _append, _truncate, _touch, Path.unlink], ids=lambda f: f.__name__.strip("_")
)
def test_a_file_changed_after_the_scan_is_not_opened_as_if_it_were_the_same(tmp_path, change):
    f = _scanned_shard(tmp_path)
    assert f.identity and f.head == f.abspath.read_bytes()[: f.segments[0].end]
    change(f.abspath)
    with pytest.raises(CheckpointChanged, match="m.safetensors"):
        os.close(open_source(f))


@pytest.mark.parametrize("change", [_append, _truncate, _touch], ids=lambda f: f.__name__.strip("_"))
def test_a_file_written_while_it_is_read_is_detected_after_the_read(tmp_path, change):
    f = _scanned_shard(tmp_path)
    fd = open_source(f)
    try:
        check_unchanged(fd, f)
        change(f.abspath)
        with pytest.raises(CheckpointChanged, match="m.safetensors"):
            check_unchanged(fd, f)
    finally:
        os.close(fd)


def test_a_file_replaced_or_removed_after_it_was_opened_is_read_as_scanned(tmp_path):
    f = _scanned_shard(tmp_path)
    data = f.abspath.read_bytes()
    fd = open_source(f)
    try:
        _replace(f.abspath)
        check_unchanged(fd, f)  # the descriptor still reads the file scanned
        f.abspath.unlink()
        check_unchanged(fd, f)
        assert read_range(fd, 0, f.size, f.path).tobytes() == data
    finally:
        os.close(fd)


def test_a_header_changed_in_place_is_detected(tmp_path):
    f = _scanned_shard(tmp_path)
    check_header(f, np.frombuffer(f.head, np.uint8))
    changed = bytearray(f.head)
    changed[-1] ^= 1
    with pytest.raises(CheckpointChanged, match="header changed"):
        check_header(f, np.frombuffer(bytes(changed), np.uint8))


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file"):
        describe_file(tmp_path / "pipe.safetensors", "pipe.safetensors")


@pytest.mark.parametrize("change", [_replace, _append, _touch, Path.unlink], ids=lambda f: f.__name__.strip("_"))
def test_still_as_scanned_tells_a_changed_path(tmp_path, change):
    """What the publisher asks before it links the checkpoint into its cache as the version published."""
    f = _scanned_shard(tmp_path)
    assert still_as_scanned([f])
    change(f.abspath)
    assert not still_as_scanned([f])


def test_a_checkpoint_must_still_be_as_scanned_before_a_commit(tmp_path):
    """A version is one state of the folder: a file rewritten in place with its mtime set back (the
    ctime tells), a file added, or one removed, all refuse the commit; a hard link made elsewhere
    (a backup) does not."""
    from weightsync.local.checkpoint import check_still_as_scanned

    f = _scanned_shard(tmp_path)
    files = scan_checkpoint(tmp_path)
    rescan = lambda: scan_checkpoint(tmp_path)  # noqa: E731
    check_still_as_scanned(files, rescan)
    os.link(f.abspath, tmp_path.parent / "backup.safetensors")
    check_still_as_scanned(files, rescan)
    os.unlink(tmp_path.parent / "backup.safetensors")  # (a write after such a link would go unseen:
    files = rescan()  # the link count no longer tells the two ctime moves apart; docs/RELIABILITY.md)
    (tmp_path / "late.json").write_text("{}")
    with pytest.raises(CheckpointChanged, match="late.json: appeared"):
        check_still_as_scanned(files, rescan)
    (tmp_path / "late.json").unlink()
    st = f.abspath.stat()
    with open(f.abspath, "r+b") as fh:
        fh.seek(st.st_size - 1)
        fh.write(b"\x01")
    os.utime(f.abspath, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CheckpointChanged, match="was modified"):
        check_still_as_scanned(files, rescan)
