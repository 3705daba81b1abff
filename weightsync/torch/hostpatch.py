"""The host side of device-side diffing: a mirror of the last published file, patched with the
changes that came from the device, and publishing straight from those changes.

:class:`HostMirror` patches the last published version's safetensors file at the changed positions
(in place, undone if the publish fails, or copy-on-write into a new folder), which yields the new
bytes that the manifest's checksums need and the wrapping differences. :func:`publish_changes`
then publishes the file as :func:`weightsync.publish` would (same codec choices, payloads, chunks
and manifest), building ``sparse`` payloads from the changes instead of re-diffing on the host.
See :mod:`weightsync.torch.device` for the device side and the trainer-facing publisher.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from weightsync.codec.payload import EncodedTensor, delta_codec, encode_sparse_from_changes, encode_tensor
from weightsync.errors import BaseMismatchError, UsageError
from weightsync.format.dtypes import UINT_VIEW, itemsize
from weightsync.format.manifest import Manifest
from weightsync.format.safetensors import SourceSegment
from weightsync.local.checkpoint import describe_file, scan_checkpoint
from weightsync.store.repo import Repo
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.publish import (
    NewVersion,
    PublishConfig,
    PublishResult,
    cache_claim,
    cache_version,
    encode_and_commit,
    next_version,
)
from weightsync.torch.dtypes import NP_INT as _NP_INT
from weightsync.torch.dtypes import TORCH_DTYPE

_FICLONE = 0x40049409


# --- what crosses from the device ------------------------------------------------------------------
@dataclass
class TensorChange:
    """One tensor's change since the snapshot, on the host."""

    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    index: np.ndarray | None  # ascending flat positions (int32, or int64 past 2^31 elements); None: whole tensor
    values: np.ndarray  # unsigned bit patterns of the element width: at ``index``, or of every element

    @property
    def nbytes(self) -> int:
        """Bytes of the change on the host (positions and values)."""
        return self.values.nbytes + (0 if self.index is None else self.index.nbytes)


@dataclass
class DeviceDiff:
    """Every tensor's change since the snapshot, as it reached the host, with the bytes moved."""

    changes: dict[str, TensorChange]  # every tensor of the state dict, in its order
    d2h_bytes: int  # bytes copied from the tensors' devices to the host (counted on CPU too)
    tensor_bytes: int  # bytes of all the tensors: what a full copy would move
    seconds: dict[str, float] = field(default_factory=dict)


# --- host side -----------------------------------------------------------------------------------
def clone_file(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new ``dst``: a reflink where the file system has them, else copy_file_range."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        try:
            fcntl.ioctl(fo.fileno(), _FICLONE, fi.fileno())
            return
        except OSError:
            pass
        size, done = os.fstat(fi.fileno()).st_size, 0
        try:
            while done < size and (n := os.copy_file_range(fi.fileno(), fo.fileno(), size - done)):
                done += n
        except OSError:
            done = -1
        if done != size:
            fi.seek(0)
            fo.seek(0)
            fo.truncate()
            shutil.copyfileobj(fi, fo, 16 << 20)


def _map(path: Path, mode: str = "r") -> np.ndarray:
    """A file's bytes, memory-mapped (a plain ndarray view, as numba wants)."""
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(np.memmap(path, dtype=np.uint8, mode=mode))


Deltas = dict[str, tuple[np.ndarray, np.ndarray]]  # tensor name -> (int64 positions, wrapping differences)


Changes = dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]  # (file path, tensor name) -> the same


@dataclass(frozen=True)
class MirrorFile:
    """One version of the mirror: its folder, layout and tensor segments."""

    folder: Path
    layout: tuple
    segments: dict[str, SourceSegment]


