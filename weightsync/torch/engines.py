"""vLLM and SGLang parameter layouts as a few declarative rules, written the way those engines
write them, turned into a :class:`~weightsync.torch.layout.Layout` for one rank::

    rules = qwen3_moe("vllm", num_heads=32, num_kv_heads=4, num_experts=128)
    layout = rules.layout(vllm_ranks(tp_rank=1, tp_size=4, enable_expert_parallel=True))

A rule set says what the engine's ``load_weights`` does with each checkpoint tensor: fuse it into
another parameter (``stacked``, the entries of the engine's ``stacked_params_mapping``), stack it
into the routed experts (``experts``, what ``FusedMoE.make_expert_params_mapping`` lists), or load
it under its own name into a column-, row- or vocab-parallel or replicated parameter (fnmatch
patterns over the engine's parameter names). :class:`Ranks` says which slice one process holds.
The rules are read from the engines' code (their main branches; nothing copied):

- vLLM ``model_executor/models/{llama,qwen3_moe,deepseek_v2}.py`` ``load_weights``: the stacked
  entries, their shard ids (``q``/``k``/``v``; ``gate_proj`` 0, ``up_proj`` 1; ``q_a_proj`` 0,
  ``kv_a_proj_with_mqa`` 1), experts matched before the stacked entries, ``rotary_emb.inv_freq``
  skipped. SGLang ``srt/models/{llama,qwen3_moe,deepseek_v2}.py`` use the same entries (DeepSeek's
  fused parameter is ``fused_qkv_a_proj_with_mqa``, q_a rows then kv_a rows).
- ``layers/linear.py``: ``ColumnParallelLinear`` narrows dim 0 (``output_dim``) at
  ``tp_rank * shard``; ``RowParallelLinear`` dim 1 (``input_dim``), its bias whole;
  ``MergedColumnParallelLinear`` puts shard ``i`` at ``sum(output_sizes[:i]) // tp`` and takes its
  ``tp_rank`` slice; ``QKVParallelLinear`` holds ``num_heads // tp`` q heads, then k, then v, each
  ``max(1, num_kv_heads // tp)`` heads, the k/v of rank ``r`` from kv shard ``r // replicas``
  (``replicas = tp // num_kv_heads`` when ``tp >= num_kv_heads``); ``ReplicatedLinear`` whole.
- ``layers/fused_moe/layer.py`` ``FusedMoE``: ``w13_weight`` [E_local, 2 I/tp, H] holds w1
  (``gate_proj``) in its first half and w3 (``up_proj``) in its second, ``w2_weight``
  [E_local, H, I/tp] holds ``down_proj`` (``SHARD_ID_TO_SHARDED_DIM``: w1, w3 dim 0, w2 dim 1);
  vLLM ``determine_expert_map`` gives EP rank ``r`` experts ``r*base + min(r, rem)`` onwards
  (``linear``) or ``r, r+ep, ...`` (``round_robin``); SGLang requires ``E % ep == 0`` and gives
  rank ``r`` experts ``[r E/ep, (r+1) E/ep)``.
- ``layers/vocab_parallel_embedding.py`` ``VocabParallelEmbedding``/``ParallelLMHead``: the vocab
  padded to a multiple of 64 (``pad_vocab_size``), rank ``r`` holds rows
  ``[r V_pad/tp, (r+1) V_pad/tp)``; the rows past the checkpoint's vocab are zero-filled padding.
- vLLM ``FusedMoEParallelConfig.make`` and SGLang ``parallel_state.initialize_model_parallel``:
  which TP/EP rank a process is for the experts (:func:`vllm_ranks`, :func:`sglang_ranks`).

What a layout cannot express is refused or named in docs/ENGINES.md: tensors an engine derives
after loading (``process_weights_after_loading``: DeepSeek MLA's absorbed ``kv_b_proj`` copies,
fp8 re-quantization, ROCm/CPU repacking), SGLang's transposed triton-kernel experts, fused shared
experts, pipeline parallelism."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from weightsync.errors import UsageError
from weightsync.torch.layout import Layout, Placement, contiguous, excluder

Shape = tuple[int, ...]
StoreTensors = Mapping[str, tuple[Shape, str]]
ENGINES = ("vllm", "sglang")
DEFAULT_VOCAB_PADDING = 64  # vLLM / SGLang DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a group of ``size`` processes."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise UsageError(f"a rank must be in 0..size-1 of a size >= 1, got rank {self.rank} of {self.size}")


@dataclass(frozen=True)
class Ranks:
    """Which slice of the model one engine process holds: ``tp`` shards the dense layers, ``moe_tp``
    the experts' intermediate dim, ``ep`` says which experts it holds."""

    tp: Shard = Shard()
    moe_tp: Shard = Shard()
    ep: Shard = Shard()


