"""The embedded default: a store in a local directory, one file per key, written through a
temporary file then linked or renamed into place; conditional updates under an ``flock``
(docs/DESIGN.md: ages, sweeps, folders)."""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from weightsync.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError, StoreError
from weightsync.store.base import Match, ObjectMeta, PutMode, Store, check_key

_TEMP_PREFIX = ".tmp-"
_MKDIR_TRIES = 8  # a concurrent delete may remove an emptied folder during mkdir or before mkstemp


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
        for attempt in range(1, _MKDIR_TRIES + 1):
            try:
                # exist_ok still raises FileExistsError when the folder was there at mkdir and gone
                # when it looked again (see below)
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
                break
            except (FileNotFoundError, FileExistsError):  # the folder was emptied and removed by a delete
                if attempt == _MKDIR_TRIES:
                    raise
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
        try:  # (a new store on a full disk: its first head write creates the file)
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / ".lock", "a+b")  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise StoreError(f"{self.url}: .lock: {exc.strerror or exc}", key=".lock") from exc
        with lock:
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

    def compare(self, key: str, data: bytes | memoryview) -> Match:
        """By reading the file (local disk: as fast as writing it; a mounted remote bucket reads it)."""
        try:
            with open(self._path(key), "rb") as f:
                if os.fstat(f.fileno()).st_size != memoryview(data).nbytes:
                    return "other"
                return "same" if f.read() == data else "other"
        except FileNotFoundError:
            return "absent"
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
                base + name for name in filenames if not name.startswith(".") and (base + name).startswith(prefix)
            )
        return iter(sorted(keys))

    def list_meta(self, prefix: str = "", *, offset: str | None = None) -> Iterator[ObjectMeta]:
        for key in self.list(prefix):
            if offset is not None and key <= offset:
                continue
            try:
                st = self._path(key).stat()
            except FileNotFoundError:
                continue  # deleted since the walk
            except OSError as exc:
                raise StoreError(f"{self.url}: {key}: {exc.strerror}", key=key) from exc
            yield ObjectMeta(key, st.st_size, st.st_mtime)

    def head_meta(self, key: str) -> ObjectMeta | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self.url}: {key}: {exc.strerror}", key=key) from exc
        return ObjectMeta(key, st.st_size, st.st_mtime)

    def now(self) -> float:
        return time.time()

    def sweep_incomplete(self, older_than: float) -> list[str]:
        """Temporary files (``.tmp-*``) anywhere under the root, by modification time."""
        removed: list[str] = []
        now = time.time()
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if not name.startswith(_TEMP_PREFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if now - os.stat(path).st_mtime >= older_than:
                        os.unlink(path)
                        removed.append(os.path.relpath(path, self.root).replace(os.sep, "/"))
                except FileNotFoundError:
                    pass  # renamed into place, or removed by another sweep
                except OSError as exc:
                    raise StoreError(f"{self.url}: sweep {path}: {exc.strerror}") from exc
        return sorted(removed)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise StoreError(f"{self.url}: {key}: {exc.strerror}", key=key) from exc
            return
        self._remove_empty_folders(path.parent)

    def _remove_empty_folders(self, folder: Path) -> None:
        """``folder`` and its parents below the root, while they are empty."""
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return  # not empty (or already gone): a sibling, or a write since
            folder = folder.parent

    def touch(self, key: str) -> None:
        with self._errors(key):
            os.utime(self._path(key))

    def local_path(self, key: str) -> Path | None:
        return self._path(key)
