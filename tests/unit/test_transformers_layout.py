"""Layouts derived from transformers' conversion mapping (weightsync.torch.transformers): for tiny
random models of the families users train, saved with ``save_pretrained`` and loaded back in
bf16, every placement holds bit for bit (store box cast to the live dtype == live view, compared as
integer views), every checkpoint tensor is placed whole and every live element has a source."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tiny_models import COMMON, config  # noqa: E402
from transformers.core_model_loading import ConversionOps, WeightConverter  # noqa: E402

from weightsync.errors import UsageError  # noqa: E402
from weightsync.torch.layout import Layout, box_slices, check_placement, live_view  # noqa: E402
from weightsync.torch.transformers import MAX_BOXES, layout  # noqa: E402

FAMILIES = ["llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]


def build(family: str, **over) -> torch.nn.Module:
    """A model of ``family`` in bf16 (with what it keeps in fp32), every element random and distinct
    from its neighbours (so that a misplaced box cannot match by chance)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family, **over), dtype=torch.bfloat16)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn(t.shape, dtype=torch.float32))
    return model


def save(model, path: Path) -> dict[str, torch.Tensor]:
    """``save_pretrained`` to ``path`` (safetensors), and what it wrote."""
    model.save_pretrained(path)
    return read(path)


def saved(family: str, path: Path) -> Path:
    """``path``, holding a random model of ``family`` as save_pretrained writes it."""
    save(build(family), path)
    return path


def read(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def load(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The elements as signed integers of their width (bit patterns, not values)."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check(model, lay: Layout, store: dict[str, torch.Tensor]) -> list:
    """Every placement bit for bit, every store tensor fully placed, every live element sourced
    (tied names by any of their aliases, each source agreeing); the placements."""
    live = model.state_dict()
    placements = lay.for_store({k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in store.items()})
    placed = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in store.items()}
    covered = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in live.items()}
    for p in placements:
        src, dst = store[p.source], live[p.dest]
        shape = tuple(src.shape)
        check_placement(p, shape, dst)
        box = box_slices(p.box, shape)
        view = live_view(dst.contiguous().view(-1), p, shape)
        assert torch.equal(bits(view), bits(src[box].to(dst.dtype))), p
        assert not placed[p.source][box].any(), f"{p.source} placed twice"
        placed[p.source][box] = True
        covered[p.dest][live_view(torch.arange(dst.numel()), p, shape).reshape(-1)] = True
    unplaced = [k for k, m in placed.items() if not m.all()]
    assert not unplaced, f"store tensors not (fully) placed: {unplaced}"
    views: dict[tuple, list[str]] = {}  # tied names view the same memory
    for k, t in live.items():
        views.setdefault((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), []).append(k)
    for names in views.values():
        assert torch.stack([covered[k] for k in names]).any(0).all(), f"live elements without a source: {names}"
    return placements


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoint_save_pretrained_writes_places_bit_for_bit(family, tmp_path):
    built = build(family)
    store = save(built, tmp_path)
    loaded = load(tmp_path)
    for model in (loaded, built):  # from_pretrained keeps the conversions it used; a built model gets the default
        lay = layout(model)
        assert lay.exclude == ()
        check(model, lay, store)


