"""Publishing a state dict by diffing it where its tensors live (CUDA when present): only the changed
positions and their new bit patterns cross to the host, which patches its mirror of the last
version's file and publishes it (docs/DESIGN.md: the path, the costs)::

    with DeviceDiffPublisher(store) as pub:         # or StateDictPublisher(store, device_diff=True)
        for step in range(steps):
            train_step()
            r = pub.publish(model.state_dict())      # r.d2h_bytes: what crossed to the host"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from weightsync.errors import BaseMismatchError, FormatError, NotFoundError, UsageError, VersionError
from weightsync.format.dtypes import UINT_VIEW, itemsize
from weightsync.format.keys import check_path
from weightsync.format.manifest import PartManifest
from weightsync.local.checkpoint import scan_checkpoint
from weightsync.local.scratch import ScratchDir
from weightsync.store.repo import open_repo
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.parts import (
    CommitResult,
    PartResult,
    RankView,
    check_world,
    commit_parts,
    rank_poll,
    read_refusal,
    store_part,
)
from weightsync.sync.publish import (
    DeltaBase,
    PublishConfig,
    PublishResult,
    encode_and_upload,
    encode_folder,
    plan_version,
    publish,
)
from weightsync.torch.dtypes import NP_INT as _NP_INT
from weightsync.torch.dtypes import ST_DTYPE
from weightsync.torch.dtypes import TORCH_INT as _TORCH_INT
from weightsync.torch.hostpatch import (
    Deltas,
    DeviceDiff,
    HostMirror,
    MirrorFile,
    TensorChange,
    _ChangeEncoder,
    publish_changes,
)

log = logging.getLogger("weightsync.publish")


# --- device side ---------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat, contiguous signed-integer view of the same width."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(_TORCH_INT[t.element_size()])


def _unsigned(a: np.ndarray) -> np.ndarray:
    return a.view(UINT_VIEW[a.dtype.itemsize])


def make_work_folder(work_dir: str | os.PathLike | None, prefix: str, what: str) -> ScratchDir:
    """A new folder for an in-process publisher's files, under ``work_dir``, by default ``/dev/shm``
    when it is there and writable (tmpfs: no disk I/O), else the temp folder; claimed, so that a
    killed publisher's (a whole model's mirror) is removed by the next one (:class:`ScratchDir`)."""
    shm = Path("/dev/shm")
    if work_dir is not None:
        root = Path(work_dir)
    else:
        root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return ScratchDir(prefix, what, root)


class _Staging:
    """Device-to-host copies: one reusable pinned buffer and ``non_blocking`` copies on CUDA,
    then one synchronization; CPU tensors are already on the host."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None

    def fetch(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [t.numpy() if t.device.type == "cpu" else None for t in tensors]
        cuda = [(i, t) for i, t in enumerate(tensors) if t.device.type == "cuda"]
        for i, t in enumerate(tensors):
            if out[i] is None and t.device.type != "cuda":
                out[i] = t.cpu().numpy()  # other accelerators: plain copies
        if cuda:
            offsets, total = [], 0
            for _, t in cuda:
                offsets.append(total)
                total += -(-t.nbytes // 8) * 8
            if self._pinned is None or self._pinned.numel() < total:
                self._pinned = torch.empty(max(total + total // 2, 1 << 20), dtype=torch.uint8, pin_memory=True)
            views = [self._pinned[o : o + t.nbytes].view(t.dtype) for (_, t), o in zip(cuda, offsets)]
            for (_, t), v in zip(cuda, views):
                v.copy_(t, non_blocking=True)
            for d in {t.device for _, t in cuda}:
                torch.cuda.synchronize(d)
            for (i, _), v in zip(cuda, views):
                out[i] = v.numpy().copy()  # the buffer is reused by the next fetch
        return out  # type: ignore[return-value]


class DeviceSnapshot:
    """A copy of the last diffed state dict on the tensors' own devices; :meth:`diff` finds what
    changed since, moves only that to the host, and advances the copy to the new tensors."""

    def __init__(self, slice_elems: int = 1 << 28, staging_bytes: int = 64 << 20):
        if slice_elems < 1 or staging_bytes < 1:
            raise UsageError("slice_elems and staging_bytes must be positive")
        self.slice_elems, self.staging_bytes = slice_elems, staging_bytes
        self._prev: dict[str, tuple[str, tuple[int, ...], torch.Tensor]] = {}
        self._staging = _Staging()

    def reset(self) -> None:
        """Forget the snapshot (frees its device memory): the next diff copies every tensor."""
        self._prev.clear()

    def drop(self, name: str) -> None:
        """Forget one tensor: the next diff copies it whole."""
        self._prev.pop(name, None)

    def restore(self, name: str, dtype: str, shape: tuple[int, ...], index: np.ndarray, values: np.ndarray) -> None:
        """Put back the bit patterns ``values`` (element width) at the flat positions ``index`` of
        ``name``, undoing the last diff there (only these bytes cross to the device); a tensor the
        snapshot holds with another dtype or shape is dropped instead."""
        prev = self._prev.get(name)
        if prev is None or prev[:2] != (dtype, tuple(shape)):
            self._prev.pop(name, None)
            return
        t = prev[2]
        if index.size:
            idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(t.device)
            vals = torch.from_numpy(np.ascontiguousarray(values).view(_NP_INT[values.dtype.itemsize])).to(t.device)
            t.index_copy_(0, idx, vals)

    def __len__(self) -> int:
        return len(self._prev)

    def _changes(self, cur: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Changed positions (ascending) and new bit patterns; ``prev`` is updated to ``cur``."""
        n = cur.numel()
        index_dtype = torch.int32 if n <= 2**31 - 1 else torch.int64
        idx, vals = [], []
        for start in range(0, n, self.slice_elems):
            c, p = cur[start : start + self.slice_elems], prev[start : start + self.slice_elems]
            pos = torch.nonzero(c != p).view(-1)
            v = c[pos]
            p.index_copy_(0, pos, v)
            idx.append((pos + start).to(index_dtype))
            vals.append(v)
        if len(idx) == 1:
            return idx[0], vals[0]
        if not idx:
            return torch.empty(0, dtype=index_dtype, device=cur.device), cur[:0]
        return torch.cat(idx), torch.cat(vals)

    def diff(self, state_dict) -> DeviceDiff:
        """What changed in ``state_dict`` since the last diff (everything the first time)."""
        t0 = time.perf_counter()
        out = DeviceDiff({}, 0, 0)
        pending: list[tuple[str, str, tuple[int, ...], torch.Tensor, torch.Tensor | None]] = []
        pending_bytes = 0
        seen = set()
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise UsageError(f"{name}: not a tensor ({type(t).__name__})")
            if t.dtype not in ST_DTYPE:
                raise UsageError(f"{name}: dtype {t.dtype} cannot be stored")
            dtype, shape, cur = ST_DTYPE[t.dtype], tuple(t.shape), _bits(t)
            seen.add(name)
            out.tensor_bytes += cur.nbytes
            prev = self._prev.get(name)
            if prev is None or prev[:2] != (dtype, shape) or prev[2].device != cur.device:
                self._prev[name] = (dtype, shape, cur.clone())
                pending.append((name, dtype, shape, cur, None))
            else:
                idx, vals = self._changes(cur, prev[2])
                if vals.nbytes + idx.nbytes >= cur.nbytes:  # dense: the whole tensor is smaller
                    pending.append((name, dtype, shape, cur, None))
                else:
                    pending.append((name, dtype, shape, vals, idx))
                    pending_bytes += vals.nbytes + idx.nbytes
            if pending_bytes >= self.staging_bytes:
                self._flush(pending, out)
                pending, pending_bytes = [], 0
        self._flush(pending, out)
        for name in set(self._prev) - seen:
            del self._prev[name]
        out.seconds["device_diff"] = time.perf_counter() - t0
        return out

    def _flush(self, pending, out: DeviceDiff) -> None:
        """Changes to the host: positions and values through the staging buffer, whole tensors
        by plain copies (they would only bloat the pinned buffer)."""
        host = iter(self._staging.fetch([x for _, _, _, vals, idx in pending if idx is not None for x in (vals, idx)]))
        for name, dtype, shape, vals, idx in pending:
            if idx is None:
                v = vals.cpu().numpy()
                ch = TensorChange(dtype, shape, None, _unsigned(v.copy() if vals.device.type == "cpu" else v))
            else:
                v = _unsigned(next(host))
                ch = TensorChange(dtype, shape, next(host), v)
            out.changes[name] = ch
            out.d2h_bytes += ch.nbytes


# --- the trainer-side publisher ------------------------------------------------------------------
@dataclass
class DevicePublishResult(PublishResult):
    """A :class:`PublishResult` plus what crossed from the devices to the host, the state dict's bytes,
    and the route the version took (``direct``, ``folder`` or ``full``)."""

    d2h_bytes: int = 0  # bytes copied from the tensors' devices to the host for this version
    tensor_bytes: int = 0  # bytes of the state dict's tensors (what a full copy moves)
    route: str = ""  # "direct" (payloads from the device's changes), "folder" (host re-diff) or "full" (no usable base)


class DeviceDiffPublisher:
    """Publishes a trainer's state dict in-process, diffing on the tensors' devices (module doc).

    The first publish, and the first after a failure or after someone else moved the store's head,
    copies every tensor to the host; later ones copy only what changed. ``direct=False`` re-diffs
    on the host with :func:`weightsync.publish` (same result; for comparison). Call
    :meth:`publish` once the step's kernels have finished on the tensors' current streams."""

    def __init__(
        self,
        store,
        *,
        config: PublishConfig | None = None,
        work_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        filename: str = "model.safetensors",
        direct: bool = True,
        slice_elems: int = 1 << 28,
        staging_bytes: int = 64 << 20,
    ):
        self.repo = open_repo(store)
        self.config = config or PublishConfig()
        self._scratch = make_work_folder(work_dir, "weightsync-dd-", "weightsync device-diff publisher (its mirror)")
        self.work = self._scratch.path
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.direct = direct
        self.snapshot = DeviceSnapshot(slice_elems, staging_bytes)
        self.mirror = HostMirror(self.work, filename)

    def publish(
        self,
        state_dict,
        version: int | None = None,
        metadata: dict[str, str] | None = None,
        *,
        observer: Observer | None = None,
    ) -> DevicePublishResult:
        """Publish ``state_dict`` as ``version`` (default: head + 1). ``observer``: as
        :func:`weightsync.sync.publish.publish`'s (it sees the host-side encode and upload)."""
        head = self.repo.head_version()
        based = self.mirror.current is not None and self.mirror.version == head  # the mirror holds the head
        in_place = based and self.direct and self.cache_dir is None  # (a cache may hard-link the mirror)
        t0 = time.perf_counter()
        if in_place:
            try:
                self.mirror.verify(self.repo.manifest(head))
            except BaseMismatchError:
                based = in_place = False
        verify_s = time.perf_counter() - t0
        if not based:
            self.snapshot.reset()
            self.mirror.reset()
        try:
            diff = self.snapshot.diff(state_dict)  # the snapshot now holds state_dict
            t0 = time.perf_counter()
            mf, deltas = self.mirror.write(diff, metadata, in_place)
            patch_s = time.perf_counter() - t0
            try:
                r, route = self._publish(mf, deltas, version, based, observer)
            except BaseException:
                self.mirror.discard(mf)
                raise
        except BaseException:
            self.snapshot.reset()  # ahead of the store, or half updated: start over next time
            raise
        self.mirror.advance(mf, r.version)
        r.seconds.update(diff.seconds, mirror=patch_s, **({"verify_base": verify_s} if in_place else {}))
        return DevicePublishResult(**asdict(r), d2h_bytes=diff.d2h_bytes, tensor_bytes=diff.tensor_bytes, route=route)

    def _publish(
        self, mf: MirrorFile, deltas: Deltas, version: int | None, based: bool, observer: Observer | None
    ) -> tuple[PublishResult, str]:

        base = self.mirror.current.folder if based else None
        if base is not None and self.direct:
            changes = {(self.mirror.filename, n): d for n, d in deltas.items()}
            try:
                return publish_changes(
                    mf.folder,
                    self.repo,
                    changes,
                    self.mirror.version,
                    None if base == mf.folder else base,
                    version,
                    self.config,
                    self.cache_dir,
                    observer,
                ), "direct"
            except BaseMismatchError:
                base = None
        if base is not None and base != mf.folder:
            try:
                return publish(
                    mf.folder,
                    self.repo,
                    version,
                    config=self.config,
                    base_dir=base,
                    cache_dir=self.cache_dir,
                    observer=observer,
                ), "folder"
            except BaseMismatchError:
                pass
        return publish(
            mf.folder, self.repo, version, config=self.config, cache_dir=self.cache_dir, observer=observer
        ), "full"

    def close(self) -> None:
        """Free the device snapshot and the host mirror's folder."""
        self.snapshot.reset()
        self._scratch.close()
        self.mirror.current = None

    def __enter__(self) -> DeviceDiffPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- one rank of a multi-rank publish ------------------------------------------------------------
def rank_filename(rank: int, world: int) -> str:
    """The default file of rank ``rank`` of ``world``: ``rank-<rank+1>-of-<world>.safetensors``,
    both as 5 digits (the shard naming of a checkpoint saved by ``world`` ranks)."""
    check_world(rank, world)
    return f"rank-{rank + 1:05d}-of-{world:05d}.safetensors"


@dataclass
class RankPublishResult(PartResult):
    """A :class:`PartResult` plus what crossed from the devices to the host, the shard's bytes, the
    route (as :class:`DevicePublishResult`'s), whether the version was seen committed (None: not
    waited for) and, on the rank that committed it, the :class:`CommitResult`."""

    d2h_bytes: int = 0
    tensor_bytes: int = 0
    route: str = ""
    committed: bool | None = None
    commit: CommitResult | None = None


@dataclass
class _Pending:
    """A part written and not yet seen committed: what moving the base back needs."""

    version: int
    mf: MirrorFile
    changes: dict[str, TensorChange]  # every tensor of the part's state dict (their names, dtypes, shapes)
    deltas: Deltas  # positions where the part differs from the base, and the differences
    xxh3: str  # the part's file checksum: the committed version must hold exactly this file
    part: PartManifest  # as stored: a committer's refusal names it
    deadline: float  # wait for the commit until then (time.monotonic)
    committer: threading.Thread | None = None
    commit: CommitResult | None = None
    error: BaseException | None = None


class RankDeviceDiffPublisher(DeviceDiffPublisher):
    """Rank ``rank`` of ``world`` publishing its shard of a trainer's state dict as its part of each
    version (docs/FORMAT.md section 6), diffing on the tensors' devices as
    :class:`DeviceDiffPublisher` does::

        with RankDeviceDiffPublisher(store, rank=r, world=W, commit=r == 0) as pub:
            for step in range(steps):
                train_step()
                pub.publish(shard_state_dict(), version=step)   # waits for the commit by default

    The shard is encoded as one file, ``filename`` (default :func:`rank_filename`). The version,
    parent and keyframe flag come from the head, as :func:`weightsync.sync.parts.publish_part`
    decides them, so all ranks agree without messages; give ``version`` (e.g. the step) so that a
    round that failed leaves a number unused rather than a half-written one to collide with. The
    version becomes visible once ``commit_parts`` merges all ``world`` parts: run by this rank
    with ``commit=True`` (after its part, in a thread when ``wait=False``), or by any process
    (``weightsync commit-parts``).

    The base (device snapshot and host mirror) moves to version N only once N is seen at (or
    below) the head holding this rank's file. If N is not committed (a rank failed, the committer
    timed out or refused, another version N was committed instead) the changes of N are undone on
    the host mirror and on the device snapshot, from the positions and old values the host
    already holds: only those bytes go back to the device, no second device copy. When it cannot
    tell (a damaged mirror, a head it does not hold), the next publish copies every tensor."""

    def __init__(
        self,
        store,
        *,
        rank: int,
        world: int,
        commit: bool = False,
        commit_timeout: float = 600.0,
        poll: float = 0.25,
        allow_removed: bool = False,
        config: PublishConfig | None = None,
        work_dir: str | os.PathLike | None = None,
        filename: str | None = None,
        direct: bool = True,
        slice_elems: int = 1 << 28,
        staging_bytes: int = 64 << 20,
    ):
        check_world(rank, world)
        if not commit_timeout >= 0 or not poll > 0:
            raise UsageError("commit_timeout must be >= 0 and poll > 0 seconds")
        filename = rank_filename(rank, world) if filename is None else filename
        try:
            check_path(filename)
        except FormatError as exc:
            raise UsageError(f"filename: {exc}") from None
        if "/" in filename or not filename.endswith(".safetensors"):
            raise UsageError(f"filename must be a plain name ending in .safetensors, not {filename!r}")
        super().__init__(
            store,
            config=config,
            work_dir=work_dir,
            filename=filename,
            direct=direct,
            slice_elems=slice_elems,
            staging_bytes=staging_bytes,
        )
        self.rank, self.world, self.committer = rank, world, commit
        self.commit_timeout, self.poll, self.allow_removed = commit_timeout, poll, allow_removed
        self._pending: _Pending | None = None
        self._rng = random.Random()  # the polls' jitter: not the training's seeded generator, nor in step with it

    @property
    def filename(self) -> str:
        """The file this rank's tensors are published as."""
        return self.mirror.filename

    @property
    def base_version(self) -> int | None:
        """The committed version the snapshot and the mirror hold (None: the next publish copies all)."""
        return self.mirror.version

    def publish(
        self,
        state_dict,
        version: int | None = None,
        metadata: dict[str, str] | None = None,
        *,
        wait: bool = True,
        observer: Observer | None = None,
    ) -> RankPublishResult:
        """Publish this rank's ``state_dict`` as its part of ``version`` (default: head + 1).

        First settles the previous part (waits for its commit until ``commit_timeout`` after it was
        written, then moves the base to it or back). ``wait``: wait for this version's commit too
        (committing it first with ``commit=True``); raises :class:`VersionError` if it is not
        committed in ``commit_timeout`` seconds (the base then stays at the committed head).
        ``wait=False`` returns once the part is written (a committer runs in a thread); see
        :meth:`settle`. ``observer``: as :func:`weightsync.sync.parts.publish_part`'s."""
        self.settle()
        new = plan_version(self.repo, version, self.config)
        head = None if new.parent is None else new.parent.version
        based = self.mirror.current is not None and self.mirror.version == head
        t0 = time.perf_counter()
        if based:
            try:
                self.mirror.verify(RankView(self.repo, [self.filename]).manifest(head))
            except BaseMismatchError:
                based = False
        verify_s = time.perf_counter() - t0
        if not based:
            self.snapshot.reset()
            self.mirror.reset()
        in_place = based and self.direct
        try:
            diff = self.snapshot.diff(state_dict)
            t0 = time.perf_counter()
            mf, deltas = self.mirror.write(diff, metadata, in_place)
        except BaseException:
            self.snapshot.reset()  # half updated, or ahead of a mirror that undid its patch
            raise
        patch_s = time.perf_counter() - t0
        try:
            r, route, part = self._part(new, mf, deltas, based, observer)
        except BaseException:
            self._rollback(mf, diff.changes, deltas)
            raise
        xxh3 = next(f.xxh3 for f in part.files if f.path == self.filename)
        pending = _Pending(new.version, mf, diff.changes, deltas, xxh3, part, time.monotonic() + self.commit_timeout)
        self._pending = pending
        r.seconds.update(diff.seconds, mirror=patch_s, **({"verify_base": verify_s} if based else {}))
        res = RankPublishResult(**asdict(r), d2h_bytes=diff.d2h_bytes, tensor_bytes=diff.tensor_bytes, route=route)
        if self.committer:
            if wait:
                self._commit(pending)
            else:
                pending.committer = threading.Thread(
                    target=self._commit, args=(pending,), name=f"ws-commit-{new.version}", daemon=True
                )
                pending.committer.start()
        if wait:
            res.committed = self.settle()
            res.commit = pending.commit
            if not res.committed:
                if pending.error is not None:
                    raise pending.error
                raise VersionError(
                    f"version {new.version} was not committed within {self.commit_timeout:g}s of rank "
                    f"{self.rank}'s part (a rank missing, or no committer running); rank {self.rank}'s "
                    f"base stays at version {self.base_version}"
                )
        return res

    def _part(
        self, new, mf: MirrorFile, deltas: Deltas, based: bool, observer: Observer | None
    ) -> tuple[PartResult, str, PartManifest]:
        """Encode the mirror's file against the head (from the changes when the mirror held the
        head, else by the folder pipeline), upload it and write the part. Returns the part's
        figures, the route and the part."""
        op = Operation(observer)
        files = scan_checkpoint(mf.folder)
        enc, route = None, "full"
        base = self.mirror.current.folder if based else None
        if base is not None and self.direct:
            changes = {(self.filename, n): d for n, d in deltas.items()}
            encoder = _ChangeEncoder(self.config, files, None if base == mf.folder else base, changes, new.keyframe)
            try:
                enc, route = encode_and_upload(self.repo, files, new, encoder, self.config, op), "direct"
            except BaseMismatchError:
                op.restart()
        view = RankView(self.repo, [self.filename])
        rescan = lambda: scan_checkpoint(mf.folder)  # noqa: E731
        if enc is None and base is not None and base != mf.folder:
            try:
                where = DeltaBase(base_dir=base, repo=view)
                enc, route = encode_folder(self.repo, files, rescan, new, self.config, where, op), "folder"
            except BaseMismatchError:
                op.restart()
        if enc is None:  # the head's bytes of this file, if any, are pulled for the deltas
            enc = encode_folder(self.repo, files, rescan, new, self.config, DeltaBase(repo=view), op)
        op.check()
        r, part = store_part(self.repo, new, enc, self.rank, self.world, op)
        op.done(r.seconds)
        return r, route, part

    def _commit(self, pending: _Pending) -> None:
        try:
            pending.commit = commit_parts(
                self.repo,
                pending.version,
                self.world,
                timeout=max(0.0, pending.deadline - time.monotonic()),
                poll=self.poll,
                allow_removed=self.allow_removed,
                signing_key=self.config.signing_key,
            )
        except Exception as exc:  # reported by publish (wait=True) or logged by settle
            pending.error = exc

    def settle(self) -> bool | None:
        """Wait for the pending part's version (until ``commit_timeout`` after the part was written,
        this rank's committer failed, or a committer stored its refusal of the version), then move
        the base: to that version if it is committed with this rank's file, else back to the
        committed head. True/False: committed or not; None: nothing was pending."""
        p = self._pending
        if p is None:
            return None
        if p.committer is not None:
            p.committer.join()  # commit_parts gives up at the deadline
        ask = 0.0  # when to look for a refusal next: every other poll, at most once a second
        while not (committed := self._committed(p)) and p.error is None and time.monotonic() < p.deadline:
            wait = rank_poll(self.poll, self.world, self._rng)
            if time.monotonic() >= ask:
                if (reason := read_refusal(self.repo, p.part)) is not None:  # no use waiting
                    p.error = VersionError(f"the committer refused version {p.version}: {reason}")
                    break
                ask = time.monotonic() + max(2 * wait, 1.0)
            time.sleep(min(wait, max(0.0, p.deadline - time.monotonic())))
        self._pending = None
        if committed:
            self.mirror.advance(p.mf, p.version)
        else:
            if p.error is not None:
                log.warning("rank %d: committing version %d failed: %s", self.rank, p.version, p.error)
            self._rollback(p.mf, p.changes, p.deltas)
        return committed

    def _committed(self, p: _Pending) -> bool:
        """Version ``p.version`` is at or below the head and holds this rank's file as its part had it."""
        head = self.repo.head_version()
        if head is None or head < p.version:
            return False
        try:
            f = self.repo.manifest(p.version).file(self.filename)
        except (NotFoundError, VersionError, FormatError):
            return False
        return f is not None and f.xxh3 == p.xxh3

    def _rollback(self, mf: MirrorFile, changes: dict[str, TensorChange], deltas: Deltas) -> None:
        """Undo a part not committed on the host mirror (``mf``), then on the device snapshot at
        the positions it changed, with the old bit patterns read back from the mirror."""
        self.mirror.discard(mf)
        cur = self.mirror.current
        if cur is None:  # nothing to restore from: the next publish copies every tensor
            self.snapshot.reset()
            return
        mm = np.memmap(cur.folder / self.filename, dtype=np.uint8, mode="r") if cur.segments else None
        for name, ch in changes.items():
            seg, d = cur.segments.get(name), deltas.get(name)
            if seg is None or d is None or (seg.dtype, seg.shape) != (ch.dtype, ch.shape):
                self.snapshot.drop(name)
                continue
            old = np.asarray(mm[seg.begin : seg.end]).view(UINT_VIEW[itemsize(ch.dtype)])[d[0]]
            self.snapshot.restore(name, ch.dtype, ch.shape, d[0], old)
        del mm

    def close(self) -> None:
        """Settle the pending part (waiting for its committer thread), then free the snapshot and mirror."""
        try:
            if self._pending is not None and self._pending.committer is not None:
                self.settle()
        finally:
            self._pending = None
            super().close()
