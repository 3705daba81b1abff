"""Signed versions end to end on file stores (docs/FORMAT.md section 7, docs/OPERATIONS.md "Signed
versions"): ``weightsync keygen``, ``publish``/``commit-parts --signing-key``, ``pull``/``verify``/
``mirror --trusted-key``, gc, and the subscriber daemon, in process and as real processes.

The attacker can write every bucket but holds no trusted private key. Whatever they commit
(unsigned, signed with their own key, a rewritten manifest with recomputed checksums, a signature
moved from another version) is refused with one line and a non-zero exit, and nothing is
installed: the folder, the subscriber's slots and the regional store keep what they had."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_daemons import Daemon, wait_for

import weightsync
from weightsync.errors import SignatureError
from weightsync.format.keys import HEAD_KEY, part_key, signature_key, version_key
from weightsync.format.manifest import Payload, manifest_from_json, manifest_to_json, part_from_json
from weightsync.local.state import read_state
from weightsync.service.config import Identity, StoreConfig, SubscriberConfig
from weightsync.service.metrics import Metrics
from weightsync.service.subscriber import Subscriber
from weightsync.store.signing import Keyring, read_public_keys, read_signing_key
from weightsync.sync.mirror import MirrorConfig, MirrorObserver, mirror
from weightsync.sync.parts import read_refusal
from weightsync.sync.publish import PublishConfig
from weightsync.sync.selection import Selection, materialize, verify_partial

OLD = time.time() - 10 * 24 * 3600


def _publish(ckpt, store, key=None, version=None, **cfg):
    config = PublishConfig(signing_key=None if key is None else read_signing_key(key), **cfg)
    return weightsync.publish(ckpt, f"file://{store}", version, config=config)


@pytest.fixture
def signed(trajectory, tmp_path, ok_cli):
    """Keys from ``weightsync keygen`` and a store holding versions 0..2 signed with them
    (keyframes at 0 and 2)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    key_id = ok_cli("keygen", keys / "publisher").strip()
    store = tmp_path / "store"
    for ckpt in trajectory[:3]:
        _publish(ckpt, store, keys / "publisher", keyframe_interval=2)
    return types.SimpleNamespace(
        store=store, key=keys / "publisher", pub=keys / "publisher.pub", key_id=key_id, traj=trajectory, keys=keys
    )


def _signatures(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "signatures").iterdir())


def test_keygen_signed_publish_verified_pull_and_verify(signed, tmp_path, ok_cli, run_cli, ws):
    assert (os.stat(signed.key).st_mode & 0o777) == 0o600
    assert f"weightsync:{signed.key_id}" in signed.pub.read_text()
    assert _signatures(signed.store) == [f"{v:020d}.json" for v in range(3)]
    out = tmp_path / "out"
    assert ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, out, "--no-progress").strip() == "2"
    ws.assert_replica(out, signed.traj[2])
    assert ok_cli("verify", "--store", signed.store, "--trusted-key", signed.pub, out) == ""
    # a signed commit through the command line too; keygen never overwrites
    ok_cli("publish", signed.traj[3], "--store", signed.store, "--signing-key", signed.key, "--no-cache")
    assert ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, out, "--no-progress").strip() == "3"
    rc, _, err = run_cli("keygen", signed.key)
    assert rc == 2 and "exists; not overwriting" in ws.error_line(err)


def _unsigned(s):
    _publish(s.traj[3], s.store)


def _own_key(s):
    weightsync.write_key_pair(s.keys / "mallory")
    _publish(s.traj[3], s.store, s.keys / "mallory")


def _rewritten(s):
    """The head's manifest rewritten, its checksum recomputed (a valid manifest no key signed)."""
    m = manifest_from_json((s.store / version_key(2)).read_bytes())
    (s.store / version_key(2)).write_bytes(manifest_to_json(replace(m, created="2000-01-01T00:00:00+00:00")))


def _moved(s):
    _publish(s.traj[3], s.store)
    shutil.copy(s.store / signature_key(2), s.store / signature_key(3))


def _deleted(s):
    (s.store / signature_key(2)).unlink()


