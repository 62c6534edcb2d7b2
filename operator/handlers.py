"""The kopf operator: read a pool, call the pure functions (crd, desired, forecast, scaling), apply, report.

Reconciling (create, update, resume): parse the pool, make sure its internal-token Secret exists (created once with
a fresh token, never rewritten: `pool_token`), compute its objects, apply each by create-then-patch (an object that
exists answers 409 to the create and is merge-patched three ways: what the operator applied last time, recorded on
the object, and no longer asks for is deleted), and write status (the handlers write it themselves, `write_status`,
so that a status the API server refuses is said, and the rest of it still written). A bad spec sets
Degraded/InvalidSpec and waits for the next change; an API call that still fails after `API_RETRY`'s few tries
sets Degraded/ApiError and kopf retries the handler with exponential backoff. Neither raises out of a handler
uncaught, so the operator never crash-loops.

Scaling: a timer per pool scrapes its engine pods' /metrics (and, for a pool that scales to zero, its router
pods': the requests they hold for want of an engine), estimates the pool's traffic, asks `scaling.decide`, and
(unless HPAs own the replicas) patches each Deployment's replicas, marks the pods worth least for deletion
first, and posts an Event with the reason. Its calls to engines (warm-ups, warm-up gates, LoRA adapters; not the
scrapes: /metrics is open) carry the pool's internal token, read from the Secret at each evaluation (which also
makes the Secret again if it was deleted: a rotation). Kubernetes calls go through the official client
in kopf's handler threads; kopf itself watches the pools.

Only what needs kopf or the Kubernetes API lives here; the pieces `kvmesh up -f` shares (the operator's metrics,
its memory of a pool, its HTTP calls to engines) live in kopf-free modules, so a local pool never loads kopf.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any

import kopf
from kubernetes.client import Configuration
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server

from kvmesh.engine.internal_token import MIN_TOKEN_CHARS, InternalToken, new_token
from kvmesh.engine.protocol import POOL_LABEL, ROLE_LABEL
from kvmesh.operator import desired
from kvmesh.operator.conditions import RefusedStatus, pool_conditions, ready_replicas, refused_status, switching
from kvmesh.operator.crd import (
    API_VERSION,
    GROUP,
    PLURAL,
    VERSION,
    Pool,
    PoolDefaults,
    SpecError,
    parse_pool,
    spec_roles,
)
from kvmesh.operator.engines import Scraper, http_open_gates, http_scrape, http_warm, scrape_all
from kvmesh.operator.forecast import PodMetrics, parse_pod, parse_router_held
from kvmesh.operator.kube import PLURALS, Kube, NameTaken, merged, owned_by, same_owner
from kvmesh.operator.leader import Election, run_elected
from kvmesh.operator.lora import REFUSED, AdapterMemory, AdapterStatus, EnginePod, adapter_tick, http_act, http_served
from kvmesh.operator.memory import (
    PoolMemory,
    RouterView,
    current_replicas,
    decided_replicas,
    now_timestamp,
    pod_hit_rates,
    status_replicas,
)
from kvmesh.operator.metrics import LeaderMetrics, OperatorMetrics
from kvmesh.operator.pod_client import close_pod_client
from kvmesh.operator.routers_first import REASON as ROUTERS_FIRST
from kvmesh.operator.routers_first import held_message, legacy_engines, routers_first
from kvmesh.operator.scale_in import deletion_costs
from kvmesh.operator.scaling import SCALED_ROLES, Decision
from kvmesh.operator.warmup import GateOpener, PodPlace, Warmer, WarmupSettings, carry_out, plan_tick_warmups
from kvmesh.router.discovery import endpoint_url

log = logging.getLogger("kvmesh.operator")

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
BACKOFF_MAX_SECONDS = 120.0
# How often kopf checks whether a deleted pool's scaling timer has stopped, so that it can remove its finalizer
# (the `configure` handler says why this is not kopf's 60 s).
TIMER_STOP_POLL_SECONDS = 1.0
# kopf runs every sync handler (each pool's scaling tick, each reconcile) in one thread pool, by default of
# min(32, CPUs + 4) threads, the CPUs being the node's, not the container's: 6 on 2 CPUs. A tick mostly waits
# (on the API server, on each pod's /metrics for up to 2 s, on a new pod's warm-up), so a few pods that never
# answer held every thread and delayed every other pool: 20 pools with one such pod each stretched a 3.6 s
# evaluation period to 11.1 s with 6 threads (5.0 s with 64). Waiting threads cost little memory and no CPU.
DEFAULT_WORKERS = 64


# Kinds a pool owns only under some specs (a role's Deployment and budget, HPAs, the Gateway pool): what the
# current spec no longer asks for is deleted, so that no stale Deployment keeps serving or stale HPA keeps scaling.
PRUNED = (("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"),
          ("autoscaling/v2", "HorizontalPodAutoscaler"), (desired.GATEWAY_API_VERSION, "InferencePool"))


def owned(kube: Kube, pool: Pool, api_version: str, kind: str) -> list[dict[str, Any]]:
    """The pool's objects of one kind (its label, and the pool as an owner); none when the API is not installed
    (the Gateway extension)."""
    try:
        items = kube.list(api_version, PLURALS[kind], pool.namespace, f"{POOL_LABEL}={pool.name}")
    except ApiException as exc:
        if exc.status == HTTPStatus.NOT_FOUND:
            return []
        raise
    return [i for i in items if any(ref.get("uid") == pool.uid for ref in i["metadata"].get("ownerReferences") or [])]


def by_role(deployments: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployments keyed by their role label (the router's under "router")."""
    return {d["metadata"]["labels"].get(ROLE_LABEL): d for d in deployments}


@dataclass(frozen=True)
class Pruned:
    """What a prune did: the objects deleted ("Kind/name"), and the previous mode's roles it kept serving."""

    deleted: list[str]
    kept: tuple[str, ...]


