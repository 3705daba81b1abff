"""Store backends and :func:`open_store`, which picks one from a URL."""

from __future__ import annotations

from pathlib import Path

from weightsync.errors import UsageError
from weightsync.store.base import ObjectMeta, Store, check_key
from weightsync.store.file import FileStore
from weightsync.store.memory import MemoryStore

__all__ = ["Store", "ObjectMeta", "FileStore", "MemoryStore", "open_store", "check_key"]


def open_store(url: str | Path, **options) -> Store:
    """``file:///abs/path`` or a plain path, ``memory://name``, or ``s3://bucket/prefix``.

    ``options`` go to the backend (for s3: ``endpoint_url``, ``max_concurrency``...).
    """
    url = str(url)
    if not url:
        raise UsageError("store URL is empty")
    if url.startswith("s3://"):
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
    return FileStore(Path(url), **options)
