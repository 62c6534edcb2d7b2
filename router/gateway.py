"""`kvmesh gateway`'s pure core: which pools' routers serve which model, and which one takes a request.

Each InferencePool has its own router, serving one base model and its LoRA adapters, which it lists at
`/v1/models`. The gateway reads every router's list each refresh and keeps, per router, the last list it answered
and how many refreshes in a row it has missed since. The model table is a pure function of those two and the
routers' weights, so it is tested without HTTP and two gateway replicas that read the same lists route alike. A
router that missed `max_failures` refreshes in a row leaves the table (its models with it, unless another router
serves them); its next answer brings it back. Each router has a weight (its pool's `spec.gateway.weight`, or
`--router-weight`), and the routers listing a model split its requests by weight (`smooth_pick`), so a canary
pool can take 5 % of a model's traffic, then 25 %, then all of it. The HTTP edge is router/gateway_app.py.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvmesh.engine.openai_types import read_json
from kvmesh.engine.typed_fields import check_http_url
from kvmesh.router.asgi import stream_error_ending
from kvmesh.router.lora import ServedModels, union_cards

LISTED, FAILING, DOWN = "listed", "failing", "down"
# kvmesh_gateway_upstreams{state}: answering; missed its last refresh(es) but still routed to; out of the table
# (never answered yet, or missed max_failures refreshes in a row)
UPSTREAM_STATES: tuple[str, ...] = (LISTED, FAILING, DOWN)
# kvmesh_gateway_requests_total{outcome}: a router answered 2xx and the whole answer was relayed; a router answered
# an error status (relayed as it was); the gateway refused the body (400, 408, 413); no router serves the model (404);
# no router of the model could be reached (502); a router's answer broke off; the client left first
GATEWAY_OUTCOMES: tuple[str, ...] = ("ok", "refused", "bad_request", "unknown_model", "unreachable", "broken",
                                     "client_gone")
UNKNOWN_MODEL = "unknown"  # the `model` label of a request for a name not in the table: no series per client string
DEFAULT_MAX_FAILURES = 3
DEFAULT_PORT = 8090
DEFAULT_REFRESH_SECONDS = 5.0
# A router's share of a model's requests is its weight over the sum of the weights of the routers listing it; 0
# drains it (no new request while a router with a weight above 0 lists the model). The CRD's bounds and default.
DEFAULT_WEIGHT = 100
MAX_WEIGHT = 1000
API_KEY_ENV = "KVMESH_GATEWAY_API_KEY"  # a key the gateway shows routers that ask one for /v1/models
API_KEY_MAX_CHARS = 4096  # of an --api-key-file read at each refresh: more is no API key (a wrong path, say)
NAMES_IN_ERROR = 5  # known models a 404 names, at most
MODEL_IN_ERROR_CHARS = 100  # of the client's own model name, echoed in that 404
# Headers never passed on: those of one connection (RFC 9110 7.6.1; plus any the Connection header names)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})
REQUEST_OWN = frozenset({"host", "content-length"})  # what the gateway's client writes for the body it sends
EVENT_STREAM = "text/event-stream"
Pick = tuple[str | None, dict[str, int]]  # the router chosen (None: none left) and the model's turns after it
# The end of an SSE answer that broke off, as the router ends a stream no pod could continue
BROKEN_STREAM_EVENTS = stream_error_ending(
    "the router serving this stream broke off its answer; what came is incomplete").encode()


@dataclass(frozen=True)
class ModelTable:
    """Model name -> the routers serving it, in the routers' stable order; what `/v1/models` answers; each
    router's state."""

    routers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    cards: tuple[dict[str, Any], ...] = ()
    states: Mapping[str, str] = field(default_factory=dict)
    weights: Mapping[str, int] = field(default_factory=dict)  # of the routers in the table; absent: DEFAULT_WEIGHT

    def serves(self, model: str) -> bool:
        return model in self.routers

    def label(self, model: str | None) -> str:
        """The metrics' `model` label: the name when the table has it, else UNKNOWN_MODEL."""
        return model if model is not None and model in self.routers else UNKNOWN_MODEL

    def listed(self) -> tuple[str, ...]:
        """The routers in the table (answering, or missed fewer than max_failures refreshes)."""
        return tuple(url for url, state in self.states.items() if state != DOWN)

    def pick(self, model: str, turns: Mapping[str, int], exclude: Collection[str] = ()) -> Pick:
        """The router of `model` to take its next request, not one in `exclude` (it refused the connection), and
        the model's turns after it (`smooth_pick`). When every router with a weight refused, a drained one (weight
        0) that lists the model takes it rather than the client getting a 502: a rollback's old pool at 0 serves
        while the crashed canary at 100 is still in the table. None when none is left."""
        routers = self.routers.get(model, ())
        chosen, after = smooth_pick(split_weights(routers, self.weights), turns, exclude)
        if chosen is None:
            chosen = next((url for url in routers if url not in exclude), None)
        return chosen, after

    def unknown(self, model: str) -> str:
        """The 404 message for a model no router serves, naming a few that are."""
        names = sorted(self.routers)
        shown = model if len(model) <= MODEL_IN_ERROR_CHARS else model[:MODEL_IN_ERROR_CHARS] + "..."
        if not names:
            return f"The model `{shown}` does not exist: no pool's router answers this gateway now"
        more = f" and {len(names) - NAMES_IN_ERROR} more (GET /v1/models)" if len(names) > NAMES_IN_ERROR else ""
        return f"The model `{shown}` does not exist; this gateway serves {', '.join(names[:NAMES_IN_ERROR])}{more}"


