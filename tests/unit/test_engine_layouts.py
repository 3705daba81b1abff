"""weightsync.torch.engines against a reference: torch modules with vLLM's and SGLang's parameter
names, per-rank shapes and ``weight_loader`` s written the slow obvious way (narrow the checkpoint
tensor, narrow the parameter, copy), filled by a ``load_weights`` loop like the engines'. For every
rank of tp 1, 2, 4 and ep 1, 2: each placement's live view equals its checkpoint box bit for bit,
every live element but the declared padding is placed exactly once, the layout applied to an empty
model gives the reference loader's model, and the ranks together place every checkpoint element."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from weightsync.errors import UsageError
from weightsync.torch.engines import (
    EngineRules,
    Ranks,
    Shard,
    deepseek_v3,
    dense,
    from_config,
    qwen3_moe,
    sglang_ranks,
    vllm_ranks,
)
from weightsync.torch.layout import box_slices, check_placement, excluder, live_view

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 16, 8, 2, 4, 24, 100
EXPERTS, MOE_INTER = 4, 8
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 12, 8, 4, 2, 4
SENTINEL = {torch.bfloat16: -0x3F, torch.float32: -0x3F3F3F3F}  # a NaN-free bit pattern no checkpoint value has


# --- the reference engine: layers like vLLM's / SGLang's, loaders the slow obvious way ----------
def _param(*shape, dtype=torch.bfloat16) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def default_weight_loader(param, loaded):
    param.data.copy_(loaded)


class Replicated(nn.Module):
    """ReplicatedLinear / RMSNorm: the whole tensor on every rank."""

    def __init__(self, *shape, dtype=torch.bfloat16):
        super().__init__()
        self.weight = _param(*shape, dtype=dtype)


class ColumnParallel(nn.Module):
    def __init__(self, inp, out, tp: Shard):
        super().__init__()
        self.tp = tp
        self.weight = _param(out // tp.size, inp)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded):
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))


class RowParallel(nn.Module):
    def __init__(self, inp, out, tp: Shard):
        super().__init__()
        self.tp = tp
        self.weight = _param(out, inp // tp.size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded):
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))


class MergedColumnParallel(nn.Module):
    """Shard i at sum(output_sizes[:i]) // tp, its tp_rank slice; disable_tp: unsharded."""

    def __init__(self, inp, output_sizes, tp: Shard):
        super().__init__()
        self.tp, self.output_sizes = tp, output_sizes
        self.weight = _param(sum(output_sizes) // tp.size, inp)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id: int):
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallel(nn.Module):
    def __init__(self, hidden, head_size, heads, kv_heads, tp: Shard, bias=False):
        super().__init__()
        self.tp, self.head_size = tp, head_size
        self.num_heads = heads // tp.size
        if tp.size >= kv_heads:
            self.num_kv_heads, self.replicas = 1, tp.size // kv_heads
        else:
            self.num_kv_heads, self.replicas = kv_heads // tp.size, 1
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.weight = _param(rows, hidden)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(rows)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id: str):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp.rank if shard_id == "q" else self.tp.rank // self.replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class VocabParallel(nn.Module):
    def __init__(self, vocab, hidden, tp: Shard, pad_to=64):
        super().__init__()
        padded = (vocab + pad_to - 1) // pad_to * pad_to
        per = padded // tp.size
        self.start, self.end = min(tp.rank * per, vocab), min((tp.rank + 1) * per, vocab)
        self.weight = _param(per, hidden)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded):
        n = self.end - self.start
        param.data[:n].copy_(loaded.narrow(0, self.start, n))
        param.data[n:].fill_(0)


