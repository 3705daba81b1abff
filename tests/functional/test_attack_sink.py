"""Hostile review of the in-process torch sink: runs that ended with bytes in the live model other
than the version's while the sink reported that version, and layouts accepted that should have
been refused (each failed against the sink as first written). Each test states what it expects of
a correct sink: follow the version bit for bit, or refuse with a UsageError / BaseMismatchError."""

from __future__ import annotations

import pytest
import torch

from weightsync.codec.payload import CodecConfig
from weightsync.errors import BaseMismatchError, UsageError
from weightsync.sync.publish import PublishConfig
from weightsync.sync.pull import pull
from weightsync.torch.layout import Layout, Placement
from weightsync.torch.sink import TorchSink
from weightsync.torch.state_dict import StateDictPublisher

MODES = pytest.mark.parametrize("mode", ["patch", "flip"])
CODECS = pytest.mark.parametrize("sparse", [False, True], ids=["ans", "sparse"])


def publish(root, sds, sparse: bool = False) -> str:
    cfg = PublishConfig(keyframe_interval=10, codec=CodecConfig(entropy_coder=not sparse))
    with StateDictPublisher(root / "store", config=cfg, work_dir=root / "work") as pub:
        for v, sd in enumerate(sds):
            pub.publish(sd, version=v)
    return str(root / "store")


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def three(name: str = "w", rows: int = 64) -> list[dict[str, torch.Tensor]]:
    """Three versions of one fp32 tensor, one element changed per step."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(rows, 4, generator=g)
    w1 = w0.clone()
    w1[3, 1] += 1
    w2 = w1.clone()
    w2[7, 2] += 1
    return [{name: w0}, {name: w1}, {name: w2}]


# -- 1. patch mode writes into a storage the model no longer uses -----------------------------------


@CODECS
def test_patch_mode_follows_a_parameter_whose_storage_was_replaced_after_construction(tmp_path, sparse):
    """A model moved or cast after the sink was built (``model.to(device)``, ``model.float()``, an
    engine's ``process_weights_after_loading`` assigning ``param.data``) holds new storages. Patch
    mode keeps the detached aliases of the old ones: it writes the update there, verifies it there,
    and reports the version while the model serves the old bytes. Flip mode notices the repoint
    (``_ensure_standby``); patch mode must either follow the new storage or refuse."""
    sds = three("weight")
    store = publish(tmp_path, sds, sparse)
    model = torch.nn.Linear(4, 64, bias=False)
    with torch.no_grad():
        model.weight.copy_(sds[0]["weight"])
    sink = TorchSink(store, model, 0)
    model.weight.data = model.weight.data.clone()  # what model.to(...) / model.float() do to each parameter
    try:
        sink.update(1)
        sink.update(2)
    except (UsageError, BaseMismatchError):
        return  # refusing is fine
    assert sink.version == 2
    assert bits(model.weight) == bits(sds[2]["weight"]), "the sink reports version 2, the model serves version 0"


# -- 2. a mirrored tensor (a TP shard) written behind the sink's back stays wrong ---------------------


@MODES
def test_a_shard_written_behind_the_sinks_back_is_not_kept_through_the_next_update(tmp_path, mode):
    """The same write into a whole tensor is caught (its base is read back from the model and fails
    its checksum: the tensor is rebuilt). For a tensor the model holds in part the base comes from
    the host mirror, and the live region is never compared with it: the foreign value survives the
    next update, which reports success. Flip mode replays the last update's positions from the live
    tensor onto the standby, so a write at one of those positions survives there too."""
    sds = three()
    store = publish(tmp_path, sds)
    live = {"w": torch.nn.Parameter(sds[0]["w"][:32].clone(), requires_grad=False)}
    lay = Layout([Placement("w", "w", box=((0, 32), (0, 4)))])
    sink = TorchSink(store, live, 0, layout=lay, mode=mode)
    sink.update(1)
    with torch.no_grad():
        live["w"][3, 1] = 999.0  # a position version 1 changed; not one version 2 changes
    try:
        sink.update(2)
    except BaseMismatchError:
        return  # saying so is fine
    assert sink.version == 2
    assert bits(live["w"]) == bits(sds[2]["w"][:32]), "version 2 reported, a foreign value kept"


# -- 3. a dtype change with identical bytes is taken for "unchanged" ---------------------------------


def _dtype_change(tmp_path):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, generator=g).bfloat16()
    sds = [{"w": w}, {"w": w.view(torch.float16)}]  # same bytes, other values
    return sds, publish(tmp_path, sds)


def test_a_dtype_change_with_the_same_bytes_reaches_a_model_that_widened_the_tensor(tmp_path):
    """A model keeps a bf16 tensor in fp32 (a cast on load). The next version stores the tensor as
    fp16 with the very same bytes (a trainer switched precision): the plan sees equal checksums and
    skips it, and the fp32 live tensor keeps bf16 values where fp16 values are due."""
    sds, store = _dtype_change(tmp_path)
    live = {"w": sds[0]["w"].float()}
    sink = TorchSink(store, live, 0)
    try:
        sink.update(1)
    except UsageError:
        return  # refusing is fine
    assert bits(live["w"]) == bits(sds[1]["w"].float()), "version 1 reported; the model holds bf16 values"


def test_a_dtype_change_with_the_same_bytes_from_a_folder(tmp_path):
    """The node path (``prepare(v, folder=, manifest=)``) skips it the same way."""
    sds, store = _dtype_change(tmp_path)
    pull(store, tmp_path / "v1", 1)
    live = {"w": sds[0]["w"].float()}
    sink = TorchSink(store, live, 0)
    try:
        up = sink.prepare(1, folder=tmp_path / "v1")
        sink.apply(up)
    except UsageError:
        return
    assert bits(live["w"]) == bits(sds[1]["w"].float()), "version 1 reported; the model holds bf16 values"


# -- 4. live tensors that share memory without being the same view -----------------------------------


def test_live_tensors_that_overlap_in_memory_are_refused_in_patch_mode(tmp_path):
    """``b`` is a view of the first rows of ``a`` (an engine that exposes a slice of a parameter
    under a second name). Flip mode refuses this (``_refuse_overlaps``); patch mode accepts it, and
    a version in which the two disagree is applied as two writes to one memory: the last one wins,
    the other tensor holds bytes that are not its version's, and the update reports success (a
    tied pair that differs is refused, with the names; this is the same fact one level down)."""
    a0 = torch.arange(8.0).view(4, 2)
    a1 = a0.clone()
    a1[0, 0] = 100.0
    sds = [{"a": a0, "b": a0[:2].clone()}, {"a": a1, "b": a0[:2] + 50}]
    store = publish(tmp_path, sds)
    mem = a0.clone()
    live = {"a": mem, "b": mem[:2]}
    try:
        sink = TorchSink(store, live, 0)
        sink.update(1)
    except UsageError:
        return  # refusing is what flip mode does
    assert bits(live["a"]) == bits(a1) and bits(live["b"]) == bits(sds[1]["b"]), (
        "version 1 reported; a and b cannot both hold it"
    )


# -- 5. layouts that should be refused before anything is written ------------------------------------


def test_a_placement_whose_strides_overlap_itself_is_refused(tmp_path):
    """Stride 0 puts all 64 store elements on live element 0; the count of covered elements (64 of
    64) hides that live elements 1..63 have no source. The sink builds, verifies (the checkpoint is
    constant) and then, on the first update, fails in the pause with a torch error and a torn model.
    A placement that writes one live element twice must be a UsageError at construction."""
    w0 = torch.ones(64)
    w1 = w0.clone()
    w1[5] = 2.0
    store = publish(tmp_path, [{"w": w0}, {"w": w1}])
    live = {"w": torch.ones(64)}
    with pytest.raises(UsageError):
        TorchSink(store, live, 0, layout=Layout([Placement("w", "w", stride=(0,))]))


def test_excluding_a_store_tensor_does_not_hide_a_gap_in_the_live_tensor_it_shares(tmp_path):
    """q, k, v fused into qkv, which has two more rows than they fill (a layout bug: a gap). The gap
    is refused (CoverageError) -- until ``exclude=["q"]`` is given to leave q alone: the exclusion
    counts the whole of qkv as covered, the gap included."""
    g = torch.Generator().manual_seed(1)
    sd = {n: torch.randn(2, 4, generator=g) for n in "qkv"}
    store = publish(tmp_path, [sd])
    live = {"qkv": torch.zeros(8, 4)}
    live["qkv"][:6] = torch.cat([sd["q"], sd["k"], sd["v"]])
    lay = Layout([Placement(n, "qkv", offset=i * 8) for i, n in enumerate("qkv")])
    with pytest.raises(UsageError):
        TorchSink(store, live, 0, layout=lay)  # refused today, rightly
    with pytest.raises(UsageError):
        TorchSink(store, live, 0, layout=lay, exclude=["q"])  # accepted today


# -- 6. wrong error: a bf16 NaN with a payload in an fp32 model ---------------------------------------


def test_a_bf16_nan_with_a_payload_kept_in_fp32_is_a_bf16_value(tmp_path):
    """A bf16 checkpoint holding a NaN whose payload is not the canonical one, loaded into fp32
    (``.float()`` keeps the payload bit for bit). The live value is exactly the store's, but
    reading it back casts fp32 -> bf16, which canonicalises NaNs: the sink refuses the model with
    ``a value in w is not a BF16 value``, which is false (``lossless`` claims bf16 -> fp32 -> bf16
    gives every value back)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, generator=g).bfloat16()
    w.view(torch.int16)[3] = 0x7F81  # a NaN, not the canonical 0x7FC0
    store = publish(tmp_path, [{"w": w}])
    live = {"w": w.float()}
    assert live["w"].view(torch.int32)[3].item() == 0x7F810000  # the load kept the payload
    TorchSink(store, live, 0)