@dataclass(frozen=True)
class Polls:
    """What the gateway knows of its routers: their stable order, each one's last `/v1/models` (absent: it has not
    answered yet) and the refreshes it missed in a row since."""

    order: tuple[str, ...] = ()
    listings: Mapping[str, ServedModels] = field(default_factory=dict)
    failures: Mapping[str, int] = field(default_factory=dict)
    weights: Mapping[str, int] = field(default_factory=dict)

    def with_routers(self, routers: Mapping[str, int]) -> Polls:
        """The routers discovery found now (URL -> weight), in its order: those gone are forgotten, new ones start
        unlisted, the others keep what they had and take their weight now."""
        order = tuple(routers)
        return Polls(order, {u: s for u, s in self.listings.items() if u in order},
                     {u: n for u, n in self.failures.items() if u in order}, dict(routers))

    def answered(self, url: str, served: ServedModels) -> Polls:
        """A router's new list; an empty one after models keeps them (its pool has no engine now: at zero, a
        request there wakes it; with engines down, the router's 503 says more than a 404 for a model it serves)."""
        if not served.names and self.listings.get(url) is not None:
            served = self.listings[url]
        return replace(self, listings={**self.listings, url: served}, failures={**self.failures, url: 0})

    def missed(self, url: str) -> Polls:
        return replace(self, failures={**self.failures, url: self.failures.get(url, 0) + 1})

    def table(self, max_failures: int = DEFAULT_MAX_FAILURES) -> ModelTable:
        return model_table(self.order, self.listings, self.failures, max_failures, self.weights)


def upstream_state(listing: ServedModels | None, failures: int, max_failures: int) -> str:
    if listing is None or failures >= max_failures:
        return DOWN
    return FAILING if failures else LISTED


def model_table(order: Sequence[str], listings: Mapping[str, ServedModels], failures: Mapping[str, int],
                max_failures: int = DEFAULT_MAX_FAILURES, weights: Mapping[str, int] | None = None) -> ModelTable:
    """The table of the routers in `order` from their last lists, missed refreshes and weights (absent:
    DEFAULT_WEIGHT): a router is in it while it has a list and has missed fewer than `max_failures` refreshes in a
    row."""
    states = {url: upstream_state(listings.get(url), failures.get(url, 0), max_failures) for url in order}
    live = [url for url in order if states[url] != DOWN]
    routers: dict[str, list[str]] = {}
    for url in live:
        for name in sorted(listings[url].names):
            routers.setdefault(name, []).append(url)
    return ModelTable({name: tuple(urls) for name, urls in routers.items()},
                      tuple(union_cards(listings[url] for url in live)), states,
                      {url: (weights or {}).get(url, DEFAULT_WEIGHT) for url in live})


def split_weights(routers: Sequence[str], weights: Mapping[str, int]) -> dict[str, int]:
    """The weights a model's routers split its requests by, in their order: those above 0 (a router at 0 drains
    while another takes requests); when every one is at 0, equal ones, since a model some pool serves is never
    refused for its weights."""
    own = {url: weights.get(url, DEFAULT_WEIGHT) for url in routers}
    return {url: w for url, w in own.items() if w > 0} or dict.fromkeys(own, 1)


def smooth_pick(weights: Mapping[str, int], turns: Mapping[str, int], exclude: Collection[str] = ()) -> Pick:
    """Smooth weighted round-robin (nginx's): each pick raises every open router's turn by its weight, takes the
    highest (ties to the earlier in order) and lowers it by the open weights' sum. So any run of picks gives each
    router its weight's share to within one request, interleaved (9:1 is 9 picks of one, then 1 of the other, in
    every 10), at any load and with nothing random: the split an operator sets is the split the metrics show.
    Equal weights make it round-robin, in place of the gateway's earlier least-requests-in-flight choice, which
    sent every request of a light load to the first router (so equal weights, a 50 % canary, split nothing) and
    counted only this gateway replica's own requests; each pool's router still balances its pods by their load.
    The routers in `exclude` (they refused the connection: the request goes to
    another) are passed over and keep their turn. Returns the router (None when none is open) and the new turns,
    those of routers no longer in `weights` dropped."""
    open_weights = {url: w for url, w in weights.items() if url not in exclude}
    raised = {url: turns.get(url, 0) + open_weights.get(url, 0) for url in weights}
    if not open_weights:
        return None, raised
    chosen = max(open_weights, key=raised.__getitem__)
    raised[chosen] -= sum(open_weights.values())
    return chosen, raised


