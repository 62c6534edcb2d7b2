"""`kvmesh up`: a whole pool on one machine. N engines and a router as child processes, from flags or an
InferencePool YAML file; waits until every child is healthy, prints the endpoint, and stops everything on
Ctrl-C or SIGTERM (gracefully: the router drains first, then the engines; `stop_pool`) or as soon as one child
dies unasked (with the tail of its log). From a pool file, the operator's scaler runs too and its decisions are
carried out: engines start (warmed from a peer), or the coldest drain and stop, the router follows its pods file,
the engines' LoRA adapters are kept equal to the spec's, and the operator's metrics are served on a loopback port.
The file is followed as the operator follows the CRD: an edit is read, checked as a pool, and applied (replicas,
the scaler's settings, adapters), or reported and ignored, the pool running on its last good spec (`PoolFile`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml
from prometheus_client import start_http_server

from kvmesh.engine.model.loader import resolve_model_dir
from kvmesh.engine.protocol import DRAIN_PATH
from kvmesh.processes import (
    free_port,
    spawn,
    tail,
    wait_healthy,
    wait_or_kill,
    write_atomically,
    write_json_atomically,
)
from kvmesh.router.config import SHUTDOWN_DRAIN_SECONDS

if TYPE_CHECKING:  # the operator loads only for a pool file
    from kvmesh.operator.local import LocalPod

HEALTH_TIMEOUT_SECONDS = 600.0
LOCAL_NAMESPACE = "local"  # a local pool's namespace: its targets' `namespace`, its operator's `pool_namespace`
LOCAL_DATABASE = "pool.db"  # in the pool's work folder: the router's SQLite database when the pool names none


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
    file: str | None = None  # the file it was read from: followed while the pool runs


def plan_from_file(path: str | Path) -> PoolPlan:
    """A local pool from an InferencePool file, read through operator/crd.py (the cluster's defaults and checks):
    each role's minimum replicas, the model, and the engine and router settings the operator would write."""
    from kvmesh.operator.crd import BUNDLED
    from kvmesh.operator.local import local_engine_settings, local_router_settings

    pool = read_pool_file(path)
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
        file=str(path),
    )


def read_pool_file(path: str | Path) -> Any:
    """The local pool a file holds, read and checked by operator/crd.py as the cluster's API server and operator
    check a pool. Raises OSError or ValueError (a YAML error, or the spec's: SpecError) naming the problem."""
    from kvmesh.operator.crd import load_pool_file

    try:
        return replace(load_pool_file(str(path)), namespace=LOCAL_NAMESPACE)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None


class PoolFile:
    """The pool file, polled for edits: its modification time, size and inode, read once per supervision loop.
    A poll rather than inotify: no extra dependency, any platform, and an editor that saves by renaming a new
    file over the old one (vim, most IDEs) is seen like one that writes in place; half a second of delay is
    nothing next to a scaling interval. The first poll counts as a change (the file is read again, and an
    unchanged pool is no news), so an edit made while the pool was starting is not missed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.seen: tuple[int, int, int] | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def changed(self) -> bool:
        """Whether the file changed since the last call (a file gone or unreadable is a change too)."""
        now = self._signature()
        if now == self.seen:
            return False
        self.seen = now
        return True

    def read(self) -> tuple[Any, str | None]:
        """The pool the file holds now, or None and why not. Never raises: a file that cannot be read or is no
        valid pool (OSError, a YAML or spec ValueError, or any shape the checks did not foresee) is the user's to
        fix, and the pool runs on its last good spec meanwhile."""
        try:
            return read_pool_file(self.path), None
        except (OSError, ValueError) as exc:
            return None, str(exc)
        except Exception as exc:  # not a crash of the whole pool for an edit of its file
            return None, f"{exc!r} (reading it failed unexpectedly)"


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
    """Wait until every child answers /health 200; the first child found dead instead, if one died. Raises
    TimeoutError after `timeout` s in all."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            wait_healthy(child.url, child.process, max(0.0, deadline - time.monotonic()))
        except RuntimeError:  # it exited before answering
            return child
    return None


