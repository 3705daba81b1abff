"""Fetching selected tensors of a version (``--include``/``--exclude``), and partial folders that
hold only them: the pull's own plan and rebuild path (:mod:`weightsync.sync.rebuild`), every
tensor checked before anyone sees it (docs/DESIGN.md: the folder's layout and updates)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from weightsync.errors import (
    BaseMismatchError,
    CheckpointError,
    ChecksumError,
    FormatError,
    SignatureError,
    UsageError,
    VersionError,
    WeightsyncError,
)
from weightsync.format.keys import MAX_VERSION, check_path
from weightsync.format.manifest import FileEntry, Manifest, Segment
from weightsync.format.safetensors import parse_safetensors_header
from weightsync.local.base import check_checksum
from weightsync.local.checkpoint import read_range
from weightsync.local.install import TornInstallError, empty_folder, prune_dirs, spool_dir
from weightsync.local.lock import FolderLock, claim
from weightsync.local.state import (
    PARTIAL_STATE,
    REFILL,
    STATE_DIR,
    open_regular,
    private_dir,
    read_doc,
    safe_join,
    stray_entries,
    version_holder,
    write_json_atomic,
)
from weightsync.store import same_store
from weightsync.store.repo import Repo
from weightsync.sync.lazy import Reads, plan_reads
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.plan import plan_segment
from weightsync.sync.pull import PullConfig, resolve_version
from weightsync.sync.rebuild import TensorJob, build_tensors, fetch_jobs
from weightsync.sync.transfer import clear_spool

STATE = PARTIAL_STATE


@dataclass(frozen=True)
class Selection:
    """Glob patterns (``fnmatch``, case-sensitive) over tensor names: included and not excluded."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def matches(self, name: str) -> bool:
        """Whether tensor ``name`` is selected: it matches an include pattern (if any) and no exclude one."""
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)


# --- partial folders -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartialState:
    """What ``partial.json`` records: the version a partial folder holds, its store and selection, and
    per file its size, checksum and its tensors' checksums."""

    version: int
    store: str
    selection: Selection
    files: dict  # path -> {"size", "xxh3", "tensors": {name: xxh3}}


@dataclass
class PartialResult:
    """What a partial pull did: the version now held, the one before, bytes fetched, files written,
    tensors selected, seconds per phase."""

    version: int
    from_version: int | None
    fetched_bytes: int
    written_files: int
    tensors: int
    seconds: dict[str, float]


def read_partial_state(folder: Path) -> PartialState | None:
    """The partial folder's state, every path and field checked; None if it has none."""
    path = folder / STATE_DIR / STATE
    doc = read_doc(path, STATE)
    if doc is None:
        return None
    try:
        sel = Selection(tuple(map(str, doc["include"])), tuple(map(str, doc["exclude"])))
        files = {}
        for p, rec in doc["files"].items():
            tensors = {str(n): str(h) for n, h in rec["tensors"].items()}
            files[check_path(p)] = {"size": int(rec["size"]), "xxh3": str(rec["xxh3"]), "tensors": tensors}
            for key in ("mtime_ns", "ctime_ns"):
                if key in rec:
                    files[p][key] = int(rec[key])
        version = doc["version"]
        if type(version) is not int or not 0 <= version <= MAX_VERSION:
            raise TypeError(f"version {version!r} out of range")
        return PartialState(version, str(doc["store"]), sel, files)
    except (ValueError, KeyError, TypeError, AttributeError, WeightsyncError) as exc:
        raise UsageError(f"{path}: corrupt {STATE} ({exc}); remove {STATE_DIR} to start afresh") from None


