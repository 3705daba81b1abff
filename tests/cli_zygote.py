"""The CLI as a forked process: ``python -m weightsync.cli`` without an interpreter start per command.

A command run as a fresh process spends most of its time outside its work: the interpreter and
numpy (0.3 s), numba and its typing registries (0.4 s), the kernels loaded from numba's cache, and
the interpreter's teardown. Four files of functional tests ran 444 commands, which took 287 s of
their 468 s; the functional and integration tests start about 250 daemons besides. :class:`Zygote`
is one process per test worker that starts once (imports the CLI's modules and loads every kernel,
in the tests' environment) and forks a child per command or daemon, as many at once as asked for.

The child is a real process: its own pid, working folder, environment, stdout and stderr, only
those three descriptors open (as ``subprocess`` leaves them), signals, exit status (a signal's as
``subprocess`` reports it). It runs the CLI module as ``__main__`` as ``-m`` does, then exits as the
interpreter does up to its teardown: threads joined, atexit run, stdio flushed (the teardown of a
process holding every kernel takes 0.4 s, ten times a command; what it could also do, flush a file
left open or print an error from a ``__del__``, a forked command does not: a test may then fail for
the lost bytes, and one that reads stderr would miss the message).

What a forked command does not repeat is the start. Its modules are imported and its kernels loaded
before it runs (a daemon logs its kernels ready at once, counted as the zygote loaded them), and
every child of a zygote has the same string hash seed (``PYTHONHASHSEED``): the order of a set of
strings is the same in each, where fresh processes differ (each worker's zygote has its own seed).
So tests that check a start (imports, a read-only install, the kernels' load) start their own
processes, and so does a command whose environment differs from the zygote's in a variable read at
a start (``NUMBA_*``, ``PYTHON*``, the locale, ``TMPDIR``...). A zygote whose start printed anything
(a warning at import would reach every fresh command's stderr) is not used. ``TESTS_FRESH_CLI=1``
starts every command as a fresh process.

Run as a script, this file is the zygote: it takes connections on a Unix socket, one request (a
JSON line) each, and answers on it the child's pid, then its exit status when it ends.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve()

# variables read when an interpreter (or a module the zygote imported) starts: a child cannot take them
_READ_AT_START = ("NUMBA_", "PYTHON", "LLVM", "LANG", "LC_", "TMPDIR", "TEMP", "TMP", "TQDM_", "OMP_", "MKL_", "LD_")

_current: Zygote | None = None


def current() -> Zygote | None:
    """The zygote of this test process, if one is started and usable (tests/functional/conftest.py)."""
    return _current if _current is not None and _current.usable else None


def set_current(zygote: Zygote | None) -> None:
    global _current
    _current = zygote


class Forked:
    """A forked command, as much of :class:`subprocess.Popen` as the tests use: ``pid``, ``args``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self._conn, self.pid, self.args, self.returncode = conn, pid, args, None
        self._waiting = threading.Lock()  # as Popen's: one reader of the status at a time

    def poll(self) -> int | None:
        if not self._waiting.acquire(blocking=False):
            return None  # another thread waits for it: as Popen's poll answers then
        try:
            return self._status(0)
        finally:
            self._waiting.release()

    def wait(self, timeout: float | None = None) -> int:
        with self._waiting:
            if self._status(timeout) is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            return self.returncode

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            if self._conn.fileno() == -1:
                raise RuntimeError(f"the zygote is gone: the exit status of pid {self.pid} is unknown")
            if select.select([self._conn], [], [], timeout)[0]:
                status = _read_line(self._conn, 60)
                self._conn.close()
                if status is None:
                    raise RuntimeError(f"the zygote is gone: the exit status of pid {self.pid} is unknown")
                self.returncode = int(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(RuntimeError):  # a zygote gone: the child lives on, and is signalled
            if self.poll() is not None:  # reaped: its pid may be another process's now
                return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One per test worker: ``spawn`` forks a command (None where a fresh process must run it);
    ``run`` forks one and waits for it, as ``subprocess.run`` with captured output."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env = dict(env)
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._names = itertools.count()  # next() is atomic: commands run from threads get their own files
        self._socket = str(folder / "zygote.sock")
        self._log = folder / "zygote.err"
        with open(self._log, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, str(_HERE), self._socket],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.env,
            )
        ready = select.select([self._proc.stdout], [], [], 600)[0] and self._proc.stdout.readline()
        problem = self._log.read_text(errors="replace")
        self.usable = ready == b"ready\n" and not problem
        self.why = "" if self.usable else problem.strip()[-2000:] or f"the zygote answered {ready!r}"
        if not self.usable:
            self.close()

    def forkable(self, env: dict[str, str]) -> bool:
        """Whether a child can take ``env``: it differs from the zygote's in no variable read at a start."""
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return not any(k.startswith(_READ_AT_START) for k in changed)

    def spawn(self, args, env: dict[str, str], cwd=None, stdout: Path | None = None, append=False, stderr=None):
        """Fork ``python -m weightsync.cli ARGS``: stdout to the file ``stdout`` (appended to with
        ``append``; /dev/null if None), stderr to the file ``stderr`` or, if it is
        ``subprocess.STDOUT``, with stdout. A :class:`Forked`, or None where a fresh process must run it."""
        if not self.usable or not self.forkable(env):
            return None
        args = [str(a) for a in args]
        request = {
            "args": args,
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),  # a relative one is the caller's, not the zygote's
            "stdout": str(stdout or os.devnull),
            "append": append,
            "stderr": "stdout" if stderr == subprocess.STDOUT else str(stderr or os.devnull),
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._socket)
            conn.sendall(json.dumps(request).encode() + b"\n")
            pid = _read_line(conn, 60)
        except OSError:
            pid = None
        if pid is None:  # the zygote is gone: this command and the next ones start processes
            conn.close()
            self.usable, self.why = False, self._log.read_text(errors="replace").strip()[-2000:] or "it is gone"
            return None
        return Forked(conn, int(pid), [sys.executable, "-m", "weightsync.cli", *args])

    def run(self, args, env, timeout: float, cwd=None) -> tuple[int, str, str] | None:
        """As ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)``: (returncode,
        stdout, stderr); TimeoutExpired after killing it, as that does. None: run it fresh."""
        n = next(self._names)
        out, err = self.folder / f"{n}.out", self.folder / f"{n}.err"
        child = self.spawn(args, env, cwd, stdout=out, stderr=err)
        if child is None:
            return None
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(child.args, timeout, *_texts(out, err)) from None
        except BaseException:  # interrupted (a test's timeout, Ctrl-C): killed, as subprocess.run kills it
            child.kill()
            raise
        return child.returncode, *_texts(out, err)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _texts(*paths: Path) -> list[str]:
    """The files' text as ``subprocess`` decodes a pipe's with ``text=True``; the files removed."""
    texts = [p.read_text() if p.exists() else "" for p in paths]
    for p in paths:
        p.unlink(missing_ok=True)
    return texts


