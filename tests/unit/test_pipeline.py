"""ordered_map: order, the memory budget, runs of small items, and failures in the middle of a run.

Overlap is made with barriers and events, never with sleeps: a test that needs runs to execute at
once meets them at a barrier (a timeout fails it instead of hanging), and a test that needs the
workers to have caught up waits for the pool to be idle.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import weightsync.sync.pipeline as pipeline
from weightsync.sync.pipeline import cgroup_cpu_quota, ordered_map, usable_cpus

TIMEOUT = 30.0  # a barrier or event that long overdue is a failure, not a slow machine


class WatchedPool(ThreadPoolExecutor):
    """The executor ordered_map uses, counting submitted and finished tasks; ``shutdown`` first
    sets ``on_shutdown`` (tasks that block on it then finish, so the pool can be joined)."""

    instances: list[WatchedPool] = []
    on_shutdown: threading.Event | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cond = threading.Condition()
        self.submitted = self.finished = 0
        WatchedPool.instances.append(self)

    def submit(self, fn, /, *args, **kwargs):
        def task():
            try:
                return fn(*args, **kwargs)
            finally:
                with self.cond:
                    self.finished += 1
                    self.cond.notify_all()

        with self.cond:
            self.submitted += 1
        return super().submit(task)

    def wait_idle(self) -> None:
        """Until every task submitted so far has run."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.finished == self.submitted, TIMEOUT), "pool never idle"

    def shutdown(self, *args, **kwargs):
        if WatchedPool.on_shutdown is not None:
            WatchedPool.on_shutdown.set()
        super().shutdown(*args, **kwargs)


@pytest.fixture
def watched(monkeypatch):
    """ordered_map's pools, watched (the list of WatchedPool instances, in creation order)."""
    monkeypatch.setattr(pipeline, "ThreadPoolExecutor", WatchedPool)
    monkeypatch.setattr(WatchedPool, "instances", [])
    monkeypatch.setattr(WatchedPool, "on_shutdown", None)
    return WatchedPool.instances


class Tracker:
    """``fn`` for ordered_map that records which thread ran each item; ``wait`` maps an item to a
    barrier or event it waits on before it returns."""

    def __init__(self, fail_at: int | None = None, wait: dict | None = None):
        self.fail_at, self.wait = fail_at, wait or {}
        self.lock = threading.Lock()
        self.thread: dict[int, int] = {}
        self.ran: list[int] = []

    def __call__(self, item: int) -> int:
        with self.lock:
            self.thread[item] = threading.get_ident()
            self.ran.append(item)
        if (gate := self.wait.get(item)) is not None:
            assert gate.wait(TIMEOUT) is not False, f"item {item}: gate never opened"
        if item == self.fail_at:
            raise ValueError(f"item {item}")
        return item * item


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("batch", [0, 1, 5, 12, 1000])
def test_results_come_in_input_order(threads, batch):
    items = list(range(40))
    fn = Tracker()
    got = list(ordered_map(fn, items, lambda i: 1 + i % 3, budget=10, threads=threads, batch=batch))
    assert got == [(i, i * i) for i in items]
    assert sorted(fn.ran) == items


def test_consecutive_small_items_run_together_on_one_thread():
    """Weights 1, 1, 1, 5, 1, 1 with runs of 3: [0, 1, 2], [3], [4, 5]; each run on one thread."""
    weights = [1, 1, 1, 5, 1, 1]
    meet = threading.Barrier(3)  # the first item of each run: all three runs at once, or a timeout
    fn = Tracker(wait={0: meet, 3: meet, 4: meet})
    got = list(ordered_map(fn, range(6), lambda i: weights[i], budget=100, threads=3, batch=3))
    assert [i for i, _ in got] == list(range(6))
    assert fn.thread[0] == fn.thread[1] == fn.thread[2]
    assert fn.thread[4] == fn.thread[5]
    assert len({fn.thread[0], fn.thread[3], fn.thread[4]}) == 3  # three runs in parallel (budget allows)


def test_the_budget_bounds_the_weight_started_but_not_yielded(watched):
    """Whatever the threads, no more than ``budget`` of weight is started ahead of the consumer,
    counted in whole runs; one run always starts, however heavy. The consumer lets the workers
    run everything submitted before it takes each item, so the peak is the worst case, exactly."""
    lock, started, peak = threading.Lock(), [0], [0]
    yielded = [0]
    weights = [4, 4, 4, 4, 9, 1, 1, 1, 1, 1]

    def fn(i):
        with lock:
            started[0] += weights[i]
            peak[0] = max(peak[0], started[0] - yielded[0])
        return i

    for i, _ in ordered_map(fn, range(10), lambda i: weights[i], budget=8, threads=4, batch=2):
        watched[0].wait_idle()
        with lock:
            peak[0] = max(peak[0], started[0] - yielded[0])
            yielded[0] += weights[i]
    assert peak[0] == 9  # the one heavy item alone; otherwise at most the budget (two items of 4)


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


