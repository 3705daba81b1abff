"""In-process hot swap: bring a live torch model's tensors to a version of a store (CPU or CUDA),
through the engine's layout (:mod:`weightsync.torch.layout`: fused, stacked, sharded, cast);
``prepare`` does the work without the serving lock, ``apply`` holds it for the swap alone
(docs/DESIGN.md: layouts, patch and flip modes, coverage, failures)::

    lock = threading.Lock()                      # the serving loop holds it around each forward
    sink = TorchSink(store_url, model, version=7, lock=lock, layout=layout(model))   # or mode="flip"
    update = sink.prepare("latest")               # fetch, decode, verify, stage: no lock held
    pause = sink.apply(update)                    # under the lock: only the swap
    sink.after_apply(update)                      # off the lock: checks what a payload patch wrote"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from weightsync.codec.kernels import changed_positions
from weightsync.codec.payload import payload_changes
from weightsync.errors import BaseMismatchError, UsageError, VersionError, WeightsyncError
from weightsync.format.dtypes import UINT_VIEW, itemsize
from weightsync.format.manifest import Manifest, Segment
from weightsync.local.base import LocalVersion
from weightsync.local.scratch import ScratchDir
from weightsync.store.repo import open_repo
from weightsync.sync.lazy import LazyReads, plan_reads
from weightsync.sync.observer import Observer, Operation
from weightsync.sync.pipeline import TASK_BYTES, ordered_map
from weightsync.sync.plan import plan_segment
from weightsync.sync.pull import resolve_version
from weightsync.sync.rebuild import Payloads, TensorJob, build_tensors, fetch_jobs
from weightsync.torch.dtypes import NP_INT as _NP_INT
from weightsync.torch.dtypes import TORCH_DTYPE
from weightsync.torch.dtypes import TORCH_INT as _INT_VIEW
from weightsync.torch.layout import (
    Layout,
    Placement,
    bf16_bits,
    box_slices,
    check_placement,
    contiguous,
    excluder,
    identity,
    lossless,
    store_tensors,
    widening,
)

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
    """One staged write into a live tensor: positions and new bit patterns, a dense region, or the
    whole tensor."""

    name: str
    target: torch.Tensor  # a flat integer view of the tensor it writes (same width, same memory)
    index: torch.Tensor | None  # flat positions on the tensor's device (flip's replays: int32 if < 2**31)
    values: torch.Tensor  # new bit patterns at ``index``; or of the region ``view`` (or the whole tensor)
    gather: bool = False  # ``values`` is a whole tensor: read it at ``index`` / ``view`` (flip's replays)
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None  # dense: (shape, strides, offset) written
    count: int = 1  # store tensors' writes it makes (a scatter of several, coalesced)

    def write(self) -> None:
        """Scatter the values into the target (or copy the dense region, or the whole tensor)."""
        if self.index is not None:
            v = self.values.index_select(0, self.index) if self.gather else self.values
            self.target.scatter_(0, self.index, v)
        elif self.view is None:
            self.target.copy_(self.values)
        else:
            shape, stride, off = self.view
            dst = self.target.as_strided(shape, stride, self.target.storage_offset() + off)
            src = (
                self.values.as_strided(shape, stride, self.values.storage_offset() + off)
                if self.gather
                else self.values.view(shape)
            )
            dst.copy_(src)

    @property
    def elements(self) -> int:
        """Elements written."""
        if self.index is not None:
            return self.index.numel()
        return self.target.numel() if self.view is None else math.prod(self.view[0])

    @property
    def names(self) -> list[str]:
        return [self.name]

    @property
    def writes(self) -> int:
        """Store tensors' writes this makes."""
        return self.count

    @property
    def staged_bytes(self) -> int:
        """Memory this holds for the pause: values and positions (a replay's values are the standby)."""
        index = 0 if self.index is None else self.index.numel() * self.index.element_size()
        return index + (0 if self.gather else self.values.numel() * self.values.element_size())

    def copy_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense write (no ``index``, not ``gather``) as the destination view and its source."""
        if self.view is None:
            return self.target, self.values
        shape, stride, off = self.view
        return self.target.as_strided(shape, stride, self.target.storage_offset() + off), self.values.view(shape)


@dataclass(eq=False)
class _Copies:
    """Patch mode: the dense writes of an update that share a device and a width, made by one
    ``torch._foreach_copy_`` in the pause. Each is its own kernel otherwise: a fused expert stack
    of 16 experts is 48 region copies, and on a GPU their launches, not their bytes, took the
    pause (benchmarks/README.md, "Swap pause")."""

    names: list[str]
    dsts: list[torch.Tensor]  # views of the live tensors (checked unmoved by ``apply`` first)
    srcs: list[torch.Tensor]
    index = None  # as a dense :class:`Patch`: no positions, its own values
    gather = False

    def write(self) -> None:
        foreach = getattr(torch, "_foreach_copy_", None)  # (a torch without it: one copy_ each)
        if foreach is not None:
            foreach(self.dsts, self.srcs)
        else:
            for d, s in zip(self.dsts, self.srcs):
                d.copy_(s)

    @property
    def name(self) -> str:
        return _some(self.names)

    @property
    def target(self) -> torch.Tensor:
        return self.dsts[0]

    @property
    def elements(self) -> int:
        return sum(d.numel() for d in self.dsts)

    @property
    def writes(self) -> int:
        return len(self.dsts)

    @property
    def staged_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.srcs)


@dataclass(eq=False)
class _Slot:
    """One distinct live tensor, every name and object that holds it, and (flip mode) its two buffers."""

    names: list[str]
    objects: list[torch.Tensor]  # the live objects (Parameters, buffers, the user's tensors)
    live: torch.Tensor  # a detached alias of the storage the objects hold now
    standby: torch.Tensor | None = None  # flip: same dtype/shape/device; equal to ``live`` once caught up
    dirty: bool = False  # flip: the standby may differ from live anywhere: copy live into it
    replay: list[Patch] | None = None  # flip: the last flip's patches, to replay onto the (retired) standby


@dataclass(eq=False)
class _Place:
    """A placement resolved against the model: the slot it writes and the region's geometry."""

    slot: _Slot
    box: tuple[slice, ...]  # of the store tensor
    shape: tuple[int, ...]  # the region's extent
    stride: tuple[int, ...]  # live strides
    offset: int  # element offset into the live tensor
    whole: bool  # the whole store tensor is the whole live tensor, same dtype, same element order
    flat: bool  # the whole store tensor, its elements in order from ``offset`` on (one expert of a stack)

    @property
    def view(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        return self.shape, self.stride, self.offset


@dataclass(eq=False)
class _Binding:
    """One store tensor of a version and where it lives in the model (``places`` empty: a region
    another store tensor already writes, tied weights)."""

    path: str
    seg: Segment
    places: list[_Place]
    mirrored: bool  # the live memory does not determine its bytes (partly placed, or cast lossily)


@dataclass(eq=False)
class _Staged:
    """One store tensor's share of an update, as the decoding thread left it."""

    binding: _Binding
    changed: int  # elements of the store tensor that changed
    patches: list[tuple[_Place, Patch]] = field(default_factory=list)
    mirror: np.ndarray | None = None  # the new bytes, when the sink mirrors the tensor


@dataclass(eq=False)
class Flip:
    """Flip mode: point ``objects`` (one live tensor under all its names) at ``new`` instead of ``old``."""

    names: tuple[str, ...]
    objects: tuple[torch.Tensor, ...]
    new: torch.Tensor  # the standby buffer, holding the update's version (verified)
    old: torch.Tensor  # the buffer the objects hold now; the standby after the flip
    slot: _Slot = field(repr=False)
    replay: list[Patch] = field(repr=False, default_factory=list)  # bring ``old`` to the new version once retired


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
    per changed region of a live tensor, what ``apply`` writes (patch mode) or, in flip mode, what
    the next ``prepare`` replays onto the storages that the ``flips`` retire."""

    version: int
    from_version: int
    patches: list[Patch | _Copies] = field(default_factory=list)
    fetched_bytes: int = 0
    changed_elements: int = 0  # of the store's tensors
    tensors: int = 0  # tensors in the version that the model holds
    seconds: dict[str, float] = field(default_factory=dict)
    mode: str = "patch"
    flips: list[Flip] = field(default_factory=list)
    excluded: tuple[str, ...] = ()  # store and model names left alone (``exclude`` patterns)
    epoch: int = 0  # patch mode: the sink's count of torn applies when it was prepared
    storages: int = 0  # patch mode: the sink's count of storage changes when it was prepared
    mirror: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # new bytes of mirrored tensors
    manifest: Manifest | None = field(default=None, repr=False)
    checked: bool = True  # every staged tensor's bytes were checked against its checksum (else: verify after apply)


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
    every tensor is checked against it on construction. ``layout``
    (:class:`~weightsync.torch.layout.Layout`) says where each store tensor lives in the model: by
    default each is the model tensor of the same name (or ``name_map(name)``; None leaves it
    alone); :func:`weightsync.torch.transformers.layout` derives it for a transformers model,
    :mod:`weightsync.torch.engines` for vLLM and SGLang layouts. ``exclude``: ``fnmatch``
    patterns over store and model names to leave alone; any other tensor of the store without a
    destination in the model, or model memory without a source in the store, is a
    :class:`CoverageError`. ``lock``: the lock the serving loop takes around its use of the model
    (a new one by default, as :attr:`lock`). ``mode``: ``"patch"`` or ``"flip"`` (clones every
    matched tensor on construction: twice the weights' memory, plus :attr:`replay_bytes`).

    ``store=None``: no store; every version comes from a local folder that holds it (a subscriber's
    slot: ``prepare(v, folder=..., manifest=...)``), and ``manifest`` is the one of ``version``.
    Store tensors that the model holds only in part (a tensor-parallel shard) or casts lossily are
    kept whole on the host (:attr:`mirror_bytes`) when following a store, to decode the next delta
    and to verify; a store-less sink keeps none (it compares with the live values, and verifies
    them against a folder: ``folder`` here, or ``verify(folder=...)``). ``trusted_keys`` (public key
    files): every version read from the store must be signed by one of them (docs/FORMAT.md
    section 7), or ``prepare`` raises :class:`~weightsync.errors.SignatureError` and nothing changes.
    ``lazy`` (:class:`~weightsync.sync.lazy.LazyReads`): how tensors whose bytes the store has not
    copied yet (a regional mirror's lazy keyframes) are read: rebuilt from an older keyframe, or
    from a fallback store (default: rebuilt).
    """

    def __init__(
        self,
        store,
        tensors,
        version: int,
        *,
        lock: threading.Lock | None = None,
        layout: Layout | None = None,
        name_map: Callable[[str], str | None] | None = None,
        exclude: Iterable[str] = (),
        dense_above: float = 0.05,
        verify: bool = True,
        threads: int = 4,
        fetch_concurrency: int = 32,
        mode: str = "patch",
        manifest: Manifest | None = None,
        folder: Path | str | None = None,
        direct: bool = True,
        trusted_keys=None,
        lazy: LazyReads | None = None,
    ):
        if mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if layout is not None and name_map is not None:
            raise UsageError("give a layout or a name_map, not both (a layout names every destination)")
        if isinstance(exclude, str):
            raise UsageError(f"exclude takes a list of patterns, not the string {exclude!r}")
        if store is None and manifest is None:
            raise UsageError("without a store, give the manifest of the version the model holds")
        if manifest is not None and manifest.version != version:
            raise UsageError(f"the manifest given is version {manifest.version}, the model holds {version}")
        self.mode = mode
        self.repo = open_repo(store, trusted_keys=trusted_keys) if store is not None else None
        self._manifests: dict[int, Manifest] = {} if manifest is None else {version: manifest}
        self._module = tensors if isinstance(tensors, torch.nn.Module) else None
        if self._module is not None:
            live = tensors.state_dict(keep_vars=True)  # the objects themselves: a later repoint is seen
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
        self.name_map = name_map
        self.layout = layout or identity(name_map)
        self.exclude = (*self.layout.exclude, *exclude)
        self._excludes = excluder(self.exclude)
        self.excluded: tuple[str, ...] = ()  # names left alone in the latest version checked
        self._pads = excluder(self.layout.padding)
        self._checked_disjoint: set[tuple] = set()  # slots whose interleaved regions were checked element by element
        self.padded: dict[str, int] = {}  # live tensor -> elements of engine padding no store tensor writes
        self._held_padding: dict[str, int] | None = None  # the padding of the version the model was loaded at
        self._epoch = 0  # patch mode: applies that failed midway (and tore the model) so far
        self._storages = 0  # times the model's tensors were seen on new storages (:meth:`_refresh`)
        self._moved: set[str] = set()  # names seen on new storages, not yet checked against the version
        self.dense_above, self.threads, self.fetch_concurrency = dense_above, threads, fetch_concurrency
        self.direct = direct
        self.lazy = lazy or LazyReads()
        self._apply_lock = threading.Lock()  # one update at a time (flip mode: also held by prepare)
        self._slots: dict[str, _Slot] = _group(live)  # model name -> its slot
        self._staged: Update | None = None  # flip mode: the update whose version the standby holds
        self._torn = False  # patch mode: the model holds neither version since a failed apply
        self._mirror: dict[str, np.ndarray] = {}  # store bytes (at ``version``) of mirrored tensors
        try:
            m = self._manifest(version)
        except VersionError:
            if verify:
                raise
            m = None  # collected by gc: checked on the first prepare (flip: standbys cloned then)
        bound = self._bind(m) if m is not None else []
        self._held_padding = dict(self.padded) if m is not None else None  # (engine padding changes: refused)
        if self.repo is not None and any(b.mirrored for b in bound):  # (from folders, diffs compare with live)
            self._mirror = self._full_bytes(m, [b for b in bound if b.mirrored], folder)
        if verify:
            self._verify(bound, version, folder)
        if mode == "flip":
            _sync({s.live.device for s in self._ensure_standbys(bound)})

    @property
    def torn(self) -> bool:
        """The model holds neither its version's bytes nor the next one's (an apply that failed
        midway, or a check after the apply that failed): the next update rebuilds every tensor."""
        return self._torn

    def _refresh(self) -> bool:
        """Follow the model's tensors if they are no longer the ones the sink holds (``model.to()``,
        ``model.float()``, ``param.data = ...`` and replaced buffers give them new storages);
        returns whether they changed. The next prepare checks every tensor seen on a new storage
        against the model's version (:meth:`_check_moved`), and reads the bases from there."""
        sd = self._module.state_dict(keep_vars=True) if self._module is not None else self.tensors
        slots = {id(x): x for x in self._slots.values()}.values()
        if sd.keys() == self.tensors.keys() and all(sd[n] is self.tensors[n] for n in sd):
            if all(_holds_storage(slot) for slot in slots):
                return False
        log.info("the model's tensors changed storage since the sink last saw them: following them")
        held = {n: (s.live.data_ptr(), s.live.device) for n, s in self._slots.items()}
        self._moved |= {n for n, t in sd.items() if held.get(n) != (t.data_ptr(), t.device)}
        self.tensors, self._slots, self._staged = sd, _group(sd), None
        self._storages += 1  # what was prepared before writes to storages the model no longer holds
        self._checked_disjoint.clear()
        return True

    def _check_moved(self) -> None:
        """Compare the tensors seen on new storages with the model's version, whether or not the next
        version changes them: a ``param.data = ...`` with other values (not only a move or a cast) must
        not outlive the next update. A mismatch, or a version whose manifest is gone, tears the model:
        the next update rebuilds every tensor. (A write in place is not seen: that would mean hashing
        every tensor at every update; :meth:`verify` does.)"""
        if not self._moved or self._torn:
            self._moved.clear()
            return
        try:
            m = self._manifest(self.version)
            moved = [b for b in self._bind(m) if any(n in self._moved for pl in b.places for n in pl.slot.names)]
            self._verify(moved, m.version)
        except (BaseMismatchError, VersionError) as exc:
            log.warning(
                "a tensor on a new storage does not hold version %d (%s): rebuilding every tensor", self.version, exc
            )
            self._torn, self._epoch = True, self._epoch + 1
        self._moved.clear()

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
        slots = {s: None for s in self._slots.values() if s.replay}
        return sum(p.index.numel() * p.index.element_size() for s in slots for p in s.replay if p.index is not None)

    @property
    def mirror_bytes(self) -> int:
        """Host memory holding the store bytes of tensors the model holds only in part (see the class doc)."""
        return sum(a.nbytes for a in self._mirror.values())

    # -- mapping ----------------------------------------------------------------------------------
    def _manifest(self, version: int) -> Manifest:
        m = self._manifests.get(version)
        if m is None:
            if self.repo is None:
                raise VersionError(f"version {version}: no store, and no manifest given for it")
            m = self.repo.manifest(version)
        return m

    def _remember(self, m: Manifest) -> None:
        """Keep the manifest of the version the model holds (and the one staged), for a store-less sink."""
        self._manifests = {v: x for v, x in self._manifests.items() if v == self.version}
        self._manifests[m.version] = m

    def _bind(self, manifest: Manifest) -> list[_Binding]:
        """Each store tensor of ``manifest`` with its places in the model; raises unless both sides
        are covered (:class:`CoverageError`) and every placement fits (:class:`UsageError`)."""
        segs = store_tensors(manifest)
        tensors = {n: (s.shape, s.dtype) for n, (_, s) in segs.items()}
        try:
            placements = self.layout.for_store(tensors)
            shapes = {} if self.layout.live_shapes is None else self.layout.live_shapes(tensors)
        except WeightsyncError:
            raise
        except Exception as exc:  # a user's rule that fails: one line, not a traceback from the layout
            raise UsageError(f"layout {self.layout.name} failed for version {manifest.version}: {_one_line(exc)}")
        wrong = [
            f"{dest}{list(self._slots[dest].live.shape)} (the version implies {list(shape)})"
            for dest, shape in shapes.items()
            if dest in self._slots and tuple(self._slots[dest].live.shape) != tuple(shape)
        ]
        if wrong:
            raise UsageError(
                f"layout {self.layout.name}: version {manifest.version} does not fit the model's "
                f"{_some(sorted(wrong))}; an engine's loader refuses it too"
            )
        by_source: dict[str, list[Placement]] = {}
        for p in placements:
            by_source.setdefault(p.source, []).append(p)
        unknown = sorted(set(by_source) - set(segs))
        if unknown:
            raise UsageError(
                f"layout {self.layout.name} places {len(unknown)} tensor(s) version {manifest.version} does not "
                f"have ({_some(unknown)})"
            )
        out, unplaced, excluded = [], [], set()
        covered: dict[_Slot, int] = {}  # elements of each slot some placement writes (or leaves alone on purpose)
        regions: dict[tuple, tuple[_Binding, tuple]] = {}  # (slot, view) -> the binding that writes it, its box
        for name, (path, seg) in segs.items():
            if self.name_map is not None and self.name_map(name) is None:
                continue  # the user's name_map leaves it alone
            ps = by_source.get(name, [])
            if self._excludes(name) or any(self._excludes(p.dest) for p in ps):
                excluded.add(name)
                for p in ps:  # its regions are left alone too (a region, not the whole live tensor)
                    if p.dest in self._slots:
                        slot = self._slots[p.dest]
                        try:
                            left = math.prod(self._place(p, seg).shape)
                        except UsageError:  # (a placement it cannot take: why it is excluded)
                            left = slot.live.numel()
                        covered[slot] = covered.get(slot, 0) + left
                continue
            if not ps or any(p.dest not in self._slots for p in ps):
                unplaced.append(name)  # a destination the model does not have: no place for (all of) it
                continue
            binding = _Binding(path, seg, [], False)
            boxes: dict[tuple, int] = {}  # distinct boxes of the store tensor placed (one box may have two copies)
            for p in ps:
                pl = self._place(p, seg)
                boxes[_box_key(pl.box)] = math.prod(pl.shape)
                key = (pl.slot, pl.view)
                first = regions.get(key)
                if first is not None:  # tied: one region, two store names (or one twice)
                    if first[1] != _box_key(pl.box):
                        raise UsageError(
                            f"{first[0].seg.name} and {name}: other boxes of them are placed on one region of "
                            f"{pl.slot.names[0]}"
                        )
                    if first[0].seg.xxh3 != seg.xxh3:
                        raise UsageError(
                            f"{first[0].seg.name} and {name} are one tensor in the model but differ in version "
                            f"{manifest.version}"
                        )
                    continue
                regions[key] = (binding, _box_key(pl.box))
                covered[pl.slot] = covered.get(pl.slot, 0) + math.prod(pl.shape)
                binding.places.append(pl)
                binding.mirrored |= not lossless(TORCH_DTYPE[seg.dtype], pl.slot.live.dtype)
            placed = sum(boxes.values())
            if placed > math.prod(seg.shape):
                raise UsageError(f"{name}: its placements take overlapping boxes of it")
            binding.mirrored |= placed < math.prod(seg.shape)
            out.append(binding)
        by_slot: dict[_Slot, list[tuple[tuple, str]]] = {}
        for (slot, view), (b, _) in regions.items():
            by_slot.setdefault(slot, []).append((view, b.seg.name))
        for slot, views in by_slot.items():
            self._disjoint(slot, views)  # (a count of covered elements alone would miss an overlap beside a gap)
        unsourced, padded = [], {}
        for slot in {s: None for s in self._slots.values()}:
            n = covered.get(slot, 0)
            if n >= slot.live.numel():
                continue
            left = [x for x in slot.names if not self._excludes(x)]
            if not left:
                excluded.update(slot.names)
            elif any(self._pads(x) for x in slot.names):
                padded[slot.names[0]] = slot.live.numel() - n  # the engine's own padding: left alone
            elif n:
                unsourced.append(f"{left[0]} ({slot.live.numel() - n} of {slot.live.numel()} elements)")
            else:
                unsourced.append(left[0])
        if unplaced or unsourced:
            none = f"no tensor of version {manifest.version} matches the model's tensor names: " if not out else ""
            if not out and self._slots and all(n.startswith("_orig_mod.") for n in self._slots):
                none = f"a torch.compile'd module (its names start with _orig_mod.): pass model._orig_mod; {none}"
            raise CoverageError(none + _coverage_message(manifest.version, unplaced, unsourced), unplaced, unsourced)
        if not out:
            raise UsageError(
                f"no tensor of version {manifest.version} matches the model's tensor names"
                f"{f' ({len(excluded)} excluded)' if excluded else ''}"
            )
        if self._held_padding is not None and padded != self._held_padding:
            raise CoverageError(
                f"version {manifest.version} leaves other elements as engine padding than the version the model "
                f"holds ({_some([f'{k}: {v}' for k, v in padded.items()]) or 'none'}, was "
                f"{_some([f'{k}: {v}' for k, v in self._held_padding.items()]) or 'none'}): the engine fills "
                "padding on load; reload the model",
                [],
                sorted(set(padded) ^ set(self._held_padding)) or sorted(padded),
            )
        if padded != self.padded:
            self.padded = padded
            log.info(
                "version %d: padding left alone in %s",
                manifest.version,
                _some([f"{k} ({v})" for k, v in padded.items()]),
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

    def _disjoint(self, slot: _Slot, views: list[tuple[tuple, str]]) -> None:
        """Refuse two placements writing one element of ``slot`` (from different store tensors that
        are not tied). Regions whose address ranges do not meet are disjoint; only where ranges
        interleave (interleaved or rope-permuted rows) are the elements marked one by one, once per
        distinct set of regions."""
        spans = sorted(
            (off, off + sum((n - 1) * st for n, st in zip(shape, stride)), name)
            for (shape, stride, off), name in views
            if math.prod(shape)
        )
        if all(a[1] < b[0] for a, b in zip(spans, spans[1:])):
            return
        key = (id(slot), tuple(sorted(v for v, _ in views)))
        if key in self._checked_disjoint:
            return
        seen = torch.zeros(slot.live.numel(), dtype=torch.uint8)
        for (shape, stride, off), name in views:
            region = seen.as_strided(shape, stride, off)
            if region.any():
                raise UsageError(f"{name}: its placement in {slot.names[0]} overlaps another store tensor's")
            region.fill_(1)
        self._checked_disjoint.add(key)

    def _place(self, p: Placement, seg: Segment) -> _Place:
        slot = self._slots[p.dest]
        t, store_dt = slot.live, TORCH_DTYPE.get(seg.dtype)
        identity_like = p.box is None and p.stride is None and p.offset == 0
        castable = store_dt is not None and store_dt.is_floating_point and t.dtype.is_floating_point
        cast_ok = castable and (self.layout.narrowing or lossless(store_dt, t.dtype) or widening(store_dt, t.dtype))
        if store_dt != t.dtype and not cast_ok:
            raise UsageError(
                f"{seg.name}: the store has {seg.dtype}{list(seg.shape)}, the model {t.dtype}{list(t.shape)}; "
                "cannot patch in place"
            )
        if not t.is_contiguous() or (self.layout.same_shapes and tuple(t.shape) != seg.shape):
            raise UsageError(
                f"{seg.name}: the store has {seg.dtype}{list(seg.shape)}, the model {t.dtype}{list(t.shape)}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}; cannot patch in place"
            )
        if t.device.type == "meta":
            raise UsageError(
                f"{p.dest} is a meta tensor (no memory) and cannot take {seg.name}'s bytes; load its weights first"
            )
        check_placement(p, seg.shape, t)
        shape = p.extent(seg.shape)
        whole = identity_like and store_dt == t.dtype and t.numel() == math.prod(seg.shape)
        stride = p.strides(seg.shape)
        flat = p.box is None and stride == contiguous(seg.shape)
        return _Place(slot, box_slices(p.box, seg.shape), shape, stride, p.offset, whole, flat)

    def verify(self, version: int | None = None, *, folder: Path | str | None = None) -> int:
        """Raise :class:`BaseMismatchError` unless every live tensor holds ``version``'s bytes through
        the layout (default: the version the sink holds); returns the store tensors checked. Tensors the
        model holds in part are checked against the host mirror (the sink's version), ``folder``'s
        files (a folder holding ``version``) or the store. Takes no lock: run it between updates."""
        m = self._manifest(self.version if version is None else version)
        self._refresh()
        return self._verify(self._bind(m), m.version, folder)

    def _verify(self, bound: list[_Binding], version: int, folder: Path | str | None = None) -> int:
        mirrored = [b for b in bound if b.mirrored and b.places]
        full = self._mirror if version == self.version else {}
        missing = [b for b in mirrored if b.seg.name not in full]
        if missing:
            full = {**full, **self._full_bytes(self._manifest(version), missing, folder)}
        for b in bound:
            if not b.places:
                continue  # a tied name: checked through the region's first store tensor
            if b.mirrored:
                data = full[b.seg.name]
                if xxhash.xxh3_128_hexdigest(data) != b.seg.xxh3:
                    raise BaseMismatchError(f"{b.seg.name}: the host copy differs from version {version}")
                self._check_regions(b, data, "live", version)
            elif xxhash.xxh3_128_hexdigest(self._gather(b, "live")) != b.seg.xxh3:
                raise BaseMismatchError(f"{b.seg.name}: the model's bytes differ from version {version}")
        return len(bound)

    def _gather(self, b: _Binding, which: str) -> np.ndarray:
        """The store bytes of ``b`` read back from the live tensors (``which``: "live" or "standby")
        through its places (unchecked; :class:`BaseMismatchError` if a value cast on load does not
        come back exactly)."""
        seg = b.seg
        if len(b.places) == 1 and b.places[0].whole:
            return _host_bytes(getattr(b.places[0].slot, which))
        dt = TORCH_DTYPE[seg.dtype]
        out = torch.empty(seg.shape, dtype=dt)
        for pl in b.places:
            t = getattr(pl.slot, which)
            view = t.detach().reshape(-1).as_strided(pl.shape, pl.stride, t.storage_offset() + pl.offset)
            vals = view if dt == t.dtype else bf16_bits(view)  # (the only cast read back: lossless())
            if vals is None:
                raise BaseMismatchError(f"{seg.name}: a value in {pl.slot.names[0]} is not a {seg.dtype} value")
            out[pl.box] = vals.cpu()
        return out.view(-1).view(torch.uint8).numpy()

    def _full_bytes(self, m: Manifest, bound: list[_Binding], folder: Path | str | None) -> dict[str, np.ndarray]:
        """The store bytes of ``bound``'s tensors at ``m``'s version, verified: read from ``folder``
        (which holds that version) or rebuilt from the store."""
        if folder is not None:
            lv = LocalVersion(Path(folder), m)
            try:
                return {b.seg.name: lv.read(b.path, b.seg).copy() for b in bound}
            finally:
                lv.close()
        if self.repo is None:
            raise UsageError(
                f"{_some([b.seg.name for b in bound])}: the model holds these only in part; without a store, "
                "give the folder that holds the version"
            )

        def make(chain: list[Manifest], avoid: frozenset[str], use_avoided: bool):
            jobs = [TensorJob(b.path, plan_segment(chain, b.path, b.seg, None, avoid, use_avoided)) for b in bound]
            return jobs, [j.recipe for j in jobs]

        jobs, reads = plan_reads(self.repo, m.version, make, lazy=self.lazy)
        with ScratchDir("weightsync-sink-", "weightsync sink (its spool)") as spool:
            paths, _ = fetch_jobs(self.repo, jobs, Path(spool), self.fetch_concurrency, reads=reads)
            built = build_tensors(jobs, paths, None, url=self.repo.url, threads=self.threads, reads=reads)
            return {job.recipe.segment.name: np.array(new, copy=True) for job, new in built}

    # -- prepare: everything before the pause ------------------------------------------------------
    def prepare(
        self,
        version: int | str = "latest",
        *,
        observer: Observer | None = None,
        folder: Path | str | None = None,
        manifest: Manifest | None = None,
    ) -> Update:
        """Fetch, decode and verify ``version``, staged on the tensors' devices: as patches (patch
        mode) or written into the standby buffers (flip mode). ``observer``
        (:class:`~weightsync.sync.observer.Observer`) sees the ``"stage"`` phase (the bytes of the
        changed tensors) and the downloads, and may cancel the prepare from its ``check``.

        ``folder``: a local folder that holds ``version`` (a subscriber's slot), read instead of the
        store, with ``manifest`` (that version's; from the store if not given): only the tensors
        that differ from the model's version are read, each checked against its checksum."""
        op = Operation(observer)
        up = self._prepare_version(version, op, folder, manifest)
        op.done(up.seconds)
        return up

    def _prepare_version(self, version, op: Operation, folder, manifest: Manifest | None) -> Update:
        flip = self.mode == "flip"
        with self._apply_lock if flip else contextlib.nullcontext():  # flip: one standby, one writer
            self._refresh()
            self._check_moved()
            if manifest is not None:
                if version != "latest" and version != manifest.version:
                    raise UsageError(f"asked for version {version}, the manifest given is {manifest.version}")
                target_v = manifest.version
            elif self.repo is None:
                raise UsageError("without a store, give the manifest of the version to prepare")
            else:
                target_v = resolve_version(self.repo, version)
            if folder is not None and manifest is None:
                manifest = self.repo.manifest(target_v)
            if folder is None and self.repo is None:
                raise UsageError("without a store, give the folder that holds the version to prepare")
            torn, epoch, storages = self._torn, self._epoch, self._storages

            def fresh() -> Update:
                return Update(target_v, self.version, mode=self.mode, epoch=epoch, storages=storages)

            up = fresh()
            if target_v == self.version and not torn:
                return up
            if flip:
                self._staged = None  # whatever the standby held is no longer what an update names
            try:
                local = None if torn else self._manifest(self.version)  # torn: no tensor is trusted
            except VersionError:
                local = None  # collected by gc: rebuild changed tensors from the keyframe
            if folder is not None:
                up = self._prepare_folder(up, manifest, local, Path(folder), op)
                if flip:
                    self._staged = up
                return up
            back_to = None if torn else self.version
            try:
                up = self._prepare(up, target_v, back_to, local, op)
            except BaseMismatchError:
                if local is None:
                    raise
                up = None
                if flip:  # a standby that differs from its live tensor is copied from it: try once more
                    with contextlib.suppress(BaseMismatchError):  # (unless the live tensor itself differs)
                        up = self._prepare(fresh(), target_v, back_to, local, op)
                if up is None:
                    up = self._prepare(fresh(), target_v, None, None, op)
            if flip:
                self._staged = up
            return up

    def _begin(self, up: Update, target: Manifest) -> list[_Binding]:
        bound = self._bind(target)
        up.tensors, up.excluded, up.manifest = len(bound), self.excluded, target
        if self.mode == "patch":
            _refuse_overlaps(self._slots.values(), {pl.slot for b in bound for pl in b.places}, "patch")
        if self.mode == "flip":
            self._ensure_standbys(bound)
            self._catch_up()  # every standby equal to its live tensor again
        return bound

    def _base(self, b: _Binding, seg: Segment, version: int) -> np.ndarray:
        """The verified store bytes of ``seg`` (``b``'s tensor at the model's version): read back from
        the model, or, for a mirrored tensor, the host copy once the model's regions of it are
        checked against it (a value written behind the sink's back into a tensor the version
        changes is a mismatch either way; one the version leaves alone is seen only where its storage
        moved, :meth:`_check_moved`, or by :meth:`verify`)."""
        which = "live" if self.mode == "patch" else "standby"
        data = self._mirror.get(b.seg.name) if b.mirrored else self._gather(b, which)
        if data is None or xxhash.xxh3_128_hexdigest(data) != seg.xxh3:
            raise BaseMismatchError(f"{seg.name}: the model's bytes differ from version {version}")
        if b.mirrored:
            self._check_regions(b, data, which, version)
        return data

    @staticmethod
    def _check_regions(b: _Binding, data: np.ndarray, which: str, version: int) -> None:
        """Raise :class:`BaseMismatchError` unless each place of ``b`` holds the engine's cast of
        ``data`` (the store bytes of ``b``'s tensor at ``version``)."""
        src = _store_tensor(data, b.seg)
        for pl in b.places:
            t = getattr(pl.slot, which)
            want = _int_view(src[pl.box].to(t.dtype).contiguous()).to(t.device)
            if not torch.equal(_region(pl, t).reshape(-1), want):
                raise BaseMismatchError(f"{b.seg.name}: the model's bytes differ from version {version}")

    def _prepare(self, up: Update, target_v: int, back_to: int | None, local: Manifest | None, op: Operation) -> Update:
        bound = self._begin(up, self._manifest(target_v))
        # a rollback: the deltas of the versions left may be undone (rebuilt whole, verified)
        ahead = [] if local is None else self.repo.descent(target_v, local.version)

        def make(chain: list[Manifest], avoid: frozenset[str], use_avoided: bool):
            by_key: dict[tuple[str, str], _Binding] = {}
            jobs: list[TensorJob] = []  # rebuilt whole, verified, then diffed
            direct: list[TensorJob] = []  # one sparse delta: patched from the payload alone
            for b in bound:
                if not b.places:
                    continue  # tied: the region is written through its first store tensor
                r = plan_segment(chain, b.path, b.seg, local, avoid, use_avoided, ahead)
                if r.base is not None and r.base.dtype != b.seg.dtype:  # the same bytes may be other values now
                    raise BaseMismatchError(f"{b.seg.name}: stored as {r.base.dtype}, now as {b.seg.dtype}")
                if r.base is not None and not r.steps and r.base.xxh3 == b.seg.xxh3:
                    continue  # unchanged
                (direct if self._direct(b, r) else jobs).append(TensorJob(b.path, r))
                by_key[(b.path, b.seg.name)] = b
            return (by_key, jobs, direct), [j.recipe for j in jobs + direct]

        (by_key, jobs, direct), reads = plan_reads(self.repo, target_v, make, back_to=back_to, lazy=self.lazy)
        host: dict[tuple[str, str], np.ndarray] = {}
        lock = threading.Lock()

        def base(path: str, seg: Segment) -> np.ndarray:
            data = self._base(by_key[(path, seg.name)], seg, self.version)
            with lock:
                host[(path, seg.name)] = data
            return data

        def stage(job: TensorJob, new: np.ndarray) -> _Staged:
            key = (job.path, job.recipe.segment.name)
            with lock:
                old = host.pop(key, None)
            return self._stage(by_key[key], old, new)

        staged: dict[_Slot, Flip] = {}
        try:
            with ScratchDir("weightsync-sink-", "weightsync sink (its spool)") as spool:
                every = jobs + direct
                paths, up.fetched_bytes = fetch_jobs(self.repo, every, Path(spool), self.fetch_concurrency, op, reads)
                up.seconds["fetch"] = op.elapsed()
                op.phase("stage", sum(j.recipe.segment.nbytes for j in every))
                built = build_tensors(
                    jobs, paths, base, url=self.repo.url, threads=self.threads, op=op, then=stage, reads=reads
                )
                for job, st in built:
                    self._merge(st, up, staged)
                    op.progress(job.recipe.segment.nbytes)
                if direct:
                    up.checked = False
                    payloads = Payloads(self.repo.url, paths, reads)
                    try:

                        def changes(job: TensorJob) -> _Staged:
                            op.check()
                            seg, step = job.recipe.segment, job.recipe.steps[0]
                            what = f"{job.path}: {seg.name}"
                            found = payload_changes(seg.dtype, step.codec, payloads.read(step), seg.nbytes, what)
                            return self._stage_changes(by_key[(job.path, seg.name)], *found)

                        weight = lambda j: 3 * j.recipe.steps[0].size + 16 * j.recipe.segment.changed  # noqa: E731
                        for job, st in ordered_map(changes, direct, weight, 256 << 20, self.threads, TASK_BYTES):
                            self._merge(st, up, staged)
                            op.progress(job.recipe.segment.nbytes)
                    finally:
                        payloads.close()
            _sync({f.new.device for f in up.flips})
        except BaseException:
            self._spoil(staged, by_key.values())
            raise
        if self.mode == "patch":
            up.patches = _coalesce(up.patches)
        up.seconds["prepare"] = op.elapsed()
        return up

    def _prepare_folder(self, up: Update, target: Manifest, local: Manifest | None, folder: Path, op: Operation):
        """:meth:`_prepare` reading the changed tensors from ``folder``, which holds ``target``'s version."""
        bound = self._begin(up, target)
        old_segs = {} if local is None else {n: s for n, (_, s) in store_tensors(local).items()}
        todo = []
        for b in bound:
            old = old_segs.get(b.seg.name)
            same = old is not None and (old.xxh3, old.nbytes, old.dtype) == (b.seg.xxh3, b.seg.nbytes, b.seg.dtype)
            if b.places and not same:
                todo.append((b, old))
        op.phase("stage", sum(b.seg.nbytes for b, _ in todo))
        lv = LocalVersion(folder, target)

        def stage(item: tuple[_Binding, Segment | None]) -> _Staged:
            b, old_seg = item
            op.check()
            new = lv.read(b.path, b.seg)  # checked against its checksum
            old = None
            if old_seg is not None and old_seg.dtype == b.seg.dtype and old_seg.shape == b.seg.shape:
                with contextlib.suppress(BaseMismatchError):  # compare with the live values instead
                    old = self._base(b, old_seg, self.version) if not b.mirrored or self._mirror else None
            return self._stage(b, old, new)

        staged: dict[_Slot, Flip] = {}
        try:
            weight = lambda item: 3 * item[0].seg.nbytes  # noqa: E731
            for (b, _), st in ordered_map(stage, todo, weight, 256 << 20, self.threads, 3 * TASK_BYTES):
                self._merge(st, up, staged)
                op.progress(b.seg.nbytes)
            _sync({f.new.device for f in up.flips})
        except BaseException:
            self._spoil(staged, [b for b, _ in todo])
            raise
        finally:
            lv.close()
        if self.mode == "patch":
            up.patches = _coalesce(up.patches)
        up.seconds["prepare"] = op.elapsed()
        return up

    def _spoil(self, staged: dict, bound) -> None:
        """Flip mode, a prepare that failed: each standby it may have touched is suspect until
        copied from live again."""
        for b in bound:
            for pl in b.places:
                pl.slot.dirty = True if self.mode == "flip" else pl.slot.dirty

    def _direct(self, b: _Binding, r) -> bool:
        """Whether ``b``'s recipe is one ``sparse`` delta from the model's version that patches can
        be read from directly (positions and differences; the old values at those positions come
        from the model): every place in the store's dtype, nothing mirrored."""
        seg = b.seg
        return (
            self.direct
            and r.base is not None
            and len(r.steps) == 1
            and r.steps[0].codec == "sparse"
            and not r.steps[0].backward
            and r.base.nbytes == seg.nbytes
            and r.base.dtype == seg.dtype
            and not b.mirrored
            and all(pl.slot.live.dtype == TORCH_DTYPE[seg.dtype] for pl in b.places)
        )

    def _stage_changes(self, b: _Binding, idx: np.ndarray, diff: np.ndarray) -> _Staged:
        """:meth:`_stage` from a delta's changes alone (positions ``idx`` of the store tensor and
        wrapping differences ``diff``): each place's new values are its current values there plus
        the differences, computed on the tensor's device. Work proportional to the change; the
        result is not hashed (``Update.checked`` is False: verify after the apply)."""
        st = _Staged(b, int(idx.size))
        seg = b.seg
        d_all = torch.from_numpy(diff.view(_NP_INT[diff.itemsize]))
        for pl in b.places:
            target = _int_view(pl.slot.live if self.mode == "patch" else pl.slot.standby)
            if self.mode == "flip":
                pl.slot.dirty = True
            if pl.whole or pl.flat:
                local, d = torch.from_numpy(idx), d_all  # positions in the region, in its element order
                pos = local + pl.offset
            else:
                coords = np.unravel_index(idx, seg.shape)
                keep = np.ones(idx.size, dtype=bool)
                for c, sl in zip(coords, pl.box):
                    keep &= (c >= sl.start) & (c < sl.stop)
                rel = [c[keep] - sl.start for c, sl in zip(coords, pl.box)]
                local = torch.from_numpy(np.ravel_multi_index(rel, pl.shape).astype(np.int64))
                pos = sum(torch.from_numpy(c) * s for c, s in zip(rel, pl.stride))
                pos, d = torch.as_tensor(pos, dtype=torch.int64) + pl.offset, d_all[torch.from_numpy(keep)]
            if not pos.numel():
                continue
            d = d.to(target.device)
            if pos.numel() > self.dense_above * math.prod(pl.shape):  # many: the region whole, patched off the lock
                region = _region(pl, target).clone(memory_format=torch.contiguous_format).view(-1)  # current values
                local = local.to(target.device)
                region.index_put_((local,), region.index_select(0, local) + d)
                p = Patch(seg.name, target, None, region, view=pl.view)
            else:
                pos = pos.to(target.device)
                p = Patch(seg.name, target, pos, target.index_select(0, pos) + d)  # wraps, as stored
            if self.mode == "flip":
                with torch.no_grad():
                    p.write()
            st.patches.append((pl, p))
        return st

    def _stage(self, b: _Binding, old: np.ndarray | None, new: np.ndarray) -> _Staged:
        """Turn ``new`` (verified bytes of ``b``'s tensor) into patches of its places; flip mode also
        writes them into the standbys. Runs on the decoding threads (each tensor's places are its own
        regions); :meth:`_merge` records the result."""
        seg, width = b.seg, itemsize(b.seg.dtype)
        new_e = new.view(UINT_VIEW[width])
        idx = None if old is None else changed_positions(old.view(UINT_VIEW[width]), new_e)
        st = _Staged(b, new_e.size if idx is None else int(idx.size))
        if b.mirrored:
            st.mirror = np.array(new, copy=True)
        src = _store_tensor(new, seg)
        for pl in b.places:
            slot = pl.slot
            target = _int_view(slot.live if self.mode == "patch" else slot.standby)
            if self.mode == "flip":
                slot.dirty = True  # until the flip (an update never applied leaves the standby ahead of live)
            p = self._patch(seg, pl, target, src, new_e, idx)
            if p is None:
                continue
            if self.mode == "flip":
                with torch.no_grad():
                    p.write()
            st.patches.append((pl, p))
        return st

    def _merge(self, st: _Staged, up: Update, staged: dict[_Slot, Flip]) -> None:
        """Record a staged tensor in the update: its patches (patch mode), or its slots' flips and
        the replays that bring the retired storages along (flip mode)."""
        up.changed_elements += st.changed
        if st.mirror is not None:
            up.mirror[st.binding.seg.name] = st.mirror
        for pl, p in st.patches:
            if self.mode == "patch":
                up.patches.append(p)
                continue
            slot = pl.slot
            f = staged.get(slot)
            if f is None:
                f = staged[slot] = Flip(tuple(slot.names), tuple(slot.objects), slot.standby, slot.live, slot)
                up.flips.append(f)
            live_t, sb = _int_view(slot.live), _int_view(slot.standby)
            if p.index is not None:
                i = p.index.int() if slot.live.numel() < 2**31 else p.index
                replay = Patch(p.name, live_t, i, sb, gather=True)  # kept: 4 B/position
            else:
                replay = Patch(p.name, live_t, None, sb, gather=True, view=p.view)
            f.replay.append(replay)
            up.patches.append(replay)

    def _patch(self, seg, pl: _Place, target, src: torch.Tensor, new_e: np.ndarray, idx) -> Patch | None:
        """The write that brings ``pl``'s region of ``target`` to ``src`` (the store tensor's new
        values); ``idx``: the store tensor's changed flat positions (None: compare with the target)."""
        live_dt, dev = pl.slot.live.dtype, target.device
        if pl.whole:
            if idx is None:
                idx = changed_positions(_host_bytes(target).view(new_e.dtype), new_e) if dev.type == "cpu" else None
            if idx is None or idx.size > self.dense_above * new_e.size:
                return Patch(seg.name, target, None, _int_view(src).to(dev))
            if not idx.size:
                return None
            values = torch.from_numpy(new_e[idx].view(_NP_INT[new_e.itemsize]))
            return Patch(seg.name, target, torch.from_numpy(idx).to(dev), values.to(dev))
        size = math.prod(pl.shape)
        region = src[pl.box]
        if idx is not None and pl.flat:  # the store tensor's element order, from ``offset`` on
            if not idx.size:
                return None
            if idx.size <= self.dense_above * size:
                at = torch.from_numpy(idx)
                vals = src.reshape(-1)[at].to(live_dt)
                return Patch(seg.name, target, (at + pl.offset).to(dev), _int_view(vals).to(dev))
        elif idx is not None:
            coords = np.unravel_index(idx, seg.shape)
            keep = np.ones(idx.size, dtype=bool)
            for c, sl in zip(coords, pl.box):
                keep &= (c >= sl.start) & (c < sl.stop)
            local = [c[keep] - sl.start for c, sl in zip(coords, pl.box)]
            n = int(keep.sum())
            if n == 0:
                return None
            if n <= self.dense_above * size:
                pos = sum(torch.from_numpy(c) * s for c, s in zip(local, pl.stride)) + pl.offset
                vals = region[tuple(torch.from_numpy(c) for c in local)].to(live_dt)
                return Patch(seg.name, target, pos.to(dev), _int_view(vals).to(dev))
        else:  # no old bytes: compare with what the target holds
            want = _int_view(region.to(live_dt).contiguous()).to(dev).view(pl.shape)
            cur = target.as_strided(pl.shape, pl.stride, target.storage_offset() + pl.offset)
            diff = (cur != want).nonzero()
            if not diff.numel():
                return None
            if diff.shape[0] <= self.dense_above * size:
                stride = torch.tensor(pl.stride, device=dev)
                pos = (diff * stride).sum(1) + pl.offset
                return Patch(seg.name, target, pos, want[tuple(diff.t())])
        values = _int_view(region.to(live_dt).contiguous()).to(dev)
        return Patch(seg.name, target, None, values, view=pl.view)

    # -- flip mode: the standby buffers ------------------------------------------------------------
    def _ensure_standbys(self, bound: list[_Binding]) -> list[_Slot]:
        """The slots ``bound`` writes, each with its standby, once checked that repointing reaches them."""
        slots = list({pl.slot: None for b in bound for pl in b.places})
        for slot in slots:
            self._ensure_standby(slot)
        _refuse_overlaps(self._slots.values(), set(slots), "flip")
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
                elif slot.replay:
                    for p in slot.replay:
                        p.write()
                slot.dirty, slot.replay = False, None
        _sync({s.live.device for s in self._slots.values()})  # decoding threads read the standbys

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
            if self._refresh() or update.storages != self._storages:  # (seen now, or by a verify or prepare since)
                raise UsageError(
                    f"update to version {update.version}: the model's tensors changed storage since it was "
                    "prepared (moved, cast or replaced); prepare again"
                )
            devices = {p.target.device for p in update.patches}
            written, batch = 0, 1
            with torch.no_grad(), self.lock:
                t0 = time.perf_counter()
                try:
                    for p in update.patches:
                        batch = p.writes
                        p.write()
                        written, batch = written + batch, 1
                    _sync(devices)
                except BaseException as exc:
                    self._torn, self._epoch = True, self._epoch + 1
                    if not isinstance(exc, Exception):
                        raise
                    part = f" ({batch} more in the call that failed, some perhaps)" if batch > 1 else ""
                    raise ApplyError(
                        f"apply to version {update.version} failed with {written} of "
                        f"{sum(p.writes for p in update.patches)} tensors written{part}: the model is torn "
                        f"until the next update, which rebuilds it from the keyframe ({_one_line(exc)})"
                    ) from exc
                pause = time.perf_counter() - t0
            self._applied(update)
            update.seconds["pause"] = pause
            return pause

    def _applied(self, update: Update) -> None:
        self.version, self._torn = update.version, False
        if update.manifest is not None:
            self._remember(update.manifest)
        self._mirror.update(update.mirror)

    def _apply_flip(self, update: Update) -> float:
        if update is not self._staged:
            raise UsageError(
                f"update to version {update.version} is no longer staged in the standby "
                "(another prepare ran since, or it failed); prepare again"
            )
        for f in update.flips:
            if any(o.data_ptr() != f.old.data_ptr() for o in f.objects):
                raise UsageError(f"{', '.join(f.names)}: the tensor's storage was repointed behind the sink's back")
        if self._refresh() or update.storages != self._storages:  # (a Parameter replaced by another object)
            raise UsageError(
                f"update to version {update.version}: the model's tensors changed since it was prepared "
                "(moved, cast or replaced); prepare again"
            )
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
        self._applied(update)
        update.seconds["pause"] = pause
        return pause

    def update(self, version: int | str = "latest", *, observer: Observer | None = None) -> Update:
        """:meth:`prepare` then :meth:`apply`, then :meth:`after_apply`; returns the update with its timings."""
        up = self.prepare(version, observer=observer)
        self.apply(up)
        self.after_apply(up)
        return up

    def after_apply(self, update: Update) -> None:
        """Check, off the lock, what ``apply`` wrote from unhashed patches (a ``sparse`` delta patched
        from its payload alone: ``update.checked`` is False): every live tensor through the layout
        against the version's checksums. On a mismatch the model is torn: the next update rebuilds
        every tensor from the keyframe, and :class:`BaseMismatchError` says so."""
        if update.checked or update.version != self.version:
            return
        t0 = time.perf_counter()
        try:
            self.verify()
        except BaseMismatchError as exc:
            with self._apply_lock:
                self._torn, self._epoch = True, self._epoch + 1
            raise BaseMismatchError(
                f"after the apply of version {update.version}: {exc}; the model is torn until the next update, "
                "which rebuilds it from the keyframe"
            ) from exc
        update.seconds["verify"] = time.perf_counter() - t0


_FOREACH_MAX = 1 << 31  # torch before 2.8 indexed a _foreach_copy_ tensor with 32 bits on CUDA (pytorch#156261)


def _coalesce(patches: list[Patch]) -> list[Patch | _Copies]:
    """Patch mode: one scatter per live tensor instead of one per store tensor (the experts of a
    stack, the shards of a fused projection), positions and values concatenated off the lock; and
    the dense writes of each device and width (of fewer than 2**31 elements each) as one
    :class:`_Copies`. The pause then pays one call per tensor, and one for the region copies."""
    by_target: dict[tuple, list[Patch]] = {}
    dense: dict[tuple, list[Patch]] = {}
    out: list[Patch | _Copies] = []
    for p in patches:
        if p.gather:
            out.append(p)
        elif p.index is None and p.elements < _FOREACH_MAX:
            dense.setdefault((p.target.device, p.target.dtype), []).append(p)
        elif p.index is None:
            out.append(p)
        else:
            by_target.setdefault((p.target.data_ptr(), p.target.device, p.target.dtype), []).append(p)
    for group in by_target.values():
        if len(group) == 1:
            out.append(group[0])
        else:
            idx = torch.cat([p.index for p in group])
            values = torch.cat([p.values for p in group])
            out.append(Patch(group[0].name, group[0].target, idx, values, count=sum(p.count for p in group)))
    for group in dense.values():
        if len(group) == 1:
            out.append(group[0])
        else:
            pairs = [p.copy_pair() for p in group]
            out.append(_Copies([p.name for p in group], [d for d, _ in pairs], [s for _, s in pairs]))
    return out


def _store_tensor(data: np.ndarray, seg: Segment) -> torch.Tensor:
    """A store tensor's bytes as a CPU tensor of its dtype and shape (a view)."""
    return torch.from_numpy(data.view(_NP_INT[itemsize(seg.dtype)])).view(TORCH_DTYPE[seg.dtype]).view(seg.shape)


def _region(pl: _Place, t: torch.Tensor) -> torch.Tensor:
    """``pl``'s region of ``t`` as integers (the live view's bits)."""
    flat = _int_view(t)
    return flat.as_strided(pl.shape, pl.stride, flat.storage_offset() + pl.offset)


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


def _box_key(box: tuple[slice, ...]) -> tuple:
    return tuple((sl.start, sl.stop) for sl in box)


def _holds_storage(slot: _Slot) -> bool:
    """Every object of ``slot`` still holds the storage (and dtype, shape, device) the sink knows."""
    t = slot.live
    return all(
        o.data_ptr() == t.data_ptr() and o.dtype == t.dtype and o.shape == t.shape and o.device == t.device
        for o in slot.objects
    )


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


def _refuse_overlaps(slots, managed: set, mode: str = "flip") -> None:
    """Refuse a managed tensor sharing memory with another tensor given without being the same
    tensor: flip mode would leave the other reading the retired storage; in patch mode their
    versions would overwrite each other. Sorted by start, each overlapping span meets one it overlaps."""
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
                + (
                    "flip mode cannot repoint one alone (use mode='patch')"
                    if mode == "flip"
                    else "writing one would change the other (give the tensor once)"
                )
            )
        if prev is None or end > prev[0]:
            reach[dev] = (end, slot)
