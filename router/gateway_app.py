"""`kvmesh gateway`: one OpenAI endpoint in front of every pool's router, routing each request by its `model`.

The gateway finds the routers (a static list, or every InferencePool's `status.routerAddress` through the
Kubernetes API), reads each one's `/v1/models` every refresh, and forwards a model request to a router serving
its model (router/gateway.py picks, splitting a model's requests among its routers by their weights), streaming
the answer back as it comes, status and headers included. It reads nothing of a body but its `model`: the router
behind validates, authenticates, routes to a pod and relays, as it does for a client that calls it directly.

Plain ASGI throughout: the routes are few and the hot one wants no framework. Upstream calls use httpx rather than
the router's own client (router/proxy.py), which reads no reply headers, and the router's answer headers
(x-kvmesh-pod, x-ratelimit-*, Retry-After) are part of what a client gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import httpx
import uvicorn
from kubernetes import client as kube_client
from kubernetes.client import Configuration
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.types import Receive, Scope, Send

from kvmesh.engine.body_deadline import BODY_REFUSED, DEFAULT_BODY_READ_TIMEOUT_SECONDS, BodyDeadline, send_json
from kvmesh.engine.openai_types import MODEL_NOT_FOUND, error_body
from kvmesh.engine.protocol import INTERNAL_HTTP_CLIENT, MODEL_PATH_PREFIX, MODELS_PATH, GatewayMetric
from kvmesh.router.asgi import RouteError, read_body, wait_disconnected
from kvmesh.router.batches import CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH
from kvmesh.router.config import MAX_HOLD_SECONDS, MAX_REQUEST_BODY_BYTES, SHUTDOWN_DRAIN_SECONDS, RouterConfig
from kvmesh.router.discovery import REQUEST_SECONDS
from kvmesh.router.gateway import (
    API_KEY_ENV,
    API_KEY_MAX_CHARS,
    DEFAULT_MAX_FAILURES,
    DEFAULT_REFRESH_SECONDS,
    DOWN,
    REQUEST_OWN,
    UNKNOWN_MODEL,
    UPSTREAM_STATES,
    BodyError,
    ModelTable,
    Polls,
    broken_stream_ending,
    key_in_file,
    outcome_of,
    pool_routers,
    relayed_headers,
    requested_model,
    router_weights,
)
from kvmesh.router.lora import ServedModels
from kvmesh.router.proxy import CONNECT_TIMEOUT_SECONDS

log = logging.getLogger("kvmesh.gateway")

MODEL_PATHS = (COMPLETIONS_PATH, CHAT_PATH, RESPONSES_PATH)
MODELS_TIMEOUT_SECONDS = 5.0  # a router's /v1/models answer, at most: past it the refresh counts it missed
# The longest the gateway waits for more of a router's answer: past the longest a router holds a request while its
# pool starts from zero (activationTimeoutSeconds) plus the router's own bound on a pod's silence
# (request-timeout-seconds), and a minute for the router to answer, so its answer or error arrives rather than the
# gateway's 502
READ_TIMEOUT_SECONDS = MAX_HOLD_SECONDS + RouterConfig.request_timeout_seconds + 60.0
KEEPALIVE_CONNECTIONS = 256  # idle connections kept for reuse, over all routers; open ones are not bounded
# Failures before a byte of the request left: another router of the model may take it (nothing was sent twice)
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
NOT_ROUTED = ("The gateway routes only model requests (POST /v1/completions, /v1/chat/completions, /v1/responses) "
              "and lists models at GET /v1/models and /v1/models/{model}; the Batch API, files, stored responses "
              "(GET /v1/responses/{id}) and /tokenize are served by each pool's router at its own address")

Discover = Callable[[], Awaitable[dict[str, int]]]  # the routers found: URL -> weight, in a stable order


def static_routers(urls: Sequence[str], weights: Sequence[str] = ()) -> Discover:
    """Discovery of a fixed list of routers (`--router`), weighted by `--router-weight URL=WEIGHT` (ValueError
    for a bad one)."""
    fixed = router_weights(urls, weights)

    async def discover() -> dict[str, int]:
        return fixed

    return discover


@dataclass
class PoolDiscovery:
    """The routers of the InferencePools in `namespace` (every namespace: None) with their pools'
    `spec.gateway.weight`, listed through the Kubernetes API at each refresh (a patched weight counts from the
    next). `pools` is the kind's (group, version, plural): operator/crd.py's, passed in by the caller,
    since imports run operator -> router and never back (docs/architecture.md). The official client is
    synchronous: each list runs in a thread."""

    configuration: Configuration
    pools: tuple[str, str, str]
    namespace: str | None = None

    async def __call__(self) -> dict[str, int]:
        return await asyncio.to_thread(self._list)

    def _list(self) -> dict[str, int]:
        group, version, plural = self.pools
        with kube_client.ApiClient(self.configuration) as api_client:
            api = kube_client.CustomObjectsApi(api_client)
            if self.namespace:
                listed = api.list_namespaced_custom_object(group, version, self.namespace, plural,
                                                           _request_timeout=REQUEST_SECONDS)
            else:
                listed = api.list_cluster_custom_object(group, version, plural, _request_timeout=REQUEST_SECONDS)
        return pool_routers(listed.get("items") or [])


@dataclass
class ApiKeyFile:
    """`--api-key-file`: the key shown to routers that ask one for /v1/models, re-read at every refresh, so a
    rotated Secret mounted as a volume (the kubelet swaps its files in place) is used from the next refresh without
    a restart. A file missing, unreadable, empty or holding no single key means polls without a key. What the file
    gives is logged when it changes, not at every refresh."""

    path: str
    _last: tuple[str | None, str] | None = field(default=None, init=False)  # the key and the problem last logged

    def read(self) -> str | None:
        """The key now (blocking: the refresh calls it off the event loop)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                text: str | None = f.read(API_KEY_MAX_CHARS + 1)
            problem = "is empty or holds no single API key"
        except (OSError, UnicodeDecodeError) as exc:
            text, problem = None, f"cannot be read ({exc})"
        key = key_in_file(text)
        now = (key, "" if key else problem)
        if now != self._last:
            if key is None:
                log.warning("API key file %s %s: routers' /v1/models are read without a key", self.path, problem)
            else:
                log.info("API key file %s: %s key shown to the routers from this refresh", self.path,
                         "a new" if self._last is not None and self._last[0] else "its")
            self._last = now
        return key


