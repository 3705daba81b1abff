"""12-factor configuration at parse level: every flag of the daemons, the mirror and gc has an
environment default ``WEIGHTSYNC_<FLAG>`` (shown in ``--help``), read with the flag's own type;
the command line wins; a bad value is a one-line error naming the variable (exit 2) that stops only
the command using it. Also: ``--poll-interval 0`` is refused (never silently 2), the publish flags
are defined once for ``publish``, ``publish-part`` and the publisher daemon, and hook headers.

The real processes (a daemon started from the environment alone, the mirror's probes, hook headers
on the wire) are in ``tests/functional/test_env_daemons.py``; the table of docs/OPERATIONS.md is
checked against the parser here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from pathlib import Path

import pytest

from weightsync import cli
from weightsync.errors import UsageError
from weightsync.service.config import HookConfig
from weightsync.service.flags import add_publisher_args, env_sources, env_var, publisher_config, subscriber_config

ROOT = Path(__file__).resolve().parents[2]
ENV_COMMANDS = ("publisher", "subscriber", "mirror", "gc", "fleet")


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    return cli.build_parser(env or {}).parse_args(argv)


def subparser(name: str, env: dict | None = None) -> argparse.ArgumentParser:
    parser = cli.build_parser(env or {})
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def sub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"WEIGHTSYNC_STORE": str(tmp_path / "store"), "WEIGHTSYNC_TARGET": str(tmp_path / "t"), **extra}


# --- every flag, named by rule, shown in --help ------------------------------------------------------
@pytest.mark.parametrize("command", ENV_COMMANDS)
def test_every_flag_of_a_deployed_command_has_its_variable(command):
    p = subparser(command)
    flags = [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert flags
    for action in flags:
        if command == "fleet" and action.dest == "json":
            continue  # an operator's output format, not configuration
        long = next(f for f in action.option_strings if f.startswith("--"))
        assert getattr(action, "env_var", None) == env_var(long), f"{command} {long}"
        assert f"env {env_var(long)}" in action.help, f"{command} {long}: the help does not name its variable"
    help_text = " ".join(p.format_help().split())  # as read, whatever the wrapping
    assert "(env WEIGHTSYNC_STORE" in help_text or "(env WEIGHTSYNC_FROM" in help_text
    # argparse %-formats each help: a bare "7% slower" printed its parameters ("7{'prog': ..}lower")
    assert "'prog'" not in help_text, f"{command}: a help text has a bare % (write %%)"


def test_variable_names_follow_the_flag():
    assert env_var("--poll-interval") == "WEIGHTSYNC_POLL_INTERVAL"
    assert env_var("--store") == "WEIGHTSYNC_STORE"
    assert env_var("--from-endpoint-url") == "WEIGHTSYNC_FROM_ENDPOINT_URL"


@pytest.mark.parametrize("command", ["publish", "publish-part", "commit-parts", "pull", "versions", "verify", "demo"])
def test_one_shot_commands_read_no_environment(command):
    p = subparser(command, {"WEIGHTSYNC_STORE": "/nowhere", "WEIGHTSYNC_CONCURRENCY": "x", "WEIGHTSYNC_LEVEL": "x"})
    assert not [a for a in p._actions if getattr(a, "env_var", None)]
    if command == "publish":
        args = p.parse_args(["ckpt", "--store", "/s"])
        assert args.store == "/s" and args.concurrency == 32 and args.level == 1


# --- defaults honoured, the command line wins ------------------------------------------------------------
def test_environment_defaults_are_honoured_with_their_types(tmp_path):
    env = sub_env(
        tmp_path,
        WEIGHTSYNC_POLL_INTERVAL="0.25",
        WEIGHTSYNC_CONCURRENCY="7",
        WEIGHTSYNC_NO_FSYNC="yes",
        WEIGHTSYNC_VERIFY_BEFORE_SWAP="0",
        WEIGHTSYNC_LOG_LEVEL="debug",
        WEIGHTSYNC_LOG_JSON="TRUE",
        WEIGHTSYNC_VERSION="latest",
        WEIGHTSYNC_STANDBY_HOLD="never",
        WEIGHTSYNC_INCLUDE="a.*, b.*,,",
        WEIGHTSYNC_LISTEN="127.0.0.1:0",
        WEIGHTSYNC_REGION="r1",
        WEIGHTSYNC_ID="sub-1",
    )
    args = parse(["subscriber"], env)
    assert (args.store, args.target) == (env["WEIGHTSYNC_STORE"], env["WEIGHTSYNC_TARGET"])
    assert args.poll_interval == 0.25 and args.concurrency == 7
    assert args.no_fsync is True and args.verify_before_swap is False and args.log_json is True
    assert args.log_level == "DEBUG" and args.pin == "latest" and args.standby_hold is None
    assert args.include == ["a.*", "b.*"]
    assert env_sources(args)["poll_interval"] == "WEIGHTSYNC_POLL_INTERVAL"
    cfg = subscriber_config(args, env)
    assert (cfg.poll_interval, cfg.fetch_concurrency, cfg.fsync, cfg.identity.id, cfg.identity.region) == (
        0.25,
        7,
        False,
        "sub-1",
        "r1",
    )
    assert (cfg.api.host, cfg.api.port, cfg.log.json, cfg.log.level) == ("127.0.0.1", 0, True, "DEBUG")


def test_the_command_line_wins_over_the_environment(tmp_path):
    env = sub_env(
        tmp_path,
        WEIGHTSYNC_POLL_INTERVAL="9",
        WEIGHTSYNC_INCLUDE="a.*,b.*",
        WEIGHTSYNC_REGION="env-region",
        WEIGHTSYNC_LOG_LEVEL="ERROR",
    )
    args = parse(
        [
            "subscriber",
            "--store",
            "/flag/store",
            "--poll-interval",
            "0.5",
            "--include",
            "c.*",
            "--region",
            "flag-region",
            "--log-level",
            "warning",
        ],
        env,
    )
    assert args.store == "/flag/store" and args.target == env["WEIGHTSYNC_TARGET"]
    assert args.poll_interval == 0.5 and args.region == "flag-region" and args.log_level == "WARNING"
    assert args.include == ["c.*"], "a repeated flag replaces the variable's list, it does not extend it"
    assert set(env_sources(args)) == {"target"}


def test_defaults_stay_without_the_environment(tmp_path):
    args = parse(["subscriber", "--store", "s", "--target", str(tmp_path)])
    assert args.poll_interval == 2.0 and args.include == [] and args.no_fsync is False and env_sources(args) == {}


def test_the_mirror_and_gc_take_the_environment():
    args = parse(
        ["mirror"],
        {
            "WEIGHTSYNC_FROM": "s3://a/x",
            "WEIGHTSYNC_TO": "s3://b/x",
            "WEIGHTSYNC_FOLLOW": "on",
            "WEIGHTSYNC_INTERVAL": "1.5",
            "WEIGHTSYNC_METRICS_LISTEN": "0.0.0.0:8472",
            "WEIGHTSYNC_LOG_JSON": "1",
            "WEIGHTSYNC_LOG_LEVEL": "WARNING",
        },
    )
    assert (args.src, args.dst, args.follow, args.interval, args.metrics_listen) == (
        "s3://a/x",
        "s3://b/x",
        True,
        1.5,
        "0.0.0.0:8472",
    )
    assert (args.log_json, args.log_level) == (True, "WARNING")
    args = parse(["gc"], {"WEIGHTSYNC_STORE": "s3://b/x", "WEIGHTSYNC_KEEP": "50", "WEIGHTSYNC_DRY_RUN": "no"})
    assert (args.store, args.keep, args.dry_run, args.grace_seconds) == ("s3://b/x", 50, False, 3600.0)
    assert parse(["gc", "--keep", "3"], {"WEIGHTSYNC_STORE": "s", "WEIGHTSYNC_KEEP": "50"}).keep == 3


def test_a_missing_required_flag_names_its_variable(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["subscriber", "--store", "s"])
    assert exc.value.code == 2
    assert "--target (or WEIGHTSYNC_TARGET)" in capsys.readouterr().err


# --- a bad value: one line, exit 2, naming the variable; only the command that uses it --------------------
@pytest.mark.parametrize(
    "var, value, words",
    [
        ("WEIGHTSYNC_POLL_INTERVAL", "soon", "not a number"),
        ("WEIGHTSYNC_CONCURRENCY", "1.5", "not an integer"),
        ("WEIGHTSYNC_NO_FSYNC", "maybe", "wants one of 1/true/yes/on/0/false/no/off"),
        ("WEIGHTSYNC_NO_FSYNC", "", "wants one of"),
        ("WEIGHTSYNC_LOG_LEVEL", "loud", "wants one of DEBUG, INFO, WARNING, ERROR"),
        ("WEIGHTSYNC_VERSION", "newest", "wants a version number or 'latest'"),
        ("WEIGHTSYNC_STANDBY_HOLD", "-1", "wants seconds >= 0"),
    ],
)
def test_a_bad_value_is_a_one_line_error_naming_the_variable(tmp_path, capsys, var, value, words):
    with pytest.raises(SystemExit) as exc:
        parse(["subscriber"], sub_env(tmp_path, **{var: value}))
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"weightsync: error: {var}={value!r}") and words in lines[0], lines[0]


def test_a_bad_value_stops_only_the_commands_that_use_it(tmp_path):
    env = {"WEIGHTSYNC_POLL_INTERVAL": "soon", "WEIGHTSYNC_KEEP": "many"}
    assert parse(["publish", "ckpt", "--store", "s"], env).checkpoint_dir == "ckpt"
    assert parse(["mirror", "--from", "a", "--to", "b"], env).interval == 1.0
    with pytest.raises(SystemExit):
        parse(["gc", "--store", "s"], env)


# --- --poll-interval 0 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("given", [["--poll-interval", "0"], ["--poll-interval", "-1"]])
def test_a_poll_interval_of_zero_is_refused_not_replaced(tmp_path, given):
    args = parse(["subscriber", "--store", "s", "--target", str(tmp_path), *given])
    with pytest.raises(UsageError, match=r"^--poll-interval must be a number of seconds > 0") as err:
        subscriber_config(args, {})
    assert "\n" not in str(err.value)
    args = parse(["publisher", "--store", "s", "--watch", str(tmp_path), *given])
    with pytest.raises(UsageError, match=r"^--poll-interval must be"):
        publisher_config(args, {})
    args = parse(["subscriber"], sub_env(tmp_path, WEIGHTSYNC_POLL_INTERVAL="0"))
    with pytest.raises(UsageError, match=r"^WEIGHTSYNC_POLL_INTERVAL must be a number of seconds > 0"):
        subscriber_config(args, {})


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "--store", "s", "--keep", "1", "--grace-seconds", "nan"],
        ["commit-parts", "--store", "s", "--version", "1", "--world", "2", "--timeout", "nan"],
        ["fleet", "--store", "s", "--expire-after", "NaN"],
        ["subscriber", "--store", "s", "--target", "t", "--grace", "nan"],
        ["subscriber", "--store", "s", "--target", "t", "--poll-interval", "nan"],
        ["publisher", "--store", "s", "--watch", "w", "--commit-timeout", "nan"],
    ],
    ids=lambda a: f"{a[0]}{a[-2]}",
)
def test_no_flag_takes_nan(argv, capsys):
    """Every comparison with NaN is false: ``gc --grace-seconds nan`` took every chunk for old (a
    publish in flight lost its chunks and committed a head no pull could build), ``commit-parts
    --timeout nan`` waited for ever. Every float flag refuses it as it is parsed."""
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert f"argument {argv[-2]}: not a number: '{argv[-1]}'" in capsys.readouterr().err


def test_no_variable_takes_nan(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["gc", "--store", "s", "--keep", "1"], {"WEIGHTSYNC_GRACE_SECONDS": "nan"})
    assert exc.value.code == 2
    assert "WEIGHTSYNC_GRACE_SECONDS='nan' (the default of --grace-seconds): not a number: 'nan'" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("text", ["\u0663", "1_000", "\uff11", "3.0", "\u20093", "\x1c3"])
def test_integer_flags_and_variables_take_ascii_digits_only(text, capsys):
    """``int`` takes ``\u0663`` (Arabic-Indic three) and ``1_000``: ``--version \u0663`` published version 3.
    The API took ASCII digits only already; flags and their variables now too."""
    for argv, env in (
        (["gc", "--store", "s", "--keep", text], {}),
        (["gc", "--store", "s"], {"WEIGHTSYNC_KEEP": text}),
        (["pull", "--store", "s", "--version", text, "out"], {}),
        (["publish", "ckpt", "--store", "s", "--version", text], {}),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(argv, env)
        assert exc.value.code == 2, argv
        assert repr(text) in capsys.readouterr().err, argv
    assert parse(["gc", "--store", "s", "--keep", " 12 "]).keep == 12  # what int() took before, blanks too


def test_a_negative_grace_is_refused(tmp_path):
    """``--grace -1`` made a SIGTERM cancel the work in flight at once."""
    args = parse(["subscriber", "--store", "s", "--target", str(tmp_path), "--grace", "-1"])
    with pytest.raises(UsageError, match=r"^--grace must be a number of seconds >= 0, got -1"):
        subscriber_config(args, {})
    args = parse(["publisher", "--store", "s", "--watch", str(tmp_path), "--grace", "-1"])
    with pytest.raises(UsageError, match=r"^--grace must be"):
        publisher_config(args, {})


def test_a_small_poll_interval_is_kept(tmp_path):
    args = parse(["subscriber", "--store", "s", "--target", str(tmp_path), "--poll-interval", "0.01"])
    assert subscriber_config(args, {}).poll_interval == 0.01
    assert subscriber_config(parse(["subscriber", "--store", "s", "--target", str(tmp_path)]), {}).poll_interval == 2.0


# --- the publish flags, defined once --------------------------------------------------------------------
ENCODING = (
    "--keyframe-interval",
    "--chunk-mib",
    "--level",
    "--fast-codec",
    "--concurrency",
    "--ignore",
    "--rank",
    "--world",
)


def _option(p: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in p._actions if flag in a.option_strings)


def _without_env(help_text: str) -> str:
    return re.sub(r" \(env [A-Z_]+[^)]*\)$", "", help_text)


def test_publish_and_the_publisher_share_one_definition_of_the_publish_flags():
    pub, daemon, part = subparser("publish"), subparser("publisher"), subparser("publish-part")
    for flag in ENCODING[:6]:
        ours, theirs = _option(daemon, flag), _option(pub, flag)
        assert (ours.dest, ours.type, ours.default, ours.const, _without_env(ours.help)) == (
            theirs.dest,
            theirs.type,
            theirs.default,
            theirs.const,
            theirs.help,
        ), flag
    for flag in ("--rank", "--world"):
        assert (_option(daemon, flag).dest, _option(daemon, flag).type) == (
            _option(part, flag).dest,
            _option(part, flag).type,
        )
    assert _option(part, "--rank").required and not _option(daemon, "--rank").required
    sources = "".join((ROOT / "weightsync" / name).read_text() for name in ("cli.py", "service/flags.py"))
    for flag in set(ENCODING) - {"--concurrency", "--world"}:  # those two are also other commands' own flags
        assert sources.count(f'"{flag}"') == 1, f"{flag} is defined more than once"


def test_the_publisher_honours_level_and_ignore(tmp_path):
    args = parse(
        [
            "publisher",
            "--store",
            "s",
            "--watch",
            str(tmp_path),
            "--level",
            "7",
            "--ignore",
            "*.tmp",
            "--ignore",
            "logs/*",
            "--fast-codec",
        ]
    )
    cfg = publisher_config(args, {}).publish
    assert cfg.codec.level == 7 and not cfg.codec.entropy_coder and cfg.ignore == ("COMPLETE", "*.tmp", "logs/*")
    env = {
        "WEIGHTSYNC_STORE": "s",
        "WEIGHTSYNC_WATCH": str(tmp_path),
        "WEIGHTSYNC_IGNORE": "*.tmp,logs/*",
        "WEIGHTSYNC_LEVEL": "3",
        "WEIGHTSYNC_MARKER": "DONE",
        "WEIGHTSYNC_PUBLISH_ROOT": os.pathsep.join(["/a", "/b"]),
    }
    cfg = publisher_config(parse(["publisher"], env), env)
    assert cfg.publish.codec.level == 3 and cfg.publish.ignore == ("DONE", "*.tmp", "logs/*")
    assert cfg.publish_roots == (Path("/a"), Path("/b"))


# --- the API token: flags before variables, files before tokens -------------------------------------------
def test_token_sources_in_order(tmp_path):
    (tmp_path / "tok").write_text("from-file\n")
    base = sub_env(tmp_path, WEIGHTSYNC_LISTEN="127.0.0.1:0")

    def token(argv, **env):
        return subscriber_config(parse(["subscriber", *argv], {**base, **env}), {**base, **env}).api.token

    assert token([], WEIGHTSYNC_API_TOKEN="t-env") == "t-env"
    assert token([], WEIGHTSYNC_API_TOKEN="t-env", WEIGHTSYNC_API_TOKEN_FILE=str(tmp_path / "tok")) == "from-file"
    assert token(["--api-token", "t-flag"], WEIGHTSYNC_API_TOKEN_FILE=str(tmp_path / "tok")) == "t-flag"
    assert token(["--api-token-file", str(tmp_path / "tok")], WEIGHTSYNC_API_TOKEN="t-env") == "from-file"
    with pytest.raises(UsageError, match="^WEIGHTSYNC_API_TOKEN gives an empty API token"):
        token([], WEIGHTSYNC_API_TOKEN=" ")
    with pytest.raises(UsageError, match="^cannot read WEIGHTSYNC_API_TOKEN_FILE"):
        token([], WEIGHTSYNC_API_TOKEN_FILE=str(tmp_path / "missing"))


# --- hook headers -------------------------------------------------------------------------------------------
def test_hook_headers_from_flags_and_the_environment(tmp_path):
    url = ["--hook-url", "http://127.0.0.1:9/hook"]
    args = parse(
        ["subscriber", *url, "--hook-header", "Authorization: Bearer hook-secret-qz", "--hook-header", "X-Run:  r1 "],
        sub_env(tmp_path),
    )
    hook = subscriber_config(args, {}).hook
    assert hook.headers == (("Authorization", "Bearer hook-secret-qz"), ("X-Run", "r1"))
    # a secret no host name or generated id can hold by chance (this once read "abc", and a host was vm-634e9abc)
    assert "hook-secret-qz" not in repr(hook) and "hook-secret-qz" not in repr(subscriber_config(args, {}))
    env = sub_env(tmp_path, WEIGHTSYNC_HOOK_HEADER="Authorization: Bearer xyz\nX-Two: 2\n")
    assert subscriber_config(parse(["subscriber", *url], env), env).hook.headers == (
        ("Authorization", "Bearer xyz"),
        ("X-Two", "2"),
    )
    flagged = parse(["subscriber", *url, "--hook-header", "X-Only: 1"], env)
    assert subscriber_config(flagged, env).hook.headers == (("X-Only", "1"),)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--hook-url", "http://h/", "--hook-header", "no colon secret-value"], "wants 'NAME: VALUE'"),
        (["--hook-url", "http://h/", "--hook-header", "Bad Name: secret-value"], "not a valid HTTP header"),
        (["--hook-command", "true", "--hook-header", "A: secret-value"], "HTTP hook"),
        (["--hook-header", "A: secret-value"], "--hook-header needs --hook-url"),
    ],
)
def test_bad_hook_headers_are_refused_without_showing_the_value(tmp_path, argv, words):
    with pytest.raises(UsageError, match=words) as err:
        subscriber_config(parse(["subscriber", *argv], sub_env(tmp_path)), {})
    assert "secret-value" not in str(err.value)
    with pytest.raises(UsageError):
        HookConfig(url="http://h/", headers=(("A", "x\r\nInjected: 1"),))


@pytest.mark.parametrize(
    "var, flag", [("WEIGHTSYNC_HOOK_COMMAND", "--hook-command"), ("WEIGHTSYNC_HOOK_URL", "--hook-url")]
)
def test_an_empty_hook_is_refused_not_dropped(tmp_path, var, flag):
    """A variable set but empty (a missing ConfigMap key) ran the subscriber without a hook, serving,
    and the engine was never told of a swap; an empty trusted key already stopped it at start."""
    env = sub_env(tmp_path, **{var: ""})
    with pytest.raises(UsageError, match=f"^{var} is empty"):
        subscriber_config(parse(["subscriber"], env), env)
    with pytest.raises(UsageError, match=f"^{flag} is empty"):
        subscriber_config(parse(["subscriber", flag, ""], sub_env(tmp_path)), {})


@pytest.mark.parametrize(
    "command, flag, var",
    [
        ("subscriber", "--target", "WEIGHTSYNC_TARGET"),
        ("publisher", "--watch", "WEIGHTSYNC_WATCH"),
        ("publisher", "--state-dir", "WEIGHTSYNC_STATE_DIR"),
    ],
)
def test_a_file_given_for_a_folder_is_refused_naming_the_flag(tmp_path, command, flag, var):
    """A subscriber whose --target was a file blamed a "damaged stored target" under it, and a
    publisher whose --watch was one logged a traceback every poll, backing off for ever."""
    afile = tmp_path / "afile"
    afile.write_text("hi")
    make = subscriber_config if command == "subscriber" else publisher_config
    base = sub_env(tmp_path) | {"WEIGHTSYNC_WATCH": str(tmp_path / "w")}
    with pytest.raises(UsageError, match=f"^{flag} {afile}: not a directory$"):
        make(parse([command, flag, str(afile)], base), {})
    env = base | {var: str(afile)}
    with pytest.raises(UsageError, match=f"^{var} {afile}: not a directory$"):
        make(parse([command], env), env)
    make(parse([command, flag, str(tmp_path / "missing")], base), {})  # not there yet: the daemon's to wait for
    with pytest.raises(UsageError, match=f"^{flag} {afile}/sub: {afile} is not a directory$"):  # a file above it
        make(parse([command, flag, str(afile / "sub")], base), {})


def test_a_hook_command_with_an_unbalanced_quote_is_one_line(tmp_path):
    """shlex's ValueError came out as a traceback (exit 1)."""
    with pytest.raises(UsageError, match=r"^--hook-command: No closing quotation"):
        subscriber_config(parse(["subscriber", "--hook-command", 'echo "open'], sub_env(tmp_path)), {})
    env = sub_env(tmp_path, WEIGHTSYNC_HOOK_COMMAND='echo "open')
    with pytest.raises(UsageError, match=r"^WEIGHTSYNC_HOOK_COMMAND: No closing quotation"):
        subscriber_config(parse(["subscriber"], env), env)