def expert_map(engine: str, num_experts: int, ep: Shard, placement: str = "linear") -> list[int]:
    """Global expert -> local index (-1 elsewhere): vLLM determine_expert_map / SGLang FusedMoE."""
    out = [-1] * num_experts
    if engine == "sglang":
        assert num_experts % ep.size == 0
        n = num_experts // ep.size
        for i in range(n):
            out[ep.rank * n + i] = i
        return out
    base, rem = divmod(num_experts, ep.size)
    local = base + (1 if ep.rank < rem else 0)
    if placement == "linear":
        start = ep.rank * base + min(ep.rank, rem)
        for i in range(local):
            out[start + i] = i
    else:
        for i, e in enumerate(range(ep.rank, num_experts, ep.size)):
            out[e] = i
    return out


class FusedMoE(nn.Module):
    def __init__(self, engine, num_experts, hidden, inter, ranks: Ranks, placement="linear"):
        super().__init__()
        self.map = expert_map(engine, num_experts, ranks.ep, placement)
        self.moe_tp = ranks.moe_tp
        local = sum(1 for i in self.map if i >= 0)
        self.w13_weight = _param(local, 2 * inter // ranks.moe_tp.size, hidden)
        self.w2_weight = _param(local, hidden, inter // ranks.moe_tp.size)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, weight_name, shard_id, expert_id):
        local = self.map[expert_id]
        if local == -1:
            return
        expert_data = param.data[local]
        if shard_id == "w2":
            size = expert_data.shape[1]
            expert_data.copy_(loaded.narrow(1, self.moe_tp.rank * size, size))
        else:
            size = expert_data.shape[0] // 2
            loaded = loaded.narrow(0, self.moe_tp.rank * size, size)
            expert_data.narrow(0, 0 if shard_id == "w1" else size, size).copy_(loaded)


def make_expert_params_mapping(gate, down, up, num_experts):
    return [
        ("experts.w13_" if w in (gate, up) else "experts.w2_", f"experts.{e}.{w}.", e, shard)
        for e in range(num_experts)
        for shard, w in (("w1", gate), ("w2", down), ("w3", up))
    ]


def load_weights(model: nn.Module, weights, stacked, expert_mapping, skip=("rotary_emb.inv_freq",)):
    """The engines' load_weights loop (vLLM qwen3_moe.py, SGLang qwen3_moe.py)."""
    params = dict(model.named_parameters())
    for name, loaded in weights:
        if any(s in name for s in skip):
            continue
        for param_name, weight_name, shard_id in stacked:
            if weight_name not in name or "mlp.experts" in name:
                continue
            param = params[name.replace(weight_name, param_name)]
            param.weight_loader(param, loaded, shard_id)
            break
        else:
            for param_name, weight_name, expert_id, shard_id in expert_mapping:
                if weight_name not in name:
                    continue
                mapped = name.replace(weight_name, param_name)
                param = params[mapped]
                param.weight_loader(param, loaded, mapped, shard_id=shard_id, expert_id=expert_id)
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded)


# --- three model families, as the engines build them -------------------------------------------
LLAMA_STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def attention(tp: Shard, qkv_bias: bool) -> nn.Module:
    a = nn.Module()
    a.qkv_proj = QKVParallel(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp, bias=qkv_bias)
    a.o_proj = RowParallel(HEADS * HEAD_DIM, HIDDEN, tp)
    a.q_norm, a.k_norm = Replicated(HEAD_DIM), Replicated(HEAD_DIM)
    return a


def mlp(tp: Shard, inter=INTER) -> nn.Module:
    m = nn.Module()
    m.gate_up_proj = MergedColumnParallel(HIDDEN, [inter, inter], tp)
    m.down_proj = RowParallel(inter, HIDDEN, tp)
    return m


def mla(engine: str, tp: Shard) -> nn.Module:
    a = nn.Module()
    fused = MergedColumnParallel(HIDDEN, [Q_LORA, KV_LORA + ROPE], Shard())  # disable_tp / ReplicatedLinear
    setattr(a, "fused_qkv_a_proj" if engine == "vllm" else "fused_qkv_a_proj_with_mqa", fused)
    a.q_a_layernorm, a.kv_a_layernorm = Replicated(Q_LORA), Replicated(KV_LORA)
    a.q_b_proj = ColumnParallel(Q_LORA, HEADS * (NOPE + ROPE), tp)
    a.kv_b_proj = ColumnParallel(KV_LORA, HEADS * (NOPE + V_DIM), tp)
    a.o_proj = RowParallel(HEADS * V_DIM, HIDDEN, tp)
    return a


def build(family: str, engine: str, ranks: Ranks, num_experts=EXPERTS, placement="linear") -> nn.Module:
    tp = ranks.tp
    model, inner = nn.Module(), nn.Module()
    model.model = inner
    inner.embed_tokens = VocabParallel(VOCAB, HIDDEN, tp)
    inner.layers = nn.ModuleList()
    for i in range(2):
        layer = nn.Module()
        layer.input_layernorm, layer.post_attention_layernorm = Replicated(HIDDEN), Replicated(HIDDEN)
        if family == "deepseek":
            layer.self_attn = mla(engine, tp)
        else:
            layer.self_attn = attention(tp, qkv_bias=family == "qwen2")
        if family in ("qwen3_moe", "deepseek") and (family != "deepseek" or i == 1):
            m = nn.Module()
            m.gate = Replicated(num_experts, HIDDEN)
            if family == "deepseek":
                m.gate.e_score_correction_bias = _param(num_experts, dtype=torch.float32)
                m.shared_experts = mlp(tp, MOE_INTER)
            m.experts = FusedMoE(engine, num_experts, HIDDEN, MOE_INTER, ranks, placement)
            layer.mlp = m
        else:
            layer.mlp = mlp(tp)
        inner.layers.append(layer)
    inner.norm = Replicated(HIDDEN)
    model.lm_head = VocabParallel(VOCAB, HIDDEN, tp)
    return model


def checkpoint(family: str, num_experts=EXPERTS) -> dict[str, torch.Tensor]:
    """A Hugging Face style state dict of the family, random bf16 (fp32 router bias)."""
    g = torch.Generator().manual_seed(sum(map(ord, family)))
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)}
        if family == "deepseek":
            shapes |= {
                p + "self_attn.q_a_proj.weight": (Q_LORA, HIDDEN),
                p + "self_attn.kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, HIDDEN),
                p + "self_attn.q_a_layernorm.weight": (Q_LORA,),
                p + "self_attn.kv_a_layernorm.weight": (KV_LORA,),
                p + "self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
                p + "self_attn.kv_b_proj.weight": (HEADS * (NOPE + V_DIM), KV_LORA),
                p + "self_attn.o_proj.weight": (HIDDEN, HEADS * V_DIM),
            }
        else:
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                shapes[p + f"self_attn.{proj}_proj.weight"] = (rows * HEAD_DIM, HIDDEN)
                if family == "qwen2":
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (rows * HEAD_DIM,)
            shapes |= {
                p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                p + "self_attn.q_norm.weight": (HEAD_DIM,),
                p + "self_attn.k_norm.weight": (HEAD_DIM,),
                p + "self_attn.rotary_emb.inv_freq": (HEAD_DIM // 2,),
            }
        moe = family == "qwen3_moe" or (family == "deepseek" and i == 1)
        if moe:
            shapes[p + "mlp.gate.weight"] = (num_experts, HIDDEN)
            for e in range(num_experts):
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.experts.{e}.{proj}_proj.weight"] = (MOE_INTER, HIDDEN)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (HIDDEN, MOE_INTER)
            if family == "deepseek":
                shapes |= {
                    p + "mlp.shared_experts.gate_proj.weight": (MOE_INTER, HIDDEN),
                    p + "mlp.shared_experts.up_proj.weight": (MOE_INTER, HIDDEN),
                    p + "mlp.shared_experts.down_proj.weight": (HIDDEN, MOE_INTER),
                }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                p + "mlp.up_proj.weight": (INTER, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, INTER),
            }
    if family == "deepseek":
        shapes["model.layers.2.eh_proj.weight"] = (HIDDEN, 2 * HIDDEN)  # the MTP layer, not loaded
    out = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    if family == "deepseek":
        out["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.randn(num_experts, generator=g)
    return out


def engine_mappings(family: str, engine: str, num_experts=EXPERTS):
    """The stacked and expert entries the engine's load_weights uses for the family."""
    stacked = list(LLAMA_STACKED)
    if family == "deepseek":
        fused = "fused_qkv_a_proj" if engine == "vllm" else "fused_qkv_a_proj_with_mqa"
        stacked = [(fused, "q_a_proj", 0), (fused, "kv_a_proj_with_mqa", 1), *LLAMA_STACKED[3:]]
    experts = (
        []
        if family in ("llama", "qwen2")
        else make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)
    )
    return stacked, experts