def prune(kube: Kube, pool: Pool, objects: list[dict[str, Any]]) -> Pruned:
    """Delete the pool's objects of the PRUNED kinds that `objects` leaves out, except a previous mode's roles
    while the new ones cannot serve yet (`desired.retained_roles`, from the Deployments' status: make before
    break)."""
    deployments = owned(kube, pool, "apps/v1", "Deployment")
    kept = desired.retained_roles(pool, by_role(deployments))
    keep = {(o["kind"], o["metadata"]["name"]) for o in objects} | desired.retained_objects(pool, kept)
    deleted: list[str] = []
    for api_version, kind in PRUNED:
        for item in deployments if kind == "Deployment" else owned(kube, pool, api_version, kind):
            name = item["metadata"]["name"]
            if (kind, name) not in keep:
                kube.delete(api_version, PLURALS[kind], pool.namespace, name)
                deleted.append(f"{kind}/{name}")
    return Pruned(deleted, kept)


REJECTED = "Rejected"  # the Degraded reason of an object the API server refused as invalid (422)


def answer_body(exc: ApiException) -> dict[str, Any]:
    """The Status object an API error carries ({} when its body is not one)."""
    try:
        body = json.loads(exc.body or "{}")
    except (ValueError, TypeError):
        return {}
    return body if isinstance(body, dict) else {}


def api_answer(exc: Exception) -> str:
    """An API error as the pool's condition and Event say it: the status line and the server's own message, which
    names the field (`422 Unprocessable Entity: ...spec.containers[0].resources.requests: Invalid value...`)."""
    if not isinstance(exc, ApiException):
        return str(exc)
    message = answer_body(exc).get("message")
    return f"{exc.status} {exc.reason}: {message}" if message else f"{exc.status} {exc.reason}"


STATUS_REFUSED = "StatusRefused"  # the Warning Event of a status patch the API server refused as invalid (422)
# How long a pool's status is written without what the API server refused before the whole is tried again, so that
# a CRD applied meanwhile gets the refused fields written again without a restart of the operator.
STATUS_RECHECK_SECONDS = 300.0
# The fix of a refused status, as docs/operations.md's upgrade gives it (Helm installs a chart's crds/ once and never
# upgrades them, so a `helm upgrade` alone leaves the API server validating against the older CRD)
CRD_APPLY = "kubectl apply --server-side --force-conflicts -f charts/kvmesh/crds/"


@dataclass
class StatusWrites:
    """What one pool's status is written without, because the API server refused it, and since when (monotonic)."""

    refused: RefusedStatus | None = None
    since: float = 0.0


def status_writes(memo: kopf.Memo) -> StatusWrites:
    """The pool's StatusWrites, which its reconcile and its scaling tick share (kopf keeps one memo per pool)."""
    writes: StatusWrites = memo.setdefault("kvmesh-status", StatusWrites())
    return writes


def write_status(kube: Kube, body: kopf.Body, writes: StatusWrites, report: Mapping[str, Any],
                 current: Mapping[str, Any] | None = None) -> None:
    """Merge-patch the pool's status with `report` (only the fields that differ from `current`, when given).

    The handlers write status themselves, not through kopf's patch, which kopf applies after a handler returns:
    there a refusal ended the pool's scaling timer for good (kopf stops a timer whose patch raises) and no one was
    told. A 422 here (an InferencePool CRD older than the operator, whose schema refuses a newer condition type)
    is a Warning Event and an error log naming the likely cause and its fix, and the status is written again
    without what the answer names, as every later status for STATUS_RECHECK_SECONDS, when the whole is tried
    again. A 422 that names nothing of the patch, and any other error, goes on to the caller."""
    namespace, name = str(body.metadata.namespace), str(body.metadata.name)
    whole = writes.refused is None or time.monotonic() - writes.since >= STATUS_RECHECK_SECONDS
    sent = writes.refused.left_out_of(report) if writes.refused is not None and not whole else dict(report)
    if current is not None:
        sent = {k: v for k, v in sent.items() if merged(current.get(k), v) != current.get(k)}
    if not sent:
        return
    try:
        kube.patch(API_VERSION, PLURAL, namespace, name, {"status": sent}, subresource="status")
    except ApiException as exc:
        if exc.status != HTTPStatus.UNPROCESSABLE_ENTITY:
            raise
        refused = refused_status(sent, answer_body(exc))
        done = (f"it is written without {refused} meanwhile, and whole again every {STATUS_RECHECK_SECONDS:.0f} s"
                if refused is not None else "none of it was written")
        message = (f"the API server refused the pool's status as invalid: the InferencePool CRD it serves is likely "
                   f"older than this operator (a helm upgrade never upgrades the chart's crds/); apply this "
                   f"release's: {CRD_APPLY}; {done}. The API server: {api_answer(exc)}")
        kopf.event(body, type="Warning", reason=STATUS_REFUSED, message=message[:1024])
        log.error("pool %s/%s: %s", namespace, name, message)
        if refused is None:
            raise
        if not whole and writes.refused is not None:
            refused = writes.refused | refused
        writes.refused, writes.since = refused, time.monotonic()
        kube.patch(API_VERSION, PLURAL, namespace, name, {"status": refused.left_out_of(sent)}, subresource="status")
        return
    if whole and writes.refused is not None:
        log.info("pool %s/%s: the API server now takes %s in status", namespace, name, writes.refused)
        writes.refused = None


class ApplyFailed(Exception):
    """A pool's objects could not all be applied; the message names the step and the API's answer, `reason` the
    Degraded condition's: NameConflict (an object of that name is another's), InvalidSecret (the pool's
    internal-token Secret holds no usable token), Rejected (the API server refused an object as invalid: only a
    change of the spec helps) or ApiError."""

    def __init__(self, message: str, reason: str = "ApiError") -> None:
        super().__init__(message)
        self.reason = reason


def pool_token(kube: Kube, pool: Pool) -> str:
    """The pool's internal token, from its Secret (desired.internal_token_secret), which is created with a fresh
    token when there is none and never rewritten. ApplyFailed when the API fails, when a Secret of that name is
    another's (NameConflict: it is not used, nor changed), or when the pool's own holds no usable token
    (InvalidSecret: deleting it makes a new one)."""
    name = desired.internal_token_name(pool)
    wanted = desired.internal_token_secret(pool, new_token())
    try:
        secret = kube.create_or_read(wanted)
    except Exception as exc:  # an API answer, or no answer at all
        reason = api_answer(exc)
        raise ApplyFailed(f"reading or creating Secret {name} failed: {reason}") from exc
    if not same_owner(wanted, secret):
        raise ApplyFailed(f"Secret {name} exists and is not this pool's ({owned_by(secret)}): it is left as it is; "
                          "delete or rename it, or give the pool another name", "NameConflict")
    token = desired.secret_token(secret)
    if token is None or len(token) < MIN_TOKEN_CHARS:
        raise ApplyFailed(f"Secret {name} holds no internal token of at least {MIN_TOKEN_CHARS} characters under "
                          f"the key `token`; delete it and the operator makes a new one", "InvalidSecret")
    return token