class HostMirror:
    """The last published version's safetensors file, kept on the host under ``work`` (tmpfs by
    default) and patched forward: in place (undone if the publish fails), or copy-on-write into a
    new folder so that the previous version stays readable as a delta base."""

    def __init__(self, work: Path, filename: str = "model.safetensors"):
        self.work, self.filename = Path(work), filename
        self.current: MirrorFile | None = None
        self.version: int | None = None
        self._seq = 0
        self._undo: Deltas | None = None  # of an in-place patch not yet published

    def verify(self, parent: Manifest) -> None:
        """Raise :class:`BaseMismatchError` unless the mirror holds ``parent``'s bytes."""
        if self.current is None or [f.path for f in parent.files] != [self.filename]:
            raise BaseMismatchError(f"version {parent.version} is not a single {self.filename}")
        _check_base(self.current.folder, parent)

    def write(
        self, diff: DeviceDiff, metadata: dict[str, str] | None, in_place: bool = False
    ) -> tuple[MirrorFile, Deltas]:
        """The mirror with ``diff`` applied (in place when asked and the layout is unchanged, else
        in a new folder), and the wrapping differences of every tensor that the mirror holds with
        the same dtype and shape."""
        meta = metadata or {"format": "pt"}
        layout = (tuple(sorted(meta.items())), tuple(sorted((n, c.dtype, c.shape) for n, c in diff.changes.items())))
        cur = self.current
        if cur is not None and cur.layout == layout and in_place:
            self._undo = {}
            try:
                self._apply(_map(cur.folder / self.filename, "r+"), cur.segments, diff, None, self._undo)
            except BaseException:
                self.discard(cur)
                raise
            return cur, self._undo
        self._seq += 1
        folder = self.work / f"v{self._seq}"
        folder.mkdir()
        path = folder / self.filename
        try:
            if cur is not None and cur.layout == layout:
                clone_file(cur.folder / self.filename, path)
                deltas = self._apply(_map(path, "r+"), cur.segments, diff, None, {})
            else:
                deltas = self._rebuild(path, diff, meta)
            segments = {s.name: s for s in describe_file(path, self.filename).segments if s.role == "tensor"}
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return MirrorFile(folder, layout, segments), deltas

    @staticmethod
    def _apply(
        mm: np.ndarray,
        segments: dict[str, SourceSegment],
        diff: DeviceDiff,
        out: dict[str, np.ndarray] | None,
        deltas: Deltas,
    ) -> Deltas:
        """Patch each tensor of ``mm`` (in place, or into copies collected in ``out``), recording
        its wrapping differences in ``deltas`` as it goes (so a failed patch can be undone)."""
        for name, ch in diff.changes.items():
            seg = segments.get(name)
            if seg is None or (seg.dtype, seg.shape) != (ch.dtype, ch.shape):
                if ch.index is not None or out is None:
                    raise UsageError(f"{name}: a change against a tensor the mirror does not hold")
                out[name] = ch.values
                continue
            e = mm[seg.begin : seg.end].view(UINT_VIEW[itemsize(ch.dtype)])
            if out is not None:
                e = out[name] = e.copy()
            if ch.index is None:
                idx = np.flatnonzero(e != ch.values)
                vals = ch.values[idx]
            else:
                idx, vals = ch.index.astype(np.int64), ch.values
            deltas[name] = (idx, vals - e[idx])
            e[idx] = vals
        return deltas

    def _rebuild(self, path: Path, diff: DeviceDiff, meta: dict[str, str]) -> Deltas:
        from safetensors.torch import save_file

        arrays: dict[str, np.ndarray] = {}
        if self.current is None:
            mm, segments = np.empty(0, np.uint8), {}
        else:
            mm, segments = _map(self.current.folder / self.filename), self.current.segments
        deltas = self._apply(mm, segments, diff, arrays, {})
        tensors = {}
        for name, ch in diff.changes.items():
            a = arrays[name].view(_NP_INT[itemsize(ch.dtype)])
            tensors[name] = torch.from_numpy(a).view(TORCH_DTYPE[ch.dtype]).reshape(ch.shape)
        save_file(tensors, str(path), metadata=meta)
        return deltas

    def reset(self) -> None:
        """Forget the mirror: the next write rebuilds the file from whole tensors."""
        if self.current is not None:
            shutil.rmtree(self.current.folder, ignore_errors=True)
        self.current = self.version = self._undo = None

    def advance(self, mf: MirrorFile, version: int) -> None:
        """``mf`` is published as ``version``: it becomes the mirror, the previous one is removed."""
        if self.current is not None and self.current.folder != mf.folder:
            shutil.rmtree(self.current.folder, ignore_errors=True)
        self.current, self.version, self._undo = mf, version, None

    def discard(self, mf: MirrorFile) -> None:
        """``mf`` was not published: undo an in-place patch, or remove the new folder."""
        if self.current is None or mf.folder != self.current.folder:
            shutil.rmtree(mf.folder, ignore_errors=True)
            return
        undo, self._undo = self._undo or {}, None
        try:
            mm = _map(mf.folder / self.filename, "r+")
            for name, (idx, diffs) in undo.items():
                seg = mf.segments[name]
                e = mm[seg.begin : seg.end].view(diffs.dtype)
                e[idx] -= diffs
        except Exception:  # the mirror is lost; the next publish copies every tensor
            shutil.rmtree(mf.folder, ignore_errors=True)
            self.current = self.version = None