ATTACKS = {
    "unsigned": (_unsigned, "not signed"),
    "own key": (_own_key, "signed by unknown key"),
    "rewritten manifest": (_rewritten, "not the one signed"),
    "moved signature": (_moved, "are those of version 2"),
    "deleted signature": (_deleted, "not signed"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_what_an_attacker_commits_is_refused_and_nothing_is_installed(signed, tmp_path, ok_cli, run_cli, ws, attack):
    out = tmp_path / "out"
    ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, "--version", 1, out, "--no-progress")
    before = ws.snapshot(out)
    forge, reason = ATTACKS[attack]
    forge(signed)
    rc, stdout, err = run_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, out, "--no-progress")
    line = ws.error_line(err)
    assert rc == 1 and stdout == "" and "refused" in line and reason in line, line
    assert ws.snapshot(out) == before
    rc, _, err = run_cli("verify", "--store", signed.store, "--trusted-key", signed.pub, out, "--version", "latest")
    assert rc == 3 and reason in ws.error_line(err)
    rc, _, err = run_cli("pull", "--store", signed.store, out, "--no-progress")  # without keys nothing is checked
    assert rc == 0, err


def test_rotation_trusts_old_and_new_and_the_new_key_starts_with_a_keyframe(signed, tmp_path, ok_cli, run_cli, ws):
    out = tmp_path / "out"
    ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, "--version", 1, out, "--no-progress")
    new = signed.keys / "new"
    ok_cli("keygen", new)
    rc, stdout, err = run_cli("publish", signed.traj[3], "--store", signed.store, "--signing-key", new, "--no-cache")
    assert rc == 0 and stdout == "3\n" and "published version 3 (keyframe)" in err
    assert "keyframe with no deltas from the head" in err and "signed by unknown key" in err  # the old key's head
    assert _deltas(signed.store, 3) == 0
    both = ["--trusted-key", signed.pub, "--trusted-key", f"{new}.pub"]
    assert ok_cli("pull", "--store", signed.store, *both, out, "--no-progress") == "3\n"
    only_new = ["--trusted-key", f"{new}.pub"]
    ok_cli("publish", signed.traj[4], "--store", signed.store, "--signing-key", new, "--no-cache")
    assert weightsync.versions(f"file://{signed.store}")[-1].parent == 3  # a delta again
    for folder in (out, tmp_path / "empty"):  # from then on the new key alone will do
        assert ok_cli("pull", "--store", signed.store, *only_new, folder, "--no-progress") == "4\n"
        ws.assert_replica(folder, signed.traj[4])
    rc, _, err = run_cli("pull", "--store", signed.store, *only_new, "--version", 2, tmp_path / "o2", "--no-progress")
    assert rc == 1 and "unknown key" in ws.error_line(err)  # pinning an old version needs the old key
    (signed.keys / "both.pub").write_text(signed.pub.read_text() + f"# rotation\n{Path(f'{new}.pub').read_text()}")
    assert len(read_public_keys(signed.keys / "both.pub")) == 2  # one file may hold both keys
    ok_cli("verify", "--store", signed.store, "--trusted-key", signed.keys / "both.pub", out)