def rules_for(family: str, engine: str, num_experts=EXPERTS, placement="linear") -> EngineRules:
    if family in ("llama", "qwen2"):
        return dense(engine, num_heads=HEADS, num_kv_heads=KV_HEADS, family=family)
    if family == "qwen3_moe":
        return qwen3_moe(engine, num_heads=HEADS, num_kv_heads=KV_HEADS, num_experts=num_experts, placement=placement)
    return deepseek_v3(
        engine, num_experts=num_experts, num_hidden_layers=2, num_nextn_predict_layers=1, placement=placement
    )


def ranks_for(engine: str, tp: int, ep: int, rank: int) -> Ranks:
    if engine == "vllm":
        return vllm_ranks(rank, tp, enable_expert_parallel=ep > 1)
    return sglang_ranks(rank, tp, ep_size=ep)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _fill(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            _bits(p.data).fill_(SENTINEL[p.dtype])


# --- the checks ------------------------------------------------------------------------------------
def check_rank(family, engine, sd, ranks, num_experts=EXPERTS, placement="linear"):
    """One rank: the layout against the reference loader; returns its placements."""
    tensors = {n: (tuple(t.shape), str(t.dtype)) for n, t in sd.items()}
    rules = rules_for(family, engine, num_experts, placement)
    ref = build(family, engine, ranks, num_experts, placement)
    _fill(ref)
    stacked, experts = engine_mappings(family, engine, num_experts)
    ckpt = {n: t for n, t in sd.items() if not n.startswith("model.layers.2.")}  # vLLM loads the MTP layer apart
    load_weights(ref, ckpt.items(), stacked, experts)
    live = dict(ref.named_parameters())
    plan = rules.plan(tensors, ranks)
    layout = rules.layout(ranks)
    assert layout.for_store(tensors) == plan.placements
    assert plan.shapes == {n: tuple(p.shape) for n, p in live.items()}  # every live tensor, its engine shape
    placed, excluded = {p.source for p in plan.placements}, excluder(layout.exclude)
    assert all((n in placed) != excluded(n) for n in sd)  # each store tensor placed here or left alone

    applied = build(family, engine, ranks, num_experts, placement)
    _fill(applied)
    mine = dict(applied.named_parameters())
    covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in live.items()}
    for p in plan.placements:
        shape = tuple(sd[p.source].shape)
        check_placement(p, shape, live[p.dest])
        box = sd[p.source][box_slices(p.box, shape)]
        view = live_view(live[p.dest].detach().reshape(-1), p, shape)
        assert torch.equal(_bits(view), _bits(box.to(view.dtype))), f"{p.source} -> {p.dest}"
        live_view(mine[p.dest].data.reshape(-1), p, shape).copy_(box)
        index = torch.arange(live[p.dest].numel())
        live_view(covered[p.dest], p, shape).add_(1)
        assert live_view(index, p, shape).unique().numel() == math.prod(p.extent(shape))  # no element twice
    for pad in plan.padding:
        block = covered[pad.dest][pad.offset : pad.offset + math.prod(pad.shape)]
        assert (block == 0).all()
        block.fill_(1)
        assert (live[pad.dest].detach().reshape(-1)[pad.offset : pad.offset + math.prod(pad.shape)] == 0).all()
        mine[pad.dest].data.reshape(-1)[pad.offset : pad.offset + math.prod(pad.shape)].zero_()  # the engine's fill
    for n, c in covered.items():
        assert (c == 1).all(), f"{n}: {int((c == 0).sum())} elements unplaced, {int((c > 1).sum())} twice"
        assert torch.equal(_bits(mine[n].data), _bits(live[n].data)), n  # the layout gives the reference's model
    return plan


