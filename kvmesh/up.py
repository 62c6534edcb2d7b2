"""`kvmesh up`: a whole pool on one machine. N engines and a router as child processes, from flags or an
InferencePool YAML file; waits until every child is healthy, prints the endpoint, and stops everything on Ctrl-C or
SIGTERM (gracefully: the router drains first, then the engines; `stop_pool`). A child that dies unasked once the
pool serves is restarted on its port after a back-off, as the kubelet restarts a crashed container (`CrashBackOff`),
while the router serves on from the other engines; one that dies before the pool is first ready stops it (with the
tail of its log): a bad flag or model would only crash again. From a pool file, the operator's scaler runs too and
its decisions are carried out: engines start (warmed from a peer), or the coldest drain and stop (all of them in a
pool that scales to zero and idles, which starts again on a request its router holds), the router follows
its pods file, the engines' LoRA adapters are kept equal to the spec's, and the operator's metrics are served on a
loopback port. The file is followed as the operator follows the CRD: an edit is read, checked as a pool, and applied
(replicas, the scaler's settings, adapters at once; engine settings by replacing the engines one at a time, router
settings by restarting the router on its port, as the operator's rollout does), or reported and ignored, the pool
running on its last good spec (`PoolFile`).

The pool has an internal token (engine/internal_token.py), as a cluster pool has its Secret: a fresh one in the
work folder (`INTERNAL_TOKEN_FILE`, readable by its owner only), named to every engine and the router by
KVMESH_INTERNAL_TOKEN_FILE, so its engines answer only the pool (the router, each other, and `kvmesh up` itself:
its drains, warm-ups and adapter calls send it); /health and /metrics stay open."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml
from prometheus_client import start_http_server

from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV, InternalToken, new_token, write_token_file
from kvmesh.engine.model.loader import resolve_model_dir
from kvmesh.engine.protocol import DRAIN_PATH, HOST_TIER_DIR, INTERNAL_HTTP_CLIENT, LIVENESS_PATH
from kvmesh.processes import (
    bind_problem,
    free_port,
    log_size,
    spawn,
    tail,
    wait_or_kill,
    write_atomically,
    write_json_atomically,
)
from kvmesh.router.config import SHUTDOWN_DRAIN_SECONDS

if TYPE_CHECKING:  # the operator loads only for a pool file
    from kvmesh.operator.local import LocalPod
    from kvmesh.operator.memory import RouterView

HEALTH_TIMEOUT_SECONDS = 600.0
# Test-only: how many seconds pass on the local operator's clock per real second, so a test sees a pool idle for
# scaling.scaleToZero.idleSeconds (at least 60) in a few seconds. Everything the operator times runs that much
# faster (its interval, the idle clock, the stabilization windows); unset: 1, real time.
CLOCK_RATE_ENV = "KVMESH_UP_CLOCK_RATE"
LOCAL_NAMESPACE = "local"  # a local pool's namespace: its targets' `namespace`, its operator's `pool_namespace`
LOCAL_DATABASE = "pool.db"  # in the pool's work folder: the router's SQLite database when the pool names none
INTERNAL_TOKEN_FILE = "internal-token"  # in the pool's work folder: the pool's internal token (0600)
# In the pool's work folder while it runs: the pid of its `kvmesh up`, so a later run can tell a run that was killed
# (SIGKILL, a crash) from a live one and remove its leftovers (`remove_leftovers`); removed at a clean-up, so a
# folder kept for its logs is left alone.
UP_PID_FILE = "kvmesh-up.pid"
# In the pool's work folder, when it writes a Prometheus targets file: that file's path and the router's target, so
# the next run empties the file of a run that was killed (`remove_leftovers`) as a clean stop does (`_empty_targets`).
TARGETS_RECORD = "targets-file.json"
# The pools' work folders live in the state folder (`state_dir`), or in this variable's folder when it is set.
STATE_DIR_ENV = "KVMESH_STATE_DIR"
WORKDIR_PREFIX = "kvmesh-"  # a pool's work folder: WORKDIR_PREFIX + its name + mkdtemp's suffix, in the state folder
INTERRUPTED = 130  # the exit status of a Ctrl-C before the pool started: 128 + SIGINT, as a shell reports it
# An engine's KV tier files (`LocalEngines.tier_paths`): the disk tier's folder (the engine's own default folder,
# a cache); the host tier's is HOST_TIER_DIR, shared memory.
DISK_TIER_DIR = Path.home() / ".cache" / "kvmesh"
# Liveness (`LocalEngines._check_liveness`), as the kubelet's probe (every 10 s, 3 failures): a serving engine's
# /livez is asked every LIVENESS_PERIOD_SECONDS (within LIVENESS_PROBE_TIMEOUT_SECONDS); one that has answered 200
# before and then not for LIVENESS_SECONDS (a hung process: stopped, deadlocked, swapping to death, or a step
# stalled: /livez 503) is killed and restarted by the crash back-off. A draining or warming engine answers 200.
LIVENESS_PERIOD_SECONDS = 2.0
LIVENESS_PROBE_TIMEOUT_SECONDS = 1.0
LIVENESS_SECONDS = 30.0
LIVENESS_ENV = "KVMESH_UP_LIVENESS_SECONDS"  # test-only: LIVENESS_SECONDS instead, so a hung engine goes in seconds


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
    each role's replicas as the operator creates them (its minimum; one for a pool that scales to zero, which idles
    down from there), the model, and the engine and router settings the operator would write."""
    from kvmesh.operator.crd import BUNDLED
    from kvmesh.operator.desired import initial_replicas
    from kvmesh.operator.local import local_engine_settings, local_router_settings

    pool = read_pool_file(path)
    roles = [role for role, n in initial_replicas(pool).items() for _ in range(n)]
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
    check a pool, the values of its programs' settings included (before any process starts, not as an engine's exit).
    Raises OSError or ValueError (a YAML error, or the spec's: SpecError) naming the problem."""
    from kvmesh.operator.crd import load_pool_file
    from kvmesh.operator.desired import check_program_files

    try:
        pool = replace(load_pool_file(str(path)), namespace=LOCAL_NAMESPACE)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None
    check_program_files(pool)
    return pool


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


# A crashed child's restarts (`CrashBackOff`): the kubelet's policy (10 s doubling to 5 min, reset after 10 min of
# running) scaled down for one machine, where a crash is more often a transient one (memory pressure, a killed
# process) than a broken image, and the person watching wants the engine back within seconds: 1 s doubling to 60 s
# (a crash loop costs at most one start a minute of CPU the other engines need), reset after 10 minutes of running.
BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 60.0
BACKOFF_RESET_SECONDS = 600.0


@dataclass
class CrashBackOff:
    """When a crashed child starts again: the first crash waits BACKOFF_FIRST_SECONDS, each crash after it twice the
    last delay up to BACKOFF_MAX_SECONDS, and a process that ran BACKOFF_RESET_SECONDS before crashing starts the
    count over. Pure (every time is passed in), so the policy is tested without waiting."""

    started: float  # when the current process started (time.monotonic)
    restarts: int = 0  # restarts so far, shown in `kvmesh up`'s lines
    delay: float = 0.0  # the last back-off; 0: none since the count (re)started
    due: float | None = None  # crashed: restart then; None while the process runs

    def crashed(self, now: float) -> float:
        """Record a crash at `now`; the delay until the restart (`due`)."""
        ran_long = now - self.started >= BACKOFF_RESET_SECONDS
        first = self.delay == 0.0 or ran_long
        self.delay = BACKOFF_FIRST_SECONDS if first else min(BACKOFF_MAX_SECONDS, 2 * self.delay)
        self.due = now + self.delay
        return self.delay

    def restarted(self, now: float) -> None:
        self.restarts, self.started, self.due = self.restarts + 1, now, None


@dataclass
class Child:
    """A child process of the pool and what starts it again on the same port, into the same log (appended: the
    log keeps what the crashed process wrote)."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)  # `kvmesh ...` arguments, the port included
    backoff: CrashBackOff = field(default_factory=lambda: CrashBackOff(time.monotonic()))
    env: dict[str, str] = field(default_factory=dict)  # the variables it starts with (the pool's token file)
    log_start: int = 0  # the log's size when the current process started: what it wrote begins there

    def tail(self, lines: int = 20) -> str:
        """The end of what the current process wrote (a crash line shows this life's error, not every earlier
        one's again)."""
        return tail(self.log, lines, self.log_start)

    @property
    def waiting(self) -> bool:
        """Crashed, waiting out its back-off."""
        return self.backoff.due is not None

    def crashed(self, now: float, what: str) -> None:
        """Say that it died unasked (`what` it was doing), with its log's tail, and start its back-off."""
        delay = self.backoff.crashed(now)
        log = self.tail()
        why = f":\n{log}" if log else " (it wrote nothing to its log)"
        _say(f"{self.name} exited with {_exit_status(self.process.returncode)} unasked{what}; restart "
             f"{self.backoff.restarts + 1} in {delay:g} s on {self.url}{why}")

    def respawn(self, now: float) -> None:
        """Start the same command line again, on its port unless another process took it meanwhile
        (`_move_if_port_taken`), once its back-off is over."""
        self.log_start = log_size(self.log)
        self.process = spawn(self.args, self.log, new_session=True, env=self.env)
        self.backoff.restarted(now)
        _say(f"{self.name} restarting (restart {self.backoff.restarts}) on {self.url}")


def _move_if_port_taken(child: Child) -> None:
    """Before an engine restarts: if another process took its port while it was down (its port is an ephemeral
    one, `free_port`, which the OS hands out again), it starts on a new free port instead of crash-looping on the
    old one; the pods file names its new URL once it serves (`publish`), and its tier files are named by the engine,
    not the port, so it finds them again."""
    port = httpx.URL(child.url).port
    if port is None or bind_problem(port) is None:
        return
    new = free_port()
    flag = child.args.index("--port")
    child.args[flag + 1] = str(new)
    child.url = local_url(new)
    _say(f"{child.name}'s port {port} is taken by another process: it restarts on port {new}")


def _exit_status(code: int | None) -> str:
    """A return code as a person reads it: a negative one is the signal that killed the process."""
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def local_url(port: int) -> str:
    """The URL of a child of the pool listening on `port`."""
    return f"http://127.0.0.1:{port}"


def _spawn(name: str, args: list[str], port: int, workdir: Path, env: Mapping[str, str] | None = None) -> Child:
    """In its own session (Ctrl-C reaches only `kvmesh up`, which stops the pool in order), and stopped with
    `kvmesh up` even if that is killed; `env`: more variables (`LocalEngines.child_env`). Its log is appended to
    (a router restarted for its settings writes into the same one)."""
    log = workdir / f"{name}.log"
    env = dict(env or {})
    start = log_size(log)
    return Child(name, local_url(port), spawn(args, log, new_session=True, env=env), log, args, env=env,
                 log_start=start)


def _wait_healthy(children: list[Child], timeout: float) -> Child | None:
    """Wait until every child answers /health 200; the first child found dead instead, if one died. All are
    watched at once: a router that exits at start (a model without a tokenizer) is seen while the engines still
    load, not once they are up. A 200 counts only from a child still running after it (whatever answers on the
    port of one that died is not it). Raises TimeoutError after `timeout` s in all."""
    deadline = time.monotonic() + timeout
    waiting = list(children)
    with httpx.Client(timeout=2.0, **INTERNAL_HTTP_CLIENT) as client:
        while waiting:
            if exited := next((c for c in waiting if c.process.poll() is not None), None):
                return exited  # before any health answer: an exit says more than another child's load error
            for child in list(waiting):
                try:
                    health = client.get(child.url + "/health")
                except httpx.TransportError:
                    healthy = False
                else:
                    if health.status_code == 503 and _status(health) == "error":  # its model failed to load
                        return child
                    healthy = health.status_code == 200
                if healthy:
                    if child.process.poll() is not None:
                        return child
                    waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(child.name for child in waiting)
                raise TimeoutError(f"{names} did not answer /health within {timeout:.0f} s")
            time.sleep(0.1)
    return None


def _status(reply: httpx.Response) -> str | None:
    """A /health answer's status field (None when the body is not the engine's JSON)."""
    try:
        body = reply.json()
    except ValueError:
        return None
    return body.get("status") if isinstance(body, dict) else None


def _failure(child: Child) -> str:
    """What a child that failed to start did, and the end of its log."""
    code = child.process.poll()
    how = f"exited with {_exit_status(code)}" if code is not None else "could not load its model"
    return f"{child.name} {how}:\n{child.tail()}"


STARTING, SERVING, DRAINING, STOPPING = "starting", "serving", "draining", "stopping"
CRASHED = "crashed"  # exited unasked: out of the pods file, restarted on its port after its back-off
COUNTED = (STARTING, SERVING, CRASHED)  # the states that count in a role's replicas, as a crash-looping pod counts
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
    draining (out of the pods file, finishing its requests), stopping (SIGINT sent: its exit is expected), crashed
    (exited unasked: waiting out its back-off, then starting again)."""

    child: Child
    role: str
    state: str = STARTING
    deadline: float = 0.0  # draining: stop it by then anyway; stopping: SIGKILL by then
    generation: int = 0  # the engine files' version it started from (`LocalEngines.generation`)
    replaces: str | None = None  # rolled in for this engine (a surge: not counted in the replicas until it is routed)
    answered: float | None = None  # when /health last answered (liveness); None: not since it (re)started
    probed: float = 0.0  # when /health was last asked (liveness)


class LocalEngines:
    """The engines of a local pool, started and stopped as the scaler asks, with the router's pods file (and the
    Prometheus targets file, if any) kept equal to the engines that serve. Engines the scaler adds start from
    `scaled_args` (the initial ones have no peer to be warmed from, so they may differ). When the engine files
    change (`roll`), the engines started before are replaced one at a time, and the router restarts after them. A
    child that exits unasked is restarted on its port after its back-off (`_restart_crashed`). With `token_file`,
    every child starts with the pool's internal token (`child_env`), and `token` sends it."""

    def __init__(self, plan: PoolPlan, engine_args: list[str], workdir: Path, targets_file: str | None,
                 scaled_args: list[str] | None = None, engine_defaults: Mapping[str, Any] | None = None,
                 token_file: Path | None = None) -> None:
        self.plan = plan
        self.child_env = {INTERNAL_TOKEN_FILE_ENV: str(token_file)} if token_file is not None else {}
        self.token = InternalToken(token_file)  # as httpx's auth: the calls of `kvmesh up` to its engines
        self.engine_args = engine_args
        self.scaled_args = scaled_args or engine_args
        self.engine_defaults = dict(engine_defaults or {})  # under the pool's settings in the engine files
        self.workdir = workdir
        self.pods_file = workdir / "pods.json"
        self.targets_file = targets_file
        self.router: Child | None = None
        self.router_args: list[str] = []  # what it (and a restarted one) starts with
        self.operator_url: str | None = None  # the local operator's /metrics, for the targets file
        self.engines: list[Engine] = []
        self._started = 0
        self.generation = 0  # the engine files' version: an engine started from an older one is rolled
        self.rolling: set[str] = set()  # the settings the engines are being rolled for (`start_inputs` keys)
        self.undo_roll: Callable[[], None] | None = None  # puts back the files and spec the roll under way left
        self.router_changes: set[str] = set()  # the settings the router restarts for, once the engines are rolled
        self.router_starting = False  # a restarted router not answering /health yet
        self.old_routers: list[tuple[Child, float]] = []  # restarted ones finishing their streams, SIGKILL by then
        self.liveness_seconds = float(os.environ.get(LIVENESS_ENV) or LIVENESS_SECONDS)
        self.ready = False  # the pool served: a stop before that keeps the logs (why did it not start?)

    def start(self, role: str, initial: bool = False) -> Engine:
        port = free_port()
        name = f"engine-{self._started}"
        flags = ["--role", role] if self.plan.roles else []
        args = self.engine_args if initial else self.scaled_args
        child = _spawn(name, [*args, "--port", str(port), *flags, *self._tier_flags(name), "--log-level", "warning"],
                       port, self.workdir, self.child_env)
        self._started += 1
        engine = Engine(child, role, generation=self.generation)
        self.engines.append(engine)
        return engine

    def tier_paths(self, name: str) -> tuple[Path, Path]:
        """Engine `name`'s host and disk KV tier files: named by this pool run (its work folder's unique name) and
        the engine, not by its port as an engine names them by default, so a crashed engine restarted with the same
        command line finds its tiers again, no other run's engine ever opens them, and `remove_tier_files` finds
        them all when the pool stops."""
        prefix = f"{self.workdir.name}-{name}"
        return Path(HOST_TIER_DIR) / f"{prefix}-host.kv", DISK_TIER_DIR / f"{prefix}-disk.kv"

    def _tier_flags(self, name: str) -> list[str]:
        """The `kvmesh serve` (or `kvmesh sim-engine`) flags naming engine `name`'s tier files (`tier_paths`);
        none for a path the pool's engine settings name themselves. Simulated engines get them too: a pool file's
        `hostTierMiB` gives them a host tier, which would otherwise go to the port-named default file, left in
        /dev/shm at every stop and opened by a later run's engine on the same port."""
        host, disk = self.tier_paths(name)
        settings = self.plan.engine
        return ([] if settings.get("kv_host_path") else ["--kv-host-path", str(host)]) + (
            [] if settings.get("kv_disk_path") else ["--kv-disk-path", str(disk)])

    def remove_tier_files(self, name: str | None = None) -> None:
        """Delete engine `name`'s tier files (every engine's of this run if None), once it has exited: a cache
        nobody will open again, which would otherwise fill /dev/shm and ~/.cache run after run."""
        pattern = f"{self.workdir.name}-{name or '*'}-*.kv"
        for folder in (Path(HOST_TIER_DIR), DISK_TIER_DIR):
            for path in folder.glob(pattern):
                path.unlink(missing_ok=True)

    def start_router(self, args: list[str], port: int) -> None:
        self.router_args = args
        self.router = _spawn("router", args, port, self.workdir, self.child_env)

    def replicas(self) -> dict[str, int]:
        """Engines per role that count towards its replicas: starting, serving or crashed (it comes back), less a
        roll's surge (it counts in place of the engine it replaces once that one drains)."""
        counts = {role: 0 for role in self.plan.pool.roles} if self.plan.pool is not None else {}
        for engine in self.engines:
            if engine.state in COUNTED and engine.replaces is None:
                counts[engine.role] = counts.get(engine.role, 0) + 1
        return counts

    def serving(self) -> list[Engine]:
        return [engine for engine in self.engines if engine.state == SERVING]

    def observable(self) -> list[Engine]:
        """Engines the operator observes (as it scrapes every pod not being deleted): starting or serving. A
        starting engine that answers /metrics before /health (one waiting for its warm-up) is warmed from there."""
        return [engine for engine in self.engines if engine.state in (STARTING, SERVING)]

    def scale(self, role: str, replicas: int, deletion_costs: Mapping[str, int] | None = None) -> None:
        """Start engines of `role`, or drain some, until `replicas` start, serve or wait to restart. The engines
        drained are the pods the cluster operator's ReplicaSet would remove (operator/scale_in.py): starting or
        crashed ones first, then the lowest of the operator's `deletion_costs` (the coldest cache, the fewest
        requests in flight), then the newest."""
        from kvmesh.operator.scale_in import Candidate, removal_order

        have = [engine for engine in self.engines
                if engine.role == role and engine.state in COUNTED and engine.replaces is None]
        for _ in range(replicas - len(have)):
            engine = self.start(role)
            print(f"kvmesh up: starting {engine.child.name} ({role})", file=sys.stderr, flush=True)
        by_name = {engine.child.name: engine for engine in have}
        order = removal_order([Candidate(e.child.name, e.state == SERVING) for e in reversed(have)],
                              deletion_costs or {})
        for engine in [by_name[name] for name in order[:max(0, len(have) - replicas)]]:
            self._retire(engine)
            for surge in [e for e in self.engines if e.replaces == engine.child.name]:
                surge.replaces = None  # rolled in for an engine the scaler removes: it goes too, ending no roll
                self._retire(surge)
        self.publish()

    def _retire(self, engine: Engine) -> None:
        """Out of the pool: a crashed engine is not restarted, a starting one stops at once, a serving one drains
        first (`progress` stops it)."""
        if engine.state == CRASHED:
            self._forget(engine)
            _say(f"{engine.child.name} ({engine.role}), crashed, is not restarted: it leaves the pool")
        elif engine.state == STARTING:
            self._stop(engine)
        else:
            engine.state, engine.deadline = DRAINING, time.monotonic() + DRAIN_TIMEOUT_SECONDS
            print(f"kvmesh up: draining {engine.child.name} ({engine.role})", file=sys.stderr, flush=True)

    def _forget(self, engine: Engine) -> None:
        """An engine whose process exited leaves the pool for good: its tier files go with it (a preallocated host
        tier holds its size of RAM in /dev/shm until deleted, not only until the pool stops)."""
        self.engines.remove(engine)
        self.remove_tier_files(engine.child.name)

    def roll(self, engine_changes: Collection[str], router_changes: Collection[str],
             undo: Callable[[], None] | None = None) -> None:
        """The engine files (`engine_changes`) or the router's file (`router_changes`) were rewritten: replace the
        engines started before, one at a time (a new one started, warmed and routed to before an old one drains),
        then restart the router; `progress` carries it out, and a later edit joins a roll under way. If a rolled-in
        engine dies, `undo` (of the edit that began the roll) puts back what the pool ran on before it."""
        if engine_changes:
            self.generation += 1
            if not self.rolling:
                self.undo_roll = undo
            self.rolling |= set(engine_changes)
        self.router_changes |= set(router_changes)

    def surges(self) -> list[Engine]:
        """The engines rolled in that do not yet count in place of the one they replace."""
        return [e for e in self.engines if e.replaces is not None]

    def unexpected_exit(self) -> Child | None:
        """A child that died without being told to (an engine stopping on request is no failure, nor a rolled-in
        one: its death stops the roll, `_roll`): while the pool starts, such a death stops it."""
        engines = [e.child for e in self.engines if e.state != STOPPING and e.replaces is None]
        for child in engines + ([self.router] if self.router else []):
            if child.process.poll() is not None:
                return child
        return None

    def progress(self, client: httpx.Client) -> None:
        """Move every engine on: crashed ones restart after their back-off (and the router); started ones that
        answer /health serve; drained ones with no requests left (or out of time) stop; stopped ones that exited
        are forgotten (SIGKILL if they take too long)."""
        now = time.monotonic()
        changed = self._restart_crashed(now)
        for engine in list(self.engines):
            if engine.state == STARTING and _answers(client, "GET", engine.child.url + "/health"):
                engine.state, changed, engine.answered = SERVING, True, now
                restarts = engine.child.backoff.restarts
                _say(f"{engine.child.name} serving{f' (restarts: {restarts})' if restarts else ''}")
            elif engine.state == DRAINING:
                left = _answers(client, "POST", engine.child.url + DRAIN_PATH)
                if now > engine.deadline or (left is not None and left["running"] + left["waiting"] == 0):
                    self._stop(engine)
            elif engine.state == STOPPING:
                if engine.child.process.poll() is not None:
                    self._forget(engine)
                    print(f"kvmesh up: {engine.child.name} stopped", file=sys.stderr, flush=True)
                elif now > engine.deadline:
                    engine.child.process.kill()
        self._check_liveness(client, now)
        if changed:
            self.publish()
        self._roll(client)
        self._restart_router(client)
        for old in list(self.old_routers):
            if old[0].process.poll() is not None:
                self.old_routers.remove(old)
                code = old[0].process.returncode
                _say(f"the previous router exited ({code}){': its open requests are done' if code == 0 else ''}")
            elif now > old[1]:
                old[0].process.kill()

    def _check_liveness(self, client: httpx.Client, now: float) -> None:
        """Kill a hung engine, so that the crash back-off restarts it: a serving one whose /health answered once
        and then not for `liveness_seconds` (the kubelet's liveness probe; an engine still starting is not asked,
        as a pod's startup probe holds its liveness probe back). Asked every LIVENESS_PERIOD_SECONDS, not at every
        turn of the loop."""
        for engine in self.engines:
            if engine.state != SERVING or engine.child.process.poll() is not None:
                continue
            if now - engine.probed >= LIVENESS_PERIOD_SECONDS:
                engine.probed = now
                if _alive(client, engine.child.url):
                    engine.answered = now
            if engine.answered is not None and now - engine.answered > self.liveness_seconds:
                _say(f"{engine.child.name} has not been alive on {LIVENESS_PATH} for {now - engine.answered:.0f} s "
                     f"(hung or stalled): "
                     f"killing it, to be restarted")
                engine.child.process.kill()
                engine.child.process.wait()
                engine.answered = None

    def _restart_crashed(self, now: float) -> bool:
        """Children that died unasked (not stopping, nor a roll's surge: `_roll` ends the roll for that) leave the
        pods file and wait out their back-off, the router routing to the other engines meanwhile; then they start
        again with the same command line. A draining engine that dies is not restarted: it was leaving. Whether
        the pods file must change (an engine that served crashed)."""
        changed = False
        for engine in [e for e in self.engines if e.replaces is None]:
            exited = engine.child.process.poll() is not None
            if engine.state in (STARTING, SERVING) and exited:
                others = any(e.state == SERVING for e in self.engines if e is not engine)
                meanwhile = "the router serves on from the others" if others else "no engine serves until it is back"
                engine.child.crashed(now, f" ({engine.role}, {engine.state}); {meanwhile}")
                changed |= engine.state == SERVING
                engine.state = CRASHED
            elif engine.state == DRAINING and exited:
                _say(f"{engine.child.name} exited with {_exit_status(engine.child.process.returncode)} while "
                     f"draining: not restarted, it was leaving the pool")
                self._stop(engine)
            elif engine.state == CRASHED and now >= (engine.child.backoff.due or now):
                _move_if_port_taken(engine.child)
                engine.child.respawn(now)
                # it reads the engine files as they are now: a roll under way has nothing left to replace in it
                engine.state, engine.generation, engine.answered = STARTING, self.generation, None
        self._restart_crashed_router(now)
        return changed

    def _restart_crashed_router(self, now: float) -> None:
        """The router, if it died unasked: restarted on its port after its back-off (a router restarted for its
        settings is a new child, and the old one's exit is expected: `old_routers`)."""
        router = self.router
        if router is None:
            return
        if not router.waiting and router.process.poll() is not None:
            router.crashed(now, "; clients cannot connect until it is back")
        elif router.waiting and now >= (router.backoff.due or now):
            router.respawn(now)
            self.router_starting = True  # `_restart_router` says when it serves

    def _roll(self, client: httpx.Client) -> None:
        """One step of a roll: a surge that died ends it; one the router routes to takes its old engine's place
        (drained, as at a scale-down); with no surge left, the next old engine gets one; then it is done."""
        if not self.rolling:
            return
        for surge in self.surges():
            if surge.child.process.poll() is not None:
                self._forget(surge)
                why = ", ".join(sorted(self.rolling))
                self.rolling = set()
                _say(f"{surge.child.name}, rolled in for {surge.replaces}, exited with {surge.child.process.returncode}"
                     f"; the roll stops, the old engines serve on ({why}: fix the pool file):\n{surge.child.tail()}")
                self._undo_roll()
                return
            routed = [] if self.router is None or surge.state == STARTING else _routed(client, self.router.url)
            if surge.child.url not in routed:
                return  # one at a time: the next waits for this one to be routed to
            old, surge.replaces = self._named(surge.replaces), None
            if old is not None and old.state in COUNTED:  # also if it crashed or restarts meanwhile
                self._retire(old)
                self.publish()
        why = ", ".join(sorted(self.rolling))
        outdated = [e for e in self.engines if e.state == SERVING and e.generation < self.generation]
        if outdated:
            new = self.start(outdated[0].role)
            new.replaces = outdated[0].child.name
            _say(f"rolling {outdated[0].child.name} -> {new.child.name} ({new.role}; settings changed: {why})")
        elif not any(e.state == STARTING and e.generation < self.generation for e in self.engines):
            self.rolling, self.undo_roll = set(), None  # (an old engine still starting is rolled once it serves)
            _say(f"engines rolled: every engine runs the new settings ({why})")

    def _undo_roll(self) -> None:
        """After a failed roll: the files engines start from hold the settings that failed, so every engine the
        scaler would start would fail too. Put back the files and spec the pool ran on before the roll (the
        router's restart, waiting for the roll, is dropped with them); engines rolled in meanwhile keep the new
        settings until the next roll."""
        if self.undo_roll is None:
            return
        self.undo_roll()
        self.undo_roll, self.router_changes = None, set()
        rolled = [e.child.name for e in self.engines if e.generation == self.generation and e.state == SERVING]
        kept = f" ({', '.join(rolled)} run the new settings until the next roll)" if rolled else ""
        _say(f"the pool runs on its spec from before the roll: the pool file's edits since are undone, new engines "
             f"and the router start from the earlier settings again{kept}")

    def _named(self, name: str | None) -> Engine | None:
        return next((e for e in self.engines if e.child.name == name), None)

    def _restart_router(self, client: httpx.Client) -> None:
        """Once the engines are rolled, restart the router on its port if its file changed: the old one drains as at
        a Ctrl-C (its port closes at once, its open requests and streams get HTTP_DRAIN_SECONDS, `progress` reaps
        it) while the new one starts from the rewritten file; then say when it serves."""
        if self.router is None or self.router.waiting:  # a crashed router restarts first (`_restart_crashed_router`)
            return
        if self.router_starting:
            if _answers(client, "GET", self.router.url + "/health") is not None:
                self.router_starting = False
                _say(f"router restarted: serving on {self.router.url}")
            return
        if not self.router_changes or self.rolling:
            return
        from kvmesh.router.app import HTTP_DRAIN_SECONDS  # here: the router's app loads only for a restart

        why, self.router_changes = ", ".join(sorted(self.router_changes)), set()
        port = int(self.router.url.rsplit(":", 1)[1])
        _say(f"restarting the router on port {port} (settings changed: {why}): its open requests and streams finish "
             f"first (up to {HTTP_DRAIN_SECONDS:g} s); new connections are refused until the new one listens")
        old = self.router
        old.process.send_signal(signal.SIGINT)  # as at a Ctrl-C: no settle time, nobody has to learn of a 503
        self.old_routers.append((old, time.monotonic() + ROUTER_STOP_SECONDS))
        _wait_port_free(port, old.process, ROUTER_STOP_SECONDS)
        self.router = _spawn("router", self.router_args, port, self.workdir, self.child_env)
        self.router_starting = True

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
        return [e.child for e in self.engines] + [old for old, _ in self.old_routers] + (
            [self.router] if self.router else [])

    def _stop(self, engine: Engine) -> None:
        if engine.child.process.poll() is None:
            engine.child.process.send_signal(signal.SIGINT)
        engine.state, engine.deadline = STOPPING, time.monotonic() + STOP_TIMEOUT_SECONDS


def _routed(client: httpx.Client, router_url: str) -> list[str]:
    """The engines the router routes to (its /health lists them, also beside a 503): empty while it does not
    answer."""
    try:
        body = client.get(router_url + "/health").json()
    except (httpx.TransportError, ValueError):
        return []
    return body.get("pods", []) if isinstance(body, dict) else []


def _wait_routed(client: httpx.Client, engines: LocalEngines, timeout: float) -> Child | None:
    """Until the router routes to every engine of the pool (its /health lists them by URL): "ready" means the whole
    pool serves, not only the first engine the router happened to scrape, and that it is this pool's router that
    answers (the engines' ports are this pool's own, so another server on the router's port lists none of them).
    The child that died meanwhile, if one did; TimeoutError past `timeout`."""
    assert engines.router is not None
    deadline = time.monotonic() + timeout
    wanted = {e.child.url for e in engines.engines}
    while not wanted <= set(_routed(client, engines.router.url)):
        dead = engines.unexpected_exit()
        if dead is not None:
            return dead
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not see all {len(wanted)} engines healthy within {timeout:.0f} s")
        time.sleep(0.1)
    return engines.unexpected_exit()


def _wait_port_free(port: int, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Until a new listener can bind `port` (the old router `process` closes it at once on SIGINT; its open
    connections do not hold it: SO_REUSEADDR, which uvicorn sets too), or `process` is gone (if something else
    holds the port, the new router says so as it exits); past `timeout`, `process` is killed."""
    deadline = time.monotonic() + timeout
    while not _bindable(port) and process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
        time.sleep(0.05)


def _bindable(port: int) -> bool:
    return bind_problem(port) is None


def _alive(client: httpx.Client, url: str) -> bool:
    """Whether `url`'s liveness path answers 200 within LIVENESS_PROBE_TIMEOUT_SECONDS (it does while loading,
    warming and draining; not once its steps have stalled)."""
    try:
        return client.get(url + LIVENESS_PATH, timeout=LIVENESS_PROBE_TIMEOUT_SECONDS).status_code == 200
    except httpx.TransportError:
        return False


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


def observe_router(engines: LocalEngines, pods: Sequence[LocalPod],
                   scrape: Callable[[str], str] | None = None) -> RouterView:
    """What a pool that scales to zero reads of its router, as the cluster operator reads its router pods: the
    requests it holds for want of a serving engine (the first request to a pool at zero), and whether the pool
    went unseen this tick: the router, serving (not starting, nor crashed), or a serving engine (one the router
    routes to) did not answer its /metrics, so a request may be running unseen."""
    from kvmesh.operator.engines import http_scrape, scrape_all
    from kvmesh.operator.forecast import parse_router_held
    from kvmesh.operator.memory import RouterView

    answered = {p.name for p in pods}
    unseen = any(e.child.name not in answered for e in engines.serving())
    router, held = engines.router, 0
    if router is not None and not router.waiting and not engines.router_starting:
        text = scrape_all({router.name: router.url + "/metrics"}, scrape or http_scrape)[router.name]
        if isinstance(text, str):
            held = parse_router_held(text)
        else:
            unseen = True
    return RouterView(held, unseen)


class _ScalingWatch:
    """The operator's tick over the local engines, every `scaling.intervalSeconds`: engines that began serving
    are warmed from a peer, each decision is printed and carried out within the pool's replica bounds (engines
    started, or drained and stopped; with `scaling.scaleToZero`, every engine once the pool is idle, and started
    again when the router holds a request: `observe_router`), the serving engines' LoRA adapters are synced with
    the spec's, and all is recorded in the operator's metrics, which a loopback port serves (the targets file
    lists it) until `close`. Before each tick, an edit of the pool file is followed (`follow_file`)."""

    def __init__(self, plan: PoolPlan, engines: LocalEngines) -> None:
        from kvmesh.operator.local import LocalOperator

        self.pool = plan.pool
        self.engines = engines
        self.operator = LocalOperator(plan.pool, auth=engines.token)
        self.clock_rate = float(os.environ.get(CLOCK_RATE_ENV) or 1.0)
        self.interval = plan.pool.spec["scaling"]["intervalSeconds"]
        self.next = self.now()
        self.file = PoolFile(plan.file) if plan.file else None
        self.adapters_said = ""  # the adapters' last reported state: a new one is printed once
        port = free_port()
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=self.operator.metrics.registry)
        engines.operator_url = local_url(port)

    def now(self) -> float:
        """The operator's clock (`CLOCK_RATE_ENV`)."""
        return time.monotonic() * self.clock_rate

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def follow_file(self) -> None:
        """Re-read the pool file if it changed; apply what a running pool can take on (replica bounds and the
        scaler's settings at once: the next tick runs now; adapters through the sync, and in the engine files new
        engines start from; changed engine or router settings in the files, and by rolling the engines and then
        restarting the router: operator/local.py `restarts`; a cluster's own fields are ignored, and said so) or
        say why not (it cannot be read, the API server would refuse it, the new files would not start an engine
        or a router, or it changes what every process must share), running on the last good spec. Never raises:
        a bad edit is the user's to fix."""
        from kvmesh.operator.local import ignored_locally, restarts

        if self.file is None or not self.file.changed():
            return
        path = self.file.path
        pool, problem = self.file.read()
        if pool is None:
            _say(f"{path} changed but cannot be used: {problem}; the pool runs on as before (fix the file to go on)")
            return
        todo = restarts(self.pool, pool)
        if todo.refused:
            _say(f"{path} changed what every process of the pool must share ({', '.join(todo.refused)}), which no "
                 f"rolling restart can change; none of this edit is applied, the pool runs on as before (restart "
                 f"kvmesh up to apply it)")
            return
        if pool == self.pool:
            return
        engine, router = self._sections(pool)
        if todo.rolls and (problem := _settings_problem(engine, router)):
            _say(f"{path} changed settings no new process would start with: {problem}; none of this edit is "
                 f"applied, the pool runs on as before")
            return
        previous = self.pool
        self._follow(pool)
        self.engines.roll(todo.engines, todo.router, undo=lambda: self._follow(previous))
        bounds = ", ".join(f"{role} {low}..{high}" for role in pool.roles for low, high in [pool.bounds(role)])
        adapters = ", ".join(a["name"] for a in pool.spec["model"]["loraAdapters"]) or "none"
        ignored = ignored_locally(previous, pool)
        unused = f"; ignored locally, a cluster's only: {', '.join(ignored)}" if ignored else ""
        steps = ([f"rolling the engines for {', '.join(todo.engines)}"] if todo.engines else []) + (
            [f"then restarting the router for {', '.join(todo.router)}"] if todo.router else []) + (
            [f"engines started from now on get {', '.join(todo.gate)}"] if todo.gate else [])
        rolled = f"; {'; '.join(steps)}" if steps else ""
        _say(f"{path} changed: following it (replicas {bounds}; adapters {adapters}{rolled}{unused})")

    def _sections(self, pool: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engine files' and the router file's sections for `pool`."""
        from kvmesh.operator.local import local_engine_settings, local_router_settings

        engines = self.engines
        router = _router_section(engines.workdir, engines.plan.name, local_router_settings(pool), engines.pods_file)
        return {**engines.engine_defaults, **local_engine_settings(pool)}, router

    def _follow(self, pool: Any) -> None:
        """Run on `pool`: the scaler follows it at once, and the files new processes start from hold its settings."""
        from kvmesh.operator.local import local_engine_settings, local_router_settings

        self.pool = pool
        plan = self.engines.plan
        plan.pool, plan.engine, plan.router = pool, local_engine_settings(pool), local_router_settings(pool)
        self.operator.follow(pool)
        self.interval = pool.spec["scaling"]["intervalSeconds"]
        self.next = self.now()
        engine, router = self._sections(pool)
        _write_engine_files(self.engines.workdir, engine, pool)
        _write_router_file(self.engines.workdir, router)

    def tick(self) -> None:
        from kvmesh.operator.local import Tick, describe

        self.follow_file()
        if any(e.state == STARTING and e.child.name not in (self.operator.memory.serving or ())
               for e in self.engines.surges()):
            for line in self.operator.warm_new(self.now(), observe_engines(self.engines.observable())):
                _say(f"warm-up: {line}")  # a rolled-in engine, warmed (or let serve) once it answers
        if self.now() < self.next:
            return
        self.next = self.now() + self.interval
        pods = observe_engines(self.engines.observable())
        router = observe_router(self.engines, pods) if "scaleToZero" in self.pool.spec["scaling"] else None
        answered = {p.name for p in pods}  # a serving engine that did not answer holds its role's size
        unanswered = Counter(e.role for e in self.engines.observable()
                             if e.state == SERVING and e.child.name not in answered)
        before = self.engines.replicas()

        def carry_out(tick: Tick) -> None:
            for line in describe(tick.decision, before):
                _say(f"scaler: {line}")
            for role, n in tick.decision.changed(before).items():
                self.engines.scale(role, n, tick.deletion_costs)  # the decision is already within the pool's bounds
            self.operator.record(tick.decision, self.engines.replicas(), before)
            for line in self.operator.warm_up(tick.warmups):  # after scaling, as the operator does
                _say(f"warm-up: {line}")

        try:
            self.operator.tick(self.now(), pods, before, carry_out, router, unanswered)
        except Exception as exc:  # as the cluster operator's timer: the tick fails (counted), the pool keeps serving
            _say(f"scaler: this tick failed ({exc!r}); the next one tries again")
            return
        self.sync_adapters()

    def sync_adapters(self) -> None:
        from kvmesh.operator.lora import EnginePod

        def pod(engine: Engine) -> EnginePod:
            # a restarted engine is a new life, as a pod's restarted container: a refusal there is tried again
            return EnginePod(engine.child.name, engine.role, engine.child.url, engine.child.backoff.restarts)

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


def _write_engine_files(workdir: Path, settings: Mapping[str, Any], pool: Any) -> tuple[Path, Path | None]:
    """The engines' files, each replaced atomically (an engine starting meanwhile reads the old or the new one):
    `engine.yaml` for the first engines and, from a pool file, `engine-scaled.yaml` for every engine started later
    (scaled up or rolled in: warmed from a peer behind the warm-up gate), what operator/local.py `start_inputs`
    lists. Rewritten at each edit, as the operator's ConfigMap is: engines started from then on read it."""
    initial = workdir / "engine.yaml"
    write_atomically(initial, yaml.safe_dump({"engine": dict(settings)}))
    if pool is None:
        return initial, None
    from kvmesh.operator.desired import warmup_grace_seconds

    scaled = workdir / "engine-scaled.yaml"
    write_atomically(scaled, yaml.safe_dump({"engine": {**settings,
                                                        "warmup_grace_seconds": warmup_grace_seconds(pool)}}))
    return initial, scaled


def _router_section(workdir: Path, pool: str, settings: Mapping[str, Any], pods_file: Path) -> dict[str, Any]:
    """The router's file: its pool's settings, with a database of its own (the request log, the Batch API's files
    and batches) unless the pool names one, and the pods file `kvmesh up` keeps. The tenants' limit sync is off:
    it splits the limits between router replicas through the database, and a local pool has one router, which
    would only write its demand to SQLite every few seconds, idle or not."""
    database = {"database_url": f"sqlite:///{workdir / LOCAL_DATABASE}"}
    return {"pool": pool, **database, **settings, "rate_limit_sync": False, "pods_file": str(pods_file)}


def _write_router_file(workdir: Path, section: Mapping[str, Any]) -> Path:
    path = workdir / "router.yaml"
    write_atomically(path, yaml.safe_dump({"router": dict(section)}))
    return path


def _settings_problem(engine: Mapping[str, Any], router: Mapping[str, Any]) -> str | None:
    """Why an engine or a router would refuse these files' sections at start (their own config checks), or None:
    checked before a roll, so a mistyped setting stops no engine and leaves the pool as it was. Written to files
    and loaded from them as the processes will: the loaders' override dicts are flags, which drop None values (and
    the router's empty lists) as not given, where a file's null reaches the config and its checks."""
    from kvmesh.engine.config import load_config
    from kvmesh.router.config import load_router_config

    with tempfile.TemporaryDirectory(prefix="kvmesh-check-") as folder:
        engine_file, router_file = Path(folder) / "engine.yaml", Path(folder) / "router.yaml"
        engine_file.write_text(yaml.safe_dump({"engine": dict(engine)}))
        router_file.write_text(yaml.safe_dump({"router": dict(router)}))
        for name, load, path in (("engine", load_config, engine_file), ("router", load_router_config, router_file)):
            try:
                load(path)
            except Exception as exc:  # whatever its checks raise: never a crash of the pool
                return f"the {name}'s: {exc}"
    return None


def _stop_signals() -> tuple[int, ...]:
    """The signals that stop the pool: Ctrl-C, SIGTERM, and SIGHUP (its terminal closed), unless SIGHUP is ignored
    (started under nohup: it must outlive its terminal)."""
    hang_up = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hang_up)