def test_two_store_tensors_on_one_region_are_checked_on_the_boxes_they_place(tmp_path):
    """Two store tensors placed on one live region count as tied, and are checked by comparing
    their whole-tensor checksums. Here ``a`` and ``b`` are equal as tensors, but the region is said
    to hold ``a``'s rows 0-1 and ``b``'s rows 2-3, which differ: no model can hold both, and the
    sink accepts the layout, silently dropping ``b``'s placement."""
    t = torch.arange(8.0).view(4, 2)
    store = publish(tmp_path, [{"a": t, "b": t.clone()}])
    live = {"r": t[:2].clone()}
    lay = Layout([Placement("a", "r", box=((0, 2), (0, 2))), Placement("b", "r", box=((2, 4), (0, 2)))])
    with pytest.raises(UsageError):
        TorchSink(store, live, 0, layout=lay)


# -- 7. one store tensor loaded into two live tensors ------------------------------------------------


def test_one_store_tensor_loaded_into_two_live_copies_follows_the_store(tmp_path):
    """An engine that keeps two copies of one checkpoint tensor (untied embedding and LM head loaded
    from one tensor, a draft model sharing the target's embedding) is two whole placements of one
    source. The sink refuses it with ``w: its placements cover more elements than it has
    (overlapping boxes)``: no box overlaps anything; the check counts elements over all
    destinations. Either follow the store or say what is unsupported."""
    sds = three()
    store = publish(tmp_path, sds)
    live = {"a": sds[0]["w"].clone(), "b": sds[0]["w"].clone()}
    sink = TorchSink(store, live, 0, layout=Layout([Placement("w", "a"), Placement("w", "b")]))
    sink.update(2)
    assert bits(live["a"]) == bits(sds[2]["w"]) and bits(live["b"]) == bits(sds[2]["w"])