STARTING, SERVING, DRAINING, STOPPING = "starting", "serving", "draining", "stopping"
DRAIN_TIMEOUT_SECONDS = 120.0  # a drained engine is stopped once its requests finish, or after this
STOP_TIMEOUT_SECONDS = 20.0  # then SIGKILL
# Stopping the pool (`stop_pool`): the router finishes its open requests and streams within SHUTDOWN_DRAIN_SECONDS
# of its signal (router/config.py) and is SIGKILLed only after this, longer bound...
ROUTER_STOP_SECONDS = SHUTDOWN_DRAIN_SECONDS + 10.0
# ...then the engines finish what they still run (requests sent to them directly) for up to this long, are sent
# SIGINT, and are SIGKILLed STOP_TIMEOUT_SECONDS later.
ENGINES_DRAIN_SECONDS = 30.0
STOPPED_AT_ONCE = 130  # the exit status after a second Ctrl-C: 128 + SIGINT, as a shell reports an interrupted command


@dataclass
class Engine:
    """One engine of a local pool and where it is in its life: starting (not yet in the pods file), serving,
    draining (out of the pods file, finishing its requests), stopping (SIGINT sent: its exit is expected)."""

    child: Child
    role: str
    state: str = STARTING
    deadline: float = 0.0  # draining: stop it by then anyway; stopping: SIGKILL by then


