"""Stopping a local pool (`kvmesh up`, kvmesh/up.py's `stop_pool`) cuts nothing it serves: at Ctrl-C the router
stops first and finishes its open streams while the engines go on serving them, then the engines are drained and
stopped, and `kvmesh up` exits 0. A second Ctrl-C stops everything at once. The engine is simulated (`--sim`: the
bundled model's timing, about 20 tokens a second), which is what lets a stream outlast the old 20 s kill."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.processes import free_port, launch
from kvmesh.router.config import SHUTDOWN_DRAIN_SECONDS, SHUTDOWN_SETTLE_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MAX_TOKENS = 600  # about 30 s of stream: the first 60 tokens measure its pace
# The stream goes on about this long after the Ctrl-C, at the pace of its tokens 20 to 60: past the 20 s after
# which `kvmesh up` used to kill its children, within the router's own drain after a Ctrl-C (SHUTDOWN_DRAIN_SECONDS
# less the settle time, which it skips: 25 s). The simulated steps slow as the context grows (about 7 % more by
# the end), so the stream really lasts about 22 s: 2 s past the old kill, 3 s inside the drain.
AFTER_CTRL_C_SECONDS = 20.5
BODY = {"prompt": [1, 2, 3, 4], "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}


def start_pool(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    port, ready, log = free_port(), tmp_path / "ready", tmp_path / "up.log"
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "--engines", "1", "--port", str(port),
                   "--ready-file", str(ready)], log)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, f"kvmesh up exited while starting:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the pool did not start:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}", log


def events(lines: Iterator[str]) -> Iterator[dict | str]:
    """The stream's server-sent events: each chunk's JSON, then "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def finish(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_stream_open_at_ctrl_c_runs_to_its_end_and_kvmesh_up_exits_0(tmp_path: Path) -> None:
    assert 20 < AFTER_CTRL_C_SECONDS < SHUTDOWN_DRAIN_SECONDS - SHUTDOWN_SETTLE_SECONDS
    proc, url, log = start_pool(tmp_path)
    try:
        tokens, usage, done, interrupt_at = 0, None, False, None
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=60) as reply:
            assert reply.status_code == 200
            for event in events(reply.iter_lines()):
                if event == "[DONE]":
                    done = True
                    break
                assert "error" not in event, f"the stream was cut after {tokens} tokens: {event}"
                usage = event.get("usage") or usage
                tokens += len(event["choices"])
                if tokens == 20:
                    started = time.monotonic()
                elif tokens == 60:  # tokens left to stream AFTER_CTRL_C_SECONDS at the pace seen
                    interrupt_at = MAX_TOKENS - math.ceil(AFTER_CTRL_C_SECONDS * 40 / (time.monotonic() - started))
                    assert interrupt_at > 60, f"the simulated engine streams too fast for this test: {interrupt_at}"
                elif tokens == interrupt_at:
                    proc.send_signal(signal.SIGINT)
        assert interrupt_at is not None and tokens == MAX_TOKENS and done, (tokens, done, log.read_text()[-3000:])
        assert usage["completion_tokens"] == MAX_TOKENS
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        out = log.read_text()
        order = ["kvmesh up: stopping the router", "kvmesh up: router stopped; draining the engines",
                 "kvmesh up: stopped"]
        assert [out.find(line) for line in order] == sorted(out.find(line) for line in order), out
        assert -1 not in [out.find(line) for line in order], out
    finally:
        finish(proc)


def test_a_second_ctrl_c_stops_the_pool_at_once(tmp_path: Path) -> None:
    proc, url, log = start_pool(tmp_path)
    try:
        tokens, done = 0, False
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=60) as reply:
            assert reply.status_code == 200
            lines = events(reply.iter_lines())
            for event in lines:
                tokens += len(event["choices"])
                if tokens == 20:
                    break
            proc.send_signal(signal.SIGINT)  # the stream has about 29 s to go: a graceful stop waits for it
            deadline = time.monotonic() + 60
            while "kvmesh up: stopping the router" not in log.read_text():
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            with pytest.raises(httpx.TransportError):  # the router is gone mid-stream
                done = "[DONE]" in list(lines)
        assert not done
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
        assert "kvmesh up: stopped at once" in log.read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=5)
    finally:
        finish(proc)
