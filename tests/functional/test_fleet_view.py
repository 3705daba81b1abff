"""The fleet view as operators read it: over one store or several (one per region, each with its own
head), with stopped subscribers and records no longer rewritten left out unless asked for; a record
says what the subscriber does right after a swap (never ``swapping``), and it is rewritten while a
long sync runs; a cleanly stopped subscriber's last record says ``stopped``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry

import weightsync
from weightsync.demo import make_trajectory
from weightsync.service.config import Identity, StoreConfig, SubscriberConfig
from weightsync.service.metrics import Metrics
from weightsync.service.subscriber import Subscriber
from weightsync.sync.fleet import FleetRecord, format_fleet, read_fleets, read_records, write_record

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


def fleet_cli(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "weightsync.cli", "fleet", *argv], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_fleet_over_two_regions_leaves_gone_subscribers_out(tmp_path):
    traj = make_trajectory(tmp_path / "traj", steps=2, **TINY)
    a, b = f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'b'}"
    for v, ckpt in enumerate(traj):
        weightsync.publish(ckpt, a, v)
    weightsync.publish(traj[0], b, 0)  # region b's mirror is behind
    now = time.time()
    write_record(weightsync.open_repo(a).store, FleetRecord("a-1", "region-a", "", 2, "latest", "serving", now))
    write_record(
        weightsync.open_repo(a).store, FleetRecord("a-old", "region-a", "", 1, "latest", "serving", now - 7200)
    )
    write_record(weightsync.open_repo(b).store, FleetRecord("b-1", "region-b", "", 0, "latest", "serving", now))
    write_record(weightsync.open_repo(b).store, FleetRecord("b-gone", "region-b", "", 0, "latest", "stopped", now))

    fleet = read_fleets([weightsync.open_repo(a), weightsync.open_repo(b)], now)
    assert fleet["head_version"] == 2 and fleet["hidden"] == 2
    assert [(s["head_version"], s["hidden"]) for s in fleet["stores"]] == [(2, 1), (0, 1)]
    rows = {r["id"]: r for r in fleet["subscribers"]}
    assert set(rows) == {"a-1", "b-1"} and rows["b-1"]["store"] == b and rows["b-1"]["lag"] == 0
    text = format_fleet(fleet)
    assert f"store {b}: head version 0" in text and "2 stopped or not seen for over 600s not shown" in text

    out = json.loads(fleet_cli("--store", a, "--store", b, "--json", "--all"))
    assert {r["id"]: r["gone"] for r in out["subscribers"]} == {
        "a-1": False,
        "a-old": True,
        "b-1": False,
        "b-gone": True,
    }
    one = json.loads(fleet_cli("--store", a, "--json"))
    assert one["store"] == a and [r["id"] for r in one["subscribers"]] == ["a-1"] and one["hidden"] == 1
    assert "a-old" in fleet_cli("--store", a, "--expire-after", "86400")


def test_the_record_says_serving_right_after_a_swap_and_stopped_at_the_end(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=0, **TINY)
    weightsync.publish(traj[0], store, 0)
    cfg = SubscriberConfig(
        StoreConfig(store), tmp_path / "t", Identity("s1"), poll_interval=0.01, fsync=False, ledger_interval=0.05
    )
    repo = weightsync.open_repo(store)
    sub = Subscriber(cfg, repo, Metrics(CollectorRegistry(), "subscriber", subscriber="s1"))

    def record() -> FleetRecord | None:
        records = read_records(repo.store)[0]
        return records[0] if records else None

    async def main():
        task = asyncio.create_task(sub.run())
        while (r := record()) is None or r.current_version != 0:  # (written just after the swap, off the loop)
            await asyncio.sleep(0.01)
        assert r.state == "serving"  # the first record naming version 0: the record of the swap itself
        first = record().updated
        while record().updated == first:  # the heartbeat rewrites it on its own
            await asyncio.sleep(0.01)
        sub.request_stop()
        await task

    asyncio.run(main())
    assert record().state == "stopped"


def test_planted_records_are_bad_records_not_rows(tmp_path):
    """Records written into the bucket by hand or by an attacker: an id with a newline forged a row of
    the table, a record under another subscriber's key was shown as that subscriber. They are listed
    as bad records; the real one stays."""
    import pytest

    from weightsync.errors import UsageError

    store = tmp_path / "store"
    weightsync.publish(make_trajectory(tmp_path / "traj", steps=0, **TINY)[0], store, 0)
    repo = weightsync.open_repo(f"file://{store}")
    now = time.time()
    write_record(repo.store, FleetRecord("sub-a", "r", "", 0, "latest", "serving", now))
    doc = json.loads((store / "fleet" / "sub-a.json").read_text())
    planted = {
        "forged.json": {**doc, "id": "forged\nsubZ    r   0   serving"},
        "impostor.json": {**doc, "id": "sub-a", "state": "stopped"},
        "region.json": {**doc, "id": "region", "region": "r\x1b[2J"},
    }
    for name, body in planted.items():
        (store / "fleet" / name).write_text(json.dumps(body))
    fleet = read_fleets([repo], now)
    assert [r["id"] for r in fleet["subscribers"]] == ["sub-a"] and fleet["subscribers"][0]["state"] == "serving"
    text = format_fleet(fleet)
    assert text.count("bad record:") == 3 and not any(line.startswith("subZ") for line in text.splitlines())
    with pytest.raises(UsageError):
        Identity("sub-a\n")  # "$" took a final newline