class _PartialBase:
    """Reads a partial folder's tensors by name, verified against the local version's segments."""

    def __init__(self, folder: Path, state: PartialState | None):
        self.folder, self.state = folder, state
        self._index: dict[str, dict[str, tuple[int, int]]] = {}

    def _offsets(self, path: str) -> dict[str, tuple[int, int]]:
        if path not in self._index:
            f = self.folder / path
            segs = parse_safetensors_header(_head_bytes(f), f.stat().st_size, path)
            self._index[path] = {s.name: (s.begin, s.end) for s in segs if s.role == "tensor"}
        return self._index[path]

    def __call__(self, path: str, seg: Segment) -> np.ndarray:
        try:
            if self.state is None or path not in self.state.files:
                raise FileNotFoundError(path)
            begin, end = (seg.begin, seg.end) if seg.role != "tensor" else self._offsets(path)[seg.name]
            fd = open_regular(self.folder / path)
            try:
                data = read_range(fd, begin, end, path)
            finally:
                os.close(fd)
        except (OSError, KeyError, ValueError, CheckpointError) as exc:
            raise BaseMismatchError(
                f"{self.folder}/{path}: no local bytes for {seg.name or seg.role} ({exc})"
            ) from None
        if xxhash.xxh3_128_hexdigest(data) != seg.xxh3:
            raise BaseMismatchError(f"{self.folder}/{path}: {seg.name or seg.role} differs from the local version")
        return data


