"""Retention: delete old versions, then the chunks no remaining version needs.

Plan (pure, :func:`plan_gc`): keep the ``keep`` newest committed versions (the head among them),
and every manifest in their chains back to a keyframe (:meth:`Repo.chain`). Manifests above the
head belong to a publish in progress and are kept too, unless older than the grace period: those
were left by publishers that died between the manifest and the head update, and they would block
every later publish of their version number, so gc deletes them. A chunk is needed when any kept
manifest references it (keyframes' ``delta`` payloads live in the same chunk list).

Execution (:func:`gc`): manifests are deleted first, oldest first, so that a reader never finds a
manifest whose chunks are gone; then chunks that no kept manifest references, but only those older
than ``grace_seconds``: a publisher uploads its chunks before its manifest exists, so a young
unreferenced chunk may belong to a version being published. ``grace_seconds`` must exceed the
longest publish (upload to commit). Last, leftovers of killed writers older than the grace period
go too: a file store's temporary files, an S3 store's incomplete multipart uploads.

Object ages need more than the :class:`Store` protocol offers (``list`` gives keys only), so this
module reads them backend by backend: a file store's files are ``os.stat``-ed, an S3 store is
listed with ``list_objects_v2`` (``LastModified``, compared with the server's own ``Date`` so that
clock skew does not matter). A backend without ages (memory) has every object treated as young:
nothing is collected there unless ``grace_seconds`` is 0.

Known limit: a publisher that finds one of its chunks already stored (same content as an old,
unreferenced chunk) skips the upload and does not refresh the chunk's age; a gc between that skip
and the publisher's commit can delete it. Chunks of the head's chain are never deleted, so this
needs content repeated from a version outside every kept chain.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from .errors import StoreError, UsageError, VersionError
from .format import CHUNKS_PREFIX, VERSIONS_PREFIX, parse_version_key, version_key
from .repo import Repo
from .store import FileStore, Store

_CHUNK_PREFIX_LEN = len(CHUNKS_PREFIX) + 3  # "chunks/ab/"


@dataclass(frozen=True)
class GcConfig:
    """``keep``: newest committed versions to keep (>= 1). ``grace_seconds``: never delete an
    unreferenced chunk younger than this. ``concurrency``: deletes in flight."""

    keep: int
    grace_seconds: float = 3600.0
    dry_run: bool = False
    concurrency: int = 16

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise UsageError(f"gc must keep at least 1 version, got --keep {self.keep}")
        if self.grace_seconds < 0:
            raise UsageError(f"grace period must be >= 0 seconds, got {self.grace_seconds}")
        if self.concurrency < 1:
            raise UsageError(f"gc concurrency must be at least 1, got {self.concurrency}")


@dataclass(frozen=True)
class GcPlan:
    head: int | None
    kept_versions: tuple[int, ...]  # committed versions kept: the newest `keep` and their chains
    pending_versions: tuple[int, ...]  # manifests above the head (publishes in progress)
    delete_versions: tuple[int, ...]  # ascending: deleted oldest first
    abandoned_versions: tuple[int, ...]  # manifests above the head older than the grace period
    needed_chunks: frozenset[str]


@dataclass
class GcResult:
    head: int | None
    kept_versions: list[int]
    deleted_versions: list[int]
    abandoned_versions: list[int]  # manifests of publishes that died before moving the head
    deleted_chunks: int = 0
    deleted_bytes: int = 0
    young_chunks: int = 0  # unreferenced but inside the grace period: left for a later gc
    kept_chunks: int = 0
    dry_run: bool = False
    seconds: float = 0.0
    partial_writes: int = 0  # removed leftovers of killed writers: temp files, multipart uploads


def plan_gc(repo: Repo, keep: int, abandoned: frozenset[int] = frozenset()) -> GcPlan:
    """Which manifests to delete and which chunks the remaining ones need (reads manifests only).

    ``abandoned``: versions above the head known to be left by dead publishers (see :func:`gc`).
    """
    head = repo.head_version()
    listed = sorted(v for v in (parse_version_key(k) for k in repo.store.list(VERSIONS_PREFIX)) if v is not None)
    above = [v for v in listed if head is None or v > head]
    pending = [v for v in above if v not in abandoned]
    dead = tuple(v for v in above if v in abandoned)
    if head is None:
        return GcPlan(None, (), tuple(pending), (), dead, frozenset(_chunks_of(repo, pending)))
    committed = [v for v in listed if v <= head]
    if head not in committed:
        raise VersionError(f"{repo.url}: head {head} has no manifest; refusing to collect anything")
    kept: set[int] = set()
    for v in committed[-keep:]:
        kept.update(m.version for m in repo.chain(v))
    delete = [v for v in committed if v not in kept]
    needed = _chunks_of(repo, sorted(kept) + pending)
    return GcPlan(head, tuple(sorted(kept)), tuple(pending), tuple(delete), dead, frozenset(needed))


def _chunks_of(repo: Repo, versions: list[int]) -> set[str]:
    needed: set[str] = set()
    for v in versions:
        try:
            needed.update(c.id for c in repo.manifest(v).chunks)
        except VersionError:
            if v <= (repo.head_version() or -1):
                raise  # a kept committed version must be readable
    return needed


def gc(repo: Repo, config: GcConfig) -> GcResult:
    """Delete versions outside ``config.keep`` and the chunks only they needed (module docstring)."""
    t0 = time.perf_counter()
    repo.require()
    plan = plan_gc(repo, config.keep, _abandoned(repo, config.grace_seconds))
    result = GcResult(plan.head, list(plan.kept_versions), list(plan.delete_versions),
                      list(plan.abandoned_versions), dry_run=config.dry_run)
    if not config.dry_run:
        for v in plan.delete_versions + plan.abandoned_versions:  # oldest first, chunks after
            repo.store.delete(version_key(v))
    # Listed after the manifests are gone: a chunk stored from here on is younger than the grace.
    doomed = []
    for key, size, age in list_chunks_with_age(repo.store):
        cid = key[_CHUNK_PREFIX_LEN:]
        if cid in plan.needed_chunks:
            result.kept_chunks += 1
        elif (age is None and config.grace_seconds > 0) or (age is not None and age < config.grace_seconds):
            result.young_chunks += 1
        else:
            doomed.append((key, size))
    result.deleted_chunks = len(doomed)
    result.deleted_bytes = sum(size for _, size in doomed)
    if not config.dry_run and doomed:
        with ThreadPoolExecutor(min(config.concurrency, len(doomed)), thread_name_prefix="ws-gc") as pool:
            for _ in pool.map(lambda kv: repo.store.delete(kv[0]), doomed):
                pass
    if not config.dry_run:
        result.partial_writes = _remove_partial_writes(repo.store, config.grace_seconds)
    result.seconds = time.perf_counter() - t0
    return result


# --- object ages, backend by backend ----------------------------------------------------------------
def _unwrap(store: Store) -> Store:
    """The backend under wrappers that keep it as ``inner`` (RetryingStore, fault injectors)."""
    seen = 0
    while hasattr(store, "inner") and seen < 16:
        store, seen = store.inner, seen + 1
    return store


def _abandoned(repo: Repo, grace: float) -> frozenset[int]:
    """Manifests above the head older than the grace period: their publishers died between the
    manifest and the head update (a live one moves the head right after), and they block every
    later publish of that version number."""
    head = repo.head_version()
    out = set()
    for key, _, age in list_with_age(repo.store, VERSIONS_PREFIX):
        v = parse_version_key(key)
        if v is not None and (head is None or v > head) and age is not None and age >= grace:
            out.add(v)
    return frozenset(out)


def list_chunks_with_age(store: Store) -> Iterator[tuple[str, int, float | None]]:
    """``(key, size, age in seconds or None if unknown)`` of every chunk object."""
    return list_with_age(store, CHUNKS_PREFIX)


def list_with_age(store: Store, prefix: str) -> Iterator[tuple[str, int, float | None]]:
    """``(key, size, age in seconds or None if unknown)`` of every object under ``prefix``."""
    backend = _unwrap(store)
    custom = getattr(backend, "list_with_times", None)
    if callable(custom):  # a backend that offers ages itself: (key, size, mtime epoch seconds)
        now = time.time()
        return ((k, size, now - mtime) for k, size, mtime in custom(prefix))
    if isinstance(backend, FileStore):
        return _file_ages(backend, prefix)
    if type(backend).__name__ == "S3Store":
        return _s3_ages(backend, prefix)
    return ((k, store.head(k) or 0, None) for k in store.list(prefix))


def _file_ages(store: FileStore, prefix: str) -> Iterator[tuple[str, int, float | None]]:
    now = time.time()
    for key in store.list(prefix):
        try:
            st = os.stat(store.local_path(key))
        except FileNotFoundError:
            continue
        yield key, st.st_size, now - st.st_mtime


def _s3_ages(store, prefix: str) -> Iterator[tuple[str, int, float | None]]:
    from botocore.exceptions import BotoCoreError, ClientError

    client, bucket, root = store._client, store.bucket, store._key_prefix
    skip = len(root)
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + prefix):
            date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            now = parsedate_to_datetime(date).timestamp() if date else time.time()
            for obj in page.get("Contents", ()):
                key = obj["Key"][skip:]
                if key and not key.endswith("/"):
                    yield key, int(obj["Size"]), now - obj["LastModified"].timestamp()
    except (BotoCoreError, ClientError) as exc:  # one line, as every store error
        what = " ".join(str(exc).split())
        raise StoreError(f"{store.url}: LIST {prefix}: {type(exc).__name__}: {what}", key=prefix) from exc


def _remove_partial_writes(store: Store, grace: float) -> int:
    """Leftovers of writers killed mid-write, older than ``grace``: a file store's ``.tmp-*``
    files, an S3 store's incomplete multipart uploads (which the bucket bills for)."""
    backend = _unwrap(store)
    if isinstance(backend, FileStore):
        return _remove_temp_files(backend, grace)
    if type(backend).__name__ == "S3Store":
        return _abort_multipart_uploads(backend, grace)
    return 0


def _remove_temp_files(backend: FileStore, grace: float) -> int:
    removed, now = 0, time.time()
    for sub in (CHUNKS_PREFIX, VERSIONS_PREFIX):
        root = backend.root / sub
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                if not name.startswith(".tmp-"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if now - os.stat(path).st_mtime >= grace:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    pass
    return removed



def _abort_multipart_uploads(store, grace: float) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    client, bucket, root = store._client, store.bucket, store._key_prefix
    aborted = 0
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=root):
            date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            now = parsedate_to_datetime(date).timestamp() if date else time.time()
            for upload in page.get("Uploads", ()):
                if now - upload["Initiated"].timestamp() >= grace:
                    client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted += 1
    except (BotoCoreError, ClientError) as exc:
        what = " ".join(str(exc).split())
        raise StoreError(f"{store.url}: abort stale multipart uploads: {type(exc).__name__}: {what}") from exc
    return aborted


__all__ = ["GcConfig", "GcPlan", "GcResult", "gc", "list_chunks_with_age", "list_with_age", "plan_gc"]