def test_closing_early_cancels_the_work_not_yet_started(watched):
    """Everything fits the budget, so every run is submitted at once; closing after the first result
    cancels the runs no worker has taken (without the cancel, all 200 items would run). Every item
    after the first run waits until the pool shuts down, after the cancel: the two workers hold
    one run each meanwhile, so at most runs [0, 1], [2, 3] and [4, 5] ever start."""
    release = threading.Event()
    WatchedPool.on_shutdown = release
    fn = Tracker(wait={i: release for i in range(2, 200)})
    gen = ordered_map(fn, range(200), lambda i: 1, budget=1000, threads=2, batch=2)
    assert next(gen) == (0, 0)
    assert watched[0].submitted == 100
    gen.close()
    assert release.is_set() and sorted(fn.ran) == list(range(len(fn.ran))) and 2 < len(fn.ran) <= 6


def test_runs_never_starve_a_small_budget_of_threads():
    """Runs are capped at budget / threads: with room for two items of weight 3 in a budget of 8,
    two run at once, as without runs (each item waits at a barrier of two: one at a time times out)."""
    lock, running, peak = threading.Lock(), [0], [0]
    pair = threading.Barrier(2)

    def fn(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        pair.wait(TIMEOUT)
        with lock:
            running[0] -= 1
        return i

    got = list(ordered_map(fn, range(8), lambda i: 3, budget=8, threads=4, batch=12))
    assert [i for i, _ in got] == list(range(8))
    assert peak[0] == 2


def _cgroups(root: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    for rel, text in files.items():
        (root / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "fs" / rel).write_text(text)
    (root / "cgroup").write_text(proc)
    return root / "fs", root / "cgroup"


@pytest.mark.parametrize(
    "proc,files,quota",
    [
        # v2, the host's path in /proc: the lowest quota of the cgroup and those above it
        (
            "0::/pods/p1/c1\n",
            {"cpu.max": "max 100000", "pods/p1/cpu.max": "150000 100000", "pods/p1/c1/cpu.max": "max 100000"},
            1.5,
        ),
        # v2 in a container: its own cgroup at the mount's root, /proc naming "/"
        ("0::/\n", {"cpu.max": "250000 100000"}, 2.5),
        ("0::/\n", {"cpu.max": "max 100000"}, None),
        # v1, cpu and cpuacct mounted together, and the container's cgroup at the root of the mount
        (
            "12:memory:/k/x\n4:cpu,cpuacct:/k/x\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "50000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            0.5,
        ),
        (
            "4:cpuacct,cpu:/k/x\n",
            {"cpu/k/x/cpu.cfs_quota_us": "300000\n", "cpu/k/x/cpu.cfs_period_us": "100000\n"},
            3.0,
        ),
        ("4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        # unreadable or odd: no quota (never an error)
        ("0::/\n", {"cpu.max": "garbage"}, None),
        ("4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "0"}, None),
        ("0::/\n", {"cpu.max": "100000 0"}, None),
        ("", {}, None),
    ],
)
def test_a_cgroup_cpu_quota_caps_the_default_threads(tmp_path, proc, files, quota):
    root, proc_file = _cgroups(tmp_path, proc, files)
    assert cgroup_cpu_quota(root, proc_file) == quota
    cpus = len(os.sched_getaffinity(0))
    assert usable_cpus(root, proc_file) == (cpus if quota is None else max(1, min(cpus, math.ceil(quota))))


def test_without_a_cgroup_file_every_cpu_is_usable(tmp_path):
    assert cgroup_cpu_quota(tmp_path, tmp_path / "absent") is None
    assert usable_cpus(tmp_path, tmp_path / "absent") == len(os.sched_getaffinity(0))
    (tmp_path / "cgroup").write_bytes(b"0::/pod\xff/c\n")  # a path that is no UTF-8
    (tmp_path / "pod\udcff").mkdir()
    (tmp_path / "pod\udcff" / "cpu.max").write_text("200000 100000")
    assert cgroup_cpu_quota(tmp_path, tmp_path / "cgroup") == 2.0
