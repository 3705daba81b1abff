"""A fault-injecting HTTP/1.1 reverse proxy for S3 tests: put it between boto3 and SeaweedFS.

    proxy = FaultProxy(seaweed.endpoint).start()     # listens on 127.0.0.1:<free port>
    env["AWS_ENDPOINT_URL"] = proxy.endpoint
    proxy.add(Rule("503", method="GET", key=r"/chunks/", count=3))   # the next 3 chunk GETs: SlowDown
    proxy.add(Rule("reset", probability=0.05))                       # 5 % of all requests: RST
    ...
    proxy.injected          # Counter of faults injected, by kind
    proxy.answers           # (method, path, status, body bytes) of each answer forwarded unchanged
    proxy.stop()

Faults (``Rule.fault``):

- ``"503"``: answer ``503 SlowDown`` (S3's throttling XML) without forwarding the request.
- ``"500"``: answer ``500 InternalError`` without forwarding.
- ``"reset"``: reset the client connection (TCP RST) without forwarding.
- ``"delay"``: wait ``Rule.delay`` seconds, then forward (a slow server).
- ``"truncate"``: forward, then send the response head with its full ``Content-Length`` but only
  ``Rule.fraction`` of the body, and close. A response without a body is dropped instead.
- ``"drop"``: forward (the request takes effect on the server), then reset the connection instead
  of answering: the client cannot tell whether its write happened.

A rule applies to requests whose method equals ``method`` (None: any) and whose URL-decoded path
and query (``/bucket/prefix/chunks/ab/ab12...``, ``/bucket?list-type=2&prefix=...``) match the regex
``key`` (``re.search``; None: any), with ``probability`` (drawn from a seeded
RNG), and only ``count`` times if set (then it is spent). Rules are tried in the order added; the
first that fires wins. Everything else is forwarded unchanged: the ``Host`` header is kept, so
SigV4 signatures made for the proxy's address stay valid upstream.

Requests are read whole (``Content-Length`` or chunked), ``Expect: 100-continue`` is answered by
the proxy; responses are read whole and re-sent with a ``Content-Length``. Memory: one request
and one response per open connection. The proxy runs its own asyncio loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

FAULTS = ("503", "500", "reset", "delay", "truncate", "drop")
_ERRORS = {
    "503": ("503 Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "500": ("500 Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}
_HEAD_LIMIT = 1 << 20


@dataclass
class Rule:
    """One fault and the requests it applies to (see the module docstring)."""

    fault: str
    method: str | None = None
    key: str | None = None
    count: int | None = None
    probability: float = 1.0
    delay: float = 0.0
    fraction: float = 0.5
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {FAULTS}")
        if not 0.0 <= self.probability <= 1.0 or not 0.0 <= self.fraction < 1.0:
            raise ValueError("probability must be in [0, 1] and fraction in [0, 1)")
        self._regex = None if self.key is None else re.compile(self.key)

    @property
    def spent(self) -> bool:
        return self.count is not None and self.fired >= self.count

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self._regex is None or self._regex.search(path) is not None
        )


@dataclass
class _Request:
    method: str
    target: str
    path: str  # URL-decoded path and query (what ``Rule.key`` is searched in)
    head: bytes  # request line and headers as forwarded upstream (Expect removed)
    body: bytes
    close: bool  # the client asked to close after this request


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str, *, seed: int = 0, host: str = "127.0.0.1", port: int = 0):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.host, self.port = host, port
        self.rules: list[Rule] = []
        self.injected: Counter[str] = Counter()  # faults injected, by kind
        self.requests: Counter[str] = Counter()  # requests seen, by method
        self.log: list[tuple[float, str, str, str | None]] = []  # (time, method, path, fault), bounded
        self.answers: list[tuple[str, str, int, int]] = []  # (method, path, status, body bytes) forwarded, bounded
        self.log_limit = 100_000
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    # -- control (any thread) ---------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def total_injected(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule (counters are kept)."""
        with self._lock:
            self.rules.clear()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.injected)

    def seen(self, method: str | None = None, key: str | None = None, since: float = 0.0) -> int:
        """Requests logged since ``since`` (monotonic time) matching ``method`` and regex ``key``."""
        regex = None if key is None else re.compile(key)
        with self._lock:
            return sum(
                1
                for t, m, p, _ in self.log
                if t >= since and (method is None or m == method) and (regex is None or regex.search(p))
            )

    def _choose(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.requests[method] += 1
            chosen = None
            for rule in self.rules:
                if rule.spent or not rule.matches(method, path):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                self.injected[rule.fault] += 1
                chosen = rule
                break
            if len(self.log) < self.log_limit:
                self.log.append((time.monotonic(), method, path, None if chosen is None else chosen.fault))
            return chosen

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> FaultProxy:
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, self.host, self.port, limit=_HEAD_LIMIT)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=main, name="fault-proxy", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError("fault proxy did not start")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._conns):
            _abort(w)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one client connection --------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                req = await _read_request(reader, writer)
                if req is None:
                    break
                rule = self._choose(req.method, req.path)
                fault = None if rule is None else rule.fault
                if fault in ("503", "500"):
                    await _send_error(writer, fault, req)
                    if req.close:
                        break
                    continue
                if fault == "reset":
                    _abort(writer)
                    return
                if fault == "delay":
                    await asyncio.sleep(rule.delay)
                up, status, headers, body, up_close = await self._forward(up, req)
                if up_close and up is not None:
                    up[1].close()
                    up = None
                if fault == "drop" or (fault == "truncate" and (not body or req.method == "HEAD")):
                    _abort(writer)
                    return
                if fault == "truncate":
                    writer.write(_response_head(status, headers, len(body)) + body[: int(len(body) * rule.fraction)])
                    await writer.drain()
                    writer.close()
                    return
                with self._lock:
                    if len(self.answers) < self.log_limit:
                        self.answers.append((req.method, req.path, int(status.split(" ", 2)[1]), len(body)))
                writer.write(_response_head(status, headers, None if req.method == "HEAD" else len(body)) + body)
                await writer.drain()
                if req.close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError):
            _abort(writer)
        except asyncio.CancelledError:  # the proxy is stopping (returning keeps asyncio's callback quiet)
            _abort(writer)
        finally:
            self._conns.discard(writer)
            if up is not None:
                up[1].close()
            if not writer.is_closing():
                writer.close()

    async def _forward(self, up, req: _Request):
        """Send ``req`` upstream (reconnecting once if a kept-alive connection went stale)."""
        for attempt in (0, 1):
            if up is None:
                up = await asyncio.open_connection(*self.upstream, limit=_HEAD_LIMIT)
            try:
                up[1].write(req.head + req.body)
                await up[1].drain()
                status, headers, body, close = await _read_response(up[0], req.method)
                return up, status, headers, body, close
            except (ConnectionError, asyncio.IncompleteReadError):
                up[1].close()
                up = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