def current_token(kube: Kube, pool: Pool, memo: kopf.Memo) -> InternalToken | None:
    """The token the evaluation's engine calls send: the Secret's, read now (and made again if it was deleted), or
    the last one read when that fails (logged: the calls may meet 401s until it is read again); None when none was
    ever read (the calls go without, and engines answer 401, which the tick survives)."""
    try:
        memo["kvmesh-token"] = InternalToken.fixed(pool_token(kube, pool))
    except ApplyFailed as exc:
        log.warning("pool %s/%s: %s", pool.namespace, pool.name, exc)
    token: InternalToken | None = memo.get("kvmesh-token")
    return token


@dataclass(frozen=True)
class Applied:
    """What `apply_pool` did, for the reconcile's Event and conditions."""

    summary: str  # one line: created, patched, deleted
    kept: tuple[str, ...]  # the previous mode's roles kept serving (`prune`)


def apply_pool(kube: Kube, pool: Pool, objects: list[dict[str, Any]], held: Collection[str] = ()) -> Applied:
    """Apply `objects` (create-then-patch, deleting the fields the spec no longer asks for: `Kube.apply`), then
    prune the objects the spec no longer asks for. The Deployments named in `held` (`routers_first`: they carry
    their live template) are patched without `spec.template`, which is neither changed nor recorded as applied:
    the apply that later gives them the new template is three-way against a record without one, so it deletes
    nothing of the template (a recorded live template would have it delete every field the API server
    defaulted)."""
    done = {"created": 0, "patched": 0}
    step = "pruning objects the spec no longer asks for"
    try:
        for obj in objects:
            step = f"applying {obj['kind']} {obj['metadata']['name']}"
            body, keep = desired.patch_body(pool, obj), desired.HANDED_OFF
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] in held:
                body = {**body, "spec": {k: v for k, v in body["spec"].items() if k != "template"}}
                keep = (*keep, ("spec", "template"))
            done[kube.apply(obj, body, keep=keep)] += 1
        step = "pruning objects the spec no longer asks for"
        pruned = prune(kube, pool, objects)
    except Exception as exc:  # an API answer, or no answer at all (the retries spent on a dead connection)
        reason = api_answer(exc)
        invalid = isinstance(exc, ApiException) and exc.status == 422
        kind = "NameConflict" if isinstance(exc, NameTaken) else REJECTED if invalid else "ApiError"
        raise ApplyFailed(f"{step} failed: {reason}", kind) from exc
    kept = f", {' and '.join(pruned.kept)} kept until the new mode serves" if pruned.kept else ""
    return Applied(f"{done['created']} created, {done['patched']} patched, {len(pruned.deleted)} deleted{kept}",
                   pruned.kept)


def live_deployments(kube: Kube, pool: Pool) -> dict[str, dict[str, Any]]:
    """The pool's Deployments by role, as they are now. ApplyFailed."""
    try:
        return by_role(kube.list("apps/v1", "deployments", pool.namespace, f"{POOL_LABEL}={pool.name}"))
    except Exception as exc:  # an API answer, or none (the retries spent)
        reason = api_answer(exc)
        raise ApplyFailed(f"listing the pool's Deployments failed: {reason}") from exc


