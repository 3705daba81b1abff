"""When a subscriber daemon refills its standby slot in place (weightsync.service.slots): with a swap hook,
only once the hook of the latest swap succeeded; without one, ``--standby-hold`` seconds after the
swap. Before that its files are replaced by rename, so a reader of the previous version keeps its
bytes. Every version served is verified byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_daemons import daemons, verify_current, wait_for  # noqa: F401  (daemons is a fixture)

import weightsync
from weightsync.demo import make_trajectory
from weightsync.sync.fleet import record_from_json, record_key


@pytest.fixture
def setup(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=4, hidden=64, layers=1, experts=2, vocab=512)
    weightsync.publish(traj[0], store, 0)
    return store, traj


def shard(target: Path, slot: str) -> Path:
    return target / "slots" / slot / "model.safetensors"


def publish_and_sync(store, traj, sub, target, v) -> dict:
    weightsync.publish(traj[v], store, v, base_dir=traj[v - 1])
    last = sub.wait_version(v)["last_sync"]
    verify_current(store, target, v, traj[v])
    return last


def test_within_the_hold_a_reader_of_the_previous_version_keeps_its_bytes(setup, tmp_path, daemons):  # noqa: F811
    store, traj = setup
    target = tmp_path / "t"
    sub = daemons("subscriber", ["--store", store, "--target", target, "--no-fsync", "--standby-hold", 3600])
    sub.wait_version(0)
    publish_and_sync(store, traj, sub, target, 1)  # into slot b, never served: refilled in place if seeded by then
    with open(shard(target, "a"), "rb") as reader:  # slot a serves version 0 no more, but is still open
        old = (traj[0] / "model.safetensors").read_bytes()
        assert publish_and_sync(store, traj, sub, target, 2)["in_place"] is False  # slot a now holds version 2
        assert reader.read() == old
    assert shard(target, "a").read_bytes() == (traj[2] / "model.safetensors").read_bytes()


def test_after_the_hold_the_standby_is_overwritten_in_place(setup, tmp_path, daemons):  # noqa: F811
    store, traj = setup
    target = tmp_path / "t"
    sub = daemons("subscriber", ["--store", store, "--target", target, "--no-fsync", "--standby-hold", 0])
    sub.wait_version(0)
    first = publish_and_sync(store, traj, sub, target, 1)
    assert first["in_place"] is True and first["from_version"] == 0  # slot b was empty: filled from slot a
    inode = shard(target, "a").stat().st_ino
    last = publish_and_sync(store, traj, sub, target, 2)
    assert (
        last["in_place"] is True
        and last["from_version"] == 1
        and last["fetched_bytes"] <= weightsync.open_repo(store).manifest(2).payload_bytes
    )
    assert shard(target, "a").stat().st_ino == inode  # the same file, rewritten
    # rolling back never writes in place: slot b holds version 1, which is reused as it is
    sub.put_target(1)
    assert sub.wait_version(1)["last_sync"]["in_place"] is False
    verify_current(store, target, 1, traj[1])


def test_a_succeeded_swap_hook_releases_the_standby_and_nothing_else_does(setup, tmp_path, daemons):  # noqa: F811
    store, traj = setup
    target = tmp_path / "t"
    sub = daemons(
        "subscriber",
        ["--store", store, "--target", target, "--no-fsync", "--standby-hold", 3600, "--hook-command", "true"],
    )
    sub.wait_version(0)
    wait_for(lambda: (sub.status()["hook"] or {}).get("ok"), 10, "the swap hook of version 0")
    assert publish_and_sync(store, traj, sub, target, 1)["in_place"] is True
    wait_for(lambda: sub.status()["hook"]["version"] == 1, 10, "the swap hook of version 1")
    assert publish_and_sync(store, traj, sub, target, 2)["in_place"] is True
    # a hook that fails, or one still running, keeps the standby as it is, whatever the hold
    weightsync.publish(traj[3], store, 3, base_dir=traj[2])
    for name, hook in (
        ("failing", ["--hook-command", "false", "--hook-attempts", 1]),
        ("slow", ["--hook-command", "sleep 60"]),
    ):
        other = tmp_path / name
        d = daemons(
            "subscriber",
            ["--store", store, "--target", other, "--no-fsync", "--standby-hold", 0, "--version", 1, *hook],
        )
        d.wait_version(1)
        d.put_target(2)  # the first standby was never served: it may be refilled whatever the hook says
        d.wait_version(2)
        d.put_target(3)  # slot a served version 1
        assert d.wait_version(3)["last_sync"]["in_place"] is False
        verify_current(store, other, 3, traj[3])


def test_a_seed_killed_midway_is_cleared_even_when_the_standby_is_released(setup, tmp_path, daemons):  # noqa: F811
    """What a clone killed before its state leaves (files linked to the serving slot, no state) is
    no version and no refill: the next sync empties it, and never writes through the links."""
    import os

    from weightsync.local.state import read_state

    store, traj = setup
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    target = tmp_path / "t"
    a, b = target / "slots" / "a", target / "slots" / "b"
    weightsync.pull(store, a, 0, config=weightsync.PullConfig(fsync=False))
    os.symlink("slots/a", target / "current")
    b.mkdir(parents=True)
    for rel in read_state(a).files:
        os.link(a / rel, b / rel)
    sub = daemons(
        "subscriber", ["--store", store, "--target", target, "--no-fsync", "--standby-hold", 0, "--version", 1]
    )
    sub.wait_version(1)
    verify_current(store, target, 1, traj[1])
    assert weightsync.verify(store, a, 0) == 0  # the old slot was never written through the links


def test_a_partial_subscriber_clears_a_slot_left_by_a_killed_refill(setup, tmp_path, daemons):  # noqa: F811
    """An interrupted refill is a full-mode slot: a subscriber restarted with --include empties it
    rather than keeping its files beside the selected tensors."""
    from weightsync.local.state import REFILL
    from weightsync.sync.selection import verify_partial

    store, traj = setup
    target = tmp_path / "t"
    slot = target / "slots" / "a"
    slot.mkdir(parents=True)
    (slot / ".weightsync").mkdir()
    (slot / ".weightsync" / REFILL).write_text("{}")
    (slot / "left-by-the-refill.bin").write_bytes(b"x" * 100)
    sub = daemons("subscriber", ["--store", store, "--target", target, "--no-fsync", "--include", "model.norm.weight"])
    sub.wait_version(0)
    assert verify_partial(weightsync.open_repo(store), target / "current", 0) == 0
    assert not (slot / "left-by-the-refill.bin").exists() and not (slot / ".weightsync" / REFILL).exists()


def seeded(target: Path, slot: str, version: int) -> bool:
    from weightsync.local.state import read_state

    state = read_state(target / "slots" / slot)
    return state is not None and state.version == version


def test_an_idle_subscriber_copies_the_current_version_into_an_empty_standby(setup, tmp_path, daemons):  # noqa: F811
    """After a start the standby slot is empty; while idle the daemon gives it a copy of its own
    (no links to the served files), so even within the hold the first delta refills it in place."""
    store, traj = setup
    target = tmp_path / "t"
    sub = daemons("subscriber", ["--store", store, "--target", target, "--no-fsync", "--standby-hold", 3600])
    sub.wait_version(0)
    # the copy's state is written before the daemon checks the served files and takes the slot as
    # its standby; the log line comes after both
    wait_for(
        lambda: seeded(target, "b", 0) and "seeded the standby slot" in sub.log(), 20, "a copy of version 0 in slot b"
    )
    a, b = shard(target, "a").stat(), shard(target, "b").stat()
    assert a.st_ino != b.st_ino and a.st_nlink == b.st_nlink == 1
    assert weightsync.verify(store, target / "slots" / "b", 0) == 0
    last = publish_and_sync(store, traj, sub, target, 1)
    assert last["in_place"] is True and last["from_version"] == 0
    assert shard(target, "b").stat().st_ino == b.st_ino  # the copy itself was rewritten
    assert weightsync.verify(store, target / "slots" / "a", 0) == 0  # the served slot is untouched
    # slot a served version 0: within the hold it is not written in place
    assert publish_and_sync(store, traj, sub, target, 2)["in_place"] is False


def test_no_copy_without_refills_and_a_killed_copy_is_redone(setup, tmp_path, daemons):  # noqa: F811
    """With --standby-hold never no refill would follow, so the standby stays empty; files a
    killed copy left (no state) are replaced by a whole copy."""
    store, traj = setup
    never = tmp_path / "never"
    sub = daemons(
        "subscriber",
        ["--store", store, "--target", never, "--no-fsync", "--standby-hold", "never"]
        + ["--id", "never", "--ledger-interval", 0.1],
    )
    sub.wait_version(0)
    # each idle poll ends with a fleet heartbeat (--ledger-interval as short as a poll), after the
    # point where a copy would have started: ten heartbeats after version 0, ten idle polls at least
    record = Path(store.removeprefix("file://")) / record_key("never")
    beats: set[float] = set()

    def ten_idle_polls() -> bool:
        rec = record_from_json(record.read_bytes(), "record")
        if rec.current_version == 0 and rec.state == "serving":
            beats.add(rec.updated)
        return len(beats) >= 11  # the first may be the swap's own record

    wait_for(ten_idle_polls, 30, "ten idle polls of the subscriber", interval=0.02)
    assert sub.status()["standby_version"] is None and "standby slot" not in sub.log()
    assert [p.name for p in (never / "slots" / "b").iterdir()] == [".weightsync"]  # the subscriber's lock alone
    assert [p.name for p in (never / "slots" / "b" / ".weightsync").iterdir()] == ["lock"]
    target = tmp_path / "t"
    (target / "slots" / "b").mkdir(parents=True)
    (target / "slots" / "b" / "model.safetensors").write_bytes(b"half a copy")
    (target / "slots" / "b" / "stray.bin").write_bytes(b"x")
    sub2 = daemons("subscriber", ["--store", store, "--target", target, "--no-fsync"])
    sub2.wait_version(0)
    wait_for(lambda: seeded(target, "b", 0), 20, "a copy of version 0 in slot b")
    assert weightsync.verify(store, target / "slots" / "b", 0) == 0  # no stray file left either


def test_an_idle_copy_gives_way_to_a_new_head_a_request_or_a_stop(setup, tmp_path, monkeypatch):
    """In process, with 64 MiB pieces shrunk to 1 KiB: the copy asks between pieces whether other
    work came (a new head, polled every poll interval; the API's wake; a stop), and if so removes
    what it copied and returns at once; when idle again it copies the whole version."""
    import asyncio
    import functools

    from prometheus_client import CollectorRegistry

    import weightsync.local.base as local
    from weightsync.service.config import Identity, StoreConfig, SubscriberConfig
    from weightsync.service.metrics import Metrics
    from weightsync.service.runtime import Stopped
    from weightsync.service.subscriber import Subscriber

    store, traj = setup
    monkeypatch.setattr(local, "_copy_file", functools.partial(local._copy_file, piece=1024))
    cfg = SubscriberConfig(StoreConfig(store), tmp_path / "t", Identity("s1"), poll_interval=1e-6, fsync=False)
    sub = Subscriber(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "subscriber", subscriber="s1"))
    standby = tmp_path / "t" / "slots" / "b"

    async def main():
        sub._wake = asyncio.Event()
        await asyncio.to_thread(sub._startup)
        await sub._iteration()  # pulls version 0 into slot a and swaps; the standby stays empty
        assert sub.view.current == 0 and sub.view.standby is None and not any(standby.iterdir())
        weightsync.publish(traj[1], store, 1, base_dir=traj[0])  # the head moves: sub.latest is still 0
        assert await sub._seed_standby() is True and not any(standby.iterdir())
        sub.latest = 1
        sub._wake.set()  # an API request
        assert await sub._seed_standby() is True and not any(standby.iterdir())
        sub._wake.clear()
        sub.stop_token.set()
        with pytest.raises(Stopped):
            await sub._seed_standby()
        sub.stop_token = type(sub.stop_token)()
        assert await sub._seed_standby() is False and sub.view.standby == 0
        assert weightsync.verify(store, standby, 0) == 0

    asyncio.run(main())


def test_a_standby_that_fails_its_verification_before_the_swap_is_rebuilt_not_retried_as_it_is(
    setup, tmp_path, monkeypatch, ws
):
    """``--verify-before-swap`` reads the filled slot back. When it finds wrong bytes that the fill's
    own checks could not see (another process wrote into a file while the fill wrote it: simulated
    by changing the file before the fill takes its times), the slot stops claiming the version.
    Before, its state kept claiming it, every later try kept every file, and failed again: the
    subscriber never reached the version."""
    import asyncio
    import os
    import time

    from prometheus_client import CollectorRegistry

    import weightsync.sync.pull as pulling
    from weightsync.service.config import Identity, StoreConfig, SubscriberConfig
    from weightsync.service.metrics import Metrics
    from weightsync.service.subscriber import Subscriber

    store, traj = setup
    cfg = SubscriberConfig(
        StoreConfig(store),
        tmp_path / "t",
        Identity("s1"),
        poll_interval=1e-6,
        fsync=False,
        verify_before_swap=True,
        standby_hold=0.0,  # the standby is refilled in place
    )
    now = [time.time()]
    metrics = Metrics(CollectorRegistry(), "subscriber", subscriber="s1")
    sub = Subscriber(cfg, weightsync.open_repo(store), metrics, clock=lambda: now[0])
    real = pulling._write_one

    def write_one(fp, results, root, cfg, in_place):
        real(fp, results, root, cfg, in_place)
        if fp.entry.path == "model.safetensors":
            ws.flip_byte(root / fp.entry.path, -2)
        st = os.lstat(root / fp.entry.path)
        return st.st_mtime_ns, st.st_ctime_ns

    async def main():
        sub._wake = asyncio.Event()
        await asyncio.to_thread(sub._startup)
        await sub._iteration()
        assert sub.view.current == 0
        weightsync.publish(traj[1], store, 1, base_dir=traj[0])
        sub.latest = 1
        monkeypatch.setattr(pulling, "_write_one", write_one)
        await sub._iteration()
        assert sub.view.current == 0 and "checksum mismatch" in (sub.last_error or ""), sub.last_error
        assert sub.last_sync["version"] == 0
        monkeypatch.undo()
        for _ in range(3):
            now[0] += 3600  # past the back-off
            await sub._iteration()
            if sub.view.current == 1:
                break
        assert sub.view.current == 1, sub.last_error
        assert sub.last_sync["in_place"] is True

    asyncio.run(main())
    verify_current(store, tmp_path / "t", 1, traj[1])
