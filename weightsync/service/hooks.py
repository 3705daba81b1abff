"""Swap hooks: tell the serving process that ``current`` now points at a new version.

A hook is an HTTP request (a JSON body rendered from a template, with the configured headers, e.g.
``Authorization``, whose values are never logged), an engine's preset requests in order (SGLang's
and vLLM's reload from disk, :data:`~weightsync.service.config.HOOK_PRESETS`) or a command. Each swap fires the
hook once, with up to ``attempts`` tries and doubling backoff; every failed try is logged and
counted, and the outcome is kept for the status endpoint. A hook never affects what ``current``
points at: the swap has already happened, atomically, before the hook runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from weightsync.service.config import HookConfig
from weightsync.service.runtime import event

log = logging.getLogger("weightsync.hooks")


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


class HookRunner:
    """Fires the configured hook with retries; ``on_failure()`` is called for every failed try."""

    def __init__(self, cfg: HookConfig, on_failure: Callable[[], None]):
        self.cfg = cfg
        self.on_failure = on_failure
        self.last: HookOutcome | None = None

    async def fire(self, version: int, path: str, current: str) -> HookOutcome:
        """Run the hook for a swap to ``version`` (``path`` the slot, ``current`` the link), retrying as
        configured; a failure is logged and returned, never raised (cancellation aside)."""
        t0 = time.monotonic()
        error = None
        for attempt in range(1, self.cfg.attempts + 1):
            try:
                await asyncio.wait_for(self._once(version, path, current), self.cfg.timeout)
                self.last = HookOutcome(version, True, attempt, None, time.monotonic() - t0)
                event(log, "swap hook done", version=version, attempts=attempt)
                return self.last
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of the hook is reported, counted and retried
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self.on_failure()
                event(log, "swap hook failed", logging.WARNING, version=version, attempt=attempt, error=error)
            if attempt < self.cfg.attempts:
                await asyncio.sleep(self.cfg.backoff.delay(attempt))
        self.last = HookOutcome(version, False, self.cfg.attempts, error, time.monotonic() - t0)
        event(log, "swap hook gave up", logging.ERROR, version=version, attempts=self.cfg.attempts, error=error)
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
        async with aiohttp.ClientSession() as session:
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
        argv = [render(a, version, path, current, json_strings=False) for a in self.cfg.command]
        env = dict(self.cfg.env, WEIGHTSYNC_VERSION=str(version), WEIGHTSYNC_PATH=path, WEIGHTSYNC_CURRENT=current)
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        try:
            _, err = await proc.communicate()
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(
                f"hook command exited with {proc.returncode}: {err.decode(errors='replace')[-200:].strip()}"
            )
