"""The pods behind a router: discovery (a static list, or a source such as router/discovery.py's EndpointSlice
watcher or router/pods_file.py's file poller that adds, removes and drains pods at run time), health, load from
/metrics, and KV event streams feeding the global prefix index. Everything the picker needs, as snapshots.

Each pod gets two tasks: a scraper (health, metrics, /v1/kv/config whenever the pod's boot id changes, and
/v1/models every MODELS_REFRESH_SECONDS: the LoRA adapters it serves, which change at run time) and an event
reader (resume from the last sequence number; on a reset, a boot change or a gap, read the block snapshot and
go on). A pod whose configuration differs from the router's (block size, hash construction,
tokenizer or chat template) is refused loudly and never indexed or routed to.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from kvmesh.engine.internal_token import InternalToken
from kvmesh.engine.protocol import (
    HEALTH_LOADING,
    HEALTH_STALLED,
    HEALTH_WARMING,
    INTERNAL_HTTP_CLIENT,
    KV_BLOCKS_PATH,
    KV_CONFIG_PATH,
    KV_EVENTS_PATH,
    MODELS_PATH,
    KVBlocksSnapshot,
    KVConfig,
    KVEventBatch,
    Metric,
    VllmMetric,
    load_progress,
    read_engine_metrics,
    serving_metrics,
)
from kvmesh.router.config import RouterConfig
from kvmesh.router.index import PrefixIndex
from kvmesh.router.lora import MODELS_REFRESH_SECONDS, LoraLoad, ServedModels, lora_load
from kvmesh.router.picker import PodState

log = logging.getLogger("kvmesh.router.pods")
RECONNECT_SECONDS = 0.5
EVENT_READ_TIMEOUT_SECONDS = 30.0
HEALTH_TIMEOUT_SECONDS = 5.0  # each read of a scrape: health, metrics, KV config, models (event streams wait longer)
# A pod whose health checks failed this long (no answer: a refused or timed-out connection) is lost: requests still
# reading from it give up on it (a stream moves to another pod) rather than wait out request_timeout_seconds. Two
# health timeouts: a pod too busy to answer one check in time keeps its requests.
LOST_AFTER_SECONDS = 2 * HEALTH_TIMEOUT_SECONDS


def served_models(served: ServedModels | None, config: KVConfig | None) -> ServedModels:
    """A pod's models: its /v1/models once read, until then the model its KV config names."""
    return served if served is not None else ServedModels.base_only(config.model if config else "")


class Unseen:
    """Where the pod's last report (/metrics) and this router's own requests disagree. Sent: requests the report
    cannot have counted yet, and their uncached prompt tokens; each counts from when it is sent until it ends or a
    read of /metrics that began after it was sent comes back (then the pod's running, waiting and queued-prefill
    numbers hold it). Ended: requests the report counted that have ended since; each counts until a read that
    began after its end comes back. So the picker counts each request once, a burst between two scrapes sees its
    own queue grow, and a pod whose requests just ended does not look busy for another scrape interval.

    Both are kept per scrape epoch (the reads begun before), so a read drops exactly what it saw; what happens
    while a read is under way counts here until the next one, one scrape interval at most."""

    def __init__(self) -> None:
        self.epoch = 0  # reads begun
        self.requests = 0
        self.tokens = 0
        self.ended_requests = 0
        self._by_epoch: dict[int, list[int]] = {}  # epoch sent in -> [requests, tokens] still open
        self._ended_by_epoch: dict[int, int] = {}  # epoch ended in -> requests a report counted, ended since

    def sent(self, tokens: int) -> int:
        """A request sent now with `tokens` uncached prompt tokens; the epoch to give back to `ended`."""
        entry = self._by_epoch.setdefault(self.epoch, [0, 0])
        entry[0] += 1
        entry[1] += tokens
        self.requests += 1
        self.tokens += tokens
        return self.epoch

    def ended(self, epoch: int, tokens: int) -> None:
        """A request sent in `epoch` ended: if no read has counted it, it no longer counts here; if one has, the
        report overstates the pod's requests by it until the next read."""
        entry = self._by_epoch.get(epoch)
        if entry is None:
            self._ended_by_epoch[self.epoch] = self._ended_by_epoch.get(self.epoch, 0) + 1
            self.ended_requests += 1
            return
        entry[0] -= 1
        entry[1] -= tokens
        self.requests -= 1
        self.tokens -= tokens
        if not entry[0]:
            del self._by_epoch[epoch]

    def reading(self) -> int:
        """A read of /metrics begins: what was sent before now, it will count."""
        self.epoch += 1
        return self.epoch

    def read(self, epoch: int) -> None:
        """The read begun at `epoch` came back: the requests sent before it began are in its numbers, and those
        that ended before it began are not."""
        for seen in [e for e in self._by_epoch if e < epoch]:
            requests, tokens = self._by_epoch.pop(seen)
            self.requests -= requests
            self.tokens -= tokens
        for seen in [e for e in self._ended_by_epoch if e < epoch]:
            self.ended_requests -= self._ended_by_epoch.pop(seen)


