"""numba's ``njit`` with an on-disk cache of compiled kernels that also works from a read-only
install: the first writable numba cache location is loaded from and saved to, every other that
exists is loaded from only (docs/DESIGN.md). ``python -m weightsync.codec.jit`` compiles or loads
every kernel (``--jobs N``: in N processes first); ``--require-cached`` exits 1 if anything had to
be compiled."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numba
from numba.core import caching, config, event, types

log = logging.getLogger("weightsync.jit")


_DISPATCHERS: list = []  # every kernel made here, for stats()


_logged: set[str] = set()


_log_lock = threading.Lock()


def _log_once(key: str, level: int, msg: str, *args) -> None:
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, msg, *args)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _package_digest(stamps: tuple) -> bytes:
    """SHA-256 of the sources of this package's modules (``stamps``: their names, times and sizes)."""
    h = hashlib.sha256()
    for name, _, _ in stamps:
        with open(os.path.join(_PACKAGE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.digest()


def _package_stamp() -> tuple:
    """What a kernel's compiled code depends on beside its own file: the sources of every module of
    this package (a kernel inlines its siblings' helpers: ``simd``'s ``pdep``, ``entropy``'s
    Rice codes) and numba's bounds checking."""
    stamps = []
    for entry in sorted(os.scandir(_PACKAGE), key=lambda e: e.name):
        if entry.name.endswith(".py") and entry.is_file():
            st = entry.stat()
            stamps.append((entry.name, st.st_mtime_ns, st.st_size))
    return _package_digest(tuple(stamps)), bool(config.BOUNDSCHECK)


def _stamped(locator_class: type) -> type:
    """``locator_class`` whose stamp, which numba compares before loading a cached kernel, also covers
    :func:`_package_stamp` (numba's covers the kernel's own file only)."""

    def get_source_stamp(self):
        return locator_class.get_source_stamp(self), _package_stamp()

    return type(f"Stamped{locator_class.__name__}", (locator_class,), {"get_source_stamp": get_source_stamp})


def _read_only(locator_class: type) -> type:
    """``locator_class`` accepting an existing, readable directory that it cannot write."""

    def ensure_cache_path(self) -> None:
        path = self.get_cache_path()
        if not (os.path.isdir(path) and os.access(path, os.R_OK | os.X_OK)):
            raise OSError(f"{path}: not a readable directory")

    return type(f"ReadOnly{locator_class.__name__}", (locator_class,), {"ensure_cache_path": ensure_cache_path})


def _numba_classes(*names: str) -> tuple[type, ...] | None:
    """Classes of ``numba.core.caching`` (numba < 0.62 spells the locators with a leading underscore);
    None if one is missing (a numba that reorganised its caches: then numba's ``cache=True`` is used)."""
    found = tuple(getattr(caching, n, None) or getattr(caching, "_" + n, None) for n in names)
    return None if None in found else found


# numba's own order; the IPython and zip locators do not apply to an installed package.
_LOCATORS = _numba_classes("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
if _LOCATORS is not None:
    _LOCATORS = tuple(_stamped(c) for c in _LOCATORS)


_READ_ONLY_LOCATORS = tuple(_read_only(c) for c in _LOCATORS) if _LOCATORS else None


def _function_cache(py_func, locator_class: type):
    """numba's cache of ``py_func`` at ``locator_class``'s location; None where that does not apply
    (numba's locator search raises when its one candidate is refused)."""
    impl = type("CacheImpl", (caching.CompileResultCacheImpl,), {"_locator_classes": [locator_class]})
    cache_class = type("FunctionCache", (caching.FunctionCache,), {"_impl_class": impl})
    try:
        return cache_class(py_func)
    except RuntimeError:
        return None


class LayeredCache:
    """A writable numba cache (or none) in front of read-only ones (see the module's docstring); the
    interface of numba's caches (``numba.core.caching._Cache``), which a dispatcher calls."""

    def __init__(self, py_func, writable, read_only: list) -> None:
        self._name = f"{py_func.__module__}.{py_func.__qualname__}"
        self._writable = writable
        self._read_only = read_only
        self._layers = ([writable] if writable is not None else []) + read_only
        self._enabled = True

    @property
    def cache_path(self):
        return self._layers[0].cache_path if self._layers else None

    @property
    def paths(self) -> tuple[str | None, list[str]]:
        return (self._writable.cache_path if self._writable else None), [c.cache_path for c in self._read_only]

    def load_overload(self, sig, target_context):
        if not self._enabled:
            return None
        for layer in self._layers:
            try:
                data = layer.load_overload(sig, target_context)
            except Exception as exc:  # noqa: BLE001 - a damaged or unreadable cache: compile instead
                _log_once(
                    f"load:{layer.cache_path}",
                    logging.WARNING,
                    "numba cache %s could not be read (%s: %s); compiling instead",
                    layer.cache_path,
                    type(exc).__name__,
                    exc,
                )
                continue
            if data is not None:
                return data
        return None

    def save_overload(self, sig, data) -> None:
        if not self._enabled:
            return
        if self._writable is None:
            _log_once(
                "unsaved",
                logging.INFO,
                "numba kernels compiled in this process are not cached: no writable "
                "cache directory (NUMBA_CACHE_DIR, the package's __pycache__, $XDG_CACHE_HOME/numba); "
                "every start compiles them again (%s)",
                self._name,
            )
            return
        try:
            self._writable.save_overload(sig, data)
        except OSError as exc:  # a full disk, a directory made read-only since: use the kernel anyway
            _log_once(
                f"save:{self._writable.cache_path}",
                logging.INFO,
                "numba cache %s could not be written (%s); kernels compiled here are not saved",
                self._writable.cache_path,
                exc,
            )

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def flush(self) -> None:
        if self._writable is not None:
            self._writable.flush()


def layered_cache(py_func) -> LayeredCache:
    if _LOCATORS is None or not hasattr(caching, "CompileResultCacheImpl"):
        raise RuntimeError(f"numba {numba.__version__}'s cache classes are not the ones expected")
    writable = None
    for cls in _LOCATORS:
        writable = _function_cache(py_func, cls)
        if writable is not None:
            break
    read_only, seen = [], {writable.cache_path} if writable is not None else set()
    for cls in _READ_ONLY_LOCATORS:
        cache = _function_cache(py_func, cls)
        if cache is not None and cache.cache_path not in seen:
            seen.add(cache.cache_path)
            read_only.append(cache)
    if writable is None:
        _log_once(
            "no-writable",
            logging.DEBUG,
            "no writable numba cache directory; loading kernels from %s",
            [c.cache_path for c in read_only] or "nowhere (they compile at first use)",
        )
    return LayeredCache(py_func, writable, read_only)


def njit(**options) -> Callable:
    """``numba.njit(**options)`` (keyword options only) with a :class:`LayeredCache`, compiled for
    plain argument types when another kernel calls it (:func:`_typed_without_literals`)."""
    if "cache" in options:
        raise TypeError("weightsync.jit.njit always caches where it can; drop cache=")

    def decorate(py_func):
        dispatcher = numba.njit(**options)(py_func)
        try:
            if getattr(config, "CACHE_LOCATOR_CLASSES", None):  # NUMBA_CACHE_LOCATOR_CLASSES: numba decides
                raise RuntimeError("NUMBA_CACHE_LOCATOR_CLASSES is set")
            dispatcher._cache = layered_cache(py_func)  # what numba's own enable_caching() sets
        except Exception as why:  # noqa: BLE001 - never let the cache stop a kernel from loading
            try:
                dispatcher.enable_caching()  # numba's cache=True
            except RuntimeError as exc:  # no writable location
                _log_once(
                    "disabled", logging.INFO, "numba cache disabled (%s; %s): kernels compile at first use", why, exc
                )
        _typed_without_literals(dispatcher)
        _DISPATCHERS.append(dispatcher)
        return dispatcher

    return decorate


def _typed_without_literals(dispatcher) -> None:
    """Calls from other kernels compile ``dispatcher`` for the arguments' plain types. numba types a
    constant argument (``f(x, 0)``) as a literal and compiles the callee again for it, a whole compile
    of that kernel per call site, which a call from Python (never literal) does not reuse. So a kernel
    that another calls cannot need a literal argument (``numba.literally``, a constant index into a
    tuple of mixed types, a dtype named by a string): such a value is fixed in the callee itself, or
    the callee inlined (``inline="always"`` types the inlined copy with the caller's literals)."""
    typed = dispatcher.get_call_template

    def get_call_template(args, kws):
        return typed(tuple(map(types.unliteral, args)), {k: types.unliteral(v) for k, v in kws.items()})

    dispatcher.get_call_template = get_call_template


def stats() -> dict[str, int]:
    """Signatures of this module's kernels loaded from a cache (``cached``) and compiled (``compiled``)
    in this process so far."""
    hits = sum(sum(d.stats.cache_hits.values()) for d in _DISPATCHERS)
    misses = sum(sum(d.stats.cache_misses.values()) for d in _DISPATCHERS)
    return {"cached": hits, "compiled": misses}


class CompileClock(event.Listener):
    """The seconds numba has spent compiling kernels (not loading them from a cache) while it listens,
    on any thread (:func:`compile_clock`). numba compiles one kernel at a time (its compiler lock),
    and a kernel's callees compile inside its own compile: the outermost compiles are timed. A
    compile under way when the clock starts counts from then (its end has no start here, and is
    dropped); one under way when it stops counts until then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._since = 0.0
        self._seconds = 0.0

    def on_start(self, ev) -> None:
        with self._lock:
            if self._depth == 0:
                self._since = time.perf_counter()
            self._depth += 1

    def on_end(self, ev) -> None:
        with self._lock:
            if self._depth == 0:  # began before the clock did
                return
            self._depth -= 1
            if self._depth == 0:
                self._seconds += time.perf_counter() - self._since

    def stop(self) -> None:
        """Stop counting (once the clock no longer listens): the seconds stay as they are now."""
        with self._lock:
            if self._depth:
                self._seconds += time.perf_counter() - self._since
                self._depth = 0

    @property
    def seconds(self) -> float:
        """The seconds so far, a compile under way included."""
        with self._lock:
            return self._seconds + (time.perf_counter() - self._since if self._depth else 0.0)


@contextlib.contextmanager
def compile_clock() -> Iterator[CompileClock]:
    """A :class:`CompileClock` that listens while the context is open (numba's event API)."""
    clock = CompileClock()
    try:
        with event.install_listener("numba:compile", clock):
            yield clock
    finally:
        clock.stop()


def cache_locations() -> dict[str, object]:
    """The kernels' cache directories: ``writable`` (numba's, per source directory; a list, empty when
    none is writable) and ``read_only`` (a list)."""
    writable: list[str] = []
    read_only: list[str] = []
    for d in _DISPATCHERS:
        cache = getattr(d, "_cache", None)
        if isinstance(cache, LayeredCache):
            w, ro = cache.paths
            writable += [p for p in [w] if p and p not in writable]
            read_only += [p for p in ro if p not in read_only]
    return {"writable": writable, "read_only": read_only}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _warm_step(step: tuple) -> int:
    """Run one warm-up piece in a worker process; the signatures it compiled."""
    from weightsync.codec.payload import warm_up_step

    before = stats()["compiled"]
    warm_up_step(*step)
    return stats()["compiled"] - before


def _warm_in_processes(steps: list[tuple], jobs: int) -> int:
    """Each of ``steps`` in a pool of ``jobs`` fresh (spawned) processes, the costliest (``ans``'s
    passes) first; every process saves what it compiles to the cache. Two processes that compile the
    same kernel both save it; numba replaces a cache's index whole, so one may drop the other's
    entry, which the caller's own warm-up then compiles again."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    order = sorted(steps, key=lambda s: s[0] != "ans")
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        return sum(pool.map(_warm_step, order))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a step that failed: the queued ones do not run


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m weightsync.codec.jit",
        description=(
            "Compile the codec's numba kernels, or load them from numba's cache, and report how many of "
            "each. Run it where the cache should be filled (an image build with NUMBA_CACHE_DIR set)."
        ),
    )
    parser.add_argument(
        "--require-cached",
        action="store_true",
        help="exit 1 if any kernel had to be compiled, here or in a --jobs process (checks a cache filled earlier)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="compile the warm-up's pieces in N processes first (a cold cache takes minutes of one CPU); "
        "this process then loads them from the cache, and compiles what a piece did not save",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be 1 or more, not {args.jobs}")
    from weightsync.codec.payload import warm_up, warm_up_steps

    t0 = time.perf_counter()
    steps, jobs = warm_up_steps(), args.jobs  # the steps import every kernel: their caches are known
    if jobs > 1 and not cache_locations()["writable"]:
        print(
            "weightsync.jit: no writable kernel cache (set NUMBA_CACHE_DIR): the --jobs processes could not "
            "hand over what they compile; compiling in this process only",
            file=sys.stderr,
            flush=True,
        )
        jobs = 1
    try:
        by_jobs = _warm_in_processes(steps, jobs) if jobs > 1 else None
    except Exception as exc:  # noqa: BLE001 - one line, whatever a worker raised
        print(f"weightsync.jit: a warm-up step failed in a worker: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    warm_up()
    report = {**stats(), "seconds": round(time.perf_counter() - t0, 2), **cache_locations(), "numba": numba.__version__}
    if by_jobs is not None:
        report |= {"jobs": jobs, "compiled_by_jobs": by_jobs}
    print(json.dumps(report))
    if args.require_cached and (report["compiled"] or report.get("compiled_by_jobs") or not report["cached"]):
        print("weightsync.jit: kernels were compiled, not loaded from the cache", flush=True)
        return 1
    return 0


if __name__ == "__main__":  # run as a script: the kernels register with the imported module, not __main__
    from weightsync.codec.jit import main as _main

    raise SystemExit(_main())
