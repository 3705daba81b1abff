"""The daemons' and commands' flags, each defined once, with ``WEIGHTSYNC_<FLAG>`` environment
defaults (the command line wins), and the builders of :mod:`weightsync.service.config` from them.
This module and ``cli.py`` are the only readers of the environment."""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from weightsync.codec.payload import CODERS, CodecConfig
from weightsync.errors import UsageError
from weightsync.service.config import (
    DEFAULT_HOOK_BODY,
    HOOK_PRESETS,
    TOKEN_ENV,
    ApiConfig,
    Backoff,
    HookConfig,
    Identity,
    LogConfig,
    PublisherConfig,
    StoreConfig,
    SubscriberConfig,
)
from weightsync.store.retry import RetryPolicy
from weightsync.store.signing import Keyring, SigningKey, read_public_keys, read_signing_key
from weightsync.sync.lazy import MODES as LAZY_MODES
from weightsync.sync.publish import PublishConfig

# --- environment defaults (12-factor) --------------------------------------------------------------
ENV_PREFIX = "WEIGHTSYNC_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
LIST_SEPARATORS = {",": "comma-separated", os.pathsep: f"{os.pathsep!r}-separated like PATH", "\n": "one per line"}


def env_var(flag: str) -> str:
    """The environment variable of a flag: ``--poll-interval`` -> ``WEIGHTSYNC_POLL_INTERVAL``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class _FromEnv:
    """An argument's default as found in the environment: converted (and checked) by
    :class:`EnvParser` once the command line is parsed, so that a bad value only stops the command
    that uses it, with a one-line error naming the variable."""

    var: str
    raw: str = field(repr=False)  # may be a secret


class _EnvAppend(argparse._AppendAction):
    """``action="append"`` whose flags replace a list taken from the environment instead of extending it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(getattr(namespace, self.dest, None), _FromEnv):
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def number(text: str) -> float:
    """``float(text)``, but not NaN."""
    out = float(text)
    if math.isnan(out):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    return out


_INTEGER = re.compile(r"[ \t]*[+-]?[0-9]+[ \t]*")


def integer(text: str) -> int:
    """``int(text)`` of ASCII digits only (``int`` takes ``٣`` and ``1_000``)."""
    if not _INTEGER.fullmatch(text):
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


def parse_bool(text: str) -> bool:
    """1/0, true/false, yes/no, on/off (any case, surrounding blanks ignored)."""
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise argparse.ArgumentTypeError(f"wants one of {'/'.join(_TRUE + _FALSE)}")


class EnvParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose arguments may take their defaults from the environment
    (:func:`env_argument`); the command line always wins. Subcommand parsers inherit the class.
    A ``float`` argument refuses NaN (every comparison with it is false: a wait without end, an age
    that is never young); an ``int`` one takes ASCII digits only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", float, number)
        self.register("type", int, integer)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, then the environment defaults and their sources are resolved (see :func:`env_argument`)."""
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(namespace, action.dest, None)
            if isinstance(value, _FromEnv):
                setattr(namespace, action.dest, self._from_env(action, value))
                namespace._env_sources = {**getattr(namespace, "_env_sources", {}), action.dest: value.var}
        return namespace, extras

    def _from_env(self, action: argparse.Action, value: _FromEnv):
        try:
            if isinstance(action, argparse._StoreTrueAction):
                return parse_bool(value.raw)
            if isinstance(action, _EnvAppend):
                items = [item.strip() for item in value.raw.split(action.env_sep)]
                return [self._convert(action, item) for item in items if item]
            return self._convert(action, value.raw)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            flag = action.option_strings[0]
            self.exit(2, f"weightsync: error: {value.var}={value.raw!r} (the default of {flag}): {exc}\n")

    @staticmethod
    def _convert(action: argparse.Action, text: str):
        if action.type is None:
            out = text
        else:
            try:
                out = {float: number, int: integer}.get(action.type, action.type)(text)  # the registered types
            except (TypeError, ValueError) as exc:
                words = {int: "not an integer", float: "not a number"}
                raise argparse.ArgumentTypeError(words.get(action.type, str(exc))) from None
        if action.choices is not None and out not in action.choices:
            raise ValueError(f"wants one of {', '.join(map(str, action.choices))}")
        return out

    def error(self, message: str):
        """argparse's error; a missing required flag also names its variable."""
        for action in self._actions:
            var = getattr(action, "env_var", None)
            if var and action.required and action.option_strings:
                flag = "/".join(action.option_strings)
                message = message.replace(flag, f"{flag} (or {var})")
        super().error(message)


