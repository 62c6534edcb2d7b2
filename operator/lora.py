"""The LoRA adapters a pool declares, kept loaded in its running engines without restarting them.

Each tick the operator asks every ready engine what it serves (GET /v1/models: the base model's card, then one
card per adapter with its directory as `root`), plans the difference against `spec.model.loraAdapters`
(`plan_adapters`, pure), and carries it out with the engine's own endpoints (POST /v1/unload_lora_adapter, then
/v1/load_lora_adapter). Unloads go first so they free slots for the loads. A changed path for a known name is an
unload then a load; an engine refuses different weights under a name it served before (400: its cached blocks
are hashed by name), which the user must fix with a new name. So a refused action (a 4xx other than 409) is
remembered per engine and not tried again while the spec asks for the same thing: one Event, no retry storm.
A busy or full engine (409) or one that does not answer is simply planned again at the next tick.

Kopf-free: the cluster operator (operator/handlers.py) calls `sync_pool` from its scaling timer.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx

from kvmesh.engine.protocol import LOAD_LORA_PATH, LORA_ACTIONS, LORA_OUTCOMES, MODELS_PATH, UNLOAD_LORA_PATH
from kvmesh.operator.crd import Pool

LOAD, UNLOAD = LORA_ACTIONS
OK, RETRY, REFUSED = LORA_OUTCOMES
MODELS_TIMEOUT_SECONDS = 2.0
# A load reads the adapter's directory and takes a slot at the next step boundary; a timed-out load may still
# complete, and the next tick sees it in /v1/models.
ACTION_TIMEOUT_SECONDS = 30.0
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

    def __post_init__(self) -> None:
        assert self.kind in LORA_ACTIONS and (self.path is None) == (self.kind == UNLOAD), self

    def describe(self) -> str:
        return f"load LoRA adapter {self.name!r} from {self.path}" if self.kind == LOAD else \
            f"unload LoRA adapter {self.name!r}"


@dataclass(frozen=True)
class AdapterPlan:
    """One engine's actions, in the order to take them, and those held back: refused by it before."""

    actions: tuple[AdapterAction, ...] = ()
    held: tuple[AdapterAction, ...] = ()


def served_adapters(models: Any) -> dict[str, str]:
    """An engine's GET /v1/models answer -> the adapters it serves, name -> directory (the cards with a parent:
    the base model's has none). Raises ValueError for an answer of another shape."""
    cards = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(cards, list) or not all(isinstance(c, Mapping) and isinstance(c.get("id"), str)
                                              for c in cards):
        raise ValueError(f"not a /v1/models answer: {str(models)[:200]}")
    adapters = [c for c in cards if c.get("parent")]
    if not all(isinstance(c.get("root"), str) for c in adapters):
        raise ValueError(f"an adapter card without its directory (root): {str(adapters)[:200]}")
    return {c["id"]: c["root"] for c in adapters}


def same_directory(a: str | None, b: str | None) -> bool:
    """Whether two spellings name one directory (`/adapters/sql/` and `/adapters/./sql`): the engine reports the
    path it opened, normalized."""
    return a is not None and b is not None and posixpath.normpath(a) == posixpath.normpath(b)