def test_experts_are_boxes_of_the_fused_tensors(tmp_path):
    model = load(saved("qwen3_moe", tmp_path))
    live = model.state_dict()
    lay = layout(model)
    n = "model.layers.1.mlp.experts"
    E, two_i, H = live[f"{n}.gate_up_proj"].shape
    half = ((two_i // 2, H), "bfloat16")
    gate, up = lay.for_store({f"{n}.3.gate_proj.weight": half, f"{n}.3.up_proj.weight": half})
    assert (gate.dest, gate.offset, gate.stride, gate.box) == (f"{n}.gate_up_proj", 3 * two_i * H, None, None)
    assert (up.dest, up.offset) == (f"{n}.gate_up_proj", 3 * two_i * H + two_i // 2 * H)


def test_mixtral_renames_block_sparse_moe(tmp_path):
    model = load(saved("mixtral", tmp_path))
    (p,) = layout(model).for_store({"model.layers.0.block_sparse_moe.gate.weight": ((4, 32), "bfloat16")})
    assert (p.dest, p.box) == ("model.layers.0.mlp.gate.weight", None)


def test_tied_weights_place_under_either_name(tmp_path):
    store = save(build("llama"), tmp_path)
    assert "lm_head.weight" not in store  # save_pretrained drops the tied copy
    model = load(tmp_path)
    lay = layout(model)
    check(model, lay, store)
    both = dict(store, **{"lm_head.weight": store["model.embed_tokens.weight"]})
    dests = {p.source: p.dest for p in check(model, lay, both)}
    assert dests["lm_head.weight"] == "lm_head.weight"
    assert model.state_dict()["lm_head.weight"].data_ptr() == model.state_dict()["model.embed_tokens.weight"].data_ptr()


def test_deepseek_v3_fp32_router_from_a_bf16_store(tmp_path):
    """DeepSeek-V3 keeps the router (``gate.weight``, ``e_score_correction_bias``) in fp32 even in a
    bf16 model, and save_pretrained writes them so; a trainer that exports every tensor in bf16
    gives a store in bf16: from_pretrained casts it up, and the layout places it with that cast."""
    save(build("deepseek_v3"), tmp_path)
    f = tmp_path / "model.safetensors"
    written = read(tmp_path)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert written[bias].dtype == torch.float32
    save_file({k: v.to(torch.bfloat16) for k, v in written.items()}, f, metadata={"format": "pt"})
    store = read(tmp_path)
    model = load(tmp_path)
    assert store[bias].dtype == torch.bfloat16 and model.state_dict()[bias].dtype == torch.float32
    placements = check(model, layout(model), store)
    assert [p.dest for p in placements if p.source == bias] == [bias]


def test_live_format_names_place_whole(tmp_path):
    model = load(saved("qwen3_moe", tmp_path))
    live = {k: v.clone() for k, v in model.state_dict().items()}
    placements = check(model, layout(model), live)
    assert all(p.source == p.dest and p.box is None and p.offset == 0 for p in placements)


def test_after_adamw_steps_the_saved_checkpoint_still_places(tmp_path):
    model = load(saved("qwen3_moe", tmp_path / "0"))
    lay = layout(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    model.train()
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(bits(before[fused]), bits(model.state_dict()[fused]))
    check(model, lay, save(model, tmp_path / "1"))


class _Pad(ConversionOps):
    """A conversion that resizes: the checkpoint holds one more column (zeros)."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        t = next(iter(input_dict.values()))
        t = t[0] if isinstance(t, list) else t
        return {target_patterns[0]: torch.nn.functional.pad(t, (0, 1))}

    @property
    def reverse_op(self):
        return _Pad()


class _Shuffle(ConversionOps):
    """A conversion that scatters elements: a fixed random permutation of all of them."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        t = next(iter(input_dict.values()))
        t = t[0] if isinstance(t, list) else t
        perm = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(0))
        return {target_patterns[0]: t.reshape(-1)[perm].view(t.shape)}

    @property
    def reverse_op(self):
        return _Shuffle()


@pytest.mark.parametrize(("op", "says"), [(_Pad(), "no live element"), (_Shuffle(), "scatters live elements")])
def test_a_conversion_that_is_no_view_is_refused(op, says):
    # down_proj [32, 2 * MAX_BOXES / 32]: a shuffle of it would need about 2 * MAX_BOXES boxes
    model = build("llama", intermediate_size=2 * MAX_BOXES // COMMON["hidden_size"])
    model._weight_conversions = [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", operations=[op])]
    with pytest.raises(UsageError, match=rf"model\.layers\.0\.mlp\.down_proj\.weight.*{says}"):
        layout(model)


def test_a_resized_live_tensor_is_refused_by_name(tmp_path):
    store = save(build("qwen3"), tmp_path)
    model = load(tmp_path)
    model.resize_token_embeddings(80)
    lay = layout(model)
    with pytest.raises(UsageError, match=r"(lm_head|embed_tokens)\.weight\[64, 32\]: .*as \[80, 32\]"):
        lay.for_store({k: (tuple(v.shape), "bfloat16") for k, v in store.items()})


def test_exclude_is_a_list_of_patterns():
    with pytest.raises(UsageError, match="list of patterns"):
        layout(build("llama"), exclude="lm_head*")
    assert layout(build("llama"), exclude=["lm_head*"]).exclude == ("lm_head*",)


def test_fused_interleaved_permuted_and_transposed_checkpoints_place_as_boxes(tmp_path):
    """transformers' own ops, on a model given a mapping of them: the checkpoint holds q, k and v
    fused (three boxes of three live tensors), gate_proj with its rows interleaved per head for
    rope (boxes of two rows: a box is contiguous in the store tensor), up_proj as halves of a live
    tensor interleaved along dim 0 (two boxes of stride 2) and down_proj transposed (one box,
    permuted strides)."""
    from transformers.core_model_loading import Interleave, PermuteForRope, Split, Transpose

    model = build("llama")
    qkv = [f"self_attn.{x}_proj.weight" for x in "qkv"]
    model._weight_conversions = [
        WeightConverter("self_attn.qkv_proj.weight", qkv, operations=[Split(dim=0)]),
        WeightConverter("mlp.gate_proj.weight", "mlp.gate_proj.weight", operations=[PermuteForRope()]),
        WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", operations=[Interleave(dim=0, inverse=True)]),
        WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", operations=[Transpose(0, 1)]),
    ]
    store = save(model, tmp_path)
    assert "model.layers.1.self_attn.qkv_proj.weight" in store
    by_source: dict[str, list] = {}
    for p in check(model, layout(model), store):
        if p.source.startswith("model.layers.1."):
            by_source.setdefault(p.source.removeprefix("model.layers.1."), []).append(p)
    H, inter, heads = COMMON["hidden_size"], COMMON["intermediate_size"], COMMON["num_attention_heads"]
    assert [p.dest.split(".")[-2] for p in by_source["self_attn.qkv_proj.weight"]] == ["q_proj", "k_proj", "v_proj"]
    half_head = inter // heads // 2
    assert [(p.box[0], p.stride) for p in by_source["mlp.gate_proj.weight"]] == [
        ((r, r + 2), (half_head * H, 1)) for r in range(0, inter, 2)
    ]
    assert [(p.box[0], p.offset, p.stride) for p in by_source["mlp.up_proj.weight"]] == [
        ((0, inter // 2), 0, (2 * H, 1)),
        ((inter // 2, inter), H, (2 * H, 1)),
    ]
    (down,) = by_source["mlp.down_proj.weight"]
    assert (down.box, down.stride) == (None, (1, inter))  # live [H, inter]


def test_a_conversion_across_layers_is_probed_whole(tmp_path):
    """The probe runs per layer; a checkpoint tensor made of several layers' tensors (here both
    down_proj stacked) is not what one layer's revert gives, so the probe runs on the whole model."""
    from transformers.core_model_loading import Split

    model = build("llama")
    downs = [f"layers.{i}.mlp.down_proj.weight" for i in range(COMMON["num_hidden_layers"])]
    model._weight_conversions = [WeightConverter("stacked_down", downs, operations=[Split(dim=0)])]
    store = save(model, tmp_path)
    assert store["model.stacked_down"].shape == (2 * COMMON["hidden_size"], COMMON["intermediate_size"])
    placements = check(model, layout(model), store)
    assert [p.dest for p in placements if p.source == "model.stacked_down"] == [f"model.{n}" for n in downs]