# -- 8. engine padding keeps a row a smaller version no longer has -------------------------------------


def test_vocab_rows_that_become_padding_are_not_left_holding_the_old_version(tmp_path):
    """vLLM rules (``engines.dense``): the embedding of 100 rows is padded to 128, rows 100-127
    zero-filled by the engine. The next version has 99 rows (a reshape): the padding grows by a
    row, and the sink, which never writes padding, leaves row 99 holding version 0's row. The
    update reports version 1; a fresh load of version 1 has zeros there (``plan().padding`` knows
    the exact blocks; the sink only knows that some elements of the tensor are padding). A reshape
    of a padded tensor should either zero the new padding or be refused."""
    from weightsync.torch.engines import dense

    g = torch.Generator().manual_seed(0)
    e0 = torch.randn(100, 8, generator=g)
    e1 = e0[:99] + 1
    name = "model.embed_tokens.weight"
    store = publish(tmp_path, [{name: e0}, {name: e1}])
    live = {name: torch.zeros(128, 8)}
    live[name][:100] = e0
    sink = TorchSink(store, live, 0, layout=dense("vllm", num_heads=1, num_kv_heads=1).layout())
    try:
        sink.update(1)
    except UsageError:
        return  # refusing is fine
    fresh = torch.zeros(128, 8)
    fresh[:99] = e1
    assert bits(live[name]) == bits(fresh), "row 99 still holds version 0's row 99"


# -- 9. found by the thirty-third session's attack: a version or model that only looked right ---------