# --- HTTP/1.1 framing ------------------------------------------------------------------------------
def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


def _headers(lines: list[bytes]) -> list[tuple[str, str]]:
    out = []
    for line in lines:
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise ValueError(f"bad header line {line!r}")
        out.append((name.strip(), value.strip()))
    return out


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


async def _read_chunked(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A chunked body: (raw bytes as sent, decoded bytes)."""
    raw, data = bytearray(), bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        raw += line
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            while True:  # trailers, up to the empty line
                t = await reader.readuntil(b"\r\n")
                raw += t
                if t == b"\r\n":
                    return bytes(raw), bytes(data)
        chunk = await reader.readexactly(size + 2)
        raw += chunk
        data += chunk[:-2]


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise
        return None  # the client closed between requests
    lines = head[:-4].split(b"\r\n")
    method, target, _version = lines[0].decode("latin-1").split(" ", 2)
    headers = _headers(lines[1:])
    if (_get(headers, "expect") or "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if (_get(headers, "transfer-encoding") or "").lower() == "chunked":
        body, _ = await _read_chunked(reader)
    else:
        body = await reader.readexactly(int(_get(headers, "content-length") or 0))
    kept = [f"{k}: {v}".encode("latin-1") for k, v in headers if k.lower() != "expect"]
    forwarded = b"\r\n".join([lines[0], *kept]) + b"\r\n\r\n"
    close = (_get(headers, "connection") or "").lower() == "close"
    return _Request(method, target, unquote(target), forwarded, body, close)


async def _read_response(reader: asyncio.StreamReader, method: str):
    """(status line, headers, body, upstream must be closed) of one upstream response."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        status = lines[0].decode("latin-1")
        code = int(status.split(" ", 2)[1])
        if code != 100:  # skip interim 100 Continue answers
            break
    headers = _headers(lines[1:])
    close = (_get(headers, "connection") or "").lower() == "close"
    if method == "HEAD" or code in (204, 304) or 100 <= code < 200:
        return status, headers, b"", close
    if (_get(headers, "transfer-encoding") or "").lower() == "chunked":
        _, body = await _read_chunked(reader)
    elif (n := _get(headers, "content-length")) is not None:
        body = await reader.readexactly(int(n))
    else:
        body, close = await reader.read(), True
    return status, headers, body, close


def _response_head(status: str, headers: list[tuple[str, str]], length: int | None) -> bytes:
    """The response head re-framed with a Content-Length (``None``: keep the headers, e.g. HEAD)."""
    drop = {"transfer-encoding", "connection", "keep-alive"}
    if length is not None:
        drop.add("content-length")
    lines = [status, *(f"{k}: {v}" for k, v in headers if k.lower() not in drop)]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send_error(writer: asyncio.StreamWriter, fault: str, req: _Request) -> None:
    status, code, message = _ERRORS[fault]
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Resource>{req.path}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()
    if req.method == "HEAD":
        body = b""
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"x-amz-request-id: faultproxy\r\n"
    )
    if fault == "503":
        head += "Retry-After: 1\r\n"
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()
