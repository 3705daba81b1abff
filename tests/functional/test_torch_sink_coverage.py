"""The torch sink never reports success while part of the model stays stale: a store tensor with no
destination in the model, or a model tensor with no source in the store, is an error unless excluded
by pattern; a version it cannot apply leaves the model untouched; a failed apply is reported and the
model is either left whole (flip) or repaired by the next update (patch)."""

from __future__ import annotations

import pytest
import torch
from test_torch_sink import module_from

import weightsync.torch.sink as wtorch
from weightsync.errors import UsageError, WeightsyncError
from weightsync.sync.publish import PublishConfig
from weightsync.torch.sink import ApplyError, CoverageError, TorchSink
from weightsync.torch.state_dict import StateDictPublisher

MODES = pytest.mark.parametrize("mode", ["patch", "flip"])


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def holds(tensors, expected: dict[str, torch.Tensor]) -> bool:
    return all(bits(tensors[n]) == bits(t) for n, t in expected.items())


# -- a transformers v5 MoE model: experts fused in memory, one tensor per expert on disk ----------------
def tiny_moe():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return transformers, cfg


@pytest.fixture(scope="module")
def moe(tmp_path_factory, ok_cli):
    """A tiny Qwen3-MoE saved with ``save_pretrained`` at two steps and published with the CLI; the
    model object (at step 0) and each step's folder."""
    transformers, cfg = tiny_moe()
    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    store = f"file://{root / 'store'}"
    dirs = [root / "step0", root / "step1"]
    model.save_pretrained(dirs[0])
    ok_cli("publish", dirs[0], "--store", store, "--no-cache")
    trained = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    trained.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in trained.parameters():  # every weight moves, the experts included
            p.add_(1e-2 * torch.randn_like(p))
    trained.save_pretrained(dirs[1])
    ok_cli("publish", dirs[1], "--store", store, "--no-cache")
    return store, model, trained, dirs


def test_the_moe_layout_differs_between_disk_and_memory(moe):
    """What the sink has to face: transformers v5 fuses the experts in memory only."""
    from safetensors import safe_open

    _, model, _, dirs = moe
    with safe_open(str(dirs[0] / "model.safetensors"), "pt") as f:
        disk = set(f.keys())
    live = set(model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in live and "model.layers.0.mlp.experts.down_proj" in live
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in disk and not any(".experts.0." in n for n in live)
    assert model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 16, 16)  # [E, 2I, H]


@MODES
def test_an_moe_model_with_fused_experts_is_refused_not_left_stale(moe, mode):
    store, model, trained, _ = moe
    live = transformers_copy(model)
    with pytest.raises(CoverageError) as err:
        TorchSink(store, live, 0, mode=mode)
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, UsageError)
    # 2 layers x 4 experts x 3 projections on disk, 2 layers x 2 fused tensors in memory
    assert "24 store tensors of version 0 have no destination" in msg and "experts.0.down_proj.weight" in msg
    assert "4 model tensors have no source" in msg and "mlp.experts.gate_up_proj" in msg
    assert "exclude=" in msg


@MODES
def test_an_moe_model_with_the_experts_excluded_updates_the_rest(moe, mode, caplog):
    store, model, trained, _ = moe
    live = transformers_copy(model)
    with caplog.at_level("INFO", logger="weightsync.torch"):
        sink = TorchSink(store, live, 0, mode=mode, exclude=["*.mlp.experts.*"])
    assert "version 0: leaving 28 tensors alone (exclude=['*.mlp.experts.*'])" in caplog.text
    assert len(sink.excluded) == 24 + 4 and all(".mlp.experts." in n for n in sink.excluded)
    assert "model.layers.1.mlp.experts.down_proj" in sink.excluded  # model names too
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sink.excluded  # and store names
    up = sink.update(1)
    assert up.excluded == sink.excluded
    new, old = trained.state_dict(), model.state_dict()
    for name, t in live.state_dict().items():
        assert bits(t) == bits(old[name] if ".mlp.experts." in name else new[name]), name
    assert live.lm_head.weight is live.model.embed_tokens.weight  # tied: one tensor, the store names it once


def transformers_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A second live model holding ``model``'s weights (the fixture's model stays at step 0)."""
    out = type(model)(model.config).to(torch.bfloat16).eval()
    out.load_state_dict(model.state_dict())
    return out


# -- plain models whose names differ from the store's ---------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Versions of a two-tensor state dict: 0 and 1 alike in layout; 2 adds ``c``; 3 drops ``b``;
    4 changes ``b``'s shape; 5 ``b``'s dtype."""
    root = tmp_path_factory.mktemp("small")
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 8, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16()
    a1, b1 = (a.float() + 0.1).bfloat16(), (b.float() - 0.1).bfloat16()
    versions = {
        0: {"a": a, "b": b},
        1: {"a": a1, "b": b1},
        2: {"a": a1, "b": b1, "c": torch.ones(4)},
        3: {"a": a1},
        4: {"a": a1, "b": torch.zeros(16).bfloat16()},
        5: {"a": a1, "b": b1.float()},
        6: {"a": a, "b": b1},
    }
    with StateDictPublisher(root / "store", config=PublishConfig(keyframe_interval=100), work_dir=root / "work") as pub:
        for v, sd in versions.items():
            pub.publish(sd, version=v)
    return str(root / "store"), versions


