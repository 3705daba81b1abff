"""In-process publishing with device-side diffs (weightsync.torch.device) on a file store.

CPU tensors here; the same code runs on CUDA tensors (the last test runs where CUDA is present).
Every version is pulled back and compared byte for byte with a safetensors dump of the state dict,
and the device path's manifests are compared with those of the host path (StateDictPublisher),
which must be identical: the same codec choices, payloads and chunks.
"""

from __future__ import annotations

import pytest
import torch

import weightsync
from weightsync.codec import CodecConfig
from weightsync.demo import SyntheticTrainer
from weightsync.errors import StoreError, VersionError
from weightsync.sync.publish import PublishConfig
from weightsync.torch import hostpatch as hostmirror
from weightsync.torch.device import DeviceDiffPublisher
from weightsync.torch.state_dict import StateDictPublisher, publish_state_dict, save_state_dict

TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(INT[t.element_size()])


class Trainer:
    """A tiny model in bf16 with tied weights and extra tensors of other dtypes; :meth:`state`
    gives the state dict of ``step`` (each step adds an event: NaN payloads, -0.0, a new tensor,
    a reshaped, retyped and removed tensor, metadata, no change at all)."""

    def __init__(self):
        self.synth = SyntheticTrainer(**TINY)
        self.extra = {
            "f32": torch.linspace(-1, 1, 300),
            "i64": torch.arange(40),
            "u8": torch.arange(64, dtype=torch.uint8),
            "f16": torch.zeros(50, dtype=torch.float16),
            "scalar": torch.tensor(0.5),
            "empty": torch.empty(0, 7),
        }
        self.metadata = None

    def state(self, step: int) -> dict[str, torch.Tensor]:
        if step and step != 5:
            self.synth.step()
            self.extra["f32"] += 1e-3
            self.extra["i64"][step] += 1
        if step == 1:
            ints(self.extra["f16"])[:4] = torch.tensor(
                [0x7E01, 0x7E02, -0x8000, 0x7C00], dtype=torch.int16
            )  # NaNs, -0.0, inf
        if step == 2:
            ints(self.extra["f16"])[0] = 0x7E03  # another NaN payload
            self.extra["new"] = torch.ones(9, dtype=torch.bfloat16)
        if step == 3:
            self.extra["f32"] = self.extra["f32"][:200].clone()  # reshaped
            self.extra["u8"] = self.extra["u8"].to(torch.int16)  # retyped
            del self.extra["scalar"]
        if step == 4:
            self.metadata = {"step": "4"}
        sd = {n: torch.from_numpy(w).to(torch.bfloat16) for n, w in self.synth.master.items()}
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied weights share storage
        return sd | self.extra


def dump(sd, path, metadata=None) -> bytes:
    save_state_dict(sd, path, metadata)
    return path.read_bytes()


def expected_d2h(prev: dict | None, sd: dict) -> int:
    """Bytes the device diff moves: int32 positions and new values of changed elements, whole
    tensors that are new or changed shape or dtype."""
    total = 0
    for name, t in sd.items():
        p = None if prev is None else prev.get(name)
        if p is None or p.dtype != t.dtype or p.shape != t.shape:
            total += t.nbytes
        else:
            k = int((ints(p.contiguous()) != ints(t.contiguous())).sum())
            total += min(k * (4 + t.element_size()), t.nbytes)
    return total


def same_manifests(a, b, version: int) -> None:
    ma, mb = a.manifest(version), b.manifest(version)
    assert (ma.files, ma.chunks, ma.keyframe, ma.parent) == (mb.files, mb.chunks, mb.keyframe, mb.parent)


