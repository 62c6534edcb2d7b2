"""`kvmesh up`: a whole pool on one machine. N engines and a router as child processes, from flags or an
InferencePool YAML file; waits until every child is healthy, prints the endpoint, and stops everything on
Ctrl-C or as soon as one child dies (with the tail of its log)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvmesh.engine.model.loader import resolve_model_dir
from kvmesh.processes import free_port, spawn, stop, tail

HEALTH_TIMEOUT_SECONDS = 600.0


@dataclass
class PoolPlan:
    """What `kvmesh up` starts: engines (aggregated), their engine settings, and the router's."""

    name: str = "local"
    engines: int = 2
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    router: dict[str, Any] = field(default_factory=dict)
    sim: str | None = None  # a `kvmesh sim-engine` profile: simulated engines instead of real ones
    roles: list[str] | None = None  # each engine's role in a disaggregated pool; None: all `both`
    pool: Any = None  # the InferencePool (operator/crd.py's Pool) the plan came from: its scaler runs too


def plan_from_file(path: str | Path) -> PoolPlan:
    """A local pool from an InferencePool file, read through operator/crd.py (the cluster's defaults and checks):
    each role's minimum replicas, the model, and the engine and router settings the operator would write."""
    from kvmesh.operator.crd import BUNDLED, load_pool_file
    from kvmesh.operator.local import local_engine_settings, local_router_settings

    pool = load_pool_file(str(path))
    roles = [role for role in pool.roles for _ in range(pool.bounds(role)[0])]
    source = pool.spec["model"]["source"]
    return PoolPlan(
        name=pool.name,
        engines=len(roles),
        model=None if source == BUNDLED else source,
        engine=local_engine_settings(pool),
        router=local_router_settings(pool),
        roles=roles if pool.mode == "disaggregated" else None,
        pool=pool,
    )


@dataclass
class Child:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        return tail(self.log, lines)


def _spawn(name: str, args: list[str], port: int, workdir: Path) -> Child:
    """In its own session (Ctrl-C reaches only `kvmesh up`, which stops the pool in order), and stopped with
    `kvmesh up` even if that is killed."""
    log = workdir / f"{name}.log"
    return Child(name, f"http://127.0.0.1:{port}", spawn(args, log, new_session=True), log)


def _wait_healthy(children: list[Child], timeout: float) -> Child | None:
    """Wait until every child answers /health 200; the first child that died instead, if one did."""
    pending = list(children)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while pending and time.monotonic() < deadline:
            for child in list(pending):
                if child.process.poll() is not None:
                    return child
                try:
                    if client.get(child.url + "/health").status_code == 200:
                        pending.remove(child)
                except httpx.TransportError:
                    pass
            time.sleep(0.25)
    if pending:
        raise TimeoutError(f"{', '.join(c.name for c in pending)} not healthy after {timeout:.0f} s")
    return None


class _ScalingWatch:
    """The operator's scaler over the local engines, every `scaling.intervalSeconds`: its decisions are printed
    (the engines' set is fixed here: the router's static pod list cannot grow at run time)."""

    def __init__(self, plan: PoolPlan, engines: list[Child]) -> None:
        from kvmesh.operator.local import Scaler

        self.engines = engines
        self.roles = plan.roles or ["both"] * len(engines)
        self.scaler = Scaler(plan.pool)
        self.interval = plan.pool.spec["scaling"]["intervalSeconds"]
        self.replicas = {role: self.roles.count(role) for role in set(self.roles)}
        self.next = time.monotonic()

    def tick(self) -> None:
        from kvmesh.operator.local import describe

        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + self.interval
        texts: dict[str, tuple[str, str]] = {}
        with httpx.Client(timeout=2.0) as client:
            for child, role in zip(self.engines, self.roles, strict=True):
                try:
                    answer = client.get(child.url + "/metrics")
                except httpx.TransportError:
                    continue
                if answer.status_code == 200:
                    texts[child.name] = (role, answer.text)
        decision = self.scaler.step(time.monotonic(), texts, self.replicas)
        for line in describe(decision, self.replicas):
            print(f"kvmesh up: scaler: {line}", file=sys.stderr, flush=True)
        self.replicas = {**self.replicas, **decision.replicas}


