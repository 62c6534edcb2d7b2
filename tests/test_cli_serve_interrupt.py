"""A Ctrl-C while `kvmesh serve` loads its model ends it with 130 and one line (review: the interpreter exited while
the loader thread was inside torch, which aborted the process, "terminate called without an active exception",
SIGABRT)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvmesh.cli import INTERRUPTED_DURING_LOAD
from kvmesh.engine.protocol import INTERNAL_HTTP_CLIENT
from kvmesh.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_ctrl_c_while_the_model_loads_exits_130_without_an_abort() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:  # the server answers while the bundled model loads (seconds): then the Ctrl-C
            assert proc.poll() is None and time.monotonic() < deadline, "kvmesh serve never answered /health"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, **INTERNAL_HTTP_CLIENT)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "loading", health.text
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode(errors="replace")
    assert proc.returncode == INTERRUPTED_DURING_LOAD, stderr[-2000:]
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    assert "kvmesh serve: stopped while the model was loading" in stderr
