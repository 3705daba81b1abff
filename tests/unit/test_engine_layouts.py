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
from engine_ref import (
    EXPERTS,
    HEADS,
    HIDDEN,
    KV_HEADS,
    bits,
    build,
    checkpoint,
    engine_mappings,
    fill,
    load_weights,
    ranks_for,
    rules_for,
)

from weightsync.errors import UsageError
from weightsync.torch.engines import Ranks, Shard, dense, from_config, qwen3_moe, sglang_ranks, vllm_ranks
from weightsync.torch.layout import box_slices, check_placement, excluder, live_view


# --- the checks ------------------------------------------------------------------------------------
def check_rank(family, engine, sd, ranks, num_experts=EXPERTS, placement="linear"):
    """One rank: the layout against the reference loader; returns its placements."""
    tensors = {n: (tuple(t.shape), str(t.dtype)) for n, t in sd.items()}
    rules = rules_for(family, engine, num_experts, placement)
    ref = build(family, engine, ranks, num_experts, placement)
    fill(ref)
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
    fill(applied)
    mine = dict(applied.named_parameters())
    covered = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in live.items()}
    for p in plan.placements:
        shape = tuple(sd[p.source].shape)
        check_placement(p, shape, live[p.dest])
        box = sd[p.source][box_slices(p.box, shape)]
        view = live_view(live[p.dest].detach().reshape(-1), p, shape)
        assert torch.equal(bits(view), bits(box.to(view.dtype))), f"{p.source} -> {p.dest}"
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
        assert torch.equal(bits(mine[n].data), bits(live[n].data)), n  # the layout gives the reference's model
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
    scales = {  # fp8 block scales are not laid out like their weights: no stacked or expert rule takes them
        "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.zeros(1, 1),
        "model.layers.0.mlp.experts.1.up_proj.weight_scale_inv": torch.zeros(1, 1),
    }
    with pytest.raises(UsageError, match=r"2 checkpoint tensor\(s\) match no rule \(model.layers.0.mlp.experts.1"):
        rules_for("qwen3_moe", "vllm").plan(_tensors(checkpoint("qwen3_moe") | scales))


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