class LocalEngines:
    """The engines of a local pool, started and stopped as the scaler asks, with the router's pods file (and the
    Prometheus targets file, if any) kept equal to the engines that serve. Engines the scaler adds start from
    `scaled_args` (the initial ones have no peer to be warmed from, so they may differ)."""

    def __init__(self, plan: PoolPlan, engine_args: list[str], workdir: Path, targets_file: str | None,
                 scaled_args: list[str] | None = None) -> None:
        self.plan = plan
        self.engine_args = engine_args
        self.scaled_args = scaled_args or engine_args
        self.workdir = workdir
        self.pods_file = workdir / "pods.json"
        self.targets_file = targets_file
        self.router: Child | None = None
        self.operator_url: str | None = None  # the local operator's /metrics, for the targets file
        self.engines: list[Engine] = []
        self._started = 0

    def start(self, role: str, initial: bool = False) -> Engine:
        port = free_port()
        flags = ["--role", role] if self.plan.roles else []
        args = self.engine_args if initial else self.scaled_args
        child = _spawn(f"engine-{self._started}", [*args, "--port", str(port), *flags, "--log-level", "warning"],
                       port, self.workdir)
        self._started += 1
        engine = Engine(child, role)
        self.engines.append(engine)
        return engine

    def replicas(self) -> dict[str, int]:
        """Engines per role that count towards its replicas: starting or serving."""
        counts = {role: 0 for role in self.plan.pool.roles} if self.plan.pool is not None else {}
        for engine in self.engines:
            if engine.state in (STARTING, SERVING):
                counts[engine.role] = counts.get(engine.role, 0) + 1
        return counts

    def serving(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.state == SERVING]

    def observable(self) -> list[Engine]:
        """Engines the operator observes (as it scrapes every pod not being deleted): starting or serving. A
        starting engine that answers /metrics before /health (one waiting for its warm-up) is warmed from there."""
        return [engine for engine in self.engines if engine.state in (STARTING, SERVING)]

    def scale(self, role: str, replicas: int, deletion_costs: Mapping[str, int] | None = None) -> None:
        """Start engines of `role`, or drain some, until `replicas` start or serve. The engines drained are the
        pods the cluster operator's ReplicaSet would remove (operator/scale_in.py): starting ones first, then the
        lowest of the operator's `deletion_costs` (the coldest cache, the fewest requests in flight), then the
        newest."""
        from kvmesh.operator.scale_in import Candidate, removal_order

        have = [engine for engine in self.engines if engine.role == role and engine.state in (STARTING, SERVING)]
        for _ in range(replicas - len(have)):
            engine = self.start(role)
            print(f"kvmesh up: starting {engine.child.name} ({role})", file=sys.stderr, flush=True)
        by_name = {engine.child.name: engine for engine in have}
        order = removal_order([Candidate(e.child.name, e.state == SERVING) for e in reversed(have)],
                              deletion_costs or {})
        for engine in [by_name[name] for name in order[:max(0, len(have) - replicas)]]:
            if engine.state == STARTING:
                self._stop(engine)
            else:
                engine.state, engine.deadline = DRAINING, time.monotonic() + DRAIN_TIMEOUT_SECONDS
                print(f"kvmesh up: draining {engine.child.name} ({role})", file=sys.stderr, flush=True)
        self.publish()

    def unexpected_exit(self) -> Child | None:
        """A child that died without being told to (an engine stopping on request is no failure)."""
        for child in [e.child for e in self.engines if e.state != STOPPING] + ([self.router] if self.router else []):
            if child.process.poll() is not None:
                return child
        return None

    def progress(self, client: httpx.Client) -> None:
        """Move every engine on: started ones that answer /health serve; drained ones with no requests left (or
        out of time) stop; stopped ones that exited are forgotten (SIGKILL if they take too long)."""
        changed = False
        now = time.monotonic()
        for engine in list(self.engines):
            if engine.state == STARTING and _answers(client, "GET", engine.child.url + "/health"):
                engine.state, changed = SERVING, True
                print(f"kvmesh up: {engine.child.name} serving", file=sys.stderr, flush=True)
            elif engine.state == DRAINING:
                left = _answers(client, "POST", engine.child.url + DRAIN_PATH)
                if now > engine.deadline or (left is not None and left["running"] + left["waiting"] == 0):
                    self._stop(engine)
            elif engine.state == STOPPING:
                if engine.child.process.poll() is not None:
                    self.engines.remove(engine)
                    print(f"kvmesh up: {engine.child.name} stopped", file=sys.stderr, flush=True)
                elif now > engine.deadline:
                    engine.child.process.kill()
        if changed:
            self.publish()

    def publish(self) -> None:
        """Rewrite the pods file (and the targets file) from the serving engines, each atomically: the router
        and Prometheus never read half a file."""
        serving = self.serving()
        write_json_atomically(self.pods_file, {"pods": [{"url": e.child.url, "role": e.role} for e in serving]})
        if self.targets_file and self.router is not None:
            members = [(e.child, e.role) for e in serving] + [(self.router, "router")]
            targets = prometheus_targets(self.plan.name, members, self.operator_url)
            write_json_atomically(Path(self.targets_file), targets)

    def children(self) -> list[Child]:
        return [e.child for e in self.engines] + ([self.router] if self.router else [])

    def _stop(self, engine: Engine) -> None:
        if engine.child.process.poll() is None:
            engine.child.process.send_signal(signal.SIGINT)
        engine.state, engine.deadline = STOPPING, time.monotonic() + STOP_TIMEOUT_SECONDS


def _wait_routed(client: httpx.Client, engines: LocalEngines, count: int, timeout: float) -> Child | None:
    """Until the router routes to `count` engines (its /health lists them): "ready" means the whole pool serves,
    not only the first engine the router happened to scrape. The child that died meanwhile, if one did;
    TimeoutError past `timeout`."""
    assert engines.router is not None
    deadline = time.monotonic() + timeout
    while len((_answers(client, "GET", engines.router.url + "/health") or {}).get("pods", [])) < count:
        dead = engines.unexpected_exit()
        if dead is not None:
            return dead
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not see all {count} engines healthy within {timeout:.0f} s")
        time.sleep(0.1)
    return None


def _answers(client: httpx.Client, method: str, url: str) -> dict[str, Any] | None:
    """The JSON of a 200 answer; None for any other answer or none."""
    try:
        reply = client.request(method, url)
        return reply.json() if reply.status_code == 200 else None
    except (httpx.TransportError, ValueError):
        return None


