"""The numba kernels' cache and warm-up (:mod:`weightsync.codec.jit`, :func:`weightsync.codec.payload.warm_up`).

Read-only installs and a cache filled ahead of time are tested with real processes in
``tests/functional/test_readonly_install.py``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from numba.core import caching

import weightsync
from weightsync.codec import CodecConfig, jit
from weightsync.codec import payload as codec
from weightsync.demo import make_trajectory


def _overloads() -> dict[int, set]:
    return {id(d): set(d.overloads) for d in jit._DISPATCHERS}


def _new_overloads(before: dict[int, set]) -> list[str]:
    return [f"{d.py_func.__qualname__}{sig}" for d in jit._DISPATCHERS for sig in set(d.overloads) - before[id(d)]]


def test_every_kernel_uses_the_layered_cache():
    for module in ("ans", "arith", "kernels", "sparse"):  # numba's modules load on first use
        importlib.import_module(f"weightsync.codec.{module}")
    names = {d.py_func.__qualname__ for d in jit._DISPATCHERS}
    assert {
        "gap_width",
        "_sparse_streams",
        "_apply_sparse",
        "_split_planes",
        "_merge_planes",
        "_encode",
        "_decode",
    } <= names
    assert all(isinstance(d._cache, jit.LayeredCache) for d in jit._DISPATCHERS)


def test_warm_up_compiles_every_signature_publish_and_pull_use(tmp_path):
    """A daemon's warm-up (and the image's cache) covers what its work needs: after it, publishing
    keyframes and deltas and pulling them (fresh, and updating a folder) compiles nothing new."""
    codec.warm_up()
    before = _overloads()
    traj = make_trajectory(tmp_path / "traj", steps=3, shards=2, hidden=32, layers=1, experts=2, vocab=128)
    store = f"file://{tmp_path / 'store'}"
    for ckpt in traj:
        weightsync.publish(
            ckpt, store, config=weightsync.PublishConfig(keyframe_interval=2), cache_dir=tmp_path / "cache"
        )
    weightsync.pull(store, tmp_path / "fresh")
    weightsync.pull(store, tmp_path / "updated", version=1)
    weightsync.pull(store, tmp_path / "updated")
    assert weightsync.verify(store, tmp_path / "updated") == len(traj) - 1
    assert _new_overloads(before) == []


def test_jit_main_reports_and_checks_the_cache(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-m", "weightsync.codec.jit"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout.splitlines()[-1])  # compiled, or loaded from this tree's __pycache__
    assert report["compiled"] + report["cached"] > 0
    assert report["writable"] and all(p.startswith(str(tmp_path / "numba")) for p in report["writable"])
    again = subprocess.run(
        [*argv, "--require-cached"], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stdout + again.stderr
    report = json.loads(again.stdout.splitlines()[-1])
    assert report["compiled"] == 0 and report["cached"] > 0
    jobs = subprocess.run(
        [*argv, "--jobs", "2", "--require-cached"], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert jobs.returncode == 0, jobs.stdout + jobs.stderr
    report = json.loads(jobs.stdout.splitlines()[-1])  # the pieces ran in two processes, all from the cache
    assert report["jobs"] == 2 and report["compiled_by_jobs"] == 0 and report["compiled"] == 0
    bad = subprocess.run([*argv, "--jobs", "0"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--jobs must be 1 or more" in bad.stderr


def test_require_cached_counts_what_the_jobs_compiled_and_a_failed_step_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(jit, "_warm_in_processes", lambda steps, jobs: 3)  # workers that compiled 3 signatures
    assert jit.main(["--jobs", "2", "--require-cached"]) == 1
    assert json.loads(capsys.readouterr().out.splitlines()[0])["compiled_by_jobs"] == 3
    assert jit.main(["--jobs", "2"]) == 0

    def fails(steps, jobs):
        raise RuntimeError("numba could not compile\nsecond line")

    monkeypatch.setattr(jit, "_warm_in_processes", fails)
    assert jit.main(["--jobs", "2"]) == 1
    err = capsys.readouterr().err
    assert err == "weightsync.jit: a warm-up step failed in a worker: RuntimeError: numba could not compile\n"


def test_jobs_without_a_writable_cache_compile_once_here(monkeypatch, capsys):
    """Processes could not hand over what they compile without a cache both can write: compiling
    everything there and again here would double a cold start, so this process does it alone."""
    used = []
    monkeypatch.setattr(jit, "_warm_in_processes", lambda steps, jobs: used.append(jobs) or 0)
    monkeypatch.setattr(jit, "cache_locations", lambda: {"writable": [], "read_only": ["/ro"]})
    assert jit.main(["--jobs", "4"]) == 0
    out, err = capsys.readouterr()
    assert used == [] and "jobs" not in json.loads(out.splitlines()[-1])
    assert err.startswith("weightsync.jit: no writable kernel cache") and err.count("\n") == 1
    monkeypatch.setattr(jit, "cache_locations", lambda: {"writable": ["/w"], "read_only": []})
    assert jit.main(["--jobs", "4"]) == 0 and used == [4]
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["jobs"] == 4


def test_warm_up_is_its_steps():
    """``--jobs`` spreads :func:`warm_up_steps`; each step runs alone, and they cover every width and pass."""
    steps = codec.warm_up_steps()
    assert len(steps) == len(set(steps)) and {s[0] for s in steps} == {"width", "ans"}
    assert sorted(s[1] for s in steps if s[0] == "width") == sorted(set(codec.UINT_VIEW))
    assert len([s for s in steps if s[0] == "ans"]) == 13
    for step in (steps[0], steps[-1]):
        codec.warm_up_step(*step)


def test_a_payload_in_a_bytearray_decodes_with_the_kernels_of_one_in_bytes(compiled_kernels):
    """The decoders read a payload as a read-only array whether it came as ``bytes`` (fetched) or in a
    ``bytearray``: one signature of each kernel that reads it, not one per buffer's writability, each
    of which is a whole compile with a cold cache (a daemon's first start, an image build, the demo's
    first run). The warm-up (``compiled_kernels``) decodes both, and so does this test."""
    from weightsync.codec import ans, arith

    rng = np.random.default_rng(0)
    for dtype in ("U8", "BF16", "F32"):
        old = rng.integers(0, 256, 4096, dtype=np.uint8)
        new = old.copy()
        new[::40] += 1
        for cfg in (CodecConfig(), CodecConfig(coder="ac")):
            enc = codec.encode_tensor(dtype, new, old, cfg)
            assert enc.codec == cfg.coder
            for payload in (bytes(enc.payload), bytearray(enc.payload)):
                assert np.array_equal(codec.decode_tensor(dtype, enc.codec, payload, old, new.size), new)
                if enc.codec == "ans":
                    assert np.array_equal(codec.decode_tensor_backward(dtype, "ans", payload, new, new.size), old)
    # the payload's readers and where they take it (others may be tested directly, with arrays of any kind)
    for kernel, at in ((ans._prepare, 0), (ans._parse, 0), (arith._decode, 1)):
        sigs = [(*sig[:at], sig[at].copy(readonly=False), *sig[at + 1 :]) for sig in kernel.overloads]
        assert sigs and len(set(sigs)) == len(sigs), (kernel.py_func.__qualname__, list(kernel.overloads))


def test_a_kernel_that_passes_another_constants_compiles_it_for_their_types_not_their_values(monkeypatch):
    """numba types a constant argument as a literal and would compile the callee once more for each
    such call (a whole compile of that kernel with a cold cache): kernels called from kernels are
    compiled for the plain types, the signature a call from Python uses too."""
    monkeypatch.setattr(jit, "_DISPATCHERS", [])  # these kernels stay out of the package's (stats(), caches)

    @jit.njit(nogil=True)
    def callee(a, k, flag):
        return a[k] if flag else a[0]

    @jit.njit(nogil=True)
    def caller(a):
        return callee(a, 3, True) + callee(a, 1, False)

    for kernel in (callee, caller):  # compiled here, each run: never loaded from a cache or saved to one
        kernel._cache = caching.NullCache()
    a = np.arange(5, dtype=np.int64)
    assert caller(a) == 3 + 0
    assert [tuple(map(str, sig)) for sig in callee.signatures] == [("array(int64, 1d, C)", "int64", "bool")]
    assert callee(a, 2, True) == 2
    assert len(callee.signatures) == 1 and jit._DISPATCHERS == [callee, caller]


@pytest.mark.parametrize("option", ["cache"])
def test_njit_refuses_a_cache_option(option):
    with pytest.raises(TypeError):
        jit.njit(**{option: True})


def test_a_kernels_cache_stamp_covers_every_module_of_the_package(tmp_path, monkeypatch):
    """A kernel inlines helpers from its sibling modules (``simd``'s ``pdep``): a cached kernel must
    not be loaded once one of them changed. numba's own stamp covers the kernel's file only."""
    for name, text in (("a.py", "x = 1\n"), ("b.py", "y = 2\n"), ("notes.txt", "n\n")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(jit, "_PACKAGE", str(tmp_path))
    first = jit._package_stamp()
    (tmp_path / "notes.txt").write_text("other\n")
    assert jit._package_stamp() == first  # not a module
    (tmp_path / "b.py").write_text("y = 3\n")  # same size: the content decides
    st = (tmp_path / "b.py").stat()
    os.utime(tmp_path / "b.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    second = jit._package_stamp()
    assert second != first
    (tmp_path / "c.py").write_text("")
    assert jit._package_stamp() not in (first, second)
    monkeypatch.undo()
    importlib.import_module("weightsync.codec.ans")  # its kernels, with their caches
    cache = next(d._cache for d in jit._DISPATCHERS if isinstance(d._cache, jit.LayeredCache) and d._cache._layers)
    own, package = cache._layers[0]._impl.locator.get_source_stamp()
    assert package == jit._package_stamp() and own


def test_the_compile_clock_times_compiles_on_every_thread_and_not_the_calls_after():
    """:func:`jit.compile_clock` counts the seconds numba compiles (a kernel and the callee it compiles
    with it, on another thread too), nothing for a call of a compiled kernel, nothing once closed."""
    import threading
    import time

    import numba

    @numba.njit
    def callee(x):
        return x * 3

    @numba.njit
    def kernel(x):
        return callee(x) + 1

    with jit.compile_clock() as clock:
        assert clock.seconds == 0.0
        t0 = time.perf_counter()
        worker = threading.Thread(target=kernel, args=(2,))
        worker.start()
        worker.join()
        spent = time.perf_counter() - t0
        compiled = clock.seconds
        assert 0.5 * spent < compiled <= spent  # numba compiled on the worker thread; the call itself is free
        assert kernel(5) == 16 and clock.seconds == compiled  # compiled already: no time added
    kernel(2.5)  # a new signature compiles, the clock closed
    assert clock.seconds == compiled


def test_the_compile_clock_drops_an_end_it_saw_no_start_of_and_stops_with_its_context():
    """A compile on another thread under way when the clock starts, or when it stops: an end without
    its start made the depth -1 (seconds then read the time since boot, and later compiles were
    dropped); a start without its end kept a closed clock running."""
    import time

    clock = jit.CompileClock()
    clock.on_end(None)  # began before the clock
    assert clock.seconds == 0.0
    clock.on_start(None)
    time.sleep(0.02)
    clock.on_end(None)
    counted = clock.seconds
    assert 0.02 <= counted < 1.0
    clock.on_start(None)  # under way when the clock stops
    time.sleep(0.02)
    clock.stop()
    stopped = clock.seconds
    assert stopped >= counted + 0.02
    time.sleep(0.02)
    assert clock.seconds == stopped