def env_argument(
    p: argparse.ArgumentParser, environ: Mapping[str, str] | None, *flags: str, sep: str | None = None, **kwargs
) -> argparse.Action:
    """``p.add_argument(*flags, **kwargs)`` with the default ``WEIGHTSYNC_<FLAG>`` from ``environ``.

    ``environ`` None: a plain argument (a command that reads no environment). Otherwise the help
    says the variable, and a variable that is set replaces the default (a required flag becomes
    optional). Its value is read like the flag's: by the argument's ``type`` and ``choices``; for a
    boolean flag (``store_true``) one of 1/0/true/false/yes/no/on/off; for a repeatable flag
    (``append``) a list, split at ``sep`` (items stripped, empty ones dropped). Only values that
    fail a type or a choice are shown in errors: secrets (the token, hook headers) have neither.
    """
    if environ is None:
        return p.add_argument(*flags, **kwargs)
    if not isinstance(p, EnvParser):
        raise TypeError("environment defaults need an EnvParser")
    var = env_var(next(f for f in flags if f.startswith("--")))
    if kwargs.get("action") == "append":
        if sep not in LIST_SEPARATORS:
            raise ValueError(f"a list flag needs a separator, one of {list(LIST_SEPARATORS)}")
        kwargs["action"] = _EnvAppend
    where = f"env {var}" + (f", {LIST_SEPARATORS[sep]}" if sep else "")
    kwargs["help"] = f"{kwargs['help']} ({where})" if kwargs.get("help") else f"({where})"
    if var in environ:
        kwargs["default"] = _FromEnv(var, environ[var])
        kwargs["required"] = False
    action = p.add_argument(*flags, **kwargs)
    action.env_var, action.env_sep = var, sep
    return action


def env_sources(args) -> dict[str, str]:
    """dest -> variable of the arguments whose value came from the environment."""
    return getattr(args, "_env_sources", {})


def _source(args, dest: str, flag: str) -> str:
    """How to name an argument in an error: its variable if the value came from there, else its flag."""
    return env_sources(args).get(dest, flag)


def env_arguments(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(variable, flag, command, help) of every argument with an environment default, in parser order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(var, flag, f"{name} {cmd}".strip(), text) for var, flag, cmd, text in env_arguments(sub)]
        elif getattr(action, "env_var", None):
            out.append((action.env_var, "/".join(action.option_strings), "", action.help or ""))
    return out


# --- flags ---------------------------------------------------------------------------------------
def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    host = (host if sep else "").strip("[]") or "127.0.0.1"
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise UsageError(f"{flag} wants HOST:PORT with a port in 0..65535, got {text!r}")
    return host, int(port)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """``--log-json`` and ``--log-level``, for every long-running process (the daemons, the mirror)."""
    env_argument(p, environ, "--log-json", action="store_true", help="log one JSON object per line")
    env_argument(
        p,
        environ,
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="the least severe messages logged (default INFO)",
    )


def _common_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None) -> None:
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add("--store", required=True, help="file:///abs/path, a plain path, or s3://bucket/prefix")
    add("--endpoint-url", help="S3 endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)")
    add("--listen", metavar="HOST:PORT", help="serve the HTTP API here (default: no HTTP server; host 127.0.0.1)")
    add("--api-token-file", help="file holding the bearer token for /v1")
    add("--api-token", help="bearer token for /v1 (the flag is visible in ps: prefer the variable or a file)")
    add("--id", help="this daemon's id (default: host name and a hash of its folder)")
    add("--region", default="", help="region label for metrics and the fleet ledger")
    add("--cluster", default="", help="cluster label for metrics and the fleet ledger")
    add(
        "--poll-interval",
        type=float,
        default=2.0,
        help="seconds between store checks, > 0 (default 2; 0 is refused: it would poll the store without pause)",
    )
    add_log_args(p, environ)
    add("--retry-attempts", type=int, default=5, help="attempts per store operation (default 5)")
    add_store_watch_args(p, environ)
    add("--grace", type=float, default=30.0, help="seconds to let work in flight finish on SIGTERM (default 30)")


