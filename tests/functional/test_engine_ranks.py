"""Engine ranks as real processes: one subscriber daemon per node, torch workers beside it.

Each worker (engine_worker.py) loads a module from the subscriber's current slot and runs an
:class:`~weightsync.torch.rank.EngineRank`; it writes the version it holds and a digest of its
tensors' bytes. The ranks of a replica switch together to each new version, bit-exact with the
checkpoint published; a rank that cannot take a version (a tensor its model lacks) aborts the
others, which stay on the version they hold; a killed rank is dropped, its replica waits for it
while another replica follows, and a restarted rank brings its replica along.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_worker import digest, load_tensors
from safetensors.torch import save_file
from test_daemons import Daemon, wait_for

import weightsync
from weightsync.demo import make_trajectory
from weightsync.store import open_store
from weightsync.sync.fleet import read_records

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
WORKER = Path(__file__).with_name("engine_worker.py")
TOKEN = "node-token"


class Engine:
    """An engine worker process (one rank) and the state file it writes."""

    count = 0

    def __init__(self, sub: Daemon, target: Path, tmp: Path, replica: str, rank: int, world: int, *extra: str):
        Engine.count += 1
        self.name = f"{replica}/{rank}"
        self.out = tmp / f"engine-{Engine.count}.json"
        self.log_path = tmp / f"engine-{Engine.count}.log"
        args = ["--url", sub.url, "--target", target, "--replica", replica, "--rank", rank, "--world", world]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, WORKER, *map(str, args), "--out", self.out, *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "WEIGHTSYNC_API_TOKEN": TOKEN},
            )

    def state(self) -> dict | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"engine {self.name} exited with {self.proc.returncode}:\n{self.log()}")
        return json.loads(self.out.read_text()) if self.out.exists() else None

    def wait(self, version: int, timeout: float = 30) -> dict:
        return wait_for(
            lambda: (s := self.state()) and s["version"] == version and s,
            timeout,
            f"engine {self.name} to hold version {version}\n{self.log()}",
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                assert self.proc.wait(10) == 0, self.log()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise AssertionError(f"engine {self.name} ignored SIGTERM\n{self.log()}") from None


@pytest.fixture
def node(tmp_path):
    """``(start_subscriber(*flags), engine(replica, rank, world, *flags), publish(v, folder=None),
    checkpoints, store)``: version 0 published; every process is ended at the end of the test."""
    traj = make_trajectory(tmp_path / "traj", steps=3, **TINY)
    store, target = tmp_path / "store", tmp_path / "node"
    weightsync.publish(traj[0], store)
    daemons: list[Daemon] = []
    engines: list[Engine] = []

    def start(*extra) -> Daemon:
        args = ["--store", store, "--target", target, "--no-fsync", "--id", "node-1", *extra]
        sub = Daemon("subscriber", args, tmp_path, env={"WEIGHTSYNC_API_TOKEN": TOKEN}, token=TOKEN).start()
        daemons.append(sub)
        sub.wait_version(0)
        return sub

    def engine(replica: str, rank: int, world: int, *extra: str) -> Engine:
        e = Engine(daemons[-1], target, tmp_path, replica, rank, world, *extra)
        engines.append(e)
        return e

    def publish(v: int, folder: Path | None = None) -> None:
        weightsync.publish(folder or traj[v], store, v, base_dir=traj[v - 1])

    yield start, engine, publish, traj, store
    for p in [e.proc for e in engines] + [d.proc for d in daemons]:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def expected(folder: Path, names: list[str]) -> str:
    """The digest of ``folder``'s tensors that the model holds (``names``; all of them exist there)."""
    tensors = load_tensors(folder)
    assert set(names) <= set(tensors)
    return digest({n: tensors[n] for n in names})


def replica(sub: Daemon, name: str) -> dict | None:
    return next((r for r in sub.status()["engines"]["replicas"] if r["replica"] == name), None)


def in_step(sub: Daemon, name: str, version: int, timeout: float = 30) -> dict:
    return wait_for(
        lambda: (r := replica(sub, name)) and r["state"] == "in step" and r["version"] == version and r,
        timeout,
        f"replica {name} in step at version {version}\n{sub.log()[-3000:]}",
    )


