"""The safetensors header (the library's file layout): a length prefix, a JSON header, then the
tensors in offset order. Parsed and validated into the segments that tile the file exactly."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from weightsync.errors import CheckpointError
from weightsync.format.dtypes import ITEMSIZE
from weightsync.format.keys import MAX_SHAPE_DIMS, MAX_SIZE

MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class SourceSegment:
    """A byte range [begin, end) of a checkpoint file: its header, one tensor (name, dtype, shape) or
    a whole non-safetensors file (a blob)."""

    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def key(self) -> tuple[str, str]:
        """``(role, name)``, as :attr:`weightsync.format.manifest.Segment.key`."""
        return (self.role, self.name)

    @property
    def nbytes(self) -> int:
        """Length of the byte range."""
        return self.end - self.begin


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
            raise CheckpointError(
                f"{what}: tensor {t.name!r} at offset {t.begin - 8 - n}, expected {pos - 8 - n} (holes or overlaps)"
            )
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
    if len(shape) > MAX_SHAPE_DIMS or any(d > MAX_SIZE for d in shape):  # docs/FORMAT.md: readers refuse these
        raise CheckpointError(
            f"{what}: tensor {name!r} has a shape the format cannot store (more than "
            f"{MAX_SHAPE_DIMS} dimensions, or one above 2^50): {shape!r}"
        )
    if not ints(offsets, 2) or not all(type(o) is int and o >= 0 for o in offsets):
        raise CheckpointError(f"{what}: tensor {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
        raise CheckpointError(f"{what}: tensor {name!r} offsets [{begin}, {end}) do not fit shape {shape} x {dtype}")
    return SourceSegment("tensor", name, dtype, tuple(shape), base + begin, base + end)
