"""The in-process torch sink in both modes, patch and flip (CPU here; the same code path serves
CUDA tensors), and in-process publishing from a state dict."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
import xxhash
from engine_worker import module_from  # (the engine worker script builds its models the same way)
from safetensors.torch import load_file

import weightsync
import weightsync.torch.sink as wtorch
from weightsync.demo import SyntheticTrainer, make_trajectory
from weightsync.errors import BaseMismatchError, NotFoundError, UsageError
from weightsync.format.keys import chunk_key
from weightsync.sync.publish import PublishConfig
from weightsync.torch.sink import TorchSink
from weightsync.torch.state_dict import StateDictPublisher, publish_state_dict

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
MODES = pytest.mark.parametrize("mode", ["patch", "flip"])


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


def copy_of(sd: dict[str, torch.Tensor], mode: str = "patch") -> dict[str, torch.Tensor]:
    """Clones of ``sd``'s tensors: plain tensors for patch mode, Parameters for flip mode (which
    needs the objects the engine reads through)."""
    if mode == "flip":
        return {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in sd.items()}
    return {k: v.clone() for k, v in sd.items()}


@MODES
def test_sink_moves_a_model_through_versions_bit_exact(published, mode):
    store, versions = published
    live = copy_of(versions[0], mode)
    sink = TorchSink(store, live, 0, mode=mode)
    for v in (1, 2, 5, 3, 0, 4):
        up = sink.update(v)
        assert sink.version == v and up.version == v
        assert_holds(live, versions[v])
        assert up.seconds["pause"] < up.seconds["prepare"] + 1.0
    assert sink.verify() == len(versions[0])
    assert sink.update(4).patches == []  # already there


@MODES
def test_serving_loop_never_sees_a_torn_model(published, mode):
    store, versions = published
    live = copy_of(versions[0], mode)
    names = sorted(live)

    def fingerprint(sd) -> str:
        h = xxhash.xxh3_64()
        for n in names:
            h.update(bits(sd[n]))
        return h.hexdigest()

    valid = {fingerprint(sd) for sd in versions}
    lock = threading.Lock()
    sink = TorchSink(store, live, 0, lock=lock, mode=mode)
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


@MODES
def test_module_name_map_and_dense_copies(published, mode):
    store, versions = published
    model = module_from({f"net.{k}": v for k, v in versions[0].items() if k != "model.step"})
    sink = TorchSink(
        store, model, 0, name_map=lambda n: None if n == "model.step" else f"net.{n}", dense_above=0.0, mode=mode
    )
    up = sink.update(2)
    assert up.patches and all(p.index is None for p in up.patches)  # every changed tensor copied whole
    assert_holds(model.state_dict(), {f"net.{k}": v for k, v in versions[2].items() if k != "model.step"})


@MODES
def test_a_model_that_drifted_is_detected_and_repaired(published, mode):
    store, versions = published
    live = copy_of(versions[1], mode)
    sink = TorchSink(store, live, 1, mode=mode)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert bits(versions[1][name]) != bits(versions[2][name]) and bits(versions[2][name]) != bits(versions[3][name])
    live[name].view(-1).view(torch.int16)[7] += 1  # someone wrote into the model behind the sink's back
    with pytest.raises(BaseMismatchError):
        sink.verify()
    # patch: the bytes it would start from are wrong, rebuilt from the keyframe instead; flip: the
    # standby still holds version 1, and the drifted storage, retired, is caught by the next update
    up = sink.prepare(2)
    sink.apply(up)
    assert_holds(live, versions[2])
    up = sink.update(3)
    assert_holds(live, versions[3])
    assert sink.verify() == len(versions[3])
    # neither mode needed the keyframe for this step (flip: the standby was copied from live again)
    assert up.fetched_bytes == TorchSink(store, copy_of(versions[2], mode), 2, mode=mode).prepare(3).fetched_bytes


@MODES
def test_updates_are_refused_when_they_cannot_apply(published, mode):
    store, versions = published
    with pytest.raises(UsageError, match="cannot patch in place"):  # a shape the identity layout cannot explain
        TorchSink(store, copy_of({k: v.reshape(-1) for k, v in versions[0].items()}, mode), 0, mode=mode)
    with pytest.raises(UsageError, match="cannot patch in place"):  # nor a cast between float and integers
        TorchSink(
            store,
            copy_of({k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v for k, v in versions[0].items()}, mode),
            0,
            mode=mode,
        )
    with pytest.raises(UsageError, match="no tensor"):
        TorchSink(store, copy_of({"other": torch.zeros(3)}, mode), 0, mode=mode)
    name = next(iter(versions[0]))
    meta = copy_of(versions[0], mode)
    meta[name] = torch.nn.Parameter(torch.empty_like(meta[name], device="meta"), requires_grad=False)
    with pytest.raises(UsageError, match=f"^{name} is a meta tensor"):  # not torch's "Cannot copy out of meta"
        TorchSink(store, meta, 0, mode=mode)
    live = copy_of(versions[0], mode)
    sink = TorchSink(store, live, 0, mode=mode)
    stale = sink.prepare(3)
    sink.update(1)
    with pytest.raises(UsageError, match="prepared from version 0"):
        sink.apply(stale)
    assert_holds(live, versions[1])


def test_a_compiled_module_is_refused_with_the_module_to_pass(published):
    store, versions = published
    model = torch.compile(module_from(versions[0]))  # (compiles at its first call only)
    with pytest.raises(UsageError, match=r"torch.compile'd module .*: pass model._orig_mod; no tensor"):
        TorchSink(store, model, 0)
    TorchSink(store, model._orig_mod, 0)


@MODES
def test_a_model_that_cast_on_load_follows_the_cast_of_each_version(published, mode):
    """An engine that loads bf16 weights into fp32 holds the cast values: the sink keeps it there
    (every live value the exact cast of the store's), and a live value that is not such a cast is
    a mismatch, not a silent pass."""
    store, versions = published
    wide = lambda v: {k: t.float() if t.dtype == torch.bfloat16 else t for k, t in v.items()}  # noqa: E731
    live = copy_of(wide(versions[0]), mode)
    sink = TorchSink(store, live, 0, mode=mode)
    for v in (1, 3, 2):
        sink.update(v)
        assert_holds(live, wide(versions[v]))
        assert sink.verify() > 0
    name = next(k for k, t in live.items() if t.dtype == torch.float32)
    with torch.no_grad():
        live[name].view(-1)[0] = live[name].view(-1)[0] + 1e-6  # not a bf16 value any more
    with pytest.raises(BaseMismatchError, match=f"{name}: a value"):
        sink.verify()


# -- flip mode ----------------------------------------------------------------------------------------
def storages(tensors) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in tensors.items()}


def test_flip_keeps_the_objects_and_swaps_between_two_storages(published):
    store, versions = published
    model = module_from(versions[0])
    params = dict(model.named_parameters())
    first = storages(params)
    sink = TorchSink(store, model, 0, mode="flip")
    twin = TorchSink(store, copy_of(versions[0]), 0, mode="patch")
    seen = {n: {p} for n, p in first.items()}
    prev = 0
    for v in (1, 2, 5, 3, 0, 4):  # forward, then back (rollbacks), then forward again
        before = storages(params)
        up = sink.update(v)
        same = twin.update(v)  # the standby was caught up exactly: the same plan as patching in place
        assert (up.fetched_bytes, up.changed_elements) == (same.fetched_bytes, same.changed_elements)
        assert dict(model.named_parameters()) == params and all(params[n] is p for n, p in model.named_parameters())
        assert_holds(model.state_dict(), versions[v])
        flipped = {n for f in up.flips for n in f.names}
        assert flipped and flipped == {p.name for p in up.patches}
        for n, p in params.items():
            assert (p.data_ptr() != before[n]) == (n in flipped), n  # only the changed tensors were repointed
            seen[n].add(p.data_ptr())
        # the pause copied nothing: each retired storage still holds the previous version (the next
        # prepare brings it forward), and the objects hold the standby that prepare wrote
        for f in up.flips:
            assert bits(f.old) == bits(versions[prev][f.names[0]]) and params[f.names[0]].data_ptr() == f.new.data_ptr()
        prev = v
    assert all(len(ptrs) <= 2 for ptrs in seen.values())  # double buffering: no third storage ever
    assert any(len(ptrs) == 2 for ptrs in seen.values())
    assert sink.verify() == len(versions[0])


@MODES
def test_a_no_op_update_leaves_the_staged_one_alone(published, mode):
    store, versions = published
    live = copy_of(versions[0], mode)
    sink = TorchSink(store, live, 0, mode=mode)
    staged = sink.prepare(1)
    noop = sink.prepare(0)  # e.g. a poller asking for the version the model already holds
    assert (noop.version, noop.from_version, noop.patches, noop.flips) == (0, 0, [], [])
    pause = sink.apply(noop)
    assert sink.version == 0
    assert_holds(live, versions[0])
    sink.apply(staged)  # still staged: the no-op changed nothing
    assert sink.version == 1
    assert_holds(live, versions[1])
    assert pause == noop.seconds["pause"] == 0.0  # nothing to swap: the serving lock was not even taken


def test_flip_keeps_only_int32_positions_between_updates(published):
    """Between an apply and the next prepare the sink holds, besides the standby buffers, only the
    positions the last update changed (int32), to replay them onto the retired storage from the
    live one; prepare consumes them."""
    store, versions = published
    live = copy_of(versions[0], "flip")
    sink = TorchSink(store, live, 0, mode="flip", dense_above=1.0)
    assert sink.replay_bytes == 0 and sink.standby_bytes == sum(t.numel() * t.element_size() for t in live.values())
    up = sink.update(2)
    assert up.flips and all(p.index is not None and p.index.dtype == torch.int32 for p in up.patches)
    assert sink.replay_bytes == 4 * up.changed_elements > 0
    assert all(r.values.data_ptr() == f.new.data_ptr() for f in up.flips for r in f.replay)  # no copy of the values
    staged = sink.prepare(3)
    assert sink.replay_bytes == 0
    sink.apply(staged)
    assert_holds(live, versions[3])
    assert sink.replay_bytes == 4 * staged.changed_elements
    assert TorchSink(store, copy_of(versions[3]), 3).replay_bytes == 0  # patch mode keeps nothing after apply


class TiedLM(torch.nn.Module):
    """A tiny language model whose output head shares the embedding's Parameter."""

    def __init__(self, vocab: int = 96, dim: int = 24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.lm_head(self.norm(h + torch.tanh(self.proj(h)) * self.scale))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """Versions 0..4 of a TiedLM in bf16 (small fp32 steps, a keyframe at 0 and 3), and version 9
    whose head no longer equals the embedding."""
    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    master = {n: t.detach().float().clone() for n, t in TiedLM().state_dict().items() if n != "lm_head.weight"}
    versions = {}
    with StateDictPublisher(root / "store", config=PublishConfig(keyframe_interval=3), work_dir=root / "work") as pub:
        for v in range(5):
            if v:
                for n, w in master.items():
                    w += 3e-3 * torch.randn_like(w) * (torch.rand_like(w) < 0.2)
            sd = {n: w.to(torch.bfloat16) for n, w in master.items()}
            sd["lm_head.weight"] = sd["embed.weight"]
            pub.publish(sd, version=v)
            versions[v] = {n: t.clone() for n, t in sd.items()}
        sd = {n: w.to(torch.bfloat16) for n, w in master.items()}
        sd["lm_head.weight"] = (master["embed.weight"] * 1.5).to(torch.bfloat16)
        pub.publish(sd, version=9)
    return str(root / "store"), versions


def loaded(sd: dict[str, torch.Tensor]) -> TiedLM:
    m = TiedLM().to(torch.bfloat16)
    m.load_state_dict(sd)
    return m.eval()


@MODES
def test_forward_after_apply_equals_a_freshly_loaded_model(tied, mode):
    store, versions = tied
    model = loaded(versions[0])
    head = model.lm_head.weight
    ids = torch.arange(64).reshape(4, 16) % 96
    sink = TorchSink(store, model, 0, mode=mode)
    for v in (2, 3, 1, 4, 0):
        before = model(ids)
        up = sink.update(v)
        with torch.no_grad():
            out = model(ids)
        assert not torch.equal(out, before)
        assert torch.equal(out, loaded(versions[v])(ids))
        assert model.lm_head.weight is model.embed.weight is head  # still tied, still the same Parameter
        assert_holds(model.state_dict(), versions[v])
        if mode == "flip":  # the tied Parameter is one tensor, repointed once under both names
            tied_flips = [f for f in up.flips if "embed.weight" in f.names]
            assert len(tied_flips) == 1 and set(tied_flips[0].names) == {"embed.weight", "lm_head.weight"}
            assert tied_flips[0].objects == (head,) and head.data_ptr() == tied_flips[0].new.data_ptr()
            assert sum(f.names.count("embed.weight") for f in up.flips) == 1


@MODES
def test_refuses_a_version_that_unties_tied_weights(tied, mode):
    store, versions = tied
    model = loaded(versions[1])
    sink = TorchSink(store, model, 1, mode=mode)
    with pytest.raises(UsageError, match="one tensor in the model but differ in version 9"):
        sink.prepare(9)
    assert_holds(model.state_dict(), versions[1])
    up = sink.update(4)
    assert_holds(model.state_dict(), versions[4])
    if mode == "patch":  # the shared memory is patched once, under one of its names
        assert sum(n in ("embed.weight", "lm_head.weight") for p in up.patches for n in p.names) == 1


def test_flip_refuses_tensors_that_overlap_without_being_one(published):
    store, versions = published
    live = copy_of(versions[0], "flip")
    live["alias"] = torch.nn.Parameter(live["model.embed_tokens.weight"].detach().view(-1)[8:40], requires_grad=False)
    with pytest.raises(UsageError, match="model.embed_tokens.weight and alias share memory"):
        TorchSink(
            store, live, 0, mode="flip", exclude=["alias"]
        )  # not in the store, would keep reading the retired storage
    TorchSink(store, live, 0, mode="patch", exclude=["alias"])  # patching in place does not care
    with pytest.raises(UsageError, match="mode"):
        TorchSink(store, copy_of(versions[0], "flip"), 0, mode="swap")
    # excluded tensors are left alone, overlapping or not, as long as no managed tensor is involved
    live = copy_of(versions[0], "flip")
    spare = torch.zeros(64, dtype=torch.int16)
    live["spare.all"] = torch.nn.Parameter(spare, requires_grad=False)
    live["spare.head"] = torch.nn.Parameter(spare[:8], requires_grad=False)
    sink = TorchSink(store, live, 0, mode="flip", exclude=["spare.*"])
    sink.update(2)
    assert_holds({k: v for k, v in live.items() if not k.startswith("spare.")}, versions[2])


def fused(sd: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat buffer holding every tensor of ``sd``, and non-overlapping views into it by name."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in sd.values()])
    views, at = {}, 0
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        views[k] = flat[at : at + n].view(t.dtype).view(t.shape)
        at += n
    return flat, views


def test_flip_refuses_what_repointing_would_not_reach(published, tied):
    """Flip mode repoints tensor objects: it must refuse tensors whose repointing the engine would
    never see, or it would stop updating the model and later write the standby (the engine's real
    storage) without the lock."""
    store, versions = published
    model = module_from(versions[0])
    with pytest.raises(UsageError, match="not a Parameter.*detached alias.*mode='patch'"):
        TorchSink(store, model.state_dict(), 0, mode="flip")  # detached aliases of the module's storages
    with pytest.raises(UsageError, match="not a Parameter"):
        TorchSink(store, copy_of(versions[0]), 0, mode="flip")  # plain tensors: whose objects are they?
    flat, views = fused(versions[0])
    with pytest.raises(UsageError, match="view into a larger buffer"):
        TorchSink(store, {k: torch.nn.Parameter(v, requires_grad=False) for k, v in views.items()}, 0, mode="flip")
    # patch mode writes in place: all of these are fine, and the fused buffer itself is updated
    for live in (model.state_dict(), views):
        TorchSink(store, live, 0).update(1)
    assert_holds(model.state_dict(), versions[1])
    assert bits(flat) == b"".join(bits(versions[1][k]) for k in views)
    # a module's own buffer that views a larger storage is refused like a Parameter
    tied_store, tied_versions = tied
    lm = loaded(tied_versions[0])
    big = torch.ones(2 * lm.scale.numel(), dtype=lm.scale.dtype)
    lm.scale = big[: lm.scale.numel()]  # assigning a tensor to a registered buffer replaces it
    with pytest.raises(UsageError, match="scale: a view into a larger buffer"):
        TorchSink(tied_store, lm, 0, mode="flip")
    TorchSink(tied_store, loaded(tied_versions[0]), 0, mode="flip").update(2)  # the same model, unviewed, is fine


def test_flip_refuses_updates_no_longer_staged(published):
    store, versions = published
    live = copy_of(versions[0], "flip")
    sink = TorchSink(store, live, 0, mode="flip")
    a = sink.prepare(2)
    b = sink.prepare(3)  # the standby now holds version 3: a's flips would swap in the wrong bytes
    with pytest.raises(UsageError, match="no longer staged"):
        sink.apply(a)
    assert_holds(live, versions[0])
    sink.apply(b)
    assert_holds(live, versions[3])
    with pytest.raises(UsageError, match="prepared from version 0"):
        sink.apply(a)
    patch_up = TorchSink(store, copy_of(versions[3]), 3).prepare(4)
    with pytest.raises(UsageError, match="patch mode"):
        sink.apply(patch_up)
    assert_holds(live, versions[3])
    sink.update(4)
    assert_holds(live, versions[4])


def test_flip_notices_a_storage_repointed_behind_its_back(published):
    store, versions = published
    live = copy_of(versions[0], "flip")
    sink = TorchSink(store, live, 0, mode="flip")
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    up = sink.prepare(2)
    assert name in {n for f in up.flips for n in f.names}
    live[name].data = live[name].clone()  # e.g. an engine reloading one tensor on its own
    with pytest.raises(UsageError, match="repointed"):
        sink.apply(up)
    assert_holds(live, versions[0])
    up = sink.prepare(2)
    assert up.fetched_bytes == TorchSink(store, copy_of(versions[0], "flip"), 0, mode="flip").prepare(2).fetched_bytes
    sink.apply(up)
    assert_holds(live, versions[2])
    sink.update(4)
    assert_holds(live, versions[4])


def test_flip_prepare_failing_midway_leaves_the_model_and_the_sink_usable(published, monkeypatch):
    store, versions = published
    live = copy_of(versions[0], "flip")
    before = storages(live)
    sink = TorchSink(store, live, 0, mode="flip")
    staged = sink.prepare(1)
    real = wtorch.build_tensors

    def fails_after_three(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == 3:
                raise RuntimeError("disk on fire")
            yield item

    monkeypatch.setattr(wtorch, "build_tensors", fails_after_three)
    with pytest.raises(RuntimeError, match="disk on fire"):
        sink.prepare(2)  # three tensors of version 2 were already written into the standby
    monkeypatch.setattr(wtorch, "build_tensors", real)
    assert_holds(live, versions[0])
    assert storages(live) == before and sink.version == 0
    with pytest.raises(UsageError, match="no longer staged"):
        sink.apply(staged)
    up = sink.prepare(2)
    # the standby was brought back from the live tensors, not rebuilt from the keyframe
    assert up.fetched_bytes == TorchSink(store, copy_of(versions[0], "flip"), 0, mode="flip").prepare(2).fetched_bytes
    sink.apply(up)
    assert_holds(live, versions[2])
    for v in (3, 1, 5):
        sink.update(v)
        assert_holds(live, versions[v])


def test_flip_prepare_with_a_damaged_store_leaves_the_model_intact(published, tmp_path):
    src, versions = published
    store = tmp_path / "store"
    shutil.copytree(src, store)
    repo = weightsync.open_repo(str(store))
    older = {c.id for v in (0, 1) for c in repo.manifest(v).chunks}
    gone = [c.id for c in repo.manifest(2).chunks if c.id not in older]
    assert gone
    for cid in gone:
        (store / chunk_key(cid)).rename(tmp_path / cid)
    live = copy_of(versions[1], "flip")
    before = storages(live)
    sink = TorchSink(str(store), live, 1, mode="flip")
    with pytest.raises(NotFoundError, match="missing chunk"):
        sink.prepare(2)
    assert_holds(live, versions[1])
    assert storages(live) == before
    for cid in gone:
        (tmp_path / cid).rename(store / chunk_key(cid))
    sink.update(2)
    assert_holds(live, versions[2])
    sink.update(0)
    assert_holds(live, versions[0])


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
        kept = [p for p in (tmp_path / "work").glob("*/*") if p.name != ".weightsync"]  # (its claim: local.scratch)
        assert len(kept) == 1  # only the newest serialized copy is kept
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
