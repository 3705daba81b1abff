"""The manifest and the other stored documents (docs/FORMAT.md): the data model as frozen
dataclasses, their canonical JSON, the head pointer and the store marker.

Pure: JSON in, validated dataclasses out, and back. Everything read from a store is validated here
before any other module trusts it: types, ranges, paths that stay inside the target folder, chunk
references within their chunks, segments that tile each file exactly."""

from __future__ import annotations

import gc
import json
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import xxhash

from weightsync.errors import FormatError
from weightsync.format.dtypes import ITEMSIZE
from weightsync.format.keys import (
    FORMAT_VERSION,
    HEAD_KEY,
    MARKER_KEY,
    MAX_INFO_DEPTH,
    MAX_SHAPE_DIMS,
    MAX_SIZE,
    MAX_VERSION,
    MAX_WORLD,
    check_path,
)

ROLES = ("header", "tensor", "blob")
SEGMENT_CODECS = ("same", "full", "sparse", "dense", "ac", "ans")  # docs/FORMAT.md; a new codec adds its name here
DELTA_CODECS = tuple(c for c in SEGMENT_CODECS if c != "full")  # a keyframe's delta is never in full
REVERSE_CODECS = ("ans",)  # whose payloads may have a reverse payload (docs/FORMAT.md, "Reverse payloads")
REVERSE = "reverse"  # what _payload is told of a reverse payload, which has none of its own
_HEX = re.compile(r"[0-9a-f]{32}")


# --- dataclasses ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A run of a payload's bytes inside one chunk (a payload may span chunks). Stored in the JSON
    field ``parts`` (docs/FORMAT.md); the multi-rank "parts" of sync/parts.py are another thing."""

    chunk: int  # index into Manifest.chunks
    offset: int
    length: int


@dataclass(frozen=True)
class Payload:
    """An encoded byte string (docs/FORMAT.md, "Payloads") of ``size`` bytes with checksum ``xxh3``,
    stored as ``parts``: pieces of chunks, concatenated in order."""

    size: int
    xxh3: str
    parts: tuple[Piece, ...]
    sha256: str = ""  # signed versions: a cryptographic digest too (XXH3 is not one); "" when absent
    reverse: Payload | None = None  # what only a backward decode reads (``ans``'s exception lists), apart

    @staticmethod
    def all_in(m: Manifest) -> Iterator[Payload]:
        """Every payload ``m`` names (segments' and their keyframe deltas', and their reverse payloads)."""
        for f in m.files:
            for s in f.segments:
                for p in (s.payload, None if s.delta is None else s.delta.payload):
                    if p is not None:
                        yield p
                        if p.reverse is not None:
                            yield p.reverse


@dataclass(frozen=True)
class Delta:
    """A keyframe segment's encoding relative to the parent, so followers need not fetch it in full."""

    codec: str  # same | sparse | dense
    changed: int
    payload: Payload | None


@dataclass(frozen=True)
class Segment:
    """A byte range [begin, end) of a file and how its bytes are encoded."""

    role: str  # header | tensor | blob
    name: str  # tensor name; "" for header and blob
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    xxh3: str
    codec: str  # same | full | sparse | dense (the last three relative to the parent's segment)
    changed: int = 0
    payload: Payload | None = None
    delta: Delta | None = None  # keyframes only: the same bytes as a delta from the parent

    @property
    def nbytes(self) -> int:
        """Length of the byte range."""
        return self.end - self.begin

    @property
    def key(self) -> tuple[str, str]:
        """``(role, name)``: what identifies the segment within its file across versions."""
        return (self.role, self.name)


