"""ordered_map: order, the memory budget, runs of small items, and failures in the middle of a run."""

from __future__ import annotations

import threading
import time

import pytest

from weightsync.sync.pipeline import ordered_map


class Tracker:
    """``fn`` for ordered_map that records which thread ran each item and the started weight."""

    def __init__(self, fail_at: int | None = None, delay: float = 0.0):
        self.fail_at, self.delay = fail_at, delay
        self.lock = threading.Lock()
        self.thread: dict[int, int] = {}
        self.ran: list[int] = []

    def __call__(self, item: int) -> int:
        with self.lock:
            self.thread[item] = threading.get_ident()
            self.ran.append(item)
        if self.delay:
            time.sleep(self.delay)
        if item == self.fail_at:
            raise ValueError(f"item {item}")
        return item * item


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("batch", [0, 1, 5, 12, 1000])
def test_results_come_in_input_order(threads, batch):
    items = list(range(40))
    fn = Tracker(delay=0.001)
    got = list(ordered_map(fn, items, lambda i: 1 + i % 3, budget=10, threads=threads, batch=batch))
    assert got == [(i, i * i) for i in items]
    assert sorted(fn.ran) == items


def test_consecutive_small_items_run_together_on_one_thread():
    """Weights 1, 1, 1, 5, 1, 1 with runs of 3: [0, 1, 2], [3], [4, 5]; each run on one thread."""
    weights = [1, 1, 1, 5, 1, 1]
    fn = Tracker(delay=0.03)
    got = list(ordered_map(fn, range(6), lambda i: weights[i], budget=100, threads=3, batch=3))
    assert [i for i, _ in got] == list(range(6))
    assert fn.thread[0] == fn.thread[1] == fn.thread[2]
    assert fn.thread[4] == fn.thread[5]
    assert len({fn.thread[0], fn.thread[3], fn.thread[4]}) == 3  # three runs in parallel (budget allows)


def test_the_budget_bounds_the_weight_started_but_not_yielded():
    """Whatever the threads, no more than ``budget`` of weight is started ahead of the consumer,
    counted in whole runs; one run always starts, however heavy."""
    lock, started, peak = threading.Lock(), [0], [0]
    yielded = [0]
    weights = [4, 4, 4, 4, 9, 1, 1, 1, 1, 1]

    def fn(i):
        with lock:
            started[0] += weights[i]
            peak[0] = max(peak[0], started[0] - yielded[0])
        return i

    for i, _ in ordered_map(fn, range(10), lambda i: weights[i], budget=8, threads=4, batch=2):
        time.sleep(0.005)
        yielded[0] += weights[i]
    assert peak[0] <= 9  # the one heavy item alone; otherwise at most the budget


@pytest.mark.parametrize("batch", [0, 100])
def test_a_failure_yields_the_items_before_it_then_raises(batch):
    """Within a run or across runs: every item before the failing one is yielded, in order."""
    fn = Tracker(fail_at=7)
    got = []
    with pytest.raises(ValueError, match="item 7"):
        for item, result in ordered_map(
            fn, range(20), lambda i: 1, budget=4 if batch == 0 else 1000, threads=2, batch=batch
        ):
            got.append(item)
    assert got == list(range(7))
    if batch:  # the whole input was one run: nothing after the failure ran
        assert fn.ran == list(range(8))


def test_closing_early_cancels_the_work_not_yet_started():
    """Everything fits the budget, so every run is submitted at once; closing after the first result
    cancels the runs no worker has taken (without the cancel, all 200 items would run)."""
    fn = Tracker(delay=0.005)
    gen = ordered_map(fn, range(200), lambda i: 1, budget=1000, threads=2, batch=2)
    assert next(gen) == (0, 0)
    gen.close()
    assert len(fn.ran) < 20


def test_runs_never_starve_a_small_budget_of_threads():
    """Runs are capped at budget / threads: with room for two items of weight 3 in a budget of 8,
    two run at once, as without runs."""
    lock, running, peak = threading.Lock(), [0], [0]

    def fn(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return i

    got = list(ordered_map(fn, range(8), lambda i: 3, budget=8, threads=4, batch=12))
    assert [i for i, _ in got] == list(range(8))
    assert peak[0] == 2