# --- publishing from known changes ---------------------------------------------------------------
class _ChangeEncoder:
    """The publish pipeline's encoder (``run(job)``, ``seconds``) for a folder whose difference
    from its base is known: ``sparse`` payloads come from the changes; everything else is coded as
    :class:`weightsync.sync.publish._Encoder` codes it, from memory-mapped files. Without a base
    folder the folder was patched in place: base bytes are the new ones minus the changes."""

    def __init__(self, cfg: PublishConfig, files, base_dir: Path | None, changes: Changes, keyframe: bool):
        self.cfg, self.changes, self.keyframe = cfg, changes, keyframe
        self.new = {f.path: _map(f.abspath) for f in files}
        self.old = (
            None
            if base_dir is None
            else {f.path: _map(base_dir / f.path) for f in files if (base_dir / f.path).is_file()}
        )
        self.seconds = {"read": 0.0, "diff": 0.0, "encode": 0.0}
        self._lock = threading.Lock()

    def _old(self, job, new: np.ndarray, change) -> np.ndarray:
        b = job.base_seg
        if self.old is not None:
            return self.old[job.file.path][b.begin : b.end]
        if (b.begin, b.end) != (job.seg.begin, job.seg.end):
            raise BaseMismatchError(f"{job.file.path}: {job.seg.name or job.seg.role} moved; no in-place base")
        old = new.copy()
        if change is not None:
            idx, diffs = change
            e = old.view(diffs.dtype)
            e[idx] -= diffs
        return old

    def _delta(self, job, new: np.ndarray, digest: str) -> EncodedTensor:
        s, b, codec = job.seg, job.base_seg, self.cfg.codec
        change = self.changes.get((job.file.path, s.name)) if s.role == "tensor" else None
        if change is not None:
            idx, diffs = change
            n, sparse = s.nbytes // itemsize(s.dtype), delta_codec(s.dtype, codec) == "sparse"
            if idx.size == 0:
                return EncodedTensor("same", b"", 0)
            if sparse and idx.size <= codec.dense_above * n:  # where encode_tensor would choose sparse
                return EncodedTensor("sparse", encode_sparse_from_changes(s.dtype, n, idx, diffs, codec), int(idx.size))
        elif self.old is None:  # untouched by an in-place patch: must be the base's bytes
            if digest != b.xxh3:
                raise BaseMismatchError(f"{job.file.path}: {s.name or s.role} differs from the base version")
            return EncodedTensor("same", b"", 0)
        old = self._old(job, new, change)
        if change is None and np.array_equal(old, new):
            return EncodedTensor("same", b"", 0)
        return encode_tensor(s.dtype, new, old, codec)

    def run(self, job) -> tuple[np.ndarray, str, EncodedTensor, EncodedTensor | None]:
        t0 = time.perf_counter()
        new = self.new[job.file.path][job.seg.begin : job.seg.end]
        digest = xxhash.xxh3_128_hexdigest(new)
        t1 = time.perf_counter()
        delta = None if job.base_seg is None else self._delta(job, new, digest)
        enc = encode_tensor(job.seg.dtype, new, None, self.cfg.codec) if self.keyframe or delta is None else delta
        with self._lock:
            self.seconds["read"] += t1 - t0
            self.seconds["encode"] += time.perf_counter() - t1
        return new, digest, enc, delta if self.keyframe else None


def _check_base(base_dir: Path, parent: Manifest) -> None:
    for f in parent.files:
        try:
            actual = xxhash.xxh3_128_hexdigest(_map(base_dir / f.path))
        except OSError as exc:
            raise BaseMismatchError(
                f"{base_dir}/{f.path}: base for version {parent.version} unreadable ({exc})"
            ) from None
        if actual != f.xxh3:
            raise BaseMismatchError(f"{base_dir}/{f.path}: bytes differ from version {parent.version}")


def publish_changes(
    folder: str | os.PathLike[str],
    repo: Repo,
    changes: Changes,
    base_version: int,
    base_dir: str | os.PathLike[str] | None = None,
    version: int | None = None,
    config: PublishConfig = PublishConfig(),
    cache_dir: str | os.PathLike[str] | None = None,
    observer: Observer | None = None,
) -> PublishResult:
    """Publish ``folder`` as :func:`weightsync.sync.publish.publish` would with ``base_dir`` (same
    payloads, chunks and manifest), given ``changes``: for tensors ``(file path, name)`` of the
    same dtype and shape in both, the flat positions (int64, ascending) where ``folder`` differs
    from the base and the wrapping differences there (unsigned, element width); tensors not listed
    are diffed on the host. ``base_dir`` must hold ``base_version``, the store's head (checked
    here; :class:`BaseMismatchError` before anything is written). ``base_dir=None``: ``folder``
    held ``base_version`` (the caller checked it) and was patched in place by ``changes`` only.
    ``observer``: as :func:`weightsync.sync.publish.publish`'s."""
    src, base_dir = Path(folder), None if base_dir is None else Path(base_dir)
    files = scan_checkpoint(src, config.ignore)
    head, etag = repo.head()
    if head != base_version:
        raise BaseMismatchError(f"the store's head is version {head}, the base holds {base_version}")
    version = next_version(repo, head, version)
    parent = repo.manifest(head)
    keyframe = parent.chain_length + 1 >= config.keyframe_interval
    with cache_claim(cache_dir, src) as lock:  # as publish's: refused or busy before anything is written
        op = Operation(observer)
        encoder = _ChangeEncoder(config, files, base_dir, changes, keyframe)
        if base_dir is not None:
            _check_base(base_dir, parent)
            encoder.seconds["verify_base"] = op.elapsed()
        new = NewVersion(version, parent, keyframe, etag)
        result, manifest = encode_and_commit(repo, files, new, encoder, config, op)
        if cache_dir is not None:
            cache_version(Path(cache_dir), manifest, src, repo.url, lock)
    return result
