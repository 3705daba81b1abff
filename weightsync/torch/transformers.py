"""The :class:`~weightsync.torch.layout.Layout` of a transformers (v5) model, derived from the
model's own conversion mapping: the one ``save_pretrained`` reverts to write the checkpoint format
(``transformers.core_model_loading.revert_weight_conversion``). No table per architecture: a
family transformers adds later works as its mapping does::

    lay = layout(model)        # a Qwen3-MoE from from_pretrained (or built from a config)
    lay.for_store({"model.layers.0.mlp.experts.3.gate_proj.weight": ((768, 2048), "bfloat16")})
    # [Placement(source=..., dest="model.layers.0.mlp.experts.gate_up_proj", offset=9437184)]

How: the revert runs first on meta tensors (the checkpoint's names and shapes, for free); a
checkpoint tensor that is a live tensor passed through is a rename. The live tensors the other ones
come from are probed: each gets an integer tensor of its elements' ids, the revert runs on those,
and each resulting id array is explained as boxes, each an affine (strided) view of one live tensor,
checked element by element. The probe runs per decoder layer (live names up to their first number)
and holds about 8 bytes per element of one layer's converted tensors (int32 ids and the revert's
copies); if the layers' outputs are not the whole revert's, it runs once on the whole state dict."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from transformers.core_model_loading import revert_weight_conversion

from weightsync.errors import UsageError
from weightsync.torch.layout import Box, Layout, Placement, contiguous, volume

# A checkpoint tensor's cover by more than MAX_BOXES boxes of fewer than MIN_MEAN_BOX elements on
# average is refused: such a conversion scatters elements (a gather, not a view)
MAX_BOXES = 4096
MIN_MEAN_BOX = 16

Shape = tuple[int, ...]


def layout(model: torch.nn.Module, *, exclude: Iterable[str] = ()) -> Layout:
    """The layout of ``model`` (a transformers ``PreTrainedModel``) for a store holding its
    checkpoint as ``save_pretrained`` writes it: per checkpoint tensor name, where its elements live
    in ``model.state_dict()``. Names with no conversion are whole placements; tied weights place
    under each name the checkpoint may hold (``lm_head.weight`` and ``model.embed_tokens.weight``
    both into their own, aliased, live names); a store tensor named as in ``model.state_dict()``
    with the live shape is placed whole too. Keys ``save_pretrained`` never writes
    (``_keys_to_ignore_on_save``) join ``exclude`` (``fnmatch`` patterns the sink leaves alone).

    Raises :class:`UsageError` when transformers cannot revert the model's conversion (quantized,
    tensor-parallel) or a checkpoint tensor is not made of strided views of live tensors (a
    conversion that computes, pads or scatters); the rules raise it for a store tensor of a known
    name whose shape differs from the checkpoint's."""
    if isinstance(exclude, str):
        raise UsageError(f"exclude takes a list of patterns, not the string {exclude!r}")
    kind = type(model).__name__
    if not hasattr(model, "config"):
        raise UsageError(f"{kind} is not a transformers model (it has no config)")
    live = model.state_dict()
    ignored = tuple(k for k in getattr(model, "_keys_to_ignore_on_save", None) or () if k in live)
    for k in ignored:
        del live[k]
    shapes = {k: tuple(t.shape) for k, t in live.items()}
    del live

    meta = {k: torch.empty(s, dtype=torch.int64, device="meta") for k, s in shapes.items()}
    saved = _revert(model, meta)
    source = {id(t): k for k, t in meta.items()}
    plan: dict[str, tuple[Shape, list[Placement]]] = {}
    converted: dict[str, Shape] = {}
    passed = set()
    for name, t in saved.items():
        k = source.get(id(t))
        if k is not None and meta[k] is t:  # the live tensor itself: a rename
            plan[name] = (shapes[k], [Placement(name, k)])
            passed.add(k)
        else:
            converted[name] = tuple(t.shape)
    if converted:
        keys = [k for k in shapes if k not in passed]
        groups: dict[str, list[str]] = {}
        for k in keys:
            groups.setdefault(_group(k), []).append(k)
        probed = _probe(model, shapes, list(groups.values()), converted)
        if probed is None:  # a conversion across groups, or one that renames by what else it sees
            probed = _probe(model, shapes, [list(shapes)], {n: t.shape for n, t in saved.items()})
        if probed is None:
            raise UsageError(
                f"{kind}: transformers' revert of its conversion gives other names or shapes on "
                "integer tensors than on meta tensors; cannot derive its layout"
            )
        for name, shape in converted.items():
            plan[name] = (shape, probed[name])

    def rules(tensors: Mapping[str, tuple[tuple[int, ...], str]]) -> Iterable[Placement]:
        for name, (shape, _) in tensors.items():
            known = plan.get(name)
            if known is not None:
                if tuple(shape) != known[0]:
                    raise UsageError(
                        f"store tensor {name}{list(shape)}: {kind}'s checkpoint holds it as {list(known[0])}"
                    )
                yield from known[1]
            elif shapes.get(name) == tuple(shape):
                yield Placement(name, name)

    return Layout(rules, tuple(exclude) + ignored, f"transformers {kind}")


