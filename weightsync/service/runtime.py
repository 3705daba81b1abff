"""What the publisher and subscriber daemons (and the mirror) share: logging, the stop token, opening
the store, running an aiohttp application until SIGTERM or SIGINT, and a plain HTTP server for the
mirror's probes and metrics.

Shutdown: a signal sets the stop token. Work running in a thread sees it through its observer's
``check`` (the token is the observer) and aborts before it commits anything (a publish before its
manifest, a pull before its install), or finishes if it is past that point; background loops are
given ``grace`` seconds to return, then cancelled. Nothing visible is ever half-written: versions
are committed and ``current`` is flipped by single atomic operations.
"""

from __future__ import annotations

import asyncio
import errno
import faulthandler
import http.server
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from weightsync.errors import WeightsyncError
from weightsync.service.config import ApiConfig, LogConfig, StoreConfig
from weightsync.store import open_store
from weightsync.store.inflight import InFlight
from weightsync.store.repo import Repo, open_repo
from weightsync.store.retry import RetryingStore, retry_reason
from weightsync.sync.observer import Observer

log = logging.getLogger("weightsync.daemon")


class Stopped(WeightsyncError):
    """Raised inside a worker thread's callback to abort work because the daemon is stopping."""


class StopToken(Observer):
    """A thread-safe flag; :meth:`check` raises :class:`Stopped` once it is set. An
    :class:`~weightsync.sync.observer.Observer`: passed as the ``observer`` of a publish or pull, it
    stops the work at its next report (before anything is committed or installed)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        """Ask every operation watching this token to stop."""
        self._event.set()

    @property
    def event(self) -> threading.Event:
        """The token as a ``threading.Event`` (for code that waits on one, as the mirror does)."""
        return self._event

    @property
    def is_set(self) -> bool:
        """Whether a stop was asked for."""
        return self._event.is_set()

    def check(self, *_args) -> None:
        """Raise :class:`Stopped` once a stop was asked for (the observer hook of a running operation)."""
        if self._event.is_set():
            raise Stopped("stopping")

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or raise :class:`Stopped` as soon as a stop is asked for (the wait of
        the store's retries: a daemon whose store is down stops at once, not after every retry)."""
        if self._event.wait(seconds):
            raise Stopped("stopping")


# --- logging -------------------------------------------------------------------------------------
class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def logfmt_value(value: object) -> str:
    """A field's value as logfmt writes it: as is, or double-quoted (JSON escapes) when it is empty or
    holds a blank, ``=`` or ``"``, so that ``key=value`` parsers read every field whole."""
    text = str(value)
    if text and not any(c.isspace() or c in '="' for c in text):
        return text
    return json.dumps(text)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={logfmt_value(v)}" for k, v in fields.items())
        return line


def setup_logging(cfg: LogConfig) -> None:
    """Log to stderr as text or JSON lines, at the configured level."""
    handler = logging.StreamHandler(sys.stderr)
    if cfg.json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields) -> None:
    """Log ``msg`` with structured ``fields`` (key=value in text logs, keys in JSON logs)."""
    logger.log(level, msg, extra={"fields": fields})


# --- store ---------------------------------------------------------------------------------------
def open_daemon_repo(
    cfg: StoreConfig,
    on_retry: Callable[[str, str, Exception], None],
    inflight: InFlight | None = None,
    stop: StopToken | None = None,
) -> Repo:
    """The repo of a daemon or of the mirror (once per side): the store wrapped in bounded retries
    (``cfg.retry``; only retryable errors, which the S3 backend marks) that report each retry to
    ``on_retry`` (the metrics) and the log (:class:`RetryLog`), its requests recorded in ``inflight``;
    the wait between retries ends with :class:`Stopped` once ``stop`` is set; signatures are checked
    with ``cfg.trusted_keys``."""
    store = open_store(cfg.url, **cfg.options())
    sleep = time.sleep if stop is None else stop.sleep
    retrying = RetryingStore(store, cfg.retry, on_retry=RetryLog(on_retry), inflight=inflight, sleep=sleep)
    return open_repo(retrying, trusted_keys=cfg.trusted_keys)


class RetryLog:
    """The ``on_retry`` of a daemon's store: ``count(op, key, exc)`` each retry, and log it at WARNING
    with the wait actually slept, at most one line per ``every`` seconds (the next line says how many
    retries it stands for): a throttled store retries in bursts."""

    def __init__(self, count: Callable[[str, str, Exception], None], every: float = 10.0, logger=None):
        self.count, self.every, self.log = count, every, logger or logging.getLogger("weightsync.store")
        self._last = -math.inf
        self._unlogged = 0
        self._lock = threading.Lock()

    def __call__(self, op: str, key: str, exc: Exception, delay: float) -> None:
        self.count(op, key, exc)
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every:
                self._unlogged += 1
                return
            self._last, unlogged, self._unlogged = now, self._unlogged, 0
        event(
            self.log,
            "store request failed; retrying",
            logging.WARNING,
            op=op,
            key=key,
            reason=retry_reason(exc),
            retry_in=f"{delay:.2f}s",
            error=" ".join(str(exc).split())[:300],
            **({"retries_not_logged": unlogged} if unlogged else {}),
        )


