"""The subscriber's decisions at their edges, in process on a file store: a stop requested while a
sync fills the standby slot leaves ``current`` where it was, and a pin one version above the head
waits for it without counting a failure."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import CollectorRegistry

import weightsync
from weightsync.demo import make_trajectory
from weightsync.service.config import Identity, StoreConfig, SubscriberConfig
from weightsync.service.metrics import Metrics
from weightsync.service.subscriber import Subscriber

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


@pytest.fixture
def setup(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    traj = make_trajectory(tmp_path / "traj", steps=3, **TINY)
    weightsync.publish(traj[0], store, 0)
    weightsync.publish(traj[1], store, 1, base_dir=traj[0])
    return store, traj


class StopDuringFill(Subscriber):
    """A subscriber whose API asks it to stop once a fill of the standby slot has finished (the
    pull's own checks have all passed), before the fill returns to the loop."""

    stop_in_fill = False

    def _fill(self, folder, version):
        result = super()._fill(folder, version)
        if self.stop_in_fill:
            asked = threading.Event()
            self.loop.call_soon_threadsafe(lambda: (self.request_stop(), asked.set()))  # as the API does
            assert asked.wait(30)
        return result


def _subscriber(cls, store, tmp_path, **options) -> Subscriber:
    cfg = SubscriberConfig(
        StoreConfig(store), tmp_path / "t", Identity("s1"), poll_interval=0.01, fsync=False, **options
    )
    return cls(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "subscriber", subscriber="s1"))


async def serving_the_head(sub: Subscriber) -> None:
    """Start ``sub`` and run its first iteration: it serves version 1, the head of ``setup``'s store."""
    await asyncio.to_thread(sub._startup)
    await sub._iteration()
    assert sub.view.current == 1


def test_a_stop_requested_during_a_sync_does_not_swap(setup, tmp_path):
    store, traj = setup
    sub = _subscriber(StopDuringFill, store, tmp_path, pin=0)

    async def main():
        sub.loop, sub._wake = asyncio.get_running_loop(), asyncio.Event()
        await asyncio.to_thread(sub._startup)
        await sub._iteration()  # version 0 into slot a, swapped in
        assert sub.view.current == 0
        served = sub.slots.current()
        await sub.set_target("latest")
        sub.stop_in_fill = True
        await sub._iteration()  # fills the standby with version 1; the stop comes before the swap
        assert sub.stop_token.is_set and sub.state == "stopping"
        assert sub.slots.current() == served and sub.view.current == 0
        assert sub.view.standby == 1 and sub.view.failures == 0
        assert sub.last_sync["version"] == 0
        assert weightsync.verify(store, sub.slots.path(sub.slots.current()), 0) == 0
        assert weightsync.verify(store, sub.slots.path(sub.slots.standby()), 1) == 1

    asyncio.run(main())


def test_a_pin_one_above_the_head_waits_without_a_failure(setup, tmp_path):
    """Pinned to 2 while the head is 1: the subscriber waits (no sync, no failure, no back-off),
    and syncs 2 as soon as it is published."""
    store, traj = setup
    sub = _subscriber(Subscriber, store, tmp_path, pin=2)

    async def main():
        sub._wake = asyncio.Event()
        await asyncio.to_thread(sub._startup)
        for _ in range(3):
            await sub._iteration()
            assert sub.state == "waiting" and "not published yet" in sub.reason, sub.reason
            assert (sub.view.current, sub.view.failed_version, sub.view.failures) == (None, None, 0)
            assert sub.last_error is None and sub._errors == 0
        weightsync.publish(traj[2], store, 2, base_dir=traj[1])
        await sub._iteration()
        assert sub.view.current == 2
        assert weightsync.verify(store, sub.slots.path(sub.slots.current()), 2) == 2

    asyncio.run(main())


def test_a_head_moved_back_is_followed_with_a_warning(setup, tmp_path, caplog):
    """The store's head rewritten from 1 to 0 (HEAD is not signed): a subscriber following ``latest``
    serves 0 again, and says why (a WARNING, and ``head moved back`` as the reason)."""
    import logging

    from weightsync.format.keys import HEAD_KEY
    from weightsync.format.manifest import head_to_json

    store, traj = setup
    sub = _subscriber(Subscriber, store, tmp_path)

    async def main():
        await serving_the_head(sub)
        repo = weightsync.open_repo(store)
        repo.store.put(HEAD_KEY, head_to_json(0))
        with caplog.at_level(logging.WARNING, "weightsync.subscriber"):
            await sub._iteration()
        assert sub.view.current == 0 and sub.reason == "head moved back: 1 -> 0"
        assert "the store's head went back (rewritten, or restored)" in caplog.text

    asyncio.run(main())


def test_two_subscribers_given_one_id_are_told(setup, tmp_path, caplog):
    """Two subscribers with one ``--id`` overwrite one fleet record (the fleet showed one of them,
    flapping): each finds the other's record before its next write, logs it once, and says so in
    its status until the record is its own again."""
    import logging

    store, _ = setup
    a = _subscriber(Subscriber, store, tmp_path / "a")
    b = _subscriber(Subscriber, store, tmp_path / "b", pin=0)

    async def main():
        for sub in (a, b):
            await asyncio.to_thread(sub._startup)
        with caplog.at_level(logging.ERROR, "weightsync.subscriber"):
            await a._iteration()  # writes the record (its first: nothing to compare with)
            await b._iteration()  # the same key, other content
            assert not a.id_clash and not b.id_clash
            for sub in (a, b, a):  # each finds the other's record
                await sub._write_ledger(force=True)
                assert sub.status()["id_clash"]
        assert caplog.text.count("another subscriber writes the fleet record of id 's1'") == 2  # once each
        await a._write_ledger(force=True)  # its own record now: the clash is over
        assert not a.id_clash

    asyncio.run(main())


def test_a_failed_iteration_says_so_in_the_reason(setup, tmp_path):
    """``state: error`` comes with a reason about the failure, not the step the iteration began
    (it kept saying "head moved: 0 -> 1" while the store was down and version 1 served)."""
    from weightsync.errors import StoreError

    store, _ = setup
    sub = _subscriber(Subscriber, store, tmp_path)

    async def main():
        await serving_the_head(sub)

        def down():
            raise StoreError("the store is down")

        sub.heads.read = down
        await sub._iteration()
        doc = sub.status()
        assert doc["state"] == "error" and doc["last_error"] == "StoreError: the store is down"
        assert doc["reason"].startswith("the last iteration failed (last_error); the next in "), doc["reason"]

    asyncio.run(main())


def test_a_fleet_write_whose_answer_was_lost_is_no_id_clash(setup, tmp_path):
    """A ledger write that landed but whose answer was lost (an error after the write): the next
    write finds that record, which is its own, not another subscriber's."""
    from weightsync.errors import StoreError
    from weightsync.sync import fleet

    store, _ = setup
    sub = _subscriber(Subscriber, store, tmp_path)

    async def main():
        await asyncio.to_thread(sub._startup)
        await sub._iteration()
        real = fleet.write_record

        def lost_answer(store_, record):
            real(store_, record)
            raise StoreError("the answer was lost")

        import weightsync.service.subscriber as subscriber_module

        subscriber_module.write_record = lost_answer
        try:
            sub.state = "other"  # (a record of other bytes)
            await sub._write_ledger(force=True)
        finally:
            subscriber_module.write_record = real
        await sub._write_ledger(force=True)
        assert not sub.id_clash

    asyncio.run(main())
