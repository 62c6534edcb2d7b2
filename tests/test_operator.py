"""The operator against kmock's KubernetesEmulator, a real HTTP API server in memory (no kube-apiserver runs
here): kopf and the kubernetes client talk to it as to a cluster. The emulator stores JSON only, so a small
subclass fills what an API server would (uid, resourceVersion, generation, creationTimestamp); it has no garbage
collector, defaulting, CEL or Deployment controller, so the tests assert owner references, mark Deployments
ready themselves, and give the operator a pool whose CEL rule would have been enforced by a real server.

Every request the emulator receives is recorded, and each test ends by checking that the operator used only
verbs and resources that operator/rbac.py lists; one test checks that it uses every one they list."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml

from kvmesh.engine.internal_token import INTERNAL_TOKEN_HEADER, INTERNAL_TOKEN_KEY, InternalToken
from kvmesh.engine.protocol import EVALUATION_OUTCOMES, POOL_LABEL, ROLE_LABEL, Metric, OperatorMetric, VllmMetric
from kvmesh.operator import rbac
from kvmesh.operator.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kvmesh.operator.engines import http_open_gates, http_warm
from kvmesh.operator.handlers import DELETION_COST_ANNOTATION, OperatorConfig, register
from kvmesh.operator.kube import API_RETRY
from kvmesh.operator.metrics import OperatorMetrics
from kvmesh.operator.warmup import GateOpener, ServingPod, Warmer, Warmup
from kvmesh.processes import free_port
from kvmesh.router.discovery import kube_configuration

NS = "pool"
POOLS = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
RESOURCES = {
    f"{GROUP}/{VERSION}/{PLURAL}": ("InferencePool", ["status"]),
    "v1/events": ("Event", []),
    "v1/configmaps": ("ConfigMap", []),
    "v1/services": ("Service", []),
    "v1/serviceaccounts": ("ServiceAccount", []),
    "v1/secrets": ("Secret", []),
    "v1/pods": ("Pod", []),
    "apps/v1/deployments": ("Deployment", ["status", "scale"]),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", []),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", []),
    "rbac.authorization.k8s.io/v1/roles": ("Role", []),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", []),
    "inference.networking.k8s.io/v1/inferencepools": ("InferencePool", []),
}
VERBS = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
         kmock.action.CREATE: "create", kmock.action.UPDATE: "patch", kmock.action.DELETE: "delete"}
_versions = itertools.count(1)


class Cluster(kmock.KubernetesEmulator):
    """The emulator plus the fields a real API server sets: uid, resourceVersion, creationTimestamp on create;
    a new resourceVersion on every write, and generation + 1 when a write changes the spec."""

    async def _handle(self, request: Any) -> Any:
        data = request.data if isinstance(request.data, dict) else None
        if request.resource is not None and data is not None:
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = str(next(_versions))
            if request.action == kmock.action.CREATE:
                if "name" not in meta and "generateName" in meta:
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                meta.update(uid=str(uuid.uuid4()), generation=1, namespace=request.namespace or meta.get("namespace"),
                            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            elif request.action == kmock.action.UPDATE and request.subresource is None and "spec" in data:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects:
                    meta["generation"] = int(self.objects[key].get("metadata", {}).get("generation", 1)) + 1
        return await super()._handle(request)


def used(request: Any) -> tuple[str, str, str]:
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    return request.resource.group, resource, VERBS[request.action]


def permitted(request: Any) -> bool:
    """Whether operator/rbac.py grants this request (discovery URLs are open to every authenticated client)."""
    if request.resource is None or request.action is None or request.resource.plural is None:
        return True
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    return rbac.allows(rbac.OPERATOR, request.resource.group, resource, VERBS[request.action])


class TickGate:
    """Holds the pool's scaling ticks part-way on request, in kopf's handler thread (each tick reads the operator's
    clock first), so that a test can act while a tick is under way."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()  # a tick waits at the closed gate

    def pass_through(self) -> None:
        if not self._open.is_set():
            self.holding.set()
            self._open.wait()

    def close(self) -> None:
        self.holding.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()