@pytest.mark.parametrize("entropy_coder", [True, False], ids=["ans", "sparse"])
def test_device_path_is_bit_exact_and_matches_the_host_path(tmp_path, monkeypatch, entropy_coder):
    cfg = PublishConfig(codec=CodecConfig(entropy_coder=entropy_coder), keyframe_interval=3)
    built = []  # sparse payloads built from the device's changes, without a host diff
    real = hostmirror.encode_sparse_from_changes
    monkeypatch.setattr(hostmirror, "encode_sparse_from_changes", lambda *a: built.append(a[0]) or real(*a))
    trainer, prev, routes = Trainer(), None, []
    with (
        DeviceDiffPublisher(tmp_path / "dev", config=cfg, work_dir=tmp_path / "w") as dev,
        StateDictPublisher(tmp_path / "host", config=cfg, work_dir=tmp_path / "w") as host,
    ):
        for step in range(7):
            sd = trainer.state(step)
            r = dev.publish(sd, metadata=trainer.metadata)
            host.publish(sd, metadata=trainer.metadata)
            assert r.version == step and r.keyframe == (step % 3 == 0)
            assert r.d2h_bytes == expected_d2h(prev, sd) and r.tensor_bytes == sum(t.nbytes for t in sd.values())
            same_manifests(dev.repo, host.repo, step)
            ref = dump(sd, tmp_path / "ref.safetensors", trainer.metadata)
            assert (dev.mirror.current.folder / "model.safetensors").read_bytes() == ref
            out = tmp_path / "pulled"
            weightsync.pull(tmp_path / "dev", out, step)
            assert (out / "model.safetensors").read_bytes() == ref
            prev = {k: v.clone() for k, v in sd.items()}
            routes.append(r.route)
            if step in (1, 2, 5, 6):
                assert r.d2h_bytes < r.tensor_bytes / 4
    assert routes == ["full"] + ["direct"] * 6
    assert ("BF16" in built) == (not entropy_coder)
    assert len(list((tmp_path / "w").glob("weightsync-dd-*/*"))) == 0  # closed


def test_folder_mode_and_cache_dir_give_the_same_versions(tmp_path):
    """direct=False re-diffs the patched mirror on the host; with a cache_dir the mirror is
    patched copy-on-write (the cache may hard-link it). Both equal the in-place direct path."""
    cfg = PublishConfig(keyframe_interval=4)
    t1, t2, t3 = Trainer(), Trainer(), Trainer()
    with (
        DeviceDiffPublisher(tmp_path / "a", config=cfg, work_dir=tmp_path / "w") as a,
        DeviceDiffPublisher(tmp_path / "b", config=cfg, work_dir=tmp_path / "w", direct=False) as b,
        StateDictPublisher(
            tmp_path / "c", config=cfg, work_dir=tmp_path / "w", cache_dir=tmp_path / "cache", device_diff=True
        ) as c,
    ):
        for step in range(5):
            ra = a.publish(t1.state(step), metadata=t1.metadata)
            rb = b.publish(t2.state(step), metadata=t2.metadata)
            rc = c.publish(t3.state(step), metadata=t3.metadata)
            assert (ra.route, rb.route, rc.route) == (("full",) * 3 if step == 0 else ("direct", "folder", "direct"))
            same_manifests(a.repo, b.repo, step)
            same_manifests(a.repo, c.repo, step)
    weightsync.verify(tmp_path / "c", tmp_path / "cache", 4)


