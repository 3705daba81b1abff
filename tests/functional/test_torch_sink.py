"""The in-process torch sink (CPU here; the same code path serves CUDA tensors) and in-process
publishing from a state dict."""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash
from safetensors.torch import load_file

import weightsync
from weightsync.errors import BaseMismatchError, UsageError
from weightsync.publisher import StateDictPublisher, publish_state_dict
from weightsync.publishing import PublishConfig
from weightsync.synth import SyntheticTrainer, make_trajectory
from weightsync.torch import TorchSink

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Versions 0..5 of a tiny model (keyframes at 0 and 3) and each version's tensors."""
    root = tmp_path_factory.mktemp("sink")
    traj = make_trajectory(root / "traj", steps=5, **TINY)
    store = root / "store"
    for ckpt in traj:
        weightsync.publish(ckpt, store, config=PublishConfig(keyframe_interval=3))
    return str(store), [load_file(str(c / "model.safetensors")) for c in traj]


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_holds(tensors, expected: dict[str, torch.Tensor]) -> None:
    assert set(tensors) == set(expected)
    for name, t in expected.items():
        assert bits(tensors[name]) == bits(t), name


def copy_of(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items()}


def module_from(sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose state_dict() names are ``sd``'s names (dots become submodules)."""
    root = torch.nn.Module()
    for name, t in sd.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def test_sink_moves_a_model_through_versions_bit_exact(published):
    store, versions = published
    live = copy_of(versions[0])
    sink = TorchSink(store, live, 0)
    for v in (1, 2, 5, 3, 0, 4):
        up = sink.update(v)
        assert sink.version == v and up.version == v
        assert_holds(live, versions[v])
        assert up.seconds["pause"] < up.seconds["prepare"] + 1.0
    assert sink.verify() == len(versions[0])
    assert sink.update(4).patches == []  # already there


def test_serving_loop_never_sees_a_torn_model(published):
    store, versions = published
    live = copy_of(versions[0])
    names = sorted(live)

    def fingerprint(sd) -> str:
        h = xxhash.xxh3_64()
        for n in names:
            h.update(bits(sd[n]))
        return h.hexdigest()

    valid = {fingerprint(sd) for sd in versions}
    lock = threading.Lock()
    sink = TorchSink(store, live, 0, lock=lock)
    seen, stop = [], threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with lock:  # what a forward pass would do
                seen.append(fingerprint(live))

    server = threading.Thread(target=serve)
    server.start()
    try:
        for v in (1, 2, 3, 4, 5, 2, 5):
            sink.update(v)
    finally:
        stop.set()
        server.join()
    assert seen and set(seen) <= valid
    assert fingerprint(live) == fingerprint(versions[5])


def test_module_name_map_and_dense_copies(published):
    store, versions = published
    model = module_from({f"net.{k}": v for k, v in versions[0].items() if k != "model.step"})
    sink = TorchSink(store, model, 0, name_map=lambda n: None if n == "model.step" else f"net.{n}", dense_above=0.0)
    up = sink.update(2)
    assert up.patches and all(p.index is None for p in up.patches)  # every changed tensor copied whole
    assert_holds(model.state_dict(), {f"net.{k}": v for k, v in versions[2].items() if k != "model.step"})


def test_a_model_that_drifted_is_detected_and_repaired(published):
    store, versions = published
    live = copy_of(versions[1])
    sink = TorchSink(store, live, 1)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    live[name].view(-1).view(torch.int16)[7] += 1  # someone wrote into the model behind the sink's back
    with pytest.raises(BaseMismatchError):
        sink.verify()
    up = sink.prepare(2)  # the bytes it would start from are wrong: rebuilt from the keyframe instead
    sink.apply(up)
    assert_holds(live, versions[2])


def test_updates_are_refused_when_they_cannot_apply(published):
    store, versions = published
    with pytest.raises(UsageError, match="cannot patch in place"):
        TorchSink(store, {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in versions[0].items()}, 0)
    with pytest.raises(UsageError, match="no tensor"):
        TorchSink(store, {"other": torch.zeros(3)}, 0)
    live = copy_of(versions[0])
    sink = TorchSink(store, live, 0)
    stale = sink.prepare(3)
    sink.update(1)
    with pytest.raises(UsageError, match="prepared from version 0"):
        sink.apply(stale)
    assert_holds(live, versions[1])


def test_publish_state_dict_in_process(tmp_path):
    store = tmp_path / "store"
    trainer = SyntheticTrainer(**TINY)

    def state() -> dict[str, torch.Tensor]:
        sd = {n: torch.from_numpy(w).to(torch.bfloat16) for n, w in trainer.master.items()}
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied weights share storage
        return sd

    states = []
    with StateDictPublisher(store, work_dir=tmp_path / "work") as pub:
        for step in range(3):
            if step:
                trainer.step()
            states.append(state())
            r = pub.publish(states[-1], version=10 * step)
            assert r.version == 10 * step and r.keyframe == (step == 0)
            if step:
                assert r.payload_bytes < r.raw_bytes / 5  # a delta against the previous step's bytes
        assert len(list((tmp_path / "work").glob("*/*"))) == 1  # only the newest serialized copy is kept
    assert not list((tmp_path / "work").iterdir())
    trainer.step()
    states.append(state())
    r = publish_state_dict(states[-1], store, cache_dir=tmp_path / "cache", work_dir=tmp_path / "work")
    assert r.version == 21 and not r.keyframe
    for v, sd in zip((0, 10, 20, 21), states):
        out = tmp_path / f"pulled-{v}"
        weightsync.pull(store, out, v)
        got = load_file(str(out / "model.safetensors"))
        assert_holds(got, sd)