def _read_line(conn: socket.socket, timeout: float) -> str | None:
    """One answer line from the zygote (read a byte at a time: nothing past it is taken), or None."""
    line, deadline = b"", time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([conn], [], [], left)[0]:
            return None
        byte = conn.recv(1)
        if not byte:
            return None
        line += byte
    return line.decode().strip()


def _serve(path: str) -> None:
    """Import and load what a command needs, say ``ready``, then fork a child per connection and
    answer its exit status when it ends; stop when stdin closes (the test worker is gone)."""
    import selectors

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # a stray print of the zygote's own does not reach the answers
    os.close(null)
    import weightsync.cli  # noqa: F401 - every module a command imports at its start
    from weightsync.codec.payload import warm_up

    warm_up()  # every kernel, loaded from numba's cache (the tests' compiled_kernels filled it)
    del sys.modules["weightsync.cli"]  # run afresh as __main__ by each child, as -m does, and without runpy's warning

    if threading.active_count() != 1:  # a fork copies no thread: a child would lack it
        print(f"the zygote has {threading.active_count()} threads: it cannot fork", file=sys.stderr, flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ, "connection")
    events.register(sys.stdin, selectors.EVENT_READ, "stdin")
    start = os.getcwd()
    answers.write("ready\n")
    while True:
        for key, _ in events.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "connection":
                conn, _ = listener.accept()
                try:  # this file's client sends its line at once: another gets 5 s, not the whole loop
                    request = json.loads(_read_line(conn, 5) or "null")
                except ValueError:
                    request = None
                if not isinstance(request, dict):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    try:
                        _child(request, start)  # never returns
                    finally:  # its set-up failed (a folder gone, a file it cannot open): printed, exit 1
                        traceback.print_exc()
                        os._exit(1)
                with contextlib.suppress(OSError):  # a client gone: the child still ends, and is reaped
                    conn.sendall(f"{pid}\n".encode())
                events.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                _, status = os.waitpid(pid, 0)
                events.unregister(key.fileobj)
                os.close(key.fileobj)
                with contextlib.suppress(OSError):  # a client that went away
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


def _child(request: dict, start: str) -> None:
    """Run one command as ``python -m weightsync.cli`` would, then exit as the interpreter does up to
    its teardown."""
    import atexit
    import runpy

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    out = os.open(request["stdout"], mode, 0o644)
    os.dup2(out, 1)
    os.close(out)
    if request["stderr"] == "stdout":
        os.dup2(1, 2)
    else:
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 2)
        os.close(err)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the zygote's socket, selector and other children's: as close_fds
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # numpy's global generator, seeded once in the zygote: seeded afresh, as at a start
        sys.modules["numpy"].random.seed()
    os.chdir(request["cwd"] or start)
    sys.path[0] = os.getcwd()  # as -m sets it
    sys.argv = ["-m", *request["args"]]  # runpy sets argv[0] to the module's file, as -m does
    interrupted = False
    try:
        runpy.run_module("weightsync.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter reads it: None is 0, an int itself, anything else printed and 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # noqa: BLE001 - printed as the interpreter prints it, and the same exit
        sys.excepthook(*sys.exc_info())
        interrupted, code = isinstance(exc, KeyboardInterrupt), 1
    threading._shutdown()  # the interpreter's own steps at exit, in its order
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:  # an unhandled Ctrl-C ends the process by SIGINT, as the interpreter does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)  # as the interpreter's exit status: sys.exit(256) and sys.exit(2**40) are 0


if __name__ == "__main__":
    _serve(sys.argv[1])
