"""The LoRA adapters a pool declares, kept loaded in its running engines without restarting them.

Each tick the operator asks every ready engine what it serves (GET /v1/models: the base model's card, then one
card per adapter with its directory as `root`), plans the difference against `spec.model.loraAdapters`
(`plan_adapters`, pure), and carries it out with the engine's own endpoints (POST /v1/unload_lora_adapter, then
/v1/load_lora_adapter). Unloads go first so they free slots for the loads. A changed path for a known name is one
load with `load_inplace` (vLLM's field): the engine points the name at the new weights with no moment it is not
served, even while the adapter is busy (its running requests finish on the old weights, in a spare slot), and it
hashes the new weights' blocks apart from the old ones' (their fingerprint is in the block hash), so no cache, tier
or peer serves the old weights' KV under the name. An adapter an engine cannot load (a bad directory, a rank
above its maximum) is the user's to fix in the spec, so a refused action (a 4xx other than 409) is remembered per
engine life and not tried again while the spec asks for the same thing: one Event, no retry storm. A full engine
(409: also an update of a busy adapter with no spare slot) or one that does not answer is simply planned again at
the next tick.

What the sync remembers (the refusals, the names the spec has declared) is kept in the pool's status
(`AdapterMemory.to_status`), so a restarted operator neither retries refusals nor leaves a dropped adapter loaded.
The engines are synced concurrently within one budget per tick (ADAPTER_BUDGET_SECONDS): what does not fit is
left for the next tick, so a hanging engine cannot hold up the pool's scaling.

Kopf-free: the cluster operator (operator/handlers.py) calls `adapter_tick` from its scaling timer, and
`kvmesh up -f` (operator/local.py) from its local one.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx

from kvmesh.engine.protocol import LOAD_LORA_PATH, LORA_ACTIONS, LORA_OUTCOMES, MODELS_PATH, UNLOAD_LORA_PATH
from kvmesh.operator.crd import MAX_ADAPTER_REFUSALS, MAX_MANAGED_ADAPTERS, Pool
from kvmesh.operator.pod_client import pod_client
from kvmesh.router.lora import ServedModels

LOAD, UNLOAD = LORA_ACTIONS
OK, RETRY, REFUSED = LORA_OUTCOMES
MODELS_TIMEOUT_SECONDS = 2.0
# A load reads the adapter's directory and takes a slot at the next step boundary; a timed-out load may still
# complete, and the next tick sees it in /v1/models.
ACTION_TIMEOUT_SECONDS = 30.0
# All of a tick's adapter calls end within this (each call's timeout is cut to what is left of it): the sync runs
# inside the pool's scaling tick (every scaling.intervalSeconds, 15 s by default), whose decision must not wait
# on slow adapter storage or a hanging engine. What did not fit is planned again at the next tick (Pending).
ADAPTER_BUDGET_SECONDS = 10.0
BUDGET_GRACE_SECONDS = 1.0  # past the budget, how long the tick waits for calls whose timeouts just ran out
SYNC_WORKERS = 8  # engines synced at once


def declared_adapters(pool: Pool) -> dict[str, str]:
    """The pool's adapters, name -> directory: what engines load at start (`lora_modules`) and keep loaded."""
    return {a["name"]: a["path"] for a in pool.spec["model"]["loraAdapters"]}


# ---- the plan (pure) -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterAction:
    kind: str  # LOAD or UNLOAD
    name: str
    path: str | None = None  # the directory to load; None for an unload
    # a load over the name's other weights (load_inplace). Not part of its identity: a refusal is of the directory,
    # whether it was to replace weights or not (the pool's status keeps refusals without it)
    inplace: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        assert self.kind in LORA_ACTIONS and (self.path is None) == (self.kind == UNLOAD), self
        assert not (self.inplace and self.kind == UNLOAD), self

    def describe(self) -> str:
        if self.kind == UNLOAD:
            return f"unload LoRA adapter {self.name!r}"
        return f"update LoRA adapter {self.name!r} in place from {self.path}" if self.inplace else \
            f"load LoRA adapter {self.name!r} from {self.path}"


@dataclass(frozen=True)
class AdapterPlan:
    """One engine's actions, in the order to take them, and those held back: refused by it before."""

    actions: tuple[AdapterAction, ...] = ()
    held: tuple[AdapterAction, ...] = ()


