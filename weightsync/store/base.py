"""The store protocol: a few small operations over keys in a flat namespace.

Every backend (memory, file, s3) implements :class:`Store`; wrappers (retries, fault injection)
implement it too. Keys are ``/``-separated relative paths such as ``chunks/ab/ab12...``.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from weightsync.errors import StoreError

PutMode = Literal["create", "overwrite"]

_KEY_RE = re.compile(r"[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*")


def check_key(key: str) -> str:
    """Reject keys that could escape a backend's root (``..``, absolute, empty segments)."""
    if not _KEY_RE.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise StoreError(f"invalid store key {key!r}", key=key)
    return key


class Store(abc.ABC):
    """Object store operations used by weightsync.

    Errors: :class:`~weightsync.errors.NotFoundError` for a missing key,
    :class:`~weightsync.errors.AlreadyExistsError` for ``put(mode="create")`` on an existing key,
    :class:`~weightsync.errors.PreconditionFailedError` for a lost conditional update, and
    :class:`~weightsync.errors.StoreError` for anything else.
    """

    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start``; fewer only if the object is shorter."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        """Store ``data`` atomically: readers see the old object or the new one, never a part."""

    @abc.abstractmethod
    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object and an opaque tag that changes whenever the object changes."""

    @abc.abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str | None) -> None:
        """Replace the object only if its tag is still ``etag`` (``None``: only if absent)."""

    @abc.abstractmethod
    def head(self, key: str) -> int | None:
        """Size of the object in bytes, or ``None`` if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys that start with ``prefix``, in lexicographic order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing a missing key is not an error."""

    def touch(self, key: str) -> None:
        """Refresh the object's modification time (so retention treats it as young again).
        Backends without object ages may leave this a no-op."""

    def local_path(self, key: str) -> Path | None:
        """A local file holding the object, when the backend has one (zero-copy reads)."""
        return None

    def close(self) -> None:
        """Release connections and pools."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