def plan_adapters(declared: Mapping[str, str], served: Mapping[str, str],
                  refused: Collection[AdapterAction] = (), managed: Collection[str] | None = None) -> AdapterPlan:
    """What one engine must do to serve `declared` (name -> directory) given what it `served`: unload the names it
    manages (`managed`: default every name) that are no longer declared or declared with another directory, then
    load the missing ones, each by name. An adapter someone loaded by hand under a name the operator never managed
    stays. An action this engine `refused` before is held back (the spec must change for it to be tried again)."""
    managed = served.keys() if managed is None else managed
    unloads = [AdapterAction(UNLOAD, n) for n in sorted(served)
               if n in managed and not same_directory(declared.get(n), served[n])]
    loads = [AdapterAction(LOAD, n, declared[n]) for n in sorted(declared)
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
    (every slot taken, or the adapter still has requests), a 5xx or no answer is retried at the next tick; any
    other 4xx is the spec's problem, refused for good."""
    if status is not None and (HTTPStatus.OK <= status < HTTPStatus.MULTIPLE_CHOICES or
                               (action.kind == UNLOAD and status == HTTPStatus.NOT_FOUND)):
        return ActionResult(action, OK, action.describe())
    if status is None or status == HTTPStatus.CONFLICT or status >= HTTPStatus.INTERNAL_SERVER_ERROR:
        return ActionResult(action, RETRY, f"{action.describe()}: {message} (retried next tick)")
    return ActionResult(action, REFUSED, f"{action.describe()} was refused ({status}): {message}; it is not "
                                         f"retried until spec.model.loraAdapters changes it (new weights need a "
                                         f"new name)")


@dataclass(frozen=True)
class EnginePod:
    name: str
    role: str
    url: str  # http://ip:port of its engine
    restarts: int = 0  # its containers' restarts: a restarted engine starts a new life, with nothing refused yet

    @property
    def life(self) -> tuple[str, int]:
        return self.name, self.restarts


@dataclass(frozen=True)
class EngineSync:
    """One engine's tick: what it served, what was done and how it went, what was held back; `error` when its
    /v1/models could not be read (nothing was done)."""

    pod: EnginePod
    results: tuple[ActionResult, ...] = ()
    held: tuple[AdapterAction, ...] = ()
    error: str | None = None


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
        [f"{s.pod.name}: {r.message}" for s in syncs for r in s.results if r.outcome == RETRY]
    if pending:
        return AdapterStatus(False, "Pending", "; ".join(pending))
    if declared and not syncs:
        return AdapterStatus(False, "Pending", "no ready engine to load them into")
    return AdapterStatus(True, "Loaded", f"{len(declared)} adapters on {len(syncs)} ready engines")


# ---- carrying it out ---------------------------------------------------------------------------------------------


@dataclass
class AdapterMemory:
    """Per engine (a pod's life: its name and restarts), the actions it refused: not tried again on it (the Event
    was posted once)."""

    refused: dict[tuple[str, int], set[AdapterAction]] = field(default_factory=dict)
    declared_before: set[str] = field(default_factory=set)  # every name the spec has declared: the ones it manages

    def keep_only(self, lives: Collection[tuple[str, int]]) -> None:
        """Forget engines that are gone or restarted (a replacement starts with a clean slate); an engine that is
        only not Ready for a moment keeps what it refused."""
        self.refused = {p: a for p, a in self.refused.items() if p in lives}


Reader = Callable[[str], dict[str, str]]  # engine URL -> the adapters it serves
Caller = Callable[[str, AdapterAction], tuple[int | None, str]]  # engine URL, action -> (status or None, message)


def http_served(url: str) -> dict[str, str]:
    reply = httpx.get(url + MODELS_PATH, timeout=MODELS_TIMEOUT_SECONDS)
    reply.raise_for_status()
    return served_adapters(reply.json())


def http_act(url: str, action: AdapterAction) -> tuple[int | None, str]:
    """POST the action; the status and the engine's error message (None and the reason when no answer came)."""
    path, body = (LOAD_LORA_PATH, {"lora_name": action.name, "lora_path": action.path}) if action.kind == LOAD \
        else (UNLOAD_LORA_PATH, {"lora_name": action.name})
    try:
        reply = httpx.post(url + path, json=body, timeout=ACTION_TIMEOUT_SECONDS)
    except httpx.HTTPError as exc:
        return None, f"no answer: {exc!r}"
    try:
        answer = reply.json()
    except ValueError:
        answer = None
    error = answer.get("error") if isinstance(answer, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    return reply.status_code, str(message or reply.text[:300])


def sync_engine(pod: EnginePod, declared: Mapping[str, str], memory: AdapterMemory, read: Reader = http_served,
                act: Caller = http_act, managed: Collection[str] | None = None) -> EngineSync:
    """Plan and carry out one engine's actions; a refusal is remembered. A name whose unload failed is not loaded
    (the engine would refuse it as already loaded)."""
    try:
        served = read(pod.url)
    except (httpx.HTTPError, ValueError) as exc:
        return EngineSync(pod, error=f"could not read its adapters: {exc!r}")
    plan = plan_adapters(declared, served, memory.refused.get(pod.life, set()), managed)
    results: list[ActionResult] = []
    still_loaded: set[str] = set()
    for action in plan.actions:
        if action.kind == LOAD and action.name in still_loaded:
            continue
        result = outcome_of(action, *act(pod.url, action))
        if result.outcome == REFUSED:
            memory.refused.setdefault(pod.life, set()).add(action)
        if action.kind == UNLOAD and result.outcome != OK:
            still_loaded.add(action.name)
        results.append(result)
    return EngineSync(pod, tuple(results), plan.held)


def sync_pool(pods: Sequence[EnginePod], declared: Mapping[str, str], memory: AdapterMemory,
              read: Reader = http_served, act: Caller = http_act,
              alive: Collection[tuple[str, int]] | None = None) -> list[EngineSync]:
    """Sync every engine in `pods` (the ready ones), in parallel, in the order given; forget engines not `alive`
    (default: not among `pods`). Only names the spec declares or declared before are unloaded; a pool that never
    declared an adapter is not read at all."""
    memory.keep_only({p.life for p in pods} if alive is None else alive)
    memory.declared_before |= declared.keys()
    if not pods or not memory.declared_before:
        return []
    managed = set(memory.declared_before)
    with ThreadPoolExecutor(max_workers=min(SYNC_WORKERS, len(pods)), thread_name_prefix="lora") as workers:
        return list(workers.map(lambda p: sync_engine(p, declared, memory, read, act, managed), pods))