def vllm_ranks(
    tp_rank: int = 0, tp_size: int = 1, *, dp_rank: int = 0, dp_size: int = 1, enable_expert_parallel: bool = False
) -> Ranks:
    """vLLM's ranks (``FusedMoEParallelConfig.make``): the experts are sharded over TP x DP
    flattened (rank ``dp_rank * tp_size + tp_rank``); with ``--enable-expert-parallel`` (and more
    than one device) that flattened group holds whole experts instead (MoE TP 1)."""
    flat = Shard(dp_rank * tp_size + tp_rank, dp_size * tp_size)
    if enable_expert_parallel and flat.size > 1:
        return Ranks(Shard(tp_rank, tp_size), Shard(), flat)
    return Ranks(Shard(tp_rank, tp_size), flat, Shard())


def sglang_ranks(tp_rank: int = 0, tp_size: int = 1, *, ep_size: int = 1) -> Ranks:
    """SGLang's ranks (``initialize_model_parallel``): ``moe_tp_size = tp_size // ep_size``; TP
    rank ``r`` is MoE-EP rank ``r // moe_tp_size`` and MoE-TP rank ``r % moe_tp_size``."""
    if ep_size < 1 or tp_size % ep_size:
        raise UsageError(f"SGLang needs --ep-size to divide --tp-size, got ep {ep_size}, tp {tp_size}")
    moe_tp = tp_size // ep_size
    return Ranks(Shard(tp_rank, tp_size), Shard(tp_rank % moe_tp, moe_tp), Shard(tp_rank // moe_tp, ep_size))


@dataclass(frozen=True)
class Experts:
    """Routed experts as ``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name,
    ckpt_down_proj_name, ckpt_up_proj_name, num_experts)`` lists them: a checkpoint name holding
    ``experts.{e}.{gate_proj}.`` becomes ``experts.w13_...`` (shard w1, the first half of dim 1),
    ``experts.{e}.{up_proj}.`` the same parameter (w3, the second half), ``experts.{e}.{down_proj}.``
    ``experts.w2_...`` (w2, its input dim sharded). ``placement``: which experts an EP rank holds
    (vLLM's ``--expert-placement-strategy``: ``linear`` or ``round_robin``); ``even``: refuse an
    expert count that the EP size does not divide (SGLang)."""

    num_experts: int
    gate_proj: str = "gate_proj"
    down_proj: str = "down_proj"
    up_proj: str = "up_proj"
    placement: str = "linear"
    even: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise UsageError(f"num_experts must be positive, got {self.num_experts}")
        if self.placement not in ("linear", "round_robin"):
            raise UsageError(f"expert placement is linear or round_robin, not {self.placement!r}")

    def local(self, ep: Shard) -> list[int]:
        """The global expert ids EP rank ``ep`` holds, in the order of its local index."""
        e, n = self.num_experts, ep.size
        if self.even and e % n:
            raise UsageError(f"{e} experts do not divide over {n} expert-parallel ranks")
        if self.placement == "round_robin":
            return list(range(ep.rank, e, n))
        base, rem = divmod(e, n)
        start = ep.rank * base + min(ep.rank, rem)
        return list(range(start, start + base + (ep.rank < rem)))

    def pattern(self) -> re.Pattern:
        """Matches the ``experts.{e}.{proj}.`` part of a checkpoint name (group 1: e, group 2: proj)."""
        projs = "|".join(re.escape(p) for p in (self.gate_proj, self.down_proj, self.up_proj))
        return re.compile(rf"experts\.(\d+)\.({projs})\.")


@dataclass(frozen=True)
class Padding:
    """Live elements no checkpoint element lands in: the ``shape`` block (contiguous, row-major)
    starting at element ``offset`` of live tensor ``dest``, which the engine fills itself."""

    dest: str
    offset: int
    shape: Shape


@dataclass
class EnginePlan:
    """One rank's layout for one version: the placements, the shape of every live tensor they
    reach, the padding the engine fills itself, and the store tensors this rank holds none of."""

    placements: list[Placement] = field(default_factory=list)
    shapes: dict[str, Shape] = field(default_factory=dict)
    padding: list[Padding] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise UsageError(f"{what}: {n} does not divide by {parts} (tensor-parallel size)")
    return n // parts


@dataclass(frozen=True)
class EngineRules:
    """One engine's rules for one model family (see the module doc).

    ``stacked``: ``(param_name, shard_name, shard_id)`` entries as in the engine's
    ``stacked_params_mapping``: a checkpoint name containing ``shard_name`` loads into the name with
    it replaced by ``param_name``; string ids ``q``/``k``/``v`` fill a ``QKVParallelLinear``
    (``num_heads``, ``num_kv_heads`` needed), integer ids a ``MergedColumnParallelLinear`` in id
    order. ``experts``: the routed experts (:class:`Experts`), matched first. Both take names ending
    in ``.weight`` (stacked also ``.bias``): quantization scales are not laid out like their
    weights and match no rule unless one is written for them. Every other name loads
    under itself, into a parameter matching (first match wins) ``vocab``, ``row``, ``column`` or
    ``replicated``; ``skip``: checkpoint names the engine never loads. A fused parameter matching
    ``replicated`` is not sharded (vLLM's ``disable_tp``). ``padding``: live tensors whose unplaced
    elements are the engine's padding (the vocab rows past the checkpoint's); unplaced elements
    anywhere else are an error, as is a checkpoint name no rule covers."""

    name: str
    stacked: tuple[tuple[str, str, str | int], ...] = ()
    experts: Experts | None = None
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    padding: tuple[str, ...] = ()
    num_heads: int | None = None
    num_kv_heads: int | None = None
    vocab_padding: int = DEFAULT_VOCAB_PADDING

    def __post_init__(self) -> None:
        for entry in self.stacked:
            if len(entry) != 3 or not entry[0] or not entry[1]:
                raise UsageError(f"a stacked entry is (param_name, shard_name, shard_id), got {entry!r}")
            if not (entry[2] in ("q", "k", "v") or (type(entry[2]) is int and entry[2] >= 0)):
                raise UsageError(f"shard id {entry[2]!r} of {entry[0]}: q, k, v or an index >= 0")
        for field_name in ("column", "row", "vocab", "replicated", "skip", "padding"):
            if isinstance(getattr(self, field_name), str):
                raise UsageError(f"{field_name} takes a tuple of patterns, not a string")

    def with_replicated(self, *patterns: str) -> EngineRules:
        """These rules with more replicated patterns (e.g. a model's router or extra norms)."""
        return replace(self, replicated=(*self.replicated, *patterns))

    # -- the layout -------------------------------------------------------------------------------
    def layout(self, ranks: Ranks = Ranks()) -> Layout:
        """The :class:`Layout` of the rank ``ranks`` says: placements computed per version (every
        error of :meth:`plan` is raised before anything is written), with the live shapes they imply
        (a model tensor of another shape refuses the version, as the engine's loader would), the
        skipped names and the experts held elsewhere excluded, the padding declared."""
        exclude = list(self.skip)
        if self.experts is not None:
            held = set(self.experts.local(ranks.ep))
            exclude += [
                f"*experts.{e}.{p}.*"
                for e in range(self.experts.num_experts)
                if e not in held
                for p in (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)
            ]
        last: list = [None]  # (tensors, plan): the sink asks for placements and shapes of one version

        def plan(tensors: StoreTensors) -> EnginePlan:
            seen = last[0]
            if seen is None or seen[0] is not tensors:
                seen = last[0] = (tensors, self.plan(tensors, ranks))
            return seen[1]

        return Layout(
            lambda tensors: plan(tensors).placements,
            tuple(exclude),
            self.name,
            self.padding,
            live_shapes=lambda tensors: plan(tensors).shapes,
        )

    def plan(self, tensors: StoreTensors, ranks: Ranks = Ranks()) -> EnginePlan:
        """Rank ``ranks``' placements of a version holding ``tensors`` (``{name: (shape, dtype)}``),
        with the live shapes they imply. Raises :class:`UsageError` for a checkpoint name no rule
        covers, a dimension the parallel size does not divide, shards of one parameter that do not
        agree, or live elements no checkpoint element reaches outside the declared padding (a
        missing q/k/v, gate/up or expert names the tensor missing)."""
        out = EnginePlan()
        fused: dict[str, dict] = {}  # dest -> {"entries": its stacked entries, "src": {shard id: (source, shape)}}
        experts: dict[str, dict[int, dict]] = {}  # dest -> {slot 1|2|3 (w1, w2, w3): {global expert: (source, shape)}}
        expert_kind: dict[str, tuple[str, str]] = {}  # dest -> (w13|w2, the name with "{e}.{proj}" to fill)
        unruled: list[str] = []
        skip, styles = excluder(self.skip), [(s, excluder(getattr(self, s))) for s in ("vocab", "row", "column")]
        replicated = excluder(self.replicated)
        xp = self.experts.pattern() if self.experts else None
        held = set(self.experts.local(ranks.ep)) if self.experts else set()
        for name in sorted(tensors):
            shape = tuple(tensors[name][0])
            if skip(name):
                out.excluded.append(name)
                continue
            leaf = name.rpartition(".")[2]  # weights (and fused biases); a quantization scale needs a rule of its own
            m = xp.search(name) if xp and leaf == "weight" else None
            if m is not None:
                e, proj = int(m.group(1)), m.group(2)
                if e >= self.experts.num_experts:
                    raise UsageError(f"{name}: expert {e} of a model with {self.experts.num_experts} experts")
                w2 = proj == self.experts.down_proj
                dest = name.replace(m.group(0), "experts.w2_" if w2 else "experts.w13_")
                if e not in held:
                    out.excluded.append(name)
                    continue
                slot = 2 if w2 else (1 if proj == self.experts.gate_proj else 3)
                experts.setdefault(dest, {}).setdefault(slot, {})[e] = (name, shape)
                expert_kind[dest] = ("w2" if w2 else "w13", name[: m.start()] + "experts.{e}.{p}." + name[m.end() :])
                continue
            entry = next((s for s in self.stacked if s[1] in name), None) if leaf in ("weight", "bias") else None
            if entry is not None:
                dest = name.replace(entry[1], entry[0])
                group = fused.setdefault(dest, {"entries": [s for s in self.stacked if s[0] == entry[0]], "src": {}})
                if entry[2] in group["src"]:
                    raise UsageError(f"{name} and {group['src'][entry[2]][0]} both load into {dest} shard {entry[2]}")
                group["src"][entry[2]] = (name, shape)
                continue
            style = next((s for s, match in styles if match(name)), None)
            if style is None and not replicated(name):
                unruled.append(name)
                continue
            self._plain(out, name, shape, style or "replicated", ranks.tp)
        if unruled:
            raise UsageError(
                f"{self.name}: {len(unruled)} checkpoint tensor(s) match no rule ({', '.join(unruled[:3])}"
                f"{', ...' if len(unruled) > 3 else ''}): add them to stacked, column, row, vocab, replicated or skip"
            )
        for dest, group in fused.items():
            tp = Shard() if replicated(dest) else ranks.tp
            self._fused(out, dest, group["entries"], group["src"], tp)
        for dest, slots in experts.items():
            self._experts(out, dest, expert_kind[dest], slots, ranks)
        self._check_coverage(out, tensors)
        return out

    # -- one parameter each ---------------------------------------------------------------------
    def _plain(self, out: EnginePlan, name: str, shape: Shape, style: str, tp: Shard) -> None:
        """A checkpoint tensor loaded under its own name (vocab, row, column or replicated)."""
        if style == "replicated" or not shape or (style == "row" and len(shape) == 1):
            out.shapes[name] = shape
            out.placements.append(Placement(name, name))
            return
        if style == "column":
            n = _split(shape[0], tp.size, f"{name}{list(shape)} dim 0")
            live = (n, *shape[1:])
            _place(out, name, name, live, ((tp.rank * n, (tp.rank + 1) * n), *((0, d) for d in shape[1:])), (0,))
        elif style == "row":
            if len(shape) != 2:
                raise UsageError(f"{name}{list(shape)}: a row-parallel weight is 2-D")
            n = _split(shape[1], tp.size, f"{name}{list(shape)} dim 1")
            _place(out, name, name, (shape[0], n), ((0, shape[0]), (tp.rank * n, (tp.rank + 1) * n)), (0, 0))
        else:  # vocab: padded to a multiple of vocab_padding, then sharded by rows
            vocab = shape[0]
            padded = -(-vocab // self.vocab_padding) * self.vocab_padding
            per = _split(padded, tp.size, f"{name}{list(shape)}: the vocabulary padded to {padded} rows")
            start, stop = min(tp.rank * per, vocab), min((tp.rank + 1) * per, vocab)
            live = (per, *shape[1:])
            out.shapes[name] = live
            if stop > start:
                _place(out, name, name, live, ((start, stop), *((0, d) for d in shape[1:])), (0,))
            if per > stop - start:
                row = math.prod(shape[1:])
                out.padding.append(Padding(name, (stop - start) * row, (per - (stop - start), *shape[1:])))

    def _fused(self, out: EnginePlan, dest: str, entries, src: dict, tp: Shard) -> None:
        """Shards stacked into one parameter: QKV (ids q, k, v) or merged column (ids 0, 1, ...)."""
        ids = [e[2] for e in entries]
        missing = [f"{dest.replace(e[0], e[1])} (shard {e[2]})" for e in entries if e[2] not in src]
        if missing:
            raise UsageError(
                f"{dest} is fused from {len(ids)} checkpoint tensors; the version lacks {', '.join(missing)}: "
                "its rows would have no source"
            )
        shapes = {i: src[i][1] for i in ids}
        rest = {s[1:] for s in shapes.values()}
        if len(rest) != 1 or any(not s for s in shapes.values()):
            seen = ", ".join(f"{src[i][0]}{list(shapes[i])}" for i in ids)
            raise UsageError(f"{dest}: its shards disagree beyond dim 0: {seen}")
        (tail,) = rest
        cols = tuple((0, d) for d in tail)
        if set(ids) == {"q", "k", "v"}:
            rows = self._qkv_rows(dest, shapes, tp)
        elif all(type(i) is int for i in ids):
            rows, at = {}, 0
            for i in sorted(ids):
                n = _split(shapes[i][0], tp.size, f"{src[i][0]}{list(shapes[i])} dim 0")
                rows[i] = (tp.rank * n, n, at)
                at += n
        else:
            raise UsageError(f"{dest}: shard ids {ids} mix q/k/v with indices")
        live = (sum(n for _, n, _ in rows.values()), *tail)
        for i in ids:
            first, n, at = rows[i]
            _place(out, src[i][0], dest, live, ((first, first + n), *cols), (at, *(0 for _ in tail)))

    def _qkv_rows(self, dest: str, shapes: dict, tp: Shard) -> dict:
        """``QKVParallelLinear``: (first source row, rows, live row) of q, k and v on rank ``tp``."""
        if not self.num_heads or not self.num_kv_heads:
            raise UsageError(f"{self.name}: {dest} is a fused q/k/v; the rules need num_heads and num_kv_heads")
        heads, kv = self.num_heads, self.num_kv_heads
        if shapes["q"][0] % heads or shapes["k"][0] != shapes["v"][0] or shapes["k"][0] % kv:
            raise UsageError(
                f"{dest}: q{list(shapes['q'])}, k{list(shapes['k'])}, v{list(shapes['v'])} do not fit "
                f"{heads} heads and {kv} key/value heads"
            )
        head_dim = shapes["q"][0] // heads
        if shapes["k"][0] != kv * head_dim:
            raise UsageError(f"{dest}: k{list(shapes['k'])} is not {kv} heads of {head_dim} rows (q's head size)")
        q_local = _split(heads, tp.size, f"{dest}: {heads} attention heads")
        if tp.size >= kv:
            replicas = _split(tp.size, kv, f"{dest}: {kv} key/value heads replicated over the tensor-parallel ranks")
            kv_local, kv_shard = 1, tp.rank // replicas
        else:
            kv_local, kv_shard = _split(kv, tp.size, f"{dest}: {kv} key/value heads"), tp.rank
        q_rows, kv_rows = q_local * head_dim, kv_local * head_dim
        return {
            "q": (tp.rank * q_rows, q_rows, 0),
            "k": (kv_shard * kv_rows, kv_rows, q_rows),
            "v": (kv_shard * kv_rows, kv_rows, q_rows + kv_rows),
        }

    def _experts(self, out: EnginePlan, dest: str, kind: tuple[str, str], slots: dict, ranks: Ranks) -> None:
        """``FusedMoE``: this rank's experts stacked on dim 0 of ``w13`` (w1 then w3) or ``w2``."""
        which, template = kind
        local = self.experts.local(ranks.ep)
        want = (2,) if which == "w2" else (1, 3)
        names = {1: self.experts.gate_proj, 2: self.experts.down_proj, 3: self.experts.up_proj}
        missing = [template.format(e=e, p=names[s]) for s in want for e in local if e not in slots.get(s, {})]
        if missing:
            raise UsageError(
                f"{dest} stacks experts {local[0]}..{local[-1]} on this rank; the version lacks "
                f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}: their rows would have no source"
            )
        shapes = {slots[s][e][1] for s in want for e in local}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise UsageError(f"{dest}: its experts' tensors are not 2-D of one shape ({sorted(shapes)})")
        (shape,) = shapes
        mt = ranks.moe_tp
        if which == "w13":  # gate/up [I, H]: dim 0 sharded, w1 rows first, w3 second
            n = _split(shape[0], mt.size, f"{dest}: intermediate size {shape[0]}")
            live = (len(local), 2 * n, shape[1])
            for i, e in enumerate(local):
                for s, at in ((1, 0), (3, n)):
                    box = ((mt.rank * n, (mt.rank + 1) * n), (0, shape[1]))
                    _place(out, slots[s][e][0], dest, live, box, (at, 0), lead=(i,))
        else:  # down [H, I]: dim 1 sharded
            n = _split(shape[1], mt.size, f"{dest}: intermediate size {shape[1]}")
            live = (len(local), shape[0], n)
            for i, e in enumerate(local):
                box = ((0, shape[0]), (mt.rank * n, (mt.rank + 1) * n))
                _place(out, slots[2][e][0], dest, live, box, (0, 0), lead=(i,))

    def _check_coverage(self, out: EnginePlan, tensors: StoreTensors) -> None:
        """Every live element placed once, but the declared padding; padding elsewhere refused."""
        placed: dict[str, int] = {}
        for p in out.placements:
            placed[p.dest] = placed.get(p.dest, 0) + math.prod(p.extent(tuple(tensors[p.source][0])))
        padded = excluder(self.padding)
        undeclared = [
            f"{p.dest}{list(out.shapes[p.dest])} ({math.prod(p.shape)})" for p in out.padding if not padded(p.dest)
        ]
        if undeclared:
            raise UsageError(
                f"{', '.join(undeclared)}: elements past the checkpoint's vocabulary have no source on this rank; "
                f"declare the engine's padding (it zero-fills them) with padding=[...] or exclude the tensors"
            )
        for pad in out.padding:
            placed[pad.dest] = placed.get(pad.dest, 0) + math.prod(pad.shape)
        for dest, shape in out.shapes.items():
            if placed.get(dest, 0) != math.prod(shape):  # the rules above place each element once
                raise UsageError(f"{dest}{list(shape)}: {placed.get(dest, 0)} of its elements placed (a rule overlaps)")


def _place(
    out: EnginePlan, source: str, dest: str, live: Shape, box, start: tuple[int, ...], lead: tuple[int, ...] = ()
) -> None:
    """Place ``box`` of ``source`` at index ``lead + start`` of ``dest`` (contiguous, shape ``live``)."""
    known = out.shapes.setdefault(dest, live)
    if known != live:
        raise UsageError(f"{dest}: {source} implies shape {list(live)}, another of its shards {list(known)}")
    strides = contiguous(live)
    offset = sum(i * s for i, s in zip((*lead, *start), strides))
    extent = tuple(b - a for a, b in box)
    stride = strides[len(lead) :]
    out.placements.append(Placement(source, dest, offset, None if stride == contiguous(extent) else stride, tuple(box)))


# --- presets: the rules of the model families both engines ship ---------------------------------
LLAMA_STACKED: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # VocabParallelEmbedding, ParallelLMHead
NORMS = ("*norm.weight",)  # RMSNorm: the layer norms, model.norm, Qwen3's q_norm/k_norm, MLA's q_a/kv_a norms
SKIP = ("*rotary_emb.inv_freq", "*rotary_emb.cos_cached", "*rotary_emb.sin_cached")  # never loaded
ROW = ("*.o_proj.weight", "*.o_proj.bias", "*.down_proj.weight", "*.down_proj.bias")


def _engine(engine: str) -> str:
    if engine not in ENGINES:
        raise UsageError(f"engine is one of {', '.join(ENGINES)}, not {engine!r}")
    return engine


def _experts(engine: str, num_experts: int, placement: str) -> Experts:
    if engine == "sglang" and placement != "linear":
        raise UsageError("SGLang places experts linearly (contiguous ranges per EP rank)")
    return Experts(num_experts, placement=placement, even=engine == "sglang")


def dense(engine: str, *, num_heads: int, num_kv_heads: int, family: str = "llama") -> EngineRules:
    """Llama-style dense decoders (Llama, Mistral, Qwen2, Qwen3), whose parameter names vLLM and
    SGLang share: ``qkv_proj`` (QKV), ``gate_up_proj`` (merged column), ``o_proj``/``down_proj``
    (row), the embedding and LM head (vocab, padded), the norms replicated."""
    return EngineRules(
        name=f"{_engine(engine)}:{family}",
        stacked=LLAMA_STACKED,
        row=ROW,
        vocab=VOCAB,
        replicated=NORMS,
        skip=SKIP,
        padding=VOCAB,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )


def qwen3_moe(
    engine: str, *, num_heads: int, num_kv_heads: int, num_experts: int, placement: str = "linear"
) -> EngineRules:
    """Qwen3-MoE (and Qwen2-MoE): the dense rules, the routed experts stacked into
    ``mlp.experts.w13_weight``/``w2_weight``, the router ``mlp.gate`` replicated (Qwen2-MoE's
    ``shared_expert`` fused like a dense MLP, its ``shared_expert_gate`` replicated)."""
    base = dense(engine, num_heads=num_heads, num_kv_heads=num_kv_heads, family="qwen3_moe")
    moe = replace(base, experts=_experts(engine, num_experts, placement))
    return moe.with_replicated("*.mlp.gate.weight", "*.mlp.shared_expert_gate.weight")


def deepseek_v3(
    engine: str,
    *,
    num_experts: int,
    num_hidden_layers: int | None = None,
    num_nextn_predict_layers: int = 0,
    placement: str = "linear",
) -> EngineRules:
    """DeepSeek-V2/V3 with MLA and ``q_lora_rank`` set: ``q_a_proj`` and ``kv_a_proj_with_mqa``
    fused, unsharded, into ``fused_qkv_a_proj`` (SGLang: ``fused_qkv_a_proj_with_mqa``),
    ``q_b_proj``/``kv_b_proj`` column, ``o_proj`` row, the shared experts fused like a dense MLP,
    the routed ones stacked, the router and its ``e_score_correction_bias`` replicated. The
    multi-token-prediction layers past ``num_hidden_layers`` are skipped (loaded by the draft model).
    Both engines also derive absorbed copies of ``kv_b_proj`` after loading, which no layout reaches
    (docs/ENGINES.md)."""
    fused = "fused_qkv_a_proj" if _engine(engine) == "vllm" else "fused_qkv_a_proj_with_mqa"
    mtp = ()
    if num_hidden_layers is not None:
        mtp = tuple(f"model.layers.{num_hidden_layers + i}.*" for i in range(num_nextn_predict_layers))
    return EngineRules(
        name=f"{engine}:deepseek_v3",
        stacked=((fused, "q_a_proj", 0), (fused, "kv_a_proj_with_mqa", 1), *LLAMA_STACKED[3:]),
        experts=_experts(engine, num_experts, placement),
        column=("*.q_b_proj.weight", "*.kv_b_proj.weight"),
        row=ROW,
        vocab=VOCAB,
        replicated=(*NORMS, f"*.{fused}.weight", "*.mlp.gate.weight", "*.mlp.gate.e_score_correction_bias"),
        skip=(*SKIP, *mtp),
        padding=VOCAB,
    )


def from_config(engine: str, config: Mapping, *, placement: str = "linear") -> EngineRules:
    """The preset for a Hugging Face ``config.json`` (its ``model_type``; Llama, Mistral, Qwen2/3,
    Qwen2/3-MoE, DeepSeek-V2/V3 with ``q_lora_rank``)."""
    kind = config.get("model_type")
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        return dense(engine, num_heads=heads, num_kv_heads=kv, family=kind)
    if kind in ("qwen2_moe", "qwen3_moe"):
        return qwen3_moe(
            engine, num_heads=heads, num_kv_heads=kv, num_experts=config["num_experts"], placement=placement
        )
    if kind in ("deepseek_v2", "deepseek_v3") and config.get("q_lora_rank"):
        return deepseek_v3(
            engine,
            num_experts=config["n_routed_experts"],
            num_hidden_layers=config.get("num_hidden_layers"),
            num_nextn_predict_layers=config.get("num_nextn_predict_layers", 0),
            placement=placement,
        )
    raise UsageError(f"no preset for model_type {kind!r}: write the EngineRules (docs/ENGINES.md)")
