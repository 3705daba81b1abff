"""Retention: delete old versions (and their signatures), then the chunks no remaining version needs. A pure plan
(:func:`plan_gc`, :func:`plan_parts`) then :func:`gc`, which re-checks each candidate's age and
new manifests before deleting, so that a publish in progress never loses a chunk (docs/DESIGN.md
gives the rules and the grace period they need)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from weightsync.errors import AlreadyExistsError, FormatError, NotFoundError, UsageError, VersionError
from weightsync.format.keys import (
    CHUNKS_PREFIX,
    LAZY_PREFIX,
    PARTS_PREFIX,
    SIGNATURES_PREFIX,
    VERSIONS_PREFIX,
    parse_chunk_key,
    parse_lazy_key,
    parse_part_key,
    parse_refused_key,
    parse_signature_key,
    parse_version_key,
    refused_key,
    version_key,
)
from weightsync.format.manifest import manifest_from_json, part_from_json
from weightsync.store import ObjectMeta, Store
from weightsync.store.repo import Repo

log = logging.getLogger("weightsync.gc")


_CHUNK_PREFIX_LEN = len(CHUNKS_PREFIX) + 3  # "chunks/ab/"


_BATCH = 1024  # chunk deletes between two re-reads of versions/


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
        if not self.grace_seconds >= 0:  # (NaN too: no age would count as young)
            raise UsageError(f"grace period must be >= 0 seconds, got {self.grace_seconds}")
        if self.concurrency < 1:
            raise UsageError(f"gc concurrency must be at least 1, got {self.concurrency}")


@dataclass(frozen=True)
class GcPlan:
    """What retention keeps and deletes (pure, from the listing): versions kept and their chains,
    publishes in progress, versions to delete (ascending), abandoned manifests, needed chunks."""

    head: int | None
    kept_versions: tuple[int, ...]  # committed versions kept: the newest `keep` and their chains
    pending_versions: tuple[int, ...]  # manifests above the head (publishes in progress)
    delete_versions: tuple[int, ...]  # ascending (deleted newest first)
    abandoned_versions: tuple[int, ...]  # manifests above the head older than the grace period
    needed_chunks: frozenset[str]
    lazy_chunks: frozenset[str] = frozenset()  # named by kept versions' lazy notes: not here by design


@dataclass
class GcResult:
    """What a gc did (or would do with ``dry_run``): versions kept and deleted, chunks deleted, kept
    and left young, the re-checks that saved chunks, seconds."""

    head: int | None
    kept_versions: list[int]
    deleted_versions: list[int]
    abandoned_versions: list[int]  # manifests of publishes that died before moving the head
    deleted_chunks: int = 0
    deleted_bytes: int = 0
    young_chunks: int = 0  # unreferenced but inside the grace period: left for a later gc
    kept_chunks: int = 0
    touched_during_gc: int = 0  # of young_chunks: old when listed, young when re-checked (re-used meanwhile)
    referenced_during_gc: int = 0  # of kept_chunks: referenced by a manifest stored while gc ran
    dry_run: bool = False
    seconds: float = 0.0
    partial_writes: int = 0  # removed leftovers of killed writers: temp files, multipart uploads
    deleted_parts: int = 0  # part objects of merged, stale or abandoned multi-rank publishes
    pending_parts: int = 0  # part objects of versions above the head, kept (a publish in progress)
    deleted_signatures: int = 0  # signatures of deleted versions, and older ones whose manifest is gone
    lazy_chunks: int = 0  # chunks kept versions name that a mirror left out on purpose (lazy notes): not missing
    deleted_notes: int = 0  # lazy notes of deleted versions, and older ones whose manifest is gone
    foreign_objects: int = 0  # objects under chunks/ that no chunk key names: never deleted


@dataclass(frozen=True)
class PartsPlan:
    """Which parts of multi-rank publishes gc deletes, which it keeps, and the chunks kept parts need."""

    delete: tuple[str, ...]  # part keys: at or below the head, or above it and all older than the grace
    pending: tuple[str, ...]  # part keys kept: a multi-rank publish in progress
    needed_chunks: frozenset[str]  # chunks the kept parts name
    # an abandoned version's last part key -> its refusals, deleted again right after its parts
    after: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def plan_parts(repo: Repo, head: int | None, grace: float) -> PartsPlan:
    """Which parts to delete and which chunks the kept ones need (module docstring). A committer's
    refusal of a version's parts goes with them, whatever its own age (a committer that retries
    rewrites it), and is deleted first (a gc cut short leaves parts without their refusal, never a
    refusal that names parts stored later), and for a version above the head again right after them
    (a committer may have stored one since the listing); one without parts is deleted."""
    by_version: dict[int, list[tuple[str, float | None]]] = {}
    refusals: dict[int, list[str]] = {}
    worlds: dict[int, set[int]] = {}
    for key, _, age in list_with_age(repo.store, PARTS_PREFIX):
        parsed = parse_part_key(key)
        if parsed is not None:
            by_version.setdefault(parsed[0], []).append((key, age))
            worlds.setdefault(parsed[0], set()).add(parsed[2])
        elif (refused := parse_refused_key(key)) is not None:
            refusals.setdefault(refused[0], []).append(key)
    delete, pending, needed, after = [], [], set(), {}
    for v in sorted(set(refusals) - set(by_version)):
        delete.extend(refusals[v])
    for v, items in sorted(by_version.items()):
        if (head is not None and v <= head) or not any(_young(age, grace) for _, age in items):
            delete.extend(refusals.get(v, []))
            delete.extend(k for k, _ in items)
            if head is None or v > head:  # committers store refusals only above the head
                after[delete[-1]] = tuple(refused_key(v, w) for w in sorted(worlds[v]))
            continue
        pending.extend(refusals.get(v, []))
        for key, _ in items:
            pending.append(key)
            try:
                needed.update(c.id for c in part_from_json(repo.store.get(key), f"{repo.url}/{key}").chunks)
            except (NotFoundError, FormatError) as exc:  # a damaged part protects nothing; a committer refuses it
                log.warning("gc %s: cannot read part %s (%s)", repo.url, key, exc)
    return PartsPlan(tuple(delete), tuple(pending), frozenset(needed), after)


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
    noted = _noted(repo)
    kept: set[int] = set()
    lazy: set[str] = set()
    for v in committed[-keep:]:
        kept.update(_rebuild_path(repo, v, noted, lazy))
    delete = [v for v in committed if v not in kept]
    needed = _chunks_of(repo, sorted(kept) + pending)
    return GcPlan(head, tuple(sorted(kept)), tuple(pending), tuple(delete), dead, frozenset(needed), frozenset(lazy))


def _noted(repo: Repo) -> set[int]:
    """Versions with a lazy-chunks note (docs/FORMAT.md section 1): a mirror left chunks of theirs out."""
    return {v for v in (parse_lazy_key(k) for k in repo.store.list(LAZY_PREFIX)) if v is not None}


def _rebuild_path(repo: Repo, version: int, noted: set[int], lazy: set[str]) -> list[int]:
    """The versions a reader needs for ``version``: its chain back to its keyframe and, while that
    keyframe lacks chunks (a lazy note), on back through its parents to the newest keyframe whose
    chunks are all here (readers rebuild a lazily held keyframe from it, its deltas and the lazy
    keyframe's own delta payloads). ``lazy`` collects the noted chunk ids met on the way. A path
    that ends at a collected manifest keeps what there is."""
    chain = repo.chain(version)
    out = [m.version for m in chain]
    keyframe = chain[0]
    while keyframe.version in noted:
        try:
            ids = repo.lazy_chunks(keyframe.version)
        except FormatError as exc:  # a damaged note: the keyframe may lack chunks, so keep the path
            log.warning("gc %s: %s; keeping the versions before it", repo.url, exc)
            ids = frozenset(["?"])
        if not ids:
            break  # an empty note: the version is whole
        lazy.update(i for i in ids if i != "?")
        if keyframe.parent is None:
            break
        try:
            chain = repo.chain(keyframe.parent)
        except VersionError:
            break  # collected already: nothing older to rebuild from
        out.extend(m.version for m in chain)
        keyframe = chain[0]
    return out


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
    parts = plan_parts(repo, plan.head, config.grace_seconds)
    plan = dataclasses.replace(plan, needed_chunks=plan.needed_chunks | parts.needed_chunks)
    result = GcResult(
        plan.head,
        list(plan.kept_versions),
        list(plan.delete_versions),
        list(plan.abandoned_versions),
        dry_run=config.dry_run,
        deleted_parts=len(parts.delete),
        pending_parts=len(parts.pending),
    )
    result.lazy_chunks = len(plan.lazy_chunks)
    if plan.abandoned_versions and not config.dry_run:
        plan = dataclasses.replace(plan, abandoned_versions=_delete_abandoned(repo, plan.abandoned_versions))
        result.abandoned_versions = list(plan.abandoned_versions)
    if not config.dry_run:
        # newest first, chunks after: a version still listed while gc runs (or after a gc cut short) still
        # has its whole chain, which is older than it
        for v in reversed(plan.delete_versions):
            repo.store.delete(version_key(v))  # their signatures and notes go after them
        for key in parts.delete:
            repo.store.delete(key)  # a file store removes the folders this empties
            for again in parts.after.get(key, ()):
                repo.store.delete(again)
    gone, grace = set(plan.delete_versions + plan.abandoned_versions), config.grace_seconds
    result.deleted_signatures = _sweep_beside(repo, SIGNATURES_PREFIX, parse_signature_key, gone, grace, config.dry_run)
    result.deleted_notes = _sweep_beside(repo, LAZY_PREFIX, parse_lazy_key, gone, grace, config.dry_run)
    # Listed after the manifests are gone: a chunk stored from here on is younger than the grace.
    doomed = []
    for key, size, age in list_chunks_with_age(repo.store):
        cid = parse_chunk_key(key)
        if cid is None:  # no chunk's key (a file someone put there, another store below this one): not ours
            result.foreign_objects += 1
        elif cid in plan.needed_chunks:
            result.kept_chunks += 1
        elif _young(age, config.grace_seconds):
            result.young_chunks += 1
        else:
            doomed.append((key, size))
    if config.dry_run:
        result.deleted_chunks = len(doomed)
        result.deleted_bytes = sum(size for _, size in doomed)
    elif doomed:
        _delete_chunks(repo, plan, doomed, config, result)
    if not config.dry_run:
        result.partial_writes = len(repo.store.sweep_incomplete(config.grace_seconds))
    result.seconds = time.perf_counter() - t0
    return result


def _delete_abandoned(repo: Repo, versions: tuple[int, ...]) -> tuple[int, ...]:
    """Delete the manifests of ``versions`` (above the head, older than the grace), first of all;
    returns those that stay deleted. A writer that only stalled past the grace may move the head
    onto one meanwhile, and checks right after that its manifest is still there (``Repo.commit``,
    the mirror): so the head is read again before each delete, and once more after it, and a
    manifest the head has reached by then is put back (its chunks stay too: a manifest outside the
    plan's, :func:`_delete_chunks`). One of the two sides always sees the other."""
    deleted = []
    for v in versions:
        head = repo.head_version()
        if head is not None and head >= v:
            continue
        try:
            data = repo.store.get(version_key(v))
        except NotFoundError:
            continue  # another gc
        repo.store.delete(version_key(v))
        head = repo.head_version()
        if head is not None and head >= v:
            with contextlib.suppress(AlreadyExistsError):
                repo.store.put(version_key(v), data, mode="create")
            log.warning("gc: version %d became the head while it was collected as abandoned; put it back", v)
            continue
        deleted.append(v)
    return tuple(deleted)


def _sweep_beside(
    repo: Repo, prefix: str, parse: Callable[[str], int | None], deleted: set[int], grace: float, dry_run: bool
) -> int:
    """Delete the documents under ``prefix`` that belong to a version (signatures, lazy notes):
    those of ``deleted`` versions (after their manifests: no reader sees a version without them),
    and those older than ``grace`` whose manifest is gone (their writer puts them right beside the
    manifest, a signature after it and a note before it; the grace spares one still committing)."""
    doomed = []
    manifests: set[int] | None = None
    for key, _, age in list_with_age(repo.store, prefix):
        v = parse(key)
        if v is None or (v not in deleted and _young(age, grace)):
            continue
        if v not in deleted:
            if manifests is None:  # listed after the manifests were deleted
                manifests = {parse_version_key(k) for k in repo.store.list(VERSIONS_PREFIX)}
            if v in manifests:
                continue
        doomed.append(key)
    if not dry_run:
        for key in doomed:
            repo.store.delete(key)
    return len(doomed)


def _delete_chunks(repo: Repo, plan: GcPlan, doomed: list[tuple[str, int]], config: GcConfig, result: GcResult) -> None:
    """Delete ``doomed`` chunks in batches, re-checking before each (module docstring)."""
    known = set(plan.kept_versions + plan.pending_versions)  # their chunks are in plan.needed_chunks
    referenced: set[str] = set()

    def one(kv: tuple[str, int], now: float) -> str:
        try:
            age = object_age(repo.store, kv[0], now)
        except NotFoundError:
            return "gone"  # deleted meanwhile (another gc)
        if _young(age, config.grace_seconds):
            return "young"
        repo.store.delete(kv[0])
        return "deleted"

    with ThreadPoolExecutor(min(config.concurrency, len(doomed)), thread_name_prefix="ws-gc") as pool:
        for start in range(0, len(doomed), _BATCH):
            referenced |= _new_references(repo, known)
            batch = [kv for kv in doomed[start : start + _BATCH] if kv[0][_CHUNK_PREFIX_LEN:] not in referenced]
            result.referenced_during_gc += min(_BATCH, len(doomed) - start) - len(batch)
            now = repo.store.now()  # read before the batch's HEADs: ages can only err young
            for kv, outcome in zip(batch, pool.map(lambda kv: one(kv, now), batch)):
                if outcome == "deleted":
                    result.deleted_chunks += 1
                    result.deleted_bytes += kv[1]
                elif outcome == "young":
                    result.touched_during_gc += 1
    result.young_chunks += result.touched_during_gc
    result.kept_chunks += result.referenced_during_gc
    if result.touched_during_gc or result.referenced_during_gc:
        log.info(
            "gc %s: kept %d chunks re-used while gc ran (%d touched or uploaded again, %d referenced by a "
            "new manifest)",
            repo.url,
            result.touched_during_gc + result.referenced_during_gc,
            result.touched_during_gc,
            result.referenced_during_gc,
        )


def _young(age: float | None, grace: float) -> bool:
    """Inside the grace period (an unknown age counts as young unless the grace period is 0)."""
    return (age is None and grace > 0) or (age is not None and age < grace)


def _new_references(repo: Repo, known: set[int]) -> set[str]:
    """Chunk ids of manifests stored since ``known`` was filled (``known`` is updated). Read from
    the store, not the manifest cache: a version number gc removed (abandoned) may be reused."""
    found: set[str] = set()
    for key in repo.store.list(VERSIONS_PREFIX):
        v = parse_version_key(key)
        if v is None or v in known:
            continue
        try:
            m = manifest_from_json(repo.store.get(key), f"{repo.url}/{key}")
        except NotFoundError:
            continue  # deleted meanwhile
        known.add(v)
        found.update(c.id for c in m.chunks)
    return found


# --- object ages, through the Store protocol ----------------------------------------------------
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
    """``(key, size, age in seconds or None if unknown)`` of every object under ``prefix``.

    Ages are ``store.now()`` read before the listing minus each object's ``last_modified``, both by
    the store's clock: the time the listing takes can only make an object look younger.
    """
    now = store.now()
    for meta in store.list_meta(prefix):
        yield meta.key, meta.size, _age(meta, now)


def object_age(store: Store, key: str, now: float | None = None) -> float | None:
    """Age in seconds of one object now (None if the backend keeps no ages); raises
    :class:`NotFoundError` if it does not exist. ``now``: ``store.now()`` read earlier (it must be
    read before the object's metadata, so that the age can only err young); read here if omitted."""
    if now is None:
        now = store.now()
    meta = store.head_meta(key)
    if meta is None:
        raise NotFoundError(f"{store.url}: no object {key}", key=key)
    return _age(meta, now)


def _age(meta: ObjectMeta, now: float) -> float | None:
    return None if meta.last_modified is None else now - meta.last_modified


__all__ = [
    "GcConfig",
    "GcPlan",
    "GcResult",
    "PartsPlan",
    "gc",
    "plan_parts",
    "list_chunks_with_age",
    "list_with_age",
    "object_age",
    "plan_gc",
]
