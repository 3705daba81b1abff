"""Rollbacks that undo deltas: a folder holding a newer version pulls an older one by running the
invertible deltas between them backward (``ans``, ``sparse``, ``dense``), fetching no keyframe
payload; with ``ac`` deltas it plans from the keyframe as before. Real publishes into a ``file://`` store,
real pulls; every installed byte compared with the source checkpoint, and every failure leaves
the folder holding its old version whole."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from weightsync.codec.payload import CodecConfig
from weightsync.demo import make_trajectory, write_safetensors
from weightsync.errors import ChecksumError
from weightsync.format.keys import chunk_key, signature_key, version_key
from weightsync.format.manifest import Manifest, Payload, manifest_to_json
from weightsync.format.safetensors import parse_safetensors_header
from weightsync.local.state import read_state
from weightsync.store.repo import open_repo
from weightsync.sync.plan import plan_pull
from weightsync.sync.publish import PublishConfig, publish
from weightsync.sync.pull import PullConfig, pull, verify
from weightsync.sync.selection import Selection, materialize

TINY = {"hidden": 64, "layers": 1, "experts": 2, "vocab": 256}  # ans: some blocks list exceptions (apart)
FORWARD = PullConfig(backward=False)  # today's plan: from the keyframe, nothing undone


def publish_all(store: Path, checkpoints: list[Path], codec: CodecConfig, interval: int = 3) -> None:
    cfg = PublishConfig(codec=codec, keyframe_interval=interval)
    for v, ckpt in enumerate(checkpoints):
        publish(ckpt, store, v, config=cfg, base_dir=checkpoints[v - 1] if v else None)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, list[Path]]:
    """Versions 0..5 of a tiny MoE in two shards (keyframes at 0 and 3, each carrying its delta),
    published three times: ``sparse`` deltas (``--fast-codec``), the default ``ans`` and ``ac``."""
    root = tmp_path_factory.mktemp("rollback")
    traj = make_trajectory(root / "traj", steps=5, shards=2, **TINY)
    publish_all(root / "sparse", traj, CodecConfig(entropy_coder=False))
    publish_all(root / "ans", traj, CodecConfig())
    publish_all(root / "ac", traj, CodecConfig(coder="ac"))
    return root, traj


@pytest.fixture
def sparse(stores, tmp_path) -> tuple[Path, list[Path]]:
    """A copy of the ``sparse`` store this test may damage, and the checkpoints."""
    root, traj = stores
    shutil.copytree(root / "sparse", tmp_path / "store")
    return tmp_path / "store", traj


def files_of(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file() and p.relative_to(folder).parts[0] != ".weightsync"
    }


def at(store: Path, version: int, folder: Path) -> Path:
    """``folder`` holding ``version`` (pulled from scratch)."""
    pull(store, folder, version)
    return folder


def delta_bytes(m: Manifest, reverse: bool = True) -> int:
    """The bytes of the chunks that hold ``m``'s deltas (a keyframe's own deltas, not its full
    payloads), and (``reverse``) their reverse payloads."""
    return sum(c.size for c in m.chunks if c.id in delta_chunks(m, reverse))


def delta_chunks(m: Manifest, reverse: bool = True, forward: bool = True) -> set[str]:
    """The chunks of ``m``'s delta payloads (``forward``) and of their reverse payloads (``reverse``)."""
    ids = set()
    for f in m.files:
        for s in f.segments:
            enc = s.delta if s.codec == "full" else s
            if enc is not None and enc.payload is not None:
                for p in (enc.payload if forward else None, enc.payload.reverse if reverse else None):
                    if p is not None:
                        ids.update(m.chunks[x.chunk].id for x in p.parts)
    return ids


def full_bytes(m: Manifest) -> int:
    """The bytes of a keyframe's full payloads."""
    return sum(s.payload.size for f in m.files for s in f.segments if s.codec == "full")