def test_a_signing_publisher_builds_nothing_on_a_head_it_did_not_sign(signed, tmp_path, ok_cli, ws):
    out = tmp_path / "out"
    ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, out, "--no-progress")
    _unsigned(signed)  # the attacker's version 3 is the head
    r = _publish(signed.traj[4], signed.store, signed.key)  # the default keyframe interval: 2 would be a delta
    assert (r.version, r.parent, r.keyframe) == (4, 3, True) and _deltas(signed.store, 4) == 0
    assert ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, out, "--no-progress") == "4\n"
    ws.assert_replica(out, signed.traj[4])
    r = _publish(signed.traj[5], signed.store, signed.key)
    assert (r.parent, r.keyframe) == (4, False)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trusted-key", "{key}"], "--trusted-key: {key} holds a private key"),
        (["--trusted-key", "{missing}"], "--trusted-key: cannot read public key file {missing}"),
        (["--trusted-key", ""], "--trusted-key names an empty path"),
        (["--trusted-key", "{fifo}"], "--trusted-key: public key file {fifo} is not a regular file"),  # it hung
    ],
)
def test_bad_trusted_keys_are_one_line_and_exit_2(signed, tmp_path, run_cli, ws, flags, message):
    names = {"key": signed.key, "missing": tmp_path / "missing.pub", "fifo": tmp_path / "key.fifo"}
    os.mkfifo(names["fifo"])
    args = [f.format(**names) for f in flags]
    rc, _, err = run_cli("pull", "--store", signed.store, *args, tmp_path / "out", "--no-progress")
    assert rc == 2 and message.format(**names) in ws.error_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, message",
    [
        ("{pub}", "holds a public key"),
        ("{missing}", "cannot read signing key"),
        ("", "--signing-key is empty: refusing to publish unsigned versions"),
        ("{fifo}", "is not a regular file"),  # it hung
    ],
)
def test_bad_signing_keys_publish_nothing(signed, tmp_path, run_cli, ws, key, message):
    before = ws.snapshot(signed.store)
    os.mkfifo(tmp_path / "key.fifo")
    key = key.format(pub=signed.pub, missing=tmp_path / "missing", fifo=tmp_path / "key.fifo")
    rc, _, err = run_cli("publish", signed.traj[3], "--store", signed.store, "--signing-key", key, "--no-cache")
    assert rc == 2 and message in ws.error_line(err)
    assert ws.snapshot(signed.store) == before


def _deltas(store: Path, version: int) -> int:
    """Segments of ``version`` that carry a delta from its parent (a keyframe's, for followers)."""
    m = manifest_from_json((store / version_key(version)).read_bytes())
    return sum(s.delta is not None for f in m.files for s in f.segments)


def test_ranks_with_the_key_make_a_keyframe_after_a_head_it_did_not_sign(signed, tmp_path, ok_cli):
    _unsigned(signed)  # the attacker's version 3 is the head; the forged manifest even lists another file
    m = manifest_from_json((signed.store / version_key(3)).read_bytes())
    extra = replace(m.files[0], path="planted.json")
    (signed.store / version_key(3)).write_bytes(manifest_to_json(replace(m, files=(*m.files, extra))))
    key, world = ["--signing-key", signed.key], ["--world", 2, "--no-cache"]
    for rank in (0, 1):
        ok_cli("publish-part", signed.traj[4], "--store", signed.store, "--rank", rank, *world, *key)
    ok_cli("commit-parts", "--store", signed.store, "--version", 4, "--world", 2, *key)
    assert _deltas(signed.store, 4) == 0
    out = tmp_path / "out"
    assert ok_cli("pull", "--store", signed.store, "--trusted-key", signed.pub, out, "--no-progress") == "4\n"


def test_commit_parts_signs_the_merged_version(signed, tmp_path, ok_cli, run_cli):
    """Parts are never signed; the committer signs the version, once every payload of the parts
    carries a SHA-256 digest (XXH3 names bind no content against a forger): ranks publish with
    --signing-key, which makes them add the digests."""
    for rank in (0, 1):
        ok_cli("publish-part", signed.traj[3], "--store", signed.store, "--rank", rank, "--world", 2, "--no-cache")
    rc, _, err = run_cli(
        "commit-parts", "--store", signed.store, "--version", 3, "--world", 2, "--signing-key", signed.key
    )
    assert rc == 2 and "payloads without SHA-256 digests cannot be signed" in err and len(err.splitlines()) == 1
    assert not (signed.store / signature_key(3)).exists()
    # stored for the ranks that wait on the commit (they would otherwise wait out their timeout)
    for rank in (0, 1):
        part = part_from_json((signed.store / part_key(3, rank, 2)).read_bytes(), "part")
        assert "cannot be signed" in read_refusal(weightsync.open_repo(f"file://{signed.store}"), part)
    for rank in (0, 1):  # (parts are immutable: the signed ranks publish as version 4)
        ok_cli(
            "publish-part",
            signed.traj[3],
            "--store",
            signed.store,
            "--version",
            4,
            "--rank",
            rank,
            "--world",
            2,
            "--no-cache",
            "--signing-key",
            signed.key,
        )
    assert not (signed.store / signature_key(4)).exists()
    ok_cli("commit-parts", "--store", signed.store, "--version", 4, "--world", 2, "--signing-key", signed.key)
    repo = weightsync.open_repo(f"file://{signed.store}", trusted_keys=[signed.pub])
    assert repo.manifest(4).version == 4


