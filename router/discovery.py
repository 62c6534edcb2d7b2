"""Kubernetes discovery: keep a router's pod set equal to the engine endpoints of its pool.

The operator puts a headless Service in front of each pool's engines; Kubernetes keeps its EndpointSlices
(discovery.k8s.io/v1) current, and they inherit the Service's labels. The router lists the slices its label
selector matches, then watches them from the list's resource version (a 410 Gone means the version is too old:
list again), and reconnects with backoff after any other failure, keeping the last known pods meanwhile.

Pure core, thin edge: `desired_pods` turns slices into the wanted set (pod URL -> draining) and is tested on its
own; the watcher only reads, calls it, and hands the result to the event loop. The official client is
synchronous, so the watch runs in a thread and never blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch
from kubernetes import config as kube_config
from kubernetes.client import Configuration, V1EndpointSlice
from kubernetes.client.exceptions import ApiException

from kvmesh.router.config import RouterConfig

log = logging.getLogger("kvmesh.router.discovery")

PORT_NAME = "http"  # the engine port's name in the pool's Service; without it, a slice's first port
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SECONDS = 300  # the server ends each watch after this; the watcher resumes from the last version it saw
REQUEST_SECONDS = 10.0  # connect timeout, and read timeout for lists; a watch may be silent until WATCH_SECONDS
BACKOFF_FIRST_SECONDS = 0.5  # the wait before listing again after a failure, doubling up to BACKOFF_MAX_SECONDS
BACKOFF_MAX_SECONDS = 30.0
STOP_SECONDS = 2.0


def endpoint_url(address: str, port: int) -> str:
    """`http://address:port`, with an IPv6 address in brackets."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def slice_port(slice_: V1EndpointSlice, name: str = PORT_NAME) -> int | None:
    """The engine port of a slice: the one called `name`, else the first; None when the slice names none."""
    ports = [p for p in slice_.ports or [] if p.port is not None]
    named = [p for p in ports if p.name == name]
    chosen = (named or ports or [None])[0]
    return chosen.port if chosen is not None else None


def desired_pods(slices: Iterable[V1EndpointSlice], port_name: str = PORT_NAME) -> dict[str, bool]:
    """Pod URL -> draining, for every endpoint a router keeps.

    Ready and not terminating: routed to. Terminating but still serving: kept, draining, so that running streams
    finish while new requests go elsewhere (docs/contracts.md, contract 0). Anything else (not ready, or terminating and
    no longer serving) is left out. Unset conditions read as the API defines them: ready and serving true,
    terminating false. An endpoint in several slices (while Kubernetes moves it) is draining only if every copy
    says so. Only the first address of an endpoint is used: the API calls them fungible.
    """
    wanted: dict[str, bool] = {}
    for slice_ in slices:
        port = slice_port(slice_, port_name)
        if port is None:
            continue
        for endpoint in slice_.endpoints or []:
            if not endpoint.addresses:
                continue
            conditions = endpoint.conditions
            ready = conditions is None or conditions.ready is not False
            serving = conditions is None or conditions.serving is not False
            terminating = conditions is not None and conditions.terminating is True
            if terminating and serving:
                draining = True
            elif ready and not terminating:
                draining = False
            else:
                continue
            url = endpoint_url(endpoint.addresses[0], port)
            wanted[url] = wanted.get(url, True) and draining
    return wanted


# what reading a kubeconfig raises besides the client's ConfigException: a missing or unreadable file, text that is
# not YAML, YAML that is not a kubeconfig
_KUBECONFIG_ERRORS = (kube_config.ConfigException, OSError, yaml.YAMLError, TypeError, AttributeError, KeyError)


def kube_configuration(kubeconfig: str | None) -> Configuration:
    """Client settings from a kubeconfig file; with none, from the pod's service account, or outside a cluster from
    $KUBECONFIG (or ~/.kube/config), as kubectl reads it. ValueError naming the file for one that cannot be used."""
    configuration = Configuration()
    if kubeconfig is None:
        try:
            kube_config.load_incluster_config(configuration)
            return configuration
        except kube_config.ConfigException as exc:
            if not Path(kube_config.KUBE_CONFIG_DEFAULT_LOCATION.split(":")[0]).expanduser().exists():
                raise ValueError(f"kubernetes discovery: not in a cluster ({exc}) and no kubeconfig: pass "
                                 "--kubeconfig FILE or set KUBECONFIG") from None
    try:
        kube_config.load_kube_config(kubeconfig, client_configuration=configuration, persist_config=False)
    except _KUBECONFIG_ERRORS as exc:
        where = kubeconfig or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
        raise ValueError(f"kubernetes discovery: kubeconfig {where} cannot be used: {' '.join(str(exc).split())}") \
            from None
    return configuration


