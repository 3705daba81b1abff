"""weightsync.torch.loader: an engine's own loader fed the tensors that changed between versions
(CPU, a file store): a module with a vLLM-like ``load_weights`` (the reference engine of
tests/engine_ref.py, rank 1 of TP 2) and an object with SGLang's ``update_weights_from_tensor``."""

from __future__ import annotations

import pytest
import torch
from engine_ref import bits, build, checkpoint, engine_mappings, fill, load_weights, ranks_for
from torch import nn

import weightsync
from weightsync.errors import UsageError
from weightsync.store.repo import open_repo
from weightsync.sync.publish import PublishConfig
from weightsync.torch.loader import EngineLoader, changed, sglang_update_weights_from_tensor, vllm_load_weights
from weightsync.torch.state_dict import StateDictPublisher, publish_state_dict

FAMILY, ENGINE = "qwen3_moe", "vllm"
CHANGED_1 = [  # what step 1 changes
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.experts.2.up_proj.weight",
    "model.embed_tokens.weight",
]
CHANGED_2 = ["model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"]


def _step(sd: dict[str, torch.Tensor], names: list[str], salt: int) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in sd.items()}
    for i, n in enumerate(names):
        flat = out[n].view(-1)
        flat[(salt + 7 * i) % flat.numel()] += 1.0  # one element moves
    return out


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Versions 0, 1, 2 of a tiny Qwen3-MoE (keyframe every 2) and their state dicts."""
    root = tmp_path_factory.mktemp("loader")
    store = str(root / "store")
    v0 = checkpoint(FAMILY)
    v1 = _step(v0, CHANGED_1, 1)
    v2 = _step(v1, CHANGED_2, 2)
    with StateDictPublisher(store, config=PublishConfig(keyframe_interval=2), work_dir=root / "work") as p:
        for v in (v0, v1, v2):
            p.publish(v)
    return store, [v0, v1, v2], root


class Engine(nn.Module):
    """The reference engine's rank with vLLM's ``load_weights(iter[(name, tensor)])``, recording
    what it is handed."""

    def __init__(self):
        super().__init__()
        self.ranks = ranks_for(ENGINE, 2, 1, 1)
        self.model = build(FAMILY, ENGINE, self.ranks)
        fill(self.model)
        self.calls: list[list[str]] = []

    def load_weights(self, weights):
        batch = list(weights)
        self.calls.append([n for n, _ in batch])
        load_weights(self.model, batch, *engine_mappings(FAMILY, ENGINE))


def loaded(sd) -> nn.Module:
    """The reference rank loaded from scratch with ``sd``."""
    e = Engine()
    e.load_weights(sd.items())
    return e.model


def assert_same(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(bits(pa[n].data), bits(pb[n].data)), n


def test_changed_compares_tensor_checksums(versions):
    store, _, _ = versions
    repo = open_repo(store)
    m0, m1, m2 = (repo.manifest(v) for v in range(3))
    assert sorted(s.name for _, s in changed(m0, m1)[0]) == sorted(CHANGED_1)
    assert sorted(s.name for _, s in changed(m1, m2)[0]) == sorted(CHANGED_2)
    assert len(changed(None, m2)[0]) == len(checkpoint(FAMILY)) and changed(m0, m2)[1] == []


def test_only_changed_tensors_reach_the_engine_and_it_ends_at_the_new_version(versions):
    store, sds, _ = versions
    engine = Engine()
    engine.load_weights(sds[0].items())
    engine.calls.clear()
    loader = EngineLoader(store, vllm_load_weights(engine), version=0)
    report = loader.update(1)
    assert sorted(report.tensors) == sorted(CHANGED_1) and engine.calls == [report.tensors]
    assert report.bytes == sum(sds[1][n].numel() * 2 for n in CHANGED_1)
    assert_same(engine.model, loaded(sds[1]))
    report = loader.update("latest")
    assert (report.from_version, report.version, sorted(report.tensors)) == (1, 2, sorted(CHANGED_2))
    assert_same(engine.model, loaded(sds[2]))
    assert loader.update("latest").tensors == [] and len(engine.calls) == 2  # nothing to do


def test_a_base_folder_serves_as_the_delta_base(versions, tmp_path):
    """From a folder holding version 1, version 2's changes cost their deltas, not the keyframe's."""
    store, sds, _ = versions
    weightsync.pull(store, tmp_path / "v1", 1)
    engine = Engine()
    engine.load_weights(sds[1].items())
    with_base = EngineLoader(store, vllm_load_weights(engine), version=1, base_dir=tmp_path / "v1").update(2)
    plain = EngineLoader(store, vllm_load_weights(Engine()), version=1).update(2)
    assert sorted(with_base.tensors) == sorted(plain.tensors) == sorted(CHANGED_2)
    assert with_base.fetched_bytes < plain.fetched_bytes  # version 2 is a keyframe: plain fetches it in full
    assert_same(engine.model, loaded(sds[2]))


def test_a_failed_load_tears_the_engine_and_the_next_update_loads_everything(versions):
    store, sds, _ = versions
    engine = Engine()
    engine.load_weights(sds[0].items())
    fail = {"now": True}

    def load(batch):
        if fail["now"]:
            engine.load_weights(batch[:1])  # part of it went in
            raise RuntimeError("engine fell over")
        engine.load_weights(batch)

    loader = EngineLoader(store, load, version=0, batch_bytes=1)
    with pytest.raises(RuntimeError, match="fell over"):
        loader.update(1)
    assert loader.version == 0
    fail["now"] = False
    report = loader.update(1)
    assert len(report.tensors) == len(sds[1]) and report.calls == len(sds[1])  # one tensor per call
    assert_same(engine.model, loaded(sds[1]))


def test_sglang_batches_without_flushing_then_flushes_once(versions):
    store, sds, _ = versions

    class SGLangEngine:
        def __init__(self):
            self.calls, self.flushes = [], 0

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            self.calls.append(([n for n, _ in named_tensors], load_format, flush_cache))

        def flush_cache(self):
            self.flushes += 1

    e = SGLangEngine()
    report = EngineLoader(store, sglang_update_weights_from_tensor(e), version=0, batch_bytes=1).update(1)
    assert [c[0] for c in e.calls] == [[n] for n in report.tensors] and e.flushes == 1
    assert {(c[1], c[2]) for c in e.calls} == {(None, False)}


def test_a_version_without_a_tensor_the_engine_holds_is_refused(versions, tmp_path):
    _, sds, _ = versions
    forked = str(tmp_path / "store")
    publish_state_dict(sds[0], forked)
    publish_state_dict({n: t for n, t in sds[0].items() if n != "model.norm.weight"}, forked)
    loader = EngineLoader(forked, lambda batch: None, version=0)
    with pytest.raises(UsageError, match="version 1 lacks 1 tensor\\(s\\) of version 0 \\(model.norm.weight\\)"):
        loader.update(1)
    assert EngineLoader(forked, lambda batch: None, version=0, exclude=["*.norm.weight"]).update(1).tensors == []