def warm_codec() -> None:
    """Load the codec's kernels (:func:`weightsync.codec.warm_up`) on a daemon thread, so that the
    first delta after a start does not compile them; a failure is logged, never fatal."""

    def work() -> None:
        from weightsync.codec.payload import warm_up

        t0 = time.perf_counter()
        try:
            warm_up()
        except Exception as exc:  # the first delta then compiles what it needs, as before
            event(log, "codec warm-up failed", level=logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            return
        from weightsync.codec.jit import stats

        event(log, "codec kernels ready", seconds=f"{time.perf_counter() - t0:.2f}", **stats())

    threading.Thread(target=work, name="codec-warm-up", daemon=True).start()


# --- a plain HTTP server for processes without the aiohttp API (the mirror) ---------------------------
Answer = tuple[int, str, bytes]  # (status, content type, body)


class _RoutesHandler(http.server.BaseHTTPRequestHandler):
    server_version = "weightsync"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        route = self.server.routes.get(urlsplit(self.path).path)  # type: ignore[attr-defined]
        status, ctype, body = route() if route else (404, "application/json", b'{"error": "Not Found"}')
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # no access log, as the daemons
        pass


def serve_routes(host: str, port: int, routes: dict[str, Callable[[], Answer]]) -> http.server.ThreadingHTTPServer:
    """Serve ``GET path`` -> ``routes[path]()`` at ``host:port`` from a daemon thread (other paths:
    404). Raises OSError if it cannot listen there; stop it with ``shutdown()`` and ``server_close()``."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type(
        "Server", (http.server.ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True}
    )
    server = server_class((host, port), _RoutesHandler)
    server.routes = routes  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def json_answer(doc: dict, status: int = 200) -> Answer:
    """An answer of :func:`serve_routes`: ``doc`` as JSON with ``status``."""
    return status, "application/json", json.dumps(doc).encode()


# --- background loops and the app runner ---------------------------------------------------------
def background(name: str, run: Callable[[], Awaitable[None]], stop: Callable[[], None], grace: float):
    """A ``cleanup_ctx`` entry that runs ``run()`` as a task for the application's lifetime.

    Under :func:`serve` the loop begins once the API's port is bound: a daemon whose port is taken
    exits without having started (a subscriber wrote its fleet record, which ``fleet --all`` then
    listed, and logged "started"). On cleanup, ``stop()`` asks the loop to finish; after ``grace``
    seconds it is cancelled. A loop that dies of an unexpected error is logged and stops the daemon
    (exit code 1).
    """

    async def after_listening(app: web.Application) -> None:
        if LISTENING in app:  # serve()'s: the loop starts once the port is bound (a failed bind runs nothing)
            await app[LISTENING].wait()
        await run()

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(after_listening(app), name=name)
        task.add_done_callback(lambda t: _loop_done(app, name, t))
        yield
        if LISTENING in app and not app[LISTENING].is_set():  # the bind failed: the loop never began
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            return
        stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), grace)
        except asyncio.TimeoutError:
            log.warning("%s did not stop within %.0fs; cancelling it", name, grace)
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        except Exception:  # already logged by _loop_done
            pass

    return ctx


SHUTDOWN = web.AppKey("shutdown", asyncio.Event)


LISTENING = web.AppKey("listening", asyncio.Event)  # set by serve() once the API's port is bound


EXIT_CODE = web.AppKey("exit_code", list)


def _loop_done(app: web.Application, name: str, task: asyncio.Task) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("%s died: %s", name, exc, exc_info=exc)
        app[EXIT_CODE].append(1)
    if SHUTDOWN in app:
        app[SHUTDOWN].set()  # a loop that returns ends the daemon


async def sleep_or_wake(wake: asyncio.Event, delay: float, stop: StopToken) -> None:
    """Wait ``delay`` seconds before a daemon's next iteration, or less if ``wake`` is set (an API
    call asks for work) or the daemon is stopping. Wakes set during the iteration are dropped."""
    wake.clear()
    if stop.is_set:
        return
    with suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), delay)


_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # OSErrors whose line says all: no traceback at each try


def iteration_failed(daemon, exc: Exception, logger: logging.Logger, delay: float | None = None) -> float:
    """Record a failed loop iteration of ``daemon`` (a publisher or subscriber: ``_errors``,
    ``metrics.loop_errors``, ``last_error``, ``state``, ``reason``, ``cfg.poll_interval``, ``cfg.backoff``):
    log it, count it, and return how long to back off before the next one (``delay`` when the daemon
    knows better, e.g. when the failed step is retried; the log says the wait actually taken)."""
    daemon._errors += 1
    daemon.metrics.loop_errors.inc()
    daemon.last_error = f"{type(exc).__name__}: {exc}"
    daemon.state = "error"
    if delay is None:
        delay = max(daemon.cfg.poll_interval, daemon.cfg.backoff.delay(daemon._errors))
    daemon.reason = f"the last iteration failed (last_error); the next in {delay:.1f}s"  # not the step it began
    event(logger, "iteration failed", logging.ERROR, error=daemon.last_error, retry_in=f"{delay:.1f}s")
    if not isinstance(exc, WeightsyncError) and getattr(exc, "errno", None) not in _SPACE:  # (a full disk: one line)
        logger.error("unexpected error", exc_info=exc)
    return delay


def stall_view(stalls, state: str, reason: str) -> tuple[str, str, list[dict]]:
    """A daemon's status ``state``, ``reason`` and ``stalled`` requests: ``stalled`` and the oldest
    stalled store request while one runs past ``--stall-after`` (``stalls``: a
    :class:`~weightsync.service.stalls.StallWatch` or None), else the daemon's own."""
    stalled = [] if stalls is None else stalls.stalled()
    if stalled and state != "stopping":
        return "stalled", stalls.describe() or reason, stalled
    return state, reason, stalled


