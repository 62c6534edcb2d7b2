"""`kvmesh router` stopped as Kubernetes stops a pod (SIGTERM): it stops advertising itself on both edges at once,
HTTP `/health` 503 (the readiness probe) and the endpoint picker's gRPC health NOT_SERVING (the Gateway's check),
while the stream already open runs to its last token; then it exits 0. Real processes on loopback: a simulated
engine (the real engine, its forward pass replaced by a latency model) and the router."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.protocol import RETURN_TOKEN_IDS_FIELD, VllmMetric
from kvmesh.processes import free_port, spawn, stop, tail, wait_healthy

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
TOKENS = 40  # at 200 ms a decode step, an 8 s stream: the checks made while it runs take a fraction of that


def running(engine: str) -> float:
    """The engine's running requests, from its /metrics."""
    for family in text_string_to_metric_families(httpx.get(engine + "/metrics", timeout=10).text):
        if family.name == VllmMetric.RUNNING:
            return sum(sample.value for sample in family.samples)
    raise AssertionError(f"{engine}/metrics has no {VllmMetric.RUNNING}")


def until_draining(router: str, proc: subprocess.Popen[bytes]) -> httpx.Response:
    """/health once it stops saying 200: the signal is handled on the router's event loop, a moment after it is
    sent."""
    while proc.poll() is None:
        try:
            reply = httpx.get(router + "/health", timeout=10)
        except httpx.ConnectError:
            raise AssertionError("the router closed its HTTP port before /health said it was draining") from None
        if reply.status_code != 200:
            return reply
        time.sleep(0.05)
    raise AssertionError(f"the router exited with {proc.returncode} before /health said it was draining")


@dataclass
class Received:
    """What a client has read of a stream."""

    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, int] | None = None
    done: bool = False  # [DONE] came

    def read(self, lines: Iterator[str], until_first_token: bool = False) -> None:
        for line in lines:
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                ids = [i for choice in chunk["choices"] for i in choice.get("token_ids", [])]
                self.token_ids += ids
                self.usage = chunk.get("usage") or self.usage
                if until_first_token and ids:
                    return


@pytest.mark.slow
def test_sigterm_stops_advertising_both_edges_at_once_finishes_the_open_stream_and_exits_0(tmp_path: Path) -> None:
    engine, router = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    picker = f"127.0.0.1:{free_port()}"
    logs = {"engine": tmp_path / "engine.log", "router": tmp_path / "router.log"}
    engine_proc = spawn(["sim-engine", "--port", engine.rsplit(":", 1)[1], "--decode-step-ms", "200"], logs["engine"])
    router_proc = spawn(["router", "--pod", engine, "--port", router.rsplit(":", 1)[1], "--ext-proc-port",
                         picker.rsplit(":", 1)[1], "--ext-proc-plaintext", "--log-level", "warning"], logs["router"])
    try:
        wait_healthy(engine, engine_proc, log=logs["engine"])
        wait_healthy(router, router_proc, log=logs["router"])
        with grpc.insecure_channel(picker) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def picker_status() -> int:
                return health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10).status

            assert picker_status() == SERVING
            body = {"prompt": "Tell me a long story", "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, RETURN_TOKEN_IDS_FIELD: True}
            received = Received()
            with httpx.stream("POST", router + "/v1/completions", json=body, timeout=60) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                received.read(lines, until_first_token=True)
                router_proc.send_signal(signal.SIGTERM)

                draining = until_draining(router, router_proc)
                assert (draining.status_code, draining.json()["status"]) == (503, "draining")
                assert picker_status() == NOT_SERVING
                assert health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10).status == SERVING
                assert running(engine) == 1 and router_proc.poll() is None  # the stream is still being generated

                received.read(lines)
        # every token reached the client, none cut by the shutdown
        assert received.done and len(received.token_ids) == TOKENS, tail(logs["router"])
        assert received.usage is not None and received.usage["completion_tokens"] == TOKENS
        assert router_proc.wait(timeout=120) == 0, tail(logs["router"])
    finally:
        stop([router_proc, engine_proc])