def _stop(children: list[Child]) -> None:
    """Stop every child: SIGINT, then SIGKILL after 20 s. A second Ctrl-C or SIGTERM cannot interrupt this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop([child.process for child in children], timeout=20)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def prometheus_targets(plan: PoolPlan, children: list[Child]) -> list[dict[str, object]]:
    """Prometheus file_sd targets for every process of the pool, labelled as the chart's PodMonitor labels pods
    in Kubernetes (namespace, pool, role, pod), so the dashboards and alerts work on a local pool unchanged."""
    roles = [*(plan.roles or ["both"] * plan.engines), "router"]
    return [{"targets": [child.url.removeprefix("http://")],
             "labels": {"namespace": "local", "pool": plan.name, "role": role, "pod": child.name}}
            for child, role in zip(children, roles, strict=True)]


def run_pool(plan: PoolPlan, router_port: int, ready_file: str | None = None,
             targets_file: str | None = None) -> int:
    """Start the pool and supervise it until Ctrl-C or SIGTERM (0) or a child's death (1)."""
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"kvmesh up: preparing model {plan.model or 'SmolLM2-135M-Instruct (bundled)'} ...", file=sys.stderr)
    model_dir = resolve_model_dir(plan.model)
    threads = max(1, (os.cpu_count() or 2) // plan.engines)
    workdir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{plan.name}-"))
    engine_file = workdir / "engine.yaml"
    real = {"threads": threads, "kv_cache_memory_mib": 256}  # simulated engines take their profile's budget
    engine_file.write_text(yaml.safe_dump({"engine": {**({} if plan.sim else real), **plan.engine}}))
    engine_args = ["sim-engine", "--profile", plan.sim] if plan.sim else ["serve", "--model", str(model_dir)]
    children: list[Child] = []
    try:
        for i in range(plan.engines):
            port = free_port()
            role = ["--role", plan.roles[i]] if plan.roles else []
            children.append(_spawn(f"engine-{i}", [*engine_args, "--config", str(engine_file), "--port", str(port),
                                                   *role, "--log-level", "warning"], port, workdir))
        router_file = workdir / "router.yaml"
        router_file.write_text(yaml.safe_dump({"router": {"pool": plan.name, **plan.router,
                                                          "pods": [c.url for c in children]}}))
        children.append(_spawn("router", ["router", "--config", str(router_file), "--model", str(model_dir),
                                          "--port", str(router_port), "--log-level", "warning"], router_port,
                               workdir))
        kind = f"simulated ({plan.sim}) " if plan.sim else ""
        print(f"kvmesh up: starting {plan.engines} {kind}engines and a router (logs in {workdir}) ...", file=sys.stderr)
        dead = _wait_healthy(children, HEALTH_TIMEOUT_SECONDS)
        if dead is not None:
            print(f"kvmesh up: {dead.name} exited with {dead.process.returncode}:\n{dead.tail()}", file=sys.stderr)
            return 1
        endpoint = f"http://127.0.0.1:{router_port}/v1"
        print(f"kvmesh up: pool {plan.name!r} ready: {plan.engines} engines behind {endpoint}", flush=True)
        if targets_file:  # before the ready file: whoever waits on that finds the targets too
            Path(targets_file).write_text(json.dumps(prometheus_targets(plan, children), indent=2))
        if ready_file:
            Path(ready_file).write_text(endpoint)
        watch = _ScalingWatch(plan, children[:-1]) if plan.pool is not None else None
        while True:
            for child in children:
                if child.process.poll() is not None:
                    print(f"kvmesh up: {child.name} exited with {child.process.returncode}; stopping the pool:\n"
                          f"{child.tail()}", file=sys.stderr)
                    return 1
            if watch is not None:
                watch.tick()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("kvmesh up: stopping", file=sys.stderr)
        return 0
    except TimeoutError as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(children)
