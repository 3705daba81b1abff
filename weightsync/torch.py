"""In-process hot swap: apply a version to a live torch model's tensors in place (CPU or CUDA).

    lock = threading.Lock()                      # the serving loop holds it around each forward
    sink = TorchSink(store_url, model, version=7, lock=lock)
    update = sink.prepare("latest")               # fetch, decode, verify, stage: no lock held
    pause = sink.apply(update)                    # under the lock: only the in-place patch

:meth:`TorchSink.prepare` does all the work before the pause: it plans the cheapest recipe per
tensor from the version the model holds (:func:`~weightsync.planner.plan_segment`), fetches only
the bytes those recipes need, rebuilds each changed tensor on the CPU from the model's own bytes
(which are first checked against the checksums of the version the sink believes it holds),
verifies the result against the new version's xxh3, and reduces it to a patch: the positions
that changed and their new bit patterns (int64 indices, integer-view values), or the whole new
tensor when more than ``dense_above`` of it changed. Patches are moved to the tensor's device
before the lock is taken. :meth:`TorchSink.apply` then takes the lock and only scatters the changed
elements (``scatter_`` on an integer view of the same width, so every bit pattern, NaN payloads
included, is copied exactly) or copies dense tensors, synchronizes the device, and releases it.

On CUDA the patch runs on the applying thread's current stream and is synchronized before the
lock is released; the serving loop should likewise let its kernels finish (or run them on the
default stream) before it releases the lock, so that no forward pass overlaps the patch.

Tensors of the store that the model does not have are ignored; a tensor whose dtype or shape
differs is an error (an in-place patch cannot change either).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

import weightsync

from .dtypes import UINT_VIEW, itemsize
from .errors import BaseMismatchError, UsageError, VersionError
from .format import Manifest, Segment
from .partial import TensorJob, build_tensors, fetch_for
from .planner import plan_segment
from .pulling import resolve_version

TORCH_DTYPE: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass
class Patch:
    name: str
    target: torch.Tensor  # a flat integer view of the live tensor (same width, same memory)
    index: torch.Tensor | None  # int64 positions on the tensor's device (None: dense copy)
    values: torch.Tensor  # new bit patterns (flat integer view) at ``index``, or of the whole tensor


@dataclass
class Update:
    """A prepared update from ``from_version`` to ``version``: everything but the in-place patch."""

    version: int
    from_version: int
    patches: list[Patch] = field(default_factory=list)
    fetched_bytes: int = 0
    changed_elements: int = 0
    tensors: int = 0  # tensors in the version that the model holds
    seconds: dict[str, float] = field(default_factory=dict)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a 1-D uint8 array (a view for CPU tensors, a copy otherwise)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1).view(_INT_VIEW[t.element_size()])


class TorchSink:
    """Keeps a model's tensors at a version of a store by in-place patches (see the module doc).

    ``tensors``: an ``nn.Module`` (its ``state_dict()``: parameters and persistent buffers) or a
    mapping of names to tensors. ``version``: the version they hold now; with ``verify=True`` every
    tensor is checked against it on construction. ``name_map`` maps a store tensor name to the
    model's name (or None to skip it). ``lock``: the lock the serving loop takes around its use of
    the model (a new one by default, as :attr:`lock`).
    """

    def __init__(self, store, tensors, version: int, *, lock: threading.Lock | None = None,
                 name_map: Callable[[str], str | None] | None = None, dense_above: float = 0.05,
                 verify: bool = True, threads: int = 4, fetch_concurrency: int = 32):
        self.repo = weightsync.open_repo(store)
        live = tensors.state_dict() if isinstance(tensors, torch.nn.Module) else dict(tensors)
        self.tensors: Mapping[str, torch.Tensor] = live
        self.version = version
        self.lock = lock or threading.Lock()
        self.name_map = name_map or (lambda n: n)
        self.dense_above, self.threads, self.fetch_concurrency = dense_above, threads, fetch_concurrency
        self._apply_lock = threading.Lock()  # one update at a time
        if verify:
            self.verify()

    # -- mapping ----------------------------------------------------------------------------------
    def _matched(self, manifest: Manifest) -> list[tuple[str, Segment, torch.Tensor]]:
        out = []
        for f in manifest.files:
            for s in f.segments:
                if s.role != "tensor":
                    continue
                name = self.name_map(s.name)
                t = None if name is None else self.tensors.get(name)
                if t is None:
                    continue
                if TORCH_DTYPE.get(s.dtype) != t.dtype or tuple(t.shape) != s.shape or not t.is_contiguous():
                    raise UsageError(f"{s.name}: the store has {s.dtype}{list(s.shape)}, the model {t.dtype}{list(t.shape)}"
                                     f"{'' if t.is_contiguous() else ' (not contiguous)'}; cannot patch in place")
                out.append((f.path, s, t))
        return out

    def verify(self, version: int | None = None) -> int:
        """Raise :class:`BaseMismatchError` unless every matched tensor holds ``version``'s bytes."""
        m = self.repo.manifest(self.version if version is None else version)
        matched = self._matched(m)
        if not matched:
            raise UsageError(f"no tensor of version {m.version} matches the model's tensor names")
        for path, seg, t in matched:
            if xxhash.xxh3_128_hexdigest(_host_bytes(t)) != seg.xxh3:
                raise BaseMismatchError(f"{seg.name}: the model's bytes differ from version {m.version}")
        return len(matched)

    # -- prepare: everything before the pause ------------------------------------------------------
    def prepare(self, version: int | str = "latest") -> Update:
        """Fetch, decode and verify ``version``, reduced to patches staged on the tensors' devices."""
        t0 = time.perf_counter()
        target_v = resolve_version(self.repo, version)
        up = Update(target_v, self.version)
        if target_v == self.version:
            return up
        try:
            local = self.repo.manifest(self.version)
        except VersionError:
            local = None  # collected by gc: rebuild changed tensors from the keyframe
        chain = self.repo.chain(target_v, back_to=self.version)
        try:
            return self._prepare(up, chain, local, t0)
        except BaseMismatchError:
            if local is None:
                raise
            return self._prepare(Update(target_v, self.version), self.repo.chain(target_v), None, t0)

    def _prepare(self, up: Update, chain: list[Manifest], local: Manifest | None, t0: float) -> Update:
        matched = self._matched(chain[-1])
        up.tensors = len(matched)
        live = {}
        jobs = []
        for path, seg, t in matched:
            r = plan_segment(chain, path, seg, local)
            if r.base is not None and not r.steps and r.base.xxh3 == seg.xxh3:
                continue  # unchanged
            jobs.append(TensorJob(path, r))
            live[(path, seg.name)] = t
        host: dict[tuple[str, str], np.ndarray] = {}
        lock = threading.Lock()

        def base(path: str, seg: Segment) -> np.ndarray:
            t = live[(path, seg.name)]
            data = _host_bytes(t)
            if xxhash.xxh3_128_hexdigest(data) != seg.xxh3:
                raise BaseMismatchError(f"{seg.name}: the model's bytes differ from version {self.version}")
            with lock:
                host[(path, seg.name)] = data
            return data

        with tempfile.TemporaryDirectory(prefix="weightsync-sink-") as spool:
            paths, up.fetched_bytes = fetch_for(self.repo, jobs, Path(spool), self.fetch_concurrency)
            up.seconds["fetch"] = time.perf_counter() - t0
            for job, new in build_tensors(jobs, paths, base, threads=self.threads):
                key = (job.path, job.recipe.target.name)
                with lock:
                    old = host.pop(key, None)
                up.patches.append(self._patch(job.recipe.target, live[key], old, new, up))
        up.seconds["prepare"] = time.perf_counter() - t0
        return up

    def _patch(self, seg: Segment, t: torch.Tensor, old: np.ndarray | None, new: np.ndarray, up: Update) -> Patch:
        width = itemsize(seg.dtype)
        new_e = new.view(UINT_VIEW[width])
        if old is None:
            old = _host_bytes(t)
        idx = np.flatnonzero(old.view(UINT_VIEW[width]) != new_e)
        up.changed_elements += int(idx.size)
        if idx.size > self.dense_above * new_e.size:
            return Patch(seg.name, _int_view(t), None, torch.from_numpy(new.view(_NP_INT[width])).to(t.device))
        values = torch.from_numpy(new_e[idx].view(_NP_INT[width]))
        return Patch(seg.name, _int_view(t), torch.from_numpy(idx).to(t.device), values.to(t.device))

    # -- apply: the pause --------------------------------------------------------------------------
    def apply(self, update: Update) -> float:
        """Patch the live tensors in place under :attr:`lock`; returns the seconds the lock was held."""
        with self._apply_lock:
            if update.from_version != self.version:
                raise UsageError(f"update was prepared from version {update.from_version}, the model holds {self.version}")
            devices = {p.target.device for p in update.patches if p.target.device.type == "cuda"}
            with torch.no_grad(), self.lock:
                t0 = time.perf_counter()
                for p in update.patches:
                    if p.index is None:
                        p.target.copy_(p.values)
                    else:
                        p.target.scatter_(0, p.index, p.values)
                for d in devices:
                    torch.cuda.synchronize(d)
                pause = time.perf_counter() - t0
            self.version = update.version
            update.seconds["pause"] = pause
            return pause

    def update(self, version: int | str = "latest") -> Update:
        """:meth:`prepare` then :meth:`apply`; returns the update with its timings."""
        up = self.prepare(version)
        self.apply(up)
        return up