def default_namespace(kubeconfig: str | None) -> str:
    """The kubeconfig's current namespace, or the router pod's own; `default` when neither says."""
    if kubeconfig is not None:
        try:
            _, current = kube_config.list_kube_config_contexts(kubeconfig)
        except _KUBECONFIG_ERRORS as exc:
            raise ValueError(f"kubeconfig {kubeconfig} cannot be used: {' '.join(str(exc).split())}") from None
        return str(current.get("context", {}).get("namespace") or "default")
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


class EndpointSliceWatcher:
    """Lists, then watches, the EndpointSlices that `label_selector` matches in `namespace`, in a thread, and
    hands every change of `desired_pods` to the event loop that started it."""

    def __init__(
        self,
        configuration: Configuration,
        namespace: str,
        label_selector: str,
        port_name: str = PORT_NAME,
        watch_seconds: int = WATCH_SECONDS,
    ) -> None:
        self.configuration = configuration
        self.namespace = namespace
        self.label_selector = label_selector
        self.port_name = port_name
        self.watch_seconds = watch_seconds
        self._slices: dict[str, V1EndpointSlice] = {}
        self._published: dict[str, bool] | None = None
        self._stopping = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._apply: Callable[[Mapping[str, bool]], None] | None = None

    @classmethod
    def from_config(cls, config: RouterConfig) -> EndpointSliceWatcher:
        """The watcher `config` describes; a kubeconfig or service account that cannot be read fails here, at
        startup, as a ValueError."""
        configuration = kube_configuration(config.kubeconfig)
        namespace = config.namespace or default_namespace(config.kubeconfig)
        return cls(configuration, namespace, config.endpoint_selector())

    def start(self, apply: Callable[[Mapping[str, bool]], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._apply = apply
        self._thread = threading.Thread(target=self._run, name="kvmesh endpointslice watch", daemon=True)
        self._thread.start()
        log.info("watching EndpointSlices %r in namespace %s", self.label_selector, self.namespace)

    def stop(self) -> None:
        """Stop watching; the thread is a daemon, so one stuck in a request cannot hold the router's exit."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()  # shuts the socket down, so a blocked read returns at once
        if self._thread is not None:
            self._thread.join(STOP_SECONDS)

    # ---- the thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        api_client = client.ApiClient(self.configuration)
        api = client.DiscoveryV1Api(api_client)
        version: str | None = None  # None: list before watching
        failures = 0
        while not self._stopping.is_set():
            try:
                if version is None:
                    version = self._list(api)
                version = self._watch_from(api, version)
                failures = 0
                continue
            except ApiException as exc:
                if self._stopping.is_set():
                    break
                version = None
                if exc.status == HTTPStatus.GONE:
                    log.info("EndpointSlice watch expired; listing again")
                    continue
                log.warning("EndpointSlice list/watch failed (%s %s); retrying", exc.status, exc.reason)
            except Exception as exc:  # any failure here must leave the router running on the pods it knows
                if self._stopping.is_set():
                    break
                version = None
                log.warning("EndpointSlice list/watch failed (%s); retrying", exc)
            failures += 1
            self._stopping.wait(min(BACKOFF_FIRST_SECONDS * 2 ** (failures - 1), BACKOFF_MAX_SECONDS))
        api_client.close()

    def _list(self, api: client.DiscoveryV1Api) -> str:
        listed = api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector, _request_timeout=REQUEST_SECONDS
        )
        self._slices = {s.metadata.name: s for s in listed.items}
        self._publish()
        return str(listed.metadata.resource_version)

    def _watch_from(self, api: client.DiscoveryV1Api, version: str) -> str:
        """Apply watch events until the server ends the watch; the version to resume from."""
        self._watch = watch.Watch()
        stream = self._watch.stream(
            api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=self.label_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_seconds,
            _request_timeout=(REQUEST_SECONDS, self.watch_seconds + REQUEST_SECONDS),
        )
        for event in stream:
            self._on_event(event)
        return str(self._watch.resource_version or version)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind, slice_ = event["type"], event["object"]
        if kind == "DELETED":
            self._slices.pop(slice_.metadata.name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._slices[slice_.metadata.name] = slice_
        else:
            return  # BOOKMARK: only a newer version to resume from, which the Watch keeps
        self._publish()

    def _publish(self) -> None:
        wanted = desired_pods(self._slices.values(), self.port_name)
        if wanted == self._published:
            return
        self._published = wanted
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, wanted)
        except RuntimeError:  # the loop is closed: the router is shutting down
            self._stopping.set()

    def _deliver(self, wanted: dict[str, bool]) -> None:
        """On the event loop: apply, unless the pod set has been stopped meanwhile."""
        if not self._stopping.is_set() and self._apply is not None:
            self._apply(wanted)
