"""Store backends and :func:`open_store`, which picks one from a URL."""

from __future__ import annotations

import os
import re
from pathlib import Path

from weightsync.errors import UsageError
from weightsync.store.base import ObjectMeta, Store, check_key
from weightsync.store.file import FileStore
from weightsync.store.memory import MemoryStore

__all__ = ["Store", "ObjectMeta", "FileStore", "MemoryStore", "open_store", "check_key", "same_store"]


_SCHEMES = r"(s3|s3a|file|memory|gs|gcs|az|abfss?|https?|ftp):"
"""URL schemes a store URL with a typo starts with (``s3:bucket``); other names with a ':' are folders."""


def open_store(url: str | Path, **options) -> Store:
    """``file:///abs/path`` or a plain path, ``memory://name``, or ``s3://bucket/prefix``.

    ``options`` go to the backend (for s3: ``endpoint_url``, ``max_concurrency``...).
    """
    given_path, url = isinstance(url, os.PathLike), str(url)
    if not url:
        raise UsageError("store URL is empty")
    if url.startswith("s3://"):
        if bad := next((c for c in url if ord(c) < 32 or ord(c) == 127), None):  # (urlsplit drops tabs and newlines)
            raise UsageError(f"store URL {url!r} holds a control character ({bad!r})")
        from weightsync.store.s3 import S3Store

        return S3Store.from_url(url, **options)
    if url.startswith("memory://"):
        return MemoryStore.named(url[len("memory://") :])
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/"):
            raise UsageError(f"file store URL must be absolute (file:///abs/path): {url}")
        return FileStore(path, **options)
    if "://" in url:
        raise UsageError(f"unsupported store URL scheme: {url}")
    if not given_path and re.match(_SCHEMES, url, re.IGNORECASE):  # s3:bucket, file:/x: a typo, not a folder
        raise UsageError(
            f"store URL {url} is neither s3://bucket/prefix nor file:///path (a folder whose name has a ':' is ./{url})"
        )
    return FileStore(Path(url), **options)


def same_store(a: str, b: str) -> bool:
    """Whether two store URLs (as stores give them) name one store: equal, or file stores at one
    folder however spelled (a link, ``..``, a bind mount). Local state records the URL it came from;
    a version number means nothing under another store."""
    if a == b:
        return True
    if not (a.startswith("file://") and b.startswith("file://")):
        return False
    pa, pb = a[len("file://") :], b[len("file://") :]
    try:
        return os.path.samefile(pa, pb)
    except OSError:  # one of them is gone: by its spelling
        return os.path.realpath(pa) == os.path.realpath(pb)
