"""The codecs by id (as payload headers store them) and by name (as manifests store them).

The ids are the format's (docs/FORMAT.md, "Payloads"): 1 = full, 2 = sparse, 3 = dense, 4 = ac, 5 = ans.
``same`` is no codec here: it has no payload (:mod:`weightsync.codec.payload`).

The built-in codec modules (:data:`BUILTIN`) are imported on the first lookup, not with the
package: they bring numba, which ``import weightsync`` does not pay for.
"""

from __future__ import annotations

import importlib
import threading

from weightsync.codec.abc import Codec

BUILTIN = (
    "weightsync.codec.full",
    "weightsync.codec.sparse",
    "weightsync.codec.dense",
    "weightsync.codec.arith",
    "weightsync.codec.ans",
)
"""The modules whose import registers the built-in codecs."""

_BY_ID: dict[int, Codec] = {}
_BY_NAME: dict[str, Codec] = {}
_loaded = False
_lock = threading.Lock()


def register(cls: type[Codec]) -> type[Codec]:
    """Register a :class:`Codec` subclass (a class decorator); its one instance serves every
    thread. Refuses an id or a name already taken: an id is part of the stored format."""
    if not (isinstance(cls.id, int) and 1 <= cls.id <= 255) or not cls.name or cls.name == "same":
        raise ValueError(f"codec {cls.__name__}: the id must be in 1..255 and the name neither empty nor 'same'")
    if cls.id in _BY_ID or cls.name in _BY_NAME:
        raise ValueError(f"codec {cls.__name__}: id {cls.id} or name {cls.name!r} is already registered")
    _BY_ID[cls.id] = _BY_NAME[cls.name] = cls()
    return cls


def _load_builtin() -> None:
    global _loaded
    with _lock:
        if not _loaded:
            for module in BUILTIN:
                importlib.import_module(module)
            _loaded = True


def get(name: str) -> Codec:
    """The codec named ``name``; raises KeyError for an unknown one."""
    if not _loaded:
        _load_builtin()
    return _BY_NAME[name]


def get_by_id(codec_id: int) -> Codec:
    """The codec whose payloads carry ``codec_id``; raises KeyError for an unknown one."""
    if not _loaded:
        _load_builtin()
    return _BY_ID[codec_id]
