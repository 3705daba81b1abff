"""Reading a checkpoint directory: files, safetensors headers validated, byte ranges as arrays.

A file is a sequence of segments that tile it exactly: a ``.safetensors`` file is its header
(length prefix and JSON) followed by its tensors in offset order; any other file is one blob.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dtypes import ITEMSIZE
from .errors import CheckpointError, FormatError
from .format import check_path

MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class SourceSegment:
    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative, "/"-separated
    abspath: Path
    kind: str
    size: int
    segments: tuple[SourceSegment, ...]


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate keys in header")
    return dict(pairs)


def parse_safetensors_header(prefix: bytes, file_size: int, what: str) -> tuple[SourceSegment, ...]:
    """Segments of a safetensors file from its first bytes (at least the header); validates offsets."""
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointError(f"{what}: truncated safetensors file ({file_size} bytes)")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER or 8 + n > file_size or len(prefix) < 8 + n:
        raise CheckpointError(f"{what}: header length {n} exceeds the file ({file_size} bytes)")
    try:
        header = json.loads(prefix[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{what}: corrupt safetensors header ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{what}: safetensors header is not a JSON object")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CheckpointError(f"{what}: __metadata__ must map strings to strings")
            continue
        tensors.append(_tensor_segment(name, info, 8 + n, what))
    tensors.sort(key=lambda s: (s.begin, s.end))
    pos = 8 + n
    for t in tensors:
        if t.begin != pos:
            raise CheckpointError(f"{what}: tensor {t.name!r} at offset {t.begin - 8 - n}, expected {pos - 8 - n} (holes or overlaps)")
        pos = t.end
    if pos != file_size:
        raise CheckpointError(f"{what}: tensors end at byte {pos} but the file has {file_size} (truncated or padded)")
    header_seg = SourceSegment("header", "", "U8", (8 + n,), 0, 8 + n)
    return (header_seg, *tensors)


def _tensor_segment(name: str, info: object, base: int, what: str) -> SourceSegment:
    if not isinstance(info, dict):
        raise CheckpointError(f"{what}: tensor {name!r} entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CheckpointError(f"{what}: tensor {name!r} has unsupported dtype {dtype!r}")
    ints = lambda v, k: isinstance(v, list) and len(v) == k if k else isinstance(v, list)  # noqa: E731
    if not ints(shape, None) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{what}: tensor {name!r} has a bad shape {shape!r}")
    if not ints(offsets, 2) or not all(type(o) is int and o >= 0 for o in offsets):
        raise CheckpointError(f"{what}: tensor {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
        raise CheckpointError(f"{what}: tensor {name!r} offsets [{begin}, {end}) do not fit shape {shape} x {dtype}")
    return SourceSegment("tensor", name, dtype, tuple(shape), base + begin, base + end)


def describe_file(abspath: Path, relpath: str) -> SourceFile:
    try:
        st = os.stat(abspath)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{relpath}: not a regular file")
        size = st.st_size
        if relpath.endswith(".safetensors"):
            with open(abspath, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                head += f.read(min(n, MAX_HEADER + 1))
            return SourceFile(relpath, abspath, "safetensors", size, parse_safetensors_header(head, size, relpath))
    except OSError as exc:
        raise CheckpointError(f"{relpath}: cannot read ({exc.strerror})") from None
    return SourceFile(relpath, abspath, "blob", size, (SourceSegment("blob", "", "U8", (size,), 0, size),))


def scan_checkpoint(directory: str | os.PathLike[str], ignore: tuple[str, ...] = ()) -> list[SourceFile]:
    """Every file under ``directory`` (sorted by path), skipping a top-level ``.weightsync`` and
    paths matching an ``ignore`` glob (e.g. a ``COMPLETE`` marker)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != ".weightsync"]
        dirnames.sort()
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
            if rel == ".weightsync" or any(fnmatch.fnmatchcase(rel, pat) for pat in ignore):
                continue
            try:
                check_path(rel)
            except FormatError as exc:
                raise CheckpointError(f"{root}: cannot publish file {rel!r}: {exc}") from None
            files.append(describe_file(Path(dirpath) / name, rel))
    if not files:
        raise CheckpointError(f"checkpoint directory is empty: {root}")
    return sorted(files, key=lambda f: f.path)


def read_range(fd: int, begin: int, end: int, what: str) -> np.ndarray:
    """Bytes [begin, end) of an open file as a fresh 1-D uint8 array."""
    out = np.empty(end - begin, dtype=np.uint8)
    view, pos = memoryview(out), 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], begin + pos)
        if n == 0:
            raise CheckpointError(f"{what}: file shrank while reading (at byte {begin + pos})")
        pos += n
    return out