@MODES
def test_names_the_model_lacks_are_refused(small, mode):
    store, versions = small
    with pytest.raises(
        CoverageError,
        match=r"2 store tensors of version 0 have no destination in the model \(a, b\).*"
        r"2 model tensors have no source in it \(net.a, net.b\)",
    ):
        TorchSink(store, module_from({f"net.{k}": v for k, v in versions[0].items()}), 0, mode=mode, verify=False)
    with pytest.raises(CoverageError, match=r"1 store tensor of version 0 has no destination in the model \(b\)"):
        TorchSink(
            store,
            module_from({"a": versions[0]["a"], "bb": versions[0]["b"]}),
            0,
            mode=mode,
            name_map=lambda n: "b_typo" if n == "b" else n,
            exclude=["bb"],
        )
    model = module_from({f"net.{k}": v for k, v in versions[0].items()})
    sink = TorchSink(store, model, 0, mode=mode, name_map=lambda n: f"net.{n}")
    assert sink.excluded == ()
    sink.update(1)
    assert holds(model.state_dict(), {f"net.{k}": v for k, v in versions[1].items()})


@MODES
def test_a_version_whose_names_change_is_refused_and_nothing_is_applied(small, mode):
    store, versions = small
    model = module_from(versions[0])
    sink = TorchSink(store, model, 0, mode=mode)
    sink.update(1)
    for v, match in (
        (2, r"1 store tensor of version 2 has no destination in the model \(c\)"),
        (3, r"1 model tensor has no source in version 3 \(b\)"),
        (4, r"b: the store has BF16\[16\].*cannot patch in place"),
        (5, r"b: the store has F32\[32\].*cannot patch in place"),
    ):
        with pytest.raises(UsageError, match=match):
            sink.prepare(v)
        with pytest.raises(UsageError, match=match):
            sink.update(v)
        assert sink.version == 1 and holds(model.state_dict(), versions[1])
    sink.update(6)  # the sink is still usable
    assert holds(model.state_dict(), versions[6])
    ignoring = TorchSink(store, module_from(versions[1]), 1, mode=mode, exclude=["c"])
    assert ignoring.update(2).excluded == ("c",)
    with pytest.raises(CoverageError, match="no source in version 3"):
        ignoring.prepare(3)


@MODES
def test_exclude_leaves_model_tensors_alone(small, mode):
    store, versions = small
    model = module_from({**versions[0], "extra.scale": torch.ones(3)})
    with pytest.raises(CoverageError, match=r"1 model tensor has no source in version 0 \(extra.scale\)"):
        TorchSink(store, model, 0, mode=mode)
    sink = TorchSink(store, model, 0, mode=mode, exclude=["extra.*"])
    assert sink.excluded == ("extra.scale",)
    sink.update(1)
    assert holds(model.state_dict(), {**versions[1], "extra.scale": torch.ones(3)})
    with pytest.raises(UsageError, match="no tensor of version 0 matches"):
        TorchSink(store, model, 0, mode=mode, exclude=["*"])


# -- a failure in the middle of the pause --------------------------------------------------------------
def test_patch_apply_failing_midway_is_reported_and_repaired(small, monkeypatch):
    store, versions = small
    model = module_from(versions[0])
    sink = TorchSink(store, model, 0, dense_above=1.0)
    up = sink.prepare(1)
    stale = sink.prepare(6)
    assert len(up.patches) == 2
    real, calls = wtorch.Patch.write, []

    def fails_second(self):
        calls.append(self.name)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        real(self)

    monkeypatch.setattr(wtorch.Patch, "write", fails_second)
    with pytest.raises(ApplyError, match=r"1 of 2 tensors written.*device lost") as err:
        sink.apply(up)
    monkeypatch.setattr(wtorch.Patch, "write", real)
    assert isinstance(err.value, WeightsyncError) and "\n" not in str(err.value)
    torn = model.state_dict()
    assert not holds(torn, versions[0]) and not holds(torn, versions[1])  # one tensor new, one old
    with pytest.raises(UsageError, match="torn"):
        sink.apply(stale)  # its patches assume version 0's bytes everywhere
    back = sink.update(0)  # not a no-op: the torn tensor is rewritten
    assert back.patches and sink.version == 0 and holds(model.state_dict(), versions[0])
    assert sink.verify() == 2
    sink.update(1)
    assert holds(model.state_dict(), versions[1])