def starting_replicas(pool: Pool, status: Mapping[str, Any], added: Collection[str],
                      deployments: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The replicas a reconcile applies per role: those last decided (`decided_replicas`: not for the roles in
    `added`); for a role without one, what its Deployment (of the pool's live `deployments`) has if it exists (a
    previous mode's, kept serving while a switch away from it was pending, and switched back to: its pods must not
    be scaled in), else its minimum."""
    decided = decided_replicas(pool, status, added)
    unknown = [r for r in pool.roles if r not in decided]
    initial = desired.initial_replicas(pool)
    return initial | deployed_replicas({r: initial[r] for r in unknown}, deployments,
                                       {r: pool.bounds(r) for r in unknown}) | decided


def reconciled(status: Mapping[str, Any], generation: int) -> bool:
    """Whether the pool's objects were applied for `generation`: observed, and not Degraded by the reconcile (a
    stuck rollout is the tick's own finding: its objects were applied)."""
    return status.get("observedGeneration") == generation and not any(
        c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") != "RolloutStuck"
        for c in status.get("conditions") or [])


def backoff_seconds(retry: int) -> float:
    return min(BACKOFF_MAX_SECONDS, 2.0 ** min(retry, 10))


@dataclass
class OperatorConfig:
    kubeconfig: str | None = None  # None: the in-cluster service account
    namespaces: tuple[str, ...] = ()  # none: every namespace
    tick_seconds: float = 5.0  # how often each pool's timer wakes (its spec's intervalSeconds decides whether to act)
    metrics_port: int | None = None  # serve the operator's /metrics here
    health_port: int | None = None  # serve kopf's liveness probe at /healthz here
    election: Election | None = None  # reconcile only while holding this Lease; None: always (one replica)
    workers: int = DEFAULT_WORKERS  # threads running the pools' handlers at once (`--workers`)
    pool_defaults: PoolDefaults = field(default_factory=PoolDefaults.from_env)  # the image and ports pools default to
    # The scaling clock: the timer's gate, the stabilization history, the traffic estimate and the idle clock all
    # measure intervals, which a wall clock's NTP step would break (a step back stopped evaluations until the
    # clock caught up, a step forward emptied the scale-down window at once). None of these times is persisted:
    # status holds wall-clock stamps only (now_timestamp), and a restarted operator starts its history afresh.
    clock: Callable[[], float] = time.monotonic


def pod_url(pod: Mapping[str, Any], port: int) -> str:
    return endpoint_url(pod["status"]["podIP"], port)


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition (its readiness probe: /health answers 200)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def addressable(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods with an address that are not being deleted: those the operator may call."""
    return [p for p in pods if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")]


def unanswered(pods: list[dict[str, Any]], scraped: list[PodMetrics]) -> dict[str, list[str]]:
    """Per role, the Ready engine pods that did not answer their scrape (sorted names): pods that serve but whose
    load the scaler cannot see, so that it must not shrink their role (a starting pod, not Ready, has no load)."""
    answered = {m.observation.name for m in scraped}
    missing: dict[str, list[str]] = {}
    for pod in addressable(pods):
        if pod_ready(pod) and pod["metadata"]["name"] not in answered:
            missing.setdefault(pod["metadata"]["labels"].get(ROLE_LABEL, "both"), []).append(pod["metadata"]["name"])
    return {role: sorted(names) for role, names in missing.items()}


def live_replicas(replicas: Mapping[str, int], deployments: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Each role's replicas as its Deployment's spec has them now, else `replicas` (the last decided, from
    status): what a decision is compared with, so a `kubectl scale` outside the bounds is patched back."""
    out = dict(replicas)
    for role in replicas:
        spec = (deployments.get(role) or {}).get("spec") or {}
        if isinstance(spec.get("replicas"), int):
            out[role] = spec["replicas"]
    return out


def scale_routers_back(kube: Kube, pool: Pool, body: kopf.Body, router: Mapping[str, Any] | None,
                       reconciled: bool) -> None:
    """The router Deployment at spec.router.replicas: one scaled by hand (to 0, a pool that answers nothing) came
    back only at the next edit of the spec. Not before this generation's reconcile, which applies the spec, nor
    from a tick that read an older spec than the pool now has (an edit's reconcile may have applied it already)."""
    live = ((router or {}).get("spec") or {}).get("replicas")
    wanted = pool.spec["router"]["replicas"]
    current = int(body.metadata.get("generation") or 0) == pool.generation
    if not reconciled or not current or not isinstance(live, int) or live == wanted:
        return
    kube.patch("apps/v1", "deployments", pool.namespace, desired.router_name(pool), {"spec": {"replicas": wanted}})
    message = f"router: {live} -> {wanted} replicas (spec.router.replicas; the Deployment was scaled by hand)"
    kopf.event(body, type="Normal", reason="Scaled", message=message)
    log.info("pool %s/%s %s", pool.namespace, pool.name, message)


def deployed_replicas(replicas: Mapping[str, int], deployments: Mapping[str, Mapping[str, Any]],
                      bounds: Mapping[str, tuple[int, int]]) -> dict[str, int]:
    """`live_replicas` within each role's bounds: the pods that exist or start, what the decision starts from. A
    `kubectl scale` of a Deployment is then patched back when it differs from the decision; read from status it
    stayed, since the decision equalled the number recorded and nothing was patched."""
    live = live_replicas(replicas, deployments)
    return {role: min(max(n, bounds[role][0]), bounds[role][1]) for role, n in live.items()}


def observe(pods: list[dict[str, Any]], port: int, scrape: Scraper) -> list[PodMetrics]:
    """Scrape the /metrics of every engine pod with an address, Ready or not (a new pod answers them before its
    warm-up gate lets it be Ready), all at once (`scrape_all`); a pod that does not answer is left out (the
    Ready ones among them are named by `unanswered`)."""
    ready = addressable(pods)
    texts = scrape_all({p["metadata"]["name"]: pod_url(p, port) + "/metrics" for p in ready}, scrape)
    scraped: list[PodMetrics] = []
    for pod in ready:
        name, text = pod["metadata"]["name"], texts[pod["metadata"]["name"]]
        if isinstance(text, Exception):  # a starting or dying pod: the scaler counts it in replicas, not in metrics
            log.debug("scrape of %s failed: %s", name, text)
        else:
            scraped.append(parse_pod(name, pod["metadata"]["labels"].get(ROLE_LABEL, "both"), text))
    return scraped


def observe_routers(pods: list[dict[str, Any]], port: int, scrape: Scraper) -> RouterView:
    """The requests the pool's router pods hold for want of a ready engine, summed over those that answer their
    /metrics (scale to zero's wake-up: a pool at 0 has no engine to count a request); and whether a Ready router
    did not answer."""
    alive = {p["metadata"]["name"]: p for p in addressable(pods)}
    total, unseen = 0, False
    for name, text in scrape_all({n: pod_url(p, port) + "/metrics" for n, p in alive.items()}, scrape).items():
        if isinstance(text, Exception):
            log.debug("scrape of router %s failed: %s", name, text)
            unseen = unseen or pod_ready(alive[name])
        else:
            total += parse_router_held(text)
    return RouterView(total, unseen)


def kopf_connection(configuration: Configuration) -> kopf.ConnectionInfo:
    """What kopf's watches and patches authenticate with: the same server, certificates and bearer token as the
    operator's own API calls. The token is asked of the configuration each time (kopf logs in again after a 401),
    which runs the client's refresh hook: a service account's token file, rotated by the kubelet, is read again.
    The loaders keep it under `BearerToken`, as `Bearer X` (kubeconfig) or `bearer X` (in the cluster)."""
    c = configuration
    header = (c.get_api_key_with_prefix("BearerToken") or "").strip()
    scheme, _, rest = header.partition(" ")
    token = rest.strip() if scheme.lower() == "bearer" and rest.strip() else header
    return kopf.ConnectionInfo(server=c.host, ca_path=c.ssl_ca_cert, insecure=not c.verify_ssl,
                               scheme="Bearer" if token else None, token=token or None,
                               certificate_path=c.cert_file, private_key_path=c.key_file)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig, configuration: Configuration,
             scrape: Scraper = http_scrape, metrics: OperatorMetrics | None = None,
             warm: Warmer | None = None, open_gates: GateOpener | None = None) -> OperatorMetrics:
    """Add the operator's handlers to `registry`; `configuration` says how to reach the API server. `warm` and
    `open_gates` (tests): instead of the HTTP calls with each pool's token (`http_warm`, `http_open_gates`)."""
    pooled = copy.deepcopy(configuration)  # the caller's (kopf's login reads it) stays as it was
    # one kept-alive API connection per handler thread: the client's default pool (5 per CPU) opened and dropped a
    # new TLS connection for every call past it, with a "pool is full" warning each
    pooled.connection_pool_maxsize = config.workers
    kube = Kube(pooled)
    metrics = metrics or OperatorMetrics()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.level = logging.WARNING
        # No watching of namespaces and CRDs: the pools' namespaces are given (or all), and the CRD is installed
        # before the operator starts, so neither needs permissions the operator would otherwise not use.
        settings.scanning.disabled = True
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 30
        # kopf keeps a finalizer on each pool until its scaling timer has stopped. A deletion that arrives while a
        # tick runs (a sync handler, in kopf's thread pool, so it cannot stop within the few event-loop cycles kopf
        # waits) leaves the timer "still exiting", and kopf looks again only after `cancellation_polling`: nothing
        # wakes it sooner, since a tick that ends without a status patch (any tick before the pool's interval is
        # due, and any evaluation that changed nothing) writes nothing to the pool. At kopf's default of 60 s such
        # a pool stayed a minute after its last tick.
        settings.background.cancellation_polling = TIMER_STOP_POLL_SECONDS
        settings.execution.max_workers = config.workers  # DEFAULT_WORKERS says why more than kopf's default

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf_connection(configuration)

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def reconcile(body: kopf.Body, status: kopf.Status, retry: int, memo: kopf.Memo, old: Any = None,
                  **_: Any) -> None:
        generation = int(body.metadata.get("generation") or 0)
        state: PoolMemory = memo.setdefault("kvmesh", PoolMemory())
        writes = status_writes(memo)
        try:
            pool = parse_pool(body, config.pool_defaults)
            desired.check_program_files(pool)
        except SpecError as exc:
            state.condition(status, "Degraded", True, "InvalidSpec", str(exc), generation)
            conditions = state.condition(status, "Progressing", False, "InvalidSpec", "waiting for a valid spec",
                                         generation)
            kopf.event(body, type="Warning", reason="InvalidSpec", message=str(exc))
            write_status(kube, body, writes, {"conditions": conditions, "observedGeneration": generation})
            return  # nothing to retry until the spec changes, which runs this handler again
        # `old`: the spec kopf last handled (an update's); the roles this change adds were not run under it
        added = [r for r in pool.roles if old is not None and r not in spec_roles((old or {}).get("spec"))]
        try:  # the Secret before the pods that mount it
            live = live_deployments(kube, pool)
            replicas = starting_replicas(pool, status, added, live)
            memo["kvmesh-token"] = InternalToken.fixed(pool_token(kube, pool))
            # an upgrade from before the internal token: the routers roll first (operator/routers_first.py)
            rollout = routers_first(desired.desired_objects(pool, replicas), live)
            applied = apply_pool(kube, pool, rollout.objects, rollout.held)
        except ApplyFailed as exc:
            conditions = state.condition(status, "Degraded", True, exc.reason, str(exc), generation)
            try:
                write_status(kube, body, writes, {"conditions": conditions})
            except Exception as write_failed:  # an API that failed the apply may fail this too: retried as one
                log.warning("pool %s/%s: writing its status failed: %s", pool.namespace, pool.name,
                            api_answer(write_failed))
            kopf.event(body, type="Warning", reason=exc.reason, message=str(exc))
            if exc.reason == REJECTED:  # the same spec is refused again: no retry until the spec changes
                raise kopf.PermanentError(str(exc)) from exc
            raise kopf.TemporaryError(str(exc), delay=backoff_seconds(retry)) from exc
        state.condition(status, "Degraded", False, "Reconciled", "objects applied", generation)
        shared = desired.router_state(pool)
        state.condition(status, "RouterStateShared", shared.shared, shared.reason, shared.message, generation)
        if not shared.shared:
            kopf.event(body, type="Warning", reason=shared.reason, message=shared.message)
        if rollout.held:  # the scaling tick applies their template once the routers are rolled out
            message = held_message(rollout.held)
            conditions = state.condition(status, "Progressing", True, ROUTERS_FIRST, message, generation)
            kopf.event(body, type="Normal", reason=ROUTERS_FIRST, message=message)
        if applied.kept:  # the scaling tick deletes them once the new roles serve
            message = switching(pool.roles, applied.kept)
            if not rollout.held:
                conditions = state.condition(status, "Progressing", True, "SwitchingMode", message, generation)
            kopf.event(body, type="Normal", reason="SwitchingMode", message=message)
        elif not rollout.held:
            conditions = state.condition(status, "Progressing", True, "Applied", applied.summary, generation)
        if not any(c["type"] == "Ready" for c in conditions):
            conditions = state.condition(status, "Ready", False, "Starting", "waiting for pods", generation)
        write_status(kube, body, writes, {
            "conditions": conditions, "observedGeneration": generation, "routerAddress": desired.router_address(pool),
            "replicas": status_replicas(pool, {r: {"desired": n, "ready": 0 if r in added else (
                (status.get("replicas") or {}).get(r) or {}).get("ready", 0)} for r, n in replicas.items()})})
        kopf.event(body, type="Normal", reason="Reconciled", message=f"objects: {applied.summary}")

    # A failed tick (an API or scrape error) is logged and the next tick tries again: no backoff to wait out.
    # Each evaluation is counted by outcome, the operator's heartbeat; a spec that does not parse (one the API
    # server's copy of the CRD let through: an operator newer than its CRD) has no interval of its own, and counts
    # an error at every wake of the timer.
    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.tick_seconds, errors=kopf.ErrorsMode.IGNORED,
                registry=registry)
    def scale(body: kopf.Body, status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
        try:
            pool = parse_pool(body, config.pool_defaults)
        except SpecError:  # reconcile reported it
            metrics.evaluated(str(body.metadata.namespace), str(body.metadata.name), ok=False)
            return
        state: PoolMemory = memo.setdefault("kvmesh", PoolMemory())
        now = config.clock()
        if now - state.last_evaluated < pool.spec["scaling"]["intervalSeconds"]:
            return
        state.last_evaluated = now
        with metrics.evaluation(pool):
            if "kvmesh-lora" not in memo:  # a restarted operator carries on from what the pool's status kept
                memo["kvmesh-lora"] = AdapterMemory.from_status(status)
            auth = current_token(kube, pool, memo)
            tick(kube, pool, body, status, status_writes(memo), state, now, scrape, metrics, warm, open_gates,
                 memo["kvmesh-lora"], auth)

    # Optional: no finalizer for it, so a pool's deletion never waits on the operator.
    @kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=registry)
    def forget(meta: kopf.Meta, **_: Any) -> None:
        metrics.forget(str(meta.get("namespace")), str(meta.get("name")))

    return metrics


