"""The daemons' pure planning functions, table-driven: subscriber ``plan_next``, publisher
``plan_publish`` and ``parse_step``, the fleet view, hook templates, selections and config parsing;
the subscriber's stored target (read, write, start-up precedence)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from weightsync.errors import FormatError, UsageError
from weightsync.service.config import ApiConfig, Backoff, HookConfig, Identity, StoreConfig, SubscriberConfig
from weightsync.service.flags import (
    add_publisher_args,
    add_subscriber_args,
    parse_listen,
    publisher_config,
    subscriber_config,
)
from weightsync.service.hooks import render
from weightsync.service.pin import LATEST, ForeignTargetError, read_target, startup_target, target_path, write_target
from weightsync.service.publisher import Candidate, Publish, parse_step, plan_publish, scan
from weightsync.service.runtime import Idle, Wait
from weightsync.service.runtime import Idle as PIdle
from weightsync.service.runtime import Wait as PWait
from weightsync.service.subscriber import Sync, View, plan_next
from weightsync.sync.fleet import FleetRecord, fleet_view, record_from_json
from weightsync.sync.selection import Selection

NOW = 1000.0

# (view, head, target, expected action type, expected version or reason fragment)
PLAN_NEXT = [
    ("empty store", View(None), None, LATEST, Wait, "no versions"),
    ("empty store, pinned", View(None), None, 3, Wait, "no versions"),
    ("first sync", View(None), 4, LATEST, Sync, 4),
    ("up to date", View(4, 3), 4, LATEST, Idle, "serving version 4"),
    ("head moved", View(4, 3), 6, LATEST, Sync, 6),
    ("pinned back", View(6, 4), 6, 2, Sync, 2),
    ("pinned to the standby's version", View(6, 4), 6, 4, Sync, 4),
    ("pinned and there", View(2, 6), 9, 2, Idle, "pinned"),
    ("pinned ahead of the head", View(2), 3, 5, Wait, "not published yet"),
    ("pinned just ahead of the head", View(2), 3, 4, Wait, "not published yet"),
    ("pinned just ahead, nothing served", View(None), 0, 1, Wait, "not published yet"),
    ("pinned forward", View(2, 6), 9, 7, Sync, 7),
    ("back to latest", View(2, 6), 9, LATEST, Sync, 9),
    ("failed, backing off", View(2, None, 9, 2, NOW + 5), 9, LATEST, Wait, "failed 2 time"),
    ("failed, retry due", View(2, None, 9, 2, NOW - 1), 9, LATEST, Sync, 9),
    ("failed, but the head moved on", View(2, None, 9, 3, NOW + 60), 10, LATEST, Sync, 10),
    ("failed version no longer wanted", View(2, None, 9, 3, NOW + 60), 9, 2, Idle, "serving version 2"),
    ("version 0", View(None), 0, LATEST, Sync, 0),
    ("head moved back", View(6, 4), 5, LATEST, Sync, 5),
]


def test_a_head_that_went_back_is_named_so():
    assert plan_next(View(6, 4), 5, LATEST, NOW).reason == "head moved back: 6 -> 5"
    assert plan_next(View(4, 3), 6, LATEST, NOW).reason == "head moved: 4 -> 6"


@pytest.mark.parametrize("view,head,target,kind,expect", [c[1:] for c in PLAN_NEXT], ids=[c[0] for c in PLAN_NEXT])
def test_plan_next(view, head, target, kind, expect):
    action = plan_next(view, head, target, NOW)
    assert type(action) is kind, action
    if kind is Sync:
        assert action.version == expect
    else:
        assert expect in action.reason


def _c(step: int, ready: bool = True, age: float = 0.0) -> Candidate:
    return Candidate(step, Path(f"/w/checkpoint-{step}"), ready, NOW - age)


# (candidates, head, failed (step, retry_at) or None, expected type, expected step / reason, base step, skipped)
PLAN_PUBLISH = [
    ("nothing", [], None, None, PIdle, "no checkpoint", None, ()),
    ("first", [_c(0), _c(1)], None, None, Publish, 0, None, ()),
    ("resume from head", [_c(0), _c(1), _c(2)], 1, None, Publish, 2, 1, ()),
    ("head folder gone", [_c(2), _c(3)], 1, None, Publish, 2, None, ()),
    ("all published", [_c(0), _c(1)], 1, None, PIdle, "newest", None, ()),
    ("wait for an unfinished one", [_c(1), _c(2, False), _c(3)], 1, None, PWait, "checkpoint 2", None, ()),
    ("skip a stale unfinished one", [_c(1), _c(2, False, 7200), _c(3)], 1, None, Publish, 3, 1, (2,)),
    ("unfinished head is no base", [_c(1, False), _c(2)], 1, None, Publish, 2, None, ()),
    ("sparse steps", [_c(100), _c(110), _c(120)], 100, None, Publish, 110, 100, ()),
    ("checkpoint below the head is ignored", [_c(5), _c(12)], 10, None, Publish, 12, None, ()),
    ("failed, backing off", [_c(1), _c(2)], 1, (2, NOW + 3), PWait, "retrying", None, ()),
    ("failed, retry due", [_c(1), _c(2)], 1, (2, NOW - 3), Publish, 2, 1, ()),
]


@pytest.mark.parametrize(
    "cands,head,failed,kind,expect,base,skipped", [c[1:] for c in PLAN_PUBLISH], ids=[c[0] for c in PLAN_PUBLISH]
)
def test_plan_publish(cands, head, failed, kind, expect, base, skipped):
    step, retry_at = failed or (None, 0.0)
    action = plan_publish(cands, head, NOW, 3600.0, step, retry_at)
    assert type(action) is kind, action
    if kind is Publish:
        assert action.candidate.step == expect
        assert action.base == (None if base is None else Path(f"/w/checkpoint-{base}"))
        assert action.skipped == skipped
    else:
        assert expect in action.reason


@pytest.mark.parametrize(
    "name,step",
    [
        ("checkpoint-120", 120),
        ("step_000120", 120),
        ("120", 120),
        ("global_step7", 7),
        ("ckpt", None),
        ("checkpoint-120.tmp", None),
        (".checkpoint-3", None),
        ("run2-step-0", 0),
        ("", None),
    ],
)
def test_parse_step(name, step):
    assert parse_step(name) == step


def test_the_watcher_follows_a_linked_checkpoint_and_refuses_a_link_above_it(tmp_path):
    """A checkpoint written elsewhere and linked into the watched folder was skipped without a word
    (the next step was published over it); a link to the watched folder itself would publish every
    checkpoint as one version."""
    watch, elsewhere = tmp_path / "watch", tmp_path / "elsewhere"
    for d in (watch / "step_0", elsewhere / "step_1"):
        d.mkdir(parents=True)
        (d / "COMPLETE").touch()
    (watch / "step_1").symlink_to(elsewhere / "step_1")
    (watch / "step_2").symlink_to(watch)
    (watch / "step_3").symlink_to(tmp_path)
    (watch / "step_4").symlink_to(tmp_path / "gone")
    refused: dict[str, str] = {}
    found = scan(watch, "COMPLETE", refused)
    assert [(c.step, c.path.name, c.ready) for c in found] == [(0, "step_0", True), (1, "step_1", True)]
    assert set(refused) == {"step_2", "step_3"} and "links to the watched folder" in refused["step_2"]


def test_fleet_view_lag_and_staleness():
    recs = [
        FleetRecord("a", "us", "c1", 10, LATEST, "serving", NOW - 2),
        FleetRecord("b", "eu", "c2", 7, LATEST, "syncing", NOW - 30),
        FleetRecord("c", "ap", "", None, 3, "waiting", NOW - 1),
        FleetRecord("d", "", "", 12, LATEST, "serving", NOW),  # ahead of a stale head read
    ]
    superseded = {7: NOW - 120.0, None: NOW - 500.0}
    rows = {r.id: r for r in fleet_view(recs, 10, superseded.get, NOW)}
    assert (rows["a"].lag, rows["a"].staleness_seconds, rows["a"].last_seen_seconds) == (0, 0.0, 2.0)
    assert (rows["b"].lag, rows["b"].staleness_seconds, rows["b"].last_seen_seconds) == (3, 120.0, 30.0)
    assert (rows["c"].lag, rows["c"].staleness_seconds) == (None, 500.0)
    assert (rows["d"].lag, rows["d"].staleness_seconds) == (-2, 0.0)
    assert all(r.lag is None and r.staleness_seconds is None for r in fleet_view(recs, None, superseded.get, NOW))
    assert not any(r.gone for r in rows.values())


def test_fleet_view_marks_stopped_and_expired_records_gone():
    recs = [
        FleetRecord("live", "us", "", 10, LATEST, "syncing", NOW - 599),  # an hour-long sync still heartbeats
        FleetRecord("rolled-out", "us", "", 8, LATEST, "stopped", NOW - 5),
        FleetRecord("killed", "us", "", 9, LATEST, "serving", NOW - 601),
        FleetRecord("skewed", "us", "", 10, LATEST, "serving", NOW + 30),  # a clock a little ahead
        FleetRecord("future", "us", "", 10, LATEST, "serving", 1e300),  # planted: it never expired
    ]
    gone = {r.id: r.gone for r in fleet_view(recs, 10, {}.get, NOW)}
    assert gone == {"live": False, "rolled-out": True, "killed": True, "skewed": False, "future": True}
    assert {r.id: r.gone for r in fleet_view(recs, 10, {}.get, NOW, expire_after=3600)}["killed"] is False


@pytest.mark.parametrize(
    "doc,ok",
    [
        (
            {
                "id": "a",
                "region": "",
                "cluster": "",
                "current_version": 3,
                "target": "latest",
                "state": "x",
                "updated": 1.5,
            },
            True,
        ),
        (
            {"id": "a", "region": "", "cluster": "", "current_version": None, "target": 4, "state": "x", "updated": 1},
            True,
        ),
        (
            {"id": "a", "region": "", "cluster": "", "current_version": -1, "target": 4, "state": "x", "updated": 1},
            False,
        ),
        (
            {"id": "a", "region": "", "cluster": "", "current_version": 1, "target": "4", "state": "x", "updated": 1},
            False,
        ),
        ({"id": 5, "region": "", "cluster": "", "current_version": 1, "target": 4, "state": "x", "updated": 1}, False),
        (
            {"id": "a", "region": "", "cluster": "", "current_version": True, "target": 4, "state": "x", "updated": 1},
            False,
        ),
        (
            {"id": "a", "region": "", "cluster": "", "current_version": 1, "target": 4, "state": "x", "updated": "now"},
            False,
        ),
    ],
)
def test_fleet_records_are_validated(doc, ok):
    data = json.dumps({"format": "weightsync.fleet", **doc}).encode()
    if ok:
        rec = record_from_json(data, "r")
        assert record_from_json(rec.to_json(), "r") == rec
    else:
        with pytest.raises(Exception, match="r: "):
            record_from_json(data, "r")


_RECORD = (
    b'{"format": "weightsync.fleet", "id": "a", "region": "", "cluster": "", "target": 4, "state": "x", "updated": 1, '
)


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        _RECORD + b'"current_version": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        _RECORD + b'"current_version": [' + b"[0]," * 100_000 + b"0]}",
    ],
    ids=["deep array", "deep object", "deep version", "huge version"],
)
def test_deep_or_huge_fleet_records_are_a_short_format_error(data):
    """A hostile store's fleet record: a one-line FormatError, not a RecursionError or a megabyte message."""
    with pytest.raises(FormatError, match="^r: ") as err:
        record_from_json(data, "r")
    assert len(str(err.value)) < 200


