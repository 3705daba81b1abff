"""The engine coordinator's rules on a fake clock (weightsync.service.engines): the pure planner, the
phases and their timeouts, drops, back-off, what is held, and the fleet record's ``engines``.
The same coordinator over HTTP: tests/functional/test_engine_protocol.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from weightsync.errors import FormatError
from weightsync.service.config import Backoff
from weightsync.service.engines import (
    EngineConflictError,
    EngineCoordinator,
    ReplicaView,
    Start,
    UnknownEngineError,
    plan_replica,
)
from weightsync.service.metrics import Metrics
from weightsync.service.runtime import Idle, Wait
from weightsync.sync.fleet import EngineRecord, FleetRecord, record_from_json

SLOT = Path("/node/slots/a")


@pytest.mark.parametrize(
    "view, serving, want, words",
    [
        (ReplicaView(2, {0: 3, 1: 3}), 3, Idle, "every rank holds version 3"),
        (ReplicaView(2, {0: 3, 1: 3}), 4, Start, "ranks hold 3, the subscriber serves 4"),
        (ReplicaView(2, {0: 3, 1: None}), 3, Start, "ranks hold ?, 3"),  # a rank that lost its version
        (ReplicaView(2, {0: 3}), 4, Wait, "rank 1 of 2 not registered"),
        (ReplicaView(3, {1: 3}), 4, Wait, "ranks 0, 2 of 3 not registered"),
        (ReplicaView(1, {0: 3}), None, Wait, "serves no version"),
        (ReplicaView(1, {0: 3}, busy="transaction 7: preparing"), 4, Wait, "transaction 7"),
        (ReplicaView(1, {0: 3}, None, 4, 2, 20.0), 4, Wait, "version 4 failed 2 time(s); retrying in 10.0s"),
        (ReplicaView(1, {0: 3}, None, 4, 2, 5.0), 4, Start, "ranks hold 3"),  # the back-off is over
        (ReplicaView(1, {0: 3}, None, 4, 2, 20.0), 5, Start, "ranks hold 3"),  # a newer version: at once
    ],
)
def test_plan_replica(view, serving, want, words):
    action = plan_replica(view, serving, now=10.0)
    assert isinstance(action, want) and words in action.reason, action


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def coordinator(clock: Clock, released: list | None = None) -> tuple[EngineCoordinator, Metrics]:
    m = Metrics(CollectorRegistry(), "subscriber", subscriber="s", runtime=False)
    c = EngineCoordinator(
        m,
        timeout=30.0,
        phase_timeout=60.0,
        backoff=Backoff(1.0, 8.0),
        on_release=lambda: released.append(1) if released is not None else None,
        clock=clock,
    )
    return c, m


def value(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, {"region": "", "cluster": "", "subscriber": "s", **labels})


def instruction(c: EngineCoordinator, instance: str, after: int = 0) -> dict:
    return asyncio.run(c.poll(instance, after, 0.0, c._ranks[instance].version))


def test_prepare_then_apply_and_what_is_held():
    clock, released = Clock(), []
    c, m = coordinator(clock, released)
    a, b = (c.register("r0", k, 2, 3)["instance"] for k in range(2))
    assert c.step((4, SLOT)) < 60 and c.holding(SLOT) == ["r0"]
    ia, ib = instruction(c, a), instruction(c, b)
    assert (ia["op"], ia["version"], ia["folder"], ia["seq"]) == ("prepare", 4, str(SLOT), 1)
    assert instruction(c, a, after=1) == {"op": "none", "seq": 1}  # already seen: nothing new
    assert c.report(a, ia["txn"], "prepare", True, 3) == {"accepted": True}
    assert instruction(c, b)["op"] == "prepare"  # repeated until the rank polls past it
    assert c.report(b, ib["txn"], "apply", True, 4) == {"accepted": False}  # not that phase yet
    c.report(b, ib["txn"], "prepare", True, 3)
    assert c.holding(SLOT) == [] and released == [1]  # the folder is no longer read
    assert [instruction(c, x, 1)["op"] for x in (a, b)] == ["apply", "apply"]
    c.report(a, ia["txn"], "apply", True, 4)
    c.report(b, ib["txn"], "apply", True, 4)
    c.step((4, SLOT))
    assert [r.version for r in c.records()] == [4, 4]
    rep = c.status()["replicas"][0]
    assert (rep["state"], rep["version"], rep["last_transaction"]["outcome"]) == ("in step", 4, "applied")
    assert value(m, "weightsync_engine_transactions_total", outcome="applied") == 1.0
    assert value(m, "weightsync_engine_version", replica="r0", rank="1") == 4.0


def test_a_prepare_that_times_out_aborts_every_rank_and_backs_off():
    clock = Clock()
    c, m = coordinator(clock)
    a, b = (c.register("r0", k, 2, 3)["instance"] for k in range(2))
    c.step((4, SLOT))
    txn = instruction(c, a)["txn"]
    c.report(a, txn, "prepare", True, 3)
    clock.now += 61
    for x in (a, b):  # alive, but rank 1 never prepared
        asyncio.run(c.poll(x, 1, 0.0, 3))
    c.step((4, SLOT))
    last = c.status()["replicas"][0]["last_transaction"]
    assert last["outcome"] == "aborted" and "rank 1 did not prepare version 4 within 60s" in last["error"]
    assert [instruction(c, x, 1)["op"] for x in (a, b)] == ["abort", "abort"]
    assert c.holding(SLOT) == []
    assert c.step((4, SLOT)) == pytest.approx(1.0)  # the next try after the back-off ...
    assert "retrying in 1.0s" in c.status()["replicas"][0]["reason"]
    clock.now += 1.0
    c.step((4, SLOT))
    assert instruction(c, a, 2)["op"] == "prepare"  # ... and it comes
    assert value(m, "weightsync_engine_transactions_total", outcome="aborted") == 1.0


def test_an_apply_not_confirmed_ends_the_transaction_and_the_rank_is_asked_again():
    clock = Clock()
    c, _ = coordinator(clock)
    a, b = (c.register("r0", k, 2, 3)["instance"] for k in range(2))
    c.step((4, SLOT))
    txn = instruction(c, a)["txn"]
    for x in (a, b):
        c.report(x, txn, "prepare", True, 3)
    c.report(a, txn, "apply", True, 4)
    c.report(b, txn, "apply", False, None, "ApplyError: torn")  # it holds no version now
    last = c.status()["replicas"][0]["last_transaction"]
    assert last["outcome"] == "apply_failed" and "rank 1 could not apply: ApplyError: torn" in last["error"]
    assert [r.version for r in c.records()] == [4, None]
    clock.now += 1.0
    c.step((4, SLOT))  # ranks disagree: a new transaction brings both to 4
    assert instruction(c, b, 2)["op"] == "prepare"


def test_a_silent_rank_is_dropped_mid_transaction_and_its_replica_waits():
    clock = Clock()
    c, m = coordinator(clock)
    a, b = (c.register("r0", k, 2, 3)["instance"] for k in range(2))
    c.step((4, SLOT))
    clock.now += 20
    asyncio.run(c.poll(a, 1, 0.0, 3))
    clock.now += 15  # rank 1: 35 s without a word
    c.step((4, SLOT))
    assert "rank 1 sent nothing for 35.0s" in c.status()["replicas"][0]["last_transaction"]["error"]
    assert value(m, "weightsync_engine_ranks_dropped_total") == 1.0
    assert value(m, "weightsync_engine_version", replica="r0", rank="1") is None  # its series is gone
    with pytest.raises(UnknownEngineError):
        asyncio.run(c.poll(b, 0, 0.0, 3))
    clock.now += 10
    c.step((4, SLOT))
    rep = c.status()["replicas"][0]
    assert rep["state"] == "waiting" and "rank 1 of 2 not registered" in rep["reason"] and rep["dropped"]
    assert instruction(c, a, 1)["op"] == "abort"  # and no new prepare for a replica missing a rank
    b = c.register("r0", 1, 2, 4)["instance"]
    c.step((4, SLOT))
    assert instruction(c, b)["op"] == "prepare" and c.status()["replicas"][0]["dropped"] == {}


def test_a_version_sent_before_a_change_the_subscriber_heard_of_is_ignored():
    c, _ = coordinator(Clock())
    a = c.register("r0", 0, 1, 3, epoch=0)["instance"]
    c.step((4, SLOT))
    txn = instruction(c, a)["txn"]
    c.report(a, txn, "prepare", True, 3, epoch=0)
    c.report(a, txn, "apply", True, 4, epoch=1)
    asyncio.run(c.poll(a, 2, 0.0, 3, epoch=0))  # left before the apply, arrived after its report
    assert [r.version for r in c.records()] == [4]
    asyncio.run(c.poll(a, 2, 0.0, None, epoch=2))  # a later change (a failed apply): taken
    assert [r.version for r in c.records()] == [None]


def test_registrations_conflict_and_replace():
    c, _ = coordinator(Clock())
    first = c.register("r0", 0, 2, 1)["instance"]
    with pytest.raises(EngineConflictError, match="world size 2"):
        c.register("r0", 1, 4, 1)
    with pytest.raises(EngineConflictError, match="outside a world of 2"):
        c.register("r0", 2, 2, 1)
    again = c.register("r0", 0, 2, 1)["instance"]  # the same rank restarted: the old one is gone
    assert again != first and [r.rank for r in c.records()] == [0]
    with pytest.raises(UnknownEngineError):
        c.report(first, 1, "prepare", True, 1)
    c.register("r0", 0, 3, 1)  # its last rank registers with another world: a new replica
    assert c.records()[0].world == 3


def test_a_subscriber_with_partial_slots_takes_no_ranks():
    m = Metrics(CollectorRegistry(), "subscriber", subscriber="s", runtime=False)
    c = EngineCoordinator(m, timeout=30.0, phase_timeout=60.0, backoff=Backoff(), refuse="partial slots")
    with pytest.raises(EngineConflictError, match="partial slots"):
        c.register("r0", 0, 1, 3)


def test_the_fleet_record_lists_engine_ranks_and_is_validated():
    rec = FleetRecord(
        "n", "", "", 4, "latest", "serving", 1.0, (EngineRecord("r0", 0, 2, 4), EngineRecord("r0", 1, 2, None))
    )
    assert record_from_json(rec.to_json(), "x") == rec
    old = FleetRecord("n", "", "", 4, "latest", "serving", 1.0)  # written before engine ranks existed
    doc = old.to_json().replace(b', "engines": []', b"")
    assert b"engines" not in doc and record_from_json(doc, "x") == old
    for bad in (
        b'"engines": {}',
        b'"engines": [{"replica": 1, "rank": 0, "world": 1, "version": 1}]',
        b'"engines": [{"replica": "r", "rank": 1, "world": 1, "version": 1}]',
        b'"engines": [{"replica": "r", "rank": 0, "world": 1, "version": -2}]',
    ):
        with pytest.raises(FormatError):
            record_from_json(old.to_json().replace(b'"engines": []', bad), "x")