def served_adapters(models: Any) -> dict[str, str]:
    """An engine's GET /v1/models answer, read as the router reads it (router/lora.py `ServedModels.of`) -> the
    adapters it serves, name -> directory (each adapter card's `root`: the path the engine opened). Raises
    ValueError for an answer of another shape."""
    served = ServedModels.of(models)
    cards = [c for c in served.cards if c["id"] in served.adapters]
    if not all(isinstance(c.get("root"), str) for c in cards):
        raise ValueError(f"an adapter card without its directory (root): {str(cards)[:200]}")
    return {c["id"]: c["root"] for c in cards}


def same_directory(a: str | None, b: str | None) -> bool:
    """Whether two spellings name one directory (`/adapters/sql/` and `/adapters/./sql`): the engine reports the
    path it opened, normalized."""
    return a is not None and b is not None and posixpath.normpath(a) == posixpath.normpath(b)


def plan_adapters(declared: Mapping[str, str], served: Mapping[str, str],
                  refused: Collection[AdapterAction] = (), managed: Collection[str] | None = None) -> AdapterPlan:
    """What one engine must do to serve `declared` (name -> directory) given what it `served`: unload the names it
    manages (`managed`: default every name) that are no longer declared, then load the missing ones and those
    declared with another directory (in place: never an unload first, so the name is served throughout), each by
    name. An adapter someone loaded by hand under a name the operator never managed stays. An action this engine
    `refused` before is held back (the spec must change for it to be tried again)."""
    managed = served.keys() if managed is None else managed
    unloads = [AdapterAction(UNLOAD, n) for n in sorted(served) if n in managed and n not in declared]
    loads = [AdapterAction(LOAD, n, declared[n], inplace=n in served) for n in sorted(declared)
             if not same_directory(served.get(n), declared[n])]
    wanted = unloads + loads
    return AdapterPlan(tuple(a for a in wanted if a not in refused), tuple(a for a in wanted if a in refused))


@dataclass(frozen=True)
class ActionResult:
    action: AdapterAction
    outcome: str  # one of LORA_OUTCOMES
    message: str


def outcome_of(action: AdapterAction, status: int | None, message: str) -> ActionResult:
    """Classify an engine's answer (`status` None: no answer). Unloading a name it no longer holds is done; 409
    (every slot taken, an unload's adapter still has requests, or an update's has them and no slot is spare), 401
    (the pool's internal token not yet the same on both sides: a rotation under way), a 5xx or no answer is
    retried at the next tick; any other 4xx is the spec's problem, refused for good."""
    if status is not None and (HTTPStatus.OK <= status < HTTPStatus.MULTIPLE_CHOICES or
                               (action.kind == UNLOAD and status == HTTPStatus.NOT_FOUND)):
        return ActionResult(action, OK, action.describe())
    if status is None or status in (HTTPStatus.CONFLICT, HTTPStatus.UNAUTHORIZED) or \
            status >= HTTPStatus.INTERNAL_SERVER_ERROR:
        return ActionResult(action, RETRY, f"{action.describe()}: {message} (retried next tick)")
    return ActionResult(action, REFUSED, f"{action.describe()} was refused ({status}): {message}; it is not "
                                         f"retried until spec.model.loraAdapters changes it")


Life = tuple[str, str, int]  # one engine's life: its pod's name, uid and containers' restarts


@dataclass(frozen=True)
class EnginePod:
    name: str
    role: str
    url: str  # http://ip:port of its engine
    restarts: int = 0  # its containers' restarts: a restarted engine starts a new life, with nothing refused yet
    uid: str = ""  # the pod's uid: a later pod of the same name is another engine

    @property
    def life(self) -> Life:
        return self.name, self.uid, self.restarts


@dataclass(frozen=True)
class EngineSync:
    """One engine's tick: what it served, what was done and how it went, what was held back (refused before) and
    what was deferred (the tick's budget was spent first); `error` when its /v1/models was not read (nothing was
    done)."""

    pod: EnginePod
    results: tuple[ActionResult, ...] = ()
    held: tuple[AdapterAction, ...] = ()
    error: str | None = None
    served: Mapping[str, str] = field(default_factory=dict)
    deferred: tuple[AdapterAction, ...] = ()

    def serves_after(self) -> set[str]:
        """The adapters it serves once this tick's actions are done, as far as their answers tell."""
        names = set(self.served)
        for r in self.results:
            if r.outcome == OK:
                (names.add if r.action.kind == LOAD else names.discard)(r.action.name)
        return names