@dataclass(frozen=True)
class FileEntry:
    """One file of a version: its path inside the folder, its kind (``safetensors`` or ``blob``),
    size and checksum, and the segments that tile it exactly."""

    path: str
    kind: str  # safetensors | blob
    size: int
    xxh3: str
    segments: tuple[Segment, ...]

    def segment(self, key: tuple[str, str]) -> Segment | None:
        """The segment with ``key`` (:attr:`Segment.key`; the first one), or None."""
        return self._by_key.get(key)

    @cached_property
    def _by_key(self) -> dict[tuple[str, str], Segment]:  # built once per entry: lookups per tensor stay O(1)
        return {s.key: s for s in reversed(self.segments)}


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of the version: its id (the XXH3-128 of its bytes, hex; the store key derives from it)
    and size. Payload pieces index into :attr:`Manifest.chunks`."""

    id: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """One version (docs/FORMAT.md, "Manifest"): its parent, keyframe flag and delta-chain length,
    its files, the chunks their payloads live in, when it was created, the codec settings and
    informational stats. Immutable once committed; readers trust only manifests at or below the head."""

    version: int
    parent: int | None
    keyframe: bool
    chain_length: int  # deltas since the keyframe: 0 for a keyframe
    files: tuple[FileEntry, ...]
    chunks: tuple[ChunkRef, ...]
    created: str = ""
    codec_config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def file(self, path: str) -> FileEntry | None:
        """The entry of the file at ``path``, or None."""
        return self._by_path.get(path)

    @cached_property
    def _by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in reversed(self.files)}

    @property
    def raw_bytes(self) -> int:
        """Bytes of the version's files, as installed."""
        return sum(f.size for f in self.files)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the payloads stored for this version (its own segments' encodings: what a pull
        forward reads; neither a keyframe's deltas nor reverse payloads, which only rollbacks read)."""
        return sum(s.payload.size for f in self.files for s in f.segments if s.payload)


@dataclass(frozen=True)
class PartManifest:
    """Rank ``rank`` of ``world``'s share of a version published by several processes: its files
    (manifest file entries, payload parts indexing this part's own ``chunks``), not yet a version."""

    version: int
    parent: int | None
    world: int
    rank: int
    keyframe: bool
    chain_length: int
    files: tuple[FileEntry, ...]
    chunks: tuple[ChunkRef, ...]
    created: str = ""
    codec_config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


# --- serialization -------------------------------------------------------------------------------
_gc_lock = threading.Lock()
_gc_paused = 0  # threads inside no_gc()
_gc_was_enabled = False


@contextmanager
def no_gc() -> Iterator[None]:
    """Python's cyclic collector paused: reading or writing the manifest of a large MoE (70k tensors)
    allocates millions of dicts and lists, none of them garbage, and the collections they trigger
    took more than half of the time. Threads may nest and overlap: the first in pauses it, the last
    out restores the setting found by the first."""
    global _gc_paused, _gc_was_enabled
    with _gc_lock:
        if _gc_paused == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_paused += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused -= 1
            if _gc_paused == 0 and _gc_was_enabled:
                gc.enable()


_dumps = partial(json.dumps, separators=(",", ":"), sort_keys=True)


def manifest_to_json(m: Manifest) -> bytes:
    """The manifest's canonical JSON (sorted keys, no spaces), as stored."""
    return _to_json({"format": "weightsync.manifest", "format_version": FORMAT_VERSION, **_shallow(m)})


def part_to_json(p: PartManifest) -> bytes:
    """A part manifest's canonical JSON, as stored."""
    return _to_json({"format": "weightsync.part", "format_version": FORMAT_VERSION, **_shallow(p)})


def _to_json(doc: dict) -> bytes:
    """The canonical serialization (sorted keys, no spaces) with its checksum, each top-level value
    serialized once: the body's bytes are hashed, then the checksum entry is spliced in at its
    sorted place, which is what ``json.dumps`` of the whole document would give."""
    with no_gc():
        doc["files"] = [_file_doc(f) for f in doc["files"]]
        doc["chunks"] = [{"id": c.id, "size": c.size} for c in doc["chunks"]]
        entries = {k: f"{_dumps(k)}:{_dumps(v)}" for k, v in doc.items() if k != "checksum"}
        body = "{" + ",".join(entries[k] for k in sorted(entries)) + "}"
        entries["checksum"] = f'"checksum":"{xxhash.xxh3_128_hexdigest(body.encode())}"'
        return ("{" + ",".join(entries[k] for k in sorted(entries)) + "}").encode()


# Documents built field by field (what ``dataclasses.asdict`` gives, with payload parts as
# [chunk, offset, length] triples): asdict's recursive deep copy took most of the time of writing a
# manifest of tens of thousands of tensors. tests/unit/test_format.py checks both agree.
def _shallow(obj) -> dict:
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}


def _payload_doc(p: Payload | None) -> dict | None:
    return (
        None
        if p is None
        else {
            "size": p.size,
            "xxh3": p.xxh3,
            "parts": [[x.chunk, x.offset, x.length] for x in p.parts],
            **({"sha256": p.sha256} if p.sha256 else {}),
            **({"reverse": _payload_doc(p.reverse)} if p.reverse is not None else {}),
        }
    )


