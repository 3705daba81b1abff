"""Swap hooks: tell the serving process that ``current`` now points at a new version.

A hook is an HTTP request (a JSON body rendered from a template, with the configured headers, e.g.
``Authorization``, whose values are never logged), an engine's preset requests in order (SGLang's
and vLLM's reload from disk, :data:`~weightsync.service.config.HOOK_PRESETS`) or a command. Each swap fires the
hook once, with up to ``attempts`` tries and doubling backoff; every failed try is logged and
counted. Calls never overlap: a try that runs past ``timeout`` counts as failed but is waited for
(its late answer still counts), never abandoned for a second call that the engine would run beside
the first; it is abandoned only after ``attempts`` such periods. Where each call stands is a
:class:`HookRecord`, which the subscriber keeps in its target folder (``hook.json``), so that a
failed or interrupted hook is known after a restart (docs/DESIGN.md). A hook never affects what
``current`` points at: the swap has already happened, atomically, before the hook runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from weightsync.errors import UsageError
from weightsync.local.state import STATE_DIR, read_doc, write_json_atomic
from weightsync.service.config import HookConfig
from weightsync.service.runtime import event

log = logging.getLogger("weightsync.hooks")

# What a hook call is doing, or how it ended: running (no try failed yet), retrying (a try failed or
# ran past the timeout, or the call before this one did not succeed; still trying), ok, failed (gave
# up), interrupted (found running at start-up).
HOOK_STATES = ("running", "retrying", "ok", "failed", "interrupted")
DEGRADED = frozenset({"retrying", "failed", "interrupted"})  # the engine may not serve the current version
_FORMAT = "weightsync.subscriber-hook"
STDERR_TAIL = 4096
"""Bytes of a hook command's stderr kept (its error names the last 200 characters)."""


def render(template: str, version: int, path: str, current: str, *, json_strings: bool) -> str:
    """Replace ``{version}``, ``{path}`` and ``{current}``; inside a JSON template paths are escaped."""
    esc = (lambda s: json.dumps(s)[1:-1]) if json_strings else (lambda s: s)
    return template.replace("{version}", str(version)).replace("{path}", esc(path)).replace("{current}", esc(current))


@dataclass
class HookOutcome:
    """How a swap hook ended for ``version``: succeeded or not, after how many attempts, the last error,
    seconds."""

    version: int
    ok: bool
    attempts: int
    error: str | None
    seconds: float


@dataclass(frozen=True)
class HookRecord:
    """Where the hook call for ``version`` stands (``state``, one of :data:`HOOK_STATES`): tries so far,
    the last error, seconds since the call began, and when this was recorded (unix seconds)."""

    version: int
    state: str
    attempts: int = 0
    error: str | None = None
    seconds: float = 0.0
    time: float = 0.0

    @property
    def ok(self) -> bool | None:
        """True once it succeeded, False once a try failed (this call's, or the last call's for a call
        made while degraded), None while the first try runs."""
        return True if self.state == "ok" else None if self.state == "running" else False

    @property
    def degraded(self) -> bool:
        """Whether the engine may be on other weights than ``version`` (a try failed, or the call was cut off)."""
        return self.state in DEGRADED

    def to_doc(self) -> dict:
        """The status document's ``hook`` fields (``ok`` as before, and ``state``)."""
        return {**asdict(self), "ok": self.ok, "degraded": self.degraded}


def hook_path(target_dir: Path) -> Path:
    """``DIR/.weightsync/hook.json``: the subscriber's last hook record."""
    return Path(target_dir) / STATE_DIR / "hook.json"


