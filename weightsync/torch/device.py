"""Publishing a state dict by diffing it where its tensors live (CUDA when present): only the changed
positions and their new bit patterns cross to the host, which patches its mirror of the last
version's file and publishes it (docs/DESIGN.md: the path, the costs)::

    with DeviceDiffPublisher(store) as pub:         # or StateDictPublisher(store, device_diff=True)
        for step in range(steps):
            train_step()
            r = pub.publish(model.state_dict())      # r.d2h_bytes: what crossed to the host"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from weightsync.errors import BaseMismatchError, UsageError
from weightsync.format.dtypes import UINT_VIEW
from weightsync.store.repo import open_repo
from weightsync.sync.observer import Observer
from weightsync.sync.publish import PublishConfig, PublishResult, publish
from weightsync.torch.dtypes import ST_DTYPE
from weightsync.torch.dtypes import TORCH_INT as _TORCH_INT
from weightsync.torch.hostpatch import (
    Deltas,
    DeviceDiff,
    HostMirror,
    MirrorFile,
    TensorChange,
    publish_changes,
)


# --- device side ---------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat, contiguous signed-integer view of the same width."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(_TORCH_INT[t.element_size()])


def _unsigned(a: np.ndarray) -> np.ndarray:
    return a.view(UINT_VIEW[a.dtype.itemsize])


def make_work_folder(work_dir: str | os.PathLike | None, prefix: str) -> Path:
    """A new folder for an in-process publisher's files, under ``work_dir``, by default ``/dev/shm``
    when it is there and writable (tmpfs: no disk I/O), else the temp folder."""
    shm = Path("/dev/shm")
    if work_dir is not None:
        root = Path(work_dir)
    else:
        root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


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
        self.work = make_work_folder(work_dir, "weightsync-dd-")
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
        shutil.rmtree(self.work, ignore_errors=True)
        self.mirror.current = None

    def __enter__(self) -> DeviceDiffPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
