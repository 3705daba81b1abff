"""benchmarks/regions.py, the multi-region harness, in its quick form (two regions, two rank
publishers, one subscriber each, three versions on shaped links): every version reaches every
subscriber byte for byte, the stages come in commit order, the keyframe crosses the links in full
(today's mirror) or lazily, and a mirror refusing a flag stops the run with the mirror's message
and nothing left running. The long run: ``python benchmarks/regions.py``."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "regions.py"
_spec = importlib.util.spec_from_file_location("weightsync_bench_regions", _HARNESS)
regions = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = regions  # dataclasses look their module up by name
_spec.loader.exec_module(regions)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]  # regions of daemons and servers


@pytest.fixture
def work(tmp_path):
    """The harness's folder, removed after the test (SeaweedFS preallocates gigabytes of volumes)."""
    path = tmp_path / "work"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _daemon_pids(work: Path) -> list[int]:
    """Processes whose command line names ``work`` (the harness's daemons)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(work) in cmd:
                pids.append(int(proc.name))
    return pids


def test_quick_run_reaches_every_subscriber_in_order(work):
    args = regions.parse_args(["--quick", "--workdir", str(work), "--link-mbit", "40", "--rtt-ms", "60"])
    res = regions.run(args)
    (conf,) = res["configurations"]
    rows = conf["rows"]
    assert [r["version"] for r in rows] == [0, 1, 2]
    assert [r["keyframe"] for r in rows] == [True, False, True] and rows[2]["parent"] == 1
    for r in rows:
        assert r["verified"]
        assert set(r["regions"]) == {"r1", "r2"}
        assert 0 <= r["parts"] <= r["commit"] <= r["regional"] <= r["sub"] <= r["swapped"], r
        assert 0 <= r["notice"] <= r["regional"], r  # a pipelined mirror may notice before the commit
        for reg in r["regions"].values():
            assert reg["link_requests"].get("GET chunks", 0) >= 1
            assert reg["link_bytes_down"] > 0
    # the keyframe with a parent moves its full payloads across every link; the delta does not
    delta, key = rows[1], rows[2]
    assert min(key["link_bytes"]) > 5 * max(delta["link_bytes"])
    assert all(reg["regional_puts"] > 0 for reg in key["regions"].values())
    text = regions.report(res)
    assert "| 2 | keyframe |" in text and "current: COMPLETE -> all swapped" in text
    assert _daemon_pids(work) == []


def test_a_mirror_flag_refused_stops_the_run_cleanly(work, capsys):
    rc = regions.main(["--quick", "--versions", "2", "--workdir", str(work), "--mirror-args", "--no-such-flag 1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "refused its flags" in err and "--no-such-flag" in err
    assert _daemon_pids(work) == []


def test_bad_arguments_are_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        regions.parse_args(["--quick", "--ranks", "5", "--files", "2"])
    assert exc.value.code == 2
    assert "a rank owns whole files" in capsys.readouterr().err
    rc = regions.main(["--quick", "--baseline-checkout", str(tmp_path), "--workdir", str(tmp_path / "w")])
    assert rc == 1
    assert "not a weightsync checkout" in capsys.readouterr().err
    (tmp_path / "used" / "current").mkdir(parents=True)
    assert regions.main(["--quick", "--workdir", str(tmp_path / "used")]) == 1
    assert "already holds a run" in capsys.readouterr().err


def test_differs_finds_a_wrong_byte_a_missing_and_an_extra_file(tmp_path):
    ckpt, folder = tmp_path / "ckpt", tmp_path / "current"
    for d in (ckpt, folder):
        (d / "sub").mkdir(parents=True)
        (d / "a.safetensors").write_bytes(b"\x00" * 1000)
        (d / "sub" / "b.json").write_text("{}")
    (ckpt / regions.MARKER).touch()
    (folder / ".weightsync").mkdir()
    (folder / ".weightsync" / "state.json").write_text("{}")
    assert regions.differs(ckpt, folder) is None
    (folder / "a.safetensors").write_bytes(b"\x00" * 999 + b"\x01")
    assert regions.differs(ckpt, folder) == "a.safetensors differs"
    (folder / "a.safetensors").unlink()
    assert "instead of" in regions.differs(ckpt, folder)
    (folder / "a.safetensors").write_bytes(b"\x00" * 1000)
    (folder / "extra").write_text("x")
    assert "instead of" in regions.differs(ckpt, folder)


def _mirror_knows(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "mirror", "--help"],
        cwd=regions.REPO,
        env={**os.environ, "PYTHONPATH": str(regions.REPO)},
        capture_output=True,
        text=True,
        check=False,
    )
    return flag in out.stdout


def test_a_mirror_that_never_copies_keyframe_payloads_ends_each_wait(work):
    if not _mirror_knows("--keyframe-payloads"):
        pytest.skip("this checkout's mirror has no --keyframe-payloads")
    args = regions.parse_args(["--quick", "--workdir", str(work), "--mirror-args", "--keyframe-payloads never"])
    (conf,) = regions.run(args)["configurations"]
    delta, key = conf["rows"][1:]
    assert key["keyframe"] and key["verified"] and delta["verified"]
    assert key["lazy_notes_left"] == ["r1", "r2"] and delta["lazy_notes_left"] == []
    assert key["lazy"] is None
    assert max(key["link_bytes"]) < key["chunk_bytes"]  # the full payloads stayed at the source
    assert "note stays in 2" in regions.table(conf)
