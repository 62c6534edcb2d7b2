"""Leader election on a coordination.k8s.io/v1 Lease, so that two operator replicas never reconcile at once.

The pure core, `decide`, reads the Lease as the API server returned it and says what this candidate does: create
or take it (acquire), renew its own, wait while another holds it, or stop because another took it (lost). As in
client-go, a candidate judges expiry by its own clock: a lease counts as held until `leaseDurationSeconds` after
this candidate last saw it change, whatever the holder's renewTime says, so clocks that disagree do not matter.
Every write is a PUT that carries the resourceVersion it read: of two candidates that decide to take the same
lease, the API server lets one write and answers 409 to the other.

The edge, `run_elected`, makes the process a candidate before kopf starts: it serves /healthz meanwhile (a
standby is alive), starts kopf once it holds the lease, renews it every retry period beside kopf, and exits
non-zero when it cannot renew within the renew deadline or sees another holder (the pod restarts as a candidate:
as controller-runtime, it never reconciles on without the lease). SIGTERM stops kopf, then releases the lease
so that the standby takes over at once.

The Kubernetes client and aiohttp load only when the edge runs: `kvmesh operator --help` reads the defaults here.
"""

from __future__ import annotations

import asyncio
import datetime
import enum
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, NoReturn

import urllib3

if TYPE_CHECKING:
    from aiohttp import web
    from kubernetes.client import Configuration

    from kvmesh.operator.metrics import LeaderMetrics

log = logging.getLogger("kvmesh.operator.leader")

# operator/rbac.py's LEADER_ELECTION lists what it asks of leases (a test holds the group the same); not imported
# here, which would load the CRD module into every `kvmesh` command (the CLI reads the defaults below)
LEASE_API_VERSION = "coordination.k8s.io/v1"
DEFAULT_LEASE_NAME = "kvmesh-operator"
# client-go's defaults: a standby takes over at most 15 s after the leader's last renewal; a leader that could
# not renew for 10 s stops, well before anyone else may take the lease.
LEASE_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0
RELEASED_LEASE_SECONDS = 1  # what a released lease says (client-go's): no holder, so it is taken at once anyway
EXIT_LOST = 1  # the exit status of a leader that lost its lease (the pod restarts and becomes a candidate)


class Action(enum.StrEnum):
    ACQUIRE = "acquire"  # create the lease, or take one that is free, released or expired
    RENEW = "renew"  # this candidate holds it: write a new renewTime
    WAIT = "wait"  # another holds it
    LOST = "lost"  # this candidate led, and another holds it now: stop reconciling at once


@dataclass(frozen=True)
class Timing:
    """The election's durations, in seconds; `check` refuses the ones that let two leaders overlap."""

    lease_seconds: int = LEASE_SECONDS
    renew_deadline_seconds: float = RENEW_DEADLINE_SECONDS
    retry_seconds: float = RETRY_SECONDS

    def check(self) -> None:
        """A leader stops at most a renew deadline plus one retry after its last renewal; a standby waits a whole
        lease duration after it last saw one, so the lease must outlast both. A renew deadline shorter than one
        retry would give a leader a single try."""
        if self.retry_seconds <= 0 or self.lease_seconds < 1:
            raise ValueError("the lease duration and the retry period must be positive")
        if self.renew_deadline_seconds <= self.retry_seconds:
            raise ValueError("the renew deadline must be longer than the retry period")
        if self.lease_seconds <= self.renew_deadline_seconds + self.retry_seconds:
            raise ValueError("the lease duration must be longer than the renew deadline plus the retry period")


