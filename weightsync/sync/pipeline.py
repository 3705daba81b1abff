"""Ordered parallel map with a memory budget: the one concurrency pattern of publish and pull."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


R = TypeVar("R")


TASK_BYTES = 16 << 20
"""Small tensors go to a worker in runs of about this many bytes (see :func:`ordered_map`). Each run
done wakes the consumer, and on two cores each wake costs the workers too: against 4 MiB, runs of
16 MiB took 5-6% off two threads' encode and decode of the 2.03 GiB pair (4 MiB tensors) and
4-15% off the small model's, on the daemons' 256 MiB budget (which caps a run at budget / threads:
many threads still get small runs)."""


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may keep busy: those it may run on, capped by its cgroup's CPU quota (a
    container's CPU limit, rounded up). ``os.cpu_count()`` counts the node's: a pod limited to 2 CPUs
    on a 96-core node would run 8 threads and be throttled for most of each period."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, cpus if quota is None else min(cpus, math.ceil(quota)))


def cgroup_cpu_quota(cgroup_root: Path, proc_cgroup: Path) -> float | None:
    """The lowest CPU quota, in CPUs, of this process's cgroup and the ones above it (cgroup v2's
    ``cpu.max``, v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None where none is set or none
    can be read. A container often sees its own cgroup at the mount's root, and ``/proc`` naming the
    host's path: both are read."""
    try:
        lines = proc_cgroup.read_text(errors="surrogateescape").splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy
            mounts, reader = [cgroup_root], _v2_quota
        elif "cpu" in controllers.split(","):
            mounts, reader = [cgroup_root / controllers, cgroup_root / "cpu"], _v1_quota
        else:
            continue
        for mount in dict.fromkeys(mounts):
            d = mount / path.strip("/")
            for folder in dict.fromkeys([d, *d.parents]):
                if folder == mount or mount in folder.parents:
                    if (q := reader(folder)) is not None:
                        quotas.append(q)
    return min(quotas, default=None)


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def default_threads() -> int:
    """Encode and decode threads unless configured: one per usable CPU, eight at most."""
    return min(8, usable_cpus())


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    weight: Callable[[T], int],
    budget: int,
    threads: int,
    batch: int = 0,
) -> Iterator[tuple[T, R]]:
    """Yield ``(item, fn(item))`` in input order, running ``fn`` on ``threads`` threads.

    Items are started while the summed ``weight`` of started-but-not-yielded items stays within
    ``budget`` (one item always runs, whatever its weight), which bounds memory to about ``budget``.
    Consecutive items go to a worker together until their summed weight reaches ``batch`` (at most
    ``budget / threads``, so that a small budget still runs ``threads`` items at once): a task
    per small item costs each a hand-off between threads, under the GIL (on the codec trajectory's
    0.6 MB tensors, runs of 4 MiB lifted two threads' ``sparse`` throughput by 1.2-1.4x; :data:`TASK_BYTES`).
    On an exception the remaining work is cancelled, the items before the failing one are yielded
    and the exception propagates.
    """
    window: deque[tuple[list[T], Future, int]] = deque()
    inflight = 0
    batch = min(batch, budget // max(1, threads))  # a small budget still keeps every thread busy

    def oldest() -> Iterator[tuple[T, R]]:
        nonlocal inflight
        done, fut, w = window.popleft()
        inflight -= w
        results, exc = fut.result()
        yield from zip(done, results)
        if exc is not None:
            raise exc

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ws-work") as pool:
        try:
            for run, w in _runs(items, weight, batch):
                while window and inflight + w > budget:
                    yield from oldest()
                window.append((run, pool.submit(_run, fn, run), w))
                inflight += w
            while window:
                yield from oldest()
        finally:
            for _, fut, _ in window:
                fut.cancel()


def _runs(items: Iterable[T], weight: Callable[[T], int], batch: int) -> Iterator[tuple[list[T], int]]:
    """Consecutive items in runs whose summed weight just reaches ``batch`` (the last may not)."""
    run: list[T] = []
    total = 0
    for item in items:
        run.append(item)
        total += weight(item)
        if total >= batch:
            yield run, total
            run, total = [], 0
    if run:
        yield run, total


def _run(fn: Callable[[T], R], items: list[T]) -> tuple[list[R], BaseException | None]:
    """``fn`` of each item in turn, up to the first that raises (returned with the results before it)."""
    results = []
    for item in items:
        try:
            results.append(fn(item))
        except BaseException as exc:  # noqa: BLE001  re-raised by the consumer, in order
            return results, exc
    return results, None