def check_union(sd, plans, skipped=("rotary_emb.inv_freq", "model.layers.2.")):
    """All ranks together place every checkpoint element (but those the engine never loads)."""
    seen = {n: torch.zeros(t.shape, dtype=torch.bool) for n, t in sd.items()}
    for plan in plans:
        for p in plan.placements:
            seen[p.source][box_slices(p.box, tuple(sd[p.source].shape))] = True
    for n, mask in seen.items():
        if any(s in n for s in skipped):
            assert not mask.any(), n
        else:
            assert mask.all(), f"{n}: {int((~mask).sum())} elements on no rank"


CASES = [
    (family, engine, tp, ep)
    for engine in ("vllm", "sglang")
    for family, tps, eps in (
        ("llama", (1, 2, 4), (1,)),
        ("qwen2", (1, 2, 4), (1,)),
        ("qwen3_moe", (1, 2, 4), (1, 2)),
        ("deepseek", (1, 2, 4), (1, 2)),
    )
    for tp in tps
    for ep in eps
    if ep <= tp
]


@pytest.mark.parametrize("family,engine,tp,ep", CASES)
def test_layout_matches_the_engine_loader(family, engine, tp, ep):
    sd = checkpoint(family)
    plans = [check_rank(family, engine, sd, ranks_for(engine, tp, ep, r)) for r in range(tp)]
    check_union(sd, plans)
    if tp == 4:  # rank 3 holds the last 4 of 100 vocab rows (padded to 128): 28 rows are padding
        assert [(p.dest, p.shape) for p in plans[3].padding] == [
            ("lm_head.weight", (28, HIDDEN)),
            ("model.embed_tokens.weight", (28, HIDDEN)),
        ]