@pytest.mark.parametrize("codec", ["sparse", "ans"])
@pytest.mark.parametrize("local,target", [(5, 4), (5, 3), (2, 1), (2, 0), (4, 2), (5, 2)])
def test_rollback_fetches_only_the_deltas_it_undoes(stores, tmp_path, codec, local, target):
    """By one and by two versions, onto a keyframe (5 -> 3, 2 -> 0) and across one (4 -> 2, 5 -> 2
    undo keyframe 3's own delta): only delta chunks are fetched, far fewer bytes than from the
    keyframe, and the folder holds the checkpoint byte for byte."""
    root, traj = stores
    store = root / codec
    repo = open_repo(store)
    undone = [repo.manifest(v) for v in range(target + 1, local + 1)]
    before = pull(store, at(store, local, tmp_path / "before"), target, config=FORWARD)
    after = pull(store, at(store, local, tmp_path / "after"), target)
    for folder in ("before", "after"):
        assert files_of(tmp_path / folder) == files_of(traj[target])
        assert verify(store, tmp_path / folder, target) == target
    assert (before.from_version, after.from_version, after.version) == (local, local, target)
    keyframe = repo.manifest(0 if target < 3 else 3)
    # every tensor of some size is undone (a tiny one may cost less in full than its deltas)
    plan = plan_pull(repo.chain(target), repo.manifest(local), ahead=repo.descent(target, local))
    for f in plan.files:
        for r in f.recipes:
            if r.segment.role == "tensor" and r.segment.nbytes >= 1024:
                assert r.steps and all(s.backward for s in r.steps), r.segment.name
    small = sum(s.payload.size for f in keyframe.files for s in f.segments if s.nbytes < 1024 and s.codec == "full")
    assert 0 < after.fetched_bytes <= sum(delta_bytes(m) for m in undone) + small
    assert after.fetched_bytes < full_bytes(keyframe) / 4
    assert after.fetched_bytes < before.fetched_bytes / 4


@pytest.mark.parametrize("codec", ["sparse", "ans"])
def test_the_plan_undoes_each_delta_newest_first(stores, codec):
    root, _ = stores
    repo = open_repo(root / codec)
    plan = plan_pull(repo.chain(2), repo.manifest(5), ahead=repo.descent(2, 5))
    steps = [s for f in plan.files for r in f.recipes for s in r.steps]
    assert steps and all(s.backward and s.codec in (codec, "dense") for s in steps)
    assert any(s.codec == codec for s in steps)
    for f in plan.files:
        for r in f.recipes:
            assert [s.version for s in r.steps] == sorted((s.version for s in r.steps), reverse=True)


def test_ans_keeps_its_exception_lists_apart_from_what_a_pull_forward_reads(stores, tmp_path):
    """``ans`` deltas whose blocks list exceptions have reverse payloads, in chunks of their own: a
    pull forward fetches none of them, a rollback through such a delta fetches them (and checks
    them: test_a_damaged_reverse_payload...)."""
    root, traj = stores
    store = root / "ans"
    repo = open_repo(store)
    for v in (1, 2, 4, 5):
        m = repo.manifest(v)
        assert any(p.reverse is not None for p in Payload.all_in(m)), v
        assert not delta_chunks(m, reverse=False) & delta_chunks(m, forward=False), v
    out = at(store, 4, tmp_path / "out")
    ahead = pull(store, out, 5)
    m5 = repo.manifest(5)
    reverse = delta_bytes(m5) - delta_bytes(m5, reverse=False)
    assert reverse > 0 and 0 < ahead.fetched_bytes <= delta_bytes(m5, reverse=False)
    back = pull(store, out, 4)
    assert files_of(out) == files_of(traj[4]) and back.from_version == 5
    assert back.fetched_bytes > ahead.fetched_bytes and back.fetched_bytes <= delta_bytes(m5)


def test_a_damaged_reverse_payload_fails_the_rollback_and_keeps_the_old_version(stores, tmp_path):
    root, traj = stores
    store = tmp_path / "store"
    shutil.copytree(root / "ans", store)
    out = at(store, 5, tmp_path / "out")
    for cid in delta_chunks(open_repo(store).manifest(5), forward=False):
        path = store / chunk_key(cid)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        pull(store, out, 4)
    assert read_state(out).version == 5 and files_of(out) == files_of(traj[5])
    assert pull(store, out, 5).fetched_bytes == 0  # where it is: nothing to read
    # a pull forward reads no reverse payload: from scratch, through the damaged version's deltas
    assert files_of(at(store, 5, tmp_path / "fresh")) == files_of(traj[5])