def observe_engines(engines: Sequence[Engine], scrape: Callable[[str], str] | None = None) -> list[LocalPod]:
    """The engines as the operator observes its pods: every one's /metrics, scraped all at once by the operator's
    helper (operator/engines.py: a slow engine delays no other's observation, and the tick waits at most the
    scrape timeout); one that does not answer in time is left out of this tick."""
    from kvmesh.operator.engines import http_scrape, scrape_all
    from kvmesh.operator.local import LocalPod

    texts = scrape_all({e.child.name: e.child.url + "/metrics" for e in engines}, scrape or http_scrape)
    return [LocalPod(e.child.name, e.role, e.child.url, text, e.state == SERVING)
            for e in engines if isinstance(text := texts[e.child.name], str)]


class _ScalingWatch:
    """The operator's tick over the local engines, every `scaling.intervalSeconds`: engines that began serving
    are warmed from a peer, each decision is printed and carried out within the pool's replica bounds (engines
    started, or drained and stopped), the serving engines' LoRA adapters are synced with the spec's, and all is
    recorded in the operator's metrics, which a loopback port serves (the targets file lists it) until `close`.
    Before each tick, an edit of the pool file is followed (`follow_file`)."""

    def __init__(self, plan: PoolPlan, engines: LocalEngines) -> None:
        from kvmesh.operator.local import LocalOperator

        self.pool = plan.pool
        self.engines = engines
        self.operator = LocalOperator(plan.pool)
        self.interval = plan.pool.spec["scaling"]["intervalSeconds"]
        self.next = time.monotonic()
        self.file = PoolFile(plan.file) if plan.file else None
        self.adapters_said = ""  # the adapters' last reported state: a new one is printed once
        port = free_port()
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=self.operator.metrics.registry)
        engines.operator_url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def follow_file(self) -> None:
        """Re-read the pool file if it changed; apply what a running pool can take on (replica bounds and the
        scaler's settings at once: the next tick runs now; adapters through the sync, and in the engine files new
        engines start from; a cluster's own fields are ignored, and said so) or say why not (it changes what the
        processes started with: operator/local.py `start_inputs`), running on the last good spec. Never raises: a
        bad edit is the user's to fix."""
        from kvmesh.operator.crd import transition_errors
        from kvmesh.operator.local import ignored_locally, needs_restart

        if self.file is None or not self.file.changed():
            return
        path = self.file.path
        pool, problem = self.file.read()
        if pool is None:
            _say(f"{path} changed but cannot be used: {problem}; the pool runs on as before (fix the file to go on)")
            return
        if broken := transition_errors(self.pool.spec, pool.spec):  # what the API server refuses on an update
            _say(f"{path} changed in a way a running pool refuses: {'; '.join(broken)}; none of this edit is "
                 f"applied, the pool runs on as before")
            return
        stuck = needs_restart(self.pool, pool)
        if stuck:
            _say(f"{path} changed what the pool started with ({', '.join(stuck)}), which running engines and "
                 f"router cannot take on; none of this edit is applied, the pool runs on as before (restart "
                 f"kvmesh up to apply it)")
            return
        if pool == self.pool:
            return
        previous, self.pool = self.pool, pool
        self.engines.plan.pool = pool
        self.operator.follow(pool)
        self.interval = pool.spec["scaling"]["intervalSeconds"]
        self.next = time.monotonic()
        _set_engine_adapters(self.engines.workdir, pool)
        bounds = ", ".join(f"{role} {low}..{high}" for role in pool.roles for low, high in [pool.bounds(role)])
        adapters = ", ".join(a["name"] for a in pool.spec["model"]["loraAdapters"]) or "none"
        ignored = ignored_locally(previous, pool)
        unused = f"; ignored locally, a cluster's only: {', '.join(ignored)}" if ignored else ""
        _say(f"{path} changed: following it (replicas {bounds}; adapters {adapters}{unused})")

    def tick(self) -> None:
        from kvmesh.operator.local import describe

        self.follow_file()
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + self.interval
        pods = observe_engines(self.engines.observable())
        before = self.engines.replicas()
        try:
            tick = self.operator.decide(time.monotonic(), pods, before)
        except Exception as exc:  # as the cluster operator's timer: this tick fails, the pool keeps serving
            _say(f"scaler: this tick failed ({exc!r}); the pool stays as it is")
            return
        for line in describe(tick.decision, before):
            _say(f"scaler: {line}")
        for role, n in tick.decision.changed(before).items():
            self.engines.scale(role, n, tick.deletion_costs)  # the decision is already within the pool's bounds
        self.operator.record(tick.decision, self.engines.replicas(), before)
        for line in self.operator.warm_up(tick.warmups):  # after scaling, as the operator does
            _say(f"warm-up: {line}")
        self.sync_adapters()

    def sync_adapters(self) -> None:
        from kvmesh.operator.lora import EnginePod

        def pod(engine: Engine) -> EnginePod:
            return EnginePod(engine.child.name, engine.role, engine.child.url)

        alive = {pod(e).life for e in self.engines.observable()}
        adapters = self.operator.sync_adapters([pod(e) for e in self.engines.serving()], alive)
        for line in adapters.lines:
            _say(f"adapters: {line}")
        said = f"{adapters.status.reason}: {adapters.status.message}" if adapters.status else ""
        if said != self.adapters_said and adapters.status is not None:
            _say(f"adapters {said}")
        self.adapters_said = said


