"""Swap hook presets for engines that reload from disk (``--hook-preset sglang|vllm``) and the hook's
bearer token (``--hook-token-file``, ``WEIGHTSYNC_HOOK_TOKEN``): configured from flags and the
environment as the subscriber is, fired at a real aiohttp server standing in for the engine, which
records each request (method, path, Authorization, JSON body) and answers as the engine would."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from aiohttp import web

from weightsync import cli
from weightsync.errors import UsageError
from weightsync.service.flags import subscriber_config
from weightsync.service.hooks import HookRunner

SLOT, CURRENT = "/weights/slots/b", "/weights/current"


def hook_config(tmp_path, argv: list[str], **env: str):
    env = {"WEIGHTSYNC_STORE": str(tmp_path / "store"), "WEIGHTSYNC_TARGET": str(tmp_path / "t"), **env}
    return subscriber_config(cli.build_parser(env).parse_args(["subscriber", *argv]), env).hook


def fire(cfg, routes: dict[str, list[int]], version: int = 7):
    """Fire ``cfg`` once at a server answering each path with the statuses listed (the last one
    repeats); returns the outcome and the requests received."""
    calls: list[dict] = []

    async def handle(request: web.Request) -> web.Response:
        statuses = routes[request.path]
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        calls.append(
            {
                "method": request.method,
                "path": request.path,
                "auth": request.headers.get("Authorization"),
                "type": request.headers.get("Content-Type"),
                "body": await request.json() if request.can_read_body else None,
            }
        )
        echo = f"engine says no; you sent {dict(request.headers)}"  # a server that echoes the request
        return web.json_response({"success": status < 300, "message": echo}, status=status)

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            runner_cfg = dataclasses.replace(cfg, url=cfg.url.replace("http://engine", f"http://127.0.0.1:{port}"))
            failures = []
            outcome = await HookRunner(runner_cfg, lambda: failures.append(1)).fire(version, SLOT, CURRENT)
            return outcome, failures
        finally:
            await runner.cleanup()

    outcome, failures = asyncio.run(main())
    return outcome, calls, len(failures)


def test_sglang_preset_posts_update_weights_from_disk_with_the_token_from_a_file(tmp_path):
    (tmp_path / "token").write_text("s3cret-sglang\n")
    cfg = hook_config(
        tmp_path,
        ["--hook-url", "http://engine", "--hook-preset", "sglang", "--hook-token-file", str(tmp_path / "token")],
    )
    assert "s3cret" not in repr(cfg)
    outcome, calls, failures = fire(cfg, {"/update_weights_from_disk": [200]})
    assert outcome.ok and failures == 0
    assert calls == [
        {
            "method": "POST",
            "path": "/update_weights_from_disk",
            "auth": "Bearer s3cret-sglang",
            "type": "application/json",
            "body": {"model_path": SLOT, "weight_version": "7"},
        }
    ]


def test_sglang_answering_400_is_a_failed_try_and_the_token_never_shows(tmp_path):
    cfg = hook_config(
        tmp_path,
        ["--hook-url", "http://engine/", "--hook-preset", "sglang", "--hook-attempts", "2", "--hook-backoff", "0.01"],
        WEIGHTSYNC_HOOK_TOKEN="s3cret-env",
    )
    outcome, calls, failures = fire(cfg, {"/update_weights_from_disk": [400, 200]})
    assert outcome.ok and outcome.attempts == 2 and failures == 1 and len(calls) == 2
    outcome, calls, failures = fire(cfg, {"/update_weights_from_disk": [400]})
    assert not outcome.ok and "HTTP 400 from hook" in outcome.error and "s3cret-env" not in outcome.error
    assert calls[0]["auth"] == "Bearer s3cret-env"


def test_vllm_preset_reloads_through_collective_rpc_then_resets_the_prefix_cache(tmp_path):
    cfg = hook_config(tmp_path, ["--hook-url", "http://engine/v", "--hook-preset", "vllm"], WEIGHTSYNC_HOOK_TOKEN="t")
    outcome, calls, _ = fire(cfg, {"/v/collective_rpc": [200], "/v/reset_prefix_cache": [200]})
    assert outcome.ok
    assert [(c["method"], c["path"], c["auth"]) for c in calls] == [
        ("POST", "/v/collective_rpc", "Bearer t"),
        ("POST", "/v/reset_prefix_cache", "Bearer t"),
    ]
    assert calls[0]["body"] == {"method": "reload_weights", "kwargs": {"weights_path": SLOT}}


def test_vllm_a_failing_step_fails_the_try_and_the_whole_sequence_is_retried(tmp_path):
    cfg = hook_config(
        tmp_path,
        ["--hook-url", "http://engine", "--hook-preset", "vllm", "--hook-attempts", "2", "--hook-backoff", "0.01"],
    )
    outcome, calls, failures = fire(cfg, {"/collective_rpc": [200], "/reset_prefix_cache": [500, 200]})
    assert outcome.ok and outcome.attempts == 2 and failures == 1
    assert [c["path"] for c in calls] == ["/collective_rpc", "/reset_prefix_cache"] * 2
    outcome, calls, _ = fire(cfg, {"/collective_rpc": [404], "/reset_prefix_cache": [200]})
    assert not outcome.ok and "HTTP 404 from hook POST collective_rpc" in outcome.error
    assert [c["path"] for c in calls] == ["/collective_rpc"] * 2  # the reset is not sent after a failed reload


@pytest.mark.parametrize(
    "argv, env, words",
    [
        (["--hook-url", "http://e", "--hook-preset", "vllm", "--hook-body", "{}"], {}, "sets the method and body"),
        (["--hook-url", "http://e", "--hook-preset", "sglang", "--hook-method", "PUT"], {}, "drop --hook-method"),
        (["--hook-url", "http://e/update_weights_from_disk", "--hook-preset", "sglang"], {}, "base URL, without"),
        (["--hook-preset", "sglang"], {}, "--hook-preset needs --hook-url"),
        ([], {"WEIGHTSYNC_HOOK_PRESET": "vllm"}, "WEIGHTSYNC_HOOK_PRESET needs --hook-url"),
        (["--hook-command", "true", "--hook-token", "x"], {}, "go with an HTTP hook"),
        ([], {"WEIGHTSYNC_HOOK_TOKEN": "x"}, "need --hook-url"),
        (
            ["--hook-url", "http://e", "--hook-header", "authorization: Bearer y"],
            {"WEIGHTSYNC_HOOK_TOKEN": "x"},
            "not both",
        ),
    ],
)
def test_preset_and_token_mistakes_are_refused(tmp_path, argv, env, words):
    with pytest.raises(UsageError, match=words):
        hook_config(tmp_path, argv, **env)


def test_an_empty_or_unreadable_token_file_is_refused(tmp_path):
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(UsageError, match=r"--hook-token-file .*empty gives an empty hook token"):
        hook_config(tmp_path, ["--hook-url", "http://e", "--hook-token-file", str(tmp_path / "empty")])
    with pytest.raises(UsageError, match="^cannot read WEIGHTSYNC_HOOK_TOKEN_FILE"):
        hook_config(tmp_path, ["--hook-url", "http://e"], WEIGHTSYNC_HOOK_TOKEN_FILE=str(tmp_path / "missing"))
    flag_wins = hook_config(tmp_path, ["--hook-url", "http://e", "--hook-token", "f"], WEIGHTSYNC_HOOK_TOKEN="e")
    assert flag_wins.headers == (("Authorization", "Bearer f"),)


def test_an_unknown_preset_is_refused_naming_the_choices(tmp_path, capsys):
    with pytest.raises(SystemExit):
        hook_config(tmp_path, ["--hook-url", "http://e", "--hook-preset", "trt"])
    assert "choose from 'sglang', 'vllm'" in capsys.readouterr().err
