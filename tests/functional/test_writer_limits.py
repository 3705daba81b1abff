"""The writer keeps to the format's limits (docs/FORMAT.md): a value every reader would reject is
refused before anything is uploaded, with one line, so that no publish can brick its own store.

Versions are at most 10^18: ``publish --version 10^18 + 1`` is refused, and so is a plain publish
on a store whose head is 10^18 (10^18 + 1 would follow). A publisher daemon watching a folder named
after a larger step logs it once and goes on instead of failing every iteration. Tensor shapes that a
manifest cannot hold (more than 64 dimensions, a dimension above 2^50) are refused at the scan.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_daemons import daemons, wait_for  # noqa: F401  (daemons: a fixture)

import weightsync
from weightsync.demo import SyntheticTrainer, write_safetensors
from weightsync.format.keys import MAX_VERSION

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


def _fails(ws, run_cli, watched: list[Path], *args) -> str:
    """Run a command that must fail with one error line and change nothing under ``watched``."""
    before = [ws.snapshot(p) for p in watched]
    rc, stdout, stderr = run_cli(*args)
    assert rc != 0, f"expected failure: {args}\nstdout: {stdout}"
    line = ws.error_line(stderr)
    assert [ws.snapshot(p) for p in watched] == before, "a refused command changed the store"
    return line


@pytest.mark.parametrize("command", ["publish", "publish-part"])
def test_a_version_above_the_format_limit_is_refused_before_anything_is_written(
    command, trajectory, tmp_path, run_cli, ok_cli, ws
):
    extra = ["--rank", 0, "--world", 1] if command == "publish-part" else []
    fresh = tmp_path / "fresh"  # not even the store marker is created
    line = _fails(ws, run_cli, [fresh], command, trajectory[0], "--store", fresh, "--version", MAX_VERSION + 1, *extra)
    assert str(MAX_VERSION) in line
    store = tmp_path / "store"
    ok_cli("publish", trajectory[0], "--store", store)
    _fails(ws, run_cli, [store], command, trajectory[1], "--store", store, "--version", MAX_VERSION + 1, *extra)
    _fails(
        ws,
        run_cli,
        [store],
        "commit-parts",
        "--store",
        store,
        "--version",
        MAX_VERSION + 1,
        "--world",
        1,
        "--timeout",
        0,
    )
    assert weightsync.open_repo(store).versions() == [0]


def test_a_store_at_the_largest_version_refuses_a_plain_publish_and_stays_readable(
    trajectory, tmp_path, run_cli, ok_cli, ws
):
    store = tmp_path / "store"
    ok_cli("publish", trajectory[0], "--store", store, "--version", MAX_VERSION)
    line = _fails(ws, run_cli, [store], "publish", trajectory[1], "--store", store)
    assert "largest" in line and str(MAX_VERSION) in line
    _fails(ws, run_cli, [store], "publish-part", trajectory[1], "--store", store, "--rank", 0, "--world", 1)
    # every reader still reads the store
    assert [v["version"] for v in json.loads(ok_cli("versions", "--store", store, "--json"))] == [MAX_VERSION]
    out = tmp_path / "out"
    ok_cli("pull", "--store", store, out)
    ok_cli("verify", "--store", store, out)
    ok_cli("gc", "--store", store, "--keep", 1)
    ws.assert_replica(out, trajectory[0])


def test_publisher_skips_a_checkpoint_whose_step_no_version_can_hold(tmp_path, daemons):  # noqa: F811
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    watch.mkdir()
    t = SyntheticTrainer(**TINY)
    for name in ("checkpoint-1", f"checkpoint-{MAX_VERSION + 1}", "step_" + "9" * 200):
        (t.save(watch / name) / "COMPLETE").write_text("")
        t.step()
    pub = daemons("publisher", ["--store", store, "--watch", watch, "--state-dir", tmp_path / "state"])
    wait_for(
        lambda: (s := pub.status())["head_version"] == 1 and s["state"] == "idle" and s, 30, f"head 1\n{pub.log()}"
    )
    # the skipped folders must not turn into failing iterations: polls go on past them, which two
    # more checkpoints, published one after the other, show (not a sleep a slow machine may not fill)
    for step in (2, 3):
        (t.save(watch / f"checkpoint-{step}") / "COMPLETE").write_text("")
        t.step()
        wait_for(
            lambda step=step: (s := pub.status())["head_version"] == step and s["state"] == "idle" and s,
            30,
            f"head {step}\n{pub.log()}",
        )
    status, log = pub.status(), pub.log()
    assert status["state"] == "idle" and status["last_error"] is None, status
    assert "iteration failed" not in log, log
    assert log.count(f"skipping checkpoint 'checkpoint-{MAX_VERSION + 1}'") == 1, log
    assert log.count("skipping checkpoint 'step_999") == 1, log
    assert weightsync.open_repo(store).versions() == [1, 2, 3]
    assert pub.stop() == 0


@pytest.mark.parametrize("shape", [[1] * 65, [2**51, 0]], ids=["65 dimensions", "a dimension above 2^50"])
def test_a_tensor_shape_no_manifest_can_hold_is_refused_at_the_scan(shape, trajectory, tmp_path, run_cli, ok_cli, ws):
    store = tmp_path / "store"
    ok_cli("publish", trajectory[0], "--store", store)
    bad = tmp_path / "bad"
    bad.mkdir()
    write_safetensors(bad / "model.safetensors", {"odd": ("F32", tuple(shape), bytes(4 if 0 not in shape else 0))})
    line = _fails(ws, run_cli, [store], "publish", bad, "--store", store)
    assert "model.safetensors" in line and "odd" in line