def _say(line: str) -> None:
    print(f"kvmesh up: {line}", file=sys.stderr, flush=True)


def _set_engine_adapters(workdir: Path, pool: Any) -> None:
    """Give the engines started from now on the spec's adapters (as the operator's ConfigMap does for new pods):
    the engine files' `lora_modules`, each replaced atomically."""
    from kvmesh.operator.desired import LORA_MODULES
    from kvmesh.operator.local import local_engine_settings

    modules = local_engine_settings(pool).get(LORA_MODULES)
    for path in (workdir / "engine.yaml", workdir / "engine-scaled.yaml"):
        if not path.exists():
            continue
        settings = dict(yaml.safe_load(path.read_text())["engine"])
        settings.pop(LORA_MODULES, None)
        if modules:
            settings[LORA_MODULES] = modules
        write_atomically(path, yaml.safe_dump({"engine": settings}))


class _StopNow(Exception):
    """A second Ctrl-C or SIGTERM while the pool stops gracefully."""


def _stop_now(signum: int, frame: object) -> None:
    raise _StopNow


def stop_pool(engines: LocalEngines, client: httpx.Client, router_signal: int = signal.SIGINT) -> bool:
    """Stop the pool without cutting what it serves. First the router, with `router_signal` (the one `kvmesh up`
    got: after SIGINT it closes its port at once, after SIGTERM it serves new requests SHUTDOWN_SETTLE_SECONDS
    more, as in Kubernetes) while the engines go on serving its open requests and streams, which it lets finish
    within SHUTDOWN_DRAIN_SECONDS and exits; SIGKILL only after ROUTER_STOP_SECONDS. Then the engines: drained
    (POST /v1/admin/drain: they refuse new requests) until none runs or queues a request, at most
    ENGINES_DRAIN_SECONDS; then SIGINT, and SIGKILL STOP_TIMEOUT_SECONDS later. A second Ctrl-C or SIGTERM
    kills whatever is left at once: False then."""
    signal.signal(signal.SIGINT, _stop_now)
    signal.signal(signal.SIGTERM, _stop_now)
    try:
        router = engines.router
        if router is not None and router.process.poll() is None:
            print(f"kvmesh up: stopping the router: its open requests and streams finish first (up to "
                  f"{SHUTDOWN_DRAIN_SECONDS:g} s; Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            router.process.send_signal(router_signal)
            wait_or_kill([router.process], ROUTER_STOP_SECONDS)
        running = [e for e in engines.engines if e.child.process.poll() is None]
        told = [e for e in running if e.state != STOPPING]  # those stopping were drained and signalled already
        print("kvmesh up: router stopped; draining the engines", file=sys.stderr, flush=True)
        _drain(client, told, time.monotonic() + ENGINES_DRAIN_SECONDS)
        for engine in told:
            if engine.child.process.poll() is None:
                engine.child.process.send_signal(signal.SIGINT)
        wait_or_kill([e.child.process for e in running], STOP_TIMEOUT_SECONDS)
        print("kvmesh up: stopped", file=sys.stderr, flush=True)
        return True
    except _StopNow:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children = engines.children()[::-1]  # the router first: its clients see their streams cut, not ended
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
        wait_or_kill([child.process for child in children], STOP_TIMEOUT_SECONDS)
        print("kvmesh up: stopped at once", file=sys.stderr, flush=True)
        return False


def _drain(client: httpx.Client, engines: list[Engine], deadline: float) -> None:
    """Drain every engine and wait until none runs or queues a request (each drain answer says how many), or
    until `deadline`. An engine that does not answer (exited, or still loading) has nothing to finish."""

    def left(engine: Engine) -> int:
        answer = _answers(client, "POST", engine.child.url + DRAIN_PATH)
        return 0 if answer is None else answer["running"] + answer["waiting"]

    said = False
    while (requests := {e.child.name: n for e in engines if (n := left(e)) > 0}) and time.monotonic() < deadline:
        if not said:
            print(f"kvmesh up: waiting for {sum(requests.values())} requests on {', '.join(requests)} to finish "
                  f"(up to {deadline - time.monotonic():.0f} s)", file=sys.stderr, flush=True)
            said = True
        engines = [e for e in engines if e.child.name in requests]
        time.sleep(0.2)


def prometheus_targets(pool: str, members: list[tuple[Child, str]],
                       operator_url: str | None = None) -> list[dict[str, object]]:
    """Prometheus file_sd targets for every (process, role) of the pool, labelled as the chart's PodMonitor labels
    pods in Kubernetes (namespace, pool, role, pod), so the dashboards and alerts work on a local pool unchanged;
    and the local operator's, labelled as the chart's ServiceMonitor labels the operator (namespace, pod: no pool
    or role, which its series carry themselves and a target label of the same name would rename)."""
    targets: list[dict[str, object]] = [
        {"targets": [child.url.removeprefix("http://")],
         "labels": {"namespace": LOCAL_NAMESPACE, "pool": pool, "role": role, "pod": child.name}}
        for child, role in members]
    if operator_url is not None:
        targets.append({"targets": [operator_url.removeprefix("http://")],
                        "labels": {"namespace": LOCAL_NAMESPACE, "pod": "operator"}})
    return targets


def run_pool(plan: PoolPlan, router_port: int, ready_file: str | None = None,
             targets_file: str | None = None) -> int:
    """Start the pool and supervise it until Ctrl-C or SIGTERM (0) or a child's death (1); then stop it
    gracefully (`stop_pool`), or at once on a second Ctrl-C (STOPPED_AT_ONCE)."""
    stopped_by: list[int] = []  # the signal that stopped the pool, if one did

    def interrupt(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    print(f"kvmesh up: preparing model {plan.model or 'SmolLM2-135M-Instruct (bundled)'} ...", file=sys.stderr)
    model_dir = resolve_model_dir(plan.model)
    threads = max(1, (os.cpu_count() or 2) // plan.engines)
    workdir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{plan.name}-"))
    real = {"threads": threads, "kv_cache_memory_mib": 256}  # simulated engines take their profile's budget
    settings = {**({} if plan.sim else real), **plan.engine}
    engine_args = ["sim-engine", "--profile", plan.sim] if plan.sim else ["serve", "--model", str(model_dir)]
    initial = [*engine_args, "--config", str(_engine_file(workdir, "engine", settings))]
    scaled = None
    if plan.pool is not None:  # engines the scaler adds wait for their warm-up as the operator's pods do
        from kvmesh.operator.desired import warmup_grace_seconds

        # what this writes is what operator/local.py `start_inputs` lists: an edit changing it needs a restart
        gated = {**settings, "warmup_grace_seconds": warmup_grace_seconds(plan.pool)}
        scaled = [*engine_args, "--config", str(_engine_file(workdir, "engine-scaled", gated))]
    engines = LocalEngines(plan, initial, workdir, targets_file, scaled)
    try:
        code = _supervise(plan, engines, model_dir, router_port, ready_file)
    finally:  # also when supervising failed unexpectedly
        with httpx.Client(timeout=2.0) as client:
            graceful = stop_pool(engines, client, stopped_by[0] if stopped_by else signal.SIGINT)
    return code if graceful else STOPPED_AT_ONCE


def _supervise(plan: PoolPlan, engines: LocalEngines, model_dir: Path, router_port: int,
               ready_file: str | None) -> int:
    """Start the pool's processes, wait until the router routes to every engine, then keep the pool as the scaler
    wants it until Ctrl-C or SIGTERM (0), a child's unasked death or a start that takes too long (1)."""
    workdir = engines.workdir
    watch: _ScalingWatch | None = None
    try:
        for i in range(plan.engines):  # in the pods file from the start, as a static list would be
            engines.start(plan.roles[i] if plan.roles else "both", initial=True).state = SERVING
        engines.publish()
        router_file = workdir / "router.yaml"
        # a database of its own (the request log, the Batch API's files and batches) unless the pool names one
        database = {"database_url": f"sqlite:///{workdir / LOCAL_DATABASE}"}
        router_file.write_text(yaml.safe_dump({"router": {"pool": plan.name, **database, **plan.router,
                                                          "pods_file": str(engines.pods_file)}}))
        engines.router = _spawn("router", ["router", "--config", str(router_file), "--model", str(model_dir),
                                           "--port", str(router_port), "--log-level", "warning"], router_port,
                                workdir)
        kind = f"simulated ({plan.sim}) " if plan.sim else ""
        print(f"kvmesh up: starting {plan.engines} {kind}engines and a router (logs in {workdir}) ...", file=sys.stderr)
        dead = _wait_healthy(engines.children(), HEALTH_TIMEOUT_SECONDS)
        if dead is not None:
            print(f"kvmesh up: {dead.name} exited with {dead.process.returncode}:\n{dead.tail()}", file=sys.stderr)
            return 1
        with httpx.Client(timeout=2.0) as client:
            dead = _wait_routed(client, engines, plan.engines, HEALTH_TIMEOUT_SECONDS)
            if dead is not None:
                print(f"kvmesh up: {dead.name} exited with {dead.process.returncode}:\n{dead.tail()}", file=sys.stderr)
                return 1
            if plan.pool is not None:
                watch = _ScalingWatch(plan, engines)
                watch.tick()  # the first decision: the operator's series exist once its target is listed
                print(f"kvmesh up: operator metrics at {engines.operator_url}/metrics", file=sys.stderr)
            engines.publish()  # the targets file, before the ready file: whoever waits on it finds the targets too
            endpoint = f"http://127.0.0.1:{router_port}/v1"
            print(f"kvmesh up: pool {plan.name!r} ready: {plan.engines} engines behind {endpoint}", flush=True)
            if ready_file:
                Path(ready_file).write_text(endpoint)
            while True:
                dead = engines.unexpected_exit()
                if dead is not None:
                    print(f"kvmesh up: {dead.name} exited with {dead.process.returncode}; stopping the pool:\n"
                          f"{dead.tail()}", file=sys.stderr)
                    return 1
                engines.progress(client)
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
        if watch is not None:
            watch.close()


def _engine_file(workdir: Path, name: str, settings: dict[str, Any]) -> Path:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"engine": settings}))
    return path
