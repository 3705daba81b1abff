"""In-process hot swap: bring a live torch model's tensors to a version of a store (CPU or CUDA);
``prepare`` does the work without the serving lock, ``apply`` holds it for the swap alone
(docs/DESIGN.md: patch and flip modes, coverage, failures)::

    lock = threading.Lock()                      # the serving loop holds it around each forward
    sink = TorchSink(store_url, model, version=7, lock=lock)            # or mode="flip"
    update = sink.prepare("latest")               # fetch, decode, verify, stage: no lock held
    pause = sink.apply(update)                    # under the lock: only the swap"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from weightsync.errors import BaseMismatchError, UsageError, VersionError, WeightsyncError
from weightsync.format.dtypes import UINT_VIEW, itemsize
from weightsync.format.manifest import Manifest, Segment
from weightsync.store.repo import open_repo
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.plan import plan_segment
from weightsync.sync.pull import resolve_version
from weightsync.sync.rebuild import TensorJob, build_tensors, fetch_jobs
from weightsync.torch.dtypes import NP_INT as _NP_INT
from weightsync.torch.dtypes import TORCH_DTYPE
from weightsync.torch.dtypes import TORCH_INT as _INT_VIEW

MODES = ("patch", "flip")


log = logging.getLogger("weightsync.torch")


class CoverageError(UsageError):
    """A version and the model do not cover each other: ``unplaced`` store tensors have no
    destination in the model, ``unsourced`` model tensors no source in the version."""

    def __init__(self, message: str, unplaced: list[str], unsourced: list[str]):
        super().__init__(message)
        self.unplaced, self.unsourced = unplaced, unsourced


class ApplyError(WeightsyncError):
    """An ``apply`` that failed during the pause; the message says what the model holds now."""


@dataclass
class Patch:
    """One staged write into a live tensor: its positions and new bit patterns (or the whole tensor)."""

    name: str
    target: torch.Tensor  # a flat integer view of the tensor it writes (same width, same memory)
    index: torch.Tensor | None  # positions on the tensor's device, int64 (flip: int32 if < 2**31); None: dense
    values: torch.Tensor  # new bit patterns (flat integer view) at ``index``, or of the whole tensor
    gather: bool = False  # ``values`` is a whole tensor: write its elements at ``index`` (flip's replays)

    def write(self) -> None:
        """Scatter the values into the target (or copy them, for a dense patch)."""
        v = self.values.index_select(0, self.index) if self.gather and self.index is not None else self.values
        self.target.copy_(v) if self.index is None else self.target.scatter_(0, self.index, v)


@dataclass(eq=False)
class _Slot:
    """Flip mode: one distinct live tensor, every name and object that holds it, and its two buffers."""

    names: list[str]
    objects: list[torch.Tensor]  # the live objects (Parameters, buffers, the user's tensors)
    live: torch.Tensor  # a detached alias of the storage the objects hold now
    standby: torch.Tensor | None = None  # same dtype/shape/device; equal to ``live`` once caught up
    dirty: bool = False  # the standby may differ from live anywhere: copy live into it
    replay: Patch | None = None  # the last flip's patch, to replay onto the (retired) standby


@dataclass(eq=False)
class Flip:
    """Flip mode: point ``objects`` (one live tensor under all its names) at ``new`` instead of ``old``."""

    names: tuple[str, ...]
    objects: tuple[torch.Tensor, ...]
    new: torch.Tensor  # the standby buffer, holding the update's version (verified)
    old: torch.Tensor  # the buffer the objects hold now; the standby after the flip
    slot: _Slot = field(repr=False)
    replay: Patch = field(repr=False)  # brings ``old`` to the new version once it is retired


def point_to(flips: list[Flip], new: bool = True) -> None:
    """Repoint each flip's tensor objects at its ``new`` (or back at its ``old``) storage: the
    whole of a flip-mode pause. No copy, no device work."""
    for f in flips:
        buf = f.new if new else f.old
        for o in f.objects:
            o.data = buf


@dataclass(eq=False)
class Update:
    """A prepared update from ``from_version`` to ``version``: everything but the swap. ``patches``:
    per changed tensor, what ``apply`` writes (patch mode) or, in flip mode, what the next ``prepare``
    replays onto the storages that the ``flips`` retire."""

    version: int
    from_version: int
    patches: list[Patch] = field(default_factory=list)
    fetched_bytes: int = 0
    changed_elements: int = 0
    tensors: int = 0  # tensors in the version that the model holds
    seconds: dict[str, float] = field(default_factory=dict)
    mode: str = "patch"
    flips: list[Flip] = field(default_factory=list)
    excluded: tuple[str, ...] = ()  # store and model names left alone (``exclude`` patterns)
    epoch: int = 0  # patch mode: the sink's count of torn applies when it was prepared


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a 1-D uint8 array (a view for CPU tensors, a copy otherwise)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1).view(_INT_VIEW[t.element_size()])


def _sync(devices) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


class TorchSink:
    """Keeps a model's tensors at a version of a store by in-place patches or, with ``mode="flip"``,
    by swapping in double-buffered storages (see the module doc).

    ``tensors``: an ``nn.Module`` (its parameters and persistent buffers) or a mapping of names to
    tensors (flip mode: to Parameters). ``version``: the version they hold now; with ``verify=True``
    every tensor is checked against it on construction. ``name_map`` maps a store tensor name to the
    model's name (or None to leave it alone). ``exclude``: ``fnmatch`` patterns over store and model
    names to leave alone; any other tensor of the store without a destination in the model, or of the
    model without a source in the store, is a :class:`CoverageError` (see the module doc). ``lock``:
    the lock the serving loop takes around its use of the model (a new one by default, as
    :attr:`lock`). ``mode``: ``"patch"`` or ``"flip"`` (clones every matched tensor on construction:
    twice the weights' memory, plus :attr:`replay_bytes`).
    """

    def __init__(
        self,
        store,
        tensors,
        version: int,
        *,
        lock: threading.Lock | None = None,
        name_map: Callable[[str], str | None] | None = None,
        exclude: Iterable[str] = (),
        dense_above: float = 0.05,
        verify: bool = True,
        threads: int = 4,
        fetch_concurrency: int = 32,
        mode: str = "patch",
    ):
        if mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.repo = open_repo(store)
        if isinstance(tensors, torch.nn.Module):
            live = tensors.state_dict(keep_vars=True) if mode == "flip" else tensors.state_dict()
        else:
            live = dict(tensors)
            plain = [n for n, t in live.items() if mode == "flip" and not isinstance(t, torch.nn.Parameter)]
            if plain:
                raise UsageError(
                    f"flip mode: {plain[0]} is not a Parameter, and repointing a plain tensor (a detached alias, "
                    "as in model.state_dict()) misses the module: pass the module, its Parameters, or mode='patch'"
                )
        self.tensors: Mapping[str, torch.Tensor] = live
        self.version = version
        self.lock = lock or threading.Lock()
        self.name_map = name_map or (lambda n: n)
        if isinstance(exclude, str):
            raise UsageError(f"exclude takes a list of patterns, not the string {exclude!r}")
        self.exclude = tuple(exclude)
        self._excluded_re = re.compile("|".join(fnmatch.translate(p) for p in self.exclude)) if self.exclude else None
        self.excluded: tuple[str, ...] = ()  # names left alone in the latest version checked
        self._epoch = 0  # patch mode: applies that failed midway (and tore the model) so far
        self.dense_above, self.threads, self.fetch_concurrency = dense_above, threads, fetch_concurrency
        self._apply_lock = threading.Lock()  # one update at a time (flip mode: also held by prepare)
        self._slots: dict[str, _Slot] = {}  # flip mode: model name -> its slot
        self._staged: Update | None = None  # flip mode: the update whose version the standby holds
        self._torn = False  # patch mode: the model holds neither version since a failed apply
        if mode == "flip":
            self._slots = _group(live)
        try:
            matched = self._matched(self.repo.manifest(version))
        except VersionError:
            if verify:
                raise
            matched = []  # collected by gc: checked on the first prepare (flip: standbys cloned then)
        if verify:
            self._verify(matched, version)
        if mode == "flip":
            _sync({s.live.device for s in self._ensure_standbys(self._names(matched))})

    @property
    def standby_bytes(self) -> int:
        """Memory held by the standby buffers (flip mode; 0 in patch mode): the size of the model's
        matched tensors, counted once per distinct tensor."""
        slots = {s: None for s in self._slots.values() if s.standby is not None}
        return sum(s.standby.numel() * s.standby.element_size() for s in slots)

    @property
    def replay_bytes(self) -> int:
        """Flip mode's memory besides the standbys, from an ``apply`` to the next ``prepare``: the last
        update's changed positions (4 bytes each; 8 from 2**31 elements), replayed onto the standby."""
        slots = {s: None for s in self._slots.values() if s.replay is not None and s.replay.index is not None}
        return sum(s.replay.index.numel() * s.replay.index.element_size() for s in slots)

    # -- mapping ----------------------------------------------------------------------------------
    def _excludes(self, name: str) -> bool:
        return self._excluded_re is not None and self._excluded_re.match(name) is not None

    def _matched(self, manifest: Manifest) -> list[tuple[str, Segment, torch.Tensor]]:
        """Each store tensor of ``manifest`` with its model tensor; raises unless both sides are
        covered (:class:`CoverageError`) and dtypes and shapes agree."""
        out, unplaced, excluded, placed = [], [], set(), set()
        for f in manifest.files:
            for s in f.segments:
                name = self.name_map(s.name) if s.role == "tensor" else None
                if name is None:
                    continue
                if self._excludes(s.name) or self._excludes(name):
                    excluded.add(s.name)
                    if name in self.tensors:
                        excluded.add(name)  # its destination is left alone too
                        placed.add(name)
                    continue
                t = self.tensors.get(name)
                if t is None:
                    unplaced.append(s.name)
                    continue
                if TORCH_DTYPE.get(s.dtype) != t.dtype or tuple(t.shape) != s.shape or not t.is_contiguous():
                    raise UsageError(
                        f"{s.name}: the store has {s.dtype}{list(s.shape)}, the model {t.dtype}{list(t.shape)}"
                        f"{'' if t.is_contiguous() else ' (not contiguous)'}; cannot patch in place"
                    )
                out.append((f.path, s, t))
                placed.add(name)
        covered = {_view_key(t) for _, _, t in out}  # a tensor tied to one the store names is covered
        unsourced = []
        for name, t in self.tensors.items():
            if name in placed or _view_key(t) in covered:
                continue
            if self._excludes(name):
                excluded.add(name)
            else:
                unsourced.append(name)
        if unplaced or unsourced:
            none = f"no tensor of version {manifest.version} matches the model's tensor names: " if not out else ""
            raise CoverageError(none + _coverage_message(manifest.version, unplaced, unsourced), unplaced, unsourced)
        if not out:
            raise UsageError(
                f"no tensor of version {manifest.version} matches the model's tensor names"
                f"{f' ({len(excluded)} excluded)' if excluded else ''}"
            )
        if tuple(sorted(excluded)) != self.excluded:
            self.excluded = tuple(sorted(excluded))
            if excluded:
                log.info(
                    "version %d: leaving %d tensors alone (exclude=%s), e.g. %s",
                    manifest.version,
                    len(excluded),
                    list(self.exclude),
                    _some(self.excluded),
                )
        return out

    def _names(self, matched) -> list[str]:
        return [self.name_map(s.name) for _, s, _ in matched]

    def verify(self, version: int | None = None) -> int:
        """Raise :class:`BaseMismatchError` unless every matched tensor holds ``version``'s bytes
        (:class:`CoverageError` unless the version's names and the model's cover each other)."""
        m = self.repo.manifest(self.version if version is None else version)
        return self._verify(self._matched(m), m.version)

    @staticmethod
    def _verify(matched, version: int) -> int:
        for path, seg, t in matched:
            if xxhash.xxh3_128_hexdigest(_host_bytes(t)) != seg.xxh3:
                raise BaseMismatchError(f"{seg.name}: the model's bytes differ from version {version}")
        return len(matched)

    # -- prepare: everything before the pause ------------------------------------------------------
    def prepare(self, version: int | str = "latest", *, observer: Observer | None = None) -> Update:
        """Fetch, decode and verify ``version``, staged on the tensors' devices: as patches (patch
        mode) or written into the standby buffers (flip mode). ``observer``
        (:class:`~weightsync.sync.observer.Observer`) sees the ``"stage"`` phase (the bytes of the
        changed tensors) and the downloads, and may cancel the prepare from its ``check``."""
        op = Operation(observer)
        up = self._prepare_version(version, op)
        op.done(up.seconds)
        return up

    def _prepare_version(self, version: int | str, op: Operation) -> Update:
        flip = self.mode == "flip"
        with self._apply_lock if flip else contextlib.nullcontext():  # flip: one standby, one writer
            target_v = resolve_version(self.repo, version)
            torn, epoch = self._torn, self._epoch

            def fresh() -> Update:
                return Update(target_v, self.version, mode=self.mode, epoch=epoch)

            up = fresh()
            if target_v == self.version and not torn:
                return up
            if flip:
                self._staged = None  # whatever the standby held is no longer what an update names
            try:
                local = None if torn else self.repo.manifest(self.version)  # torn: no tensor is trusted
            except VersionError:
                local = None  # collected by gc: rebuild changed tensors from the keyframe
            chain = self.repo.chain(target_v, back_to=None if torn else self.version)
            try:
                up = self._prepare(up, chain, local, op)
            except BaseMismatchError:
                if local is None:
                    raise
                up = None
                if flip:  # a standby that differs from its live tensor is copied from it: try once more
                    with contextlib.suppress(BaseMismatchError):  # (unless the live tensor itself differs)
                        up = self._prepare(fresh(), chain, local, op)
                if up is None:
                    up = self._prepare(fresh(), self.repo.chain(target_v), None, op)
            if flip:
                self._staged = up
            return up

    def _prepare(self, up: Update, chain: list[Manifest], local: Manifest | None, op: Operation) -> Update:
        matched = self._matched(chain[-1])
        up.tensors, up.excluded = len(matched), self.excluded
        # tied weights: one entry per distinct tensor (flip: per slot; patch: per memory view)
        slot_of = (
            (lambda seg, t: self._slots[self.name_map(seg.name)])
            if self.mode == "flip"
            else (lambda seg, t: _view_key(t))
        )
        matched = _distinct(matched, chain[-1].version, slot_of)
        if self.mode == "flip":
            self._ensure_standbys(self._names(matched))
            self._catch_up()  # every standby equal to its live tensor again
        live = {}
        jobs = []
        for path, seg, t in matched:
            r = plan_segment(chain, path, seg, local)
            if r.base is not None and not r.steps and r.base.xxh3 == seg.xxh3:
                continue  # unchanged
            jobs.append(TensorJob(path, r))
            live[(path, seg.name)] = t if self.mode == "patch" else self._slots[self.name_map(seg.name)]
        host: dict[tuple[str, str], np.ndarray] = {}
        lock = threading.Lock()

        def base(path: str, seg: Segment) -> np.ndarray:
            x = live[(path, seg.name)]
            data = _host_bytes(x if self.mode == "patch" else x.standby)
            if xxhash.xxh3_128_hexdigest(data) != seg.xxh3:
                raise BaseMismatchError(f"{seg.name}: the model's bytes differ from version {self.version}")
            with lock:
                host[(path, seg.name)] = data
            return data

        try:
            with tempfile.TemporaryDirectory(prefix="weightsync-sink-") as spool:
                paths, up.fetched_bytes = fetch_jobs(self.repo, jobs, Path(spool), self.fetch_concurrency, op)
                up.seconds["fetch"] = op.elapsed()
                op.phase("stage", sum(j.recipe.segment.nbytes for j in jobs))
                for job, new in build_tensors(jobs, paths, base, url=self.repo.url, threads=self.threads, op=op):
                    key = (job.path, job.recipe.segment.name)
                    with lock:
                        old = host.pop(key, None)
                    if self.mode == "patch":
                        up.patches.append(self._patch(job.recipe.segment, live[key], old, new, up))
                    else:
                        up.flips.append(self._stage(job.recipe.segment, live[key], old, new, up))
                        up.patches.append(up.flips[-1].replay)
                    op.progress(job.recipe.segment.nbytes)
            _sync({f.new.device for f in up.flips})
        except BaseException:
            for slot in (x for x in live.values() if isinstance(x, _Slot)):  # flip: each standby it touched
                slot.dirty = True  # is suspect until copied from live again
            raise
        up.seconds["prepare"] = op.elapsed()
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

    # -- flip mode: the standby buffers ------------------------------------------------------------
    def _ensure_standbys(self, names: list[str]) -> list[_Slot]:
        """The slots of ``names``, each with its standby, once checked that repointing reaches them."""
        slots = list({self._slots[n]: None for n in names})
        for slot in slots:
            self._ensure_standby(slot)
        _refuse_overlaps(self._slots.values(), set(slots))
        return slots

    def _ensure_standby(self, slot: _Slot) -> None:
        """Give ``slot`` a standby buffer equal to its live tensor; notice a storage repointed behind
        the sink's back (the standby then starts again from the live bytes)."""
        cur = slot.objects[0].detach()
        if any(o.data_ptr() != cur.data_ptr() for o in slot.objects[1:]):
            raise UsageError(f"{', '.join(slot.names)}: the tensor objects no longer share one storage")
        if cur.storage_offset() or cur.untyped_storage().nbytes() != cur.numel() * cur.element_size():
            raise UsageError(
                f"{', '.join(slot.names)}: a view into a larger buffer; flip mode would repoint the view, "
                "not the buffer the engine reads (use mode='patch')"
            )
        if cur.data_ptr() != slot.live.data_ptr() or cur.device != slot.live.device:
            slot.live, slot.replay, slot.dirty = cur, None, True
        sb = slot.standby
        if sb is None or sb.device != cur.device or sb.dtype != cur.dtype or sb.shape != cur.shape:
            slot.standby, slot.replay, slot.dirty = cur.clone(memory_format=torch.contiguous_format), None, False

    def _catch_up(self) -> None:
        """Bring every standby buffer to the version its live tensor holds (bit-identical)."""
        with torch.no_grad():
            for slot in {s: None for s in self._slots.values()}:
                if slot.standby is None:
                    continue
                if slot.dirty:
                    _int_view(slot.standby).copy_(_int_view(slot.live))
                elif slot.replay is not None:
                    slot.replay.write()
                slot.dirty, slot.replay = False, None
        _sync({s.live.device for s in self._slots.values()})  # decoding threads read the standbys

    def _stage(self, seg: Segment, slot: _Slot, old: np.ndarray | None, new: np.ndarray, up: Update) -> Flip:
        """Write ``new`` (verified bytes of ``seg``) into ``slot``'s standby; the flip that swaps it in."""
        slot.dirty = True  # until the flip (an update never applied leaves the standby ahead of live)
        p = self._patch(seg, slot.standby, old, new, up)  # old: the standby's bytes now
        with torch.no_grad():
            p.write()
        idx = p.index.int() if p.index is not None and slot.live.numel() < 2**31 else p.index
        replay = Patch(seg.name, _int_view(slot.live), idx, _int_view(slot.standby), gather=True)  # kept: 4 B/position
        return Flip(tuple(slot.names), tuple(slot.objects), slot.standby, slot.live, slot, replay)

    # -- apply: the pause --------------------------------------------------------------------------
    def apply(self, update: Update) -> float:
        """Patch the live tensors in place (patch mode) or swap in their standby storages (flip
        mode) under :attr:`lock`; returns the seconds the lock was held."""
        with self._apply_lock:
            if update.mode != self.mode:
                raise UsageError(f"update was prepared in {update.mode} mode, the sink is in {self.mode} mode")
            if update.from_version != self.version:
                raise UsageError(
                    f"update was prepared from version {update.from_version}, the model holds {self.version}"
                )
            if update.epoch != self._epoch:
                raise UsageError(
                    f"update to version {update.version} was prepared before an apply failed and left the "
                    "model torn; prepare again"
                )
            if update.version == update.from_version and not self._torn:  # nothing to swap (flip: leave the staged one)
                update.seconds["pause"] = 0.0
                return 0.0
            if self.mode == "flip":
                return self._apply_flip(update)
            devices = {p.target.device for p in update.patches}
            written = 0
            with torch.no_grad(), self.lock:
                t0 = time.perf_counter()
                try:
                    for p in update.patches:
                        p.write()
                        written += 1
                    _sync(devices)
                except BaseException as exc:
                    self._torn, self._epoch = True, self._epoch + 1
                    if not isinstance(exc, Exception):
                        raise
                    raise ApplyError(
                        f"apply to version {update.version} failed with {written} of {len(update.patches)} "
                        "tensors written: the model is torn until the next update, which rebuilds it "
                        f"from the keyframe ({_one_line(exc)})"
                    ) from exc
                pause = time.perf_counter() - t0
            self.version, self._torn = update.version, False
            update.seconds["pause"] = pause
            return pause

    def _apply_flip(self, update: Update) -> float:
        if update is not self._staged:
            raise UsageError(
                f"update to version {update.version} is no longer staged in the standby "
                "(another prepare ran since, or it failed); prepare again"
            )
        for f in update.flips:
            if any(o.data_ptr() != f.old.data_ptr() for o in f.objects):
                raise UsageError(f"{', '.join(f.names)}: the tensor's storage was repointed behind the sink's back")
        with self.lock:
            t0 = time.perf_counter()
            try:
                point_to(update.flips)
            except BaseException as exc:
                point_to(update.flips, new=False)  # all or nothing: every object back on its live storage
                if not isinstance(exc, Exception):
                    raise
                raise ApplyError(
                    f"apply to version {update.version} failed: the model still holds version "
                    f"{self.version} and the update stays staged ({_one_line(exc)})"
                ) from exc
            pause = time.perf_counter() - t0
        for f in update.flips:
            f.slot.live, f.slot.standby, f.slot.dirty, f.slot.replay = f.new, f.old, False, f.replay
        self._staged = None
        self.version = update.version
        update.seconds["pause"] = pause
        return pause

    def update(self, version: int | str = "latest", *, observer: Observer | None = None) -> Update:
        """:meth:`prepare` then :meth:`apply`; returns the update with its timings."""
        up = self.prepare(version, observer=observer)
        self.apply(up)
        return up


def _some(names, n: int = 3) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _coverage_message(version: int, unplaced: list[str], unsourced: list[str]) -> str:
    parts = []
    if unplaced:
        one = len(unplaced) == 1
        parts.append(
            f"{len(unplaced)} store tensor{'' if one else 's'} of version {version} "
            f"{'has' if one else 'have'} no destination in the model ({_some(unplaced)})"
        )
    if unsourced:
        one = len(unsourced) == 1
        parts.append(
            f"{len(unsourced)} model tensor{'' if one else 's'} {'has' if one else 'have'} no source in "
            f"{'it' if unplaced else f'version {version}'} ({_some(unsourced)})"
        )
    return (
        "; ".join(parts) + ": they would stay stale; map names with name_map, or leave tensors alone with "
        "exclude=[fnmatch patterns]"
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _view_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that view the same memory the same way (tied weights)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _distinct(matched, version: int, key) -> list:
    """One (path, segment, tensor) per distinct ``key(segment, tensor)``; every name of a tied tensor
    must have the same bytes in ``version`` (they are verified through the first one's checksum)."""
    first: dict = {}
    out = []
    for path, seg, t in matched:
        k = key(seg, t)
        seen = first.get(k)
        if seen is None:
            first[k] = seg
            out.append((path, seg, t))
        elif seen.xxh3 != seg.xxh3:
            raise UsageError(f"{seen.name} and {seg.name} are one tensor in the model but differ in version {version}")
    return out


def _group(tensors: Mapping[str, torch.Tensor]) -> dict[str, _Slot]:
    """Flip mode: group names by the memory they view (tied weights: one slot, all their objects)."""
    by_view: dict[tuple, _Slot] = {}
    out: dict[str, _Slot] = {}
    for name, t in tensors.items():
        slot = by_view.get(_view_key(t)) or by_view.setdefault(_view_key(t), _Slot([], [], t.detach()))
        slot.names.append(name)
        if not any(o is t for o in slot.objects):
            slot.objects.append(t)
        out[name] = slot
    return out


def _refuse_overlaps(slots, managed: set) -> None:
    """Flip mode: refuse a managed tensor sharing memory with another tensor given (which would keep
    reading the retired storage). Sorted by start, each overlapping span meets one it overlaps."""
    spans = []
    for slot in {s: None for s in slots}:
        t = slot.objects[0]
        if t.numel() and t.device.type != "meta":
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            spans.append(
                ((t.device.type, t.device.index), t.data_ptr(), t.data_ptr() + extent * t.element_size(), slot)
            )
    spans.sort(key=lambda x: (str(x[0]), x[1]))
    reach: dict = {}  # device -> (furthest end so far, its slot)
    for dev, begin, end, slot in spans:
        prev = reach.get(dev)
        if prev is not None and begin < prev[0] and (slot in managed or prev[1] in managed):
            raise UsageError(
                f"{prev[1].names[0]} and {slot.names[0]} share memory without being the same tensor; "
                "flip mode cannot repoint one alone (use mode='patch')"
            )
        if prev is None or end > prev[0]:
            reach[dev] = (end, slot)