class GatewayMetrics:
    def __init__(self, table: Callable[[], ModelTable]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(GatewayMetric.REQUESTS, "Model requests by model (a name the pools' routers list, "
                                "else unknown) and outcome.", ["model", "outcome"], registry=r)
        self.upstream_requests = Counter(
            GatewayMetric.UPSTREAM_REQUESTS, "Model requests sent to each pool's router (counted when its answer "
            "begins, or fails once sent), by model and router URL: the weighted split.", ["model", "router"],
            registry=r)
        upstreams = Gauge(GatewayMetric.UPSTREAMS, "The pools' routers by state.", ["state"], registry=r)
        for state in UPSTREAM_STATES:
            upstreams.labels(state).set_function(lambda s=state: _count(table().states.values(), s))
        self._outcomes: set[tuple[str, str]] = set()  # the (model, outcome) series of `requests`
        self._splits: set[tuple[str, str]] = set()  # the (model, router) series of `upstream_requests`

    def count(self, model: str, outcome: str) -> None:
        """One model request ended (`model`: a table's label)."""
        self._outcomes.add((model, outcome))
        self.requests.labels(model, outcome).inc()

    def took(self, model: str, router: str) -> None:
        """One model request `router` took (`model`: a table's label)."""
        self._splits.add((model, router))
        self.upstream_requests.labels(model, router).inc()

    def prune(self, table: ModelTable) -> None:
        """Remove the series of the models that left `table`, and of the routers that no longer serve a model: pools
        and adapters come and go, and a gateway that runs for months must not export every one it ever served."""
        for key in [key for key in self._outcomes if not _listed(table, key[0])]:
            self.requests.remove(*key)
            self._outcomes.remove(key)
        for key in [key for key in self._splits if not _listed(table, *key)]:
            self.upstream_requests.remove(*key)
            self._splits.remove(key)


def _listed(table: ModelTable, model: str, router: str | None = None) -> bool:
    """Whether `table` serves the metrics' label `model` (UNKNOWN_MODEL: any model), through `router` if named (a
    request counted unknown had its model leave the table on its way: the router still in the table keeps it)."""
    if model == UNKNOWN_MODEL:
        return router is None or router in table.states
    return table.serves(model) and (router is None or router in table.routers[model])


def _count(states: Iterable[str], state: str) -> int:
    return sum(1 for s in states if s == state)


@dataclass
class Gateway:
    """The gateway's state: how it finds routers, what they last listed, and each model's turns among its routers
    (`smooth_pick`'s)."""

    discover: Discover
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS
    max_failures: int = DEFAULT_MAX_FAILURES
    api_key: str | None = None  # shown to the routers when reading their /v1/models ($KVMESH_GATEWAY_API_KEY)
    api_key_file: ApiKeyFile | None = None  # when set, the key instead: the file's, read at every refresh
    polls: Polls = field(default_factory=Polls)
    table: ModelTable = field(default_factory=ModelTable)
    turns: dict[str, dict[str, int]] = field(default_factory=dict)  # model -> router -> turn
    client: httpx.AsyncClient | None = None  # opened in the app's lifespan, inside the loop that serves
    body_read_timeout_seconds: float = DEFAULT_BODY_READ_TIMEOUT_SECONDS  # a body not whole by then: 408, closed
    metrics: GatewayMetrics = field(init=False)
    _missed: dict[str, str] = field(default_factory=dict)  # why each router's last refresh missed, for the log

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(lambda: self.table)

    def count(self, model: str | None, outcome: str) -> None:
        self.metrics.count(self.table.label(model), outcome)

    def choose(self, model: str, exclude: Collection[str]) -> str | None:
        """The router of `model` to try next, not one in `exclude`; its turn is taken."""
        router, self.turns[model] = self.table.pick(model, self.turns.get(model, {}), exclude)
        return router

    def took(self, model: str, router: str) -> None:
        """A request `router` took (not one it refused the connection to), for the split's metric."""
        self.metrics.took(self.table.label(model), router)

    async def refresh(self) -> None:
        """Discover the routers (keeping the last ones when discovery fails) and read every one's /v1/models at
        once; the new table replaces the old in one step."""
        try:
            found = await self.discover()
        except Exception as exc:  # an API server away must leave the gateway routing to the routers it knows
            log.warning("router discovery failed (%s); keeping the %d routers known", exc, len(self.polls.order))
            found = dict(self.polls.weights)
        polls = self.polls.with_routers(found)
        key = await asyncio.to_thread(self.api_key_file.read) if self.api_key_file is not None else self.api_key
        listed = await asyncio.gather(*(self._models_of(url, key) for url in polls.order))
        for url, served in zip(polls.order, listed, strict=True):
            polls = polls.answered(url, served) if served is not None else polls.missed(url)
        table = polls.table(self.max_failures)
        for url, state in table.states.items():
            before = self.table.states.get(url)
            if state == DOWN and before != DOWN:
                log.warning("router %s is out of the model table: %s", url, self._missed.get(url, "no answer"))
            elif state != DOWN and before in (DOWN, None):
                log.info("router %s serves %s", url, ", ".join(sorted(polls.listings[url].names)) or "no model now")
            if url in self.polls.weights and self.polls.weights[url] != polls.weights[url]:
                log.info("router %s: weight %d, was %d", url, polls.weights[url], self.polls.weights[url])
        self.polls, self.table = polls, table
        self.turns = {model: turns for model, turns in self.turns.items() if table.serves(model)}
        self.metrics.prune(table)
        self._missed = {url: why for url, why in self._missed.items() if url in polls.order}

    async def _models_of(self, url: str, api_key: str | None) -> ServedModels | None:
        """A router's /v1/models, or None when it did not answer one."""
        assert self.client is not None
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            reply = await self.client.get(url + MODELS_PATH, headers=headers, timeout=MODELS_TIMEOUT_SECONDS)
            if reply.status_code != 200:
                self._missed[url] = f"{MODELS_PATH} answered {reply.status_code}" + (
                    " (it asks an API key: the gateway showed none or one its keys file lacks)"
                    if reply.status_code == 401 else "")
                return None
            return ServedModels.of(reply.json())
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # InvalidURL: a pool's address is no URL
            self._missed[url] = f"no {MODELS_PATH}: {exc or type(exc).__name__}"
            return None

    async def refresh_forever(self) -> None:
        """Refresh until cancelled; a refresh that fails is logged and the next one comes (an escaped error ended
        the task, and the gateway routed on a table that never changed again)."""
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing the model table failed; keeping the last one")

    async def open(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(READ_TIMEOUT_SECONDS, connect=CONNECT_TIMEOUT_SECONDS),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS),
            **INTERNAL_HTTP_CLIENT)
        for name in ("accept", "accept-encoding", "user-agent"):  # httpx's defaults: a router gets the client's own
            del self.client.headers[name]
        await self.refresh()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class GatewayApp:
    """The gateway's ASGI app: model requests forwarded, /v1/models (and a model's card, /v1/models/{model}),
    /health, /metrics; anything else 404. Every
    request goes through the body-read deadline first (engine/body_deadline.py): a body not whole in time is a 408,
    counted as bad_request."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._refreshing: asyncio.Task[None] | None = None
        self._edge = BodyDeadline(self._dispatch, lambda: gateway.body_read_timeout_seconds,
                                  lambda _: gateway.count(None, "bad_request"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._edge(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method, gw = scope["path"], scope["method"], self.gateway
        if path in MODEL_PATHS:
            if method == "POST":
                await self._model_request(scope, receive, send)
            else:
                await send_json(send, 405, error_body("Method Not Allowed"), [("allow", "POST")])
        elif (path in (MODELS_PATH, "/health", "/metrics") or path.startswith(MODEL_PATH_PREFIX)) \
                and method not in ("GET", "HEAD"):
            await send_json(send, 405, error_body("Method Not Allowed"), [("allow", "GET, HEAD")])
        elif path == MODELS_PATH:
            await send_json(send, 200, {"object": "list", "data": list(gw.table.cards)})
        elif path.startswith(MODEL_PATH_PREFIX):  # the path is percent-decoded already (ASGI): an id's "/" as sent
            model = path.removeprefix(MODEL_PATH_PREFIX)
            card = next((card for card in gw.table.cards if card.get("id") == model), None)
            if card is None:
                await send_json(send, 404, error_body(gw.table.unknown(model), param="model", code=MODEL_NOT_FOUND))
            else:
                await send_json(send, 200, card)
        elif path == "/health":
            listed = gw.table.listed()
            await send_json(send, 200 if listed else 503, {"status": "ok" if listed else "no_routers",
                                                           "routers": list(listed)})
        elif path == "/metrics":
            content = generate_latest(gw.metrics.registry)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4"), (b"content-length", str(len(content)).encode())]})
            await send({"type": "http.response.body", "body": content})
        else:
            await send_json(send, 404, error_body(NOT_ROUTED, code="not_found"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.gateway.open()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                self._refreshing = asyncio.create_task(self.gateway.refresh_forever())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._refreshing is not None:
                    self._refreshing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._refreshing
                await self.gateway.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _model_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read and check the body, then forward it while watching the client: one that leaves cancels the
        forwarding, which closes the router's connection (the router then aborts its pod's request)."""
        gw = self.gateway
        try:
            payload = await read_body(receive, MAX_REQUEST_BODY_BYTES)
            if payload is None:  # the client left before its request was whole, or was answered 408 (counted then)
                if not scope.get(BODY_REFUSED):
                    gw.count(None, "client_gone")
                return
            model = requested_model(payload)
        except RouteError as exc:  # over the size bound
            gw.count(None, "bad_request")
            await send_json(send, exc.status, error_body(exc.message, code=exc.code), exc.headers.items())
            return
        except BodyError as exc:
            gw.count(None, "bad_request")
            await send_json(send, 400, error_body(str(exc), param=exc.param))
            return
        if not gw.table.serves(model):
            gw.count(model, "unknown_model")
            await send_json(send, 404, error_body(gw.table.unknown(model), param="model", code=MODEL_NOT_FOUND))
            return
        work = asyncio.ensure_future(self._forward(scope, send, payload, model))
        gone = asyncio.ensure_future(wait_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
            gone.cancel()
        try:
            outcome = await work
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():  # not the client: this request itself was cancelled
                raise
            outcome = "client_gone"
        gw.count(model, outcome)

    async def _forward(self, scope: Scope, send: Send, payload: bytes, model: str) -> str:
        """Send the request to the routers of `model`, in the order their weights give, until one takes the
        connection; relay its answer. The outcome (GATEWAY_OUTCOMES)."""
        gw = self.gateway
        assert gw.client is not None
        # as bytes: httpx encodes str values as ASCII, and a client's UTF-8 header (x-user: café) is passed on as
        # it came, as the router and Envoy do
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in relayed_headers(
            ((n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]), REQUEST_OWN)]
        query = scope.get("query_string", b"").decode("latin-1")
        target = scope["path"] + (f"?{query}" if query else "")
        tried: set[str] = set()
        while (router := gw.choose(model, tried)) is not None:
            tried.add(router)
            request = gw.client.build_request("POST", router + target, content=payload, headers=headers)
            try:
                reply = await gw.client.send(request, stream=True)
            except CONNECT_FAILURES as exc:
                log.warning("router %s of %s: cannot connect (%s); trying another", router, model, exc)
                continue
            except httpx.HTTPError as exc:  # sent, then failed: another router might serve it twice
                gw.took(model, router)
                await send_json(send, 502, error_body(f"the router serving `{model}` failed before answering: "
                                                      f"{exc or type(exc).__name__}", "server_error"))
                return "unreachable"
            gw.took(model, router)
            try:
                return await self._relay(reply, send)
            finally:
                await reply.aclose()  # before its end: the connection is dropped, which tells the router
        await send_json(send, 502, error_body(f"no router serving `{model}` could be reached ({len(tried)} tried)",
                                              "server_error"))
        return "unreachable"

    @staticmethod
    async def _relay(reply: httpx.Response, send: Send) -> str:
        """The router's answer as it arrives (its bytes as sent: an SSE stream chunk by chunk). An SSE stream that
        breaks off at a line's end ends with an error event and [DONE], as the router ends one no pod could
        continue; any other answer that breaks off is cut here too (the connection closes unfinished), so the client
        sees it was not whole."""
        await send({"type": "http.response.start", "status": reply.status_code, "headers": [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in relayed_headers(
                (n.decode("latin-1"), v.decode("latin-1")) for n, v in reply.headers.raw)]})
        tail = b""  # the last two bytes relayed: where the stream stood when it broke
        try:
            async for chunk in reply.aiter_raw():
                tail = (tail + chunk)[-2:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            log.warning("a router's answer broke off: %s", exc or type(exc).__name__)
            ending = broken_stream_ending(reply.headers.get("content-type", ""), tail)
            if ending is not None:
                await send({"type": "http.response.body", "body": ending})
            return "broken"
        await send({"type": "http.response.body", "body": b""})
        return outcome_of(reply.status_code)


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def run_gateway(gateway: Gateway, host: str, port: int, log_level: str = "info") -> None:
    """Serve until a signal; requests open then get SHUTDOWN_DRAIN_SECONDS to finish, as a router's do."""
    uvicorn.run(GatewayApp(gateway), host=host, port=port, log_level=log_level, lifespan="on",
                server_header=False, date_header=False,  # the router's own pass through
                timeout_graceful_shutdown=int(SHUTDOWN_DRAIN_SECONDS))