@dataclass
class Pod:
    """What the router knows of one engine; mutated only by its own tasks and the request path's counters."""

    url: str
    healthy: bool = False
    draining: bool = False
    terminating: bool = False  # discovery says the pod is going away: drain it whatever /health says
    loading: bool = False  # an engine loading its model (/health 503 "loading"): starting, not routed to yet
    load_progress: float | None = None  # while loading: the share of its weights read (None: it does not say)
    warming: bool = False  # a new pod waiting for its warm-up (/health 503 "warming"): up, not routed to yet
    kv_config: KVConfig | None = None
    refused: str | None = None  # why the pod's configuration is not usable, if it is not
    metrics: dict[str, float] = field(default_factory=dict)
    lora: LoraLoad = field(default_factory=LoraLoad)  # its vllm:lora_requests_info, as of the last scrape
    served: ServedModels | None = None  # its /v1/models; None until read (it then serves its KV config's model)
    served_at: float = 0.0
    scraped_at: float = 0.0
    unreachable_since: float | None = None  # its scrapes have failed since then (None: the last one answered)
    inflight: int = 0
    unseen: Unseen = field(default_factory=Unseen, repr=False, compare=False)  # of inflight, what /metrics lacks
    # its last snapshot and what it was made from (PodSet.snapshot): rebuilt only when one of those changed
    snapped: tuple[StateInputs, PodState] | None = field(default=None, repr=False, compare=False)

    def models(self) -> ServedModels:
        return served_models(self.served, self.kv_config)

    @property
    def name(self) -> str:
        return self.url


# Everything a pod's PodState is made from besides its name, in this order: its KV config, its /v1/models, its
# adapters' load, up with a usable configuration, draining, stale, the router's requests in flight to it (all of
# them, those its last report lacks, their uncached tokens, and those it counts that ended since), and a copy of its
# numbers (the dict may change
# in place). PodSet.snapshot compares them to rebuild a state only when one changed, and `_state` reads nothing
# else, so no input can be left out of the comparison. (A plain tuple: a NamedTuple costs 0.2 us more to make, per
# pod and request.)
StateInputs = tuple[KVConfig | None, ServedModels | None, LoraLoad, bool, bool, bool, tuple[int, int, int, int],
                    tuple[tuple[str, float], ...]]


_PICKER_READS = {  # exposed name -> the PodState field it feeds
    VllmMetric.RUNNING: "running",
    VllmMetric.WAITING: "waiting",
    VllmMetric.KV_USAGE: "kv_usage",
    Metric.FORECAST_OVERLOAD: "overload_probability",
    Metric.EVENTS_SEQ: "events_seq",
    Metric.QUEUED_PREFILL_TOKENS: "pending_prefill_tokens",
    Metric.PREFILL_THROUGHPUT: "prefill_tokens_per_second",
    Metric.DECODE_STEP_SECONDS: "decode_step_seconds",
}


def parse_metrics(text: str) -> tuple[dict[str, float], LoraLoad]:
    """The load numbers the picker reads and the adapters running, from an engine's Prometheus text. EngineLoading
    for an engine loading its model (restarted since its /health answered 200): the scraper takes it as gone, never
    as a pod with nothing running."""
    m = read_engine_metrics(serving_metrics(text))
    out = {field: m.values[name] for name, field in _PICKER_READS.items() if name in m.values}
    if "p90" in m.forecast_usage:
        out["forecast_usage_p90"] = m.forecast_usage["p90"]
    if m.num_blocks is not None and m.block_size is not None:
        out["num_blocks"], out["block_size"] = m.num_blocks, m.block_size
    return out, lora_load(m.lora_info)


class Discovery(Protocol):
    """A source of pods that change at run time. `start` runs on the event loop; the source then calls `apply`
    there with its whole current view (pod URL -> draining) whenever that view changes."""

    def start(self, apply: Callable[[Mapping[str, bool]], None]) -> None: ...

    def stop(self) -> None: ...


