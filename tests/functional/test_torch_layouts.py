"""The torch sink through a layout: a model whose memory is not the checkpoint's names and shapes
(fused projections, stacked experts, a transposed weight, a tensor-parallel shard, a dtype cast on
load, tied weights) follows a store, or a local folder holding each version, bit for bit; and a
layout that leaves anything unexplained is refused before anything is written."""

from __future__ import annotations

import os

import pytest
import torch

from weightsync.codec.payload import CodecConfig
from weightsync.errors import BaseMismatchError, UsageError
from weightsync.store.repo import open_repo
from weightsync.sync.publish import PublishConfig
from weightsync.sync.pull import pull
from weightsync.torch.layout import Layout, Placement
from weightsync.torch.sink import CoverageError, TorchSink, _Copies
from weightsync.torch.state_dict import StateDictPublisher

MODES = pytest.mark.parametrize("mode", ["patch", "flip"])
DEVICE = torch.device(os.environ.get("WEIGHTSYNC_TEST_DEVICE", "cpu"))  # benchmarks/gpu.sh: cuda
E, O, I, D = 3, 8, 6, 4  # experts, rows, columns, head rows  # noqa: E741


def checkpoint(g: torch.Generator) -> dict[str, torch.Tensor]:
    """One version as the trainer saves it: per-expert tensors, separate q/k/v, bf16 throughout."""
    sd = {f"experts.{e}.w": torch.randn(O, I, generator=g) for e in range(E)}
    sd |= {n: torch.randn(D, I, generator=g) for n in ("q", "k", "v")}
    sd |= {"down": torch.randn(O, I, generator=g), "col": torch.randn(O, I, generator=g)}
    sd |= {"bias": torch.randn(O, generator=g), "embed": torch.randn(10, I, generator=g)}
    sd["lm_head"] = sd["embed"]
    return {k: v.bfloat16() for k, v in sd.items()}


def step(sd: dict[str, torch.Tensor], g: torch.Generator, frac: float) -> dict[str, torch.Tensor]:
    """A training step's change: ``frac`` of each tensor's elements move by one ulp or so."""
    out = {}
    for k, v in sd.items():
        if k == "lm_head":
            continue
        mask = torch.rand(v.shape, generator=g) < frac
        out[k] = torch.where(mask, (v.float() * 1.01).bfloat16(), v)
    out["lm_head"] = out["embed"]
    return out


