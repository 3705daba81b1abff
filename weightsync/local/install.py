"""Changing a folder atomically (docs/RELIABILITY.md): a new version is built in ``staging/``, a
journal naming every rename is written, then the renames run; :func:`recover` rolls an interrupted
install forward. A standby folder may instead be refilled in place (``refill.json`` marks it
meanwhile, so it claims no version until the refill ends)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from weightsync.errors import UsageError, WeightsyncError
from weightsync.format.keys import check_path
from weightsync.format.manifest import Manifest
from weightsync.local.lock import LOCK
from weightsync.local.state import (
    REFILL,
    STATE_DIR,
    LocalState,
    Times,
    _holds,
    _version,
    fsync_dir,
    private_dir,
    read_doc,
    read_state,
    safe_join,
    state_dir,
    stray_entries,
    version_holder,
    write_json_atomic,
)

log = logging.getLogger("weightsync.install")


def _read_journal(folder: Path) -> dict | None:
    """The journal of an interrupted install, every path in it checked; None if there is none."""
    path = state_dir(folder) / "journal.json"
    doc = read_doc(path, "install journal")
    if doc is None:
        return None
    try:
        journal = {
            "version": _version(doc["version"]),
            "store": str(doc["store"]),
            "install": [check_path(p) for p in doc["install"]],
            "remove": [check_path(p) for p in doc["remove"]],
            "files": {check_path(p): (int(size), str(digest)) for p, (size, digest) in doc["files"].items()},
            "kept": {check_path(p): (int(m), int(c)) for p, (m, c) in doc.get("kept", {}).items()},
            "staged": {check_path(p): (int(m), int(c)) for p, (m, c) in doc.get("staged", {}).items()},
        }
    except (ValueError, KeyError, TypeError, AttributeError, WeightsyncError) as exc:
        raise UsageError(f"{path}: corrupt install journal ({exc}); remove {STATE_DIR} to start afresh") from None
    if not set(journal["install"]) <= set(journal["files"]) or set(journal["remove"]) & set(journal["files"]):
        raise UsageError(
            f"{path}: corrupt install journal (it installs files its version lacks, or removes ones it has)"
        )
    return journal


class TornInstallError(WeightsyncError):
    """An install could not complete: the folder now claims no version (the next pull rebuilds it)."""


def _apply_journal(folder: Path, journal: dict, recovering: bool = False) -> None:
    """Run (or finish) the renames of ``journal``, then record its version. A staged file that is
    gone must already be in place (a rename done before a kill): its checksum says so; otherwise
    the folder is marked as holding no version and :class:`TornInstallError` is raised. So is it
    when a file the version keeps is no longer as the folder's state recorded it (changed since
    the pull chose to keep it, or while an interrupted install waited) and its checksum differs,
    or when a staged file's checksum differs: checked always when finishing an interrupted install
    (``recovering``), else where its times are no longer those it was written with."""
    sdir = state_dir(folder)
    staging = sdir / "staging"
    private_dir(folder, "staging", create=False)  # a link there is refused
    try:
        before = (read_state(folder) or LocalState(0, "", {})).files  # what the kept files were checked against
    except UsageError:
        before = {}
    # the times the pull saw when it chose to keep a file (closer than the old state's); staged files' as written
    checked = {rel: tuple(t) for rel, t in journal.get("kept", {}).items()}
    written = {rel: tuple(t) for rel, t in journal.get("staged", {}).items()}
    installed, moved = set(journal["install"]), {}
    for rel in journal["remove"]:  # first, so that a file may become a folder and back
        path = safe_join(folder, rel)
        if path.is_dir() and not path.is_symlink():
            raise UsageError(
                f"{path} is a folder weightsync did not put there (its version has a file there); move it away first"
            )
        path.unlink(missing_ok=True)
        prune_dirs(folder, path.parent)
    for rel in journal["install"]:
        src, dst = safe_join(staging, rel), safe_join(folder, rel)
        if os.path.lexists(src):
            st = os.lstat(src)
            if (recovering or (st.st_mtime_ns, st.st_ctime_ns) != written.get(rel)) and not _holds(
                src, *journal["files"][rel]
            ):  # staging is trusted for nothing once the process that wrote it is gone
                _mark_torn(folder)
                raise TornInstallError(
                    f"{folder}: the staged file {rel} of version {journal['version']} changed before its install "
                    f"({'while the install was interrupted' if recovering else f'another process in {STATE_DIR}?'}); "
                    "the folder now holds no version: pull again to rebuild it"
                )
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
            moved[rel] = (st.st_ino, st.st_mtime_ns)  # a rename moves the ctime, not these
        elif not _holds(dst, *journal["files"][rel]):
            _mark_torn(folder)
            raise TornInstallError(
                f"{folder}: the staged file {rel} of version {journal['version']} vanished before its install "
                f"(another process in {STATE_DIR}?); the folder now holds no version: pull again to rebuild it"
            )
    files = {}
    for rel, (size, digest) in journal["files"].items():
        path = safe_join(folder, rel)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            _mark_torn(folder)
            raise TornInstallError(
                f"{folder}: {rel} is not the file version {journal['version']} installs; "
                "the folder now holds no version: pull again to rebuild it"
            )
        if rel in moved and (st.st_ino, st.st_mtime_ns) != moved[rel] and not _holds(path, size, digest):
            _mark_torn(folder)
            raise TornInstallError(
                f"{folder}: {rel} of version {journal['version']} changed right after its install "
                "(another process writing into the folder?); the folder now holds no version: pull again to rebuild it"
            )
        if (
            rel not in installed
            and not _as_recorded((size, digest, *checked[rel]) if rel in checked else before.get(rel), size, digest, st)
            and not _holds(path, size, digest)
        ):
            _mark_torn(folder)
            raise TornInstallError(
                f"{folder}: {rel}, which version {journal['version']} keeps, changed while it was installed "
                "(another process writing into the folder?); the folder now holds no version: pull again to rebuild it"
            )
        files[rel] = (size, digest, st.st_mtime_ns, st.st_ctime_ns)
    write_json_atomic(sdir / "state.json", {"version": journal["version"], "store": journal["store"], "files": files})
    (sdir / "journal.json").unlink()
    (sdir / REFILL).unlink(missing_ok=True)  # a refill interrupted before this install replaced it
    shutil.rmtree(staging, ignore_errors=True)


def _as_recorded(rec: tuple | None, size: int, digest: str, st: os.stat_result) -> bool:
    """A kept file is still as the folder's state recorded it for the same content (size, digest,
    modification and change times; a record without a change time checks the rest)."""
    return (
        rec is not None
        and (rec[0], rec[1], rec[2]) == (size, digest, st.st_mtime_ns)
        and rec[3] in (None, st.st_ctime_ns)
    )


def _mark_torn(folder: Path) -> None:
    """The folder holds no complete version: it claims none, and is marked weightsync's own (the
    refill marker), so the next pull clears and rebuilds it instead of refusing a foreign folder."""
    sdir = state_dir(folder)
    write_json_atomic(sdir / REFILL, {"torn": True})
    (sdir / "state.json").unlink(missing_ok=True)
    (sdir / "journal.json").unlink(missing_ok=True)
    shutil.rmtree(sdir / "staging", ignore_errors=True)


def prune_dirs(folder: Path, d: Path) -> None:
    """Remove ``d`` and its parents below ``folder`` while they are empty (a file of theirs was removed)."""
    while d != folder and d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def recover(folder: Path) -> None:
    """Finish an interrupted install, or drop an unfinished staging area (spooled chunks stay).
    It writes: only a holder of the folder's lock may call it."""
    private_dir(folder)
    journal = _read_journal(folder)
    if journal is not None:
        _apply_journal(folder, journal, recovering=True)
        log.warning(
            "%s: finished the install of version %d, which a process left unfinished", folder, journal["version"]
        )
    elif private_dir(folder, "staging", create=False):  # a link there is refused, not followed or removed
        shutil.rmtree(state_dir(folder) / "staging")