def test_a_signed_manifest_names_payloads_by_sha256_and_a_forged_chunk_is_refused(signed, tmp_path, run_cli):
    """The signature covers the manifest, which names each payload by XXH3 (no cryptographic hash)
    and by SHA-256: bytes crafted to match every XXH3 the manifest names still fail their payload's
    SHA-256. Simulated the other way round (a forger's collision is out of reach of a test): the
    signer's manifest names a SHA-256 the stored payload does not have, every XXH3 still matching;
    the pull is refused with a checksum error, nothing installed."""
    import shutil

    repo = weightsync.open_repo(f"file://{signed.store}", trusted_keys=[signed.pub])
    m = repo.manifest(2)
    assert all(len(p.sha256) == 64 for p in Payload.all_in(m)) and list(Payload.all_in(m))
    forged = tmp_path / "forged"
    shutil.copytree(signed.store, forged)
    seg = next(s for f in m.files for s in f.segments if s.payload is not None and s.role == "tensor")
    bad = replace(seg.payload, sha256="0" * 64)
    files = tuple(
        replace(f, segments=tuple(replace(s, payload=bad) if s is seg else s for s in f.segments)) for f in m.files
    )
    data = manifest_to_json(replace(m, files=files))
    (forged / version_key(2)).write_bytes(data)
    (forged / signature_key(2)).write_bytes(read_signing_key(signed.key).sign(2, data))
    out = tmp_path / "out"
    rc, _, err = run_cli("pull", "--store", forged, "--trusted-key", signed.pub, out, "--version", 2, "--no-progress")
    assert rc != 0 and "sha256" in err and len(err.splitlines()) == 1
    assert read_state(out) is None  # no version installed


# --- the mirror -----------------------------------------------------------------------------------------
def test_mirror_with_trusted_keys_copies_signatures_and_refuses_to_propagate(signed, tmp_path, ok_cli, run_cli, ws):
    dst = tmp_path / "region"
    _unsigned(signed)  # version 3 at the source: an attacker's
    rc, _, err = run_cli("mirror", "--from", signed.store, "--to", dst, "--trusted-key", signed.pub)
    last = err.splitlines()[-1]  # after the log lines of the versions it copied
    assert rc == 1 and last.startswith("weightsync: error: version 3") and "not signed" in last
    assert json.loads((dst / HEAD_KEY).read_text())["version"] == 2  # the versions before it, nothing of it
    assert not (dst / version_key(3)).exists()
    assert _signatures(dst) == _signatures(signed.store)  # copied along
    out = tmp_path / "out"
    assert ok_cli("pull", "--store", dst, "--trusted-key", signed.pub, out, "--no-progress").strip() == "2"
    ws.assert_replica(out, signed.traj[2])
    # the publisher moves on with a signed keyframe (it needs nothing of 3), then a delta: the mirror
    # stayed at 2 for good (every later pass refused 3 again); it passes over 3, as readers do
    assert _publish(signed.traj[4], signed.store, signed.key).keyframe
    assert not _publish(signed.traj[5], signed.store, signed.key).keyframe
    assert ok_cli("mirror", "--from", signed.store, "--to", dst, "--trusted-key", signed.pub).strip() == "5"
    assert not (dst / version_key(3)).exists()
    assert ok_cli("pull", "--store", dst, "--trusted-key", signed.pub, out, "--no-progress").strip() == "5"
    ws.assert_replica(out, signed.traj[5])
    # a new region started after it: the same, from nothing
    fresh = tmp_path / "region-new"
    assert ok_cli("mirror", "--from", signed.store, "--to", fresh, "--trusted-key", signed.pub).strip() == "5"
    assert sorted(p.name for p in (fresh / "versions").iterdir()) == [
        version_key(v).split("/")[1] for v in (0, 1, 2, 4, 5)
    ]


