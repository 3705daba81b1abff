"""Real processes racing on one folder: pulls of different versions, verify, kills, a subscriber
and manual pulls into its slots. One writer per folder (docs/RELIABILITY.md): whatever exits 0
leaves a folder that holds the version it records, byte for byte; a refused writer says who holds
the folder; verify never changes anything. ``WEIGHTSYNC_TEST_SEED`` replays a run.
"""

from __future__ import annotations

import os
import random
import signal
import time

from procs import finish, spawn_cli
from test_daemons import Daemon

import weightsync
from weightsync.local.state import read_state

BUSY = "one writer per folder"


def _settled(url: str, out) -> int | None:
    """The version ``out`` records, checked byte for byte (None: it records none, which only a
    kill or a refused first pull may leave)."""
    state = read_state(out) if out.exists() else None
    if state is None:
        return None
    assert weightsync.verify(url, out, state.version) == state.version
    return state.version


def test_pulls_verify_and_kills_racing_on_one_folder(published, ws, tmp_path):
    store, ckpts = published
    url = f"file://{store}"
    out = tmp_path / "out"
    seed = int(os.environ.get("WEIGHTSYNC_TEST_SEED", time.time_ns() & 0xFFFF))
    rng = random.Random(seed)
    refused = 0
    for rnd in range(6):
        versions = [rng.randrange(len(ckpts)) for _ in range(3)]
        procs = [spawn_cli("pull", "--store", url, out, "--version", v) for v in versions]
        checker = spawn_cli("verify", "--store", url, out)
        victim = rng.randrange(3) if rnd % 2 else None  # every other round, one pull dies mid-way
        if victim is not None:
            time.sleep(rng.uniform(0.0, 0.6))
            procs[victim].send_signal(signal.SIGKILL)
        won = []
        for i, (v, p) in enumerate(zip(versions, procs)):
            rc, _, err = finish(p)
            if i == victim and rc == -signal.SIGKILL:
                continue
            assert rc in (0, 2), f"seed {seed}: pull {v} exited {rc}: {err}"
            if rc == 2:
                assert BUSY in err and "in use by weightsync pull (pid" in err, f"seed {seed}: {err}"
                refused += 1
            else:
                won.append(v)
        rc, _, err = finish(checker)
        assert "Traceback" not in err, err
        got = _settled(url, out)
        if victim is None:
            assert len(won) >= 1 and got in won, f"seed {seed}: {won} exited 0, the folder holds {got}"
        if victim is None:
            assert not (out / ".weightsync" / "lock").exists(), "a lock outlived its holders"
    assert refused > 0, f"seed {seed}: no pull ever met another; the race was not exercised"
    # whatever the races and kills left, a plain pull brings the folder to the head
    rc, _, err = finish(spawn_cli("pull", "--store", url, out))
    assert rc == 0, err
    assert _settled(url, out) == len(ckpts) - 1
    ws.assert_replica(out, ckpts[-1])


def test_manual_pulls_race_a_subscriber_and_lose_cleanly(published, ws, tmp_path):
    """While a subscriber moves between versions (PUT /v1/target), pulls into its ``current``, its
    slots and the folder are refused every time; the subscriber always serves a verified copy."""
    store, ckpts = published
    url = f"file://{store}"
    target = tmp_path / "sub"
    sub = Daemon("subscriber", ["--store", url, "--target", target, "--no-fsync", "--version", 0], tmp_path).start()
    try:
        sub.wait_version(0)
        rng = random.Random(int(os.environ.get("WEIGHTSYNC_TEST_SEED", time.time_ns() & 0xFFFF)))
        for rnd in range(4):
            want = rng.choice([v for v in range(len(ckpts)) if v != sub.status()["current_version"]])
            sub.put_target(want)
            wheres = [target / "current", target / "slots" / "a", target / "slots" / "b", target]
            procs = [spawn_cli("pull", "--store", url, w, "--version", rng.randrange(len(ckpts))) for w in wheres]
            for w, p in zip(wheres, procs):
                rc, _, err = finish(p)
                assert rc == 2 and BUSY in err and "weightsync subscriber" in err, (w, rc, err)
            sub.wait_version(want)
            assert weightsync.verify(url, target / "current", want) == want
            ws.assert_replica(target / "current", ckpts[want])
    finally:
        assert sub.stop() == 0