def test_hook_attempts_and_timeout_say_their_defaults():
    p = subparser("subscriber")
    assert "(default 5)" in _option(p, "--hook-attempts").help and "(default 600" in _option(p, "--hook-timeout").help


def test_plain_parsers_still_work_without_the_environment(tmp_path):
    p = argparse.ArgumentParser()
    add_publisher_args(p)  # as library users and older tests build them: no variables, same flags
    args = p.parse_args(["--store", "s", "--watch", str(tmp_path), "--level", "5"])
    assert publisher_config(args, {}).publish.codec.level == 5
    with pytest.raises(TypeError):
        add_publisher_args(argparse.ArgumentParser(), {})


# --- the table of docs/OPERATIONS.md ------------------------------------------------------------------------
def _env_table():
    spec = importlib.util.spec_from_file_location("env_table", ROOT / "scripts" / "env_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_operations_table_of_variables_is_the_parsers():
    table = _env_table()
    assert table.current(ROOT / "docs" / "OPERATIONS.md") == table.render(), "run: python scripts/env_table.py --write"
    rendered = table.render()
    for var in (
        "WEIGHTSYNC_STORE",
        "WEIGHTSYNC_TARGET",
        "WEIGHTSYNC_LISTEN",
        "WEIGHTSYNC_POLL_INTERVAL",
        "WEIGHTSYNC_API_TOKEN",
        "WEIGHTSYNC_HOOK_HEADER",
        "WEIGHTSYNC_FROM",
        "WEIGHTSYNC_KEEP",
        "WEIGHTSYNC_HEALTHCHECK_URLS",
    ):
        assert f"`{var}`" in rendered, var
    # a variable several commands share shows each one's help where they differ (the mirror's default)
    (row,) = [line for line in rendered.splitlines() if line.startswith("| `WEIGHTSYNC_CONCURRENCY`")]
    assert "(default 32)" in row and "(default 64" in row and "(mirror)" in row


@pytest.mark.parametrize("command", ENV_COMMANDS)
def test_every_default_is_shown_in_help(command):
    """An operator reads the defaults in --help (the hook's timeout, the store's timeouts...)."""
    for action in subparser(command)._actions:
        if action.option_strings and action.default not in (None, False, [], "", argparse.SUPPRESS):
            assert "default" in action.help, f"{command} {action.option_strings[0]}: {action.help!r}"


def test_a_mirror_interval_of_zero_is_refused_naming_the_flag():
    from weightsync.sync.mirror import MirrorConfig

    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(UsageError, match=r"^--interval must be a number of seconds > 0, not "):
            MirrorConfig(interval=bad)