@dataclass
class Env:
    k8s: Cluster
    clock: list[float]  # the operator's clock, moved by the test
    metrics: OperatorMetrics
    ticks_gate: TickGate = field(default_factory=TickGate)

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"pool_namespace": NS, "pool": "chat", **labels})

    def get(self, plural_path: str, name: str) -> dict[str, Any] | None:
        for (resource, namespace, obj_name), obj in self.k8s.objects.items():
            if namespace == NS and obj_name == name and f"{resource.group}/{resource.version}/{resource.plural}" \
                    .lstrip("/").endswith(plural_path) and not obj.deleted:
                return dict(obj.raw)
        return None

    def owned(self) -> list[dict[str, Any]]:
        return [dict(o.raw) for (r, ns, _), o in self.k8s.objects.items()
                if ns == NS and not o.deleted and o.raw.get("metadata", {}).get("ownerReferences")]

    def pool(self, name: str = "chat") -> dict[str, Any]:
        obj = self.get(f"{GROUP}/{VERSION}/{PLURAL}", name)
        assert obj is not None
        return obj

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [dict(o.raw) for (r, _, _), o in self.k8s.objects.items()
                if r.plural == "events" and o.raw.get("reason") == reason]

    def operator_requests(self) -> list[Any]:
        """The requests the operator made (the test's own come from kmock's client)."""
        return [r for r in self.k8s if not r.headers.get("User-Agent", "").startswith("kmock/")]

    def ticks(self) -> int:
        """The pool's scaling ticks that have ended, either outcome: the operator's heartbeat."""
        return int(sum(self.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome=outcome) or 0
                       for outcome in EVALUATION_OUTCOMES))

    def ticks_begun(self) -> int:
        """The scaling ticks the operator has begun, seen from the API server: each lists the pool's engine pods
        once (nothing else lists pods), answered or not."""
        return sum(1 for r in self.operator_requests() if r.action == kmock.action.LIST and r.resource is not None
                   and r.resource.plural == "pods")

    def used(self) -> set[tuple[str, str, str]]:
        """(group, resource, verb) of every API request the operator made so far."""
        return {used(r) for r in self.operator_requests() if r.resource is not None and r.resource.plural is not None}

    def check_rbac(self) -> None:
        """The operator's requests stay inside operator/rbac.py."""
        theirs = self.operator_requests()
        assert any(r.action == kmock.action.CREATE for r in theirs)  # the operator's requests were recorded
        outside = {(r.method, str(r.url.path)) for r in theirs if not permitted(r)}
        assert not outside, f"requests outside operator/rbac.py: {sorted(outside)}"


async def eventually(check: Callable[[], Any], seconds: float = 30.0) -> Any:
    """Poll `check` until it returns something true; a failure names what the check last saw."""
    deadline = time.monotonic() + seconds
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except (AssertionError, KeyError, TypeError) as exc:
            last = repr(exc)
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"condition not reached in {seconds} s; last seen: {last!r}"
        await asyncio.sleep(0.05)


def pool_body(name: str = "chat", **spec: Any) -> dict[str, Any]:
    full = {"model": {"source": "bundled"}, "replicas": {"both": {"min": 1, "max": 4}}} | spec
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NS}, "spec": full}


def serve_operator_resources(k8s: kmock.KubernetesEmulator) -> None:
    """The kinds the operator reads and writes, as the emulator serves them."""
    for key, (kind, subresources) in RESOURCES.items():
        k8s.resources[key] = {"kind": kind, "namespaced": True, "subresources": subresources,
                              "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"]}
    # Discovered only: kopf looks for it at startup, and with scanning off it never lists it.
    k8s.resources["v1/namespaces"] = {"kind": "Namespace", "namespaced": False, "verbs": ["list", "watch"]}


def write_kubeconfig(path: Path, server: str, namespace: str | None = NS) -> Path:
    """A kubeconfig for the emulator at `server` (a token it does not check), in `namespace` by default."""
    context = {"cluster": "emulator", "user": "test", **({"namespace": namespace} if namespace else {})}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server.rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "t"}}],
        "contexts": [{"name": "emulator", "context": context}]}))
    return path


@contextlib.asynccontextmanager
async def operator(tmp_path: Path, tick: float = 0.2, warm: Warmer | None = None,
                   open_gates: GateOpener | None = None, cluster: type[Cluster] = Cluster) -> AsyncIterator[Env]:
    """The operator against a fresh emulator (`cluster`: a subclass that answers some requests as a real API
    server would, where the emulator cannot)."""
    async with cluster() as k8s, kmock.Server(k8s) as server:
        serve_operator_resources(k8s)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url))
        clock, gate = [1000.0], TickGate()

        def read_clock() -> float:
            gate.pass_through()
            return clock[0]

        registry = kopf.OperatorRegistry()
        metrics = register(registry, OperatorConfig(namespaces=(NS,), tick_seconds=tick, clock=read_clock),
                           kube_configuration(str(kubeconfig)), **({"warm": warm} if warm else {}),
                           **({"open_gates": open_gates} if open_gates else {}))
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(kopf.operator(registry=registry, standalone=True, namespaces=[NS],
                                                 stop_flag=stop, ready_flag=ready))
        await asyncio.wait_for(ready.wait(), 20)
        env = Env(k8s, clock, metrics, gate)
        try:
            yield env
            assert not task.done(), "the operator exited"
            env.check_rbac()
        finally:
            gate.open()  # a tick held by a failed test must not keep the operator from stopping
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 20)


def run(main: Callable[[], Any], seconds: float = 90.0) -> None:
    asyncio.run(asyncio.wait_for(main(), seconds))