@dataclass(frozen=True)
class LeaseRecord:
    """A Lease's spec and resourceVersion. The times are the writer's clock, written for people (kubectl): no
    candidate compares them with its own."""

    holder: str  # "" when released
    lease_seconds: int
    transitions: int
    acquired: str
    renewed: str
    resource_version: str = ""

    @classmethod
    def parse(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(holder=str(spec.get("holderIdentity") or ""),
                   lease_seconds=int(spec.get("leaseDurationSeconds") or 0),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   acquired=str(spec.get("acquireTime") or ""), renewed=str(spec.get("renewTime") or ""),
                   resource_version=str((lease.get("metadata") or {}).get("resourceVersion") or ""))

    def body(self, namespace: str, name: str) -> dict[str, Any]:
        """The Lease to create, or to PUT over the one read (its resourceVersion makes the PUT conditional)."""
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if self.resource_version:
            metadata["resourceVersion"] = self.resource_version
        return {"apiVersion": LEASE_API_VERSION, "kind": "Lease", "metadata": metadata,
                "spec": {"holderIdentity": self.holder, "leaseDurationSeconds": self.lease_seconds,
                         "leaseTransitions": self.transitions, "acquireTime": self.acquired,
                         "renewTime": self.renewed}}


@dataclass(frozen=True)
class Seen:
    """The lease as this candidate last read it, and when (its own monotonic clock) it last saw it change."""

    record: LeaseRecord
    since: float


@dataclass(frozen=True)
class Step:
    action: Action
    write: LeaseRecord | None  # for ACQUIRE and RENEW: the lease to write (resourceVersion: the one read)
    seen: Seen | None  # what to remember for the next step


def decide(lease: LeaseRecord | None, seen: Seen | None, me: str, leading: bool, now: float, wall: str,
           lease_seconds: int) -> Step:
    """One round of the election for candidate `me`: `lease` as just read (None: there is none), `seen` from the
    last round, `now` this candidate's monotonic clock, `wall` the time to write (RFC 3339)."""
    if lease is None:
        return Step(Action.ACQUIRE, LeaseRecord(me, lease_seconds, 0, wall, wall), None)
    if seen is None or seen.record != lease:
        seen = Seen(lease, now)
    if lease.holder == me:
        # Not leading yet: this candidate's own write took the lease but its answer never came (a timeout), so it
        # takes the lease up now; a RENEW would keep it from leading while renewing the lease away from the others.
        return Step(Action.RENEW if leading else Action.ACQUIRE,
                    replace(lease, lease_seconds=lease_seconds, renewed=wall), seen)
    if leading:
        return Step(Action.LOST, None, seen)
    if lease.holder and now < seen.since + lease.lease_seconds:
        return Step(Action.WAIT, None, seen)
    return Step(Action.ACQUIRE, replace(lease, holder=me, lease_seconds=lease_seconds,
                                        transitions=lease.transitions + 1, acquired=wall, renewed=wall), seen)


def released(lease: LeaseRecord, wall: str) -> LeaseRecord:
    """The lease a leader writes when it stops: no holder, so a standby takes it at its next retry."""
    return replace(lease, holder="", lease_seconds=RELEASED_LEASE_SECONDS, renewed=wall)


def micro_time(moment: datetime.datetime | None = None) -> str:
    """Kubernetes' MicroTime: RFC 3339 with microseconds, UTC."""
    moment = moment or datetime.datetime.now(datetime.UTC)
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def identity(pod_name: str | None = None) -> str:
    """The pod's name (POD_NAME, from the downward API; else the host name) and a random suffix: a restarted
    container is a new candidate, never mistaken for the leader it replaced."""
    return f"{pod_name or os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


# ---- the edge ----------------------------------------------------------------------------------------------------


class LeaseError(Exception):
    """A lease call that failed: an answer outside 2xx, or none in time."""


class LeaseConflict(LeaseError):
    """The lease changed since it was read (409): another candidate wrote first."""


class LeaseApi:
    """GET, POST and PUT of one Lease through operator/kube.py's `Kube` (loaded here, with the Kubernetes client:
    the edge alone needs it), each tried once: the election's retry period is the retry."""

    def __init__(self, configuration: Configuration, namespace: str, name: str, timeout_seconds: float) -> None:
        from kvmesh.operator.kube import Kube

        self.kube = Kube(configuration, retries=False, timeout_seconds=timeout_seconds)
        self.namespace, self.name = namespace, name
        self.collection = Kube.path(LEASE_API_VERSION, "leases", namespace)

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any] | None:
        """The answer's JSON; None for 404. Kube's failures are LeaseErrors (409: LeaseConflict)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.kube.call(method, path, body)
        except ApiException as exc:  # an answer outside 2xx, or the client's wrapping of a TLS failure (status 0)
            if exc.status == HTTPStatus.NOT_FOUND:
                return None
            if exc.status == HTTPStatus.CONFLICT:
                raise LeaseConflict(f"lease {self.namespace}/{self.name} changed since it was read") from exc
            raise LeaseError(f"{method} {path}: {exc.status} {str(exc.body or exc.reason)[:200]}") from exc
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:  # no answer, or one that is not JSON
            raise LeaseError(f"{method} {path}: {exc}") from exc

    def read(self) -> LeaseRecord | None:
        lease = self._call("GET", f"{self.collection}/{self.name}")
        return None if lease is None else LeaseRecord.parse(lease)

    def write(self, record: LeaseRecord) -> LeaseRecord:
        """Create the lease (no resourceVersion: none was read) or replace the one read; the lease written."""
        body = record.body(self.namespace, self.name)
        if record.resource_version:
            written = self._call("PUT", f"{self.collection}/{self.name}", body)
        else:
            written = self._call("POST", self.collection, body)
        if written is None:  # deleted since it was read: made anew in the next round
            raise LeaseError(f"lease {self.namespace}/{self.name} is gone")
        return LeaseRecord.parse(written)


class LeadershipLost(Exception):
    """The leader saw another holder, or could not renew within the renew deadline."""


class Elector:
    """One candidate: `acquire` returns once it holds the lease, `hold` renews it until it is lost (raises).

    A write counts from when it was sent, not answered: the API server stores it in between, and a standby
    counts the lease's duration from when it sees it, so a slow answer must not lengthen the leader's term."""

    def __init__(self, api: LeaseApi, me: str, timing: Timing, metrics: LeaderMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.me, self.timing, self.metrics, self.clock = api, me, timing, metrics, clock
        self.leading = False
        self.seen: Seen | None = None
        self.mine: LeaseRecord | None = None  # the lease as this candidate last wrote it
        self.renewed_at = 0.0  # when (this candidate's clock) the last write that counted was sent

    async def _round(self) -> Action:
        """Read, decide, write; a write that fails or conflicts leaves the lease to the next round, and so does
        one answered a renew deadline or more after it was sent (a standby may have taken the lease by then)."""
        lease = await asyncio.to_thread(self.api.read)
        step = decide(lease, self.seen, self.me, self.leading, self.clock(), micro_time(), self.timing.lease_seconds)
        self.seen = step.seen
        if step.write is None:
            return step.action
        sent = self.clock()
        written = await asyncio.to_thread(self.api.write, step.write)
        answered = self.clock()
        self.seen, self.mine = Seen(written, answered), written
        if answered - sent >= self.timing.renew_deadline_seconds:
            raise LeaseError(f"the write was answered {answered - sent:.1f} s after it was sent, past the renew "
                             f"deadline")
        self.renewed_at = sent
        if step.action == Action.ACQUIRE and not self.leading:
            self.leading = True
            self.metrics.acquired()
            log.info("%s leads (lease %s/%s, transition %d)", self.me, self.api.namespace, self.api.name,
                     written.transitions)
        return step.action

    async def acquire(self) -> None:
        while True:
            try:
                if await self._round() == Action.ACQUIRE:
                    return
            except LeaseError as exc:
                log.info("lease %s/%s not acquired: %s", self.api.namespace, self.api.name, exc)
            await asyncio.sleep(self.timing.retry_seconds)

    async def hold(self) -> NoReturn:
        while True:
            await asyncio.sleep(self.timing.retry_seconds)
            left = self.renewed_at + self.timing.renew_deadline_seconds - self.clock()
            try:
                action = await asyncio.wait_for(self._round(), max(left, 0.001))
            except (TimeoutError, LeaseError) as exc:
                log.warning("lease %s/%s not renewed: %s", self.api.namespace, self.api.name, str(exc) or "timed out")
                action = None
            if action == Action.LOST:
                self._stopped()
                holder = self.seen.record.holder if self.seen else "another candidate"
                raise LeadershipLost(f"lease {self.api.namespace}/{self.api.name} is held by {holder}")
            if self.clock() - self.renewed_at >= self.timing.renew_deadline_seconds:  # no write counted since
                self._stopped()
                raise LeadershipLost(f"lease {self.api.namespace}/{self.api.name} not renewed for "
                                     f"{self.timing.renew_deadline_seconds:g} s")

    async def release(self) -> None:
        """Give the lease up (on failure the standby waits for it to expire)."""
        if not self.leading or self.mine is None:
            return
        self._stopped()
        try:
            try:
                await asyncio.to_thread(self.api.write, released(self.mine, micro_time()))
            except LeaseConflict:  # a renewal cancelled on its way still landed: release the lease it wrote
                current = await asyncio.to_thread(self.api.read)
                if current is None or current.holder != self.me:
                    return
                await asyncio.to_thread(self.api.write, released(current, micro_time()))
            log.info("%s released lease %s/%s", self.me, self.api.namespace, self.api.name)
        except LeaseError as exc:
            log.warning("lease %s/%s not released: %s", self.api.namespace, self.api.name, exc)

    def _stopped(self) -> None:
        self.leading = False
        self.metrics.stopped()


@dataclass(frozen=True)
class Election:
    """Where the lease is and who this candidate is (the operator's --leader-elect flags)."""

    namespace: str
    name: str = DEFAULT_LEASE_NAME
    me: str = ""
    timing: Timing = Timing()


async def serve_health(port: int | None, elector: Elector, host: str = "0.0.0.0") -> web.AppRunner | None:
    """/healthz on `port` from the first moment: a standby is alive too (its body says whether it leads)."""
    from aiohttp import web

    if port is None:
        return None

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": elector.leading})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()  # all addresses: the kubelet probes the pod's
    return runner


def exit_now(code: int) -> NoReturn:
    """Leave at once, as controller-runtime does on a lost lease: kopf's handler threads may be mid-call, and no
    graceful stop may let them write on while another leader starts."""
    logging.shutdown()
    os._exit(code)


async def run_elected(election: Election, configuration: Configuration,
                      operate: Callable[[asyncio.Event], Awaitable[None]], metrics: LeaderMetrics,
                      health_port: int | None) -> None:
    """Be a candidate; run `operate` (kopf, given the flag that stops it) only while holding the lease. Returns
    after SIGTERM/SIGINT (the lease released); exits the process with EXIT_LOST if the lease is lost."""
    timing = election.timing
    api = LeaseApi(configuration, election.namespace, election.name, timing.renew_deadline_seconds)
    elector = Elector(api, election.me or identity(), timing, metrics)
    metrics.stopped()  # the gauge exists, at 0, from the start
    health = await serve_health(health_port, elector)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # kopf puts in its own once started; both stop it
        loop.add_signal_handler(signum, stopping.set)
    log.info("%s is a candidate for lease %s/%s", elector.me, election.namespace, election.name)
    try:
        candidate = asyncio.create_task(elector.acquire())
        stop = asyncio.create_task(stopping.wait())
        await asyncio.wait({candidate, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not candidate.done():  # stopped while standing by
            candidate.cancel()
            return
        stop.cancel()
        candidate.result()  # acquire retries the API's failures; any other error stops here, never runs kopf
        operator = asyncio.create_task(operate(stopping))
        holder = asyncio.create_task(elector.hold())
        await asyncio.wait({operator, holder}, return_when=asyncio.FIRST_COMPLETED)
        if holder.done():
            log.critical("leadership lost, exiting: %s", holder.exception())
            exit_now(EXIT_LOST)
        holder.cancel()
        await elector.release()  # after kopf has stopped: its last writes are done
        operator.result()  # kopf's own failure, if any, goes on
    finally:
        if health is not None:
            await health.cleanup()
