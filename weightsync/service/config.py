"""The daemons' configuration: frozen dataclasses, validated on construction, built once at the
entry point (:mod:`weightsync.service.flags`) and passed down."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from weightsync.errors import UsageError
from weightsync.format.keys import ID_RE
from weightsync.store.retry import RetryPolicy
from weightsync.store.signing import Keyring
from weightsync.sync.lazy import MODES as LAZY_MODES
from weightsync.sync.pipeline import default_threads
from weightsync.sync.publish import PublishConfig

TOKEN_ENV = "WEIGHTSYNC_API_TOKEN"
DEFAULT_HOOK_BODY = '{"version": {version}, "path": "{path}"}'
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise UsageError(f"{name} must be positive, got {value}")


def _not_negative(name: str, value: float) -> None:
    if not value >= 0:  # (NaN too)
        raise UsageError(f"{name} must be a number of seconds >= 0, got {value}")


def _check_http_url(name: str, url: str) -> None:
    """``http(s)://host[:port]``, without path, query or credentials."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise UsageError(f"{name} must be a subscriber's API URL like http://host:8471, not {url!r}")


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
        if not ID_RE.match(self.id) or self.id in (".", ".."):
            raise UsageError(f"id must be 1-128 characters of A-Z a-z 0-9 . _ -, got {self.id!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Where the daemon's store is and how it is reached: URL, S3 endpoint, retry policy, the S3
    client's timeouts (seconds to connect, and to wait for each answer; None: the S3 backend's 10 and
    60), and the keys whose signatures it trusts (None: signatures are not checked)."""

    url: str
    endpoint_url: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    connect_timeout: float | None = None
    read_timeout: float | None = None
    trusted_keys: Keyring | None = None

    def __post_init__(self) -> None:
        if not self.url:
            raise UsageError("--store is empty")
        for name, value in (("--s3-connect-timeout", self.connect_timeout), ("--s3-read-timeout", self.read_timeout)):
            if value is not None and not value > 0:
                raise UsageError(f"{name} must be a number of seconds > 0, not {value:g}")

    def options(self) -> dict:
        """Keyword options for :func:`weightsync.store.open_store` (the timeouts for s3:// only)."""
        out = {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}
        if self.url.startswith("s3://"):
            out |= {
                k: v for k, v in (("connect_timeout", self.connect_timeout), ("read_timeout", self.read_timeout)) if v
            }
        return out


@dataclass(frozen=True)
class LogConfig:
    """Log format (``text`` or ``json``) and level."""

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
        """Seconds to wait after ``failures`` consecutive failed iterations."""
        return 0.0 if failures <= 0 else min(self.maximum, self.base * 2.0 ** min(failures - 1, 32))


@dataclass(frozen=True)
class PublisherConfig:
    """Everything the publisher daemon runs with, validated: the watched folder and marker, the
    store, encoding, ranks, the API, logging and back-off."""

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
    stall_after: float = 60.0  # a store request running longer than this is reported (weightsync.service.stalls)
    rank: int | None = None  # rank mode: publish this rank's part of each version (weightsync.sync.parts)
    world: int = 1  # ... of this many ranks
    commit: bool = False  # ... and merge and commit the version once every part is stored
    commit_timeout: float = 600.0  # seconds the committer waits for the other ranks' parts
    own_files: bool = False  # ... every file of the folder is this rank's (no shared listing)

    def __post_init__(self) -> None:
        _positive("poll interval", self.poll_interval)
        _not_negative("--grace", self.grace)
        _positive("stale-after", self.stale_after)
        _positive("--stall-after", self.stall_after)
        if not self.marker or "/" in self.marker or self.marker in (".", ".."):
            raise UsageError(f"marker must be a plain file name, got {self.marker!r}")
        from weightsync.sync.parts import check_world

        check_world(self.rank, self.world)
        if self.rank is None and (self.world != 1 or self.commit or self.own_files):
            raise UsageError("--world, --commit and --own-files need --rank (the publisher's rank of the world)")
        if self.rank is not None:
            _positive("commit timeout", self.commit_timeout)
            if self.world == 1 and not self.commit:
                raise UsageError("--rank 0 --world 1 needs --commit: no other rank would commit its versions")


@dataclass(frozen=True)
class HookRequest:
    """One HTTP request of a swap hook: its method, URL (a preset's: a path after the hook URL) and
    JSON body template."""

    method: str
    url: str
    body: str


# Engines that reload from disk, as --hook-preset NAME: the requests, in order, after the engine's
# base URL (--hook-url http://127.0.0.1:30000). docs/ENGINES.md says what each needs.
HOOK_PRESETS: dict[str, tuple[HookRequest, ...]] = {
    # SGLang http_server.py: POST /update_weights_from_disk (UpdateWeightFromDiskReqInput: model_path,
    # load_format, abort_all_requests, weight_version, ...); 200, or 400 with "success": false
    "sglang": (
        HookRequest("POST", "/update_weights_from_disk", '{"model_path": "{path}", "weight_version": "{version}"}'),
    ),
    # vLLM with VLLM_SERVER_DEV_MODE=1 (entrypoints/serve/dev): /collective_rpc runs every worker's
    # reload_weights(weights_path=...), which reads the folder and re-runs the post-load processing;
    # /reset_prefix_cache then drops the KV blocks computed with the old weights
    "vllm": (
        HookRequest("POST", "/collective_rpc", '{"method": "reload_weights", "kwargs": {"weights_path": "{path}"}}'),
        HookRequest("POST", "/reset_prefix_cache", "{}"),
    ),
}


@dataclass(frozen=True)
class HookConfig:
    """What to run after each swap: an HTTP request (``url``) or a command (``command``), not both.

    ``body`` is a JSON template in which ``{version}``, ``{path}`` (the verified version folder) and
    ``{current}`` (the ``current`` symlink) are replaced; the command's arguments too. ``preset``
    (a key of :data:`HOOK_PRESETS`): an engine's own requests, after ``url``, the engine's base URL,
    instead of one request with ``method`` and ``body``. Each swap gets up to ``attempts`` tries
    (all the requests, in order), ``backoff`` apart (doubling); a try past ``timeout`` seconds counts
    as failed but is waited for (calls never overlap), and abandoned after ``attempts`` such periods.
    """

    url: str | None = None
    command: tuple[str, ...] = ()
    method: str = "POST"
    body: str = DEFAULT_HOOK_BODY
    attempts: int = 5
    backoff: Backoff = field(default_factory=lambda: Backoff(0.5, 10.0))
    timeout: float = 600.0  # a large model's reload from disk takes minutes
    env: Mapping[str, str] = field(default_factory=dict)  # the command's environment (secrets removed)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # sent with the HTTP request; never printed
    preset: str | None = None

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.command):
            raise UsageError("a swap hook is either --hook-url or --hook-command")
        if self.preset is not None:
            if self.preset not in HOOK_PRESETS:
                raise UsageError(f"hook preset must be one of {', '.join(HOOK_PRESETS)}, not {self.preset!r}")
            if not self.url:
                raise UsageError(f"--hook-preset {self.preset} needs --hook-url, the engine's base URL")
            if (self.method, self.body) != ("POST", DEFAULT_HOOK_BODY):
                raise UsageError(
                    f"--hook-preset {self.preset} sets the method and body: drop --hook-method/--hook-body"
                )
            first = HOOK_PRESETS[self.preset][0].url
            if self.url.rstrip("/").endswith(first):
                raise UsageError(f"--hook-url with --hook-preset is the engine's base URL, without {first}")
        if self.headers and not self.url:
            raise UsageError("hook headers go with an HTTP hook (--hook-url), not a command")
        for name, value in self.headers:
            if not _HEADER_NAME.match(name) or any(c in value for c in "\r\n\0"):
                raise UsageError(f"hook header {name[:40]!r}: not a valid HTTP header (its value is not shown)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise UsageError(f"hook URL must be http:// or https://, got {self.url!r}")
        if self.method not in ("POST", "PUT", "GET"):
            raise UsageError(f"hook method must be POST, PUT or GET, got {self.method!r}")
        if self.attempts < 1:
            raise UsageError("hook attempts must be at least 1")
        _positive("hook timeout", self.timeout)

    def requests(self) -> tuple[HookRequest, ...]:
        """The HTTP requests of one try, in order (none for a command hook)."""
        if not self.url:
            return ()
        if self.preset is None:
            return (HookRequest(self.method, self.url, self.body),)
        base = self.url.rstrip("/")
        return tuple(HookRequest(r.method, base + r.url, r.body) for r in HOOK_PRESETS[self.preset])


@dataclass(frozen=True)
class SubscriberConfig:
    """Everything the subscriber daemon runs with, validated: the target folder and slots, the store,
    the version to follow, selection, standby refills, hooks, the API, logging and back-off."""

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
    decode_threads: int = field(default_factory=default_threads)
    fsync: bool = True
    verify_before_swap: bool = False  # re-read the whole standby folder before each swap
    standby_hold: float | None = 30.0  # without a hook, refill the standby in place this long after a swap; None: never
    engine_timeout: float = 30.0  # drop an engine rank that sent nothing for this long
    engine_phase_timeout: float = 600.0  # each phase of an engine transaction (prepare, apply) ends by then
    backoff: Backoff = field(default_factory=Backoff)
    api: ApiConfig = field(default_factory=ApiConfig)
    log: LogConfig = field(default_factory=LogConfig)
    grace: float = 30.0
    stall_after: float = 60.0  # a store request running longer than this is reported (weightsync.service.stalls)
    head_from: str | None = None  # a leader subscriber's API: wait on its GET /v1/head between polls
    lazy_chunks: str = "auto"  # chunks the store has not copied yet: rebuild, fallback or auto (weightsync.sync.lazy)
    fallback: StoreConfig | None = None  # the store they are read from (--fallback-store)

    def __post_init__(self) -> None:
        if self.identity.id.startswith("."):  # its fleet record would be a hidden file: a file store lists none
            raise UsageError(
                f"a subscriber's id must not start with '.' (a file store hides its fleet record): {self.identity.id!r}"
            )
        if self.lazy_chunks not in LAZY_MODES:
            raise UsageError(f"--lazy-chunks must be one of {', '.join(LAZY_MODES)}, not {self.lazy_chunks!r}")
        if self.lazy_chunks == "fallback" and self.fallback is None:
            raise UsageError("--lazy-chunks fallback needs --fallback-store (a store holding the same versions)")
        _positive("poll interval", self.poll_interval)
        _not_negative("--grace", self.grace)
        _positive("ledger interval", self.ledger_interval)
        if self.head_from is not None:
            _check_http_url("--head-from", self.head_from)
        _positive("--stall-after", self.stall_after)
        _positive("engine timeout", self.engine_timeout)
        _positive("engine phase timeout", self.engine_phase_timeout)
        if self.pin is not None and self.pin != "latest" and not (type(self.pin) is int and self.pin >= 0):
            raise UsageError(f"--version must be a non-negative version number or 'latest', not {self.pin!r}")
        if self.fetch_concurrency < 1 or self.decode_threads < 1:
            raise UsageError("concurrency must be positive")
        if self.standby_hold is not None and not self.standby_hold >= 0:
            raise UsageError(f"--standby-hold must be a number of seconds >= 0 or 'never', not {self.standby_hold}")

    @property
    def partial(self) -> bool:
        """Whether the slots hold selected tensors only (``--include``/``--exclude``)."""
        return bool(self.include or self.exclude)
