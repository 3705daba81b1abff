"""What the zstd codecs share (docs/FORMAT.md, "Payloads"): byte planes, zigzag codes, zstd frames
(one compression context per thread and level), and copying a base into the output while hashing.

All of it is bit-exact integer work on unsigned views, and thread-safe.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from weightsync.codec import hashing
from weightsync.errors import FormatError
from weightsync.format.dtypes import INT_VIEW, UINT_VIEW

SLICE_BYTES = 256 << 10
"""Decode+verify works in slices this size, so hashing reads from cache (L2): a slice's source and
result both stay there (with 512 KiB slices, decode+verify of the 2.03 GiB pair's 4 MiB tensors took
6-8% longer, `ans` and `sparse` alike; 128 KiB ones 1-1.5% longer, calls' overhead)."""


# --- zstd contexts are not thread-safe: one per thread and level ---------------------------------
_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor at ``level``. Every stream is byte planes (of gaps, of changes, of
    whole tensors), where a match shorter than 7 bytes rarely pays and a small match table stays
    in cache: at level 1 (the default) on the codec trajectories, against plain level 1, delta
    streams code 1.2-1.3x faster and 1-2% smaller, and bf16 tensors in full 1.5x faster and 1-2%
    smaller (2.6x faster and 4% smaller than level 3)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, min_match=7, hash_log=10, write_content_size=True
        )
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def decompress(data: bytes | memoryview, expected: int, what: str) -> bytes:
    """Decompress one frame whose declared size must be exactly ``expected`` (no bombs)."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: not a zstd frame ({exc})") from None
    if declared != expected:
        raise FormatError(f"{what}: frame declares {declared} bytes, expected {expected}")
    if "decompressor" not in _local.__dict__:
        _local.decompressor = zstandard.ZstdDecompressor()
    try:
        out = _local.decompressor.decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(out) != expected:
        raise FormatError(f"{what}: decompressed {len(out)} bytes, expected {expected}")
    return out


# --- integer helpers -----------------------------------------------------------------------------
def to_planes(values: np.ndarray) -> np.ndarray:
    """Split little-endian unsigned integers into byte planes (uint8): all low bytes, then the next
    bytes, ..."""
    from weightsync.codec.kernels import split_planes  # numba: imported on first use, not with weightsync

    return split_planes(values)


def from_planes(data: bytes | np.ndarray, width: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """The ``count`` integers of ``width`` bytes whose byte planes ``data`` holds, into ``out`` if given."""
    from weightsync.codec.kernels import merge_planes

    out = np.empty(count, UINT_VIEW[width]) if out is None else out
    return merge_planes(read_only_bytes(data), out)


def read_only_bytes(data: bytes | bytearray | memoryview | np.ndarray, offset: int = 0) -> np.ndarray:
    """``data`` from ``offset`` as a read-only uint8 array, whether its buffer is writable (a bytearray)
    or not (bytes, as fetched): a kernel that reads a payload is then compiled for one array type, not
    one per buffer's writability (each another whole compile with a cold cache)."""
    view = np.frombuffer(data, dtype=np.uint8, offset=offset)
    view.flags.writeable = False  # this array only, not the buffer under it
    return view


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map wrapping differences (as unsigned) to small unsigned codes: 0,-1,1,-2,2 -> 0,1,2,3,4."""
    width = diff.dtype.itemsize
    s = diff.view(INT_VIEW[width])
    return ((s << 1) ^ (s >> (8 * width - 1))).view(UINT_VIEW[width])


def unzigzag(code: np.ndarray) -> np.ndarray:
    """The inverse of :func:`zigzag`: wrapping differences back from their zigzag codes."""
    width = code.dtype.itemsize
    s = code.view(INT_VIEW[width])
    return ((code >> 1).view(INT_VIEW[width]) ^ -(s & 1)).view(UINT_VIEW[width])


# --- buffers -------------------------------------------------------------------------------------
def copy(src: np.ndarray, dst: np.ndarray, hasher=None) -> None:
    """``dst[:] = src`` (nothing to copy when they are one buffer), feeding ``hasher`` slice by
    slice while each slice is in cache."""
    if same_memory(src, dst):
        if hasher is not None:
            hasher.update(dst)
        return
    if hasher is None:
        np.copyto(dst, src)
        return
    step = max(1, SLICE_BYTES // src.dtype.itemsize)
    state = hashing.native_state(hasher)
    fits = src.dtype == dst.dtype and src.shape == dst.shape and src.flags.c_contiguous and dst.flags.c_contiguous
    if state and fits and dst.flags.writeable and not np.may_share_memory(src, dst):
        from weightsync.codec.kernels import copy_feeding  # numba: imported where a kernel can feed

        if copy_feeding(src.reshape(-1), dst.reshape(-1), hashing.UPDATE, state, step):  # in one call
            raise RuntimeError(hashing.FEED_FAILED)
        return
    for a in range(0, src.size, step):
        np.copyto(dst[a : a + step], src[a : a + step])
        hasher.update(dst[a : a + step])


def same_memory(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether ``a`` and ``b`` are the same buffer (same start, same size)."""
    return a is not None and b is not None and a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes
