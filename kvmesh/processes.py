"""Child processes on loopback: free ports, `python -m kvmesh.cli ...` with its output in a log file, waiting for
`/health`, and stopping. One copy for `kvmesh up`, the benchmarks and the tests, so they start and stop their
engines and routers the same way."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

PR_SET_PDEATHSIG = 1
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # every server's --log-level: logging's and uvicorn's


def free_port() -> int:
    """A loopback port free right now (the OS picks it), for a child to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_problem(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server could not listen on `host`:`port` now (the OS's words: in use, not an address of this machine,
    a privileged port), or None. With SO_REUSEADDR as uvicorn binds: a port whose old connections linger in
    TIME_WAIT is free, one with a listener is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            return exc.strerror or str(exc)


def launch(argv: list[str], log: Path, *, new_session: bool = False,
           env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` with stdout and stderr appended to `log` (appended, so a restarted child keeps its
    predecessor's output) and PYTHONUNBUFFERED=1, so the log is current when a failure shows its tail; `env`: more
    variables, over this process's own (`kvmesh up`'s children get the pool's internal-token file).

    `new_session`: the child gets its own session, so a Ctrl-C at the terminal reaches only this process, which
    then stops its children in order; since the terminal no longer reaches them, on Linux they also get SIGTERM
    when this process dies, even by SIGKILL, and are never orphaned."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                                start_new_session=new_session,
                                preexec_fn=_die_with_parent if new_session else None)


def spawn(args: list[str], log: Path, *, new_session: bool = False,
          env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m kvmesh.cli *args` (`kvmesh serve ...`, `kvmesh router ...`) with this interpreter, by `launch`."""
    return launch([sys.executable, "-m", "kvmesh.cli", *args], log, new_session=new_session, env=env)


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


TAIL_BYTES = 16 * 1024  # the most of a log that `tail` reads: a failure's last lines, never a long run's history


def tail(log: Path, lines: int = 20, start: int = 0) -> str:
    """The last `lines` of what a child wrote to its log from byte `start` on (empty if it cannot be read): what
    an error shows of why it failed. `start`: the log's size when the child started, so a restarted child's
    failure shows its own lines, not its predecessors' again; at most TAIL_BYTES are read."""
    try:
        with log.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            begin = max(start, size - TAIL_BYTES)
            file.seek(begin)
            text = file.read().decode(errors="replace")
    except OSError:
        return ""
    if begin > start and "\n" in text:  # begun inside a line: drop that line's end
        text = text.partition("\n")[2]
    return "\n".join(text.splitlines()[-lines:])


def log_size(log: Path) -> int:
    """How many bytes `log` holds now (0 if there is none yet): where a child started now begins to write in it."""
    try:
        return log.stat().st_size
    except OSError:
        return 0


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120.0,
                 log: Path | None = None) -> None:
    """Return once `url`/health answers 200. Raise RuntimeError if `proc` exits first, TimeoutError after
    `timeout` s; either with the tail of `log`, when given, so the failure says why. A 200 counts only while `proc`
    still runs: a child that failed to bind its port (another server holds it) is not the one answering."""
    import httpx  # here: `kvmesh --help` imports the benchmarks, which import this module

    from kvmesh.engine.protocol import INTERNAL_HTTP_CLIENT

    def exited() -> RuntimeError:
        assert proc is not None
        return RuntimeError(f"{url} exited with {proc.returncode}{_tail_of(log)}")

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise exited()
        try:
            if httpx.get(url + "/health", timeout=2, **INTERNAL_HTTP_CLIENT).status_code == 200:
                if proc is not None and proc.poll() is not None:
                    raise exited()
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} was not healthy after {timeout:.0f} s{_tail_of(log)}")


def _tail_of(log: Path | None) -> str:
    return f":\n{tail(log)}" if log is not None else ""


def stop(procs: Iterable[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGINT every child still running (a clean shutdown: engines and routers exit on it), then SIGKILL those not
    gone `timeout` s later, counted once for all of them."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    wait_or_kill(procs, timeout)


def wait_or_kill(procs: Iterable[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait for every process to exit; SIGKILL those still running `timeout` s from now (counted once for all),
    and reap them."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (a new file renamed over it), so a process reading the file (a
    router's pods file, Prometheus' targets file, an engine starting from its config, a script waiting for a ready
    file) never reads half of it. The temporary file is removed if the write fails (a full disk)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomically(path: Path, data: object) -> None:
    write_atomically(path, json.dumps(data, indent=2))
