"""The swap hook as a state, against a real aiohttp server standing in for the engine: a slow reload
is waited for and never overlapped (its late answer counts), a hung one is abandoned after
``attempts`` periods; a failed hook makes the subscriber ``degraded`` (status, gauge, record in the
target folder) until a call succeeds, survives a restart, which calls the hook again, and an API
call (``POST /v1/hook``) runs it again; ``?wait=`` makes it and ``PUT /v1/target`` say how it ended.
In process, and once with the daemon as a real process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from test_daemons import daemons, http, wait_for  # noqa: F401  (daemons is a fixture)

import weightsync
from weightsync.demo import make_trajectory
from weightsync.service.config import Backoff, HookConfig, Identity, StoreConfig, SubscriberConfig
from weightsync.service.hooks import HookRecord, HookRunner, hook_path
from weightsync.service.metrics import Metrics
from weightsync.service.subscriber import Subscriber

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


class Engine:
    """An engine's reload endpoint in a thread: answers ``status`` after ``delay`` seconds; counts
    calls and the most it ever ran at once."""

    def __init__(self, status: int = 200, delay: float = 0.0):
        self.status, self.delay = status, delay
        self.calls: list[dict] = []
        self.running = self.most = 0
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        async def reload(request: web.Request) -> web.Response:
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                self.calls.append(await request.json())
                await asyncio.sleep(self.delay)
                return web.json_response({"ok": self.status < 300}, status=self.status)
            finally:
                self.running -= 1

        async def main() -> None:
            app = web.Application()
            app.router.add_post("/reload", reload)
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)  # a hung reload does not hold the test
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/reload"
            started.set()

        threading.Thread(
            target=lambda: (self._loop.run_until_complete(main()), self._loop.run_forever()), daemon=True
        ).start()
        assert started.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def engine():
    made: list[Engine] = []

    def make(**kw) -> Engine:
        made.append(Engine(**kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _fire(cfg: HookConfig):
    failures, records = [], []

    async def on_record(rec):
        records.append(rec)

    async def main():
        return await HookRunner(cfg, lambda: failures.append(1), on_record).fire(3, "/w/slots/a", "/w/current")

    t0 = time.monotonic()
    outcome = asyncio.run(main())
    return outcome, len(failures), records, time.monotonic() - t0


def test_a_slow_reload_is_waited_for_never_overlapped_and_its_late_answer_counts(engine):
    e = engine(delay=0.5)
    cfg = HookConfig(url=e.url, timeout=0.15, attempts=5, backoff=Backoff(0.01, 0.05))
    outcome, failures, records, _ = _fire(cfg)
    assert outcome.ok and len(e.calls) == 1 and e.most == 1  # one request, answered late: it counts
    assert failures >= 1 and outcome.attempts == failures + 1
    states = [r.state for r in records]
    assert states[0] == "running" and "retrying" in states and states[-1] == "ok", states
    assert records[1].degraded and "--hook-timeout" in records[1].error and not records[-1].degraded


def test_a_call_after_one_that_failed_stays_degraded_until_it_succeeds(engine):
    e = engine(delay=0.3)
    records = []

    async def on_record(rec):
        records.append(rec)

    async def main():
        runner = HookRunner(HookConfig(url=e.url, attempts=1, timeout=5.0), lambda: None, on_record)
        runner.record = HookRecord(3, "failed", 1, "RuntimeError: HTTP 503", 0.1, 0.0)  # read at start-up
        return await runner.fire(3, "/w/slots/a", "/w/current")

    assert asyncio.run(main()).ok
    assert [(r.state, r.degraded) for r in records] == [("retrying", True), ("ok", False)], records
    assert records[0].error == "RuntimeError: HTTP 503" and records[0].attempts == 0 and records[-1].error is None


def test_a_hung_reload_is_abandoned_after_attempts_periods_without_a_second_call(engine):
    e = engine(delay=30)
    cfg = HookConfig(url=e.url, timeout=0.1, attempts=3, backoff=Backoff(0.01, 0.05))
    outcome, failures, records, seconds = _fire(cfg)
    assert not outcome.ok and failures == 3 and len(e.calls) == 1 and seconds < 5
    assert records[-1].state == "failed" and records[-1].degraded and "--hook-timeout" in outcome.error


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")


def test_a_command_that_leaves_a_child_in_the_background_succeeds_when_it_exits(tmp_path):
    """``sleep 25 & exit 0`` (a reload started in the background): the runner waited for the end of
    its stderr, which the child holds, and reported a hung hook, degraded."""
    cfg = HookConfig(command=("sh", "-c", f"sleep 25 & echo $! > {tmp_path}/pid; exit 0"), timeout=5.0, attempts=1)
    outcome, failures, records, seconds = _fire(cfg)
    pid = int((tmp_path / "pid").read_text())
    try:
        assert outcome.ok and failures == 0 and records[-1].state == "ok" and seconds < 3, outcome
        assert _alive(pid)  # what it started in the background is its own
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_hung_command_is_killed_with_its_children_and_the_next_call_runs(tmp_path):
    """A command whose child hangs (``sh`` waiting on a ``curl`` without a timeout): the runner killed
    the command only, then waited for the child's end of stderr, so every later swap's hook waited
    behind it, and the child outlived the subscriber. The whole group is killed when the call is
    given up; only the tail of stderr is kept, however much the command writes."""
    script = f"sleep 60 & echo $! > {tmp_path}/pid; wait"
    cfg = HookConfig(command=("sh", "-c", script), timeout=0.5, attempts=1, backoff=Backoff(0.01, 0.05))
    outcome, failures, records, seconds = _fire(cfg)
    child = int((tmp_path / "pid").read_text())
    assert not outcome.ok and failures == 1 and seconds < 5 and "--hook-timeout" in outcome.error, outcome
    wait_for(lambda: not _alive(child), 5, "the hung child killed with its command")
    chatty = "head -c 3000000 /dev/zero | tr '\\0' x >&2; echo tail-of-stderr >&2; exit 3"
    outcome, _, _, seconds = _fire(HookConfig(command=("sh", "-c", chatty), attempts=1))
    assert not outcome.ok and outcome.error.endswith("tail-of-stderr") and "exited with 3" in outcome.error
    assert len(outcome.error) < 400 and seconds < 3


def _subscriber(store: str, target, url: str, **hook) -> Subscriber:
    hook_cfg = HookConfig(url=url, backoff=Backoff(0.01, 0.05), **{"attempts": 1, "timeout": 5.0, **hook})
    cfg = SubscriberConfig(StoreConfig(store), target, Identity("s1"), poll_interval=0.01, fsync=False, hook=hook_cfg)
    return Subscriber(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "subscriber", subscriber="s1"))


def _gauge(sub: Subscriber) -> float:
    return sub.metrics.registry.get_sample_value("weightsync_swap_hook_degraded", sub.metrics.labels)


async def _settle(sub: Subscriber) -> None:
    await sub._iteration()
    assert await sub.wait_until(lambda: sub.hook_settled(sub.view.current), 10)
    await sub._iteration()  # the loop's next pass shows the state


def test_a_failed_hook_degrades_the_subscriber_until_a_call_succeeds_across_a_restart(engine, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=1, **TINY)
    weightsync.publish(traj[0], store, 0)
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    target = tmp_path / "t"
    failing = engine(status=503)

    async def first():
        sub = _subscriber(store, target, failing.url)
        await asyncio.to_thread(sub._startup)
        await _settle(sub)
        assert sub.view.current == 1 and sub.state == "degraded" and sub.degraded and _gauge(sub) == 1
        hook = sub.status()["hook"]
        assert (hook["version"], hook["state"], hook["ok"], hook["degraded"]) == (1, "failed", False, True)
        assert "HTTP 503" in hook["error"] and sub.hook_outcome(1).startswith("version 1 is served, but its swap hook")
        assert sub.target_outcome("latest") == sub.hook_outcome(1)
        await sub._iteration()
        assert sub.state == "degraded", "the state persists while idle: no retry of the loop clears it"

    asyncio.run(first())
    assert json.loads(hook_path(target).read_text())["state"] == "failed"
    assert len(failing.calls) == 1

    ok = engine()

    async def restarted():
        sub = _subscriber(store, target, ok.url)
        await asyncio.to_thread(sub._startup)
        assert sub.degraded and _gauge(sub) == 1 and sub.status()["hook"]["state"] == "failed"  # known at start
        sub._resume_hook()  # as run() does after start-up: the engine is told again
        assert await sub.wait_until(lambda: sub.hook_settled(1), 10)
        await sub._iteration()
        assert sub.state == "serving" and not sub.degraded and _gauge(sub) == 0
        assert ok.calls == [{"version": 1, "path": str(target / "slots" / "a")}]
        assert sub.target_outcome("latest") == "ok"
        # POST /v1/hook calls it again; two requests before the call begins make one call
        assert sub.rerun_hook() == 1 and sub.rerun_hook() == 1
        assert await sub.wait_until(lambda: sub.hook_settled(1), 10)
        assert len(ok.calls) == 2 and ok.most == 1
        assert sub.hook_outcome(1) == "ok"

    asyncio.run(restarted())
    assert json.loads(hook_path(target).read_text())["state"] == "ok"

    async def again():  # the last call succeeded for the version served: a restart calls nothing
        sub = _subscriber(store, target, ok.url)
        await asyncio.to_thread(sub._startup)
        sub._resume_hook()
        assert sub._hook_task is None and not sub.degraded

    asyncio.run(again())
    assert len(ok.calls) == 2


def test_a_newer_swap_waits_for_the_call_in_flight_then_fires_once_for_the_newest(engine, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=2, **TINY)
    weightsync.publish(traj[0], store, 0)
    slow = engine(delay=0.6)

    async def main():
        sub = _subscriber(store, tmp_path / "t", slow.url)
        await asyncio.to_thread(sub._startup)
        await sub._iteration()  # version 0 swapped in, its hook call running
        for v in (1, 2):
            weightsync.publish(traj[v], store, v, base_dir=traj[v - 1])
            await sub._iteration()
        assert sub.view.current == 2
        assert await sub.wait_until(lambda: sub.hook_settled(2), 10)
        assert [c["version"] for c in slow.calls] == [0, 2] and slow.most == 1
        assert sub.status()["hook"]["state"] == "ok" and sub.state in ("serving", "degraded")

    asyncio.run(main())


def test_the_daemon_stays_degraded_across_a_restart_and_the_api_waits_for_the_hook(engine, tmp_path, daemons):  # noqa: F811
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=1, **TINY)
    weightsync.publish(traj[0], store, 0)
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    e = engine(status=503)
    args = ["--store", store, "--target", tmp_path / "t", "--no-fsync", "--hook-url", e.url, "--hook-attempts", 1]
    sub = daemons("subscriber", [*args, "--version", 0])
    wait_for(lambda: sub.status()["state"] == "degraded", 20, f"the failed hook to degrade it\n{sub.log()}")
    assert re.search(r"^weightsync_swap_hook_degraded\{[^}]*\} 1\.0$", sub.get("/metrics")[1], re.M)
    code, doc, _ = http("PUT", sub.url + "/v1/target?wait=20", {"version": "latest"})
    assert code == 502 and "version 1 is served, but its swap hook failed: RuntimeError: HTTP 503" in doc["error"], doc
    code, doc, _ = http("POST", sub.url + "/v1/hook?wait=20")
    assert code == 502 and "HTTP 503" in doc["error"] and len(e.calls) == 3, doc  # 0, 1, and this one
    assert http("PUT", sub.url + "/v1/target?wait=0", {"version": 99})[0] == 404

    e.status, e.delay = 200, 2.0
    assert sub.stop() == 0
    sub.args = [a for a in sub.args if a not in ("--version", "0")]  # the stored target (latest) from here
    sub.start()  # the record says failed: the engine is told again at start-up, degraded until it answers
    # the hook's task starts before the loop's first iteration, which sets the state: wait for both
    doc = wait_for(
        lambda: len(e.calls) == 4 and (d := sub.status())["state"] != "starting" and d,
        20,
        f"the hook to be called after the restart\n{sub.log()}",
    )
    assert doc["state"] == "degraded" and doc["hook"]["state"] == "retrying", doc
    assert "swap hook of version 1 is being retried: RuntimeError: HTTP 503" in doc["reason"], doc
    wait_for(lambda: sub.status()["state"] == "serving", 20, f"the hook to succeed after the restart\n{sub.log()}")
    e.delay = 0.0
    assert len(e.calls) == 4 and e.calls[-1]["version"] == 1 and "calling the swap hook again" in sub.log()
    assert sub.status()["hook"]["state"] == "ok"
    code, doc, _ = http("POST", sub.url + "/v1/hook?wait=20")
    assert code == 200 and doc["state"] == "serving" and doc["hook"]["state"] == "ok" and len(e.calls) == 5
    code, doc, _ = http("POST", sub.url + "/v1/hook")
    assert code == 202
    code, doc, _ = http("PUT", sub.url + "/v1/target?wait=20", {"version": 0})
    assert code == 200 and doc["current_version"] == 0 and doc["hook"] == {**doc["hook"], "version": 0, "state": "ok"}
    assert http("POST", sub.url + "/v1/hook?wait=soon")[0] == 400


def test_a_wait_on_a_target_another_call_replaced_ends_at_once_with_409(engine, tmp_path, daemons):  # noqa: F811
    """``PUT /v1/target?wait=`` for version 0 while its hook runs; another call sets ``latest``: the first
    answers 409 naming the new target, not 202 after its whole wait (version 0 is never served again)."""
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=1, **TINY)
    weightsync.publish(traj[0], store, 0)
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    e = engine(delay=3.0)
    args = ["--store", store, "--target", tmp_path / "t", "--no-fsync", "--hook-url", e.url]
    sub = daemons("subscriber", [*args, "--version", 1])
    wait_for(lambda: sub.status()["state"] == "serving", 30, f"version 1 served\n{sub.log()}")
    answer: list = []
    first = threading.Thread(target=lambda: answer.append(http("PUT", sub.url + "/v1/target?wait=60", {"version": 0})))
    started = time.monotonic()
    first.start()
    wait_for(lambda: sub.status()["target"] == 0, 10, "the first call's target")
    assert http("PUT", sub.url + "/v1/target", {"version": "latest"})[0] == 200
    first.join(40)
    assert answer, "the first call still waits (its wait is 60 s)"
    code, doc, _ = answer[0]
    assert code == 409 and doc["error"] == "the target was set to latest by another call before version 0 was served"
    assert time.monotonic() - started < 30, "the first call waited out its wait"


def test_a_pin_set_while_a_newer_version_syncs_is_never_swapped_away_from(engine, tmp_path):
    """A rollback (``PUT /v1/target``) while the subscriber fills its standby slot with a newer
    version: the fill ends, the slot keeps that version, and it is not swapped in; the pinned version
    stays served, its hook is the only one called (before: the newer one was swapped in and hooked
    after the call had answered that the pin was served, then swapped back)."""
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=2, **TINY)
    weightsync.publish(traj[0], store, 0)
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    e = engine()

    async def main():
        sub = _subscriber(store, tmp_path / "t", e.url)
        await asyncio.to_thread(sub._startup)
        await _settle(sub)
        assert sub.view.current == 1 and [c["version"] for c in e.calls] == [1]
        weightsync.publish(traj[2], store, 2, base_dir=traj[1])
        filling, go = threading.Event(), threading.Event()
        real = sub._fill

        def held_fill(folder, version):
            out = real(folder, version)
            filling.set()
            assert go.wait(30)
            return out

        sub._fill = held_fill
        task = asyncio.create_task(sub._iteration())
        assert await asyncio.to_thread(filling.wait, 30) and sub.state == "syncing"
        await sub.set_target(1)
        assert sub.target_outcome(1) == "ok"  # what PUT /v1/target?wait= answers now: it must stay true
        go.set()
        await task
        assert (sub.view.current, sub.view.standby) == (1, 2) and sub.state == "serving"
        await sub._iteration()
        assert await sub.wait_until(lambda: sub.hook_settled(1), 10)
        assert sub.view.current == 1 and [c["version"] for c in e.calls] == [1]
        assert sub.target_outcome(1) == "ok"
        await sub.set_target("latest")  # the standby slot already holds it
        await sub._iteration()
        assert sub.view.current == 2

    asyncio.run(main())


def test_put_target_latest_reads_the_head_and_a_held_wait_ends_on_sigterm(engine, tmp_path, daemons):  # noqa: F811
    """``latest`` with ``?wait=`` is served once the head the call reads is (the loop's last read, up
    to a poll interval old, answered 200 for the version before); a call held by a slow hook answers
    503 on SIGTERM, and the daemon stops within its grace (the server waited for the call)."""
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=1, **TINY)
    weightsync.publish(traj[0], store, 0)
    e = engine()
    args = ["--store", store, "--target", tmp_path / "t", "--no-fsync", "--hook-url", e.url, "--grace", 3]
    sub = daemons("subscriber", [*args, "--poll-interval", 600])
    sub.wait_version(0)
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    code, doc, _ = http("PUT", sub.url + "/v1/target?wait=30", {"version": "latest"})
    assert code == 200 and doc["current_version"] == 1, doc

    e.delay = 60.0  # the hook of version 0 holds the next call's wait
    answer: list = []
    held = threading.Thread(target=lambda: answer.append(http("PUT", sub.url + "/v1/target?wait=120", {"version": 0})))
    held.start()
    wait_for(lambda: len(e.calls) == 3, 20, f"the hook call for version 0\n{sub.log()}")
    started = time.monotonic()
    assert sub.stop(signal.SIGTERM, timeout=30) == 0
    assert time.monotonic() - started < 15, "the daemon waited for the held call"
    held.join(10)
    assert answer and answer[0][0] == 503 and answer[0][1]["error"] == "the subscriber is stopping", answer