def test_a_region_an_attacker_wrote_is_refused_by_its_readers(signed, tmp_path, ok_cli, run_cli, ws):
    dst, out = tmp_path / "region", tmp_path / "out"
    ok_cli("mirror", "--from", signed.store, "--to", dst, "--trusted-key", signed.pub)
    ok_cli("pull", "--store", dst, "--trusted-key", signed.pub, out, "--no-progress")
    before = ws.snapshot(out)
    _publish(signed.traj[3], dst)  # written straight into the regional bucket
    rc, _, err = run_cli("pull", "--store", dst, "--trusted-key", signed.pub, out, "--no-progress")
    assert rc == 1 and "version 3" in ws.error_line(err) and "not signed" in err
    assert ws.snapshot(out) == before
    rc, _, err = run_cli("mirror", "--from", signed.store, "--to", dst, "--trusted-key", signed.pub)
    assert rc == 1 and "is not a mirror" in err.splitlines()[-1]
    # a mirror without keys propagates the attacker's version; the region's readers still refuse it
    evil = tmp_path / "evil-source"
    shutil.copytree(signed.store, evil)
    _publish(signed.traj[3], evil)
    ok_cli("mirror", "--from", evil, "--to", tmp_path / "region2")
    assert not (tmp_path / "region2" / signature_key(3)).exists()
    rc, _, err = run_cli("pull", "--store", tmp_path / "region2", "--trusted-key", signed.pub, out, "--no-progress")
    assert rc == 1 and "not signed" in ws.error_line(err)


def test_a_following_mirror_stops_at_a_refused_version_and_reports_it(signed, tmp_path):
    _unsigned(signed)
    src = weightsync.open_repo(f"file://{signed.store}", trusted_keys=[signed.pub])
    dst = weightsync.open_repo(f"file://{tmp_path / 'region'}")
    metrics = Metrics(CollectorRegistry(), "mirror", runtime=False)
    stop = threading.Event()
    errors = []

    statuses = []

    class Report(MirrorObserver):
        def on_error(self, exc):
            errors.append(exc)
            metrics.mirror_error(exc)
            stop.set()

        def on_status(self, status):
            statuses.append(status)

    r = mirror(src, dst, follow=True, config=MirrorConfig(interval=0.01), stop=stop, observer=Report())
    assert r.head == 2 and r.errors == 1 and isinstance(errors[0], SignatureError) and errors[0].version == 3
    # the lag said "caught up" (the refusal was raised before the pass reported): it says one behind
    assert (statuses[-1].source_head, statuses[-1].destination_head, statuses[-1].lag_versions) == (3, 2, 1)
    assert metrics.registry.get_sample_value("weightsync_refused_version", {"region": "", "cluster": ""}) == 3
    assert metrics.registry.get_sample_value("weightsync_signature_refusals_total", {"region": "", "cluster": ""}) == 1
    metrics.mirror_pass(r)  # a later pass succeeds (the version was removed, or a good one follows)
    assert metrics.registry.get_sample_value("weightsync_refused_version", {"region": "", "cluster": ""}) == -1


# --- retention --------------------------------------------------------------------------------------------
def test_gc_removes_signatures_with_their_versions_and_old_orphans(signed, ok_cli):
    (signed.store / signature_key(99)).write_bytes(b"{}")  # an orphan: no manifest
    os.utime(signed.store / signature_key(99), (OLD, OLD))
    (signed.store / signature_key(98)).write_bytes(b"{}")  # a young one: spared by the grace period
    res = json.loads(ok_cli("gc", "--store", signed.store, "--keep", 1))
    assert res["deleted"] == [0, 1] and res["deleted_signatures"] == 3
    assert _signatures(signed.store) == [f"{2:020d}.json", f"{98:020d}.json"]
    repo = weightsync.open_repo(f"file://{signed.store}", trusted_keys=[signed.pub])
    assert repo.manifest(2).version == 2


