"""Start and stop a real Prometheus (Debian's ``prometheus`` package) for integration tests.

    server = PrometheusServer(tmp_dir, config=lambda own_address: {...prometheus.yml as a dict...})
    server.start()                      # picks a free port on 127.0.0.1, retries if it was taken
    server.query("up")                  # the result list of GET /api/v1/query
    server.stop()

The config is built once the port is known (a scrape job of Prometheus itself needs it) and written
next to the TSDB folder. Prometheus runs in its own process group and with ``PR_SET_PDEATHSIG``, so
a crashed or killed test run leaves no orphan server behind; ``stop`` ends the whole group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

# The launcher makes the kernel send SIGTERM to Prometheus when the thread that started it dies
# (an exec wrapper rather than preexec_fn, which is unsafe in a process with threads).
_LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent died before prometheus started")
os.execv(sys.argv[2], sys.argv[2:])
"""
_BIND_FAILED = "address already in use"


def prometheus_binary() -> str | None:
    """Path of the ``prometheus`` binary (Debian package ``prometheus``), or None if missing."""
    return shutil.which("prometheus")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusError(RuntimeError):
    """Prometheus did not start, or its HTTP API answered with an error."""


class PrometheusServer:
    """One ``prometheus`` process with its own TSDB folder, config file, log and port."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        config: Callable[[str], dict],
        *,
        startup_timeout: float = 30.0,
        attempts: int = 5,
    ):
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError("prometheus binary not found (apt-get install prometheus)")
        self.binary, self.base_dir, self.config = binary, Path(base_dir), config
        self.startup_timeout, self.attempts = startup_timeout, attempts
        self.config_path = self.base_dir / "prometheus.yml"
        self.log_path = self.base_dir / "prometheus.log"
        self.address, self.url = "", ""
        self._proc: subprocess.Popen | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> PrometheusServer:
        """Start on a free port (another one if it was taken meanwhile) and wait for ``/-/ready``."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(self.attempts):
            self.address = f"127.0.0.1:{free_port()}"
            self.url = f"http://{self.address}"
            self.config_path.write_text(yaml.safe_dump(self.config(self.address), sort_keys=False))
            seen = len(self.log())
            self._spawn()
            try:
                if self._wait_ready(seen):
                    return self
            except BaseException:
                self.stop()
                raise
        raise PrometheusError(f"no free port after {self.attempts} attempts:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout`` seconds."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                continue
        proc.wait()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- HTTP API ----------------------------------------------------------------------------

    def api(self, path: str, **params) -> object:
        """``data`` of ``GET /api/v1/<path>``; raises :class:`PrometheusError` unless status is success."""
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"GET {url}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """The result of an instant query (vector, or a one-element list for a scalar)."""
        data = self.api("query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    # -- internals ---------------------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def _spawn(self) -> None:
        argv = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.base_dir / 'data'}",
            f"--web.listen-address={self.address}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait_ready(self, seen: int) -> bool:
        """True once ``/-/ready`` answers 200; False if the port was taken (the process is gone)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                if _BIND_FAILED in self.log()[seen:]:
                    return False
                raise PrometheusError(f"prometheus exited during startup:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return True
            except OSError:  # not listening yet, or 503 while starting
                pass
            time.sleep(0.1)
        raise PrometheusError(f"prometheus not ready after {self.startup_timeout}s:\n{self.log_tail()}")
