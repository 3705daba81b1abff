"""An in-process store, for tests and for wrapping in fault injectors.

It keeps no modification times (``last_modified`` is ``None``), so retention treats its objects
as young; writes are whole dict assignments, so nothing is ever left incomplete.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import xxhash

from weightsync.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError
from weightsync.store.base import Match, ObjectMeta, PutMode, Store, check_key

_NAMED: dict[str, MemoryStore] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStore(Store):
    def __init__(self, name: str = ""):
        self.url = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """The process-wide store of this name, so that ``memory://name`` URLs share objects."""
        with _NAMED_LOCK:
            if name not in _NAMED:
                _NAMED[name] = cls(name)
            return _NAMED[name]

    def _read(self, key: str) -> bytes:
        try:
            return self._objects[check_key(key)]
        except KeyError:
            raise NotFoundError(f"{self.url}: no object {key}", key=key) from None

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._read(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._lock:
            return self._read(key)[start : start + length]

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        with self._lock:
            if mode == "create" and check_key(key) in self._objects:
                raise AlreadyExistsError(f"{self.url}: {key} already exists", key=key)
            self._objects[check_key(key)] = bytes(data)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        with self._lock:
            data = self._read(key)
        return data, xxhash.xxh3_128_hexdigest(data)

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> None:
        with self._lock:
            current = self._objects.get(check_key(key))
            tag = None if current is None else xxhash.xxh3_128_hexdigest(current)
            if tag != etag:
                raise PreconditionFailedError(f"{self.url}: {key} changed concurrently", key=key)
            self._objects[key] = bytes(data)

    def head(self, key: str) -> int | None:
        with self._lock:
            obj = self._objects.get(check_key(key))
        return None if obj is None else len(obj)

    def compare(self, key: str, data: bytes | memoryview) -> Match:
        with self._lock:
            obj = self._objects.get(check_key(key))
        return "absent" if obj is None else "same" if obj == data else "other"

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        return iter(keys)

    def list_meta(self, prefix: str = "", *, offset: str | None = None) -> Iterator[ObjectMeta]:
        with self._lock:
            found = sorted(
                (k, len(v)) for k, v in self._objects.items() if k.startswith(prefix) and (offset is None or k > offset)
            )
        return iter([ObjectMeta(k, size, None) for k, size in found])

    def head_meta(self, key: str) -> ObjectMeta | None:
        size = self.head(key)
        return None if size is None else ObjectMeta(key, size, None)

    def now(self) -> float:
        return time.time()

    def sweep_incomplete(self, older_than: float) -> list[str]:
        return []

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)