def tick(kube: Kube, pool: Pool, body: kopf.Body, status: Mapping[str, Any], writes: StatusWrites, state: PoolMemory,
         now: float, scrape: Scraper, operator_metrics: OperatorMetrics, warm: Warmer | None = None,
         open_gates: GateOpener | None = None, adapters: AdapterMemory | None = None,
         auth: InternalToken | None = None) -> Decision:
    """One scaling evaluation of one pool: observe, decide, act (scale, warm new pods, sync LoRA adapters), report
    (the status fields that changed, `write_status`: an evaluation that changes nothing writes nothing).
    Every call to an engine sends the pool's token `auth`: `warm` and `open_gates` default to the HTTP calls with
    it (a test passes its own)."""
    warm = warm or functools.partial(http_warm, auth=auth)
    open_gates = open_gates or functools.partial(http_open_gates, auth=auth)
    generation = int(body.metadata.get("generation") or 0)
    deployments = finish_switch(kube, pool, body, by_role(kube.list(
        "apps/v1", "deployments", pool.namespace, f"{POOL_LABEL}={pool.name}")))
    held = release_engines(kube, pool, body, status, deployments)
    pods = kube.list("v1", "pods", pool.namespace, f"{POOL_LABEL}={pool.name},{desired.COMPONENT_LABEL}=engine")
    scraped = observe(pods, pool.spec["engine"]["port"], scrape)
    operator_scales = pool.spec["scaling"]["mode"] == "operator"
    replicas = current_replicas(pool, status)
    missing = sorted(role for role in (*pool.roles, "router") if role not in deployments)
    if missing and reconciled(status, generation):
        # deleted by hand (or a lost race with the GC): nothing else would bring it back until an edit. Not while
        # a reconcile of this generation has yet to succeed: that one is applying them (or kopf retries it)
        try:
            rollout = routers_first(desired.desired_objects(pool, replicas), deployments)
            summary = apply_pool(kube, pool, rollout.objects, rollout.held).summary
            message = f"the Deployments of {', '.join(missing)} were gone: objects applied again ({summary})"
        except ApplyFailed as exc:  # the tick goes on (scaling, status); the next one tries again
            message = f"the Deployments of {', '.join(missing)} are gone and could not be applied again: {exc}"
        kopf.event(body, type="Warning", reason="Repaired", message=message)
        log.warning("pool %s/%s: %s", pool.namespace, pool.name, message)
    scale_routers_back(kube, pool, body, deployments.get("router"), reconciled(status, generation))
    live = live_replicas(replicas, deployments)  # a Deployment scaled by hand, out of bounds too, is patched back
    if not operator_scales:  # the HPAs own the replicas: the Deployments say what they are
        replicas = {role: int(((deployments.get(role) or {}).get("spec") or {}).get("replicas") or n)
                    for role, n in replicas.items()}
    else:  # what exists, within the bounds: what the decision starts from
        replicas = deployed_replicas(replicas, deployments, {role: pool.bounds(role) for role in pool.roles})
    missing_metrics = unanswered(pods, scraped)
    routers = RouterView()
    if "scaleToZero" in pool.spec["scaling"]:  # a pool at 0 learns of its first request from the routers holding it
        router_pods = kube.list("v1", "pods", pool.namespace,
                                f"{POOL_LABEL}={pool.name},{desired.COMPONENT_LABEL}=router")
        routers = observe_routers(router_pods, pool.spec["router"]["port"], scrape)
        answered = {m.observation.name for m in scraped}
        if any(pod_ready(p) and p["metadata"]["name"] not in answered for p in pods):
            routers = replace(routers, unseen=True)
    idle = state.idle.update(now, scraped, routers)
    decision = state.scaler_for(pool).observe(now, scraped, replicas, routers.held, idle,
                                              {role: len(names) for role, names in missing_metrics.items()})
    hit_rates = pod_hit_rates(state, now, scraped)
    for role, n in decision.changed(live).items() if operator_scales else ():
        message = decision.describe(role, live)
        if n < live[role]:
            write_deletion_costs(kube, pool, role, pods, scraped, hit_rates)
        kube.patch("apps/v1", "deployments", pool.namespace, desired.engine_name(pool, role), {"spec": {"replicas": n}})
        kopf.event(body, type="Normal", reason="Scaled", message=message)
        log.info("pool %s/%s %s", pool.namespace, pool.name, message)
    before = replicas
    if operator_scales:
        replicas = decision.replicas
    operator_metrics.record(pool, decision, replicas, before)
    # after scaling: a scale-up decided now must not wait behind the copies of the last one's pods
    warm_new_pods(pool, body, state, pods, scraped, hit_rates, warm, open_gates)
    report: dict[str, Any] = {}  # status fields as a merge patch; only those that change are written
    if adapters is not None:
        if (loaded := sync_adapters(pool, body, pods, adapters, operator_metrics, auth)) is not None:
            state.condition(status, "AdaptersLoaded", loaded.ok, loaded.reason, loaded.message, generation)
        if adapters.managed or adapters.refused or status.get("adapters"):
            report["adapters"] = adapters.to_status()
    ready = ready_replicas(deployments, pool.roles)
    kv = [d for r, d in decision.roles.items() if r in ("both", "decode")]
    usage = [m.observation.usage for m in scraped if m.observation.role in ("both", "decode")]
    summary = ", ".join(f"{r} {ready[r]}/{replicas[r]}" for r in pool.roles)
    found = pool_conditions(pool.roles, replicas, deployments, desired.retained_roles(pool, deployments))
    for c in found:
        if c.kind == "Progressing" and held:  # what the rollout waits for: the routers
            c = replace(c, value=True, reason=ROUTERS_FIRST, message=f"{held_message(held)}; {c.message}")
        conditions = state.condition(status, c.kind, c.value, c.reason, c.message, generation)
    if missing_metrics:  # the HPA's ScalingActive/FailedGetPodsMetric: say why a role is not scaled down
        names = "; ".join(f"{role}: {', '.join(n)}" for role, n in sorted(missing_metrics.items()))
        conditions = state.condition(status, "MetricsAvailable", False, "PodsNotAnswering",
                                     f"Ready pods did not answer /metrics, so their roles are not scaled down: "
                                     f"{names}", generation)
    elif any(c.get("type") == "MetricsAvailable" for c in state.conditions or []):
        conditions = state.condition(status, "MetricsAvailable", True, "PodsAnswering",
                                     "every Ready engine pod answered /metrics", generation)
    if not any(c.kind == "Degraded" for c in found) and any(
            c.get("type") == "Degraded" and c.get("reason") == "RolloutStuck" for c in conditions):
        conditions = state.condition(status, "Degraded", False, "Reconciled", "the rollout went on", generation)
    report["conditions"] = conditions
    report["replicas"] = status_replicas(pool, {r: {"desired": replicas[r], "ready": ready[r]} for r in pool.roles})
    report["ready"] = summary
    report["kvUsage"] = {"observed": round(sum(usage) / len(usage), 4) if usage else 0.0,
                         "predicted": round(max((d.predicted_usage for d in kv), default=0.0), 4),
                         "overloadProbability": round(max((d.overload_probability for d in kv), default=0.0), 4)}
    report["lastDecision"] = last_decision(status.get("lastDecision"), decision)
    write_status(kube, body, writes, report, status)
    return decision


