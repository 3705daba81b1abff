"""Configuration of the publisher and subscriber daemons: frozen dataclasses validated on construction.

Built once at the entry point from command-line flags and the environment (:func:`publisher_config`,
:func:`subscriber_config`), then passed down. This module and ``cli.py`` are the only places that
read the environment; the one variable read is ``WEIGHTSYNC_API_TOKEN``.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .codec import CodecConfig
from .errors import UsageError
from .publishing import PublishConfig
from .store.retry import RetryPolicy

TOKEN_ENV = "WEIGHTSYNC_API_TOKEN"
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_HOOK_BODY = '{"version": {version}, "path": "{path}"}'


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UsageError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class ApiConfig:
    """Where the HTTP API listens (``port=None``: no HTTP server) and the bearer token, if any."""

    host: str = "127.0.0.1"
    port: int | None = None
    token: str | None = field(default=None, repr=False)  # never printed

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise UsageError(f"port must be in 0..65535, got {self.port}")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise UsageError("the API token must be non-empty and hold no whitespace")


@dataclass(frozen=True)
class Identity:
    """Who a daemon is, for metrics labels and the fleet ledger."""

    id: str
    region: str = ""
    cluster: str = ""

    def __post_init__(self) -> None:
        if not _ID_RE.match(self.id) or self.id in (".", ".."):
            raise UsageError(f"id must be 1-128 characters of A-Z a-z 0-9 . _ -, got {self.id!r}")


@dataclass(frozen=True)
class StoreConfig:
    url: str
    endpoint_url: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not self.url:
            raise UsageError("--store is empty")

    def options(self) -> dict:
        return {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}


@dataclass(frozen=True)
class LogConfig:
    json: bool = False
    level: str = "INFO"

    def __post_init__(self) -> None:
        if self.level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise UsageError(f"log level must be DEBUG, INFO, WARNING or ERROR, got {self.level!r}")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff between failed attempts: ``base * 2**(n-1)`` capped at ``maximum``."""

    base: float = 1.0
    maximum: float = 60.0

    def __post_init__(self) -> None:
        _positive("backoff", self.base)
        if self.maximum < self.base:
            raise UsageError("maximum backoff must be at least the base backoff")

    def delay(self, failures: int) -> float:
        return 0.0 if failures <= 0 else min(self.maximum, self.base * 2.0 ** min(failures - 1, 32))


@dataclass(frozen=True)
class PublisherConfig:
    store: StoreConfig
    watch_dir: Path
    state_dir: Path  # holds cache/ (the head version, a delta base of last resort)
    identity: Identity
    marker: str = "COMPLETE"
    poll_interval: float = 2.0
    stale_after: float = 3600.0  # an unfinished checkpoint older than this no longer blocks later ones
    publish: PublishConfig = field(default_factory=PublishConfig)
    publish_roots: tuple[Path, ...] = ()  # folders POST /v1/publish may read (besides watch_dir)
    backoff: Backoff = field(default_factory=Backoff)
    api: ApiConfig = field(default_factory=ApiConfig)
    log: LogConfig = field(default_factory=LogConfig)
    grace: float = 30.0  # seconds to let a publish in flight finish on SIGTERM
    rank: int | None = None  # rank mode: publish this rank's part of each version (weightsync.parts)
    world: int = 1  # ... of this many ranks
    commit: bool = False  # ... and merge and commit the version once every part is stored
    commit_timeout: float = 600.0  # seconds the committer waits for the other ranks' parts
    own_files: bool = False  # ... every file of the folder is this rank's (no shared listing)

    def __post_init__(self) -> None:
        _positive("poll interval", self.poll_interval)
        _positive("stale-after", self.stale_after)
        if not self.marker or "/" in self.marker or self.marker in (".", ".."):
            raise UsageError(f"marker must be a plain file name, got {self.marker!r}")
        from .parts import check_world

        check_world(self.rank, self.world)
        if self.rank is None and (self.world != 1 or self.commit or self.own_files):
            raise UsageError("--world, --commit and --own-files need --rank (the publisher's rank of the world)")
        if self.rank is not None:
            _positive("commit timeout", self.commit_timeout)
            if self.world == 1 and not self.commit:
                raise UsageError("--rank 0 --world 1 needs --commit: no other rank would commit its versions")