_STOP_SIGNALS = _stop_signals()


def _quiet_hung_up_terminal() -> None:
    """After SIGHUP: stdout and stderr that go to a terminal go to /dev/null instead, since writing to a terminal
    that hung up fails (EIO) and would end the stop half-way, leaving processes and files behind."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if os.isatty(fd):
            os.dup2(devnull, fd)
    os.close(devnull)


def remove_leftovers(state: Path, tier_dirs: Sequence[Path] | None = None) -> list[Path]:
    """Remove what runs of `kvmesh up` that were killed left (SIGKILL or a crash: no clean-up ran) in the state
    folder `state`: their work folders, their engines' KV tier files (a host tier holds its size of RAM in /dev/shm
    until deleted), and their targets in a targets file they wrote (`TARGETS_RECORD`: emptied as a clean stop
    empties it, whether or not this run writes one). A run's leftovers go only if its work folder names a
    `kvmesh up` pid (`UP_PID_FILE`) that no longer runs: never a live run's, nor a folder kept for its logs (it has
    no pid file). The work folders removed."""
    tier_dirs = tier_dirs if tier_dirs is not None else (Path(HOST_TIER_DIR), DISK_TIER_DIR)
    removed = []
    for pid_file in state.glob(f"{WORKDIR_PREFIX}*/{UP_PID_FILE}"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue  # a run writing it now, or not ours
        if _running(pid):
            continue
        workdir = pid_file.parent
        for folder in tier_dirs:
            for path in folder.glob(f"{workdir.name}-engine-*.kv"):
                path.unlink(missing_ok=True)
        _empty_killed_runs_targets(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        removed.append(workdir)
    return removed


def _empty_killed_runs_targets(workdir: Path) -> None:
    """The targets file a killed run wrote (its `TARGETS_RECORD`), emptied if it still names that run's router."""
    try:
        record = json.loads((workdir / TARGETS_RECORD).read_text())
        path, router = Path(record["path"]), str(record["router"])
    except (OSError, ValueError, TypeError, KeyError):
        return  # it wrote none (or the record is unreadable: nothing known to empty)
    if _empty_targets(path, router):
        _say(f"emptied the targets file {path} of a killed run (its processes are gone)")