def engine(sd: dict[str, torch.Tensor], rank: int = 0) -> dict[str, torch.Tensor]:
    """What an engine holds after loading ``sd`` its own way: experts stacked, q/k/v fused, ``down``
    transposed, rows ``rank`` of 2 of ``col``, the bias kept in fp32, one tensor for embed and lm_head."""
    live = {
        "moe.w": torch.stack([sd[f"experts.{e}.w"] for e in range(E)]),
        "qkv": torch.cat([sd["q"], sd["k"], sd["v"]]),
        "down_t": sd["down"].t().contiguous(),
        "col_shard": sd["col"][rank * O // 2 : (rank + 1) * O // 2].clone(),
        "bias": sd["bias"].float(),
        "embed": sd["embed"].clone(),
    }
    live = {k: t.to(DEVICE) for k, t in live.items()}
    live["lm_head"] = live["embed"]  # tied: one storage, two names
    return live


def layout(rank: int = 0) -> Layout:
    ps = [Placement(f"experts.{e}.w", "moe.w", offset=e * O * I) for e in range(E)]
    ps += [Placement(n, "qkv", offset=i * D * I) for i, n in enumerate("qkv")]
    ps += [
        Placement("down", "down_t", stride=(1, O)),
        Placement("col", "col_shard", box=((rank * O // 2, (rank + 1) * O // 2), (0, I))),
        Placement("bias", "bias"),
        Placement("embed", "embed"),
        Placement("lm_head", "lm_head"),
    ]
    return Layout(ps, name="test-engine")


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_engine_holds(model: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], rank: int = 0) -> None:
    want = engine(sd, rank)
    for name, t in want.items():
        assert bits(model[name]) == bits(t), name


def params(live: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Flip mode needs the objects the engine reads through (Parameters), tied ones shared."""
    if mode == "patch":
        return live
    out, seen = {}, {}
    for k, t in live.items():
        out[k] = seen.setdefault(t.data_ptr(), torch.nn.Parameter(t, requires_grad=False))
    return out


def publish_all(root, sds, codec: CodecConfig | None = None) -> str:
    store = root / "store"
    cfg = PublishConfig(keyframe_interval=3, codec=codec or CodecConfig())
    with StateDictPublisher(store, config=cfg, work_dir=root / "work") as pub:
        for v, sd in enumerate(sds):
            pub.publish({k: x for k, x in sd.items() if k != "lm_head"} | {"lm_head": sd["lm_head"].clone()}, version=v)
    return str(store)


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Five versions published to a file store, and a folder pulled at each."""
    root = tmp_path_factory.mktemp("layouts")
    g = torch.Generator().manual_seed(3)
    sds = [checkpoint(g)]
    for frac in (0.03, 0.03, 0.15, 0.03):
        sds.append(step(sds[-1], g, frac))
    store = publish_all(root, sds)
    folders = []
    for v in range(len(sds)):
        pull(str(store), root / f"v{v}", v)
        folders.append(root / f"v{v}")
    return str(store), sds, folders


@MODES
@pytest.mark.parametrize("rank", [0, 1])
def test_an_engine_layout_follows_the_store_bit_exact(versions, mode, rank):
    store, sds, _ = versions
    live = params(engine(sds[0], rank), mode)
    sink = TorchSink(store, live, 0, layout=layout(rank), mode=mode)
    assert sink.mirror_bytes == O * I * 2  # only the sharded tensor is kept whole on the host
    for v in (1, 2, 3, 4, 1, 4):
        up = sink.update(v)
        assert sink.version == v and up.changed_elements > 0
        assert_engine_holds(live, sds[v], rank)
        assert sink.verify() == len(sds[v])
    if mode == "patch":  # a 3% step scatters positions; the 15% step copies regions whole
        assert any(p.index is not None for p in sink.prepare(3).patches)


@MODES
def test_an_engine_layout_follows_a_local_folder_without_a_store(versions, mode):
    """The node path: no store at all, each version read from a folder that holds it (a subscriber's
    slot), only the tensors that changed."""
    store, sds, folders = versions
    repo = open_repo(store)
    live = params(engine(sds[0], 1), mode)
    sink = TorchSink(None, live, 0, layout=layout(1), mode=mode, manifest=repo.manifest(0), folder=folders[0])
    assert sink.mirror_bytes == 0  # the shard is compared with the folder's bytes, not kept
    for v in (1, 2, 3, 4, 2):
        up = sink.prepare(v, folder=folders[v], manifest=repo.manifest(v))
        assert up.fetched_bytes == 0
        sink.apply(up)
        assert_engine_holds(live, sds[v], 1)
        assert sink.verify(folder=folders[v]) == len(sds[v])
    with pytest.raises(UsageError, match="give the manifest"):
        sink.prepare(3, folder=folders[3])
    with pytest.raises(UsageError, match="give the folder"):
        sink.prepare(3, manifest=repo.manifest(3))


def test_a_folder_that_does_not_hold_the_version_is_refused_and_nothing_changes(versions, tmp_path):
    store, sds, folders = versions
    repo = open_repo(store)
    live = engine(sds[0])
    with pytest.raises(UsageError, match="col: the model holds these only in part"):
        TorchSink(None, live, 0, layout=layout(), manifest=repo.manifest(0))  # nothing to verify the shard with
    sink = TorchSink(None, live, 0, layout=layout(), manifest=repo.manifest(0), folder=folders[0])
    with pytest.raises(BaseMismatchError):
        sink.prepare(1, folder=folders[2], manifest=repo.manifest(1))
    assert_engine_holds(live, sds[0])
    sink.apply(sink.prepare(1, folder=folders[1], manifest=repo.manifest(1)))
    assert_engine_holds(live, sds[1])


@MODES
def test_a_layout_that_leaves_something_unexplained_is_refused(versions, mode):
    store, sds, _ = versions
    full = layout()
    cases = [
        (Layout([p for p in full.placements if p.source != "experts.2.w"]), r"no destination.*experts\.2\.w.*moe\.w"),
        (Layout([*full.placements, Placement("col", "missing")]), r"no destination in the model \(col\)"),
        (Layout([*full.placements, Placement("nope", "qkv")]), "does not have"),
        (Layout([*full.placements, Placement("col", "moe.w", offset=O * I * E)]), "runs past the end"),
        (Layout([*full.placements, Placement("col", "col_shard", box=((0, O), (0, I)))]), "runs past|more elements"),
        (  # q and k swapped for an overlap of k over q: the counts still add up, the layout is wrong
            Layout([p if p.source != "k" else Placement("k", "qkv", offset=D * I // 2) for p in full.placements]),
            r"[qk]: its placement in qkv overlaps",
        ),
        (  # rows interleaved (the address ranges meet): checked element by element
            Layout(
                [p for p in full.placements if p.source not in ("q", "k")]
                + [Placement("q", "qkv", stride=(2 * I, 1)), Placement("k", "qkv", offset=2 * I, stride=(2 * I, 1))]
            ),
            r"[qk]: its placement in qkv overlaps",
        ),
    ]
    for lay, match in cases:
        live = params(engine(sds[0]), mode)
        before = {k: bits(t) for k, t in live.items()}
        with pytest.raises(UsageError, match=match):
            TorchSink(store, live, 0, layout=lay, mode=mode)
        assert {k: bits(t) for k, t in live.items()} == before
    # excluded by name, the gap is intended
    lay = Layout([p for p in full.placements if p.source != "experts.2.w"], exclude=("experts.2.*", "moe.w"))
    live = params(engine(sds[0]), mode)
    sink = TorchSink(store, live, 0, layout=lay, mode=mode)
    assert "experts.2.w" in sink.excluded


def test_a_live_value_that_is_no_cast_of_the_store_value_is_caught(versions):
    store, sds, _ = versions
    live = engine(sds[0])
    live["bias"][0] += 1e-4  # an fp32 value no bf16 rounds to
    with pytest.raises(BaseMismatchError, match="bias: a value"):
        TorchSink(store, live, 0, layout=layout())
    live = engine(sds[0], 0)
    live["col_shard"][0, 0] += 1  # the shard, checked against the host copy of the whole tensor
    with pytest.raises(BaseMismatchError, match="col"):
        TorchSink(store, live, 0, layout=layout(0))


def test_a_narrowing_cast_needs_the_layout_to_say_so(versions):
    store, sds, _ = versions
    live = engine(sds[0])
    live["bias"] = live["bias"].half()  # bf16 store, fp16 live: not a cast the sink may assume
    with pytest.raises(UsageError, match="cannot patch in place"):
        TorchSink(store, live, 0, layout=layout())
    lay = layout()
    lay.narrowing = True
    sink = TorchSink(store, live, 0, layout=lay)
    sink.update(4)
    assert bits(live["bias"]) == bits(sds[4]["bias"].half())
    assert sink.verify() == len(sds[4])


@MODES
def test_an_fp16_checkpoint_in_an_fp32_model_is_a_cast_on_load_followed_bit_for_bit(tmp_path, mode):
    """A widening cast (fp16 store, fp32 model, as ``from_pretrained(dtype=float32)`` loads it) is
    taken without ``narrowing``: updates and a rollback leave the values a load would, and the
    store's bytes (a NaN payload the cast quiets included) are checked on the host copy."""
    g = torch.Generator().manual_seed(5)
    sds = [{k: v.half() for k, v in checkpoint(g).items()}]
    sds[0]["bias"].view(torch.int16)[0] = 0x7C01  # a signalling NaN: fp32 has no exact copy of it
    for _ in range(2):
        sds.append({k: torch.where(torch.rand(v.shape, generator=g) < 0.1, v * 1.01, v) for k, v in sds[-1].items()})
        sds[-1]["lm_head"] = sds[-1]["embed"]
    store = publish_all(tmp_path, sds)
    live = {k: t.float().to(DEVICE) for k, t in sds[0].items() if k != "lm_head"}
    live = params(live | {"lm_head": live["embed"]}, mode)  # tied, as the trainer saved them
    sink = TorchSink(store, live, 0, mode=mode)
    for v in (1, 2, 0, 2):
        sink.update(v)
        for k, t in live.items():
            assert bits(t) == bits(sds[v][k].float()), (v, k)
        assert sink.verify() == len(sds[v])


def test_coverage_error_names_the_live_memory_left_without_a_source(versions):
    store, sds, _ = versions
    live = engine(sds[0])
    pad = torch.zeros(2, I, device=DEVICE).bfloat16()  # padding the layout does not mention
    live["qkv"] = torch.cat([live["qkv"], pad])
    with pytest.raises(CoverageError, match=r"qkv \(12 of 84 elements\)"):
        TorchSink(store, live, 0, layout=layout())


@pytest.fixture(scope="module")
def sparse_store(tmp_path_factory, versions):
    """The same versions coded with ``sparse`` deltas (``--fast-codec``), whose payloads name the
    changed positions."""
    _, sds, _ = versions
    return publish_all(tmp_path_factory.mktemp("sparse"), sds, CodecConfig(entropy_coder=False)), sds


@MODES
def test_sparse_deltas_patch_from_the_payload_alone_and_are_verified_after_the_apply(sparse_store, mode):
    """One ``sparse`` delta from the model's version is patched from its positions and differences
    (the old values read from the model at those positions only), never rebuilt whole on the host;
    the result is checked against the checksums after the apply."""
    store, sds = sparse_store
    live = params(engine(sds[0]), mode)
    sink = TorchSink(store, live, 0, layout=layout(), mode=mode)
    calls = []
    real = TorchSink._stage_changes

    def spy(self, b, idx, diff):
        calls.append(b.seg.name)
        return real(self, b, idx, diff)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchSink, "_stage_changes", spy)
        up = sink.prepare(1)
        assert not up.checked and "experts.1.w" in calls and "col" not in calls  # the shard is mirrored: whole
        sink.apply(up)
        sink.after_apply(up)
        assert up.seconds["verify"] >= 0
        assert_engine_holds(live, sds[1])
        for v in (2, 4, 3):  # 1 -> 2 one delta; 2 -> 4 crosses a keyframe; 4 -> 3 goes back
            sink.update(v)
            assert_engine_holds(live, sds[v])
        sink.update(2)
        up = sink.prepare(3)  # 15% of the elements change: regions patched off the lock, copied whole
        assert not up.checked and (mode == "flip" or any(isinstance(p, _Copies) for p in up.patches))
        sink.apply(up)
        sink.after_apply(up)
        assert_engine_holds(live, sds[3])


@MODES
def test_a_model_changed_behind_the_sinks_back_is_caught_after_a_payload_patch_and_repaired(sparse_store, mode):
    store, sds = sparse_store
    live = params(engine(sds[0]), mode)
    sink = TorchSink(store, live, 0, layout=layout(), mode=mode)
    with torch.no_grad():
        live["moe.w"].view(-1)[5] += 1  # someone wrote into the live model: the delta lands on a wrong base
    up = sink.prepare(1)
    sink.apply(up)
    if mode == "flip":  # the standby was patched, not the written storage: the flip discards the write
        sink.after_apply(up)
        assert_engine_holds(live, sds[1])
        return
    with pytest.raises(BaseMismatchError, match="torn until the next update"):
        sink.after_apply(up)
    sink.update(2)
    assert_engine_holds(live, sds[2])


def test_interleaved_rows_are_a_valid_layout(versions):
    """Rows of two store tensors interleaved in one live tensor (as rope-permuted or interleaved
    checkpoints are): their address ranges meet, their elements do not."""
    store, sds, _ = versions
    full = layout()
    lay = Layout(
        [p for p in full.placements if p.source not in ("q", "k")]
        + [Placement("q", "qkv", stride=(2 * I, 1)), Placement("k", "qkv", offset=I, stride=(2 * I, 1))]
    )

    def interleaved(sd):
        live = engine(sd)
        qk = torch.stack([sd["q"], sd["k"]], dim=1).reshape(2 * D, I)  # q0 k0 q1 k1 ...
        live["qkv"] = torch.cat([qk, sd["v"]]).to(DEVICE)
        return live

    live = interleaved(sds[0])
    sink = TorchSink(store, live, 0, layout=lay)
    for v in (1, 4):
        sink.update(v)
        want = interleaved(sds[v])
        assert all(bits(live[k]) == bits(t) for k, t in want.items())
