"""The CLI as a forked process: ``python -m weightsync.cli`` without an interpreter start per command.

A command run as a fresh process spends most of its time outside its work: the interpreter and
numpy (0.3 s), numba and its typing registries (0.4 s), the kernels loaded from numba's cache, and
the interpreter's teardown. Four files of functional tests ran 444 commands, which took 287 s of
their 468 s. :class:`Zygote` is one process per test worker that starts once (imports the CLI's
modules and loads every kernel, in the tests' environment) and forks a child per command. The
child is a real process: its own pid, working folder, stdout and stderr files and exit status (a
signal's as ``subprocess`` reports it), killed on a timeout. It runs the CLI module as ``__main__``
as ``-m`` does, then exits as the interpreter does up to its teardown: threads joined, atexit run,
stdio flushed (the teardown of a process holding every kernel takes 0.4 s, ten times a command).

What a forked command does not repeat is the start, so tests that check it (imports, a read-only
install, variables read at import) start their own processes, and so does every command whose
environment differs from the zygote's, and one asked for while the zygote is busy (commands a test
runs side by side stay side by side). A zygote whose start printed anything (a warning at import
would reach every fresh command's stderr) is not used.

Run as a script, this file is the zygote: requests on stdin (one JSON line each), answers on
stdout (the child's pid, then its exit status), its own stderr to the file the client names.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve()


class Zygote:
    """``run(args, env, timeout, cwd)`` -> (returncode, stdout, stderr), or None where a fresh process must run it."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env = dict(env)
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._count = 0
        self._log = folder / "zygote.err"
        with open(self._log, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, str(_HERE)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.env,
            )
        self._answers, self._buffer = self._proc.stdout.fileno(), b""
        ready = self._line(600)
        problem = self._log.read_text(errors="replace")
        self.usable = ready == "ready" and not problem
        if not self.usable:
            self.why = problem.strip()[-2000:] or f"the zygote answered {ready!r}"
            self.close()

    def run(self, args, env, timeout: float, cwd=None) -> tuple[int, str, str] | None:
        if not self.usable or env != self.env or not self._lock.acquire(blocking=False):
            return None
        try:
            self._count += 1
            out, err = self.folder / f"{self._count}.out", self.folder / f"{self._count}.err"
            request = {"args": [str(a) for a in args], "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                pid = self._line(60)
            except BrokenPipeError:
                pid = None
            if pid is None:  # the zygote is gone: this command and the next ones start processes
                self.usable, self.why = False, self._log.read_text(errors="replace").strip()[-2000:]
                return None
            pid = int(pid)
            code = self._status(pid, timeout)
            texts = [p.read_text() for p in (out, err)]
            for p in (out, err):
                p.unlink()
            if code is None:
                raise subprocess.TimeoutExpired([sys.executable, "-m", "weightsync.cli", *args], timeout, *texts)
            return code, *texts
        finally:
            self._lock.release()

    def _status(self, pid: int, timeout: float) -> int | None:
        """The child's exit status (as ``subprocess``: -N for signal N), or None if it ran past
        ``timeout`` (it is then killed, as ``subprocess.run`` kills it)."""
        status = self._line(timeout)
        if status is None:
            with contextlib.suppress(ProcessLookupError):  # not reaped yet, so not reused: ended just now
                os.kill(pid, signal.SIGKILL)
            self._line(60)
            return None
        return int(status)

    def _line(self, timeout: float) -> str | None:
        """The zygote's next answer, or None if none came within ``timeout`` seconds (or it is gone)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                return None
            chunk = os.read(self._answers, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _serve() -> None:
    """Import and load what a command needs, say ``ready``, then fork a child per request."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print of the zygote's own does not reach the answers
    os.close(null)
    import weightsync.cli  # noqa: F401 - every module a command imports at its start
    from weightsync.codec.payload import warm_up

    warm_up()  # every kernel, loaded from numba's cache (the tests' compiled_kernels filled it)
    del sys.modules["weightsync.cli"]  # run afresh as __main__ by each child, as -m does, and without runpy's warning
    if threading.active_count() != 1:  # a fork copies no thread: a child would lack it
        print(f"the zygote has {threading.active_count()} threads: it cannot fork", file=sys.stderr, flush=True)
    answers.write("ready\n")
    start = os.getcwd()
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            _child(request, start)  # never returns
        answers.write(f"{pid}\n")
        _, status = os.waitpid(pid, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")


def _child(request: dict, start: str) -> None:
    """Run one command as ``python -m weightsync.cli`` would, then exit as the interpreter does up to
    its teardown. The teardown frees what the process holds; what it could also do, flush a file
    left open or print an error from a ``__del__``, a forked command does not (a test may then fail
    for the lost bytes; one that reads stderr would miss the message)."""
    import atexit
    import runpy
    import traceback

    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
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
        traceback.print_exc()
        interrupted, code = isinstance(exc, KeyboardInterrupt), 1
    threading._shutdown()  # the interpreter's own steps at exit, in its order
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:  # an unhandled Ctrl-C ends the process by SIGINT, as the interpreter does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    _serve()