# --- outcomes shared by the daemons' pure planning functions ---------------------------------------
@dataclass(frozen=True)
class Idle:
    """Nothing to do: ``reason`` says why (shown in /v1/status)."""

    reason: str


@dataclass(frozen=True)
class Wait:
    """Something to do, but not yet (an unfinished checkpoint, a back-off): ``reason`` says what."""

    reason: str


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    import ipaddress

    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to may be reachable from outside


async def serve(app: web.Application, api: ApiConfig) -> int:
    """Run ``app`` (HTTP only if ``api.port`` is set) until SIGTERM/SIGINT or its loop ends."""
    app[SHUTDOWN] = asyncio.Event()
    app[LISTENING] = asyncio.Event()
    app[EXIT_CODE] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app[SHUTDOWN].set)
    loop.add_signal_handler(signal.SIGUSR1, dump_stacks)
    with suppress(AttributeError, ValueError, RuntimeError, OSError):  # no stderr file: no dump
        faulthandler.register(signal.SIGUSR2, all_threads=True)  # threads' stacks to stderr, even if the loop is stuck
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        if api.port is not None:
            site = web.TCPSite(runner, api.host, api.port)
            await site.start()
            for addr in runner.addresses:
                event(log, "listening", url=f"http://{addr[0]}:{addr[1]}", auth="bearer" if api.token else "none")
            if api.token is None and not is_loopback(api.host):
                event(
                    log,
                    f"the API listens on {api.host} without a token: anyone who reaches this port can pin, roll "
                    "back, publish and call the swap hook; set WEIGHTSYNC_API_TOKEN (or --api-token-file)",
                    logging.WARNING,
                )
        app[LISTENING].set()  # the daemon's loop starts now: a port in use must not leave a fleet record
        await app[SHUTDOWN].wait()
        event(log, "stopping")
    finally:
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        faulthandler.unregister(signal.SIGUSR2)
    code = max(app[EXIT_CODE], default=0)
    event(log, "stopped", exit_code=code)
    return code


def dump_stacks() -> None:
    """Log where every asyncio task waits (its chain of awaits) and every thread's stack: what a
    daemon that does not stop, or does not answer, is doing (``kill -USR1 PID``). Called from a
    thread without a running loop (the mirror's signal handler), it logs the threads."""
    import traceback

    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop running in this thread (the mirror): its threads only
        tasks = set()
    parts = []
    for task in sorted(tasks, key=lambda t: t.get_name()):
        frames, coro = [], task.get_coro()
        while coro is not None:  # a suspended coroutine's frame, then what it awaits, down the chain
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                frames.append((frame, frame.f_lineno))
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        stack = "".join(traceback.format_list(traceback.StackSummary.extract(frames)))
        parts.append(f"task {task.get_name()}:\n{stack}")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    log.warning("stacks of %d tasks and %d threads (SIGUSR1):\n%s", len(tasks), len(names), "\n".join(parts))


def run(app_factory: Callable[[], web.Application], api: ApiConfig) -> int:
    """Build the app inside a fresh event loop and serve it; returns the process exit code."""

    async def main() -> int:
        return await serve(app_factory(), api)

    return asyncio.run(main())