def test_the_ranks_of_a_replica_switch_together_bit_exact(node):
    start, engine, publish, traj, store = node
    sub = start()
    ranks = [engine("r0", 0, 2), engine("r0", 1, 2, "--step-apply")]  # rank 1 applies at its step boundary
    in_step(sub, "r0", 0)
    for v in (1, 2):
        publish(v)
        states = [e.wait(v) for e in ranks]
        for s in states:
            assert s["digest"] == expected(traj[v], s["names"]) and len(s["names"]) == len(load_tensors(traj[v]))
        in_step(sub, "r0", v)
    # every rank prepared before any applied, in each transaction (a state file follows its apply)
    for e in ranks:
        wait_for(lambda e=e: sum(h[1] == "applied" for h in e.state()["history"]) == 2, 5, f"{e.name}'s applies")
    history = [(t, what, txn) for e in ranks for t, what, txn, _ in e.state()["history"]]
    for txn in {txn for _, _, txn in history}:
        prepared = [t for t, what, x in history if x == txn and what == "prepared"]
        applied = [t for t, what, x in history if x == txn and what == "applied"]
        assert len(prepared) == len(applied) == 2 and max(prepared) <= min(applied), history

    # a roll back through the API: the ranks follow current backwards too
    sub.put_target(1)
    for e in ranks:
        s = e.wait(1)
        assert s["digest"] == expected(traj[1], s["names"])
    sub.put_target("latest")
    for e in ranks:
        e.wait(2)
    in_step(sub, "r0", 2)
    assert sub.log().count("engine transaction") == 2 * 4  # one per switch (preparing, applied), no more

    metrics = sub.get("/metrics")[1]
    for k in (0, 1):
        assert f'weightsync_engine_version{{cluster="",rank="{k}",region="",replica="r0",subscriber="node-1"}} 2.0' in (
            metrics
        )
    rows = wait_for(
        lambda: (rs := read_records(open_store(str(store)))[0]) and [e.version for e in rs[0].engines] == [2, 2] and rs,
        10,
        "the fleet record to show both ranks at version 2",
    )
    assert [(e.replica, e.rank, e.world) for e in rows[0].engines] == [("r0", 0, 2), ("r0", 1, 2)]
    for e in ranks:
        e.stop()
    wait_for(lambda: replica(sub, "r0") is None, 5, "both ranks to leave")
    assert sub.stop() == 0


def test_a_rank_that_cannot_take_a_version_aborts_the_other(node, tmp_path):
    start, engine, publish, traj, _ = node
    sub = start()
    able = engine("r0", 0, 2, "--exclude", "extra.*")  # leaves the new tensor alone
    unable = engine("r0", 1, 2)  # its model has nowhere to put it
    in_step(sub, "r0", 0)
    grown = tmp_path / "grown"
    subprocess.run(["cp", "-r", str(traj[1]), str(grown)], check=True)
    save_file({"extra.weight": torch.arange(16, dtype=torch.float32).reshape(4, 4)}, str(grown / "extra.safetensors"))
    publish(1, grown)
    sub.wait_version(1)
    rep = wait_for(lambda: (r := replica(sub, "r0"))["last_transaction"] and r, 20, f"the abort\n{sub.log()[-2000:]}")
    last = rep["last_transaction"]
    assert last["outcome"] == "aborted" and "rank 1 could not prepare version 1" in last["error"], rep
    assert "CoverageError" in last["error"] and "extra.weight" in last["error"]
    s = wait_for(lambda: (s := able.state()) and any(h[1] == "aborted" for h in s["history"]) and s, 10, "abort")
    assert s["version"] == 0 and s["digest"] == expected(traj[0], s["names"])  # it stays where it was
    whats = [h[1] for h in s["history"]]  # its prepare finished first, or was cut short by the abort
    assert "aborted" in whats and "applied" not in whats, whats
    # each worker writes its own state file every 20 ms: the unable rank's error may land after the abort
    bad = wait_for(lambda: (b := unable.state()) and b["error"] and b, 10, "the unable rank's error")
    assert bad["version"] == 0 and "extra.weight" in bad["error"] and bad["digest"] == expected(traj[0], bad["names"])
    rep = replica(sub, "r0")
    assert rep["version"] == 0 and rep["state"] == "waiting" and "failed" in rep["reason"], rep
    assert "extra.weight" in rep["ranks"][1]["error"]

    # restarted with a model that has the tensor (loaded from current, version 1): the replica follows
    unable.stop()
    fixed = engine("r0", 1, 2)
    in_step(sub, "r0", 1)
    for e, folder in ((able, grown), (fixed, grown)):
        s = e.wait(1)
        assert s["digest"] == expected(folder, s["names"])
    assert "extra.weight" in fixed.state()["names"] and "extra.weight" not in able.state()["names"]


def test_a_killed_rank_is_dropped_its_replica_waits_and_another_follows(node):
    start, engine, publish, traj, _ = node
    sub = start("--engine-timeout", "1.5")
    r0 = [engine("r0", 0, 2), engine("r0", 1, 2)]
    r1 = engine("r1", 0, 1)
    in_step(sub, "r0", 0)
    in_step(sub, "r1", 0)
    r0[1].proc.kill()  # no leave: the subscriber notices the silence
    wait_for(lambda: "1" in replica(sub, "r0")["dropped"], 10, f"rank 1 to be dropped\n{sub.log()[-2000:]}")
    assert "engine rank dropped: sent nothing for" in sub.log()
    publish(1)
    s = r1.wait(1)
    assert s["digest"] == expected(traj[1], s["names"])
    in_step(sub, "r1", 1)
    rep = replica(sub, "r0")
    assert rep["state"] == "waiting" and "rank 1 of 2 not registered" in rep["reason"], rep
    survivor = r0[0].state()
    assert survivor["version"] == 0 and survivor["history"] == []  # never asked to prepare alone

    restarted = engine("r0", 1, 2)  # loads the version current serves (1)
    for e in (r0[0], restarted):
        s = e.wait(1)
        assert s["digest"] == expected(traj[1], s["names"])
    in_step(sub, "r0", 1)
    # a member of the transaction like any rank, with nothing to change (its state file follows)
    s = wait_for(lambda: (s := restarted.state()) and len(s["history"]) == 2 and s, 5, "the restarted rank's history")
    assert s["loaded"] == 1 and [h[1:] for h in s["history"]] == [["prepared", 2, 1], ["applied", 2, 1]]
