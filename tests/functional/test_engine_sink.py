"""The sink in an engine's worker process, through vLLM's and SGLang's layouts (weightsync.torch.engines):
each tensor-/expert-parallel rank holds its slice of fused, stacked and padded parameters, and
follows a store to every version bit for bit, ending where the engine's own loader (the reference
engine of tests/engine_ref.py) would put that version; and from a local folder, without the store."""

from __future__ import annotations

import pytest
import torch
from engine_ref import build, checkpoint, engine_mappings, fill, load_weights, ranks_for, rules_for

from weightsync.store.repo import open_repo
from weightsync.sync.publish import PublishConfig
from weightsync.sync.pull import pull
from weightsync.torch.sink import TorchSink
from weightsync.torch.state_dict import StateDictPublisher

VERSIONS = 4


def steps(family: str) -> list[dict[str, torch.Tensor]]:
    """Versions of the family's checkpoint: 3% of each tensor's elements move by one ulp per step."""
    g = torch.Generator().manual_seed(7)
    out = [checkpoint(family)]
    for _ in range(VERSIONS - 1):
        nxt = {}
        for k, t in out[-1].items():
            bits = t.clone().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
            bits.add_((torch.rand(bits.shape, generator=g) < 0.03).to(bits.dtype))
            nxt[k] = bits.view(t.dtype).view(t.shape)
        out.append(nxt)
    return out


def engine_model(family, engine, ranks, sd):
    """What the engine holds after loading ``sd`` with its own loader."""
    model = build(family, engine, ranks)
    fill(model)
    stacked, experts = engine_mappings(family, engine)
    load_weights(model, [(n, t) for n, t in sd.items() if not n.startswith("model.layers.2.")], stacked, experts)
    return model


def differing(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return [n for n in pa if not torch.equal(pa[n].data.view(torch.uint8), pb[n].data.view(torch.uint8))]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek"])
def published(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    sds = steps(family)
    with StateDictPublisher(root / "store", config=PublishConfig(keyframe_interval=2), work_dir=root / "w") as pub:
        for v, sd in enumerate(sds):
            pub.publish(sd, version=v)
    return family, str(root / "store"), sds, root


@pytest.mark.parametrize("engine,tp,ep", [("vllm", 2, 1), ("vllm", 2, 2), ("sglang", 2, 2)])
@pytest.mark.parametrize("mode", ["patch", "flip"])
def test_every_rank_follows_the_store_as_the_engine_would_load_it(published, engine, tp, ep, mode):
    family, store, sds, _ = published
    rules = rules_for(family, engine)
    for rank in range(tp):
        ranks = ranks_for(engine, tp, ep, rank)
        model = engine_model(family, engine, ranks, sds[0])
        sink = TorchSink(store, model, 0, layout=rules.layout(ranks), mode=mode)
        for v in (1, 2, 3, 1):
            sink.update(v)
            assert differing(model, engine_model(family, engine, ranks, sds[v])) == [], (rank, v)
        assert sink.verify() > 0


def test_a_rank_follows_a_local_folder_without_the_store(published):
    """The node path: versions come from a folder the subscriber holds, nothing from the store, no
    host copy of the tensors the rank holds only in part."""
    family, store, sds, root = published
    repo = open_repo(store)
    rules, ranks = rules_for(family, "vllm"), ranks_for("vllm", 2, 1, 1)
    folders = []
    for v in range(VERSIONS):
        pull(store, root / f"folder{v}", v)
        folders.append(root / f"folder{v}")
    model = engine_model(family, "vllm", ranks, sds[0])
    sink = TorchSink(None, model, 0, layout=rules.layout(ranks), manifest=repo.manifest(0), folder=folders[0])
    assert sink.mirror_bytes == 0
    for v in (1, 2, 3):
        sink.apply(sink.prepare(v, folder=folders[v], manifest=repo.manifest(v)))
        assert differing(model, engine_model(family, "vllm", ranks, sds[v])) == []
        assert sink.verify(folder=folders[v]) > 0