def last_decision(previous: Any, decision: Decision) -> dict[str, Any]:
    """status.lastDecision as a merge patch: each role's reason and replicas, and since when the pool has had that
    decision (`previous`'s time when it is the same: a time stamped at every evaluation made every evaluation a
    write to the API server, which at 200 pools every 15 s was 13 writes a second while nothing changed, each
    waking every watcher of the pools)."""
    reason = "; ".join(f"{r}: {d.reason}" for r, d in decision.roles.items())
    replicas = {r: None for r in SCALED_ROLES if r not in decision.replicas} | dict(decision.replicas)
    previous = previous if isinstance(previous, Mapping) else {}
    same = previous.get("reason") == reason and merged(previous.get("replicas"), replicas) == previous.get("replicas")
    since = previous.get("time") if same and previous.get("time") else now_timestamp()
    return {"time": since, "reason": reason, "replicas": replicas}


def write_deletion_costs(kube: Kube, pool: Pool, role: str, pods: list[dict[str, Any]], scraped: list[PodMetrics],
                         hit_rates: Mapping[str, float]) -> None:
    """Before a role shrinks, write the pod-deletion cost on every pod of the role (`scale_in.deletion_costs`):
    one left without (not scraped this tick) would keep a cost from an earlier scale-in, or read as 0 and tie
    with the coldest pod. A pod gone since the listing is skipped."""
    names = [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")
             and p["metadata"]["labels"].get(ROLE_LABEL, "both") == role]
    for name, cost in deletion_costs(role, scraped, hit_rates, names).items():
        try:
            kube.patch("v1", "pods", pool.namespace, name,
                       {"metadata": {"annotations": {DELETION_COST_ANNOTATION: str(cost)}}})
        except ApiException as exc:
            if exc.status != HTTPStatus.NOT_FOUND:
                raise


