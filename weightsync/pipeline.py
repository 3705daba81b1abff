"""Ordered parallel map with a memory budget: the one concurrency pattern of publish and pull."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], weight: Callable[[T], int], budget: int, threads: int
) -> Iterator[tuple[T, R]]:
    """Yield ``(item, fn(item))`` in input order, running ``fn`` on ``threads`` threads.

    Items are started while the summed ``weight`` of started-but-not-yielded items stays within
    ``budget`` (one item always runs, whatever its weight), which bounds memory to about ``budget``.
    On an exception the remaining work is cancelled and the exception propagates.
    """
    window: deque[tuple[T, Future, int]] = deque()
    inflight = 0
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ws-work") as pool:
        try:
            for item in items:
                w = weight(item)
                while window and inflight + w > budget:
                    done, fut, dw = window.popleft()
                    inflight -= dw
                    yield done, fut.result()
                window.append((item, pool.submit(fn, item), w))
                inflight += w
            while window:
                done, fut, dw = window.popleft()
                inflight -= dw
                yield done, fut.result()
        finally:
            for _, fut, _ in window:
                fut.cancel()