class PodSet:
    def __init__(
        self,
        urls: list[str],
        expected: KVConfig,
        index: PrefixIndex,
        scrape_interval: float,
        stale_after: float,
        discovery: Discovery | None = None,
        token: InternalToken | None = None,
    ) -> None:
        """`token`: the pool's internal token, sent with every scrape and event stream."""
        self.pods: dict[str, Pod] = {}
        self.expected = expected
        self.index = index
        self.scrape_interval = scrape_interval
        self.stale_after = stale_after
        self.discovery = discovery
        # reads time out: engines send a heartbeat line every 10 s, so a silent stream is a dead connection. No
        # bound on connections: httpx's is over all pods, and each pod's event stream holds one for good (a bound
        # under twice the pods would starve scrapes); each pod uses at most three at once by construction (its
        # scrapes, one after another; its event stream; a resync). Requests go through router/proxy.py, bounded.
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=EVENT_READ_TIMEOUT_SECONDS),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                         auth=token, **INTERNAL_HTTP_CLIENT)
        self._tasks: dict[str, tuple[asyncio.Task[None], asyncio.Task[None]]] = {}
        self._started = False
        # called after every scrape of a pod, which is when it can become ready (router/app.py PodWait)
        self.scrape_listeners: list[Callable[[], None]] = []
        # called with a pod's URL and why while it stays unreachable past LOST_AFTER_SECONDS: what is still being
        # read from it will not come (router/app.py breaks its connections, so streams move on). Not when it leaves
        # the pool: a draining pod leaves the endpoints (its /health answers 503) while its streams finish
        self.lost_listeners: list[Callable[[str, str], None]] = []
        for url in urls:
            self.add(url)

    @classmethod
    def from_config(cls, config: RouterConfig, expected: KVConfig, index: PrefixIndex,
                    token: InternalToken | None = None) -> PodSet:
        """The pod set `config` asks for: its static list, a pods file's, or the pool's pods as Kubernetes
        reports them."""
        discovery: Discovery | None = None
        if config.pods_file is not None:
            from kvmesh.router.pods_file import PodsFileWatcher

            discovery = PodsFileWatcher(config.pods_file)
        elif config.discovery == "kubernetes":
            # Imported here: the kubernetes client takes most of a second to import, which static pools never need.
            from kvmesh.router.discovery import EndpointSliceWatcher

            discovery = EndpointSliceWatcher.from_config(config)
        return cls(config.pods, expected, index, config.scrape_interval_seconds, config.stale_after_seconds, discovery,
                   token)

    async def start(self) -> None:
        self._started = True
        for pod in self.pods.values():
            self._start_tasks(pod)
        if self.discovery is not None:
            self.discovery.start(self.sync)

    async def stop(self) -> None:
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.stop)  # it may wait for a thread: not on the event loop
        self._started = False
        tasks = [task for pair in self._tasks.values() for task in pair]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    def adapter_fingerprints(self, model: str) -> list[str | None]:
        """The fingerprints of the weights healthy pods serve LoRA adapter `model` with, sorted (None, a pod that
        publishes none, first); empty when no healthy pod serves `model` as an adapter. Its blocks are hashed with
        the name and the fingerprint: one hashing per entry."""
        found = {pod.served.fingerprints.get(model) for pod in self.pods.values()
                 if pod.healthy and pod.served is not None and model in pod.served.adapters}
        return sorted(found, key=lambda f: f or "")

    def kv_config_of(self, name: str) -> KVConfig | None:
        """The KV config pod `name` published, or None (not read yet, or the pod has left)."""
        pod = self.pods.get(name)
        return pod.kv_config if pod is not None else None

    # ---- membership at run time (called on the event loop) -----------------------------------------------

    def add(self, url: str) -> Pod:
        """The pod at `url`, added (and, once started, scraped and indexed) if it was not there."""
        url = url.rstrip("/")
        pod = self.pods.get(url)
        if pod is None:
            pod = self.pods[url] = Pod(url)
            if self._started:
                log.info("pod %s joined the pool", url)
                self._start_tasks(pod)
        return pod

    def remove(self, url: str) -> None:
        """Forget a pod: stop its tasks and drop its blocks from the index. Requests already relayed from it
        keep their own reference and finish."""
        pod = self.pods.pop(url.rstrip("/"), None)
        if pod is None:
            return
        log.info("pod %s left the pool", pod.url)
        for task in self._tasks.pop(pod.url, ()):
            task.cancel()
        self.index.remove_pod(pod.name)

    def mark_draining(self, url: str, draining: bool = True) -> None:
        """Discovery's word that a pod is terminating: no new requests from now on, running ones finish."""
        pod = self.pods[url.rstrip("/")]
        if draining and not pod.terminating:
            log.info("pod %s is terminating: draining it", pod.url)
        pod.terminating = draining
        pod.draining = draining or pod.draining  # /health decides again at the next scrape once not terminating

    def sync(self, desired: Mapping[str, bool]) -> None:
        """Make the set equal to a discovery source's view: pod URL -> draining."""
        wanted = {url.rstrip("/"): draining for url, draining in desired.items()}
        for url in [url for url in self.pods if url not in wanted]:
            self.remove(url)
        for url, draining in wanted.items():
            self.add(url)
            self.mark_draining(url, draining)

    def snapshot(self, now: float | None = None) -> list[PodState]:
        """Every pod's state now, for one request's decision. A pod's state is made again only when something it
        is made from changed (most pods of a large pool do not between two requests): building a PodState costs
        microseconds, and a request reads every pod's."""
        now = time.monotonic() if now is None else now
        states = []
        for pod in self.pods.values():
            inputs: StateInputs = (pod.kv_config, pod.served, pod.lora, pod.healthy and pod.refused is None,
                                   pod.draining, now - pod.scraped_at > self.stale_after,
                                   (pod.inflight, pod.unseen.requests, pod.unseen.tokens, pod.unseen.ended_requests),
                                   tuple(pod.metrics.items()))
            if pod.snapped is None or pod.snapped[0] != inputs:
                pod.snapped = (inputs, self._state(pod.name, inputs))
            states.append(pod.snapped[1])
        return states

    def _state(self, name: str, inputs: StateInputs) -> PodState:
        config, served, lora, healthy, draining, stale, (inflight, unseen, unseen_tokens, ended), metrics = inputs
        m = dict(metrics)
        return PodState(
            name=name,
            url=name,  # a pod is named by its URL
            role=config.role if config else "both",
            model=config.model if config else "",
            models=served_models(served, config).names,
            adapter_fingerprints=served.fingerprints if served is not None else {},
            adapters_active=lora.active,
            adapters_running=len(lora.running),
            max_loras=lora.max_lora,
            healthy=healthy and config is not None,
            draining=draining,
            stale=stale,
            running=int(m.get("running", 0)),
            waiting=int(m.get("waiting", 0)),
            inflight=inflight,
            unseen_requests=unseen,
            unseen_prefill_tokens=unseen_tokens,
            ended_requests=ended,
            kv_usage=m.get("kv_usage", 0.0),
            forecast_usage_p90=m.get("forecast_usage_p90", 0.0),
            overload_probability=m.get("overload_probability", 0.0),
            pending_prefill_tokens=int(m.get("pending_prefill_tokens", 0)),
            prefill_tokens_per_second=m.get("prefill_tokens_per_second", 0.0),
            decode_step_seconds=m.get("decode_step_seconds", 0.0),
            num_blocks=int(m.get("num_blocks", 0)),
            block_size=int(m.get("block_size", self.expected.block_size)),
        )

    # ---- per-pod tasks -------------------------------------------------------------------------------------

    def _start_tasks(self, pod: Pod) -> None:
        self._tasks[pod.url] = (
            asyncio.create_task(self._scrape_loop(pod), name=f"scrape {pod.url}"),
            asyncio.create_task(self._event_loop(pod), name=f"events {pod.url}"),
        )

    async def _scrape(self, pod: Pod, path: str) -> httpx.Response:
        """One read of a scrape, within HEALTH_TIMEOUT_SECONDS (the client's own read timeout is the event
        stream's: a pod frozen in mid-scrape kept its streams waiting 30 s more before they moved)."""
        return await self._client.get(pod.url + path, timeout=HEALTH_TIMEOUT_SECONDS)

    async def _read_config(self, pod: Pod) -> None:
        config = KVConfig.from_json((await self._scrape(pod, KV_CONFIG_PATH)).json())  # a newer engine may say more
        boot_id, _ = self.index.resume_point(pod.name)
        if boot_id is not None and boot_id != config.boot_id:
            self.index.remove_pod(pod.name)  # a restarted pod: its old blocks are gone before its events say so
        if not config.compatible_with(self.expected):
            pod.refused = (
                f"pod {pod.url} hashes blocks differently from this router (block size {config.block_size}, "
                f"hash {config.hash_algo}/{config.hash_root}, tokenizer {config.tokenizer_fingerprint}; router "
                f"expects {self.expected.block_size}, {self.expected.hash_algo}/{self.expected.hash_root}, "
                f"{self.expected.tokenizer_fingerprint}): not indexing or routing to it"
            )
            log.error(pod.refused)
        else:
            pod.refused = None
        pod.kv_config = config

    async def _scrape_loop(self, pod: Pod) -> None:
        while True:
            try:
                health = await self._scrape(pod, "/health")
                status = health.json().get("status") if health.status_code == 503 else None
                pod.draining = pod.terminating or status == "draining"
                pod.loading = status == HEALTH_LOADING
                if status == HEALTH_STALLED:  # its steps hang (a device call): what it runs moves elsewhere now
                    if pod.healthy:
                        log.warning("pod %s stalled: %s", pod.url, health.json().get("message", ""))
                    self._lost(pod, "the engine has stalled (a step running past its stall timeout)")
                # how far its load is, for the pool status (its /metrics answers while it loads)
                pod.load_progress = (load_progress((await self._scrape(pod, "/metrics")).text)
                                     if pod.loading else None)
                if (status == HEALTH_WARMING) != pod.warming:
                    pod.warming = not pod.warming
                    log.info("pod %s %s", pod.url, "is warming up: not routing to it until /health says ok"
                             if pod.warming else "is no longer warming up")
                if health.status_code == 200:  # healthy once its config and metrics are read: never stale at once
                    if pod.kv_config is None:
                        await self._read_config(pod)
                    if pod.served is None or time.monotonic() - pod.served_at >= MODELS_REFRESH_SECONDS:
                        await self._read_models(pod)
                    epoch = pod.unseen.reading()
                    text = (await self._scrape(pod, "/metrics")).text
                    pod.metrics, pod.lora = await asyncio.to_thread(parse_metrics, text)  # ms of parsing: off the loop
                    pod.unseen.read(epoch)
                    pod.scraped_at = time.monotonic()
                pod.healthy = health.status_code == 200
                pod.unreachable_since = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a pod's bad answer must not end its scraper
                if pod.healthy:
                    log.warning("pod %s unreachable: %s", pod.url, exc)
                pod.healthy = pod.warming = pod.loading = False
                pod.load_progress = None
                pod.kv_config = pod.served = None  # read again when it comes back: it may be another boot
                if not isinstance(exc, httpx.TransportError):  # it answered, with something unusable
                    pod.unreachable_since = None
                elif pod.unreachable_since is None:
                    pod.unreachable_since = time.monotonic()
                elif time.monotonic() - pod.unreachable_since >= LOST_AFTER_SECONDS:  # at each scrape from then on
                    self._lost(pod, f"the pod has not answered its health checks for {LOST_AFTER_SECONDS:g} s")
            self.scraped()
            await asyncio.sleep(self.scrape_interval)

    def _lost(self, pod: Pod, why: str) -> None:
        for listener in self.lost_listeners:
            listener(pod.url, why)

    def scraped(self) -> None:
        """A pod was just scraped (it may have become ready or gone): tell the listeners."""
        for listener in self.scrape_listeners:
            listener()

    async def _read_models(self, pod: Pod) -> None:
        """The pod's model list (its KV config is read by then); a pod without the endpoint (404) serves the model
        its KV config names."""
        assert pod.kv_config is not None
        reply = await self._scrape(pod, MODELS_PATH)
        if reply.status_code == 404:
            pod.served, pod.served_at = ServedModels.base_only(pod.kv_config.model), time.monotonic()
            return
        reply.raise_for_status()
        pod.served, pod.served_at = ServedModels.of(reply.json()), time.monotonic()

    async def _resync(self, pod: Pod) -> None:
        body = (await self._client.get(pod.url + KV_BLOCKS_PATH)).json()
        self.index.load_snapshot(pod.name, KVBlocksSnapshot.from_json(body))  # a newer engine may say more

    async def _event_loop(self, pod: Pod) -> None:
        while True:
            try:
                if pod.kv_config is None or pod.refused is not None:
                    await asyncio.sleep(self.scrape_interval)
                    continue
                boot_id, seq = self.index.resume_point(pod.name)
                params: dict[str, str | int] = {"after": seq}
                if boot_id is not None:
                    params["boot_id"] = boot_id
                async with self._client.stream("GET", pod.url + KV_EVENTS_PATH, params=params) as reply:
                    async for line in reply.aiter_lines():
                        if not line:
                            continue
                        batch = KVEventBatch.from_json(json.loads(line))
                        if not self.index.apply(pod.name, batch):
                            await self._resync(pod)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnect whatever went wrong
                log.info("event stream of %s ended: %s", pod.url, exc)
            await asyncio.sleep(RECONNECT_SECONDS)