def interrupted(folder: Path) -> bool:
    """Whether an install into ``folder`` was interrupted and not yet finished (read-only)."""
    return os.path.lexists(state_dir(folder) / "journal.json")


def target_hint(folder: Path) -> str:
    """Where ``folder`` is a subscriber's target (its ``slots`` folder and ``current`` link, the layout
    of :class:`weightsync.service.slots.Slots`), the words that point at the folder it serves."""
    if (folder / "slots").is_dir() and (folder / "current").is_symlink():
        return f" ({folder} is a subscriber's target: its version is in {folder / 'current'})"
    return ""


def prepare_folder(folder: Path, owned: bool = False) -> LocalState | None:
    """Create the folder if needed, recover, and refuse a folder holding anything weightsync does not
    own. An interrupted refill (:func:`begin_refill`) is kept as it is for the next refill
    (``owned``), else emptied. The caller holds the folder's lock (:func:`claim`)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a directory")
    if holder := version_holder(folder, itself=False):
        raise UsageError(
            f"{folder} is inside {holder}, which holds a weightsync version (its next update removes what else "
            "is in it); choose a folder elsewhere"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {folder}: {exc.strerror}") from None
    recover(folder)
    sdir = state_dir(folder)
    for stale in sdir.glob(".tmp-*") if sdir.is_dir() and not sdir.is_symlink() else ():
        if stale.is_symlink() or not stale.is_dir():  # a state or journal write killed before its rename
            stale.unlink(missing_ok=True)  # (the lock is ours: nobody writes one now)
    state = read_state(folder)
    marker = state_dir(folder) / REFILL
    if marker.exists():
        if state is not None:  # killed before the first byte changed, or after the refill's state
            marker.unlink()
        elif owned:
            return None  # an interrupted refill: every file in it is weightsync's, to be overwritten
        else:  # ... and none of it a version: cleared for a pull that builds in staging
            empty_folder(folder)
            marker.unlink()
    if state is None and any(p.name != STATE_DIR for p in folder.iterdir()):
        raise UsageError(
            f"{folder} is not empty and holds no weightsync version; refusing to overwrite it{target_hint(folder)}"
        )
    if state is not None and (stray := stray_entries(folder, set(state.files))):
        raise UsageError(
            f"{folder} holds entries weightsync did not put there ({', '.join(stray[:3])}); move them away first"
        )
    return state


def empty_folder(folder: Path) -> None:
    """Remove every entry of ``folder`` but ``.weightsync`` (whose spool of verified chunks stays)."""
    for entry in folder.iterdir():
        if entry.name != STATE_DIR:
            _remove(entry)


def clear_folder(folder: Path) -> None:
    """Remove every entry of ``folder``, local state included, but its lock file (which a holder
    keeps: a new file would let a second writer in); creates the folder if needed."""
    folder.mkdir(parents=True, exist_ok=True)
    empty_folder(folder)
    sdir = state_dir(folder)
    if sdir.is_dir() and not sdir.is_symlink():
        for entry in sdir.iterdir():
            if entry.name != LOCK:
                _remove(entry)
        if not any(sdir.iterdir()):
            sdir.rmdir()
    elif os.path.lexists(sdir):
        sdir.unlink()


def _remove(entry: Path) -> None:
    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def staging_dir(folder: Path) -> Path:
    """The folder's staging area (created, checked to be a real directory)."""
    return private_dir(folder, "staging")