def _segment_doc(s: Segment) -> dict:
    d = s.delta
    return {
        "role": s.role,
        "name": s.name,
        "dtype": s.dtype,
        "shape": s.shape,
        "begin": s.begin,
        "end": s.end,
        "xxh3": s.xxh3,
        "codec": s.codec,
        "changed": s.changed,
        "payload": _payload_doc(s.payload),
        "delta": None if d is None else {"codec": d.codec, "changed": d.changed, "payload": _payload_doc(d.payload)},
    }


def _file_doc(f: FileEntry) -> dict:
    return {
        "path": f.path,
        "kind": f.kind,
        "size": f.size,
        "xxh3": f.xxh3,
        "segments": [_segment_doc(s) for s in f.segments],
    }


def manifest_checksum(doc: dict) -> str:
    """The ``checksum`` a manifest document must carry (tools that write manifests by hand use it)."""
    return _canonical_xxh3(doc)


def _canonical_xxh3(doc: dict) -> str:
    """XXH3-128 of the document without its ``checksum`` field, serialized canonically."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return xxhash.xxh3_128_hexdigest(_dumps(body).encode())


def _show(v: object) -> str:
    """An untrusted JSON value for an error message: short, one line, never a deep ``repr``."""
    items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
    if isinstance(v, (list, dict)) and (len(v) > 16 or any(isinstance(x, (list, dict)) for x in items)):
        return f"<{'array' if isinstance(v, list) else 'object'} of {len(v)}>"
    r = repr(v)  # a scalar, or a short list of scalars / an object with scalar keys
    return r if len(r) <= 80 else f"{r[:77]}..."


def _depth_at_most(v: object, limit: int) -> bool:
    """Whether the JSON value ``v`` nests at most ``limit`` arrays/objects deep (iterative)."""
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d >= limit:
                return False
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _load_json(data: bytes, what: str) -> dict:
    try:
        doc = json.loads(data)
    except RecursionError:
        raise FormatError(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what}: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{what}: expected a JSON object")
    return doc


def _get(doc: dict, key: str, typ: type | tuple, what: str) -> Any:
    val = doc.get(key)
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise FormatError(f"{what}: field {key!r} missing or of the wrong type")
    return val


def _int(doc: dict, key: str, what: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
    val = _get(doc, key, int, what)
    if isinstance(val, bool) or not lo <= val <= hi:
        raise FormatError(f"{what}: field {key!r}={_show(val)} out of range [{lo}, {hi}]")
    return val


def _hex(doc: dict, key: str, what: str) -> str:
    val = _get(doc, key, str, what)
    if not _HEX.fullmatch(val):
        raise FormatError(f"{what}: field {key!r} is not a 128-bit hex checksum")
    return val


# The readers below run once per tensor (70k times for a large MoE): checks are inlined on the
# exact types JSON produces (``type(x) is int`` also refuses bools) and the helpers above only
# run to word the error.
def _payload(doc: Any, chunks: tuple[ChunkRef, ...], what: str, codec: str = "") -> Payload:
    """A payload of ``codec`` (which says whether it may have a reverse payload; none when not given)."""
    if type(doc) is not dict:
        raise FormatError(f"{what}: payload must be an object")
    size, raw_parts, xxh3 = doc.get("size"), doc.get("parts"), doc.get("xxh3")
    if type(size) is not int or not 0 <= size <= MAX_SIZE or type(raw_parts) is not list:
        _int(doc, "size", what)
        _get(doc, "parts", list, what)
    parts, total, n = [], 0, len(chunks)
    for raw in raw_parts:
        if type(raw) is not list or len(raw) != 3:
            raise FormatError(f"{what}: a part must be [chunk, offset, length]")
        ci, off, length = raw
        if type(ci) is not int or type(off) is not int or type(length) is not int:
            raise FormatError(f"{what}: a part must be [chunk, offset, length]")
        if not (0 <= ci < n and off >= 0 and length > 0 and off + length <= chunks[ci].size):
            raise FormatError(f"{what}: part {raw} lies outside its chunk")
        parts.append(Piece(ci, off, length))
        total += length
    if total != size:
        raise FormatError(f"{what}: parts add up to {total} bytes, not {size}")
    if type(xxh3) is not str or not _HEX.fullmatch(xxh3):
        _hex(doc, "xxh3", what)
    sha256 = doc.get("sha256", "")
    if sha256 and (type(sha256) is not str or not re.fullmatch(r"[0-9a-f]{64}", sha256)):
        raise FormatError(f"{what}: sha256 must be 64 lowercase hex digits")
    reverse = doc.get("reverse")
    if reverse is not None:
        if codec == REVERSE:
            raise FormatError(f"{what}: a reverse payload has none of its own")
        if codec not in REVERSE_CODECS:
            raise FormatError(f"{what}: only a payload of {', '.join(REVERSE_CODECS)} has a reverse payload")
        reverse = _payload(reverse, chunks, f"{what} reverse", REVERSE)
    return Payload(size, xxh3, tuple(parts), sha256, reverse)


def _segment(doc: Any, chunks: tuple[ChunkRef, ...], what: str) -> Segment:
    if type(doc) is not dict:
        raise FormatError(f"{what}: segment must be an object")
    g = doc.get
    role, codec, dtype, name, shape = g("role"), g("codec"), g("dtype"), g("name"), g("shape")
    if (
        type(role) is not str
        or type(codec) is not str
        or type(dtype) is not str
        or type(name) is not str
        or type(shape) is not list
    ):
        for key, typ in (("role", str), ("codec", str), ("dtype", str), ("name", str), ("shape", list)):
            _get(doc, key, typ, what)
    if role not in ROLES or codec not in SEGMENT_CODECS or dtype not in ITEMSIZE:
        raise FormatError(f"{what}: unknown role, codec or dtype ({_show(role)}, {_show(codec)}, {_show(dtype)})")
    if len(shape) > MAX_SHAPE_DIMS:
        raise FormatError(f"{what}: bad shape {_show(shape)}")
    count = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_SIZE:
            raise FormatError(f"{what}: bad shape {_show(shape)}")
        count *= d
    begin, end, changed, xxh3 = g("begin"), g("end"), g("changed"), g("xxh3")
    if not (
        type(begin) is int
        and type(end) is int
        and type(changed) is int
        and 0 <= begin <= MAX_SIZE
        and 0 <= end <= MAX_SIZE
        and 0 <= changed <= MAX_SIZE
    ):
        for key in ("begin", "end", "changed"):
            _int(doc, key, what)
    if end < begin or count * ITEMSIZE[dtype] != end - begin:
        raise FormatError(f"{what}: [{begin}, {end}) does not hold {shape} x {dtype}")
    raw_payload, raw_delta = g("payload"), g("delta")
    payload = None
    if codec != "same":
        payload = _payload(raw_payload, chunks, what, codec)
    elif raw_payload is not None:
        raise FormatError(f"{what}: codec 'same' has no payload")
    delta = None if raw_delta is None else _delta(raw_delta, chunks, what)
    if delta is not None and codec != "full":
        raise FormatError(f"{what}: only a full segment carries a delta")
    if type(xxh3) is not str or not _HEX.fullmatch(xxh3):
        _hex(doc, "xxh3", what)
    return Segment(role, name, dtype, tuple(shape), begin, end, xxh3, codec, changed, payload, delta)


def _delta(doc: Any, chunks: tuple[ChunkRef, ...], what: str) -> Delta:
    if not isinstance(doc, dict) or doc.get("codec") not in DELTA_CODECS:
        raise FormatError(f"{what}: delta must be an object with codec {', '.join(DELTA_CODECS)}")
    if doc["codec"] == "same" and doc.get("payload") is not None:
        raise FormatError(f"{what}: a 'same' delta has no payload")
    payload = None if doc["codec"] == "same" else _payload(doc.get("payload"), chunks, f"{what} delta", doc["codec"])
    return Delta(doc["codec"], _int(doc, "changed", what), payload)


def _file(doc: Any, chunks: tuple[ChunkRef, ...], what: str) -> FileEntry:
    if not isinstance(doc, dict):
        raise FormatError(f"{what}: file entry must be an object")
    try:
        path = check_path(_get(doc, "path", str, what))
    except FormatError as exc:
        raise FormatError(f"{what}: {exc}") from None
    what = f"{what} {path}"
    kind, size = _get(doc, "kind", str, what), _int(doc, "size", what)
    segs = tuple(_segment(s, chunks, f"{what} segment {i}") for i, s in enumerate(_get(doc, "segments", list, what)))
    pos = 0
    for s in segs:
        if s.begin != pos:
            raise FormatError(f"{what}: segments do not tile the file at offset {pos}")
        pos = s.end
    if pos != size or kind not in ("safetensors", "blob"):
        raise FormatError(f"{what}: segments cover {pos} of {size} bytes (kind {_show(kind)})")
    if len({s.key for s in segs}) != len(segs):
        raise FormatError(f"{what}: duplicate segment names")
    return FileEntry(path, kind, size, _hex(doc, "xxh3", what), segs)


def manifest_from_json(data: bytes, what: str = "manifest") -> Manifest:
    """Parse and validate a stored manifest; :class:`FormatError` names what is wrong."""
    with no_gc():
        doc = _sealed(data, "weightsync.manifest", what)
        return Manifest(*_body(doc, what), **_info(doc, what))


def part_from_json(data: bytes, what: str = "part") -> PartManifest:
    """A rank's part (docs/FORMAT.md section 6), validated as a manifest is, plus its rank and world."""
    with no_gc():
        doc = _sealed(data, "weightsync.part", what)
        version, parent, keyframe, chain, files, chunks = _body(doc, what)
        world = _int(doc, "world", what, 1, MAX_WORLD)
        rank = _int(doc, "rank", what, 0, world - 1)
        return PartManifest(version, parent, world, rank, keyframe, chain, files, chunks, **_info(doc, what))


