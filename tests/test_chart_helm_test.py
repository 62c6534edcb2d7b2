"""`helm test`: the chart's test pod asks its pool's router a question, as a client in the namespace would, and
fails when no answer comes. Its command runs here against a real router in front of a real engine (no cluster can
run here, so the pod itself cannot: the Kubernetes side is checked as rendered objects)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvmesh.operator import crd, desired
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router, tiny_engines
from .test_chart import DISAGGREGATED, PODS, allowed, by_kind, manifests, render

HOOK = "helm.sh/hook"


def hook_pod(values: dict[str, Any]) -> dict[str, Any] | None:
    pods = [d for d in by_kind(manifests(render(values)), "Pod") if d["metadata"]["annotations"].get(HOOK) == "test"]
    assert len(pods) <= 1
    return pods[0] if pods else None


def chat_args(pod: dict[str, Any]) -> list[str]:
    (container,) = pod["spec"]["containers"]
    return container["args"]


def test_the_test_pod_asks_the_pools_own_router() -> None:
    pod = hook_pod(DISAGGREGATED)
    assert pod is not None and pod["spec"]["restartPolicy"] == "Never"
    pool = crd.parse_pool(next(d for d in manifests(render(DISAGGREGATED)) if d["kind"] == crd.KIND))
    service = next(s for s in desired.desired_objects(pool) if s["kind"] == "Service"
                   and s["metadata"]["name"] == desired.router_name(pool))
    port = service["spec"]["ports"][0]["port"]
    assert f"--url=http://{service['metadata']['name']}.{pool.namespace}.svc:{port}" in chat_args(pod)
    assert chat_args(pod)[0] == "chat"


def test_no_test_pod_without_the_charts_pool_or_with_api_keys() -> None:
    assert hook_pod({}) is None
    keyed = {"pool": {**DISAGGREGATED["pool"], "spec": {**DISAGGREGATED["pool"]["spec"],
                                                        "router": {"apiKeys": {"secretName": "keys"}}}}}
    assert hook_pod(keyed) is None


def test_narrowed_clients_still_let_the_test_pod_reach_the_routers() -> None:
    pod = hook_pod(DISAGGREGATED)
    assert pod is not None
    apps = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
    policies = by_kind(manifests(render({**DISAGGREGATED, "networkPolicy": {"clients": [apps]}})), "NetworkPolicy")
    PODS["helm-test"] = (pod["metadata"]["namespace"], pod["metadata"]["labels"])
    try:
        assert allowed(policies, "helm-test", "router", 8080)
        assert not allowed(policies, "helm-test", "both", 8000)
    finally:
        del PODS["helm-test"]


@pytest.fixture(scope="module")
def router_url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("engines"), roles=(None,)) as procs:
        router = build_router(RouterConfig(pods=list(procs), scrape_interval_seconds=0.1), tiny_dir)
        with serve_router(router) as url:
            yield url


# Runs the command given and prints its peak resident set (KiB, Linux's ru_maxrss) last on stderr: its only child.
PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")
BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity with a binary suffix (the chart writes these) in bytes."""
    return int(quantity[:-2]) * BINARY_SUFFIXES[quantity[-2:]]


def run_pod_command(args: list[str], url: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """The pod's command, with its Service address swapped for the local router's; and its peak resident bytes."""
    local = [f"--url={url}" if a.startswith("--url=") else "--wait=60" if a.startswith("--wait=") else a
             for a in args]
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "kvmesh.cli", *local],
                          capture_output=True, text=True, timeout=120)
    stderr, _, peak_kib = done.stderr.rstrip("\n").rpartition("\n")
    done.stderr = stderr
    return done, int(peak_kib) * 1024


def test_the_test_pods_command_passes_on_an_answering_pool(router_url: str) -> None:
    pod = hook_pod(DISAGGREGATED)
    assert pod is not None
    done, peak_bytes = run_pod_command(chat_args(pod), router_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "completion tokens" in done.stderr
    # All of it resident counts against the container's limit (file pages too, until reclaimed under it)
    (container,) = pod["spec"]["containers"]
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    assert peak_bytes < limit * 0.8, f"peak {peak_bytes / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB"


def test_the_test_pods_command_fails_when_nothing_answers() -> None:
    pod = hook_pod(DISAGGREGATED)
    assert pod is not None
    args = [("--wait=1" if a.startswith("--wait=") else a) for a in chat_args(pod)]
    done = subprocess.run([sys.executable, "-m", "kvmesh.cli",
                           *[("--url=http://127.0.0.1:9" if a.startswith("--url=") else a) for a in args]],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "did not become healthy" in done.stderr


class FlakyRouter(BaseHTTPRequestHandler):
    """Healthy at once, then 503 for the first two questions: another router replica that sees no engine yet."""

    refusals = 2

    def do_GET(self) -> None:
        self._answer(200, {"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        if FlakyRouter.refusals:
            FlakyRouter.refusals -= 1
            self._answer(503, {"error": {"message": "no pod can take this request now"}})
        else:
            self._answer(200, {"choices": [{"message": {"content": "ready"}}], "usage": {
                "prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


def test_the_test_pods_command_asks_again_while_the_router_answers_503() -> None:
    """Several router replicas: /health may reach one that sees an engine and the question one that does not yet."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FlakyRouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done, _ = run_pod_command(chat_args(hook_pod(DISAGGREGATED) or {}), f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ready" and FlakyRouter.refusals == 0