def finish_switch(kube: Kube, pool: Pool, body: kopf.Body,
                  deployments: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """After a change of mode, delete the previous mode's roles once they are no longer retained (the new roles
    serve, or the old ones serve nobody), with a ModeSwitched Event: at the scaling tick, so no further edit is
    needed. The Deployments left, by role. A failed deletion is logged, and the next tick tries again."""
    previous = desired.previous_roles(pool, deployments)
    if not previous or desired.retained_roles(pool, deployments):
        return deployments
    if int(body.metadata.get("generation") or 0) != pool.generation:
        # the spec moved on since this tick read it (kopf runs timers beside the reconcile, and `body` is live):
        # what it ran may be what the new spec asks for, and the reconcile of that spec prunes by it
        return deployments
    try:
        pruned = prune(kube, pool, desired.desired_objects(pool))
    except Exception as exc:  # an API answer, or none (the retries spent): the tick goes on, as with a repair
        log.warning("pool %s/%s: deleting the previous mode's %s failed: %s", pool.namespace, pool.name,
                    " and ".join(previous), exc)
        return deployments
    if pruned.deleted:
        message = f"now {pool.mode}: the previous {' and '.join(previous)} deleted ({', '.join(pruned.deleted)})"
        kopf.event(body, type="Normal", reason="ModeSwitched", message=message)
        log.info("pool %s/%s %s", pool.namespace, pool.name, message)
    return {r: d for r, d in deployments.items() if r not in previous}


def release_engines(kube: Kube, pool: Pool, body: kopf.Body, status: Mapping[str, Any],
                    deployments: Mapping[str, dict[str, Any]]) -> tuple[str, ...]:
    """Routers first (operator/routers_first.py), finished at the scaling tick as a change of mode is: the engine
    Deployments whose template a reconcile kept (legacy: no internal token) get their new one once the router
    Deployment has rolled out with the token, with a RoutersRolledOut Event, so no further edit is needed. The
    engine Deployments still held (named; none once applied, or with none legacy). Only for the generation the
    last reconcile applied (else that reconcile, or kopf's retry of it, applies them); a failed apply is logged,
    and the next tick tries again."""
    legacy = legacy_engines(deployments, pool.roles)
    if not legacy:
        return ()
    # the replicas the Deployments run (the scaler's to change, later in the tick): only the template changes
    initial = desired.initial_replicas(pool)
    replicas = deployed_replicas({role: initial[role] for role in legacy}, deployments,
                                 {role: pool.bounds(role) for role in legacy})
    objects = [desired.engine_deployment(pool, role, replicas[role]) for role in legacy]
    rollout = routers_first(objects, deployments)
    generation = int(body.metadata.get("generation") or 0)
    if rollout.held or generation != pool.generation or not reconciled(status, generation):
        return rollout.held
    names = ", ".join(o["metadata"]["name"] for o in objects)
    try:
        for obj in objects:
            kube.apply(obj, desired.patch_body(pool, obj), keep=desired.HANDED_OFF)
    except Exception as exc:  # an API answer, or none (the retries spent): the tick goes on
        log.warning("pool %s/%s: applying the new template of %s failed: %s", pool.namespace, pool.name, names, exc)
        return ()
    message = f"the routers rolled out with the internal token: {names} now roll to the template with it"
    kopf.event(body, type="Normal", reason="RoutersRolledOut", message=message)
    log.info("pool %s/%s: %s", pool.namespace, pool.name, message)
    return ()


def warm_new_pods(pool: Pool, body: kopf.Body, state: PoolMemory, pods: list[dict[str, Any]],
                  scraped: list[PodMetrics], hit_rates: Mapping[str, float], warm: Warmer,
                  open_gates: GateOpener = http_open_gates) -> None:
    """Warm the engine pods that began serving since the last tick from a peer's hottest prefixes; with the
    engines' warm-up gate on, tell those left with nothing copied to serve now. A failed warm-up is a Warning
    Event and a log line: the pod serves anyway, computing those prefixes itself."""
    port = pool.spec["engine"]["port"]
    names = {m.observation.name for m in scraped}  # scraped: each has an address
    places = {p["metadata"]["name"]: PodPlace(pod_url(p, port), pod_ready(p)) for p in pods
              if p["metadata"]["name"] in names}
    settings = WarmupSettings.of(pool)
    plan = plan_tick_warmups(state, scraped, places, hit_rates, settings)
    results = carry_out(plan, settings.limit, settings.gated, warm, open_gates)
    for _, _, outcome in results.warmed:  # an Event for each pod warmed or failed; a log line for every outcome
        if outcome.ok is True:
            kopf.event(body, type="Normal", reason="WarmedUp", message=outcome.message)
        elif outcome.ok is False:
            kopf.event(body, type="Warning", reason="WarmupFailed", message=outcome.message[:1024])
    for outcome in [o for _, _, o in results.warmed] + [o for _, o in results.opened]:
        level = logging.WARNING if outcome.ok is False else logging.INFO
        log.log(level, "pool %s/%s: %s", pool.namespace, pool.name, outcome.message)


def sync_adapters(pool: Pool, body: kopf.Body, pods: list[dict[str, Any]], adapters: AdapterMemory,
                  operator_metrics: OperatorMetrics, auth: InternalToken | None = None) -> AdapterStatus | None:
    """Load and unload LoRA adapters in the Ready engine pods so they serve what the spec declares
    (operator/lora.py `adapter_tick`); count the actions, post a Warning Event for each refusal (once: it is not
    retried, also after a restart, which finds the refusals in status.adapters), and log every action and a tick
    that leaves engines out of step. The pool's AdaptersLoaded condition, or None to set none."""
    port = pool.spec["engine"]["port"]
    wanted = set(desired.adapter_mounts(pool))

    def engine(p: dict[str, Any]) -> EnginePod:
        return EnginePod(p["metadata"]["name"], p["metadata"]["labels"].get(ROLE_LABEL, "both"), pod_url(p, port),
                         sum(int(c.get("restartCount") or 0) for c in (p.get("status") or {}).get("containerStatuses")
                             or []), str(p["metadata"].get("uid") or ""))

    def mounts_every_claim(p: dict[str, Any]) -> bool:
        """False for a pod of an older template: before an adapter's claim was added, or an adapter renamed on its
        claim (mounted under its old name), which would be sent a load of a path it lacks and refuse it."""
        spec = p.get("spec") or {}
        claims = {v.get("name"): (v.get("persistentVolumeClaim") or {}).get("claimName")
                  for v in spec.get("volumes") or []}
        mounted = {(claims.get(m.get("name")), m.get("mountPath")) for c in spec.get("containers") or []
                   for m in c.get("volumeMounts") or []}
        return wanted <= mounted

    # Alive: pods with an engine that may serve adapters (a pod not yet given an address has started none, and
    # will read the current list at start); Ready ones are synced, the others keep what they refused.
    alive = addressable(pods)
    ready = [engine(p) for p in alive if pod_ready(p) and mounts_every_claim(p)]
    tick = adapter_tick(desired.engine_adapters(pool), ready, adapters, alive={engine(p).life for p in alive},
                        read=functools.partial(http_served, auth=auth), act=functools.partial(http_act, auth=auth))
    operator_metrics.record_adapters(pool, tick.syncs)
    for pod, result in tick.results():
        message = f"{pod.name}: {result.message}"
        if result.outcome == REFUSED:
            kopf.event(body, type="Warning", reason="AdapterRefused", message=message[:1024])
        log.log(logging.WARNING if result.outcome == REFUSED else logging.INFO, "pool %s/%s %s", pool.namespace,
                pool.name, message)
    if tick.summary is not None and not tick.summary.ok:
        log.info("pool %s/%s adapters %s: %s", pool.namespace, pool.name, tick.summary.reason, tick.summary.message)
    return tick.status


def run(config: OperatorConfig) -> None:
    """`kvmesh operator`: run until SIGINT/SIGTERM. A kubeconfig that cannot be read (or no service account)
    raises ValueError here, before anything starts."""
    from kvmesh.router.discovery import kube_configuration

    registry = kopf.OperatorRegistry()
    configuration = kube_configuration(config.kubeconfig)
    metrics = register(registry, config, configuration)
    if config.metrics_port is not None:
        start_http_server(config.metrics_port, registry=metrics.registry)

    def operate(stop: asyncio.Event) -> Awaitable[None]:  # /healthz is the election's, served from the start
        return kopf.operator(registry=registry, standalone=True, clusterwide=not config.namespaces,
                             namespaces=list(config.namespaces), stop_flag=stop)

    try:
        if config.election is None:
            liveness = f"http://0.0.0.0:{config.health_port}/healthz" if config.health_port is not None else None
            kopf.run(registry=registry, standalone=True, clusterwide=not config.namespaces,
                     namespaces=list(config.namespaces), liveness_endpoint=liveness)
        else:
            asyncio.run(run_elected(config.election, configuration, operate, LeaderMetrics(metrics.registry),
                                    config.health_port))
    finally:
        close_pod_client()