@dataclass(frozen=True)
class HookConfig:
    """What to run after each swap: an HTTP request (``url``) or a command (``command``), not both.

    ``body`` is a JSON template in which ``{version}``, ``{path}`` (the verified version folder) and
    ``{current}`` (the ``current`` symlink) are replaced; the command's arguments too. Each swap gets
    up to ``attempts`` tries, ``backoff`` apart (doubling), each bounded by ``timeout`` seconds.
    """

    url: str | None = None
    command: tuple[str, ...] = ()
    method: str = "POST"
    body: str = DEFAULT_HOOK_BODY
    attempts: int = 5
    backoff: Backoff = field(default_factory=lambda: Backoff(0.5, 10.0))
    timeout: float = 30.0
    env: Mapping[str, str] = field(default_factory=dict)  # the command's environment (secrets removed)

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.command):
            raise UsageError("a swap hook is either --hook-url or --hook-command")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise UsageError(f"hook URL must be http:// or https://, got {self.url!r}")
        if self.method not in ("POST", "PUT", "GET"):
            raise UsageError(f"hook method must be POST, PUT or GET, got {self.method!r}")
        if self.attempts < 1:
            raise UsageError("hook attempts must be at least 1")
        _positive("hook timeout", self.timeout)


@dataclass(frozen=True)
class SubscriberConfig:
    store: StoreConfig
    target_dir: Path
    identity: Identity
    poll_interval: float = 2.0
    pin: int | str | None = None  # start at this version, or "latest" (the head); None: the stored target
    include: tuple[str, ...] = ()  # glob patterns over tensor names: partial fetch when set
    exclude: tuple[str, ...] = ()
    hook: HookConfig | None = None
    ledger_interval: float = 30.0  # heartbeat of the fleet record (also written after each swap)
    fetch_concurrency: int = 32
    decode_threads: int = max(1, min(8, os.cpu_count() or 1))
    fsync: bool = True
    verify_before_swap: bool = False  # re-read the whole standby folder before each swap
    standby_hold: float | None = 30.0  # without a hook, refill the standby in place this long after a swap; None: never
    backoff: Backoff = field(default_factory=Backoff)
    api: ApiConfig = field(default_factory=ApiConfig)
    log: LogConfig = field(default_factory=LogConfig)
    grace: float = 30.0

    def __post_init__(self) -> None:
        _positive("poll interval", self.poll_interval)
        _positive("ledger interval", self.ledger_interval)
        if self.pin is not None and self.pin != "latest" and not (type(self.pin) is int and self.pin >= 0):
            raise UsageError(f"--version must be a non-negative version number or 'latest', not {self.pin!r}")
        if self.fetch_concurrency < 1 or self.decode_threads < 1:
            raise UsageError("concurrency must be positive")
        if self.standby_hold is not None and not self.standby_hold >= 0:
            raise UsageError(f"--standby-hold must be a number of seconds >= 0 or 'never', not {self.standby_hold}")

    @property
    def partial(self) -> bool:
        return bool(self.include or self.exclude)


# --- flags ---------------------------------------------------------------------------------------
def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    host = (host if sep else "").strip("[]") or "127.0.0.1"
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise UsageError(f"{flag} wants HOST:PORT with a port in 0..65535, got {text!r}")
    return host, int(port)


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="file:///abs/path, a plain path, or s3://bucket/prefix")
    p.add_argument("--endpoint-url", help="S3 endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)")
    p.add_argument("--listen", metavar="HOST:PORT", help="serve the HTTP API here (default: no HTTP server; host 127.0.0.1)")
    p.add_argument("--api-token-file", help=f"file holding the bearer token for /v1 (or set {TOKEN_ENV})")
    p.add_argument("--api-token", help=f"bearer token for /v1 (visible in ps; prefer {TOKEN_ENV})")
    p.add_argument("--id", help="this daemon's id (default: host name and a hash of its folder)")
    p.add_argument("--region", default="", help="region label for metrics and the fleet ledger")
    p.add_argument("--cluster", default="", help="cluster label for metrics and the fleet ledger")
    p.add_argument("--poll-interval", type=float, help="seconds between store checks")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--retry-attempts", type=int, default=5, help="attempts per store operation (default 5)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to let work in flight finish on SIGTERM")