def test_hook_templates_escape_paths_in_json():
    body = render(
        '{"version": {version}, "path": "{path}", "link": "{current}"}',
        12,
        '/m/"a"\\b',
        "/m/current",
        json_strings=True,
    )
    assert json.loads(body) == {"version": 12, "path": '/m/"a"\\b', "link": "/m/current"}
    assert render("--v={version} {path}", 3, "/x y", "/c", json_strings=False) == "--v=3 /x y"


@pytest.mark.parametrize(
    "include,exclude,name,ok",
    [
        ((), (), "anything", True),
        (("model.layers.*.mlp.experts.3.*",), (), "model.layers.0.mlp.experts.3.up_proj.weight", True),
        (("model.layers.*.mlp.experts.3.*",), (), "model.layers.0.mlp.experts.13.up_proj.weight", False),
        (("*",), ("*.down_proj.*",), "model.layers.1.mlp.experts.0.down_proj.weight", False),
        ((), ("lm_head.*",), "lm_head.weight", False),
        (("Model.*",), (), "model.norm.weight", False),  # case-sensitive
    ],
)
def test_selection(include, exclude, name, ok):
    assert Selection(include, exclude).matches(name) is ok


@pytest.mark.parametrize(
    "text,expect",
    [
        ("8080", ("127.0.0.1", 8080)),
        (":9000", ("127.0.0.1", 9000)),
        ("0.0.0.0:1", ("0.0.0.0", 1)),
        ("[::1]:7000", ("::1", 7000)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_parse_listen(text, expect):
    assert parse_listen(text) == expect


def test_config_validation():
    with pytest.raises(UsageError):
        parse_listen("host:port")
    with pytest.raises(UsageError):
        ApiConfig(port=70000)
    with pytest.raises(UsageError):
        ApiConfig(token="has space")
    assert "tok" not in repr(ApiConfig(token="tok"))  # the token is never printed
    with pytest.raises(UsageError):
        Identity("bad/id")
    for hidden in (".", ".."):
        with pytest.raises(UsageError, match="id must be"):
            Identity(hidden)
    assert Identity(".pub-1").id == ".pub-1" and Identity("sub.1-a_b").id == "sub.1-a_b"
    with pytest.raises(UsageError, match="must not start with '.'"):  # a file store lists no hidden names
        SubscriberConfig(StoreConfig("file:///s"), Path("/t"), Identity(".hidden-sub"))
    with pytest.raises(UsageError):
        HookConfig()  # neither a URL nor a command
    with pytest.raises(UsageError):
        HookConfig(url="http://x", command=("true",))
    assert [Backoff(0.5, 4.0).delay(n) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("argv,pin", [([], None), (["--version", "3"], 3), (["--version", "latest"], "latest")])
def test_subscriber_version_flag(tmp_path, argv, pin):
    assert subscriber_config(_subscriber_args(tmp_path, argv), {}).pin == pin


@pytest.mark.parametrize(
    "argv,hold",
    [([], 30.0), (["--standby-hold", "0"], 0.0), (["--standby-hold", "2.5"], 2.5), (["--standby-hold", "never"], None)],
)
def test_subscriber_standby_hold_flag(tmp_path, argv, hold):
    assert subscriber_config(_subscriber_args(tmp_path, argv), {}).standby_hold == hold


@pytest.mark.parametrize(
    "argv",
    [
        ["--version", "newest"],
        ["--version", "-1"],
        ["--standby-hold", "-1"],
        ["--standby-hold", "nan"],
        ["--standby-hold", "soon"],
    ],
)
def test_subscriber_version_flag_refuses_bad_values(tmp_path, argv):
    with pytest.raises(SystemExit) as exc:  # argparse's one-line usage error
        _subscriber_args(tmp_path, argv)
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv,env,token",
    [
        ([], {}, None),
        ([], {"WEIGHTSYNC_API_TOKEN": "t1"}, "t1"),
        (["--api-token", "t2"], {"WEIGHTSYNC_API_TOKEN": ""}, "t2"),
        (["--api-token-file", "{file}"], {"WEIGHTSYNC_API_TOKEN": ""}, "t3"),
        (["--api-token", ""], {}, UsageError),
        (["--api-token", " "], {"WEIGHTSYNC_API_TOKEN": "t1"}, UsageError),
        ([], {"WEIGHTSYNC_API_TOKEN": ""}, UsageError),
        ([], {"WEIGHTSYNC_API_TOKEN": "\t"}, UsageError),
        (["--api-token-file", "{empty}"], {"WEIGHTSYNC_API_TOKEN": "t1"}, UsageError),
        (["--api-token-file", ""], {}, UsageError),
        (["--api-token-file", "{missing}"], {}, UsageError),
    ],
)
def test_a_token_given_empty_is_refused_not_ignored(tmp_path, argv, env, token):
    (tmp_path / "file").write_text("t3\n")
    (tmp_path / "empty").write_text("\n \n")
    argv = [a.format(file=tmp_path / "file", empty=tmp_path / "empty", missing=tmp_path / "nope") for a in argv]
    args = _subscriber_args(tmp_path, [*argv, "--listen", "0.0.0.0:0"])
    if token is UsageError:
        with pytest.raises(UsageError, match="--api-token|WEIGHTSYNC_API_TOKEN") as err:
            subscriber_config(args, env)
        assert "\n" not in str(err.value)
    else:
        assert subscriber_config(args, env).api.token == token


@pytest.mark.parametrize(
    "role,flag",
    [
        ("publisher", "--publish-root"),
        ("publisher", "--watch"),
        ("publisher", "--state-dir"),
        ("subscriber", "--target"),
    ],
)
def test_an_empty_folder_flag_is_refused_not_taken_as_the_current_folder(tmp_path, role, flag):
    p = argparse.ArgumentParser()
    (add_publisher_args if role == "publisher" else add_subscriber_args)(p)
    need = {"--watch" if role == "publisher" else "--target": str(tmp_path)}
    build = publisher_config if role == "publisher" else subscriber_config
    argv = ["--store", str(tmp_path), *[a for k, v in {**need, flag: " "}.items() for a in (k, v)]]
    with pytest.raises(UsageError, match=f"^{flag} is empty$"):
        build(p.parse_args(argv), {})


def _subscriber_args(tmp_path: Path, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_subscriber_args(p)
    return p.parse_args(["--store", str(tmp_path), "--target", str(tmp_path / "t"), *argv])


# --- the stored target --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pin,stored,expect",
    [
        (None, None, (LATEST, "default")),
        (None, 7, (7, "stored")),
        (None, LATEST, (LATEST, "stored")),
        (3, 7, (3, "command line")),
        (3, LATEST, (3, "command line")),
        (0, None, (0, "command line")),
        (LATEST, 7, (LATEST, "command line")),
    ],
)
def test_startup_target_precedence(pin, stored, expect):
    assert startup_target(pin, stored) == expect


def test_stored_target_round_trip(tmp_path):
    target = tmp_path / "sub"
    assert read_target(target) is None  # no folder yet
    for value in (0, 118, LATEST, 5):
        write_target(target, value)
        assert read_target(target) == value
    assert [p.name for p in target_path(target).parent.iterdir()] == ["target.json"]  # no temporary left
    write_target(target, 9, fsync=False)
    assert read_target(target) == 9


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"\xff\xfe",
        b"[]",
        b'{"target": 3}',
        b'{"format": "weightsync.subscriber-target"}',
        b'{"format": "weightsync.subscriber-target", "target": -1}',
        b'{"format": "weightsync.subscriber-target", "target": "3"}',
        b'{"format": "weightsync.subscriber-target", "target": true}',
        b'{"format": "weightsync.subscriber-target", "target": 2.5}',
        b'{"format": "weightsync.subscriber-target", "target": "newest"}',
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep"),
        pytest.param(
            b'{"format": "weightsync.subscriber-target", "target": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            id="deep target",
        ),
        pytest.param(
            b'{"format": "weightsync.subscriber-target", "target": 3, "store": ' + b"[" * 900 + b"]" * 900 + b"}",
            id="deep store",
        ),
    ],
)
def test_a_damaged_stored_target_is_an_error_naming_the_file(tmp_path, content):
    path = target_path(tmp_path)
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(UsageError, match="damaged stored target") as err:
        read_target(tmp_path)
    assert str(path) in str(err.value) and "--version" in str(err.value) and "\n" not in str(err.value)


def test_a_stored_target_is_never_kept_behind_a_symlink(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".weightsync").symlink_to(tmp_path / "elsewhere")
    for call in (lambda: read_target(tmp_path / "sub"), lambda: write_target(tmp_path / "sub", 3)):
        with pytest.raises(UsageError, match="not a directory"):
            call()
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_target_stored_for_another_store_is_not_applied(tmp_path):
    write_target(tmp_path, 118, fsync=False, store="s3://bucket/run-1")
    assert read_target(tmp_path, "s3://bucket/run-1") == 118
    assert read_target(tmp_path) == 118  # no store to compare with
    with pytest.raises(ForeignTargetError, match="set for s3://bucket/run-1, not s3://bucket/run-2"):
        read_target(tmp_path, "s3://bucket/run-2")
    write_target(tmp_path, LATEST, fsync=False)  # written without a store: applies to any
    assert read_target(tmp_path, "s3://bucket/run-2") == LATEST