def _head_bytes(f: Path) -> bytes:
    with open(open_regular(f), "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        fh.seek(0)
        return fh.read(8 + n)


def _wanted(target: Manifest, sel: Selection) -> list[tuple[FileEntry, list[Segment]]]:
    out = []
    for f in target.files:
        if f.kind != "safetensors":
            out.append((f, list(f.segments)))
            continue
        tensors = [s for s in f.segments if s.role == "tensor" and sel.matches(s.name)]
        if tensors:
            out.append((f, [f.segments[0], *tensors]))  # the header, for its __metadata__
    return out


def _header(f: FileEntry, header_bytes: np.ndarray, tensors: list[Segment]) -> bytes:
    verified = {
        s.name: s for s in parse_safetensors_header(header_bytes.tobytes(), f.size, f.path) if s.role == "tensor"
    }
    n = int.from_bytes(header_bytes[:8].tobytes(), "little")
    src = json.loads(header_bytes[8 : 8 + n].tobytes())  # parsed once already, above
    for s in tensors:  # the header bytes were checked against their checksum; the manifest's labels must agree
        v = verified.get(s.name)
        if v is None or (v.dtype, v.shape, v.begin, v.end) != (s.dtype, s.shape, s.begin, s.end):
            raise FormatError(
                f"{f.path}: the manifest's entry for {s.name!r} disagrees with the file's verified header"
            )
    doc: dict = {"__metadata__": src["__metadata__"]} if "__metadata__" in src else {}
    off = 0
    for s in tensors:
        doc[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def materialize(
    repo: Repo,
    folder: str | os.PathLike[str],
    version: int,
    selection: Selection,
    *,
    config: PullConfig | None = None,
    observer: Observer | None = None,
    lock: FolderLock | None = None,
) -> PartialResult:
    """Make ``folder`` a partial folder holding ``selection`` of ``version`` (see the module doc).
    ``config``: the fetch concurrency, decode threads, memory bound and fsync, as a pull's.
    ``observer``: as :func:`weightsync.sync.pull.pull`'s (cancels before the folder changes).
    One writer per folder: runs under ``lock`` (a lock on ``folder`` the caller holds) or takes one."""
    with claim(Path(folder), lock, "weightsync partial pull"):
        return _materialize(repo, Path(folder), version, selection, config or PullConfig(), Operation(observer))


def _prepare(out: Path) -> PartialState | None:
    """The folder's partial state, after refusing a folder that holds what weightsync did not put
    there, and emptying one whose update was interrupted (marked, no state)."""
    if holder := version_holder(out, itself=False):
        raise UsageError(
            f"{out} is inside {holder}, which holds a weightsync version (its next update removes what else is "
            "in it); choose a folder elsewhere"
        )
    private_dir(out)
    state = read_partial_state(out)
    if state is None:
        if (out / STATE_DIR / REFILL).exists():
            empty_folder(out)
            (out / STATE_DIR / REFILL).unlink()
        elif any(p.name != STATE_DIR for p in out.iterdir()):
            raise UsageError(f"{out} is not empty and holds no weightsync version; refusing to overwrite it")
    elif stray := stray_entries(out, set(state.files)):
        raise UsageError(
            f"{out} holds entries weightsync did not put there ({', '.join(stray[:3])}); move them away first"
        )
    return state


def _materialize(
    repo: Repo, out: Path, version: int, selection: Selection, cfg: PullConfig, op: Operation
) -> PartialResult:
    version = resolve_version(repo, version)  # as a pull's: none above the head (a publish not committed)
    state = _prepare(out)
    held = frozenset(state.files) if state is not None else frozenset()  # removed below unless kept
    if state is not None and (not same_store(state.store, repo.url) or state.selection != selection):
        state = None  # another store or selection: nothing local is reused
    if state is not None and state.version == version:
        result = PartialResult(version, version, 0, 0, 0, {"total": 0.0})
        op.done(result.seconds)
        return result
    local = None
    if state is not None:
        try:
            local = repo.manifest(state.version)  # also off the chain: identical tensors are copied
        except (VersionError, SignatureError):
            state = None  # collected by gc, or refused (its signature)
    target = repo.manifest(version)
    files = _wanted(target, selection)
    if not any(f.kind == "safetensors" for f, _ in files) and (selection.include or selection.exclude):
        raise UsageError(
            f"no tensor of version {version} matches include={list(selection.include)} "
            f"exclude={list(selection.exclude)}"
        )
    wanted = [(f.path, s) for f, segs in files for s in segs]

    def planned(local: Manifest | None) -> tuple[list[TensorJob], Reads]:
        ahead = [] if local is None or not cfg.backward else repo.descent(version, local.version)  # a rollback

        def make(chain: list[Manifest], avoid: frozenset[str], use_avoided: bool):
            # headers are rebuilt from the chain (the local folder holds our header, not the source's)
            jobs = []
            for p, s in wanted:
                own = None if s.role == "header" else local
                jobs.append(TensorJob(p, plan_segment(chain, p, s, own, avoid, use_avoided, ahead)))
            return jobs, [j.recipe for j in jobs]

        back_to = None if local is None else local.version
        return plan_reads(repo, version, make, back_to=back_to, lazy=cfg.lazy)

    base = _PartialBase(out, state)
    try:
        result = _write(repo, base, held, target, selection, *planned(local), cfg, op)
    except BaseMismatchError:  # the folder changed behind our back: rebuild without local bytes
        result = _write(repo, base, held, target, selection, *planned(None), cfg, op)
    op.done(result.seconds)
    return result


def _write(
    repo: Repo,
    base: _PartialBase,
    held: frozenset[str],
    target: Manifest,
    sel: Selection,
    jobs: list[TensorJob],
    reads: Reads,
    cfg: PullConfig,
    op: Operation,
) -> PartialResult:
    """Rebuild ``jobs`` (the files of ``sel`` in ``target``, in order) in staging, then swap them
    into ``base.folder`` in place of the files it ``held`` (its state's, whether or not that state
    was another selection's or store's): those the target lacks go first, so that a file may become
    a folder and back."""
    out, state, fsync = base.folder, base.state, cfg.fsync
    files = _wanted(target, sel)
    sdir = out / STATE_DIR
    spool = spool_dir(out)  # checked (never a link) before anything is written
    staging = private_dir(out, "staging")
    empty_folder(staging)
    paths, fetched = fetch_jobs(repo, jobs, spool, cfg.fetch_concurrency, op, reads)
    seconds = {"fetch": op.elapsed()}
    op.phase("write", sum(j.recipe.segment.nbytes for j in jobs))
    built = build_tensors(
        jobs,
        paths,
        base,
        url=repo.url,
        threads=cfg.decode_threads,
        inflight_bytes=cfg.inflight_bytes,
        op=op,
        reads=reads,
    )
    record: dict[str, dict] = {}
    try:
        for f, segs in files:
            record[f.path] = _write_file(staging / f.path, f, segs, built, fsync)
            op.progress(sum(s.nbytes for s in segs))
    finally:
        built.close()  # stop the workers now if a file failed
    seconds["build"] = op.elapsed() - seconds["fetch"]
    write_json_atomic(sdir / REFILL, {"partial": True}, fsync)  # ours, claiming no version, until the state
    (sdir / STATE).unlink(missing_ok=True)
    for path in held - set(record):
        gone = safe_join(out, path)
        gone.unlink(missing_ok=True)
        prune_dirs(out, gone.parent)  # as a full install: a folder left empty is no entry of the version
    for path in record:
        dst, written = safe_join(out, path), record[path].pop("written")
        dst.parent.mkdir(parents=True, exist_ok=True)
        staged = os.lstat(staging / path)
        if (staged.st_mtime_ns, staged.st_ctime_ns) != written:
            raise TornInstallError(
                f"{out}: the staged file {path} of version {target.version} changed before its install "
                f"(another process in {STATE_DIR}?); the folder now holds no version: pull again to rebuild it"
            )
        os.replace(staging / path, dst)
        st = os.lstat(dst)
        if (st.st_ino, st.st_mtime_ns) != (staged.st_ino, staged.st_mtime_ns):
            raise TornInstallError(
                f"{out}: {path} of version {target.version} changed right after its install (another process "
                "writing into the folder?); the folder now holds no version: pull again to rebuild it"
            )
        record[path].update(mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
    doc = {
        "format": "weightsync.partial",
        "version": target.version,
        "store": repo.url,
        "include": list(sel.include),
        "exclude": list(sel.exclude),
        "files": record,
    }
    write_json_atomic(sdir / STATE, doc, fsync)
    (sdir / REFILL).unlink()
    shutil.rmtree(staging, ignore_errors=True)
    clear_spool(spool_dir(out))
    seconds["total"] = op.elapsed()
    n = sum(len(r["tensors"]) for r in record.values())
    return PartialResult(target.version, None if state is None else state.version, fetched, len(record), n, seconds)


def _write_file(dest: Path, f: FileEntry, segs: list[Segment], built: Iterator, fsync: bool) -> dict:
    dest.parent.mkdir(parents=True, exist_ok=True)
    hasher, tensors = xxhash.xxh3_128(), {}
    with open(dest, "wb") as fh:
        if f.kind != "safetensors":
            for _ in segs:
                _, data = next(built)
                fh.write(memoryview(data))
                hasher.update(data)
        else:
            _, header_bytes = next(built)
            head = _header(f, header_bytes, segs[1:])
            fh.write(head)
            hasher.update(head)
            for seg in segs[1:]:
                _, data = next(built)
                fh.write(memoryview(data))
                hasher.update(data)
                tensors[seg.name] = seg.xxh3
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
        size = fh.tell()
        st = os.fstat(fh.fileno())
    if f.kind != "safetensors" and hasher.hexdigest() != f.xxh3:
        raise ChecksumError(f.path, f.xxh3, hasher.hexdigest())
    return {"size": size, "xxh3": hasher.hexdigest(), "tensors": tensors, "written": (st.st_mtime_ns, st.st_ctime_ns)}


def verify_partial(repo: Repo, folder: str | os.PathLike[str], version: int | None = None) -> int:
    """Raise unless ``folder`` is a complete partial folder of ``version`` (default: the one it claims);
    every tensor is re-read and checked against the version's manifest."""
    out = Path(folder)
    state = read_partial_state(out)
    if state is None:
        raise UsageError(f"{out} is not a partial folder")
    v = state.version if version is None else version
    if state.version != v:
        raise ChecksumError(f"{out} (version)", str(v), str(state.version))
    target = repo.manifest(v)
    expected = {f.path: [s.name for s in segs if s.role == "tensor"] for f, segs in _wanted(target, state.selection)}
    if set(expected) != set(state.files):
        raise ChecksumError(f"{out}: files", ", ".join(sorted(expected)), ", ".join(sorted(state.files)))
    for path, names in expected.items():
        rec, f = state.files[path], target.file(path)
        data = (out / path).read_bytes()
        check_checksum(str(out / path), rec["xxh3"], data)
        if f.kind != "safetensors":
            check_checksum(str(out / path), f.xxh3, data)
            continue
        segs = {s.name: s for s in parse_safetensors_header(data, len(data), path) if s.role == "tensor"}
        if list(segs) != names:
            raise ChecksumError(f"{out / path}: tensors", ", ".join(names), ", ".join(segs))
        for s in f.segments:
            if s.name in segs:
                check_checksum(f"{out / path}: {s.name}", s.xxh3, data[segs[s.name].begin : segs[s.name].end])
    return v