def router_weights(urls: Sequence[str], given: Iterable[str]) -> dict[str, int]:
    """`--router URL` (each once, in order) -> its weight: DEFAULT_WEIGHT unless a `--router-weight URL=WEIGHT`
    names it. ValueError, saying what is wrong, for a malformed one, a weight out of 0..MAX_WEIGHT, a URL no
    `--router` gives, or one given twice."""
    for url in urls:
        check_http_url(url, "--router")
    routers = dict.fromkeys((url.rstrip("/") for url in urls), DEFAULT_WEIGHT)
    named: set[str] = set()
    for item in given:
        url, _, text = item.rpartition("=")
        url = url.rstrip("/")
        if not url or not text.isdecimal() or int(text) > MAX_WEIGHT:
            raise ValueError(f"--router-weight {item!r}: expected URL=WEIGHT, WEIGHT an integer from 0 to "
                             f"{MAX_WEIGHT} (default {DEFAULT_WEIGHT})")
        if url not in routers:
            raise ValueError(f"--router-weight {item!r}: {url} is not one of the --router URLs")
        if url in named:
            raise ValueError(f"--router-weight: {url} is given twice")
        named.add(url)
        routers[url] = int(text)
    return routers


def pool_weight(pool: Mapping[str, Any]) -> int:
    """A pool's `spec.gateway.weight`; DEFAULT_WEIGHT when it has none (the API server fills the default in, but
    an object the CRD never checked may lack it) or one out of 0..MAX_WEIGHT."""
    spec = pool.get("spec")
    gateway = spec.get("gateway") if isinstance(spec, Mapping) else None
    weight = gateway.get("weight") if isinstance(gateway, Mapping) else None
    valid = isinstance(weight, int) and not isinstance(weight, bool) and 0 <= weight <= MAX_WEIGHT
    return weight if valid else DEFAULT_WEIGHT


def pool_routers(pools: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The router address of every InferencePool (as the API lists them) whose status has one, in (namespace,
    name) order, each once (the first pool's weight), with its pool's weight. Not only Ready pools: Ready is False
    while a role is below its desired replicas (a scale-up), when the pool still serves; the refresh itself learns
    what a router serves (nothing, with no healthy engine)."""
    found = []
    for pool in pools:
        address = (pool.get("status") or {}).get("routerAddress")
        meta = pool.get("metadata") or {}
        if isinstance(address, str) and address:
            found.append((str(meta.get("namespace", "")), str(meta.get("name", "")), address.rstrip("/"),
                          pool_weight(pool)))
    routers: dict[str, int] = {}
    for *_, address, weight in sorted(found):
        routers.setdefault(address, weight)
    return routers


def key_in_file(text: str | None) -> str | None:
    """The API key an `--api-key-file` holds, from its text (None: the file could not be read): the text less the
    whitespace around it (a Secret written with `echo` ends in a newline). None when that is empty, longer than
    API_KEY_MAX_CHARS, or not one printable ASCII word, which no `Authorization: Bearer` header could carry."""
    key = (text or "").strip()
    if not key or len(key) > API_KEY_MAX_CHARS or not key.isascii() or not key.isprintable() or " " in key:
        return None
    return key


def relayed_headers(headers: Iterable[tuple[str, str]], own: Collection[str] = ()) -> list[tuple[str, str]]:
    """Headers as the gateway passes them on (a client's to a router: Authorization, x-kvmesh-*, traceparent and
    the rest; a router's answer back), names lowercased, less those of one connection and the `own` ones its
    client or server writes itself."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = {n.strip().lower() for name, value in pairs if name == "connection" for n in value.split(",")}
    dropped = HOP_BY_HOP | named | set(own)
    return [(name, value) for name, value in pairs if name not in dropped]


class BodyError(ValueError):
    """A model request's body the gateway cannot route (400), with the field at fault when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def requested_model(payload: bytes) -> str:
    """The `model` a request body names (BodyError when the body is no JSON object or names none): all the gateway
    reads of it; the router behind checks the rest."""
    try:
        body = read_json(payload)
    except ValueError as exc:
        raise BodyError(str(exc)) from None
    if not isinstance(body, dict):
        raise BodyError("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise BodyError("`model` is required, a string naming one of the models at GET /v1/models"
                        if model is None else f"`model` must be a string, not {type(model).__name__}", "model")
    return model


def outcome_of(status: int) -> str:
    """How a request a router answered counts (its answer relayed whole): ok for 2xx, refused otherwise."""
    return "ok" if 200 <= status < 300 else "refused"


def broken_stream_ending(content_type: str, tail: bytes) -> bytes | None:
    """The bytes that end an answer that broke off after `tail` (its last bytes relayed, two at least when there
    are): for an SSE stream cut at a line's end, its last event finished, then BROKEN_STREAM_EVENTS, so a client
    (the openai SDK among them) reads an error rather than a dropped connection. None for any other answer, or a
    stream cut mid-line (no ending makes that event whole): the gateway cuts it."""
    if not content_type.lower().startswith(EVENT_STREAM) or (tail and not tail.endswith(b"\n")):
        return None
    return (b"" if tail in (b"", b"\n\n") else b"\n") + BROKEN_STREAM_EVENTS
