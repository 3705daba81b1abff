"""XXH3-128 that the numba kernels can feed without going back to Python.

A decode hashes its result slice by slice while each is in cache (:data:`streams.SLICE_BYTES`).
Done from Python, each slice costs two hand-offs of the GIL (the kernel's call, then
``hasher.update``): on two threads decoding the 2.03 GiB pair's 8,200 slices those cost 13-14% of
the decode's time (docs/DESIGN.md, "Hashing as it writes"). :class:`Xxh3` holds its XXH3 state in
C memory, made and fed by the functions of the xxHash library that the ``xxhash`` package is built
from (its extension module exports them); a kernel loops over the slices itself and calls the
update through :func:`weightsync.codec.kernels.feed`. The digest is the one ``xxhash.xxh3_128``
gives.

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


RELEASE_GIL_FROM = 64 << 10
"""An update of at least this many bytes drops the GIL while it hashes; the state's other calls
(made, reset, read out: a microsecond or so through ctypes) keep it. (On two threads
decoding the small model's 0.6 MB tensors, dropping it for those too measured the same, within
the run-to-run noise of 16-19 ms a pass.)"""


class _Lib:
    """The xxHash library's XXH3-128 state functions, from the ``xxhash`` package's extension module
    (it exports them): each through ``ctypes.PyDLL`` (the GIL kept), and the update also through
    ``ctypes.CDLL`` (the GIL dropped). The update is the runtime dispatch to the CPU's widest
    vectors where the package has it (the plain one is built for SSE2: decodes took 5% longer on an
    AVX-512 Xeon)."""

    def __init__(self, path: str) -> None:
        keep, drop = ctypes.PyDLL(path), ctypes.CDLL(path)
        name = (
            "XXH3_128bits_update_dispatch" if hasattr(keep, "XXH3_128bits_update_dispatch") else "XXH3_128bits_update"
        )
        self.create, self.free = keep.XXH3_createState, keep.XXH3_freeState
        self.reset, self.digest = keep.XXH3_128bits_reset, keep.XXH3_128bits_digest
        self.update, self.update_nogil = getattr(keep, name), getattr(drop, name)
        self.create.restype, self.create.argtypes = ctypes.c_void_p, []
        for fn in (self.free, self.reset):
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
        for fn in (self.update, self.update_nogil):
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.digest.restype, self.digest.argtypes = _Hash128, [ctypes.c_void_p]
        self.address = ctypes.cast(self.update_nogil, ctypes.c_void_p).value


def _load() -> _Lib | None:
    try:
        return _Lib(xxhash._xxhash.__file__)  # noqa: SLF001  the library the package is built from
    except (AttributeError, OSError) as exc:
        log.info("XXH3 state functions not found (%s): decodes hash from Python", exc)
        return None


_LIB = _load()

UPDATE = 0 if _LIB is None else _LIB.address
"""Address of the library's XXH3-128 update (0 where it is not available), for
:func:`weightsync.codec.kernels.feed`."""


FEED_FAILED = "a kernel's XXH3 update failed, or refused a range it could not read safely"
"""The error of a decode whose kernel could not feed its hasher (``kernels.feed``'s nonzero codes)."""


class Xxh3:
    """An XXH3-128 hasher (``update``, ``digest``, ``hexdigest`` as ``xxhash.xxh3_128``'s) whose
    state a kernel can feed: :attr:`state`, with :data:`UPDATE`. Made by :func:`hasher`. It cannot
    be copied or pickled (a copy would share, then outlive, the C state), as ``xxhash``'s cannot be
    pickled."""

    __slots__ = ("state", "__weakref__")

    def __init__(self) -> None:
        self.state = _LIB.create()
        if not self.state:
            raise MemoryError("XXH3_createState failed")
        # freed with the object, not at exit: a daemon thread may still be feeding it then
        weakref.finalize(self, _LIB.free, self.state).atexit = False
        if _LIB.reset(self.state):
            raise RuntimeError("XXH3_128bits_reset failed")

    def __reduce__(self):
        raise TypeError("an Xxh3 hasher cannot be pickled or copied (its state is C memory)")

    def __copy__(self):
        raise TypeError("an Xxh3 hasher cannot be copied (its state is C memory)")

    def __deepcopy__(self, memo):
        raise TypeError("an Xxh3 hasher cannot be copied (its state is C memory)")

    def update(self, data) -> None:
        arr = data if isinstance(data, np.ndarray) else np.frombuffer(memoryview(data).cast("B"), np.uint8)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        n = arr.nbytes
        if n and (_LIB.update_nogil if n >= RELEASE_GIL_FROM else _LIB.update)(self.state, arr.ctypes.data, n):
            raise RuntimeError("XXH3_128bits_update failed")

    def digest(self) -> bytes:
        h = _LIB.digest(self.state)
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
    return h.state if type(h) is Xxh3 else 0  # a subclass may feed otherwise: its update is called