def _sealed(data: bytes, kind: str, what: str) -> dict:
    doc = _load_json(data, what)
    if doc.get("format") != kind or doc.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{what}: not a {kind.replace('.', ' ')} of format version {FORMAT_VERSION}")
    try:
        checksum = _canonical_xxh3(doc)
    except RecursionError:  # parsed, but too deep to serialize again
        raise FormatError(f"{what}: JSON nested too deeply") from None
    if doc.get("checksum") != checksum:
        raise FormatError(f"{what}: {kind.split('.')[1]} checksum mismatch (damaged in storage or in transit)")
    return doc


def _info(doc: dict, what: str) -> dict:
    """The informational fields (readers must not need them); objects nested deeper than
    MAX_INFO_DEPTH are refused, so nothing deep leaves this module."""
    info = {"created": doc.get("created") if isinstance(doc.get("created"), str) else ""}
    for key in ("codec_config", "stats"):
        v = doc.get(key)
        info[key] = v if isinstance(v, dict) else {}
        if not _depth_at_most(v, MAX_INFO_DEPTH):
            raise FormatError(f"{what}: field {key!r} nested more than {MAX_INFO_DEPTH} deep")
    return info


def _body(doc: dict, what: str) -> tuple[int, int | None, bool, int, tuple[FileEntry, ...], tuple[ChunkRef, ...]]:
    """``version, parent, keyframe, chain_length, files, chunks`` of a manifest or part, validated."""
    version = _int(doc, "version", what, 0, MAX_VERSION)
    parent = doc.get("parent")
    if parent is not None and (type(parent) is not int or not 0 <= parent < version):
        raise FormatError(f"{what}: parent {_show(parent)} must be an earlier version")
    keyframe = _get(doc, "keyframe", bool, what)
    chunks = []
    for c in _get(doc, "chunks", list, what):
        if not isinstance(c, dict):
            raise FormatError(f"{what}: chunk entry must be an object")
        chunks.append(ChunkRef(_hex(c, "id", what), _int(c, "size", what, 1)))
    chunks_t = tuple(chunks)
    files = tuple(_file(f, chunks_t, what) for f in _get(doc, "files", list, what))
    check_paths_disjoint([f.path for f in files], what)
    if keyframe and any(s.codec != "full" for f in files for s in f.segments):
        raise FormatError(f"{what}: a keyframe holds only full segments")
    if (not keyframe or parent is None) and any(s.delta for f in files for s in f.segments):
        raise FormatError(f"{what}: only a keyframe with a parent carries deltas")
    if not keyframe and parent is None:
        raise FormatError(f"{what}: a delta version needs a parent")
    chain = _int(doc, "chain_length", what, 0, MAX_VERSION)
    if keyframe != (chain == 0):
        raise FormatError(f"{what}: chain_length {chain} disagrees with keyframe={keyframe}")
    return version, parent, keyframe, chain, files, chunks_t