def kinds(objects: list[dict[str, Any]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for o in objects:
        out.setdefault(o["kind"], set()).add(o["metadata"]["name"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_is_reconciled_patched_and_deleted(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(gatewayInferencePool={"enabled": True}))
            uid = env.pool()["metadata"]["uid"]
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            owned = env.owned()
            assert kinds(owned) == {
                "ConfigMap": {"chat-config"}, "ServiceAccount": {"chat-router"}, "Role": {"chat-router"},
                "RoleBinding": {"chat-router"}, "Service": {"chat-engines", "chat-router"},
                "Deployment": {"chat-both", "chat-router"}, "PodDisruptionBudget": {"chat-both", "chat-router"},
                "InferencePool": {"chat"}, "Secret": {"chat-internal-token"}}
            for obj in owned:
                (ref,) = obj["metadata"]["ownerReferences"]
                assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (KIND, "chat", uid, True)
                assert obj["metadata"]["labels"][POOL_LABEL] == "chat"
            engines = env.get("apps/v1/deployments", "chat-both")
            assert engines is not None and engines["spec"]["replicas"] == 1
            assert engines["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == "both"
            status = env.pool()["status"]
            conditions = {c["type"]: c for c in status["conditions"]}
            assert conditions["Degraded"]["status"] == "False" and conditions["Progressing"]["status"] == "True"
            # two router replicas (the default) and no database: they keep stored responses apart, and say so
            shared = conditions["RouterStateShared"]
            assert (shared["status"], shared["reason"]) == ("False", "NoStore") and "404" in shared["message"]
            assert status["routerAddress"] == "http://chat-router.pool.svc:8080"
            await eventually(lambda: env.events("Reconciled") and env.events("NoStore"))

            # A change to the spec is patched onto the objects, and rolls the pods whose configuration changed.
            old_hash = engines["spec"]["template"]["metadata"]["annotations"]["kvmesh.io/config-hash"]
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"router": {"replicas": 3},
                                                                "engine": {"maxNumSeqs": 32},
                                                                "store": {"databaseUrl": "sqlite:///pool.db"}}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 2)
            shared = {c["type"]: c for c in env.pool()["status"]["conditions"]}["RouterStateShared"]
            assert (shared["status"], shared["reason"]) == ("True", "Database")
            assert env.get("apps/v1/deployments", "chat-router")["spec"]["replicas"] == 3  # type: ignore[index]
            engines = env.get("apps/v1/deployments", "chat-both")
            assert engines["spec"]["template"]["metadata"]["annotations"]["kvmesh.io/config-hash"] != old_hash  # type: ignore[index]
            config = env.get("v1/configmaps", "chat-config")
            assert yaml.safe_load(config["data"]["engine.yaml"])["engine"]["max_num_seqs"] == 32  # type: ignore[index]

            # Switched to disaggregated without the Gateway pool: the new roles appear, and what the spec no longer
            # asks for (the `both` Deployment and budget, the Gateway InferencePool) is deleted.
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated",
                                                                "gatewayInferencePool": {"enabled": False}}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 3)
            owned = kinds(env.owned())
            assert owned["Deployment"] == {"chat-prefill", "chat-decode", "chat-router"}
            assert owned["PodDisruptionBudget"] == {"chat-prefill", "chat-decode", "chat-router"}
            assert "InferencePool" not in owned

            # Deleted: the pool goes (its objects carry owner references for the garbage collector, which the
            # emulator lacks), and the operator carries on.
            await env.k8s.delete(f"{POOLS}/chat")
            await eventually(lambda: env.get(f"{GROUP}/{VERSION}/{PLURAL}", "chat") is None)
            await asyncio.sleep(0.5)

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_deleted_during_a_scaling_tick_goes_once_the_tick_returns(tmp_path: Path) -> None:
    """kopf's finalizer keeps a deleted pool until its scaling timer stops; a tick under way (here, held) cannot
    stop at once, and one that writes nothing to the pool wakes nothing: the operator has kopf check the timer
    again every TIMER_STOP_POLL_SECONDS, not kopf's default 60 s, which outlasts `eventually`'s 30 s."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body())
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            await eventually(env.ticks)  # the first tick evaluated; later ones return early (the clock stands)
            env.ticks_gate.close()
            await eventually(env.ticks_gate.holding.is_set)
            await env.k8s.delete(f"{POOLS}/chat")
            # kopf has asked the timer to stop, and run the deletion handler (it drops the pool's series)
            await eventually(lambda: env.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome="ok") is None)
            assert env.get(f"{GROUP}/{VERSION}/{PLURAL}", "chat") is not None  # the finalizer holds it meanwhile
            env.ticks_gate.open()
            await eventually(lambda: env.get(f"{GROUP}/{VERSION}/{PLURAL}", "chat") is None)

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_invalid_spec_is_reported_as_degraded_and_fixing_it_recovers(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            # min > max: a real API server's CEL rule would refuse it; the emulator lets it through.
            await env.k8s.post(POOLS, json=pool_body(replicas={"both": {"min": 5, "max": 2}}))
            degraded = await eventually(lambda: {c["type"]: c for c in env.pool()["status"]["conditions"]}["Degraded"])
            assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
            assert "min must be at most max" in degraded["message"]
            await eventually(lambda: env.events("InvalidSpec"))
            assert env.get("apps/v1/deployments", "chat-both") is None
            # the timer cannot read the pool: its heartbeat counts errors (an operator newer than its CRD)
            await eventually(lambda: (env.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome="error") or 0) >= 2)
            assert env.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome="ok") == 0
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"replicas": {"both": {"min": 2, "max": 4}}}})
            await eventually(lambda: {c["type"]: c["status"] for c in env.pool()["status"]["conditions"]}
                             ["Degraded"] == "False")
            assert env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 2  # type: ignore[index]
            await eventually(lambda: env.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome="ok") == 1)

    run(main)


def fail(env: Env, action: kmock.action, plural: str, times: int, status: int,
         message: str | None = None) -> list[kmock.Request]:
    """The next `times` requests of `action` on `plural` answer `status` (with the Status `message`, if given);
    returns those requests as they come. (The emulator still carries out a failed write, as a server that committed
    it and then failed to answer.)"""
    failed: list[kmock.Request] = []
    before = max((r.id for r in env.k8s), default=-1)  # kmock offers a new reaction the requests already answered

    def matches(request: kmock.Request) -> bool:  # kmock may ask more than once per request
        if any(r is request for r in failed):
            return True
        if (request.id <= before or request.resource is None or request.resource.plural != plural
                or len(failed) >= times):
            return False
        failed.append(request)
        return True

    error = kmock.KubernetesError(status=status, reason=HTTPStatus(status).phrase,
                                  **({"message": message} if message else {}))
    env.k8s[action][matches] << error
    return failed


def conditions(env: Env) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in env.pool()["status"]["conditions"]}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_transient_api_error_is_retried_within_the_reconcile(tmp_path: Path) -> None:
    """An API server that fails once (a 503 to a create it had carried out: the worst case for a POST) costs the
    pool nothing: the client's retry policy sends the create again, which answers 409, the object is
    merge-patched, the reconcile succeeds, and the pool is never marked Degraded. Likewise for a delete."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            failed = fail(env, kmock.action.CREATE, "deployments", 1, 503)
            await env.k8s.post(POOLS, json=pool_body())
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            assert len(failed) == 1 and env.get("apps/v1/deployments", "chat-both") is not None
            degraded = conditions(env)["Degraded"]
            assert (degraded["status"], degraded["reason"]) == ("False", "Reconciled")
            assert env.events("ApiError") == []
            to_both = [r.action for r in env.k8s if r.resource is not None and r.resource.plural == "deployments"
                       and "chat-both" in (str(r.url.path), str((r.data or {}).get("metadata", {}).get("name")))]
            assert to_both[:3] == [kmock.action.CREATE, kmock.action.CREATE, kmock.action.UPDATE]  # 503, 409, patch

            # The same for a delete the server carried out before failing: its retry answers 404, which is done.
            failed = fail(env, kmock.action.DELETE, "deployments", 1, 503)
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 2)
            assert len(failed) == 1 and env.get("apps/v1/deployments", "chat-both") is None
            assert conditions(env)["Degraded"]["status"] == "False" and env.events("ApiError") == []

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_object_the_api_server_refuses_is_rejected_with_its_message_until_the_spec_changes(
        tmp_path: Path) -> None:
    """A 422 (an admission policy, a quota's rule: the spec is what is wrong) was Degraded/ApiError saying only
    '422 Unprocessable Entity', and retried with backoff forever, an Event each time. The condition now carries the
    server's message, which names the field, and nothing is retried until the spec changes."""
    refusal = ('Deployment.apps "chat-both" is invalid: spec.template.spec.containers[0].resources.limits: '
               'Invalid value: "64": must be less than or equal to the namespace limit of 16')

    async def main() -> None:
        async with operator(tmp_path) as env:
            failed = fail(env, kmock.action.CREATE, "deployments", 1, 422, refusal)
            await env.k8s.post(POOLS, json=pool_body())
            degraded = await eventually(lambda: conditions(env)["Degraded"])
            assert degraded["reason"] == "Rejected" and refusal in degraded["message"], degraded
            assert "applying Deployment chat-both failed: 422 Unprocessable Entity: " in degraded["message"]
            await asyncio.sleep(3)  # a TemporaryError would have been retried after 1 s and 2 s
            assert len(failed) == 1 and len(env.events("Rejected")) == 1
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"router": {"replicas": 1}}})
            await eventually(lambda: conditions(env)["Degraded"]["status"] == "False")
            assert env.get("apps/v1/deployments", "chat-both") is not None

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_persistent_api_error_is_degraded_then_retried(tmp_path: Path) -> None:
    """An error that outlasts the client's retries sets Degraded/ApiError with the status; kopf retries the
    reconcile with backoff, and once the API answers again the pool recovers."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            tries = API_RETRY.total + 1  # every try of one call
            failed = fail(env, kmock.action.LIST, "poddisruptionbudgets", tries, 500)
            await env.k8s.post(POOLS, json=pool_body())
            degraded = await eventually(lambda: conditions(env)["Degraded"])
            assert degraded["reason"] == "ApiError" and "500" in degraded["message"]
            assert "pruning" in degraded["message"]
            await eventually(lambda: env.events("ApiError"))
            await eventually(lambda: conditions(env)["Degraded"]["status"] == "False", seconds=30)
            assert len(failed) == tries and env.get("apps/v1/deployments", "chat-both") is not None

    run(main)


# ---- scaling ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_scaling_tick_is_counted_in_the_heartbeat_by_outcome(tmp_path: Path) -> None:
    """What the Stalled and EvaluationsFailing alerts read: one count per tick of the pool's timer, an error for
    a tick that cannot read its inputs (the pods list refused, as after lost RBAC), ok again once it can; the
    last evaluation's wall-clock time and the pool's interval; all gone with the pool."""
    evaluations = f"{OperatorMetric.EVALUATIONS}_total"

    async def main() -> None:
        async with operator(tmp_path) as env:
            start = time.time()
            await env.k8s.post(POOLS, json=pool_body(scaling={"intervalSeconds": 2}))

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            await eventually(lambda: env.ticks() >= 2)
            assert env.sample(evaluations, outcome="error") == 0
            assert env.sample(OperatorMetric.EVALUATION_INTERVAL) == 2
            stamped = env.sample(OperatorMetric.LAST_EVALUATION)
            assert stamped is not None and start <= stamped <= time.time()  # Unix time, not the operator's clock

            failed = fail(env, kmock.action.LIST, "pods", 2, 403)  # a 403 is not retried: two ticks fail
            await eventually(lambda: env.sample(evaluations, outcome="error") == 2)
            ok = env.sample(evaluations, outcome="ok") or 0
            await eventually(lambda: (env.sample(evaluations, outcome="ok") or 0) >= ok + 2)  # and recovers
            assert len(failed) == 2 and env.sample(evaluations, outcome="error") == 2

            # The clock stops, so no tick begins; once the last one ends, every tick begun was counted once.
            ticking.cancel()
            await eventually(lambda: env.ticks() == env.ticks_begun())
            await env.k8s.delete(f"{POOLS}/chat")
            await eventually(lambda: env.sample(OperatorMetric.LAST_EVALUATION) is None)
            assert env.sample(evaluations, outcome="ok") is None
            assert env.sample(OperatorMetric.EVALUATION_INTERVAL) is None

    run(main)


def metrics_text(usage: float, forecast: tuple[float, float, float], overload: float, blocks: int = 1000,
                 hits: float = 0.0) -> str:
    """An engine's /metrics, in the names engine/protocol.py fixes."""
    p50, p90, p99 = forecast
    return "\n".join([
        f"{VllmMetric.KV_USAGE} {usage}",
        f"{VllmMetric.RUNNING} 4",
        f"{VllmMetric.WAITING} 0",
        f'{VllmMetric.CACHE_CONFIG}{{block_size="16",num_gpu_blocks="{blocks}"}} 1',
        f'{Metric.FORECAST_USAGE}{{level="p50"}} {p50}',
        f'{Metric.FORECAST_USAGE}{{level="p90"}} {p90}',
        f'{Metric.FORECAST_USAGE}{{level="p99"}} {p99}',
        f"{Metric.FORECAST_OVERLOAD} {overload}",
        f"{VllmMetric.PREFIX_HITS}_total {hits}",
        "",
    ])