def _running(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


class _StopNow(Exception):
    """A second Ctrl-C or SIGTERM while the pool stops gracefully."""


def _stop_now(signum: int, frame: object) -> None:
    if signum == signal.SIGHUP:
        _quiet_hung_up_terminal()
    raise _StopNow


def stop_pool(engines: LocalEngines, client: httpx.Client, router_signal: int = signal.SIGINT) -> bool:
    """Stop the pool without cutting what it serves. First the router, with `router_signal` (the one `kvmesh up`
    got: after SIGINT it closes its port at once, after SIGTERM it serves new requests SHUTDOWN_SETTLE_SECONDS
    more, as in Kubernetes) while the engines go on serving its open requests and streams, which it lets finish
    within SHUTDOWN_DRAIN_SECONDS and exits; SIGKILL only after ROUTER_STOP_SECONDS. Then the engines: drained
    (POST /v1/admin/drain: they refuse new requests) until none runs or queues a request, at most
    ENGINES_DRAIN_SECONDS; then SIGINT, and SIGKILL STOP_TIMEOUT_SECONDS later. A second Ctrl-C or SIGTERM
    kills whatever is left at once: False then."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _stop_now)
    try:
        router = engines.router
        if router is not None and router.process.poll() is None:
            print(f"kvmesh up: stopping the router: its open requests and streams finish first (up to "
                  f"{SHUTDOWN_DRAIN_SECONDS:g} s; Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            router.process.send_signal(router_signal)
        # and a router restarted earlier that still finishes its streams (signalled then: again would cut them)
        wait_or_kill([r.process for r in [router, *[old for old, _ in engines.old_routers]] if r is not None],
                     ROUTER_STOP_SECONDS)
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
        for signum in _STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
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


def scrape_target(url: str) -> str:
    """A process's address as a Prometheus file_sd target (host:port), from its URL: one rule for writing the
    targets file and for finding this pool's router in it."""
    return url.removeprefix("http://")


def prometheus_targets(pool: str, members: list[tuple[Child, str]],
                       operator_url: str | None = None) -> list[dict[str, object]]:
    """Prometheus file_sd targets for every (process, role) of the pool, labelled as the chart's PodMonitor labels
    pods in Kubernetes (namespace, pool, role, pod), so the dashboards and alerts work on a local pool unchanged;
    and the local operator's, labelled as the chart's ServiceMonitor labels the operator (namespace, pod and
    component: no pool or role, which its series carry themselves and a target label of the same name would
    rename)."""
    targets: list[dict[str, object]] = [
        {"targets": [scrape_target(child.url)],
         "labels": {"namespace": LOCAL_NAMESPACE, "pool": pool, "role": role, "pod": child.name}}
        for child, role in members]
    if operator_url is not None:
        targets.append({"targets": [scrape_target(operator_url)],
                        "labels": {"namespace": LOCAL_NAMESPACE, "pod": "operator", "component": "operator"}})
    return targets


def startup_problem(plan: PoolPlan, router_port: int, ready_file: str | None = None,
                    targets_file: str | None = None, state: Path | None = None) -> str | None:
    """Why the pool could not start or say that it did, checked before anything starts (a model converted, a
    process spawned), or None. The router's port must be free: a router that cannot bind it crash-loops, while
    whatever holds the port answers the health checks as if it were this pool's. The ready and targets files must
    be writable where they are named: found out only once the pool is up, the pool would stop again. The state
    folder `state`, if given, is made if it is missing (a first run) and must be writable."""
    if not 1 <= router_port <= 65535:
        return f"--port {router_port}: a port is a number from 1 to 65535"
    host = str(plan.router.get("host") or "127.0.0.1")
    if (problem := bind_problem(router_port, host)) is not None:
        return (f"the router's port {router_port} on {host} cannot be used ({problem}): another kvmesh up or server "
                f"holds it? Stop it or give another --port")
    if state is not None:  # first: a targets file may be named beside the work folders
        try:
            state.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"the state folder {state} (--state-dir) cannot be made: {exc.strerror or exc}"
        if not os.access(state, os.W_OK | os.X_OK):
            return f"the state folder {state} (--state-dir) is not writable"
    for flag, name in (("--ready-file", ready_file), ("--targets-file", targets_file)):
        if name and (problem := _unwritable(Path(name))) is not None:
            return f"{flag} {name}: {problem}"
    return None


def _unwritable(path: Path) -> str | None:
    """Why a file could not be written (atomically: a new file beside it, renamed over it) at `path`, or None."""
    folder = path.parent
    if path.is_dir():
        return "is a folder"
    if not folder.is_dir():
        return f"there is no folder {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return None


def _endpoint(router_port: int) -> str:
    return f"{local_url(router_port)}/v1"


def state_dir() -> Path:
    """Where `kvmesh up` makes its runs' work folders: $KVMESH_STATE_DIR, else `kvmesh` in the XDG state folder
    ($XDG_STATE_HOME when it is an absolute path, as the XDG spec asks, else ~/.local/state), the spec's place for
    logs and history. Not /tmp: a running pool's files there are aged out by /tmp cleaners (systemd-tmpfiles after
    10 days), and a crashed engine then crash-loops on its missing config and token; its logs and request log go
    with them, and a memory-backed /tmp keeps the request log in RAM."""
    if override := os.environ.get(STATE_DIR_ENV):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state") / "kvmesh"


def run_pool(plan: PoolPlan, router_port: int, ready_file: str | None = None,
             targets_file: str | None = None, keep_logs: bool = False, state: Path | None = None) -> int:
    """Start the pool and supervise it until Ctrl-C or SIGTERM (0) or a failed start (1); then stop it
    gracefully (`stop_pool`), or at once on a second Ctrl-C (STOPPED_AT_ONCE). A model that cannot be read is 2,
    a Ctrl-C while it is prepared INTERRUPTED. Its work folder is made in `state` (default `state_dir()`), where
    what a killed run left is removed first (`remove_leftovers`); what this run leaves is removed as it ends
    (`_clean_up`)."""
    stopped_by: list[int] = []  # the signal that stopped the pool, if one did

    def interrupt(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:  # the terminal closed: stop as at SIGTERM, saying nothing more to it
            _quiet_hung_up_terminal()
            signum = signal.SIGTERM
        stopped_by.append(signum)
        raise KeyboardInterrupt

    for signum in _STOP_SIGNALS:
        signal.signal(signum, interrupt)
    state = state or state_dir()
    remove_leftovers(state)
    try:
        if plan.sim:  # no weights: the bundled tokenizer, served under the simulated model's name
            from kvmesh.bench.sim_engine import PROFILES, served_name

            name = served_name(PROFILES[plan.sim], plan.engine.get("served_model_name"))
            print(f"kvmesh up: simulated engines ({plan.sim}) serve model {name} ...", file=sys.stderr)
        else:
            print(f"kvmesh up: preparing model {plan.model or 'SmolLM2-135M-Instruct (bundled)'} ...",
                  file=sys.stderr)
        model_dir = resolve_model_dir(plan.model)  # a GGUF's conversion (its temporary files clean up after it)
    except KeyboardInterrupt:
        _say("interrupted")
        return INTERRUPTED
    except (OSError, ValueError) as exc:  # no such file, no config.json, not a .gguf
        _say(str(exc))
        return 2
    except Exception as exc:  # a GGUF the converter cannot read: the user's file, not a kvmesh crash
        _say(f"cannot read the model {plan.model}: {exc!r}")
        return 2
    threads = max(1, (os.cpu_count() or 2) // plan.engines)
    state.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{plan.name}-", dir=state))
    (workdir / UP_PID_FILE).write_text(str(os.getpid()))
    if targets_file:
        write_json_atomically(workdir / TARGETS_RECORD, {"path": str(Path(targets_file).absolute()),
                                                         "router": scrape_target(local_url(router_port))})
    engines: LocalEngines | None = None
    code, graceful = 1, False
    try:
        try:
            defaults = {} if plan.sim else {"threads": threads, "kv_cache_memory_mib": 256}  # sims: their profile's
            engine_args = ["sim-engine", "--profile", plan.sim] if plan.sim else ["serve", "--model", str(model_dir)]
            # engines the scaler adds (and a roll's) wait for their warm-up as the operator's pods do
            initial_file, scaled_file = _write_engine_files(workdir, {**defaults, **plan.engine}, plan.pool)
            initial = [*engine_args, "--config", str(initial_file)]
            scaled = [*engine_args, "--config", str(scaled_file)] if scaled_file else None
            token_file = workdir / INTERNAL_TOKEN_FILE  # this run's own: a later run makes another
            write_token_file(token_file, new_token())
            engines = LocalEngines(plan, initial, workdir, targets_file, scaled, defaults, token_file)
        except KeyboardInterrupt:  # nothing started yet
            _say("interrupted")
            code = INTERRUPTED
            return code
        try:
            code = _supervise(plan, engines, model_dir, router_port, ready_file)
        finally:  # also when supervising failed unexpectedly
            with httpx.Client(timeout=2.0, auth=engines.token, **INTERNAL_HTTP_CLIENT) as client:
                graceful = stop_pool(engines, client, stopped_by[0] if stopped_by else signal.SIGINT)
    finally:
        failed = code not in (0, INTERRUPTED) or (engines is not None and not engines.ready)
        _clean_up(workdir, engines, ready_file, _endpoint(router_port), keep=keep_logs or failed)
    return code if graceful else STOPPED_AT_ONCE


def invoked_command() -> str:
    """How to run kvmesh as this process was run, for the hints it prints: `kvmesh` when that is what PATH finds,
    else the path or `python -m` it was started with (a user who ran .venv/bin/kvmesh without the venv on PATH got
    a hint that said `kvmesh`, which their shell did not find)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":  # python -m kvmesh.cli
        return f"{shlex.quote(sys.executable)} -m {spec.name.removesuffix('.__main__')}"
    invoked = sys.argv[0]
    on_path = shutil.which("kvmesh")
    try:
        same = on_path is not None and os.path.samefile(on_path, invoked)
    except OSError:
        same = False
    return "kvmesh" if same else shlex.quote(invoked)


def cluster_only_fields(pool: Any) -> list[str]:
    """The fields of a pool file that a local pool ignores (engine.resources, router.replicas, ...), said at start
    as an edit's are (operator/local.py `ignored_locally`): they were said only once the file changed. They are
    those the file sets beyond a pool of its model, mode and replicas alone; none where that pool cannot be had."""
    from kvmesh.operator.crd import PoolDefaults, complete_spec
    from kvmesh.operator.local import ignored_locally

    least = {"model": {"source": pool.spec["model"]["source"]}, "mode": pool.spec["mode"],
             "replicas": pool.spec["replicas"]}
    try:
        bare = replace(pool, spec=complete_spec(least, PoolDefaults(local=True)))
    except ValueError:
        return []
    return ignored_locally(bare, pool)


def ready_message(pool: str, engines: int, endpoint: str, command: str = "kvmesh") -> str:
    """What `kvmesh up` prints once the pool serves: where, and what to do next (try it with `command`, stop it)."""
    base = endpoint.removesuffix("/v1")
    return (f"kvmesh up: pool {pool!r} ready: {engines} engine{'' if engines == 1 else 's'} behind {endpoint}\n"
            f"  try it:  {command} chat --url {base} 'Hello'   (or: curl {endpoint}/models)\n"
            f"  Ctrl-C stops the pool")


def _clean_up(workdir: Path, engines: LocalEngines | None, ready_file: str | None, endpoint: str, keep: bool) -> None:
    """After the pool stopped: its ready file goes (a script must not find a stopped pool "ready"; only if it still
    names this pool's endpoint: another run may have written it since), and its engines' KV tier files (caches no
    later run opens: each names its own). The work folder (logs, configuration, the router's SQLite database) goes
    too after a clean stop, unless `keep` (`--keep-logs`, or the pool failed or was stopped before it served: its
    logs say why); then its path is printed."""
    if ready_file:
        try:
            if Path(ready_file).read_text() == endpoint:
                Path(ready_file).unlink()
        except OSError:
            pass
    if engines is not None:
        engines.remove_tier_files()
        if engines.targets_file and engines.router is not None:
            _empty_targets(Path(engines.targets_file), scrape_target(engines.router.url))
    (workdir / UP_PID_FILE).unlink(missing_ok=True)  # stopped: a later run leaves a kept folder alone
    if keep:
        _say(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def _empty_targets(path: Path, router: str) -> bool:
    """After a pool stopped (or, for a run that was killed, at the next start): its targets file (`--targets-file`)
    becomes `[]`, only if it still names the pool's `router` target (another run may have written it since).
    Left as it was, it would list dead processes and Prometheus would fire KvmeshEngineDown and friends. Emptied
    rather than removed: an empty list drops the targets in every Prometheus version, while a removed file is not
    read at all, and whether its last targets go then depends on the version (and on a file_sd path without a
    glob, which some log as an error); a file read half-way through a removal keeps them. Whether it emptied it."""
    try:
        groups = json.loads(path.read_text())
        ours = any(router in group.get("targets", []) for group in groups)
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    if not ours:
        return False
    try:
        write_json_atomically(path, [])
    except OSError as exc:
        _say(f"cannot empty the targets file {path}: {exc}")
        return False
    return True


def _supervise(plan: PoolPlan, engines: LocalEngines, model_dir: Path, router_port: int,
               ready_file: str | None) -> int:
    """Start the pool's processes, wait until the router routes to every engine, then keep the pool as the scaler
    wants it, crashed children restarted, until Ctrl-C or SIGTERM (0); a child that dies before the pool is ready,
    or a start that takes too long, ends it (1)."""
    workdir = engines.workdir
    watch: _ScalingWatch | None = None
    try:
        for i in range(plan.engines):  # in the pods file from the start, as a static list would be
            engines.start(plan.roles[i] if plan.roles else "both", initial=True).state = SERVING
        engines.publish()
        router_file = _write_router_file(workdir, _router_section(workdir, plan.name, plan.router,
                                                                  engines.pods_file))
        engines.start_router(["router", "--config", str(router_file), "--model", str(model_dir), "--port",
                              str(router_port), "--log-level", "warning"], router_port)
        kind = f"simulated ({plan.sim}) " if plan.sim else ""
        plural = "" if plan.engines == 1 else "s"
        print(f"kvmesh up: starting {plan.engines} {kind}engine{plural} and a router (logs in {workdir}) ...",
              file=sys.stderr)
        if plan.pool is not None and (ignored := cluster_only_fields(plan.pool)):
            _say(f"{plan.file}: ignored locally, a cluster's only: {', '.join(ignored)}")
        dead = _wait_healthy(engines.children(), HEALTH_TIMEOUT_SECONDS)
        if dead is not None:
            _say(_failure(dead))
            return 1
        # drains send the pool's token
        with httpx.Client(timeout=2.0, auth=engines.token, **INTERNAL_HTTP_CLIENT) as client:
            dead = _wait_routed(client, engines, HEALTH_TIMEOUT_SECONDS)
            if dead is not None:
                _say(_failure(dead))
                return 1
            if plan.pool is not None:
                watch = _ScalingWatch(plan, engines)
                watch.tick()  # the first decision: the operator's series exist once its target is listed
                print(f"kvmesh up: operator metrics at {engines.operator_url}/metrics", file=sys.stderr)
            engines.publish()  # the targets file, before the ready file: whoever waits on it finds the targets too
            endpoint = _endpoint(router_port)
            print(ready_message(plan.name, plan.engines, endpoint, invoked_command()), flush=True)
            engines.ready = True
            if ready_file:
                write_atomically(Path(ready_file), endpoint)
            while True:  # a crash from here on is restarted (`progress`), not the end of the pool
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
    except OSError as exc:  # a file it keeps cannot be written (its folder removed, a full disk): said, not a crash
        _say(f"cannot write {exc.filename or 'a file'}: {exc.strerror or exc}; stopping the pool")
        return 1
    finally:
        if watch is not None:
            watch.close()