def spool_dir(folder: Path) -> Path:
    """The folder's spool of verified downloaded chunks (created, checked to be a real directory)."""
    return private_dir(folder, "spool")


def install(
    folder: Path,
    manifest: Manifest,
    store_url: str,
    staged: Mapping[str, Times],
    fsync: bool = True,
    kept: Mapping[str, Times] | None = None,
) -> None:
    """Atomically make ``folder`` hold ``manifest``'s version: ``staged`` files replace the current
    ones, each with its times (mtime, ctime) as written (a staged file no longer so is hashed
    before its rename). ``kept`` has the times of files the version keeps as they were
    when found to hold its bytes: a kept file still so is not hashed again."""
    old = read_state(folder)
    keep = {f.path for f in manifest.files}
    remove = sorted(set(old.files) - keep) if old else []
    journal = {
        "version": manifest.version,
        "store": store_url,
        "install": sorted(staged),
        "remove": remove,
        "files": {f.path: [f.size, f.xxh3] for f in manifest.files},
        "kept": {rel: list(times) for rel, times in (kept or {}).items() if rel in keep and rel not in staged},
        "staged": {rel: list(times) for rel, times in staged.items()},
    }
    write_json_atomic(state_dir(folder) / "journal.json", journal, fsync)
    _apply_journal(folder, journal)


def begin_refill(folder: Path, manifest: Manifest, store_url: str, fsync: bool = True) -> None:
    """Before overwriting ``folder``'s files in place: mark it weightsync's own, make it claim no
    version, and remove the entries ``manifest``'s version does not have (so that no directory
    stands where a file goes)."""
    sdir = state_dir(folder)
    write_json_atomic(sdir / REFILL, {"version": manifest.version, "store": store_url}, fsync)
    (sdir / "state.json").unlink(missing_ok=True)
    if fsync:
        fsync_dir(sdir)
    for rel in stray_entries(folder, {f.path for f in manifest.files}):
        path = folder / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def open_in_place(path: Path):
    """``path`` opened for overwriting in place (no truncation: the caller truncates at the end).
    A file with other hard links (shared with another folder by :func:`clone` or :func:`adopt`),
    or anything that is not a regular file, is replaced by a new file instead, so that another
    folder never sees its bytes change."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return open(os.open(path, os.O_WRONLY | os.O_NOFOLLOW), "wb", closefd=True)
    if st is not None:
        path.unlink()
    return open(path, "xb")


def finish_refill(
    folder: Path, manifest: Manifest, store_url: str, checked: Mapping[str, Times], fsync: bool = True
) -> None:
    """After every file of ``manifest`` is in place and verified: the state, then the marker goes.
    ``checked`` has each file's times (mtime, ctime) as they were when its bytes were verified
    (written, or found unchanged); a file no longer so must hash to its checksum, or
    :class:`TornInstallError` is raised and the folder goes on claiming no version."""
    files = {}
    for f in manifest.files:
        path = safe_join(folder, f.path)
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is None or not (
            stat.S_ISREG(st.st_mode)
            and st.st_size == f.size
            and ((st.st_mtime_ns, st.st_ctime_ns) == checked.get(f.path) or _holds(path, f.size, f.xxh3))
        ):
            raise TornInstallError(
                f"{folder}: {f.path} changed while version {manifest.version} was written into the folder "
                "(another process writing into it?); it holds no version: pull again to rebuild it"
            )
        files[f.path] = (f.size, f.xxh3, st.st_mtime_ns, st.st_ctime_ns)
    sdir = state_dir(folder)
    write_json_atomic(sdir / "state.json", {"version": manifest.version, "store": store_url, "files": files}, fsync)
    (sdir / REFILL).unlink(missing_ok=True)
    if fsync:
        fsync_dir(sdir)