class MetricsServer:
    """A pod's /metrics on 127.0.0.x: what the operator scrapes at the pod's IP."""

    def __init__(self, host: str, port: int) -> None:
        self.text = metrics_text(0.1, (0.1, 0.1, 0.1), 0.0)
        self.scrapes = 0  # how many times the operator read it: one per tick
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.scrapes += 1
                body = owner.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pod_body(name: str, ip: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {POOL_LABEL: "chat", ROLE_LABEL: "both",
                                                                   "app.kubernetes.io/component": "engine"}},
            "spec": {"containers": [{"name": "engine", "image": "kvmesh"}]},
            "status": {"phase": "Running", "podIP": ip}}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_timer_scales_on_predicted_kv_and_marks_the_coldest_pod_for_scale_in(tmp_path: Path) -> None:
    port = free_port()
    servers = {ip: MetricsServer(ip, port) for ip in ("127.0.0.2", "127.0.0.3")}

    async def main() -> None:
        async with operator(tmp_path) as env:
            spec = {"engine": {"port": port}, "replicas": {"both": {"min": 1, "max": 6}},
                    "scaling": {"intervalSeconds": 1, "scaleDownStabilizationSeconds": 60}}
            await env.k8s.post(POOLS, json=pool_body(**spec))
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both"))
            for i, ip in enumerate(servers):
                await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod_body(f"chat-both-{i}", ip))
            await env.k8s.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-both/status",
                                json={"status": {"readyReplicas": 1}})

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            # Usage is 50 % now, but the pods forecast passing 95 % with 30 % probability: scale up ahead.
            for server in servers.values():
                server.text = metrics_text(0.5, (0.7, 1.0, 1.2), 0.3)
            replicas = await eventually(lambda: (env.get("apps/v1/deployments", "chat-both") or {})
                                        .get("spec", {}).get("replicas", 1) > 1
                                        and env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"])
            # The two pods' p90 demand is 2 x 1000 blocks: ceil(2000 / (80 % x 1000)) = 3 pods.
            assert replicas == 3
            await eventually(lambda: any("ScaleUpPredictedOverload" in e["message"] for e in env.events("Scaled")))
            # the tick patches the Deployment, then warms new pods, then writes the pool's status
            status = await eventually(lambda: env.pool()["status"].get("replicas", {}).get("both", {})
                                      .get("desired") == 3 and env.pool()["status"])
            assert status["lastDecision"] and status["kvUsage"]["predicted"] > 0.95
            assert env.sample(OperatorMetric.DESIRED_REPLICAS, role="both") == 3
            assert env.sample(f"{OperatorMetric.SCALING_DECISIONS}_total", role="both", direction="up") == 1
            assert env.sample(f"{OperatorMetric.SCALING_DECISIONS}_total", role="both", direction="down") == 0

            # Quiet again, and the stabilization window passes on the operator's clock: scale down, after
            # marking the pod whose cache served fewer hits lately as the one to delete first.
            servers["127.0.0.2"].text = metrics_text(0.1, (0.1, 0.1, 0.1), 0.0, hits=0)
            servers["127.0.0.3"].text = metrics_text(0.1, (0.1, 0.1, 0.1), 0.0, hits=0)
            await asyncio.sleep(0.5)
            servers["127.0.0.3"].text = metrics_text(0.1, (0.1, 0.1, 0.1), 0.0, hits=50_000)
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 1)
            costs = {name: env.get("v1/pods", name)["metadata"]["annotations"][DELETION_COST_ANNOTATION]
                     for name in ("chat-both-0", "chat-both-1")}
            assert int(costs["chat-both-0"]) < int(costs["chat-both-1"])  # the cold cache goes first
            await eventually(lambda: any("ScaleDownUnderTarget" in e["message"] for e in env.events("Scaled")))
            assert env.sample(f"{OperatorMetric.SCALING_DECISIONS}_total", role="both", direction="down") == 1
            ticking.cancel()
            await env.k8s.delete(f"{POOLS}/chat")  # a deleted pool's series go with it
            await eventually(lambda: env.sample(OperatorMetric.DESIRED_REPLICAS, role="both") is None)

    try:
        run(main)
    finally:
        for server in servers.values():
            server.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_with_hpa_mode_the_operator_creates_autoscalers_and_leaves_replicas_alone(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(scaling={"mode": "hpa"}))
            hpa = await eventually(lambda: env.get("autoscaling/v2/horizontalpodautoscalers", "chat-both"))
            assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == Metric.FORECAST_USAGE
            # The HPA moved the Deployment to 3; a spec change must not write replicas back.
            await env.k8s.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-both", json={"spec": {"replicas": 3}})
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"engine": {"maxNumSeqs": 16}}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 2)
            assert env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 3  # type: ignore[index]
            # Back to the operator's scaling: the autoscaler goes, so the two never fight.
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"scaling": {"mode": "operator"}}})
            await eventually(lambda: env.get("autoscaling/v2/horizontalpodautoscalers", "chat-both") is None)

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_permission_in_rbac_py_is_used(tmp_path: Path) -> None:
    """Every verb operator/rbac.py grants the operator is one it uses (the list is no wider than it needs): one
    pool is taken through each thing that asks for a permission, and the requests the operator made are compared
    with the list (every test of this module also checks the other way: no request outside it)."""
    port = free_port()
    server = MetricsServer("127.0.0.2", port)  # an idle engine: the pool will scale in

    async def main() -> None:
        async with operator(tmp_path) as env:
            # HPAs and the Gateway pool too: every kind is created, and the prunable kinds are listed
            spec = {"engine": {"port": port}, "replicas": {"both": {"min": 2, "max": 4}},
                    "gatewayInferencePool": {"enabled": True},
                    "scaling": {"mode": "hpa", "intervalSeconds": 1, "scaleDownStabilizationSeconds": 0}}
            await env.k8s.post(POOLS, json=pool_body(**spec))
            await eventually(lambda: env.get("autoscaling/v2/horizontalpodautoscalers", "chat-both"))
            await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pod_body("chat-both-0", "127.0.0.2"))
            # a spec change: every object is patched
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"engine": {"maxNumSeqs": 32}}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 2)

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            # the operator scales, min 1, no Gateway: the HPA and the Gateway pool are deleted, and the timer
            # scales the idle pool in, marking its pod's deletion cost first
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"replicas": {"both": {"min": 1}},
                                                                "gatewayInferencePool": {"enabled": False},
                                                                "scaling": {"mode": "operator"}}})
            await eventually(lambda: DELETION_COST_ANNOTATION in (env.get("v1/pods", "chat-both-0") or {})
                             .get("metadata", {}).get("annotations", {}))
            ticking.cancel()
            # disaggregated: the `both` Deployment and its budget are deleted
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both") is None
                             and env.get("policy/v1/poddisruptionbudgets", "chat-both") is None)
            await eventually(lambda: env.events("Reconciled") and env.events("Scaled"))
            granted = {(p.group, p.resource, verb) for p in rbac.OPERATOR if p not in rbac.ROUTER
                       for verb in p.verbs}
            assert granted - env.used() == set()

    try:
        run(main)
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_object_of_the_same_name_that_is_not_the_pool_s_is_left_alone(tmp_path: Path) -> None:
    """A ConfigMap named as the pool's would be, owned by someone else: the operator does not patch it (a merge
    patch would replace its owner references with the pool's, and the pool's deletion would then delete it). The
    pool is Degraded/NameConflict until the name is free, then reconciles."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            theirs = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"theirs": "yes"},
                      "metadata": {"name": "chat-config", "namespace": NS, "ownerReferences": [
                          {"apiVersion": "apps/v1", "kind": "Deployment", "name": "someone-else", "uid": "u-1",
                           "controller": True}]}}
            await env.k8s.post(f"/api/v1/namespaces/{NS}/configmaps", json=theirs)
            await env.k8s.post(POOLS, json=pool_body())
            degraded = await eventually(lambda: conditions(env)["Degraded"])
            assert degraded["reason"] == "NameConflict" and "Deployment someone-else" in degraded["message"]
            left = env.get("v1/configmaps", "chat-config")
            assert left is not None and left["data"] == {"theirs": "yes"}
            assert left["metadata"]["ownerReferences"][0]["name"] == "someone-else"
            await eventually(lambda: env.events("NameConflict"))
            await env.k8s.delete(f"/api/v1/namespaces/{NS}/configmaps/chat-config")
            await eventually(lambda: conditions(env)["Degraded"]["status"] == "False", seconds=60)
            mine = env.get("v1/configmaps", "chat-config")
            assert mine is not None and mine["metadata"]["ownerReferences"][0]["kind"] == KIND

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_deployment_deleted_by_hand_is_applied_again_at_the_next_tick(tmp_path: Path) -> None:
    """The operator is level-triggered for what matters most: an engine Deployment deleted by hand comes back at the
    pool's next evaluation, not at the next edit of the spec, with a Warning Event saying so."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(scaling={"intervalSeconds": 1}))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            await env.k8s.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-both")
            assert env.get("apps/v1/deployments", "chat-both") is None

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            back = await eventually(lambda: env.get("apps/v1/deployments", "chat-both"))
            assert back["metadata"]["ownerReferences"][0]["kind"] == KIND
            (event,) = await eventually(lambda: env.events("Repaired"))  # posted once the objects are applied
            ticking.cancel()
            assert "both" in event["message"]

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_deployments_scaled_by_hand_out_of_bounds_are_scaled_back(tmp_path: Path) -> None:
    """`kubectl scale` of the engines past their max (or below their min), or of the router to 0, stayed: the
    decision was compared with the replicas clamped to the bounds, which it equalled, and the router's replicas
    were applied only at an edit of the spec. A pool someone scaled to 0 answered nothing until then."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(scaling={"intervalSeconds": 1}))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            deployments = f"/apis/apps/v1/namespaces/{NS}/deployments"
            await env.k8s.patch(f"{deployments}/chat-both", json={"spec": {"replicas": 10}})  # max 4
            await env.k8s.patch(f"{deployments}/chat-router", json={"spec": {"replicas": 0}})

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            await eventually(lambda: env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] <= 4)
            await eventually(lambda: env.get("apps/v1/deployments", "chat-router")["spec"]["replicas"] == 2)
            ticking.cancel()

            def said(start: str) -> bool:  # kopf posts Events in the background
                return any(e["message"].startswith(start) for e in env.events("Scaled"))

            await eventually(lambda: said("both: 10 -> ") and said("router: 0 -> 2 replicas"))

    run(main)


class FakeEngine:
    """An engine pod on 127.0.0.x as the operator's calls see it: its /metrics, a /v1/models listing no adapter,
    and 200 to everything posted (an adapter load, a warm-up gate); every request is recorded with the internal
    token it carried."""

    def __init__(self, host: str, port: int) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, token header
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                owner.requests.append(("GET", self.path.split("?")[0], self.headers.get(INTERNAL_TOKEN_HEADER)))
                if self.path == "/metrics":
                    self.answer(metrics_text(0.1, (0.1, 0.1, 0.1), 0.0).encode(), "text/plain; version=0.0.4")
                elif self.path.startswith("/v1/kv/hot"):
                    self.answer(b'{"chains": [{"hashes": [1, 2]}]}')
                else:
                    self.answer(b'{"object": "list", "data": [{"id": "base", "object": "model"}]}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.requests.append(("POST", self.path, self.headers.get(INTERNAL_TOKEN_HEADER)))
                self.answer(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def calls(self, since: int = 0) -> list[tuple[str, str, str | None]]:
        """The requests after the first `since`, less the scrapes (/metrics asks for no token)."""
        return [r for r in self.requests[since:] if r[1] != "/metrics"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def secret_token(env: Env) -> str | None:
    secret = env.get("v1/secrets", "chat-internal-token")
    return None if secret is None else base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_pool_has_an_internal_token_its_pods_mount_and_its_engine_calls_send(tmp_path: Path) -> None:
    """The pool's Secret is created once, owned by the pool (the GC removes it with the pool), and not rewritten by
    a later reconcile; every engine and router pod mounts it; the operator's calls to the engines (here the LoRA
    sync: /v1/models, /v1/load_lora_adapter) carry its token. Deleted (a rotation), it is made again with a new
    token at the next evaluation, which the calls send from then on."""
    port = free_port()
    engine = FakeEngine("127.0.0.2", port)
    ready_pod = pod_body("chat-both-0", "127.0.0.2")
    ready_pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    spec = {"engine": {"port": port, "maxLoras": 2, "maxLoraRank": 8}, "replicas": {"both": {"min": 1, "max": 1}},
            "scaling": {"intervalSeconds": 1},
            "model": {"source": "bundled", "loraAdapters": [{"name": "sql", "path": "/adapters/sql"}]}}

    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(**spec))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            secret = env.get("v1/secrets", "chat-internal-token")
            assert secret is not None and secret["type"] == "Opaque"
            (owner,) = secret["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"], owner["controller"]) == (KIND, env.pool()["metadata"]["uid"], True)
            token = secret_token(env)
            assert token and len(token) >= 32
            for name in ("chat-both", "chat-router"):
                pod = env.get("apps/v1/deployments", name)["spec"]["template"]["spec"]  # type: ignore[index]
                (volume,) = [v for v in pod["volumes"]
                             if v.get("secret", {}).get("secretName") == "chat-internal-token"]
                (container,) = pod["containers"]
                (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
                assert mount["readOnly"]
                wanted = {"name": "KVMESH_INTERNAL_TOKEN_FILE", "value": f"{mount['mountPath']}/token"}
                assert wanted in container["env"]

            # a second reconcile (a spec change) leaves the Secret as it was
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"engine": {"maxNumSeqs": 16}}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 2)
            again = env.get("v1/secrets", "chat-internal-token")
            assert again is not None and again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
            assert secret_token(env) == token

            await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=ready_pod)

            async def clock() -> None:
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            await eventually(lambda: {("GET", "/v1/models"), ("POST", "/v1/load_lora_adapter")}
                             <= {r[:2] for r in engine.calls()})
            assert {r[2] for r in engine.calls()} == {token}

            # rotation: the Secret deleted, the next evaluation makes a new one and sends its token
            await env.k8s.delete(f"/api/v1/namespaces/{NS}/secrets/chat-internal-token")
            rotated = await eventually(lambda: secret_token(env) not in (None, token) and secret_token(env))
            seen = len(engine.requests)
            await eventually(lambda: any(r[2] == rotated for r in engine.calls(seen)))
            ticking.cancel()
            assert env.get("v1/secrets", "chat-internal-token")["metadata"]["ownerReferences"][0]["kind"] == KIND  # type: ignore[index]

    try:
        run(main)
    finally:
        engine.close()


def test_the_warm_up_calls_send_the_pools_token_and_never_log_it() -> None:
    """http_warm (the source's hot listing, the target's warm) and http_open_gates carry the token given as `auth`;
    without one they send none (a pool whose engines ask for none)."""
    engine = FakeEngine("127.0.0.1", free_port())
    try:
        url = f"http://127.0.0.1:{engine.server.server_address[1]}"
        source, target = ServingPod("a", "both", url), ServingPod("b", "both", url)
        token = InternalToken.fixed("s" * 43)
        assert "s" * 43 not in repr(token)
        assert http_warm(Warmup("both", source, (target,)), 4, auth=token) == {"b": {}}
        assert http_open_gates([target], auth=token) == {"b": None}
        assert engine.calls() == [("GET", "/v1/kv/hot", "s" * 43), ("POST", "/v1/kv/warm", "s" * 43),
                                  ("POST", "/v1/admin/ready", "s" * 43)]
        seen = len(engine.requests)
        http_open_gates([target])
        assert engine.calls(seen) == [("POST", "/v1/admin/ready", None)]
    finally:
        engine.close()