@dataclass(frozen=True)
class AdapterStatus:
    """A pool's adapters in one line, for its AdaptersLoaded condition."""

    ok: bool
    reason: str  # Loaded, Pending or Refused
    message: str


def summarize(syncs: Sequence[EngineSync], declared: Mapping[str, str]) -> AdapterStatus:
    """Loaded when every engine answered and all its actions (if any) succeeded; Refused when an engine holds a
    refusal (the user must act); Pending otherwise (retried next tick)."""
    refused = [f"{s.pod.name}: {a.describe()}" for s in syncs for a in s.held] + \
        [f"{s.pod.name}: {r.action.describe()}" for s in syncs for r in s.results if r.outcome == REFUSED]
    if refused:
        return AdapterStatus(False, "Refused", "refused, change the spec: " + "; ".join(refused))
    pending = [f"{s.pod.name}: {s.error}" for s in syncs if s.error] + \
        [f"{s.pod.name}: {r.message}" for s in syncs for r in s.results if r.outcome == RETRY] + \
        [f"{s.pod.name}: {a.describe()}: the tick's adapter budget was spent first (next tick)" for s in syncs
         for a in s.deferred]
    if pending:
        return AdapterStatus(False, "Pending", "; ".join(pending))
    if declared and not syncs:
        return AdapterStatus(False, "Pending", "no ready engine to load them into")
    return AdapterStatus(True, "Loaded", f"{len(declared)} adapters on {len(syncs)} ready engines")


# ---- what the sync remembers, in the pool's status -------------------------------------------------------------


@dataclass
class AdapterMemory:
    """What the sync remembers of one pool: per engine life, the actions it refused (not tried again on it: the
    Event was posted once) while the spec asks for the same thing, and the names the spec has declared that an
    engine may still serve (the ones it manages: unloaded once the spec drops them). Unbounded in this process
    (at most engines x names the spec asks for: a refusal goes when the spec stops asking for it), kept in the
    pool's status bounded (`to_status`, operator/crd.py), so a restarted operator carries on. `busy`: engines
    whose calls from an earlier tick are still out (this process only: a restarted operator has none), not
    called again until those end. `asked`: the adapters the spec declared at the last `update` (this process
    only), to see a name declared again."""

    refused: dict[Life, set[AdapterAction]] = field(default_factory=dict)
    managed: set[str] = field(default_factory=set)
    busy: set[Life] = field(default_factory=set)
    asked: dict[str, str] | None = None

    def update(self, lives: Collection[Life], declared: Mapping[str, str]) -> None:
        """Before a tick, under the spec's `declared` adapters: manage them; forget engines that are gone or
        restarted (a replacement starts with a clean slate; an engine only not Ready for a moment keeps what it
        refused) and the refusals the spec no longer asks for, so an adapter removed and added back is tried
        once more: a load of a name the spec no longer declares with that path; an unload of a name no longer
        managed, or declared again or otherwise (its entry changed since the last update)."""
        self.managed |= declared.keys()
        changed = set() if self.asked is None else \
            {n for n in self.asked.keys() | declared.keys() if self.asked.get(n) != declared.get(n)}
        self.asked = dict(declared)

        def still_asked(action: AdapterAction) -> bool:
            if action.kind == LOAD:
                return same_directory(declared.get(action.name), action.path)
            return action.name in self.managed and action.name not in changed

        kept = {life: {a for a in actions if still_asked(a)} for life, actions in self.refused.items()
                if life in lives}
        self.refused = {life: actions for life, actions in kept.items() if actions}

    def to_status(self) -> dict[str, Any]:
        """`status.adapters`: the managed names and each refusal, sorted (an unchanged memory is an unchanged
        status), within the CRD's bounds: past MAX_MANAGED_ADAPTERS the dropped names last in order are left out
        (a restarted operator leaves them loaded), past MAX_ADAPTER_REFUSALS the refusals of the engines last in
        order (a restarted operator tries each of those once more, one more Event, and remembers it again). This
        process keeps them all: the cut never makes it retry."""
        refused = [{"pod": life[0], "podUid": life[1], "restarts": life[2], "action": a.kind, "adapter": a.name,
                    **({"path": a.path} if a.path is not None else {})}
                   for life in sorted(self.refused) for a in sorted(self.refused[life], key=_action_key)]
        declared = sorted(self.asked or {})
        managed = declared + sorted(self.managed - set(declared))
        return {"managed": sorted(managed[:MAX_MANAGED_ADAPTERS]), "refused": refused[:MAX_ADAPTER_REFUSALS]}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> AdapterMemory:
        """The memory a pool's status kept (what `to_status` wrote); entries of another shape (a status edited by
        hand) are left out."""
        kept = status.get("adapters")
        if not isinstance(kept, Mapping):
            return cls()
        memory = cls(managed={n for n in kept.get("managed") or [] if isinstance(n, str)})
        for entry in kept.get("refused") or []:
            if not isinstance(entry, Mapping):
                continue
            kind, name, path = entry.get("action"), entry.get("adapter"), entry.get("path")
            pod, uid, restarts = entry.get("pod"), entry.get("podUid", ""), entry.get("restarts", 0)
            if kind in LORA_ACTIONS and isinstance(name, str) and isinstance(pod, str) and isinstance(uid, str) \
                    and isinstance(restarts, int) and (path is None) == (kind == UNLOAD) \
                    and (path is None or isinstance(path, str)):
                memory.refused.setdefault((pod, uid, restarts), set()).add(AdapterAction(kind, name, path))
        return memory

    def learn(self, syncs: Sequence[EngineSync], declared: Mapping[str, str], lives: Collection[Life]) -> None:
        """After a tick: remember its refusals; forget a dropped name once every engine alive was read and none
        serves it any more."""
        for sync in syncs:
            for result in sync.results:
                if result.outcome == REFUSED:
                    self.refused.setdefault(sync.pod.life, set()).add(result.action)
        read = {s.pod.life for s in syncs if s.error is None}
        if set(lives) <= read:
            still = set().union(*(s.serves_after() for s in syncs))
            self.managed = {n for n in self.managed if n in declared or n in still}