def test_dense_writes_are_one_batch_and_a_batch_failing_midway_is_torn_then_repaired(small, monkeypatch):
    """Regions copied whole (dense_above=0) go as one ``_foreach_copy_``; if it fails part way the
    model is torn, said so, and the next update rewrites it."""
    store, versions = small
    model = module_from(versions[0])
    sink = TorchSink(store, model, 0, dense_above=0.0)
    up = sink.prepare(1)
    (batch,) = up.patches
    assert (
        isinstance(batch, wtorch._Copies)
        and batch.writes == 2
        and batch.elements == sum(v.numel() for v in versions[1].values())
    )
    real = torch._foreach_copy_

    def first_only(dsts, srcs):
        dsts[0].copy_(srcs[0])
        raise RuntimeError("device lost")

    monkeypatch.setattr(torch, "_foreach_copy_", first_only)
    with pytest.raises(
        ApplyError, match=r"0 of 2 tensors written \(2 more in the call that failed, some perhaps\).*device lost"
    ):
        sink.apply(up)
    monkeypatch.setattr(torch, "_foreach_copy_", real)
    torn = model.state_dict()
    assert not holds(torn, versions[0]) and not holds(torn, versions[1])
    sink.update(0)
    assert sink.version == 0 and holds(model.state_dict(), versions[0])
    sink.update(1)
    assert holds(model.state_dict(), versions[1]) and sink.verify() == 2
    monkeypatch.delattr(torch, "_foreach_copy_")  # an older torch: one copy_ each, the same bytes
    sink.update(0)
    assert holds(model.state_dict(), versions[0])
    monkeypatch.setattr(wtorch, "_FOREACH_MAX", 512)  # "a" (512 elements) too large to batch: its own copy
    up = sink.prepare(1)
    assert sorted((type(p).__name__, p.elements) for p in up.patches) == [("Patch", 32), ("Patch", 512)]
    sink.apply(up)
    assert holds(model.state_dict(), versions[1])


@pytest.mark.parametrize("between", ["verify", "prepare"])
@pytest.mark.parametrize("change", ["clone", "float"])
def test_an_update_prepared_before_the_storage_changed_is_refused_after_another_call_saw_it(small, between, change):
    """Storage replaced after a prepare, then seen by a verify (which passes: the bytes are still
    version 0's) or another prepare: the first update's writes would go to storage the model no
    longer holds, so its apply is refused, not reported done over a model left at version 0."""
    store, versions = small
    model = module_from(versions[0])
    sink = TorchSink(store, model, 0, dense_above=0.0)
    up = sink.prepare(1)
    if change == "clone":
        model.a.data = model.a.data.clone()  # an engine re-allocating a buffer: the same bytes elsewhere
    else:
        model.float()  # a lossless cast
    if between == "verify":
        assert sink.verify() == 2
    else:
        sink.prepare(6)  # abandoned
    with pytest.raises(UsageError, match="changed storage since it was prepared"):
        sink.apply(up)
    assert sink.version == 0
    sink.update(1)
    assert holds({k: v.bfloat16() for k, v in model.state_dict().items()}, versions[1]) and sink.verify() == 2


def test_coalesce_merges_scatters_per_tensor_and_copies_per_width_and_counts_their_writes():
    t = torch.zeros(10, dtype=torch.int16)
    u = torch.zeros(4, dtype=torch.int16)
    i16 = torch.int16
    patches = [
        wtorch.Patch("a", t, torch.tensor([1]), torch.tensor([5], dtype=i16)),
        wtorch.Patch("b", t, torch.tensor([3]), torch.tensor([7], dtype=i16)),
        wtorch.Patch("c", t, None, torch.ones(2, dtype=i16), view=((2,), (1,), 6)),
        wtorch.Patch("d", t, None, torch.full((2,), 2, dtype=i16), view=((2,), (1,), 8)),
        wtorch.Patch("e", u, None, torch.arange(4, dtype=i16)),  # a whole tensor
    ]
    out = wtorch._coalesce(patches)
    assert sorted((type(p).__name__, p.writes, p.elements) for p in out) == [("Patch", 2, 2), ("_Copies", 3, 8)]
    for p in out:
        p.write()
    assert t.tolist() == [0, 5, 0, 7, 0, 0, 1, 1, 2, 2] and u.tolist() == [0, 1, 2, 3]


def test_flip_apply_failing_midway_leaves_the_old_version(small):
    store, versions = small
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in versions[0].items()}
    before = {k: p.data_ptr() for k, p in params.items()}
    sink = TorchSink(store, params, 0, mode="flip")
    up = sink.prepare(1)
    assert len(up.flips) == 2

    class Refuses:  # a tensor object whose storage cannot be repointed to the standby
        def __init__(self, old):
            self.old = old

        def data_ptr(self):
            return self.old.data_ptr()

        @property
        def data(self):
            return self.old

        @data.setter
        def data(self, buf):
            if buf is not self.old:
                raise RuntimeError("cannot repoint")

    second = up.flips[1]
    real = second.objects
    second.objects = (Refuses(second.old),)
    with pytest.raises(ApplyError, match=r"still holds version 0.*cannot repoint"):
        sink.apply(up)
    assert {k: p.data_ptr() for k, p in params.items()} == before and holds(params, versions[0]) and sink.version == 0
    second.objects = real
    sink.apply(up)  # still staged: the failed apply changed nothing
    assert holds(params, versions[1]) and sink.version == 1