@pytest.mark.parametrize("placement,ep", [("linear", 2), ("round_robin", 2), ("linear", 3), ("round_robin", 3)])
def test_vllm_uneven_and_round_robin_experts(placement, ep):
    """vLLM gives the first E % ep ranks one more expert (linear) or deals them out (round_robin);
    EP 3 as data parallel 3 (TP 1: the 128 padded vocab rows do not divide by 3)."""
    sd = checkpoint("qwen3_moe", num_experts=5)
    plans = [
        check_rank(
            "qwen3_moe", "vllm", sd, vllm_ranks(0, 1, dp_rank=r, dp_size=ep, enable_expert_parallel=True), 5, placement
        )
        for r in range(ep)
    ]
    check_union(sd, plans)


def test_vllm_data_parallel_flattens_moe_tp():
    """Without EP, vLLM shards the experts over TP x DP flattened; the dense layers over TP only."""
    assert vllm_ranks(1, 2, dp_rank=1, dp_size=2) == Ranks(Shard(1, 2), Shard(3, 4), Shard(0, 1))
    assert vllm_ranks(1, 2, dp_rank=1, dp_size=2, enable_expert_parallel=True) == Ranks(
        Shard(1, 2), Shard(), Shard(3, 4)
    )
    assert sglang_ranks(3, 4, ep_size=2) == Ranks(Shard(3, 4), Shard(1, 2), Shard(1, 2))
    sd = checkpoint("qwen3_moe")
    plans = [check_rank("qwen3_moe", "vllm", sd, vllm_ranks(r % 2, 2, dp_rank=r // 2, dp_size=2)) for r in range(4)]
    check_union(sd, plans)


def test_from_config_picks_the_preset():
    cfg = {"model_type": "qwen3_moe", "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_experts": 4}
    assert from_config("sglang", cfg) == qwen3_moe("sglang", num_heads=HEADS, num_kv_heads=KV_HEADS, num_experts=4)
    ds = {"model_type": "deepseek_v3", "q_lora_rank": 12, "n_routed_experts": 4, "num_hidden_layers": 2}
    assert from_config("vllm", ds | {"num_nextn_predict_layers": 1}) == rules_for("deepseek", "vllm")
    with pytest.raises(UsageError, match="no preset for model_type 'gpt2'"):
        from_config("vllm", {"model_type": "gpt2"})
    with pytest.raises(UsageError, match="engine is one of vllm, sglang"):
        dense("trt", num_heads=1, num_kv_heads=1)


# --- refusals --------------------------------------------------------------------------------------
def _tensors(sd):
    return {n: (tuple(t.shape), "BF16") for n, t in sd.items()}


def test_a_checkpoint_tensor_no_rule_covers_is_refused():
    sd = checkpoint("llama") | {"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(UsageError, match=r"1 checkpoint tensor\(s\) match no rule \(model.layers.0.mlp.extra_proj"):
        rules_for("llama", "vllm").plan(_tensors(sd))


@pytest.mark.parametrize(
    "family,keep,message",
    [
        ("llama", "lm_head", r"lm_head.weight\[100, 16\]: the vocabulary padded to 128 rows: 128 does not divide by 3"),
        ("llama", "layers.0.self_attn.v_proj", "8 attention heads: 8 does not divide by 3"),
        ("llama", "o_proj", r"o_proj.weight\[16, 32\] dim 1: 32 does not divide by 3"),
        ("deepseek", "kv_b_proj", r"kv_b_proj.weight\[64, 8\] dim 0: 64 does not divide by 3"),
        ("qwen3_moe", "experts", "intermediate size 8: 8 does not divide by 3"),
    ],
)
def test_a_shape_the_parallel_size_does_not_divide_is_refused(family, keep, message):
    keep = (keep, keep.replace("v_proj", "q_proj"), keep.replace("v_proj", "k_proj"))  # q/k/v come together
    tensors = {n: s for n, s in _tensors(checkpoint(family)).items() if any(k in n for k in keep)}
    with pytest.raises(UsageError, match=message):
        rules_for(family, "vllm").plan(tensors, vllm_ranks(0, 3))


def test_sglang_refuses_experts_the_ep_size_does_not_divide():
    with pytest.raises(UsageError, match="5 experts do not divide over 2 expert-parallel ranks"):
        rules_for("qwen3_moe", "sglang", num_experts=5).plan(
            _tensors(checkpoint("qwen3_moe", 5)), sglang_ranks(0, 2, ep_size=2)
        )


def test_a_missing_expert_is_refused_by_name():
    sd = checkpoint("qwen3_moe")
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"]
    rules = rules_for("qwen3_moe", "sglang")
    rules.plan(_tensors(sd), sglang_ranks(0, 2, ep_size=2))  # rank 0 holds experts 0 and 1: unaffected
    with pytest.raises(
        UsageError,
        match=r"w13_weight stacks experts 2..3 on this rank; the version lacks "
        r"model.layers.1.mlp.experts.2.up_proj.weight",
    ):
        rules.plan(_tensors(sd), sglang_ranks(1, 2, ep_size=2))


def test_a_missing_shard_of_a_fused_parameter_is_refused():
    sd = checkpoint("llama")
    del sd["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(
        UsageError,
        match=r"qkv_proj.weight is fused from 3 checkpoint tensors; the version lacks "
        r"model.layers.0.self_attn.v_proj.weight \(shard v\)",
    ):
        rules_for("llama", "vllm").plan(_tensors(sd))


def test_padding_must_be_declared():
    from dataclasses import replace

    rules = replace(rules_for("llama", "vllm"), padding=())  # 100 rows padded to 128, even on one rank
    with pytest.raises(
        UsageError,
        match=r"lm_head.weight\[128, 16\] \(448\), model.embed_tokens.weight\[128, 16\] \(448\): elements past the "
        r"checkpoint's vocabulary have no source on this rank; declare the engine's padding",
    ):
        rules.plan(_tensors(checkpoint("llama")), vllm_ranks(0, 1))