def add_publisher_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--watch", required=True, help="folder whose subfolders (ending in a step number) are checkpoints")
    p.add_argument("--marker", default="COMPLETE", help="file that marks a checkpoint as ready (default COMPLETE)")
    p.add_argument("--state-dir", help="publisher state (default: ~/.local/state/weightsync/publisher-<store hash>)")
    p.add_argument("--stale-after", type=float, default=3600.0, help="seconds after which an unfinished checkpoint is skipped")
    p.add_argument("--publish-root", action="append", default=[], help="extra folder POST /v1/publish may read (repeatable)")
    p.add_argument("--keyframe-interval", type=int, default=20, help="a full snapshot every K versions (default 20)")
    p.add_argument("--chunk-mib", type=int, default=16, help="chunk size in MiB (default 16)")
    p.add_argument("--concurrency", type=int, default=32, help="chunks in flight (default 32)")
    p.add_argument("--fast-codec", action="store_true",
                   help="code deltas with 'sparse' (6-8x faster to encode, 10x to decode, ~1.5x larger) instead of the arithmetic coder")
    p.add_argument("--rank", type=int, help="publish only this rank's part of each version (with --world; "
                   "the safetensors files round-robin by sorted path, every other file on rank 0)")
    p.add_argument("--world", type=int, default=1, help="the number of rank publishers (default 1)")
    p.add_argument("--commit", action="store_true", help="with --rank: also merge and commit each version once all "
                   "its parts are stored (one rank, or several: they commit once)")
    p.add_argument("--commit-timeout", type=float, default=None,
                   help="with --commit: seconds to wait for the other ranks' parts (default 600)")
    p.add_argument("--own-files", action="store_true",
                   help="with --rank: every file of each checkpoint folder is this rank's (ranks with folders of their own)")


def add_subscriber_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--target", required=True, help="folder holding slots/a, slots/b and the current symlink")
    p.add_argument("--version", dest="pin", type=version_arg, metavar="N|latest",
                   help="start at this version (a pin), or 'latest' to follow the head; overrides the target "
                        "stored by PUT /v1/target (default: the stored target, else the head)")
    p.add_argument("--include", action="append", default=[], help="glob over tensor names to fetch (repeatable)")
    p.add_argument("--exclude", action="append", default=[], help="glob over tensor names to skip (repeatable)")
    p.add_argument("--hook-url", help="HTTP endpoint called after each swap")
    p.add_argument("--hook-method", default="POST", help="HTTP method of the hook (default POST)")
    p.add_argument("--hook-body", default=DEFAULT_HOOK_BODY, help="JSON template; {version}, {path}, {current} are replaced")
    p.add_argument("--hook-command", help="command run after each swap (split like a shell; same placeholders)")
    p.add_argument("--hook-attempts", type=int, default=5)
    p.add_argument("--hook-timeout", type=float, default=30.0)
    p.add_argument("--hook-backoff", type=float, default=0.5, help="first wait between hook attempts (doubles)")
    p.add_argument("--ledger-interval", type=float, default=30.0, help="seconds between fleet ledger heartbeats")
    p.add_argument("--concurrency", type=int, default=32, help="chunks in flight (default 32)")
    p.add_argument("--verify-before-swap", action="store_true", help="re-read the whole standby copy before each swap")
    p.add_argument("--standby-hold", type=hold_arg, default=30.0, metavar="SECONDS|never",
                   help="overwrite the standby slot's files in place (half the CPU of new files) once nothing reads "
                        "them: with a swap hook, once the hook of the latest swap succeeded; without one, this many "
                        "seconds after the swap; 'never': always write new files (default 30)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of written files (tests, tmpfs)")


# --- building configs ------------------------------------------------------------------------------
def _number_or(word: str, kind: type, noun: str, value_of_word):
    """An argparse type: a non-negative ``kind`` (``noun`` in errors), or ``word`` (giving ``value_of_word``)."""

    def parse(text: str):
        if text == word:
            return value_of_word
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants {noun} or {word!r}, not {text!r}") from None
        if not v >= 0:
            raise argparse.ArgumentTypeError(f"wants {noun} >= 0 or {word!r}, not {text!r}")
        return v

    return parse


hold_arg = _number_or("never", float, "seconds", None)  # --standby-hold: seconds, or never (None)
version_arg = _number_or("latest", int, "a version number", "latest")  # --version: N, or latest


def _token(args, environ: Mapping[str, str]) -> str | None:
    """The API token from ``--api-token-file``, ``--api-token`` or the environment, the first given;
    None if none is. One given but empty is refused: a missing secret must not turn auth off."""
    if getattr(args, "api_token_file", None) is not None:
        source = f"--api-token-file {args.api_token_file}"
        try:
            token = Path(args.api_token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"cannot read {source}: {exc.strerror}") from None
        except ValueError:  # not UTF-8
            raise UsageError(f"cannot read {source}: not a UTF-8 text file") from None
    elif getattr(args, "api_token", None) is not None:
        source, token = "--api-token", args.api_token
    elif TOKEN_ENV in environ:
        source, token = TOKEN_ENV, environ[TOKEN_ENV]
    else:
        return None
    if not token.strip():
        raise UsageError(f"{source} gives an empty API token: refusing to start without authentication "
                         f"(give a token, or none of --api-token-file, --api-token and {TOKEN_ENV})")
    return token


