"""A pin set through the API survives a killed and restarted subscriber (real processes).

``PUT /v1/target`` stores the target in ``TARGET/.weightsync/target.json``; a restarted subscriber
goes on serving the pinned version while the head moves, an unpin (``"latest"``) is stored too, a
``--version`` on the command line wins over the stored pin without replacing it, and a damaged file
stops the start-up with one error line and leaves ``current`` as it was.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from test_daemons import daemons, verify_current  # noqa: F401 - daemons is a fixture

import weightsync
from weightsync.demo import make_trajectory

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


def stored(target) -> object:
    return json.loads((target / ".weightsync" / "target.json").read_text())["target"]


def stays_at(sub, version: int, head: int, seconds: float = 0.6) -> dict:
    """The status once ``sub`` has kept serving ``version`` for ``seconds`` (several polls at 0.1 s)
    and knows the head is ``head``. A subscriber still ``starting`` has not read its slots (its
    ``current_version`` is None): under load a status came before it had, and failed here."""
    started = time.monotonic() + 60
    while (s := sub.status())["state"] == "starting":
        assert time.monotonic() < started, (s, sub.log())
        time.sleep(0.05)
    deadline = time.monotonic() + seconds
    while True:
        assert s["current_version"] == version, (s, sub.log())
        if time.monotonic() > deadline and s["latest_version"] == head:
            return s
        time.sleep(0.05)
        s = sub.status()


def test_a_pin_survives_a_restart_while_the_head_moves(tmp_path, daemons):  # noqa: F811
    store, target = f"file://{tmp_path / 'store'}", tmp_path / "sub"
    traj = make_trajectory(tmp_path / "traj", steps=5, **TINY)
    for v in range(3):
        weightsync.publish(traj[v], store, base_dir=traj[v - 1] if v else None)
    args = ["--store", store, "--target", target, "--id", "pinned"]  # fsync on: the real write path

    sub = daemons("subscriber", args)
    assert sub.wait_version(2)["target_from"] == "default"
    assert sub.put_target(1)["target_from"] == "api"
    sub.wait_version(1)
    assert stored(target) == 1
    sub.stop(signal.SIGKILL)

    weightsync.publish(traj[3], store, base_dir=traj[2])  # the head moves while it is down
    litter = target / ".weightsync" / ".tmp-killed-write"  # what a write killed before its rename leaves
    litter.write_text('{"format"')
    sub = daemons("subscriber", args)
    sub.wait_version(1)
    assert not litter.exists()
    s = stays_at(sub, 1, head=3)
    assert (s["target"], s["target_from"], s["lag"]) == (1, "stored", 2)
    verify_current(store, target, 1, traj[1])
    assert "target at start-up" in sub.log() and "source=stored" in sub.log()

    # unpinning is stored too: after a kill, it follows the head
    assert sub.put_target("latest")["target"] == "latest"
    sub.wait_version(3)
    assert stored(target) == "latest"
    sub.stop(signal.SIGKILL)
    weightsync.publish(traj[4], store, base_dir=traj[3])
    sub = daemons("subscriber", args)
    s = sub.wait_version(4)
    assert (s["target"], s["target_from"]) == ("latest", "stored")
    verify_current(store, target, 4, traj[4])

    # a command-line pin wins over the stored one, and does not replace it
    sub.put_target(2)
    sub.wait_version(2)
    assert sub.stop() == 0
    sub = daemons("subscriber", [*args, "--version", 0])
    sub.wait_version(0)
    s = stays_at(sub, 0, head=4)
    assert (s["target"], s["target_from"]) == (0, "command line")
    assert "overrides_stored=2" in sub.log()
    assert stored(target) == 2
    assert sub.stop() == 0
    sub = daemons("subscriber", args)  # the flag removed: the operator's last API choice is back
    sub.wait_version(2)
    s = stays_at(sub, 2, head=4)
    assert (s["target"], s["target_from"]) == (2, "stored")
    verify_current(store, target, 2, traj[2])
    assert sub.stop() == 0
    sub = daemons("subscriber", [*args, "--version", "latest"])  # follow the head over a stored pin
    s = sub.wait_version(4)
    assert (s["target"], s["target_from"]) == ("latest", "command line")
    assert stored(target) == 2
    assert sub.stop() == 0


def test_a_damaged_stored_target_stops_the_start_up(tmp_path, daemons):  # noqa: F811
    store, target = f"file://{tmp_path / 'store'}", tmp_path / "sub"
    traj = make_trajectory(tmp_path / "traj", steps=1, **TINY)
    weightsync.publish(traj[0], store)
    args = ["--store", store, "--target", target, "--no-fsync"]
    sub = daemons("subscriber", args)
    sub.put_target(0)
    sub.wait_version(0)
    assert sub.stop() == 0
    weightsync.publish(traj[1], store, base_dir=traj[0])
    path = target / ".weightsync" / "target.json"
    path.write_text('{"format": "weightsync.subscriber-target", "tar')  # e.g. edited by hand

    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "subscriber", *map(str, args), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("weightsync: error:") and str(path) in lines[0] and "damaged stored target" in lines[0]
    assert "--version" in lines[0] and "remove the file" in lines[0]
    verify_current(store, target, 0, traj[0])  # nothing moved

    # an explicit --version still starts (with a warning), and the next API call repairs the file
    sub = daemons("subscriber", [*args, "--version", 0])
    assert sub.wait_version(0)["target_from"] == "command line"
    assert "ignoring a damaged stored target" in sub.log()
    sub.put_target("latest")
    sub.wait_version(1)
    assert stored(target) == "latest"
    assert sub.stop() == 0


def test_a_restart_with_another_store_never_serves_the_old_stores_bytes_and_a_pin_survives_a_link(
    tmp_path,
    daemons,  # noqa: F811
):
    """A subscriber restarted on its target with another ``--store`` (a new run) took its slots'
    version numbers for the new store's: it served the old run's version 1 as the new run's, ready,
    and with ``--version 1`` never corrected it. A slot filled from another store now holds nothing
    of this one. And a pin stored under the store's plain path was dropped when the same store was
    given through a link ("ignoring a target stored for another store"): it is kept. A mirror of the
    same versions (a failover) keeps its slots (a review found them emptied and fetched again)."""
    old, new = f"file://{tmp_path / 'old'}", f"file://{tmp_path / 'new'}"
    run1 = make_trajectory(tmp_path / "run1", steps=1, seed=1, **TINY)
    run2 = make_trajectory(tmp_path / "run2", steps=2, seed=2, **TINY)
    for v in range(2):
        weightsync.publish(run1[v], old)
        weightsync.publish(run2[v], new)
    target = tmp_path / "sub"
    sub = daemons("subscriber", ["--store", old, "--target", target, "--id", "s1"])
    sub.wait_version(1)
    assert sub.stop() == 0
    sub = daemons("subscriber", ["--store", new, "--target", target, "--id", "s1", "--version", 1])
    sub.wait_version(1)
    verify_current(new, target, 1, run2[1])
    assert sub.put_target(0)["target"] == 0
    sub.wait_version(0)
    assert sub.stop() == 0
    weightsync.publish(run2[2], new)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "new")
    sub = daemons("subscriber", ["--store", f"file://{link}", "--target", target, "--id", "s1"])
    s = stays_at(sub, 0, head=2)
    assert (s["target"], s["target_from"]) == (0, "stored"), sub.log()
    assert "another store" not in sub.log()
    verify_current(new, target, 0, run2[0])
    assert sub.stop() == 0
    import shutil

    shutil.copytree(tmp_path / "new", tmp_path / "mirror")  # a failover to a mirror of the same versions
    sub = daemons("subscriber", ["--store", f"file://{tmp_path / 'mirror'}", "--target", target, "--id", "s1"])
    sub.wait_version(2)  # (the pin was the other store's) from its slots, which hold the mirror's version 0 too
    assert "holds this store's version" in sub.log() and "base_version=0" in sub.log().split("started")[-1]
    verify_current(f"file://{tmp_path / 'mirror'}", target, 2, run2[2])
    assert sub.stop() == 0
    from weightsync.format.keys import HEAD_KEY
    from weightsync.format.manifest import head_to_json

    behind = tmp_path / "behind"  # version 2 stored there but not committed (its head is 1): not taken for it
    shutil.copytree(tmp_path / "new", behind)
    (behind / HEAD_KEY).write_bytes(head_to_json(1))
    sub = daemons("subscriber", ["--store", f"file://{behind}", "--target", target, "--id", "s1"])
    sub.wait_version(1)
    last = sub.log().rsplit("target at start-up", 1)[-1]
    assert not [line for line in last.splitlines() if "holds this store's version" in line and "version=2" in line]
    stays_at(sub, 1, head=1)
    verify_current(f"file://{behind}", target, 1, run2[1])
    assert sub.stop() == 0