def _revert(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``revert_weight_conversion`` (what ``save_pretrained`` does to the state dict), its errors as
    :class:`UsageError`."""
    try:
        return revert_weight_conversion(model, state_dict)
    except Exception as e:  # a conversion transformers cannot revert (quantized, TP) or an op failing
        raise UsageError(f"{type(model).__name__}: transformers cannot revert its weight conversion: {e}") from e


class _Ids:
    """A probe's id space: live tensor ``names[i]`` holds ids ``starts[i] + its flat index``, int32
    where they fit (half the memory), int64 otherwise."""

    def __init__(self, shapes: Mapping[str, Shape]):
        self.names = list(shapes)
        self.shapes = dict(shapes)
        numels = torch.tensor([volume(s) for s in shapes.values()], dtype=torch.int64)
        total = int(numels.sum())
        # ids start high: a value computed from them (padding, a scale, a sum) is out of range, no id
        self.first = (1 << 30) if total < 1 << 30 else (1 << 40)
        self.dtype = torch.int32 if self.first == 1 << 30 else torch.int64
        self.starts = self.first + torch.cumsum(numels, 0) - numels
        self.ends = self.starts + numels
        self.end = self.first + total
        self._start = dict(zip(self.names, self.starts.tolist()))

    def of(self, name: str) -> torch.Tensor:
        """The ids of live tensor ``name``, in its shape."""
        s = self._start[name]
        return torch.arange(s, s + volume(self.shapes[name]), dtype=self.dtype).view(self.shapes[name])

    def owner(self, v: torch.Tensor) -> torch.Tensor:
        """The index (in ``names``) of the live tensor holding each id of ``v``."""
        return torch.searchsorted(self.starts, v.to(torch.int64), right=True) - 1


def _group(name: str) -> str:
    """The probe group of a live name: up to its first numeric part (a decoder layer), or ''."""
    m = re.match(r"(.*?\.\d+)(\.|$)", name)
    return m.group(1) if m else ""


def _probe(
    model, shapes: Mapping[str, Shape], groups: list[list[str]], expected: Mapping[str, Shape]
) -> dict[str, list[Placement]] | None:
    """Placements of every ``expected`` checkpoint tensor, from reverts of id tensors of the live
    tensors of each group in turn (each group its own id space); None unless the groups' outputs are
    exactly ``expected``, each once."""
    out: dict[str, list[Placement]] = {}
    for members in groups:
        ids = _Ids({k: shapes[k] for k in members})
        saved = _revert(model, {k: ids.of(k) for k in members})
        for name, t in saved.items():
            if name in out or name not in expected or tuple(expected[name]) != tuple(t.shape):
                return None
            out[name] = _explain(name, t, ids)
        del saved
    return out if out.keys() == expected.keys() else None


def _explain(name: str, t: torch.Tensor, ids: _Ids) -> list[Placement]:
    """Boxes of checkpoint tensor ``name`` (its probe values ``t``), each an affine view of one live
    tensor, covering it (found greedily: maximal runs along the dim that splits into fewest);
    :class:`UsageError` if there is none, or only a scatter (see ``MAX_BOXES``)."""
    shape = tuple(t.shape)
    if t.numel() == 0:
        return []
    whole = _affine(t, ids) if t.dtype == ids.dtype else None
    if whole is None and (t.dtype != ids.dtype or int(t.min()) < ids.first or int(t.max()) >= ids.end):
        raise UsageError(
            f"checkpoint tensor {name}{list(shape)} holds values that are no live element (the conversion computes, "
            "pads or casts them): it cannot be placed"
        )
    out: list[Placement] = []
    placed = 0

    def region(r: torch.Tensor, origin: tuple[int, ...], fit=None) -> None:
        if r.numel() == 0:
            return
        fit = fit or _affine(r, ids)
        if fit is not None:
            k, offset, stride = fit
            ext = tuple(r.shape)
            box: Box | None = None if ext == shape else tuple((a, a + n) for a, n in zip(origin, ext))
            out.append(Placement(name, ids.names[k], offset, None if stride == contiguous(ext) else stride, box))
            nonlocal placed
            placed += r.numel()
            if len(out) > MAX_BOXES and placed < MIN_MEAN_BOX * len(out):
                raise UsageError(
                    f"checkpoint tensor {name}{list(shape)} scatters live elements (more than {MAX_BOXES} strided "
                    f"boxes of fewer than {MIN_MEAN_BOX} elements on average): it cannot be placed"
                )
            return
        best = None
        for d in range(r.dim()):
            if r.shape[d] > 1:
                runs = _runs(r, d, ids)
                if len(runs) > 1 and (best is None or len(runs) < len(best[1])):
                    best = (d, runs)
        if best is None:
            box = [(a, a + n) for a, n in zip(origin, r.shape)]
            raise UsageError(
                f"checkpoint tensor {name}{list(shape)}: its box {box} is no strided view of one live tensor: "
                "it cannot be placed"
            )
        d, runs = best
        for a, b in runs:
            region(r.narrow(d, a, b - a), origin[:d] + (origin[d] + a,) + origin[d + 1 :])

    region(t, (0,) * t.dim(), whole)
    return out


def _affine(r: torch.Tensor, ids: _Ids) -> tuple[int, int, tuple[int, ...]] | None:
    """(live tensor index, element offset, strides) if ``r`` is an affine view of one live tensor
    (strides >= 0: its first and last elements are its least and greatest)."""
    shape, nd = tuple(r.shape), r.dim()
    first, last = int(r[(0,) * nd]), int(r[tuple(n - 1 for n in shape)])
    if first < ids.first or last >= ids.end:
        return None
    k = int(ids.owner(torch.tensor(first)))
    if last >= int(ids.ends[k]):
        return None
    dense = contiguous(shape)
    stride = []
    for d, n in enumerate(shape):
        step = int(r[(0,) * d + (1,) + (0,) * (nd - d - 1)]) - first if n > 1 else dense[d]
        if step < 0:
            return None
        stride.append(step)
    if last != first + sum((n - 1) * s for n, s in zip(shape, stride)):
        return None
    e = torch.full((1,) * nd, first, dtype=r.dtype)
    for d, (n, s) in enumerate(zip(shape, stride)):
        if n > 1:
            e = e + (torch.arange(n, dtype=r.dtype) * s).view([-1 if j == d else 1 for j in range(nd)])
    if not torch.equal(r, e.expand(shape)):
        return None
    return k, first - int(ids.starts[k]), tuple(stride)


def _runs(r: torch.Tensor, d: int, ids: _Ids) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` along dim ``d`` over which ``r`` steps by one constant stride within
    one live tensor (each slice on its own not checked)."""
    n = r.shape[d]
    x = r.movedim(d, 0).reshape(n, -1)
    own_lo, own_hi = ids.owner(x.min(1).values), ids.owner(x.max(1).values)
    own = torch.where(own_lo == own_hi, own_lo, -1)
    dx = x[1:] - x[:-1]
    step = dx[:, 0]
    go = (dx == step[:, None]).all(1) & (own[1:] == own[:-1]) & (own[1:] >= 0) & (step >= 0)
    runs, start, cur = [], 0, None
    for i, (ok, s) in enumerate(zip(go.tolist(), step.tolist())):
        if ok and (cur is None or s == cur):
            cur = s
        else:
            runs.append((start, i + 1))
            start, cur = i + 1, None
    runs.append((start, n))
    return runs