def test_with_ac_deltas_a_rollback_plans_from_the_keyframe(stores, tmp_path):
    """``ac`` deltas code the change in the old value's context: no ``ac`` delta is undone, each
    such tensor comes from the keyframe as before (only a ``dense`` delta of a tiny, wholly changed
    tensor may be undone), and the result is the same."""
    root, traj = stores
    store = root / "ac"
    repo = open_repo(store)
    m5 = repo.manifest(5)
    codecs = {(f.path, s.key): s.codec for f in m5.files for s in f.segments}
    assert "ac" in codecs.values()
    plan = plan_pull(repo.chain(4), m5, ahead=repo.descent(4, 5))
    for f in plan.files:
        for r in f.recipes:
            back = [s for s in r.steps if s.backward]
            assert all(s.codec == "dense" for s in back)
            if codecs[(f.entry.path, r.segment.key)] == "ac":
                assert r.base is None and r.steps[0].codec == "full"
    before = pull(store, at(store, 5, tmp_path / "before"), 4, config=FORWARD)
    after = pull(store, at(store, 5, tmp_path / "after"), 4)
    # the same keyframe payloads (a tiny tensor's dense delta in place of its full payload may
    # shift the merged ranges by a few bytes either way: the planner counts payload bytes)
    assert abs(after.fetched_bytes - before.fetched_bytes) < 1024 < before.fetched_bytes
    assert files_of(tmp_path / "after") == files_of(traj[4]) == files_of(tmp_path / "before")


def test_a_damaged_delta_payload_fails_the_rollback_and_keeps_the_old_version(sparse, tmp_path):
    store, traj = sparse
    out = at(store, 5, tmp_path / "out")
    m5 = open_repo(store).manifest(5)
    for c in m5.chunks:  # every chunk of version 5 (all deltas) damaged in the middle
        path = store / chunk_key(c.id)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        pull(store, out, 4)
    assert read_state(out).version == 5
    assert files_of(out) == files_of(traj[5])


def _swap_payloads(store: Path, version: int) -> int:
    """Rewrite ``version``'s manifest (with a valid checksum: an unsigned store cannot tell) so that
    pairs of tensors of one dtype and shape carry each other's delta payloads; returns the pairs.
    Each payload still passes its own checksum: only the result of undoing it can be wrong."""
    repo = open_repo(store)
    m = repo.manifest(version)
    files = []
    swapped = 0
    for f in m.files:
        by_kind: dict[tuple, list[int]] = {}
        segs = list(f.segments)
        for i, s in enumerate(segs):
            if s.role == "tensor" and s.codec in ("sparse", "dense") and s.payload is not None:
                by_kind.setdefault((s.dtype, s.shape, s.codec), []).append(i)
        for idx in by_kind.values():
            for i, j in zip(idx[::2], idx[1::2]):
                if segs[i].payload.xxh3 != segs[j].payload.xxh3:
                    segs[i], segs[j] = (
                        replace(segs[i], payload=segs[j].payload),
                        replace(segs[j], payload=segs[i].payload),
                    )
                    swapped += 1
        files.append(replace(f, segments=tuple(segs)))
    (store / version_key(version)).write_bytes(manifest_to_json(replace(m, files=tuple(files))))
    return swapped


def test_a_wrong_inversion_ends_in_a_checksum_error_never_in_other_bytes(sparse, tmp_path):
    store, traj = sparse
    out = at(store, 5, tmp_path / "out")
    assert _swap_payloads(store, 5) > 0
    with pytest.raises(ChecksumError):
        pull(store, out, 4)
    assert read_state(out).version == 5
    assert files_of(out) == files_of(traj[5])


