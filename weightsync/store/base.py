"""The store protocol: a few small operations over keys in a flat namespace.

Every backend (memory, file, s3) implements :class:`Store`; wrappers (retries, fault injection)
implement it too. Keys are ``/``-separated relative paths such as ``chunks/ab/ab12...``.

Retention (:mod:`weightsync.sync.gc`) needs object ages and a sweep of what crashed writers left;
the protocol offers them in the manner of obstore's ``list``/``head``: :meth:`Store.list_meta` and
:meth:`Store.head_meta` give :class:`ObjectMeta` (``last_modified`` by the store's own clock),
:meth:`Store.now` reads that clock, and :meth:`Store.sweep_incomplete` removes old incomplete
writes.

Head polling is one conditional read: :meth:`Store.get_if_changed` answers ``None`` while the
object still has the tag the caller holds (S3: ``If-None-Match``, a ``304`` without a body).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from weightsync.errors import StoreError

Match = Literal["absent", "other", "same", "same-size"]  # Store.compare's answers
PutMode = Literal["create", "overwrite"]

_KEY_RE = re.compile(r"[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*")


def check_key(key: str) -> str:
    """Reject keys that could escape a backend's root (``..``, absolute, empty segments)."""
    if not _KEY_RE.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise StoreError(f"invalid store key {key!r}", key=key)
    return key


@dataclass(frozen=True)
class ObjectMeta:
    """One object as a listing sees it.

    ``last_modified``: when the object was last written or touched, in seconds since the epoch by
    the clock of the store (an S3 server's, not this host's: compare it with :meth:`Store.now`
    only), or ``None`` where the backend keeps no times (memory). Its resolution is the backend's
    (whole seconds on S3).
    """

    key: str
    size: int
    last_modified: float | None


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

    def get_at_most(self, key: str, limit: int) -> bytes:
        """The whole object if it holds at most ``limit`` bytes, else only its first ``limit + 1``: an
        object far larger than expected is never read whole (one plain ``GET`` on S3)."""
        return self.get_range(key, 0, limit + 1)

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        """Store ``data`` atomically: readers see the old object or the new one, never a part."""

    @abc.abstractmethod
    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object and an opaque tag that changes whenever the object changes."""

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """The object and its tag (as :meth:`get_with_etag`) unless its tag is still ``etag``: then
        ``None``, without the body where the backend can tell (S3: one ``GET`` with ``If-None-Match``,
        answered ``304``). ``etag=None`` always reads. :class:`NotFoundError` if the object is gone,
        whatever ``etag`` was. This default reads the object and compares tags: the check of the
        memory and file stores, whose tag is the content's XXH3 (a local read of a small object; a
        check by ``stat`` alone could miss a rewrite of the same size within the file system's
        timestamp granularity)."""
        data, tag = self.get_with_etag(key)
        return None if etag is not None and tag == etag else (data, tag)

    @abc.abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str | None) -> None:
        """Replace the object only if its tag is still ``etag`` (``None``: only if absent)."""

    @abc.abstractmethod
    def head(self, key: str) -> int | None:
        """Size of the object in bytes, or ``None`` if it does not exist."""

    def compare(self, key: str, data: bytes | memoryview) -> Match:
        """Whether the object ``key`` holds exactly ``data``, as far as the backend can tell without
        moving the object over the network: ``"absent"``, ``"other"`` (another size, or other bytes),
        ``"same"``, or ``"same-size"`` where only the size can be told (S3 tells by the ``ETag`` of a
        single-part upload, its MD5; a local file is read). One request."""
        size = self.head(key)
        return "absent" if size is None else "same-size" if size == memoryview(data).nbytes else "other"

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys that start with ``prefix``, in lexicographic order."""

    @abc.abstractmethod
    def list_meta(self, prefix: str = "", *, offset: str | None = None) -> Iterator[ObjectMeta]:
        """:class:`ObjectMeta` of every object whose key starts with ``prefix`` and, when
        ``offset`` is given, comes after ``offset`` in the listing's order (so that a listing cut
        short can resume after the last key it gave: every key once).

        The order is the store's own: lexicographic for the memory and file stores and on AWS S3,
        but an S3-compatible server may differ (SeaweedFS lists a folder's objects where the
        folder's name sorts, ``a/b`` before ``a-b``); :meth:`list` is always sorted. The listing
        may be lazy (S3: one request per page), so errors can surface while iterating; an object
        deleted while listed may be left out.
        """

    @abc.abstractmethod
    def head_meta(self, key: str) -> ObjectMeta | None:
        """:class:`ObjectMeta` of one object read now (one request), or ``None`` if it does not
        exist."""

    @abc.abstractmethod
    def now(self) -> float:
        """The current time, in seconds since the epoch, by the clock that stamps
        ``last_modified`` (an S3 server's ``Date``: one request), so that ``now() - last_modified``
        is an object's age whatever this host's clock says. The local clock where the store is
        local."""

    @abc.abstractmethod
    def sweep_incomplete(self, older_than: float) -> list[str]:
        """Remove what writers killed mid-write left behind, once at least ``older_than`` seconds
        old by the store's clock (younger ones may belong to a write in flight): a file store's
        temporary files, an S3 bucket's unfinished multipart uploads under the store's prefix
        (whoever started them). Objects are never touched. Returns what was removed, one entry
        per leftover, each naming it (a path relative to the store, or ``key (upload id)``);
        ``[]`` where a backend leaves nothing (memory). Removing a leftover that is already gone
        is not an error."""

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