def check_paths_disjoint(paths: list[str], what: str) -> None:
    """No path twice, none under another (a file cannot also be a folder)."""
    unique = set(paths)
    if len(unique) != len(paths):
        raise FormatError(f"{what}: duplicate file paths")
    tree: dict = {}  # folder name -> its tree; file name -> None. Linear in the paths' length
    for p in paths:
        *folders, name = p.split("/")
        node = tree
        for i, part in enumerate(folders):
            sub = node.setdefault(part, {})
            if sub is None:
                raise FormatError(f"{what}: {p!r} lies under file {'/'.join(folders[: i + 1])!r}")
            node = sub
        if name in node:  # a folder already (a path twice was refused above)
            inner, under = node[name], [name]
            while inner:  # down to one file under it
                key = next(iter(inner))
                inner, under = inner[key], [*under, key]
            raise FormatError(f"{what}: {'/'.join([*folders, *under])!r} lies under file {p!r}")
        node[name] = None


# --- head pointer and store marker ---------------------------------------------------------------
def head_to_json(version: int) -> bytes:
    """The head pointer's document for ``version``."""
    return json.dumps({"format": "weightsync.head", "version": version}).encode()


def head_from_json(data: bytes) -> int:
    """The version a head pointer names, validated."""
    doc = _load_json(data, HEAD_KEY)
    if doc.get("format") != "weightsync.head":
        raise FormatError(f"{HEAD_KEY}: not a weightsync head pointer")
    return _int(doc, "version", HEAD_KEY, 0, MAX_VERSION)