def two_files(root, name: str, versions: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """A store whose versions each hold ``name`` in two files: ``model.safetensors`` and a copy in
    ``stale/`` (a trainer's leftover)."""
    from safetensors.torch import save_file

    from weightsync.sync.publish import publish as publish_folder

    for v, (main, stale) in enumerate(versions):
        ck = root / f"ck{v}"
        (ck / "stale").mkdir(parents=True)
        save_file({name: main}, str(ck / "model.safetensors"))
        save_file({name: stale}, str(ck / "stale" / "model.safetensors"))
        publish_folder(ck, root / "store", version=v)
    return str(root / "store")


@MODES
def test_a_tensor_two_files_of_a_version_hold_with_other_bytes_is_refused(tmp_path, mode):
    """A version whose checkpoint folder held a stale copy of the model beside it: the sink took the
    last file's tensor (the stale one), reported the version, and its own verify agreed. Which copy
    the model should get is unknown: refused before anything is written. Identical copies (what
    ranks writing a replicated tensor each give) are one tensor."""
    sds = three()
    store = two_files(tmp_path, "w", [(sds[0]["w"], sds[0]["w"]), (sds[1]["w"], sds[0]["w"])])
    model = {"w": torch.nn.Parameter(sds[0]["w"].clone(), requires_grad=False)}
    sink = TorchSink(store, model, 0, mode=mode)  # version 0: two identical copies
    with pytest.raises(UsageError, match="holds tensor w twice, with other values in model.safetensors and stale/"):
        sink.update(1)
    assert sink.version == 0 and bits(model["w"]) == bits(sds[0]["w"])


def test_the_engine_loader_takes_identical_copies_once_and_refuses_differing_ones(tmp_path):
    """The engine path's rule is the sink's: it refused a version holding a name twice even where the
    copies were the same bytes (a valid checkpoint), while the sink took them. Identical copies are one
    tensor; differing copies are refused, naming both files, before the engine gets anything."""
    from weightsync.torch.loader import EngineLoad, EngineLoader

    sds = three()
    w0, w1, w2 = (sd["w"] for sd in sds)
    store = two_files(tmp_path, "w", [(w0, w0), (w1, w1), (w2, w0)])
    got: list[tuple[str, torch.Tensor]] = []
    loader = EngineLoader(store, EngineLoad(lambda batch: got.extend((n, t.clone()) for n, t in batch)), version=0)
    assert loader.update(1).tensors == ["w"] and [n for n, _ in got] == ["w"] and bits(got[0][1]) == bits(w1)
    got.clear()
    with pytest.raises(UsageError, match="holds tensor w twice, with other values in model.safetensors and stale/"):
        loader.update(2)
    assert got == [] and loader.version == 1


def test_an_engine_layout_refuses_a_tensor_of_the_same_size_in_another_shape(tmp_path):
    """vLLM rules: a row-parallel weight stored transposed ([16, 8] for the model's [8, 16]) fits its
    parameter by element count. The sink wrote its elements in the stored order and reported the
    version; the engine's loader refuses the shape. The rules work out the live shapes: refused."""
    from weightsync.torch.engines import dense

    g = torch.Generator().manual_seed(0)
    name = "model.layers.0.mlp.down_proj.weight"
    w0 = torch.randn(8, 16, generator=g)
    store = publish(tmp_path, [{name: w0}, {name: (w0 + 1).t().contiguous()}])
    live = {name: w0.clone()}
    sink = TorchSink(store, live, 0, layout=dense("vllm", num_heads=1, num_kv_heads=1).layout())
    with pytest.raises(UsageError, match=r"down_proj.weight\[8, 16\] \(the version implies \[16, 8\]\)"):
        sink.update(1)
    assert sink.version == 0 and bits(live[name]) == bits(w0)


def test_flip_refuses_a_parameter_replaced_between_prepare_and_apply(tmp_path):
    """``mod.weight = nn.Parameter(mod.weight.data)`` between prepare and apply (a re-registration, a
    wrapper): flip mode checked only the objects it had captured, repointed the detached one and
    reported the version while the module computed with the old. Patch mode refused it already."""
    sds = three("weight")
    store = publish(tmp_path, sds)
    model = torch.nn.Linear(4, 64, bias=False)
    with torch.no_grad():
        model.weight.copy_(sds[0]["weight"])
    sink = TorchSink(store, model, 0, mode="flip")
    up = sink.prepare(1)
    model.weight = torch.nn.Parameter(model.weight.data)
    with pytest.raises(UsageError, match="prepare again"):
        sink.apply(up)
    sink.update(1)
    assert sink.version == 1 and bits(model.weight) == bits(sds[1]["weight"])


@MODES
def test_a_tensor_repointed_at_other_values_is_rebuilt_though_the_next_version_leaves_it(tmp_path, mode):
    """``param.data = other`` with foreign values on a tensor the next version does not change: only
    the changed tensors were read back as delta bases, so the foreign values outlived the update,
    which reported success. A tensor seen on a new storage is now checked at the next prepare."""
    sds = three("a")
    for sd in sds:
        sd["b"] = torch.arange(32, dtype=torch.float32)  # never changes
    store = publish(tmp_path, sds)
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in sds[0].items()})
    sink = TorchSink(store, model, 0, mode=mode)
    model["b"].data = torch.zeros(32)
    sink.update(1)
    assert sink.version == 1 and not sink.torn
    assert bits(model["b"]) == bits(sds[1]["b"]) and bits(model["a"]) == bits(sds[1]["a"])
    model["b"].data = model["b"].data.clone()  # a move with the right values: nothing to rebuild
    sink.update(2)
    assert bits(model["b"]) == bits(sds[2]["b"]) and bits(model["a"]) == bits(sds[2]["a"])