def read_hook_record(target_dir: Path, store: str) -> HookRecord | None:
    """The hook record a subscriber of ``store`` left in ``target_dir`` (None: none, another store's, or
    damaged: a damaged record only loses what it said, the next swap writes a new one). A call that was
    still running is ``interrupted``: the process stopped before the engine confirmed the version."""
    try:
        doc = read_doc(hook_path(target_dir), "hook record")
    except UsageError as exc:
        event(log, "ignoring a damaged hook record", logging.WARNING, error=exc)
        return None
    if doc is None or doc.get("format") != _FORMAT or doc.get("store") != store:
        return None
    try:
        rec = HookRecord(
            int(doc["version"]), str(doc["state"]), int(doc["attempts"]), doc.get("error"), float(doc["seconds"]),
            float(doc["time"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError):
        event(log, "ignoring a damaged hook record", logging.WARNING, file=hook_path(target_dir))
        return None
    if rec.state not in HOOK_STATES:
        return None
    return replace(rec, state="interrupted") if rec.state in ("running", "retrying") else rec


def write_hook_record(target_dir: Path, store: str, rec: HookRecord, fsync: bool = True) -> None:
    """Store ``rec`` atomically in ``target_dir`` (read back by :func:`read_hook_record`)."""
    write_json_atomic(hook_path(target_dir), {"format": _FORMAT, "store": store, **asdict(rec)}, fsync)


class HookRunner:
    """Fires the configured hook with retries; ``on_failure()`` is called for every failed try and
    ``on_record(record)`` (a coroutine function) at every change of :attr:`record`."""

    def __init__(
        self,
        cfg: HookConfig,
        on_failure: Callable[[], None],
        on_record: Callable[[HookRecord], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.on_failure = on_failure
        self.on_record = on_record
        self.clock = clock
        self.last: HookOutcome | None = None
        self.record: HookRecord | None = None

    async def _set(self, rec: HookRecord) -> None:
        self.record = rec
        if self.on_record is not None:
            await self.on_record(rec)

    async def fire(
        self, version: int, path: str, current: str, superseded: Callable[[], bool] = lambda: False
    ) -> HookOutcome:
        """Run the hook for a swap to ``version`` (``path`` the slot, ``current`` the link), retrying as
        configured, one call at a time (module doc); a failure is logged and returned, never raised
        (cancellation aside). ``superseded()`` true (a newer swap wants the hook) ends the retries."""
        t0 = time.monotonic()
        error: str | None = None
        task: asyncio.Task | None = None
        attempt = 0
        timeout = self.cfg.timeout

        async def record(state: str) -> None:
            await self._set(HookRecord(version, state, attempt, error, round(time.monotonic() - t0, 3), self.clock()))

        # A call after one that did not succeed starts degraded, with that call's error: the engine is
        # known to be behind until this call succeeds (the state never flips to serving and back).
        if self.record is not None and self.record.degraded:
            error = self.record.error or f"the call for version {self.record.version} was {self.record.state}"
            await record("retrying")
        else:
            await record("running")
        try:
            while attempt < self.cfg.attempts:
                attempt += 1
                if task is None:
                    task = asyncio.ensure_future(self._once(version, path, current))
                done, _ = await asyncio.wait({task}, timeout=timeout)  # never cancels the call
                if not done:
                    error = f"no answer after {time.monotonic() - t0:.0f}s (--hook-timeout {timeout:g}s)"
                    self.on_failure()
                    last = attempt == self.cfg.attempts
                    event(
                        log,
                        "swap hook is slower than --hook-timeout; "
                        + ("abandoning it" if last else "waiting for its answer, no second call meanwhile"),
                        logging.WARNING,
                        version=version,
                        attempt=attempt,
                        seconds=f"{time.monotonic() - t0:.1f}",
                    )
                    await record("retrying")
                    continue
                exc, task = done.pop().exception(), None
                if exc is None:
                    error = None
                    self.last = HookOutcome(version, True, attempt, None, time.monotonic() - t0)
                    await record("ok")
                    event(
                        log, "swap hook done", version=version, attempts=attempt, seconds=f"{time.monotonic() - t0:.2f}"
                    )
                    return self.last
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self.on_failure()
                event(log, "swap hook failed", logging.WARNING, version=version, attempt=attempt, error=error)
                await record("retrying")
                if attempt < self.cfg.attempts:
                    if superseded():
                        break
                    await asyncio.sleep(self.cfg.backoff.delay(attempt))
                    if superseded():
                        break
        finally:
            if task is not None and not task.done():  # abandoned (or we are cancelled): end the call
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task
        gave_up = not superseded()
        self.last = HookOutcome(version, False, attempt, error, time.monotonic() - t0)
        await record("failed")
        event(
            log,
            "swap hook gave up: the engine may still serve older weights; POST /v1/hook runs it again"
            if gave_up
            else "swap hook stopped retrying: a newer swap fires it",
            logging.ERROR if gave_up else logging.WARNING,
            version=version,
            attempts=attempt,
            error=error,
        )
        return self.last

    async def _once(self, version: int, path: str, current: str) -> None:
        if self.cfg.url:
            await self._http(version, path, current)
        else:
            await self._command(version, path, current)

    async def _http(self, version: int, path: str, current: str) -> None:
        import aiohttp
        from multidict import CIMultiDict

        requests = self.cfg.requests()
        bodies = [render(r.body, version, path, current, json_strings=True) for r in requests]
        for body in bodies:
            json.loads(body)  # a template that does not render to JSON is a configuration error, reported per try
        # no session timeout of its own (aiohttp's is 5 minutes): --hook-timeout governs, see fire()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for r, body in zip(requests, bodies):  # in order; the first failure fails the try
                data = None if r.method == "GET" else body.encode()
                headers = CIMultiDict({} if data is None else {"Content-Type": "application/json"})
                for name, value in self.cfg.headers:  # the operator's (auth, ...): never logged; they may replace ours
                    headers.popall(name, None)
                headers.extend(self.cfg.headers)
                async with session.request(r.method, r.url, data=data, headers=headers) as resp:
                    if resp.status >= 300:
                        text = (await resp.text())[:200]
                        for _, value in self.cfg.headers:  # a server that echoes the request must not leak them
                            if value:
                                text = text.replace(value, "***")
                        step = f" {r.method} {r.url.rsplit('/', 1)[-1]}" if len(requests) > 1 else ""
                        raise RuntimeError(f"HTTP {resp.status} from hook{step}: {text}")

    async def _command(self, version: int, path: str, current: str) -> None:
        """Run the command in a session of its own and wait for it to exit, not for its stderr to end: a
        child it leaves in the background (a reload it starts, a ``curl`` without a timeout) may hold
        that pipe. Only the last :data:`STDERR_TAIL` bytes of stderr are kept. A call given up
        (the hook's timeout) kills the whole process group, its children with it."""
        argv = [render(a, version, path, current, json_strings=False) for a in self.cfg.command]
        env = dict(self.cfg.env, WEIGHTSYNC_VERSION=str(version), WEIGHTSYNC_PATH=path, WEIGHTSYNC_CURRENT=current)
        loop, tail = asyncio.get_running_loop(), bytearray()
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)

        def drain() -> None:
            with suppress(BlockingIOError):
                while chunk := os.read(rfd, 1 << 16):
                    tail.extend(chunk)
                    del tail[:-STDERR_TAIL]
                loop.remove_reader(rfd)  # end of file: every writer is gone

        loop.add_reader(rfd, drain)
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=wfd, start_new_session=True
                )
            finally:
                os.close(wfd)
            try:
                await proc.wait()
            except asyncio.CancelledError:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                raise
            drain()
        finally:
            loop.remove_reader(rfd)
            os.close(rfd)
        err = bytes(tail)
        if proc.returncode != 0:
            raise RuntimeError(
                f"hook command exited with {proc.returncode}: {err.decode(errors='replace')[-200:].strip()}"
            )