def test_a_direct_publish_holds_its_cache_and_empties_it_when_it_cannot_take_the_version(tmp_path, monkeypatch, caplog):
    """The direct route claims the cache as a publish does: a cache another process holds is refused
    before anything is written, and one that cannot take the committed version (a full disk) is
    emptied with a warning (it was left half written for the next claim to clear), the version
    stored; the next publish pulls its base there, and every version is exact."""
    import errno
    import logging
    import os

    import weightsync.local.base as base_module
    from weightsync.errors import WeightsyncError
    from weightsync.local.lock import FolderLock
    from weightsync.local.state import read_state

    trainer, store, cache = Trainer(), tmp_path / "store", tmp_path / "cache"
    states, expected = [], []  # (the trainer's tensors change in place: each state's bytes are kept)
    with StateDictPublisher(store, work_dir=tmp_path / "w", cache_dir=cache, device_diff=True) as pub:
        states.append(trainer.state(0))
        expected.append(dump(states[-1], tmp_path / "ref0"))
        pub.publish(states[-1])
        states.append(trainer.state(1))
        expected.append(dump(states[-1], tmp_path / "ref1"))
        with FolderLock(cache, "another publish"), pytest.raises(WeightsyncError, match="another publish"):
            pub.publish(states[-1])
        assert weightsync.versions(store)[-1].version == 0
        real = base_module.install

        def full_disk(folder, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(base_module, "install", full_disk)
        with caplog.at_level(logging.WARNING, "weightsync.publish"):
            r = pub.publish(states[-1])
        assert r.version == 1 and r.route == "direct"
        assert f"the delta-base cache {cache} could not take it (No space left on device); emptied it" in caplog.text
        assert read_state(cache) is None
        monkeypatch.setattr(base_module, "install", real)
        states.append(trainer.state(2))
        expected.append(dump(states[-1], tmp_path / "ref2"))
        assert pub.publish(states[-1]).version == 2 and read_state(cache).version == 2
    for v, data in enumerate(expected):
        weightsync.pull(store, tmp_path / f"v{v}", v)
        assert (tmp_path / f"v{v}/model.safetensors").read_bytes() == data


def test_a_failed_publish_leaves_everything_consistent(tmp_path):
    """A version conflict and an upload failure after the mirror was patched: the store is
    unchanged, the mirror is undone, the next publish copies every tensor once and is exact."""
    trainer = Trainer()
    store = tmp_path / "store"
    with DeviceDiffPublisher(store, work_dir=tmp_path / "w") as pub:
        pub.publish(trainer.state(0))
        pub.publish(trainer.state(1), version=5)
        sd = trainer.state(2)
        with pytest.raises(VersionError):
            pub.publish(sd, version=3)
        put, calls = pub.repo.put_chunk, []

        def failing_put(chunk_id, data):
            calls.append(chunk_id)
            raise StoreError("injected upload failure", key=chunk_id)

        pub.repo.put_chunk = failing_put
        with pytest.raises(StoreError):
            pub.publish(sd)
        assert calls and weightsync.versions(store)[-1].version == 5
        pub.repo.put_chunk = put
        r = pub.publish(sd)
        assert r.version == 6 and r.route == "direct" and r.d2h_bytes == r.tensor_bytes  # started over
        sd = trainer.state(3)
        r = pub.publish(sd)
        assert r.route == "direct" and r.d2h_bytes < r.tensor_bytes / 4
        weightsync.pull(store, tmp_path / "out", 7)
        assert (tmp_path / "out/model.safetensors").read_bytes() == dump(sd, tmp_path / "ref")


def test_head_moved_by_someone_else_or_mirror_tampered_with(tmp_path):
    trainer, other = Trainer(), Trainer()
    store = tmp_path / "store"
    with DeviceDiffPublisher(store, work_dir=tmp_path / "w") as pub:
        pub.publish(trainer.state(0))
        publish_state_dict(other.state(1), store, work_dir=tmp_path / "w")  # version 1, not ours
        sd = trainer.state(1)
        r = pub.publish(sd)
        assert (r.version, r.route, r.d2h_bytes) == (2, "full", r.tensor_bytes)
        mirror = pub.mirror.current.folder / "model.safetensors"
        with open(mirror, "r+b") as f:  # flip a byte of the host mirror
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        sd = trainer.state(2)
        r = pub.publish(sd)
        assert (r.version, r.route, r.d2h_bytes) == (3, "full", r.tensor_bytes)
        weightsync.pull(store, tmp_path / "out", 3)
        assert (tmp_path / "out/model.safetensors").read_bytes() == dump(sd, tmp_path / "ref")
        assert pub.publish(trainer.state(3)).route == "direct"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_dict_publishes_bit_exact_moving_only_changes(tmp_path):
    trainer, prev = Trainer(), None
    with DeviceDiffPublisher(tmp_path / "store", work_dir=tmp_path / "w") as pub:
        for step in range(5):
            cpu = trainer.state(step)
            gpu = {k: v.cuda() for k, v in cpu.items()}
            r = pub.publish(gpu, metadata=trainer.metadata)
            assert r.d2h_bytes == expected_d2h(prev, cpu)
            weightsync.pull(tmp_path / "store", tmp_path / "out", step)
            assert (tmp_path / "out/model.safetensors").read_bytes() == dump(cpu, tmp_path / "ref", trainer.metadata)
            prev = {k: v.clone() for k, v in cpu.items()}
