"""The subscriber's side of engine ranks (weightsync.service.engines) over HTTP, with fake ranks.

A real subscriber daemon (a process, as in test_daemons.py) and ranks that speak the protocol only
(:class:`FakeRank`: a thread that registers, long-polls and reports, without torch): every rank of a
replica prepares before any applies; a failed prepare aborts every rank; a silent rank is dropped
and its replica waits for it while other replicas follow; a slot that ranks prepare from is not
written until they are done; the API's token, validation and conflicts. The same protocol with real
torch ranks: test_engine_ranks.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from test_daemons import Daemon, http, wait_for

import weightsync
from weightsync.demo import make_trajectory
from weightsync.format.manifest import HEAD_KEY, head_to_json, manifest_from_json
from weightsync.service.engines import EngineClient, UnknownEngineError
from weightsync.store import open_store
from weightsync.sync.fleet import read_records

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
TOKEN = "engine-token"


class FakeRank:
    """An engine rank without a model: it checks that the folder it is told to prepare from holds
    the version (its state file), then reports ``ok`` (or fails, or holds its report while
    ``hold`` is set); ``events`` records (time, op, txn, version) of every instruction."""

    def __init__(self, url: str, replica: str, rank: int, world: int, version: int | None, token=TOKEN):
        self.client = EngineClient(url, token)
        self.replica, self.rank, self.world, self.version = replica, rank, world, version
        self.fail: str | None = None
        self.hold = threading.Event()
        self.events: list[tuple[float, str, int, int]] = []
        self.folders: list[str] = []
        self._stop = threading.Event()
        self.instance = self.client.register(replica, rank, world, version)["instance"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        after = 0
        while not self._stop.is_set():
            try:
                msg = self.client.poll(self.instance, after, 0.3, self.version)
            except UnknownEngineError:
                return  # dropped: a real rank registers again
            except OSError:
                time.sleep(0.05)
                continue
            if msg["op"] == "none":
                continue
            after = msg["seq"]
            if msg["op"] == "prepare":  # the folder before the event: a test that saw the event reads it
                self.folders.append(msg["folder"])
            self.events.append((time.monotonic(), msg["op"], msg["txn"], msg["version"]))
            if msg["op"] == "prepare":
                threading.Thread(target=self._prepare, args=(msg,), daemon=True).start()
            elif msg["op"] == "apply":
                self.version = msg["version"]
                self.client.report(self.instance, msg["txn"], "apply", True, self.version)

    def _prepare(self, msg: dict) -> None:
        while self.hold.is_set() and not self._stop.is_set():
            time.sleep(0.02)
        state = json.loads((Path(msg["folder"]) / ".weightsync" / "state.json").read_text())
        assert state["version"] == msg["version"], (state, msg)
        try:
            self.client.report(self.instance, msg["txn"], "prepare", self.fail is None, self.version, self.fail)
        except UnknownEngineError:
            pass

    def ops(self) -> list[tuple[str, int]]:
        return [(op, v) for _, op, _, v in self.events]

    def stop(self) -> None:
        """Stop polling without leaving (as a killed process)."""
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def node(tmp_path):
    """A store with version 0 (more with ``publish(v)``) and a subscriber serving it, token set."""
    traj = make_trajectory(tmp_path / "traj", steps=4, **TINY)
    store = tmp_path / "store"
    weightsync.publish(traj[0], store)
    started: list[Daemon] = []

    def start(*extra, wait: int = 0) -> Daemon:
        args = ["--store", store, "--target", tmp_path / "t", "--no-fsync", "--id", "node-1", *extra]
        sub = Daemon("subscriber", args, tmp_path, env={"WEIGHTSYNC_API_TOKEN": TOKEN}, token=TOKEN).start()
        started.append(sub)
        sub.wait_version(wait)
        return sub

    def publish(v: int) -> None:
        weightsync.publish(traj[v], store, v, base_dir=traj[v - 1])

    yield start, publish, store, tmp_path / "t"
    for d in started:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def replica(sub: Daemon, name: str) -> dict | None:
    return next((r for r in sub.status()["engines"]["replicas"] if r["replica"] == name), None)


def in_step(sub: Daemon, name: str, version: int):
    return wait_for(
        lambda: (r := replica(sub, name)) and r["state"] == "in step" and r["version"] == version and r,
        15,
        f"replica {name} in step at version {version}\n{sub.log()[-3000:]}",
    )


def test_every_rank_prepares_before_any_applies(node):
    start, publish, store, target = node
    sub = start()
    ranks = [FakeRank(sub.url, "r0", k, 2, 0) for k in range(2)]
    in_step(sub, "r0", 0)
    assert all(r.events == [] for r in ranks)  # nothing to do at the version served
    publish(1)
    sub.wait_version(1)
    in_step(sub, "r0", 1)
    for r in ranks:
        assert r.ops() == [("prepare", 1), ("apply", 1)]
        assert Path(r.folders[0]) == (target / "current").resolve()  # the slot current serves
    prepared = max(t for r in ranks for t, op, _, _ in r.events if op == "prepare")
    assert all(t > prepared for r in ranks for t, op, _, _ in r.events if op == "apply")

    # what each process holds: status, metrics, the fleet ledger; the manifest from the subscriber
    rep = replica(sub, "r0")
    assert [(k["rank"], k["version"]) for k in rep["ranks"]] == [(0, 1), (1, 1)]
    assert rep["last_transaction"]["outcome"] == "applied"
    metrics = sub.get("/metrics")[1]
    for k in range(2):
        assert f'weightsync_engine_version{{cluster="",rank="{k}",region="",replica="r0",subscriber="node-1"}} 1.0' in (
            metrics
        )
    assert 'outcome="applied",region="",subscriber="node-1"} 1.0' in metrics
    records = wait_for(
        lambda: (
            (rs := read_records(open_store(str(store)))[0]) and rs[0].engines and rs[0].engines[0].version == 1 and rs
        ),
        10,
        "the fleet record",
    )
    assert [(e.replica, e.rank, e.world, e.version) for e in records[0].engines] == [("r0", 0, 2, 1), ("r0", 1, 2, 1)]
    assert manifest_from_json(ranks[0].client.manifest(1)) == weightsync.open_repo(store).manifest(1)
    with pytest.raises(Exception, match="HTTP 404"):
        ranks[0].client.manifest(7)

    # the API: token, validation, conflicts, unknown instances, a clean leave
    assert http("POST", sub.url + "/v1/engines", {"replica": "x", "rank": 0, "world": 1})[0] == 401
    for body in (
        {"replica": "a b", "rank": 0, "world": 1},
        {"replica": "x", "rank": 0, "world": 0},
        {"replica": "x", "rank": 0, "world": 1, "version": -1},
        {"replica": "x", "rank": 0},
    ):
        code, doc, _ = http("POST", sub.url + "/v1/engines", body, token=TOKEN)
        assert code == 400 and "error" in doc, (body, code, doc)
    code, doc, _ = http("POST", sub.url + "/v1/engines", {"replica": "r0", "rank": 0, "world": 4}, token=TOKEN)
    assert code == 409 and "world size 2" in doc["error"], doc
    code, doc, _ = http("POST", sub.url + "/v1/engines", {"replica": "x", "rank": 2, "world": 2}, token=TOKEN)
    assert code == 409 and "outside a world of 2" in doc["error"], doc
    for path, body in (
        ("poll", {"instance": "nobody"}),
        ("report", {"instance": "nobody", "txn": 1, "phase": "apply", "ok": True}),
        ("leave", {"instance": "nobody"}),
    ):
        assert http("POST", f"{sub.url}/v1/engines/{path}", body, token=TOKEN)[0] == 404, path
    for body in ({"instance": ranks[0].instance, "wait": 99}, {"instance": ranks[0].instance, "after": -1}):
        assert http("POST", sub.url + "/v1/engines/poll", body, token=TOKEN)[0] == 400, body
    ranks[1].stop()
    ranks[1].client.leave(ranks[1].instance)
    wait_for(lambda: replica(sub, "r0")["dropped"] == {"1": "left"}, 5, "rank 1 to leave")
    assert "engine rank dropped: left" in sub.log()
    assert sub.stop() == 0  # held polls do not hold up the shutdown
    ranks[0].stop()


def test_a_failed_prepare_aborts_every_rank(node):
    start, publish, _, _ = node
    sub = start()
    good, bad = FakeRank(sub.url, "r0", 0, 2, 0), FakeRank(sub.url, "r0", 1, 2, 0)
    bad.fail = "CoverageError: 1 store tensor of version 1 has no destination in the model (extra.weight)"
    in_step(sub, "r0", 0)
    publish(1)
    rep = wait_for(
        lambda: (r := replica(sub, "r0"))["last_transaction"] and r, 15, f"a transaction\n{sub.log()[-2000:]}"
    )
    last = rep["last_transaction"]
    assert last["outcome"] == "aborted" and last["version"] == 1 and "rank 1 could not prepare" in last["error"]
    assert "extra.weight" in last["error"] and "extra.weight" in rep["ranks"][1]["error"]
    wait_for(lambda: ("abort", 1) in good.ops(), 5, "the abort to reach rank 0")
    assert ("apply", 1) not in good.ops() + bad.ops()
    assert (good.version, bad.version) == (0, 0)
    rep = replica(sub, "r0")
    assert rep["version"] == 0 and rep["state"] == "waiting" and "failed 1 time(s)" in rep["reason"], rep
    assert "engine transaction 1: aborted (version 1)" in sub.log()
    assert 'outcome="aborted",region="",subscriber="node-1"} 1.0' in sub.get("/metrics")[1]

    # the rank's process is fixed and registers again: a fresh try at once, not after the back-off
    bad.stop()
    fixed = FakeRank(sub.url, "r0", 1, 2, 0)
    in_step(sub, "r0", 1)
    assert good.ops()[-2:] == [("prepare", 1), ("apply", 1)] and fixed.ops() == [("prepare", 1), ("apply", 1)]
    assert "registered again" in sub.log()
    for r in (good, fixed):
        r.stop()


def test_a_silent_rank_is_dropped_its_replica_waits_and_others_follow(node):
    start, publish, _, _ = node
    sub = start("--engine-timeout", "1.5")
    r0 = [FakeRank(sub.url, "r0", k, 2, 0) for k in range(2)]
    r1 = FakeRank(sub.url, "r1", 0, 1, 0)
    in_step(sub, "r0", 0)
    r0[1].stop()  # as if killed: no leave, no more polls
    wait_for(lambda: "1" in replica(sub, "r0")["dropped"], 10, f"rank 1 to be dropped\n{sub.log()[-2000:]}")
    assert "engine rank dropped: sent nothing for" in sub.log()
    publish(1)
    in_step(sub, "r1", 1)
    rep = replica(sub, "r0")
    assert rep["state"] == "waiting" and "rank 1 of 2 not registered" in rep["reason"], rep
    assert r0[0].events == [] and r0[0].version == 0  # a replica with a dead rank does not switch
    assert "weightsync_engine_ranks_dropped_total" in sub.get("/metrics")[1]
    back = FakeRank(sub.url, "r0", 1, 2, 1)  # restarted: it loaded the version current serves
    in_step(sub, "r0", 1)
    assert r0[0].ops() == [("prepare", 1), ("apply", 1)] and back.ops() == [("prepare", 1), ("apply", 1)]
    for r in (r0[0], r1, back):
        r.stop()


def test_a_slot_ranks_prepare_from_is_not_written_until_they_are_done(node):
    """Ranks prepare from the slot ``current`` serves. Two more versions later that slot is the
    standby the next sync would refill: the subscriber waits while any rank still reads it."""
    start, publish, _, target = node
    sub = start("--standby-hold", "0")
    slow = FakeRank(sub.url, "r0", 0, 1, 0)
    slow.hold.set()
    publish(1)
    wait_for(lambda: slow.ops() == [("prepare", 1)], 15, "the prepare")
    folder = Path(slow.folders[0])
    state = (folder / ".weightsync" / "state.json").read_text()
    publish(2)
    sub.wait_version(2)  # the other slot: free to fill
    publish(3)
    status = wait_for(
        lambda: "preparing from the standby slot" in (s := sub.status())["reason"] and s, 10, "the wait for the ranks"
    )
    assert status["current_version"] == 2 and "replica r0" in status["reason"]
    time.sleep(0.5)
    assert (folder / ".weightsync" / "state.json").read_text() == state  # untouched: still version 1
    slow.hold.clear()
    sub.wait_version(3)
    in_step(sub, "r0", 3)
    assert slow.ops()[:2] == [("prepare", 1), ("apply", 1)] and slow.ops()[-1] == ("apply", 3)
    slow.stop()


def test_a_manifest_above_the_head_is_not_served(node):
    """A manifest stored above the head (a publish in progress or abandoned) is not a version: the
    subscriber answers 404 for it, as ``PUT /v1/target`` refuses it, and serves it once committed."""
    start, publish, store, _ = node
    publish(1)
    publish(2)
    backend = open_store(str(store))
    backend.put(HEAD_KEY, head_to_json(1))  # version 2's manifest stays, above the head
    sub = start(wait=1)
    client = EngineClient(sub.url, token=TOKEN)
    assert manifest_from_json(client.manifest(1)).version == 1
    with pytest.raises(Exception, match="HTTP 404.*version 2 does not exist"):
        client.manifest(2)
    assert http("PUT", sub.url + "/v1/target", {"version": 2}, token=TOKEN)[0] == 404
    backend.put(HEAD_KEY, head_to_json(2))  # committed now: served at once, without waiting for a poll
    assert manifest_from_json(client.manifest(2)).version == 2
