"""A reference inference engine for tests: torch modules with vLLM's and SGLang's parameter names,
per-rank shapes and ``weight_loader`` s written the slow obvious way (narrow the checkpoint tensor,
narrow the parameter, copy), a ``load_weights`` loop like the engines', and tiny checkpoints of
three model families (Llama/Qwen2-style dense, Qwen3-MoE, DeepSeek-V3 with MLA) to load into them.
Written from the engines' code (vLLM ``layers/linear.py``, ``fused_moe/layer.py``,
``vocab_parallel_embedding.py``, ``models/*.py``; SGLang's counterparts), independently of
weightsync.torch.engines, which the tests check against it."""

from __future__ import annotations

import torch
from torch import nn

from weightsync.torch.engines import EngineRules, Ranks, Shard, deepseek_v3, dense, qwen3_moe, sglang_ranks, vllm_ranks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 16, 8, 2, 4, 24, 100
EXPERTS, MOE_INTER = 4, 8
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 12, 8, 4, 2, 4
SENTINEL = {torch.bfloat16: -0x3F, torch.float32: -0x3F3F3F3F}  # bits (a NaN in bf16) no checkpoint value has


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


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def fill(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            bits(p.data).fill_(SENTINEL[p.dtype])