def _action_key(action: AdapterAction) -> tuple[str, str, str]:
    return action.kind, action.name, action.path or ""


# ---- carrying it out ---------------------------------------------------------------------------------------------

Reader = Callable[[str, float], dict[str, str]]  # engine URL, timeout -> the adapters it serves
Caller = Callable[[str, AdapterAction, float], tuple[int | None, str]]  # URL, action, timeout -> (status, message)
Clock = Callable[[], float]


def http_served(url: str, timeout: float = MODELS_TIMEOUT_SECONDS, auth: httpx.Auth | None = None) -> dict[str, str]:
    """The adapters the engine at `url` serves (`auth`: the pool's internal token, operator/engines.py)."""
    reply = pod_client().get(url + MODELS_PATH, timeout=timeout, auth=auth)
    reply.raise_for_status()
    return served_adapters(reply.json())


def http_act(url: str, action: AdapterAction, timeout: float = ACTION_TIMEOUT_SECONDS,
             auth: httpx.Auth | None = None) -> tuple[int | None, str]:
    """POST the action (with the pool's internal token, `auth`); the status and the engine's error message (None
    and the reason when no answer came)."""
    path, body = (LOAD_LORA_PATH, {"lora_name": action.name, "lora_path": action.path,
                                   "load_inplace": action.inplace}) if action.kind == LOAD \
        else (UNLOAD_LORA_PATH, {"lora_name": action.name})
    try:
        reply = pod_client().post(url + path, json=body, timeout=timeout, auth=auth)
    except httpx.HTTPError as exc:
        return None, f"no answer: {exc!r}"
    try:
        answer = reply.json()
    except ValueError:
        answer = None
    error = answer.get("error") if isinstance(answer, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    return reply.status_code, str(message or reply.text[:300])


def sync_engine(pod: EnginePod, declared: Mapping[str, str], refused: Collection[AdapterAction] = (),
                read: Reader = http_served, act: Caller = http_act, managed: Collection[str] | None = None,
                deadline: float = float("inf"), clock: Clock = time.monotonic) -> EngineSync:
    """Plan and carry out one engine's actions, each call's timeout cut to what is left before `deadline`; an
    action with no time left is deferred."""
    left = deadline - clock()
    if left <= 0:
        return EngineSync(pod, error="not reached: the tick's adapter budget was spent first (next tick)")
    try:
        served = read(pod.url, min(MODELS_TIMEOUT_SECONDS, left))
    except (httpx.HTTPError, ValueError) as exc:
        return EngineSync(pod, error=f"could not read its adapters: {exc!r}")
    plan = plan_adapters(declared, served, refused, managed)
    results: list[ActionResult] = []
    deferred: list[AdapterAction] = []
    for action in plan.actions:
        left = deadline - clock()
        if left <= 0:
            deferred.append(action)
        else:
            results.append(outcome_of(action, *act(pod.url, action, min(ACTION_TIMEOUT_SECONDS, left))))
    return EngineSync(pod, tuple(results), plan.held, served=dict(served), deferred=tuple(deferred))


def sync_pool(pods: Sequence[EnginePod], declared: Mapping[str, str], memory: AdapterMemory,
              read: Reader = http_served, act: Caller = http_act, alive: Collection[Life] | None = None,
              budget: float = ADAPTER_BUDGET_SECONDS, clock: Clock = time.monotonic) -> list[EngineSync]:
    """Sync every engine in `pods` (the ready ones), SYNC_WORKERS at a time, within `budget` seconds in all, and
    return in the order given; then `memory.learn` from it, forgetting engines not `alive` (default: not among
    `pods`). An engine still busy with an earlier tick's calls, or not finished within the budget, is Pending
    (its calls run out on their own timeouts; the next tick reads what they did). Only names the spec declares
    or declared before are unloaded; a pool that never declared an adapter is not read at all."""
    lives = {p.life for p in pods} if alive is None else set(alive)
    memory.update(lives, declared)
    if not pods or not memory.managed:
        return []
    deadline = clock() + budget
    managed = frozenset(memory.managed)
    idle = [p for p in pods if p.life not in memory.busy]
    memory.busy |= {p.life for p in idle}

    def one(pod: EnginePod) -> EngineSync:
        try:
            return sync_engine(pod, declared, memory.refused.get(pod.life, ()), read, act, managed, deadline, clock)
        finally:
            memory.busy.discard(pod.life)

    workers = ThreadPoolExecutor(max_workers=max(1, min(SYNC_WORKERS, len(idle))), thread_name_prefix="lora")
    futures = {p.life: workers.submit(one, p) for p in idle}
    wait(futures.values(), timeout=max(0.0, deadline - clock()) + BUDGET_GRACE_SECONDS)
    workers.shutdown(wait=False, cancel_futures=True)  # a call still out ends on its own timeout
    syncs: list[EngineSync] = []
    for pod in pods:
        future = futures.get(pod.life)
        if future is None:
            syncs.append(EngineSync(pod, error="its adapter calls from an earlier tick are still out (next tick)"))
        elif future.cancelled() or not future.done():
            if future.cancelled():
                memory.busy.discard(pod.life)
            syncs.append(EngineSync(pod, error=f"not done within the tick's adapter budget ({budget:g} s; next "
                                               f"tick)"))
        else:
            syncs.append(future.result())
    memory.learn(syncs, declared, lives)
    return syncs


# ---- one tick of a pool, for both operators ----------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterTick:
    """A pool's adapter sync in one tick: each engine's sync, how the engines stand (`summary`; None when the
    engine settings list the adapters themselves: nothing is synced), and the pool's AdaptersLoaded condition to
    set (`status`: the summary, or None for a pool that declares no adapters and had nothing to do)."""

    syncs: tuple[EngineSync, ...] = ()
    summary: AdapterStatus | None = None
    status: AdapterStatus | None = None

    def results(self) -> list[tuple[EnginePod, ActionResult]]:
        """Every action taken, with its engine, in the order taken."""
        return [(s.pod, r) for s in self.syncs for r in s.results]

    @property
    def lines(self) -> list[str]:
        """One per action taken: which engine, what, and how it went."""
        return [f"{pod.name}: {r.message}" for pod, r in self.results()]


def adapter_tick(declared: Mapping[str, str] | None, serving: Sequence[EnginePod], memory: AdapterMemory,
                 alive: Collection[Life], budget: float = ADAPTER_BUDGET_SECONDS, read: Reader = http_served,
                 act: Caller = http_act) -> AdapterTick:
    """Keep the `serving` engines' adapters equal to `declared` (the spec's, desired.engine_adapters; None: the
    engine settings list them, left as the engines started), within `budget`, remembering in `memory` (`sync_pool`),
    and say whether the pool gets an AdaptersLoaded condition: the cluster operator's timer and `kvmesh up -f`'s
    tick both call this, and keep only their I/O (pods, Events, status, lines printed) at their edges."""
    if declared is None:
        return AdapterTick()
    syncs = sync_pool(serving, declared, memory, read, act, alive=alive, budget=budget)
    summary = summarize(syncs, declared)
    acted = any(s.results or s.held or s.deferred for s in syncs)
    return AdapterTick(tuple(syncs), summary, summary if declared or acted else None)
