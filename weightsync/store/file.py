"""The embedded default: a store in a local directory.

Each key is a file under the root. Writes go to a temporary file in the same directory, are
fsynced, then linked (create) or renamed (overwrite) into place, so a reader sees the old object or
the new one. Conditional updates hold an exclusive ``flock`` on ``<root>/.lock``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from weightsync.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError, StoreError
from weightsync.store.base import PutMode, Store, check_key


class FileStore(Store):
    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True):
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @contextmanager
    def _errors(self, key: str):
        try:
            yield
        except FileNotFoundError:
            raise NotFoundError(f"{self.url}: no object {key}", key=key) from None
        except OSError as exc:
            raise StoreError(f"{self.url}: {key}: {exc.strerror or exc}", key=key) from exc

    def get(self, key: str) -> bytes:
        with self._errors(key):
            return self._path(key).read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._errors(key), open(self._path(key), "rb") as f:
            return os.pread(f.fileno(), length, start)

    def _write_temp(self, path: Path, data: bytes | memoryview) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        path = self._path(key)
        with self._errors(key):
            tmp = self._write_temp(path, data)
            try:
                if mode == "create":
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise AlreadyExistsError(f"{self.url}: {key} already exists", key=key) from None
                else:
                    os.replace(tmp, path)
                    tmp = ""
            finally:
                if tmp:
                    os.unlink(tmp)

    @contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, xxhash.xxh3_128_hexdigest(data)

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> None:
        with self._locked():
            try:
                current: str | None = self.get_with_etag(key)[1]
            except NotFoundError:
                current = None
            if current != etag:
                raise PreconditionFailedError(f"{self.url}: {key} changed concurrently", key=key)
            self.put(key, data, mode="overwrite")

    def head(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.url}: {key}: {exc.strerror}", key=key) from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        if not self.root.is_dir():
            return iter(())
        keys = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if not (base.startswith(prefix) or prefix.startswith(base)):
                dirnames[:] = []
                continue
            keys.extend(
                base + name
                for name in filenames
                if not name.startswith(".") and (base + name).startswith(prefix)
            )
        return iter(sorted(keys))

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise StoreError(f"{self.url}: {key}: {exc.strerror}", key=key) from exc

    def touch(self, key: str) -> None:
        with self._errors(key):
            os.utime(self._path(key))

    def local_path(self, key: str) -> Path | None:
        return self._path(key)