S3_CONNECT_TIMEOUT, S3_READ_TIMEOUT = 10.0, 60.0  # S3Options' defaults (not imported: botocore is slow to load)


def add_store_watch_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The S3 client's timeouts and ``--stall-after``, for every long-running process (the daemons, the
    mirror): how long a request to a hung store may wait, and when it is reported."""
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add(
        "--s3-connect-timeout",
        type=float,
        default=S3_CONNECT_TIMEOUT,
        help=f"seconds to connect to an S3 endpoint before the attempt fails and is retried "
        f"(default {S3_CONNECT_TIMEOUT:g})",
    )
    add(
        "--s3-read-timeout",
        type=float,
        default=S3_READ_TIMEOUT,
        help=f"seconds an S3 request may wait for the next bytes of its answer before the attempt fails and is "
        f"retried (default {S3_READ_TIMEOUT:g})",
    )
    add(
        "--stall-after",
        type=float,
        default=60.0,
        help="seconds after which a store request still running (retries included) is logged, shown in "
        "/v1/status as stalled and counted in weightsync_store_stalled_requests (default 60)",
    )


def store_timeouts(args) -> dict:
    """``connect_timeout`` and ``read_timeout`` of a :class:`StoreConfig` from :func:`add_store_watch_args`."""
    return {"connect_timeout": args.s3_connect_timeout, "read_timeout": args.s3_read_timeout}


def add_encoding_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """How versions are cut and coded: one definition for ``publish``, ``publish-part`` and the
    publisher daemon (ranks of one multi-rank publish must agree on them)."""
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add("--keyframe-interval", type=int, default=20, help="a full snapshot every K versions (default 20)")
    add("--chunk-mib", type=int, default=16, help="chunk size in MiB (default 16)")
    add(
        "--level",
        type=int,
        default=CodecConfig.level,
        help=f"zstd level of the 'sparse' and 'dense' delta streams, with min_match 7 and hash_log 10 "
        f"(default {CodecConfig.level})",
    )
    add(
        "--entropy-coder",
        choices=CODERS,
        default=CodecConfig.coder,
        help="the entropy coder of deltas: 'ans' (default; decodes at 0.65-1.06x the speed of 'sparse', by CPU) or "
        "'ac' (payloads 0.96x the size at lr 1e-6, 1.02x at 1e-5; 2.8-10.4x slower to encode and decode, by CPU; "
        "docs/DESIGN.md)",
    )
    add(
        "--fast-codec",
        action="store_true",
        help="code deltas with 'sparse' instead of the entropy coder: 1.0-1.6x faster to encode than 'ans' "
        "(0.90-1.26x where pdep is fast), faster to decode only where pdep is slow (1.3-1.7x; within -8%% to +5%% "
        "where it is fast), ~1.5x larger",
    )
    add("--concurrency", type=int, default=32, help="chunks in flight (default 32)")
    add(
        "--ignore",
        action="append",
        default=[],
        metavar="GLOB",
        sep=",",
        help="do not publish files whose relative path matches (repeatable), e.g. COMPLETE",
    )


def add_rank_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None, *, required: bool) -> None:
    """``--rank`` and ``--world`` of a multi-rank publish (``publish-part``: both required; the
    publisher: rank mode when ``--rank`` is given)."""
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add(
        "--rank",
        type=int,
        required=required,
        help="this process's rank, 0..W-1"
        + (
            ""
            if required
            else ": publish only this rank's part of each version "
            "(the safetensors files round-robin by sorted path, every other file on rank 0)"
        ),
    )
    add(
        "--world",
        type=int,
        required=required,
        default=None if required else 1,
        help="W, the number of ranks publishing each version" + ("" if required else " (default 1)"),
    )


SIGNING_HELP = (
    "sign every version committed with this Ed25519 private key (weightsync keygen; readers that trust its "
    "public key refuse versions it did not sign; a head it did not sign gets a keyframe, not a delta)"
)


def add_signing_args(
    p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None, help: str = SIGNING_HELP
) -> None:
    """``--signing-key``: for the commands that commit versions (``publish``, ``commit-parts``, the
    publisher) and the ranks of a signed multi-rank publish (``publish-part``)."""
    env_argument(p, environ, "--signing-key", metavar="FILE", help=help)


def add_trust_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """``--trusted-key``: for the commands that read versions (``pull``, ``verify``, the subscriber, the mirror)."""
    env_argument(
        p,
        environ,
        "--trusted-key",
        action="append",
        default=[],
        sep=os.pathsep,
        metavar="FILE",
        help="use only versions signed by a key of this public key file (repeatable: the old and the new key "
        "while rotating; default: signatures are not checked)",
    )


def add_lazy_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """``--lazy-chunks`` and ``--fallback-store``: for the commands that read chunks (``pull``, the
    subscriber) from a regional store whose mirror copies keyframe full payloads lazily."""
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add(
        "--lazy-chunks",
        choices=LAZY_MODES,
        default="auto",
        help="how to read chunks this store notes as not copied yet (a mirror copying keyframe full payloads "
        "lazily): rebuild (from an older keyframe the store holds whole, plus deltas), fallback (from "
        "--fallback-store), or auto: rebuild what can be, the fallback store for the rest (default auto)",
    )
    add(
        "--fallback-store",
        metavar="URL",
        help="a store holding the same versions (e.g. the source region), read only for chunks this store "
        "has not copied yet, each checked against its id (default: none)",
    )
    add("--fallback-endpoint-url", help="S3 endpoint of --fallback-store (default: --endpoint-url's)")


def fallback_store(args) -> StoreConfig | None:
    """The :class:`StoreConfig` of ``--fallback-store`` (None if not given): ``--endpoint-url`` unless
    ``--fallback-endpoint-url``, the retries and timeouts of the main store, no trusted keys (only
    chunks are read from it, each checked against the main store's manifest)."""
    url = getattr(args, "fallback_store", None)
    if url is None:
        return None
    if not url.strip():
        raise UsageError(f"{_source(args, 'fallback_store', '--fallback-store')} is empty")
    endpoint = getattr(args, "fallback_endpoint_url", None) or getattr(args, "endpoint_url", None)
    attempts = getattr(args, "retry_attempts", None)
    retry = RetryPolicy() if attempts is None else RetryPolicy(attempts=attempts)
    return StoreConfig(url, endpoint, retry, **(store_timeouts(args) if hasattr(args, "s3_read_timeout") else {}))


def signing_key(args) -> SigningKey | None:
    """The key of ``--signing-key`` (or its variable), read once at start; None if not given. One
    given but empty (a missing secret) is refused, never taken as "do not sign"."""
    path = getattr(args, "signing_key", None)
    if path is None:
        return None
    source = _source(args, "signing_key", "--signing-key")
    if not path.strip():
        raise UsageError(f"{source} is empty: refusing to publish unsigned versions (give a key file, or no {source})")
    try:
        return read_signing_key(path)
    except UsageError as exc:
        raise UsageError(f"{source}: {exc}") from None


def trusted_keys(args) -> Keyring | None:
    """The keys of every ``--trusted-key`` file (or of its variable); None if none is given (no
    checks). A variable that is set but names no file (a missing secret) is refused: it must not
    turn the checks off."""
    paths = getattr(args, "trusted_key", None) or []
    source = _source(args, "trusted_key", "--trusted-key")
    if not paths:
        if "trusted_key" in env_sources(args):
            raise UsageError(
                f"{source} is set but names no key file: refusing to run without signature checks (unset it to "
                "run without)"
            )
        return None
    keys = []
    for path in paths:
        if not path.strip():
            raise UsageError(f"{source} names an empty path")
        try:
            keys += read_public_keys(path)
        except UsageError as exc:
            raise UsageError(f"{source}: {exc}") from None
    return Keyring.of(keys)


def publish_config(args, ignore: tuple[str, ...] = ()) -> PublishConfig:
    """The :class:`PublishConfig` of :func:`add_encoding_args`' flags (``ignore`` first, then
    ``--ignore``) and of ``--signing-key`` where the command has it."""
    return PublishConfig(
        codec=CodecConfig(level=args.level, entropy_coder=not args.fast_codec, coder=args.entropy_coder),
        chunk_bytes=args.chunk_mib << 20,
        keyframe_interval=args.keyframe_interval,
        upload_concurrency=args.concurrency,
        ignore=(*ignore, *args.ignore),
        signing_key=signing_key(args),
    )


def add_publisher_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The publisher daemon's flags; with ``environ`` (a mapping, possibly empty) each has an
    environment default (:func:`env_argument`)."""
    _common_args(p, environ)
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add("--watch", required=True, help="folder whose subfolders (ending in a step number) are checkpoints")
    add(
        "--marker",
        default="COMPLETE",
        help="file that marks a checkpoint as ready (default COMPLETE); left out of the version when empty, "
        "published with it when it has content (a checkpoint file written last)",
    )
    add("--state-dir", help="publisher state (default: ~/.local/state/weightsync/publisher-<store hash>)")
    add(
        "--stale-after",
        type=float,
        default=3600.0,
        help="seconds after which an unfinished checkpoint is skipped (default 3600)",
    )
    add(
        "--publish-root",
        action="append",
        default=[],
        sep=os.pathsep,
        help="extra folder POST /v1/publish may read (repeatable)",
    )
    add_encoding_args(p, environ)
    add_signing_args(p, environ)
    add_rank_args(p, environ, required=False)
    add(
        "--commit",
        action="store_true",
        help="with --rank: also merge and commit each version once all "
        "its parts are stored (one rank, or several: they commit once)",
    )
    add(
        "--commit-timeout",
        type=float,
        default=None,
        help="with --commit: seconds to wait for the other ranks' parts (default 600)",
    )
    add(
        "--own-files",
        action="store_true",
        help="with --rank: every file of each checkpoint folder is this rank's (ranks with folders of their own)",
    )


def add_subscriber_args(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The subscriber daemon's flags; ``environ`` as for :func:`add_publisher_args`."""
    _common_args(p, environ)
    add = lambda *flags, **kw: env_argument(p, environ, *flags, **kw)  # noqa: E731
    add("--target", required=True, help="folder holding slots/a, slots/b and the current symlink")
    add(
        "--version",
        dest="pin",
        type=version_arg,
        metavar="N|latest",
        help="start at this version (a pin), or 'latest' to follow the head; overrides the target "
        "stored by PUT /v1/target (default: the stored target, else the head)",
    )
    add("--include", action="append", default=[], sep=",", help="glob over tensor names to fetch (repeatable)")
    add("--exclude", action="append", default=[], sep=",", help="glob over tensor names to skip (repeatable)")
    add("--hook-url", help="HTTP endpoint called after each swap (with --hook-preset: the engine's base URL)")
    add(
        "--hook-preset",
        choices=tuple(HOOK_PRESETS),
        help="the reload requests of an engine: sglang (POST /update_weights_from_disk) or vllm (POST "
        "/collective_rpc reload_weights, then /reset_prefix_cache; needs VLLM_SERVER_DEV_MODE=1), "
        "sent to --hook-url; see docs/ENGINES.md",
    )
    add("--hook-method", help="HTTP method of the hook (default POST)")
    add(
        "--hook-header",
        action="append",
        default=[],
        sep="\n",
        metavar="'NAME: VALUE'",
        help="HTTP header sent with each hook request, e.g. 'Authorization: Bearer ...' (repeatable; "
        "values are never logged; prefer the variable to the flag, which ps shows)",
    )
    add(
        "--hook-body",
        help=f"JSON template in which {{version}} (the version swapped in), {{path}} (the folder of the slot "
        f"holding it) and {{current}} (the current symlink) are replaced (default {DEFAULT_HOOK_BODY})",
    )
    add("--hook-token-file", help="file holding a bearer token sent as 'Authorization: Bearer ...' to the hook")
    add(
        "--hook-token",
        help="bearer token sent to the hook (the flag is visible in ps: prefer the variable or a file)",
    )
    add("--hook-command", help="command run after each swap (split like a shell; same placeholders)")
    add(
        "--hook-attempts",
        type=int,
        default=5,
        help="tries of the hook per swap, each failure logged and counted (default 5); POST /v1/hook calls it again",
    )
    add(
        "--hook-timeout",
        type=float,
        default=600.0,
        help="seconds after which a try of the hook counts as failed (default 600, for a large model's reload); "
        "a try still running is waited for, never overlapped by another call, and abandoned after "
        "--hook-attempts such periods",
    )
    add(
        "--hook-backoff",
        type=float,
        default=0.5,
        help="first wait between hook attempts, doubling up to 30 s or this if longer (default 0.5)",
    )
    add(
        "--head-from",
        metavar="URL",
        help="a leader subscriber's API (http://host:8471) to wait on between polls instead of polling the "
        "store: one head poller per replica; the leader only says when to look (this subscriber then reads "
        "the head itself), and while it does not answer the store is polled (sent: this API's token)",
    )
    add("--ledger-interval", type=float, default=30.0, help="seconds between fleet ledger heartbeats (default 30)")
    add("--concurrency", type=int, default=32, help="chunks in flight (default 32)")
    add(
        "--verify-before-swap",
        action="store_true",
        help="re-read the whole standby copy before each swap (a copy that fails is rebuilt, never swapped in)",
    )
    add(
        "--standby-hold",
        type=hold_arg,
        default=30.0,
        metavar="SECONDS|never",
        help="overwrite the standby slot's files in place (half the CPU of new files) once nothing reads "
        "them: with a swap hook, once the hook of the latest swap succeeded; without one, this many "
        "seconds after the swap; 'never': always write new files (default 30)",
    )
    add(
        "--engine-timeout",
        type=float,
        default=30.0,
        help="seconds after which an engine rank that sent nothing (no poll) is dropped from its replica (default 30)",
    )
    add(
        "--engine-phase-timeout",
        type=float,
        default=600.0,
        help="seconds each phase of an engine transaction (every rank prepares, then applies) may take (default 600)",
    )
    add("--no-fsync", action="store_true", help="skip fsync of written files (tests, tmpfs)")
    add_trust_args(p, environ)
    add_lazy_args(p, environ)


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
version_arg = _number_or("latest", integer, "a version number", "latest")  # --version: N, or latest


def new_version_arg(text: str) -> int:
    """A publish's ``--version``: a version number (``latest`` names none to publish)."""
    try:
        v = integer(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"wants a version number >= 0, not {text!r}")
    return v


def _token(args, environ: Mapping[str, str]) -> str | None:
    """The API token from ``--api-token-file`` or ``--api-token``, the first given, flags before
    their variables (``WEIGHTSYNC_API_TOKEN_FILE``, ``WEIGHTSYNC_API_TOKEN``); None if none is.
    One given but empty is refused: a missing secret must not turn auth off."""
    given = [(dest, getattr(args, dest, None)) for dest in ("api_token_file", "api_token")]
    if all(v is None for _, v in given) and TOKEN_ENV in environ:  # arguments parsed without environment defaults
        given = [("api_token", environ[TOKEN_ENV])]
        args = argparse.Namespace(_env_sources={"api_token": TOKEN_ENV})
    return _secret(
        args,
        given,
        "API token",
        "refusing to start without authentication (give a token, or none of --api-token-file, --api-token, "
        f"{TOKEN_ENV}_FILE and {TOKEN_ENV})",
    )


def _secret(args, given: list[tuple[str, str | None]], what: str, refusal: str) -> str | None:
    """The first of ``given`` (``(dest, value)``: a ``*_file`` dest holds a path to read) that is
    set, flags before their variables; None if none is; one set but empty is refused."""
    given = sorted(((d, v) for d, v in given if v is not None), key=lambda g: g[0] in env_sources(args))  # flags first
    if not given:
        return None
    dest, value = given[0]
    source = _source(args, dest, "--" + dest.replace("_", "-"))
    if dest.endswith("_file"):
        source = f"{source} {value}"
        try:
            token = Path(value).read_text().strip()
        except OSError as exc:
            raise UsageError(f"cannot read {source}: {exc.strerror}") from None
        except ValueError:  # not UTF-8
            raise UsageError(f"cannot read {source}: not a UTF-8 text file") from None
    else:
        token = value
    if not token.strip():
        raise UsageError(f"{source} gives an empty {what}: {refusal}")
    return token


def _api(args, environ: Mapping[str, str]) -> ApiConfig:
    token = _token(args, environ)
    if args.listen is None:
        return ApiConfig(token=token)
    host, port = parse_listen(args.listen, _source(args, "listen", "--listen"))
    return ApiConfig(host, port, token)


def _poll_interval(args) -> float:
    """``--poll-interval``: seconds > 0. Zero is refused, never replaced by the default: a daemon
    that polled its store without pause would spend requests (and money) for nothing."""
    value = args.poll_interval
    if not value > 0:
        raise UsageError(
            f"{_source(args, 'poll_interval', '--poll-interval')} must be a number of seconds > 0, "
            f"not {value:g} (a poll interval of 0 would poll the store without pause)"
        )
    return value


def _folder(flag: str, value: str) -> Path:
    """A folder flag's value, absolute; an empty one (an unset variable) is refused, not taken as the
    current folder (``--publish-root ''`` would let POST /v1/publish read anything under it), and so
    is a file (a folder that does not exist yet is the daemon's to wait for or make)."""
    if not value.strip():
        raise UsageError(f"{flag} is empty")
    path = Path(value).absolute()
    for there in (path, *path.parents):  # the deepest that exists must be a folder (or a link to one)
        if there.exists():
            if not there.is_dir():
                raise UsageError(f"{flag} {value}: {'' if there == path else f'{there} is '}not a directory")
            break
    return path


def default_id(folder: Path) -> str:
    """A subscriber id when none is given: the host name and a hash of the target folder's path."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{xxhash.xxh3_64_hexdigest(str(folder.absolute()).encode())[:8]}"


def _store(args) -> StoreConfig:
    return StoreConfig(
        args.store,
        args.endpoint_url,
        RetryPolicy(attempts=args.retry_attempts),
        trusted_keys=trusted_keys(args),
        **store_timeouts(args),
    )


def _state_home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "weightsync"


def _commit_timeout(args) -> float:
    if args.commit_timeout is not None and not args.commit:
        raise UsageError("--commit-timeout needs --commit (and --rank)")
    return 600.0 if args.commit_timeout is None else args.commit_timeout


def publisher_config(args, environ: Mapping[str, str] = os.environ) -> PublisherConfig:
    """The publisher daemon's :class:`PublisherConfig` from parsed flags and the environment."""
    watch = _folder(_source(args, "watch", "--watch"), args.watch)
    store_hash = xxhash.xxh3_64_hexdigest(str(args.store).encode())
    name = f"publisher-{store_hash}" + (
        "" if args.rank is None else f"-rank{args.rank}-of-{args.world}"
    )  # ranks may share a host
    state = (
        _folder(_source(args, "state_dir", "--state-dir"), args.state_dir)
        if args.state_dir is not None
        else _state_home(environ) / name
    )
    return PublisherConfig(
        store=_store(args),
        watch_dir=watch,
        state_dir=state,
        identity=Identity(args.id or default_id(watch), args.region, args.cluster),
        marker=args.marker,
        poll_interval=_poll_interval(args),
        stale_after=args.stale_after,
        publish=publish_config(args, ignore=(args.marker,)),
        publish_roots=tuple(_folder(_source(args, "publish_root", "--publish-root"), p) for p in args.publish_root),
        api=_api(args, environ),
        log=LogConfig(args.log_json, args.log_level),
        grace=args.grace,
        rank=args.rank,
        world=args.world,
        commit=args.commit,
        commit_timeout=_commit_timeout(args),
        own_files=args.own_files,
        stall_after=args.stall_after,
    )


_SECRETISH = re.compile(r"SECRET|TOKEN|PASSWORD|CREDENTIAL|^AWS_|^WEIGHTSYNC_HOOK_HEADER$", re.IGNORECASE)


def _header(text: str, source: str) -> tuple[str, str]:
    """``'Name: value'`` -> (name, value); an error never shows the value (it may be a secret)."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise UsageError(
            f"{source} wants 'NAME: VALUE' (e.g. 'Authorization: Bearer ...'), not a line without a name and colon"
        )
    return name.strip(), value.strip()


def _hook(args, environ: Mapping[str, str]) -> HookConfig | None:
    token = _secret(
        args,
        [(d, getattr(args, d, None)) for d in ("hook_token_file", "hook_token")],
        "hook token",
        "give a token or neither of --hook-token-file and --hook-token",
    )
    for dest, flag in (("hook_url", "--hook-url"), ("hook_command", "--hook-command")):
        if getattr(args, dest, None) == "":  # a missing ConfigMap key: the engine would never be told
            raise UsageError(f"{_source(args, dest, flag)} is empty: give the hook, or leave it out")
    if not args.hook_url and not args.hook_command:
        for dest, flag in (("hook_header", "--hook-header"), ("hook_preset", "--hook-preset")):
            if getattr(args, dest, None):
                raise UsageError(f"{_source(args, dest, flag)} needs --hook-url")
        if token is not None:
            raise UsageError("--hook-token-file/--hook-token need --hook-url")
        return None
    import shlex

    preset = getattr(args, "hook_preset", None)
    if preset and (args.hook_body is not None or args.hook_method is not None):
        given = [f for f, v in (("--hook-method", args.hook_method), ("--hook-body", args.hook_body)) if v is not None]
        raise UsageError(f"--hook-preset {preset} sets the method and body: drop {' and '.join(given)}")
    try:
        command = tuple(shlex.split(args.hook_command)) if args.hook_command else ()
    except ValueError as exc:  # an unbalanced quote
        raise UsageError(f"{_source(args, 'hook_command', '--hook-command')}: {exc}: {args.hook_command!r}") from None
    # a command hook inherits the environment minus anything that looks like a secret
    env = {k: v for k, v in environ.items() if not _SECRETISH.search(k)}
    headers = tuple(_header(h, _source(args, "hook_header", "--hook-header")) for h in getattr(args, "hook_header", []))
    if token is not None:
        if not args.hook_url:
            raise UsageError("--hook-token-file/--hook-token go with an HTTP hook (--hook-url), not a command")
        if any(name.lower() == "authorization" for name, _ in headers):
            raise UsageError("give the hook's Authorization once: --hook-token(-file) or --hook-header, not both")
        headers += (("Authorization", f"Bearer {token}"),)
    return HookConfig(
        url=args.hook_url,
        command=command,
        method=(args.hook_method or "POST").upper(),
        body=DEFAULT_HOOK_BODY if args.hook_body is None else args.hook_body,
        attempts=args.hook_attempts,
        backoff=Backoff(args.hook_backoff, max(args.hook_backoff, 30.0)),
        timeout=args.hook_timeout,
        env=env,
        headers=headers,
        preset=preset,
    )


def subscriber_config(args, environ: Mapping[str, str] = os.environ) -> SubscriberConfig:
    """The subscriber daemon's :class:`SubscriberConfig` from parsed flags and the environment."""
    target = _folder(_source(args, "target", "--target"), args.target)
    return SubscriberConfig(
        store=_store(args),
        target_dir=target,
        identity=Identity(args.id or default_id(target), args.region, args.cluster),
        poll_interval=_poll_interval(args),
        pin=args.pin,
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        hook=_hook(args, environ),
        ledger_interval=args.ledger_interval,
        fetch_concurrency=args.concurrency,
        fsync=not args.no_fsync,
        verify_before_swap=args.verify_before_swap,
        standby_hold=args.standby_hold,
        engine_timeout=args.engine_timeout,
        engine_phase_timeout=args.engine_phase_timeout,
        api=_api(args, environ),
        log=LogConfig(args.log_json, args.log_level),
        grace=args.grace,
        stall_after=args.stall_after,
        head_from=args.head_from or None,
        lazy_chunks=args.lazy_chunks,
        fallback=fallback_store(args),
    )