def _tensor_span(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    segs = parse_safetensors_header(data[: 8 + n], len(data), path.name)
    t = max((s for s in segs if s.role == "tensor"), key=lambda s: s.end - s.begin)
    return t.begin, t.end


@pytest.mark.parametrize("lie", ["one byte changed", "older bytes"])
def test_a_folder_whose_bytes_are_not_the_version_its_state_claims(sparse, tmp_path, lie):
    """The base read for undoing is not checked up front: the result's checksum fails, the base is
    then checked, found changed, and the rollback rebuilt from the keyframe without local bytes."""
    store, traj = sparse
    out = at(store, 5, tmp_path / "out")
    shard = sorted(p for p in out.glob("*.safetensors"))[0]
    if lie == "one byte changed":
        begin, end = _tensor_span(shard)
        with open(shard, "r+b") as f:
            f.seek((begin + end) // 2)
            b = f.read(1)
            f.seek((begin + end) // 2)
            f.write(bytes([b[0] ^ 1]))
    else:  # the files of version 3 put in place behind the state's back
        for name, data in files_of(traj[3]).items():
            (out / name).write_bytes(data)
    r = pull(store, out, 4)
    assert r.version == 4
    assert files_of(out) == files_of(traj[4])
    assert verify(store, out, 4) == 4


def _checkpoint(folder: Path, tensors: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", {k: ("BF16", v.shape, v.tobytes()) for k, v in tensors.items()})
    return folder


def test_a_tensor_resized_on_the_way_comes_from_the_keyframe(tmp_path):
    """``b`` changes size at version 2: undoing 3 and 2 cannot give its version-1 bytes (2 is its
    full encoding, of another size), so it alone comes from the keyframe; ``w`` is undone."""
    rng = np.random.default_rng(0)
    w = rng.integers(0, 1 << 16, 4096, dtype=np.uint16)
    b = rng.integers(0, 1 << 16, 64, dtype=np.uint16)
    versions = []
    for v in range(4):
        if v:
            w = w.copy()
            w[rng.integers(0, w.size, 40)] += 1
            b = b[:32].copy() if v == 2 else b.copy()
            b[rng.integers(0, b.size, 3)] += 1
        versions.append(_checkpoint(tmp_path / "traj" / str(v), {"w": w.reshape(64, 64), "b": b}))
    store = tmp_path / "store"
    publish_all(store, versions, CodecConfig(entropy_coder=False), interval=10)
    repo = open_repo(store)
    assert repo.manifest(2).file("model.safetensors").segment(("tensor", "b")).codec == "full"
    plan = plan_pull(repo.chain(1), repo.manifest(3), ahead=repo.descent(1, 3))
    how = {r.segment.name: r for f in plan.files for r in f.recipes}
    assert [s.backward for s in how["w"].steps] == [True, True]
    assert how["b"].base is None and how["b"].steps[0].codec == "full"
    for target in (1, 2):
        out = at(store, 3, tmp_path / f"out{target}")
        pull(store, out, target)
        assert files_of(out) == files_of(versions[target])


def test_repo_descent(sparse):
    store, _ = sparse
    repo = open_repo(store)
    assert [m.version for m in repo.descent(2, 5)] == [3, 4, 5]
    assert [m.version for m in repo.descent(4, 5)] == [5]
    assert repo.descent(5, 5) == [] and repo.descent(5, 2) == []
    assert repo.descent(0, 5, limit=4) == [] and len(repo.descent(0, 5, limit=5)) == 5
    (store / version_key(4)).unlink()  # collected by gc: no way back through it
    assert open_repo(store).descent(2, 5) == [] and open_repo(store).descent(4, 5) != []


def test_a_collected_version_on_the_way_back_plans_from_the_keyframe(sparse, tmp_path):
    store, traj = sparse
    out = at(store, 5, tmp_path / "out")
    (store / version_key(4)).unlink()
    r = pull(store, out, 2)
    assert files_of(out) == files_of(traj[2])
    assert r.fetched_bytes > full_bytes(open_repo(store).manifest(0)) / 4


def test_cli_pull_rolls_back_by_deltas(sparse, tmp_path, run_cli, ws):
    store, traj = sparse
    url = f"file://{store}"
    out = tmp_path / "replica"
    sizes = {}
    for v in (5, 4, 3):
        rc, stdout, stderr = run_cli("pull", "--store", url, "--version", v, out)
        assert rc == 0, stderr
        assert stdout.strip().splitlines()[-1] == str(v)
        ws.assert_replica(out, traj[v])
        sizes[v] = stderr
    assert "from version 5" in sizes[4] and "from version 4" in sizes[3]
    rc, _, stderr = run_cli("verify", "--store", url, "--version", 3, out)
    assert rc == 0, stderr


def test_a_partial_folder_rolls_back_by_deltas(sparse, tmp_path):
    """``--include`` folders plan each selected tensor the same way (their headers, which the
    folder does not hold as stored, still come from the chain)."""
    store, _ = sparse
    repo = open_repo(store)
    sel = Selection(include=("*experts.0*",))
    materialize(repo, tmp_path / "before", 5, sel)
    before = materialize(repo, tmp_path / "before", 4, sel, config=FORWARD)
    materialize(repo, tmp_path / "after", 5, sel)
    after = materialize(repo, tmp_path / "after", 4, sel)
    materialize(repo, tmp_path / "fresh", 4, sel)
    assert files_of(tmp_path / "after") == files_of(tmp_path / "fresh") == files_of(tmp_path / "before")
    assert (after.version, after.from_version) == (4, 5)
    # the selected tensors' deltas of version 5 instead of their full payloads in keyframe 3
    full = sum(s.payload.size for f in repo.manifest(3).files for s in f.segments if sel.matches(s.name))
    deltas = sum(s.payload.size for f in repo.manifest(5).files for s in f.segments if sel.matches(s.name))
    assert after.fetched_bytes <= before.fetched_bytes - full + deltas


@pytest.mark.parametrize("codec", ["sparse", "ans"])
@pytest.mark.parametrize("mode", ["patch", "flip"])
def test_torch_sink_rolls_back_by_deltas(tmp_path, mode, codec):
    """A sink following a store undoes the deltas too: the tensors rebuilt whole from the model's
    bytes and checked (never patched from the payload alone), bit for bit the older version; with
    ``ans``, reading the reverse payloads of the deltas whose blocks list exceptions."""
    torch = pytest.importorskip("torch")
    from weightsync.torch.sink import TorchSink
    from weightsync.torch.state_dict import StateDictPublisher

    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(256, 64, generator=g), "h": torch.randn(512, 64, generator=g).to(torch.bfloat16)}
    sds = [sd]
    for _ in range(3):
        sd = {k: v.clone() for k, v in sd.items()}
        for v in sd.values():
            flat = v.view(-1)
            idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
            flat[idx] = flat[idx] * 1.01
        sds.append(sd)
    cfg = PublishConfig(keyframe_interval=10, codec=CodecConfig(entropy_coder=codec == "ans"))
    with StateDictPublisher(tmp_path / "store", config=cfg, work_dir=tmp_path / "work") as pub:
        for v, s in enumerate(sds):
            pub.publish(s, version=v)
    store = tmp_path / "store"
    reverse = [p.reverse for v in (2, 3) for p in Payload.all_in(open_repo(store).manifest(v)) if p.reverse]
    assert bool(reverse) == (codec == "ans")
    live = {k: v.clone() for k, v in sds[3].items()}
    if mode == "flip":
        live = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in live.items()}
    sink = TorchSink(store, live, 3, mode=mode)
    keyframe = full_bytes(open_repo(store).manifest(0))
    for target in (2, 1):
        up = sink.update(target)
        assert sink.version == target
        for k, t in sds[target].items():
            assert (
                live[k].detach().view(-1).view(torch.uint8).numpy().tobytes()
                == t.view(-1).view(torch.uint8).numpy().tobytes()
            ), k
        assert 0 < up.fetched_bytes < keyframe / 4
    assert sink.verify() == 2


@pytest.mark.parametrize("codec", ["sparse", "ans"])
def test_signed_versions_roll_back_by_deltas_with_every_sha256_checked(stores, tmp_path, codec):
    """With trusted keys each manifest on the way back is checked for its signature and each
    undone payload (and reverse payload) carries its SHA-256 to be checked; a version on the way
    that is no longer signed leaves no way back through it (the keyframe serves)."""
    from weightsync.store.signing import SigningKey

    _, traj = stores
    key = SigningKey.generate()
    store = tmp_path / "store"
    codecs = CodecConfig(entropy_coder=codec == "ans")
    cfg = PublishConfig(codec=codecs, keyframe_interval=3, signing_key=key)
    for v, ckpt in enumerate(traj):
        publish(ckpt, store, v, config=cfg, base_dir=traj[v - 1] if v else None)
    repo = open_repo(store, trusted_keys=[key])
    out = tmp_path / "out"
    pull(repo, out, 5)
    ahead = repo.descent(3, 5)
    assert [m.version for m in ahead] == [4, 5]
    plan = plan_pull(repo.chain(3), repo.manifest(5), ahead=ahead)
    back = [s for f in plan.files for r in f.recipes for s in r.steps if s.backward]
    assert back and all(len(s.sha256) == 64 for s in back)
    reverse = [s.reverse for s in back if s.reverse is not None]
    assert all(len(r.sha256) == 64 for r in reverse) and bool(reverse) == (codec == "ans")
    r = pull(repo, out, 3)
    assert files_of(out) == files_of(traj[3]) and r.fetched_bytes < full_bytes(repo.manifest(3)) / 4
    pull(repo, out, 5)
    (store / signature_key(4)).unlink()  # version 4 no longer signed: no way back through it
    fresh = open_repo(store, trusted_keys=[key])
    assert fresh.descent(3, 5) == []
    r = pull(fresh, out, 3)  # from keyframe 3 instead
    assert files_of(out) == files_of(traj[3]) and r.fetched_bytes > full_bytes(repo.manifest(3)) / 4
