"""XXH3-128 that the numba kernels can feed without going back to Python.

A decode hashes its result slice by slice while each is in cache (:data:`streams.SLICE_BYTES`).
Done from Python, each slice costs two hand-offs of the GIL (the kernel's call, then
``hasher.update``): on two threads decoding the 2.03 GiB pair's 8,200 slices those cost 15% of the
decode's time, against two processes (docs/DESIGN.md). :class:`Xxh3` holds its XXH3 state in C
memory, made and fed by the functions of the xxHash library that the ``xxhash`` package is built
from (its extension module exports them); a kernel loops over the slices itself and calls
``XXH3_128bits_update`` through :func:`weightsync.codec.kernels.feed`. The digest is the one ``xxhash.xxh3_128`` gives.

Where that library cannot be loaded or lacks a function (another build of ``xxhash``),
:func:`hasher` returns ``xxhash.xxh3_128()`` and the decoders hash from Python as before.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import numpy as np
import xxhash

log = logging.getLogger("weightsync.codec")


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load():
    """The xxHash library's state functions, from the ``xxhash`` package's extension module."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)  # noqa: SLF001  the library the package is built from
        create, free = lib.XXH3_createState, lib.XXH3_freeState
        reset, digest = lib.XXH3_128bits_reset, lib.XXH3_128bits_digest
        # the runtime dispatch to the CPU's widest vectors where the package has it (the plain
        # update is built for SSE2: 5% slower decodes on an AVX-512 Xeon)
        update = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
    except (AttributeError, OSError) as exc:
        log.info("XXH3 state functions not found (%s): decodes hash from Python", exc)
        return None
    create.restype, create.argtypes = ctypes.c_void_p, []
    free.restype, free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
    update.restype, update.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    digest.restype, digest.argtypes = _Hash128, [ctypes.c_void_p]
    return create, free, reset, update, digest


_LIB = _load()

UPDATE = 0 if _LIB is None else ctypes.cast(_LIB[3], ctypes.c_void_p).value
"""Address of ``XXH3_128bits_update`` (0 where the library is not available), for
:func:`weightsync.codec.kernels.feed`."""


class Xxh3:
    """An XXH3-128 hasher (``update``, ``digest``, ``hexdigest`` as ``xxhash.xxh3_128``'s) whose
    state a kernel can feed: :attr:`state`, with :data:`UPDATE`. Made by :func:`hasher`."""

    def __init__(self) -> None:
        create, free, reset, _, _ = _LIB
        self.state = create()
        if not self.state:
            raise MemoryError("XXH3_createState failed")
        weakref.finalize(self, free, self.state)
        if reset(self.state):
            raise RuntimeError("XXH3_128bits_reset failed")

    def update(self, data) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else None
        arr = np.frombuffer(view, np.uint8) if view is not None else data
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if arr.nbytes and _LIB[3](self.state, arr.ctypes.data, arr.nbytes):  # ctypes drops the GIL
            raise RuntimeError("XXH3_128bits_update failed")

    def digest(self) -> bytes:
        h = _LIB[4](self.state)
        return h.high64.to_bytes(8, "big") + h.low64.to_bytes(8, "big")  # XXH128's canonical form

    def hexdigest(self) -> str:
        return self.digest().hex()


def hasher():
    """A new XXH3-128 hasher: an :class:`Xxh3` where the library's functions load, else
    ``xxhash.xxh3_128()`` (the same digests)."""
    return xxhash.xxh3_128() if _LIB is None else Xxh3()


def native_state(h) -> int:
    """The C state of ``h`` for :func:`weightsync.codec.kernels.feed`, or 0 if it is not an
    :class:`Xxh3` (then its caller feeds ``h`` from Python)."""
    return h.state if isinstance(h, Xxh3) else 0