def lazy_candidates(m: Manifest | PartManifest) -> frozenset[str]:
    """The chunks of keyframe ``m`` (a manifest, or a rank's part of one) that only its full
    payloads use, on segments that also carry a delta from the parent: a follower of the parent
    never reads them. Empty for a non-keyframe and for a keyframe without a parent. Pure."""
    if not m.keyframe or m.parent is None:
        return frozenset()
    full: set[str] = set()
    other: set[str] = set()  # delta payloads, and full payloads a follower still needs (no delta)
    for f in m.files:
        for s in f.segments:
            if s.payload is not None:
                (full if s.delta is not None else other).update(m.chunks[p.chunk].id for p in s.payload.parts)
            if s.delta is not None and s.delta.payload is not None:
                other.update(m.chunks[p.chunk].id for p in s.delta.payload.parts)
                if s.delta.payload.reverse is not None:  # a rollback past the keyframe reads it
                    other.update(m.chunks[p.chunk].id for p in s.delta.payload.reverse.parts)
    return frozenset(full - other)


def lazy_to_json(version: int, chunks: Iterable[str]) -> bytes:
    """The note of ``version``'s chunks a mirror left out of this store for now (docs/FORMAT.md section 1)."""
    ids = sorted(set(chunks))
    return json.dumps({"format": "weightsync.lazy", "version": version, "chunks": ids}).encode()


def lazy_from_json(data: bytes, what: str) -> tuple[int, frozenset[str]]:
    """``(version, chunk ids)`` of a lazy-chunks note, validated."""
    doc = _load_json(data, what)
    if doc.get("format") != "weightsync.lazy":
        raise FormatError(f"{what}: not a weightsync lazy-chunks note")
    version = _int(doc, "version", what, 0, MAX_VERSION)
    ids = doc.get("chunks")
    if not isinstance(ids, list) or not all(isinstance(i, str) and _HEX.fullmatch(i) for i in ids):
        raise FormatError(f"{what}: chunks must be a list of 32-hex-digit chunk ids")
    return version, frozenset(ids)


def marker_to_json() -> bytes:
    """The store marker's document (``weightsync.json``)."""
    return json.dumps({"format": "weightsync.store", "format_version": FORMAT_VERSION}).encode()


def check_marker(data: bytes) -> None:
    """Raise :class:`FormatError` unless ``data`` is a marker of a format version this code reads."""
    doc = _load_json(data, MARKER_KEY)
    if doc.get("format") != "weightsync.store":
        raise FormatError(f"{MARKER_KEY}: not a weightsync store marker")
    if doc.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{MARKER_KEY}: store format version {_show(doc.get('format_version'))} is not supported")
