"""The one child-interpreter runner of the tests.

Anything that may crash, hang or poison the process (a race, a fork, a signal, exit) runs in a
fresh interpreter, so that a crash or a hang fails the test instead of the test run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass


@dataclass
class ChildResult:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        how = "timed out" if self.timed_out else f"exit {self.returncode}"
        return f"child {how}\n--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"


# A child's backend unless a test names one: the host runtime of this session (simt in a session
# started with METRALE_FEED_BACKEND=simt, so the children of the suite's simt pass run simt too).
HOST_RUNTIME = "simt" if os.environ.get("METRALE_FEED_BACKEND", "").strip().lower() == "simt" else "host"


def child_env(backend: str | None = HOST_RUNTIME, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: METRALE_FEED_* cleared, then ``backend`` (None: the package
    chooses) and ``extra`` set; faulthandler on, so a crash prints its stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_FEED_")}
    if backend is not None:
        env["METRALE_FEED_BACKEND"] = backend
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra or {})
    return env


def run_python(code: str | None = None, *, argv: list[str] | None = None, timeout: float = 60,
               backend: str | None = HOST_RUNTIME, env: dict[str, str] | None = None,
               cwd: str | None = None, check: bool = True) -> ChildResult:
    """Run ``code`` (dedented) or the script ``argv`` in a fresh interpreter.

    Parameters
    ----------
    code : str, optional
        Python source for ``-c``; mutually exclusive with ``argv``.
    argv : list of str, optional
        Arguments after the interpreter (a script and its arguments).
    timeout : float
        Seconds before the child is killed (a hang is then reported, never waited out).
    backend : str or None
        METRALE_FEED_BACKEND of the child; None leaves the choice to the package.
    env : dict, optional
        Extra environment variables.
    cwd : str, optional
        Working directory (outside the repository, the installed package is imported).
    check : bool
        Fail the calling test unless the child exits with status 0.

    Returns
    -------
    ChildResult
        Its exit status (None after a timeout) and output.
    """
    if (code is None) == (argv is None):
        raise TypeError("give code or argv")
    args = [sys.executable] + (["-c", textwrap.dedent(code)] if code is not None else list(argv or []))
    # A session of its own, so that a hung child is killed with everything it forked.
    proc = subprocess.Popen(args, env=child_env(backend, env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    result = _wait(proc, timeout)
    if check and result.returncode != 0:
        raise AssertionError(result.describe())
    return result


def _wait(proc: subprocess.Popen, timeout: float) -> ChildResult:
    """A child's result; after ``timeout`` seconds it is killed with its whole session (what it
    forked too) and its exit status is None."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return ChildResult(proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        return ChildResult(None, stdout or "", stderr or "")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The tests folder: a child puts it on its path to import ``helpers`` and the top conftest.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def world_of_one(body: str, *paths: str) -> str:
    """The source of a child that runs ``body`` (dedented) as rank 0 of a gloo process group of
    one, then destroys the group and prints ``OK``.

    Parameters
    ----------
    body : str
        Python source run once the group is up (``dist`` is ``torch.distributed``).
    *paths : str
        Folders put first on the child's path, before the tests folder (a test's own folder, for
        its conftest and sibling modules).

    Returns
    -------
    str
        Source for ``run_python``; the caller checks ``OK`` in its stdout.
    """
    return (f"import sys\nsys.path[:0] = {[*paths, TESTS]!r}\n"
            "import torch.distributed as dist\n"
            "from helpers.child import free_port\n"
            'dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, '
            "world_size=1)\n"
            + textwrap.dedent(body)
            + "\ndist.destroy_process_group()\nprint(\"OK\")\n")


def run_unhung(code: str, *, timeout: float, hung: str = "hung") -> ChildResult:
    """Run ``code`` (dedented) in a fresh interpreter that may import ``helpers`` (the tests
    folder on its path): the calling test fails as ``hung`` at the timeout, and unless the child
    exits with status 0 after printing ``ok``."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    result = run_python(code, timeout=timeout, env={"PYTHONPATH": path}, check=False)
    assert not result.timed_out, f"{hung}: " + result.describe()
    assert result.returncode == 0 and "ok" in result.stdout, result.describe()
    return result


def run_ranks(script: str, world: int, *args: str, timeout: float = 120,
              backend: str | None = HOST_RUNTIME) -> list[ChildResult]:
    """Run ``script RANK WORLD PORT *args`` as ``world`` children at once (the ranks of one
    process group), each killed at ``timeout`` with everything it forked.

    Returns
    -------
    list of ChildResult
        One per rank, in rank order.
    """
    import time

    deadline = time.monotonic() + timeout  # one for all the attempts
    for attempt in range(3):
        # free_port's port is free when it returns, not when rank 0's store binds it: another
        # process (a peer test's ranks, their ephemeral sockets) may take it in between. Only
        # that, the rendezvous failing to bind, is run again; any other failure is the result.
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, script, str(r), str(world), port, *args],
                                  env=child_env(backend), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True) for r in range(world)]
        results = [_wait(proc, max(0.1, deadline - time.monotonic())) for proc in procs]
        if not any("EADDRINUSE" in r.stderr or "Address already in use" in r.stderr for r in results):
            break
    return results