# --- the subscriber -------------------------------------------------------------------------------------
def test_the_subscriber_stays_on_its_version_and_reports_the_refusal(signed, tmp_path):
    """In process: a refused head leaves ``current`` and the standby slot alone, shows in /v1/status
    and the metrics; a signed keyframe after it is taken, and the refusal is over."""
    url = f"file://{signed.store}"
    keys = Keyring.of([signed.pub])
    cfg = SubscriberConfig(StoreConfig(url, trusted_keys=keys), tmp_path / "t", Identity("s1"), fsync=False)
    metrics = Metrics(CollectorRegistry(), "subscriber", subscriber="s1", runtime=False)
    sub = Subscriber(cfg, weightsync.open_repo(url, trusted_keys=keys), metrics)
    labels = {"region": "", "cluster": "", "subscriber": "s1"}

    async def main():
        sub._wake = asyncio.Event()
        await asyncio.to_thread(sub._startup)
        await sub._iteration()
        assert sub.view.current == 2 and sub.status()["trusted_keys"] == [signed.key_id]
        await sub._iteration()  # idle: seeds the standby slot with a copy of version 2
        served = sub.slots.current()
        slots = {n: _tree(sub.slots.path(n)) for n in ("a", "b")}
        _unsigned(signed)
        for _ in range(2):
            sub.view = replace(sub.view, retry_at=0.0)  # no back-off wait between the tries
            await sub._iteration()
            status = sub.status()
            assert status["current_version"] == 2 and status["latest_version"] == 3 and status["state"] == "error"
            assert status["refused"]["version"] == 3 and "not signed" in status["refused"]["reason"]
            assert "refused" in status["last_error"]
            assert sub.slots.current() == served and {n: _tree(sub.slots.path(n)) for n in ("a", "b")} == slots
        assert metrics.registry.get_sample_value("weightsync_refused_version", labels) == 3
        assert metrics.registry.get_sample_value("weightsync_signature_refusals_total", labels) == 2
        assert metrics.registry.get_sample_value("weightsync_current_version", labels) == 2
        _publish(signed.traj[4], signed.store, signed.key)  # the publisher moves on: a keyframe, not on 3
        sub.view = replace(sub.view, retry_at=0.0)
        await sub._iteration()
        assert sub.view.current == 4 and sub.status()["refused"] is None
        assert metrics.registry.get_sample_value("weightsync_refused_version", labels) == -1
        assert weightsync.verify(url, sub.slots.path(sub.slots.current()), 4) == 4

    asyncio.run(main())


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_signing_and_trusting_daemons_configured_by_their_variables(signed, tmp_path, ws):
    """Real processes: a publisher signing with WEIGHTSYNC_SIGNING_KEY, a subscriber trusting
    WEIGHTSYNC_TRUSTED_KEY; an attacker's version shows in the subscriber's status and metrics. A
    variable set but empty (a missing Secret) stops the daemon at start."""
    watch, store = tmp_path / "watch", tmp_path / "daemon-store"
    watch.mkdir()
    shutil.copytree(signed.traj[0], watch / "checkpoint-0")
    (watch / "checkpoint-0" / "COMPLETE").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    pub = Daemon(
        "publisher", ["--store", store, "--watch", watch], tmp_path, {**env, "WEIGHTSYNC_SIGNING_KEY": str(signed.key)}
    )
    sub = Daemon(
        "subscriber",
        ["--store", store, "--target", tmp_path / "target", "--no-fsync"],
        tmp_path,
        {**env, "WEIGHTSYNC_TRUSTED_KEY": str(signed.pub)},
    )
    try:
        pub.start()
        assert pub.status()["signing_key"] == signed.key_id
        sub.start()
        sub.wait_version(0)
        _publish(signed.traj[1], store, version=1)  # the attacker's
        status = wait_for(lambda: (s := sub.status())["refused"] and s, 30, f"the refusal\n{sub.log()}")
        assert status["refused"]["version"] == 1 and status["current_version"] == 0
        _, text, _ = sub.get("/metrics")
        assert 'weightsync_refused_version{cluster="",region="",subscriber=' in text
        assert [line for line in text.splitlines() if line.startswith("weightsync_refused_version{")][0].endswith(
            " 1.0"
        )
        assert "refused a version: not signed by a trusted key" in sub.log()
    finally:
        assert pub.stop() == 0 and sub.stop() == 0
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "subscriber", "--store", store, "--target", tmp_path / "t3"],
        env={**env, "WEIGHTSYNC_TRUSTED_KEY": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "WEIGHTSYNC_TRUSTED_KEY is set but names no key file" in ws.error_line(proc.stderr)


def test_the_torch_sink_refuses_what_no_trusted_key_signed(signed):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from weightsync.torch.sink import TorchSink

    def tensors(ckpt: Path) -> dict:
        return {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    def bits(sd: dict) -> dict:
        return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in sd.items()}

    url, trusted = f"file://{signed.store}", [signed.pub]
    live = {k: v.clone() for k, v in tensors(signed.traj[1]).items()}
    sink = TorchSink(url, live, 1, trusted_keys=trusted)
    sink.update(2)
    assert bits(live) == bits(tensors(signed.traj[2]))
    _unsigned(signed)
    with pytest.raises(SignatureError, match="version 3 .* refused, it is not signed"):
        sink.update(3)
    assert sink.version == 2 and bits(live) == bits(tensors(signed.traj[2]))  # nothing changed
    with pytest.raises(SignatureError):
        TorchSink(url, {k: v.clone() for k, v in tensors(signed.traj[3]).items()}, 3, trusted_keys=trusted)
    assert TorchSink(url, {k: v.clone() for k, v in tensors(signed.traj[3]).items()}, 3).version == 3  # no keys


def test_checks_switched_on_over_a_folder_of_unsigned_versions(trajectory, tmp_path, ok_cli, ws):
    """A store published unsigned, then signed: the signing publisher's first version is a keyframe,
    and folders (whole and partial) holding an unsigned version move to it with trusted keys (their
    old manifest is refused, so nothing of it is trusted but whole unchanged files)."""
    store, out, partial, key = tmp_path / "store", tmp_path / "out", tmp_path / "partial", tmp_path / "k"
    for ckpt in trajectory[:2]:
        _publish(ckpt, store)
    ok_cli("pull", "--store", store, out, "--no-progress")
    experts = Selection(("*experts*",))
    materialize(weightsync.open_repo(f"file://{store}"), partial, 1, experts)
    weightsync.write_key_pair(key)
    r = _publish(trajectory[2], store, key)
    assert r.keyframe and r.parent == 1 and _deltas(store, 2) == 0
    assert ok_cli("pull", "--store", store, "--trusted-key", f"{key}.pub", out, "--no-progress") == "2\n"
    ws.assert_replica(out, trajectory[2])
    assert not _publish(trajectory[3], store, key).keyframe
    trusting = weightsync.open_repo(f"file://{store}", trusted_keys=[f"{key}.pub"])
    assert materialize(trusting, partial, 3, experts).version == 3
    verify_partial(trusting, partial)


def test_a_subscriber_given_keys_reports_the_unsigned_version_it_already_serves(trajectory, tmp_path):
    store, key = tmp_path / "store", tmp_path / "k"
    url = f"file://{store}"
    _publish(trajectory[0], store)
    weightsync.write_key_pair(key)

    def subscriber(keys) -> Subscriber:
        cfg = SubscriberConfig(StoreConfig(url, trusted_keys=keys), tmp_path / "t", Identity("s1"), fsync=False)
        metrics = Metrics(CollectorRegistry(), "subscriber", subscriber="s1", runtime=False)
        return Subscriber(cfg, weightsync.open_repo(url, trusted_keys=keys), metrics)

    async def main():
        for sub in (subscriber(None), subscriber(Keyring.of([f"{key}.pub"]))):  # a restart, given keys
            sub._wake = asyncio.Event()
            await asyncio.to_thread(sub._startup)
            await sub._iteration()
            assert sub.view.current == 0
        assert sub.status()["refused"]["version"] == 0  # installed without keys: still served, reported
        _publish(trajectory[1], store, key)  # the first signed version: a keyframe
        await sub._iteration()
        assert sub.view.current == 1 and sub.status()["refused"] is None

    asyncio.run(main())
