"""Where a checkpoint's tensors live in an engine's memory: a :class:`Layout` is a list of
:class:`Placement` s, each saying that a box of a store tensor equals (after the engine's cast) a
strided view of one live tensor. Every layout an engine builds on load is of this kind: renamed
modules (a placement of the whole tensor), fused projections (a box of the live tensor along one
dim), stacked experts (one index of a new leading dim), transposes (permuted strides), tensor- and
expert-parallel shards (a box of the store tensor), tied weights (two placements on one storage),
dtypes cast on load (the live tensor's dtype differs from the store's).

Layouts come from :mod:`weightsync.torch.transformers` (derived from a transformers model's own
conversion mapping) or :mod:`weightsync.torch.engines` (vLLM / SGLang style rules); the identity
layout (every store tensor is a live tensor of the same name and shape) is :func:`identity`.
:class:`~weightsync.torch.sink.TorchSink` resolves a layout against a model and a version
(:func:`resolve`): every store tensor must have a destination, every live element a source, unless
excluded by name; anything the layout cannot explain is an error before anything is written."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from weightsync.errors import UsageError
from weightsync.format.manifest import Manifest, Segment

Box = tuple[tuple[int, int], ...]  # per dim of the store tensor: [start, stop)


@dataclass(frozen=True)
class Placement:
    """Elements ``box`` of store tensor ``source`` equal, cast to the live dtype, the view
    ``live.flatten().as_strided(shape, stride, offset)`` of live tensor ``dest`` (contiguous),
    where ``shape`` is the box's extent. ``box=None``: the whole store tensor."""

    source: str
    dest: str
    offset: int = 0  # element offset into the live tensor's flat memory
    stride: tuple[int, ...] | None = None  # live strides per dim of the box; None: contiguous in the box's shape
    box: Box | None = None

    def extent(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the placed region, given the store tensor's shape."""
        return shape if self.box is None else tuple(b - a for a, b in self.box)

    def strides(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The live strides of the region (contiguous strides of its extent if not given)."""
        return self.stride if self.stride is not None else contiguous(self.extent(shape))


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def box_slices(box: Box | None, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``box`` as a tuple of slices over a tensor of ``shape``."""
    return tuple(slice(0, n) for n in shape) if box is None else tuple(slice(a, b) for a, b in box)


def live_view(flat: torch.Tensor, p: Placement, shape: tuple[int, ...]) -> torch.Tensor:
    """The view of ``flat`` (a live tensor's flat view, or its standby's) that ``p`` places into."""
    return flat.as_strided(p.extent(shape), p.strides(shape), flat.storage_offset() + p.offset)


@dataclass
class Layout:
    """A model's placements, plus names it says to leave alone and live tensors it says are padded.
    ``placements`` may be a callable taking the store's tensors ``{name: (shape, dtype name)}`` and
    returning placements (rules that depend on which tensors a version has). A live dtype wider
    than the store's (bf16 or fp16 kept in fp32, :func:`widening`) is always a cast on load; a
    narrower one only if ``narrowing`` says so (otherwise it is a version the model cannot take)."""

    placements: list[Placement] | Callable[[Mapping[str, tuple[tuple[int, ...], str]]], Iterable[Placement]]
    exclude: tuple[str, ...] = ()
    name: str = "layout"
    # live tensors (fnmatch) whose elements no placement covers are the engine's own padding (vocab rows past
    # the checkpoint's, which the engine zero-fills on load): accepted and reported there, refused elsewhere
    padding: tuple[str, ...] = ()
    narrowing: bool = False  # the engine casts store values to a narrower live dtype on load (fp32 served in bf16)
    same_shapes: bool = False  # every placement is a whole live tensor of the store tensor's shape
    # the shape each live tensor must have for a version holding these tensors (rules that work the
    # shapes out, as an engine's loader does): a model whose tensor differs cannot take the version
    live_shapes: Callable[[Mapping[str, tuple[tuple[int, ...], str]]], Mapping[str, tuple[int, ...]]] | None = None

    def for_store(self, tensors: Mapping[str, tuple[tuple[int, ...], str]]) -> list[Placement]:
        """The placements for a version holding ``tensors``."""
        return list(self.placements(tensors) if callable(self.placements) else self.placements)


def identity(name_map: Callable[[str], str | None] | None = None, exclude: Iterable[str] = ()) -> Layout:
    """Every store tensor is the live tensor of the same name (or ``name_map(name)``; None: no
    destination), whole."""

    def rules(tensors):
        for n in tensors:
            dest = name_map(n) if name_map else n
            if dest is not None:
                yield Placement(n, dest)

    return Layout(rules, tuple(exclude), "identity", same_shapes=True)


@dataclass
class Resolved:
    """A layout resolved against one version and one model: per store tensor, its placements; the
    names left alone; and which store tensors the live memory does not fully determine (partially
    placed, or cast to a narrower dtype), whose store bytes the sink must keep on the host."""

    by_source: dict[str, list[Placement]] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()
    mirrored: frozenset[str] = frozenset()


def excluder(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A test for names matching any of the ``fnmatch`` patterns."""
    pats = tuple(patterns)
    rx = re.compile("|".join(fnmatch.translate(p) for p in pats)) if pats else None
    return lambda n: rx is not None and rx.match(n) is not None


def volume(shape: Iterable[int]) -> int:
    return math.prod(shape)


def lossless(store: torch.dtype, live: torch.dtype) -> bool:
    """The live values of a ``store`` tensor cast to ``live`` give the store's bits back exactly
    (NaN payloads included): the same dtype, or bf16 kept in fp32 (the cast is a shift by 16 bits,
    undone exactly by :func:`bf16_bits`). Other casts (fp16 -> fp32 quiets NaNs, fp32 -> bf16
    rounds) are not read back: the sink keeps the store's bytes of such tensors on the host."""
    return store == live or (store == torch.bfloat16 and live == torch.float32)


def widening(store: torch.dtype, live: torch.dtype) -> bool:
    """A cast of ``store`` floats to the wider float ``live`` keeps every value (fp16 or bf16 to fp32,
    fp8 to 16 bits): what a loader does with a checkpoint in a narrower dtype than the model's. Only
    NaN payloads may change, so the sink keeps the bytes of such tensors on the host unless
    :func:`lossless` says the cast reads back."""
    return store.is_floating_point and live.is_floating_point and live.itemsize > store.itemsize


def bf16_bits(t: torch.Tensor) -> torch.Tensor | None:
    """The bf16 values an fp32 tensor was cast from (the upper 16 bits of each element), or None
    if an element has low bits set (it is no bf16 value)."""
    b = t.contiguous().view(torch.int32)
    if bool((b & 0xFFFF).any()):
        return None
    return (b >> 16).to(torch.int16).view(torch.bfloat16)


def check_placement(p: Placement, shape: tuple[int, ...], live: torch.Tensor) -> None:
    """Raise :class:`UsageError` unless ``p`` fits the store tensor's ``shape`` and stays inside ``live``."""
    if p.box is not None:
        if len(p.box) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(p.box, shape)):
            raise UsageError(f"{p.source}{list(shape)}: box {list(p.box)} of its placement in {p.dest} is out of range")
    ext = p.extent(shape)
    st = p.strides(shape)
    if len(st) != len(ext) or any(s < 0 for s in st) or p.offset < 0:
        raise UsageError(f"{p.source}: strides {list(st)} or offset {p.offset} do not fit its region {list(ext)}")
    last = p.offset + sum((n - 1) * s for n, s in zip(ext, st))
    if volume(ext) and last >= live.numel():
        raise UsageError(
            f"{p.source}{list(ext)} placed at offset {p.offset} with strides {list(st)} runs past the end of "
            f"{p.dest}{list(live.shape)}"
        )
    if self_overlapping(ext, st):
        raise UsageError(
            f"{p.source}{list(ext)} placed in {p.dest} with strides {list(st)} writes some live elements twice"
        )


def self_overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether the strided view ``(shape, stride)`` reaches one element twice. Dims sorted by
    stride that each step past what the smaller ones reach cannot (every engine layout); only
    other strides are checked element by element."""
    dims = sorted((s, n) for n, s in zip(shape, stride) if n > 1)
    reach = 1
    for s, n in dims:
        if s < reach:
            break
        reach += s * (n - 1)
    else:
        return False
    if any(s == 0 for s, _ in dims) or volume(shape) > 1 << 26:
        return True  # (a broadcast; or too large to enumerate: refused rather than guessed)
    addr = torch.zeros((), dtype=torch.int64)
    for n, s in zip(shape, stride):
        addr = addr.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
    return addr.unique().numel() != volume(shape)


def store_tensors(manifest: Manifest) -> dict[str, tuple[str, Segment]]:
    """Each tensor of ``manifest`` by name, with the file holding it, in the manifest's order. A name
    that two files hold (a stale copy in a subfolder, ranks that wrote a replicated tensor each) is one
    tensor only where the copies are the same bytes; otherwise which one a model should get is unknown,
    and :class:`UsageError` says so before anything is written (the sink and ``EngineLoader``)."""
    out: dict[str, tuple[str, Segment]] = {}
    for f in manifest.files:
        for s in f.segments:
            if s.role != "tensor":
                continue
            first = out.setdefault(s.name, (f.path, s))
            if first[1] is not s and (first[1].xxh3, first[1].dtype, first[1].shape) != (s.xxh3, s.dtype, s.shape):
                raise UsageError(
                    f"version {manifest.version} holds tensor {s.name} twice, with other values in {first[0]} "
                    f"and {f.path}; a model takes one (remove the stale copy from the checkpoint)"
                )
    return out