def _api(args, environ: Mapping[str, str]) -> ApiConfig:
    token = _token(args, environ)
    if args.listen is None:
        return ApiConfig(token=token)
    host, port = parse_listen(args.listen)
    return ApiConfig(host, port, token)


def _folder(flag: str, value: str) -> Path:
    """A folder flag's value, absolute; an empty one (an unset variable) is refused, not taken as the
    current folder (``--publish-root ''`` would let POST /v1/publish read anything under it)."""
    if not value.strip():
        raise UsageError(f"{flag} is empty")
    return Path(value).absolute()


def default_id(folder: Path) -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{xxhash.xxh3_64_hexdigest(str(folder.absolute()).encode())[:8]}"


def _store(args) -> StoreConfig:
    return StoreConfig(args.store, args.endpoint_url, RetryPolicy(attempts=args.retry_attempts))


def _state_home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "weightsync"


def _commit_timeout(args) -> float:
    if args.commit_timeout is not None and not args.commit:
        raise UsageError("--commit-timeout needs --commit (and --rank)")
    return 600.0 if args.commit_timeout is None else args.commit_timeout


def publisher_config(args, environ: Mapping[str, str] = os.environ) -> PublisherConfig:
    watch = _folder("--watch", args.watch)
    store_hash = xxhash.xxh3_64_hexdigest(str(args.store).encode())
    name = f"publisher-{store_hash}" + ("" if args.rank is None else f"-rank{args.rank}-of-{args.world}")  # ranks may share a host
    state = _folder("--state-dir", args.state_dir) if args.state_dir is not None else _state_home(environ) / name
    return PublisherConfig(
        store=_store(args),
        watch_dir=watch,
        state_dir=state,
        identity=Identity(args.id or default_id(watch), args.region, args.cluster),
        marker=args.marker,
        poll_interval=args.poll_interval or 2.0,
        stale_after=args.stale_after,
        publish=PublishConfig(
            chunk_bytes=args.chunk_mib << 20, keyframe_interval=args.keyframe_interval,
            upload_concurrency=args.concurrency, ignore=(args.marker,),
            codec=CodecConfig(entropy_coder=not args.fast_codec),
        ),
        publish_roots=tuple(_folder("--publish-root", p) for p in args.publish_root),
        api=_api(args, environ),
        log=LogConfig(args.log_json, args.log_level),
        grace=args.grace,
        rank=args.rank,
        world=args.world,
        commit=args.commit,
        commit_timeout=_commit_timeout(args),
        own_files=args.own_files,
    )


_SECRETISH = re.compile(r"SECRET|TOKEN|PASSWORD|CREDENTIAL|^AWS_", re.IGNORECASE)


def _hook(args, environ: Mapping[str, str]) -> HookConfig | None:
    if not args.hook_url and not args.hook_command:
        return None
    import shlex

    command = tuple(shlex.split(args.hook_command)) if args.hook_command else ()
    # a command hook inherits the environment minus anything that looks like a secret
    env = {k: v for k, v in environ.items() if not _SECRETISH.search(k)}
    return HookConfig(
        url=args.hook_url, command=command, method=args.hook_method.upper(), body=args.hook_body,
        attempts=args.hook_attempts, backoff=Backoff(args.hook_backoff, max(args.hook_backoff, 30.0)),
        timeout=args.hook_timeout, env=env,
    )


def subscriber_config(args, environ: Mapping[str, str] = os.environ) -> SubscriberConfig:
    target = _folder("--target", args.target)
    return SubscriberConfig(
        store=_store(args),
        target_dir=target,
        identity=Identity(args.id or default_id(target), args.region, args.cluster),
        poll_interval=args.poll_interval or 2.0,
        pin=args.pin,
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        hook=_hook(args, environ),
        ledger_interval=args.ledger_interval,
        fetch_concurrency=args.concurrency,
        fsync=not args.no_fsync,
        verify_before_swap=args.verify_before_swap,
        standby_hold=args.standby_hold,
        api=_api(args, environ),
        log=LogConfig(args.log_json, args.log_level),
        grace=args.grace,
    )
