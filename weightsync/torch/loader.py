"""Feeding an engine's own loader, for layouts no rule set of :mod:`weightsync.torch.engines`
covers: the whole checkpoint tensors that changed between the version the engine holds and a newer
one, rebuilt and verified from the store, handed to the engine's loading entry point, which fuses,
shards and post-processes them as it does at start-up::

    loader = EngineLoader(store_url, vllm_model.load_weights, version=7)
    report = loader.update("latest")           # only the tensors whose bytes changed since 7

    loader = EngineLoader(store_url, sglang_update_weights_from_tensor(engine), version=7)

What changed is decided per tensor name from the two manifests (the segments' XXH3-128): no tensor
is read from the engine. What the adapter checks: every tensor it hands over holds exactly the new
version's bytes (its checksum). What it cannot check: what the engine does with them. The values
then live behind the engine's private mapping (fused, sharded, cast, repacked, quantized), which
this adapter neither sees nor verifies; a tensor the engine's loader silently skips (SGLang skips
names it has no parameter for, vLLM those of other pipeline stages) stays stale without an error
here; and vLLM's ``model.load_weights`` does not re-run ``process_weights_after_loading`` (use the
worker's ``reload_weights(weights_iterator=...)``, which does, where the engine has it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from weightsync.errors import BaseMismatchError, UsageError, VersionError
from weightsync.format.manifest import Manifest, Segment
from weightsync.local.base import LocalVersion
from weightsync.local.scratch import ScratchDir
from weightsync.local.state import read_state
from weightsync.store.repo import open_repo
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.plan import plan_segment
from weightsync.sync.pull import resolve_version
from weightsync.sync.rebuild import TensorJob, build_tensors, fetch_jobs
from weightsync.torch.dtypes import TORCH_DTYPE
from weightsync.torch.layout import excluder, store_tensors

log = logging.getLogger("weightsync.torch")

NamedTensors = list[tuple[str, torch.Tensor]]


def changed(old: Manifest | None, new: Manifest) -> tuple[list[tuple[str, Segment]], list[str]]:
    """``(path, segment)`` of every tensor of ``new`` whose bytes, dtype or shape differ from the
    tensor of the same name in ``old`` (all of them without ``old``), and the tensor names ``old``
    has that ``new`` lacks. A tensor may move between files: names are compared, not paths. A name two
    files hold is one tensor where the copies are the same bytes (:func:`~weightsync.torch.layout.store_tensors`)."""
    before: dict[str, Segment] = {}
    for f in old.files if old is not None else ():
        for s in f.segments:
            if s.role == "tensor":
                before[s.name] = s
    out = []
    for path, s in store_tensors(new).values():
        b = before.pop(s.name, None)
        if b is None or (b.xxh3, b.dtype, b.shape) != (s.xxh3, s.dtype, s.shape):
            out.append((path, s))
    return out, sorted(before)


@dataclass
class LoadReport:
    """One :meth:`EngineLoader.update`: the versions, the tensors handed over (names), their
    bytes, the bytes fetched from the store, the loader calls, and seconds per phase."""

    version: int
    from_version: int | None
    tensors: list[str] = field(default_factory=list)
    bytes: int = 0
    fetched_bytes: int = 0
    calls: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLoad:
    """An engine's loading entry point as the adapter calls it: ``load(named_tensors)`` per batch
    (whole checkpoint tensors, checkpoint names), then ``finish()`` once per update."""

    load: Callable[[NamedTensors], object]
    finish: Callable[[], object] | None = None


def vllm_load_weights(model: torch.nn.Module) -> EngineLoad:
    """vLLM, in the worker process that holds ``model`` (e.g. a ``worker_extension_cls`` method
    called through ``LLM.collective_rpc``): ``model.load_weights(iter[(name, tensor)])``."""
    return EngineLoad(lambda batch: model.load_weights(iter(batch)))


def sglang_update_weights_from_tensor(engine, load_format: str | None = None) -> EngineLoad:
    """SGLang's ``Engine.update_weights_from_tensor(named_tensors, load_format=None,
    flush_cache=True)``: each batch without flushing the cache, then ``engine.flush_cache()``."""
    return EngineLoad(
        lambda batch: engine.update_weights_from_tensor(
            named_tensors=batch, load_format=load_format, flush_cache=False
        ),
        engine.flush_cache,
    )


class EngineLoader:
    """Keeps an engine at the latest version of a store through the engine's own loader.

    ``load``: an :class:`EngineLoad`, or a callable taking a list of ``(name, tensor)``.
    ``version``: the version the engine holds now (None: unknown, every tensor is loaded on the
    first update). ``base_dir``: a folder holding some version of the store (a pull target, a
    subscriber's ``current``), read as the delta base; without it changed tensors are rebuilt from
    their keyframe. ``exclude``: fnmatch patterns of tensor names never handed over (e.g. layers the
    engine loads elsewhere). ``device``: where the tensors are built (default CPU). At most about
    ``batch_bytes`` of tensors are handed over per call (bigger tensors alone)."""

    def __init__(
        self,
        store,
        load: EngineLoad | Callable[[NamedTensors], object],
        version: int | None,
        *,
        base_dir: str | Path | None = None,
        exclude: Iterable[str] = (),
        device: str | torch.device | None = None,
        batch_bytes: int = 1 << 30,
        threads: int = 4,
        fetch_concurrency: int = 32,
    ):
        if isinstance(exclude, str):
            raise UsageError(f"exclude takes a list of patterns, not the string {exclude!r}")
        self.repo = open_repo(store)
        self.engine = load if isinstance(load, EngineLoad) else EngineLoad(load)
        self.version = version
        self.base_dir = None if base_dir is None else Path(base_dir)
        self.excluded = excluder(tuple(exclude))
        self.device = device
        self.batch_bytes, self.threads, self.fetch_concurrency = batch_bytes, threads, fetch_concurrency
        self._torn = False  # a failed update left the engine holding neither version

    def update(self, version: int | str = "latest", *, observer: Observer | None = None) -> LoadReport:
        """Hand the engine every tensor of ``version`` that differs from the version it holds;
        afterwards it holds ``version``. Refuses a version that lacks a tensor the held one has (a
        loader cannot remove a parameter). If the engine's loader raises, the engine is torn: the
        next update hands over every tensor."""
        op = Operation(observer)
        target = resolve_version(self.repo, version)
        report = LoadReport(target, self.version)
        if target == self.version and not self._torn:
            return report
        old = None
        if self.version is not None and not self._torn:
            try:
                old = self.repo.manifest(self.version)
            except VersionError:
                log.info("version %d was collected: loading every tensor of version %d", self.version, target)
        new = self.repo.manifest(target)
        todo, removed = changed(old, new)
        removed = [n for n in removed if not self.excluded(n)]
        if removed:
            raise UsageError(
                f"version {target} lacks {len(removed)} tensor(s) of version {self.version} "
                f"({', '.join(removed[:3])}{', ...' if len(removed) > 3 else ''}): an engine's loader cannot remove "
                "a parameter; exclude them or restart the engine"
            )
        todo = [(p, s) for p, s in todo if not self.excluded(s.name)]
        base = self._base()
        try:
            self._load(todo, target, base, report, op)
        except BaseMismatchError:
            if base is None:
                raise
            log.warning(
                "%s no longer holds version %d: rebuilding from the keyframe", self.base_dir, base.manifest.version
            )
            report = LoadReport(target, self.version)
            self._load(todo, target, None, report, op)
        finally:
            if base is not None:
                base.close()
        self.version, self._torn = target, False
        report.seconds["total"] = op.elapsed()
        op.done(report.seconds)
        return report

    def _base(self) -> LocalVersion | None:
        if self.base_dir is None:
            return None
        state = read_state(self.base_dir)
        if state is None:
            raise UsageError(f"{self.base_dir} holds no weightsync version to use as the delta base")
        try:
            return LocalVersion(self.base_dir, self.repo.manifest(state.version))
        except VersionError:
            return None

    def _load(self, todo, target: int, base: LocalVersion | None, report: LoadReport, op: Operation) -> None:
        local = None if base is None else base.manifest  # off the target's chain, only its keyframe serves
        chain = self.repo.chain(target, back_to=None if local is None else local.version)
        ahead = [] if local is None else self.repo.descent(target, local.version)  # a rollback: deltas undone
        jobs = [TensorJob(path, plan_segment(chain, path, seg, local, ahead=ahead)) for path, seg in todo]
        with ScratchDir("weightsync-loader-", "weightsync loader (its spool)") as spool:
            paths, report.fetched_bytes = fetch_jobs(self.repo, jobs, Path(spool), self.fetch_concurrency, op)
            report.seconds["fetch"] = op.elapsed()
            op.phase("load", sum(s.nbytes for _, s in todo))
            batch: NamedTensors = []
            size = 0
            t0 = time.perf_counter()
            try:
                for job, data in build_tensors(jobs, paths, base, url=self.repo.url, threads=self.threads, op=op):
                    seg = job.recipe.segment
                    batch.append((seg.name, self._tensor(data, seg)))
                    size += seg.nbytes
                    report.tensors.append(seg.name)
                    report.bytes += seg.nbytes
                    op.progress(seg.nbytes)
                    if size >= self.batch_bytes:
                        self._call(batch, report)
                        batch, size = [], 0
                if batch:
                    self._call(batch, report)
                if report.calls and self.engine.finish is not None:
                    self._torn = True
                    self.engine.finish()
            finally:
                report.seconds["load"] = time.perf_counter() - t0

    def _call(self, batch: NamedTensors, report: LoadReport) -> None:
        self._torn = True  # until the whole update went in
        self.engine.load(batch)
        report.calls += 1

    def _tensor(self, data: np.ndarray, seg: Segment) -> torch.Tensor:
        dtype = TORCH_DTYPE.get(seg.dtype)
        if dtype is None:
            raise UsageError(f"{seg.name}: dtype {seg.dtype} has no torch dtype")
        t = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(dtype).reshape(seg.shape)
        return t if self.device is None else t.to(self.device)
