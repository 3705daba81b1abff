"""A link-shaping, request-counting HTTP/1.1 proxy for S3: one instance stands for one network link
(a cross-region path, or an in-region client's path to its bucket) in ``benchmarks/regions.py``.

    link = LinkProxy(seaweed.endpoint, bandwidth=10e6, rtt=0.150).start()
    env["AWS_ENDPOINT_URL"] = link.endpoint       # clients of this link talk to the proxy
    ...
    link.snapshot()    # {"requests": {kind: n}, "bytes_up": .., "bytes_down": .., "by_kind": {...}}
    link.records()     # one Record per request: times, kind, status, bytes, key
    link.stop()

Shaping (both settable, both off by default):

- ``bandwidth``: bytes per second in each direction, shared by every connection of the link: a
  FIFO of slices (``SLICE`` bytes each) on a virtual clock, so the link's total rate never exceeds
  it and concurrent transfers interleave slice by slice. Request bodies are paced upstream, response
  bodies to the client, heads included. No TCP window, slow start or loss is modelled: one
  connection can fill the link.
- ``rtt``: seconds of round trip. Each request waits ``rtt / 2`` before it is forwarded and its
  response ``rtt / 2`` before it is sent back; a new client connection first waits
  ``connect_rtts x rtt`` (the TCP handshake; 1 by default, no TLS). The waits do not use bandwidth,
  so requests in flight overlap as on a real long link.

Counting: every request is classified by method and key family (``chunks``, ``versions``,
``parts``, ``lazy``, ``signatures``, ``fleet``, ``HEAD-key``, ``marker``, ``other``), ``range`` when it
carries a ``Range`` header, ``LIST`` for bucket listings, and the status when it is not 2xx (e.g.
``GET HEAD-key 304``: a conditional read of the head pointer that did not change, ``HEAD chunks
404``, ``PUT HEAD-key 412``). Bytes each way are counted as sent on the wire (request line, headers and body).

The proxy reuses :class:`tests.faultproxy.FaultProxy` for its thread, loop, lifecycle and HTTP
framing, so fault rules (``link.add(Rule("503", ...))``) still apply; ``truncate`` and ``drop``
are not supported here. Memory: one request and one response per open connection.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/faultproxy.py

from faultproxy import (  # noqa: E402
    FaultProxy,
    Rule,
    _abort,
    _read_request,
    _response_head,
    _send_error,
)

SLICE = 64 << 10  # bytes paced at a time
_FAMILY = re.compile(r"/(chunks|versions|parts|lazy|signatures|fleet)/")
_SMALL_BODY = 4096  # PUT bodies of the HEAD key up to this size are kept in the record (the version)

__all__ = ["LinkProxy", "Pacer", "Record", "Rule", "classify"]


@dataclass(frozen=True)
class Record:
    """One request through the link: arrival and completion (``time.time()``), its kind, the
    URL-decoded path, status code, bytes up and down, and the body of a small PUT of the head
    pointer (else None)."""

    start: float
    end: float
    method: str
    kind: str
    path: str
    status: int
    up: int
    down: int
    body: bytes | None = None


def family(path: str) -> str:
    """The key family of an S3 path (``/bucket/prefix/chunks/ab/ab12..`` -> ``chunks``)."""
    key = path.split("?", 1)[0]
    m = _FAMILY.search(key)
    if m:
        return m.group(1)
    if key.endswith("/HEAD"):
        return "HEAD-key"
    if key.endswith("/weightsync.json"):
        return "marker"
    return "other"


def classify(method: str, path: str, ranged: bool, status: int) -> str:
    """The counting kind of one request (see the module docstring)."""
    key = path.split("?", 1)[0]
    if method == "GET" and "/" not in key.strip("/"):  # a bucket-level GET: a listing
        kind = "LIST"
    else:
        kind = f"{method} {family(path)}" + (" range" if ranged else "")
    if not 200 <= status < 300:
        kind += f" {status}"
    return kind


class Pacer:
    """A link direction of ``rate`` bytes per second shared by its users: :meth:`reserve` books
    ``n`` bytes on a virtual clock and returns the time (monotonic) at which they have crossed."""

    def __init__(self, rate: float | None):
        if rate is not None and not rate > 0:
            raise ValueError(f"bandwidth must be positive, got {rate}")
        self.rate = rate
        self._free = 0.0  # when the link finishes what is booked so far

    def reserve(self, n: int) -> float:
        now = time.monotonic()
        if self.rate is None:
            return now
        self._free = max(now, self._free) + n / self.rate
        return self._free


class LinkProxy(FaultProxy):
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` that shapes and counts (module docstring)."""

    def __init__(
        self,
        upstream: str,
        *,
        name: str = "link",
        bandwidth: float | None = None,
        rtt: float = 0.0,
        connect_rtts: float = 1.0,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        super().__init__(upstream, seed=seed, host=host, port=port)
        if rtt < 0 or connect_rtts < 0:
            raise ValueError("rtt and connect_rtts must not be negative")
        self.name, self.rtt, self.connect_rtts = name, rtt, connect_rtts
        self.bandwidth = bandwidth
        self._up, self._down = Pacer(bandwidth), Pacer(bandwidth)
        self._records: list[Record] = []
        self._stats_lock = threading.Lock()
        self.connections = 0

    def add(self, rule: Rule) -> Rule:
        if rule.fault in ("truncate", "drop"):
            raise ValueError(f"LinkProxy does not inject {rule.fault!r} faults (use FaultProxy)")
        return super().add(rule)

    # -- counters (any thread) ----------------------------------------------------------------------
    def records(self, since: float = 0.0) -> list[Record]:
        """The requests completed at or after ``since`` (``time.time()``), in completion order."""
        with self._stats_lock:
            return [r for r in self._records if r.end >= since]

    def snapshot(self, since: float = 0.0, until: float = float("inf")) -> dict:
        """Totals of the requests completed in ``[since, until)``: requests by kind, bytes up and
        down, and per kind ``[requests, bytes up, bytes down]``."""
        requests: Counter[str] = Counter()
        by_kind: dict[str, list[int]] = {}
        up = down = 0
        with self._stats_lock:
            chosen = [r for r in self._records if since <= r.end < until]
        for r in chosen:
            requests[r.kind] += 1
            k = by_kind.setdefault(r.kind, [0, 0, 0])
            k[0] += 1
            k[1] += r.up
            k[2] += r.down
            up += r.up
            down += r.down
        return {
            "requests": dict(sorted(requests.items())),
            "bytes_up": up,
            "bytes_down": down,
            "by_kind": dict(sorted(by_kind.items())),
        }

    def _record(self, rec: Record) -> None:
        with self._stats_lock:
            self._records.append(rec)

    # -- shaping ----------------------------------------------------------------------------------
    async def _paced_write(self, writer: asyncio.StreamWriter, data: bytes, pacer: Pacer, done=None) -> None:
        """Write ``data`` to ``writer`` slice by slice, each once it has crossed the link; ``done()``
        runs just before the last slice is handed to the socket (so a client that has read the
        whole answer always finds the request counted)."""
        view = memoryview(data)
        starts = range(0, max(len(view), 1), SLICE)
        for i in starts:
            piece = view[i : i + SLICE]
            if pacer.rate is not None:
                delay = pacer.reserve(len(piece)) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if done is not None and i == starts[-1]:
                done()
            writer.write(piece)
            await writer.drain()

    async def _latency(self, fraction: float) -> None:
        if self.rtt > 0:
            await asyncio.sleep(self.rtt * fraction)

    # -- one client connection --------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        self.connections += 1
        up = None
        try:
            await self._latency(self.connect_rtts)  # the handshake of a new connection
            while True:
                req = await _read_request(reader, writer)
                if req is None:
                    break
                start = time.time()
                rule = self._choose(req.method, req.path)
                fault = None if rule is None else rule.fault
                head_lines = req.head.split(b"\r\n")
                ranged = any(line.lower().startswith(b"range:") for line in head_lines[1:])
                sent = len(req.head) + len(req.body)
                if fault == "reset":
                    _abort(writer)
                    return
                await self._latency(0.5)  # the request crosses
                if self._up.rate is not None:
                    delay = self._up.reserve(sent) - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                if fault in ("503", "500"):
                    await self._latency(0.5)
                    kind = classify(req.method, req.path, ranged, int(fault))
                    self._record(Record(start, time.time(), req.method, kind, req.path, int(fault), sent, 0))
                    await _send_error(writer, fault, req)
                    if req.close:
                        break
                    continue
                if fault == "delay":
                    await asyncio.sleep(rule.delay)
                up, status, headers, body, up_close = await self._forward(up, req)
                if up_close and up is not None:
                    up[1].close()
                    up = None
                code = int(status.split(" ", 2)[1])
                out = _response_head(status, headers, None if req.method == "HEAD" else len(body)) + body
                await self._latency(0.5)  # the answer crosses
                kind = classify(req.method, req.path, ranged, code)
                small = req.body if req.method == "PUT" and kind.startswith("PUT HEAD-key") else None
                if small is not None and len(small) > _SMALL_BODY:
                    small = None
                record = lambda: self._record(  # noqa: E731
                    Record(start, time.time(), req.method, kind, req.path, code, sent, len(out), small)
                )
                await self._paced_write(writer, out, self._down, record)
                if req.close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError):
            _abort(writer)
        except asyncio.CancelledError:  # the proxy is stopping
            _abort(writer)
        finally:
            self._conns.discard(writer)
            if up is not None:
                up[1].close()
            if not writer.is_closing():
                writer.close()
