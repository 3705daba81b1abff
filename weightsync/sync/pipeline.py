"""Ordered parallel map with a memory budget: the one concurrency pattern of publish and pull."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


R = TypeVar("R")


TASK_BYTES = 16 << 20
"""Small tensors go to a worker in runs of about this many bytes (see :func:`ordered_map`). Each run
done wakes the consumer, and on two cores each wake costs the workers too: against 4 MiB, runs of
16 MiB took 5-6% off two threads' encode and decode of the 2.03 GiB pair (4 MiB tensors) and
4-15% off the small model's, on the daemons' 256 MiB budget (which caps a run at budget / threads:
many threads still get small runs)."""


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
