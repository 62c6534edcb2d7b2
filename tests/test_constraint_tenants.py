"""Tenants share the grammar checkers (engine/constraint.py) but nothing else: a verdict one tenant's request left
is never another's (timing a check told a tenant which schemas the others sent), a tenant whose checks hold the
checkers leaves the next free one to a tenant waiting for its first, and no checker free in time is a retryable
overload (429 at the router, 503 at an engine, with Retry-After), not a 400. Checks are counted, never timed."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from fastapi.testclient import TestClient

from kvmesh.engine import constraint
from kvmesh.engine.constraint import Constraint, check
from kvmesh.engine.internal_token import InternalToken
from kvmesh.engine.model.token_cache import CACHE_SCOPE
from kvmesh.engine.server import EngineHolder, create_app
from kvmesh.router.app import build_router, create_router_app
from kvmesh.router.auth import hash_key
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .waiting import wait_for

KEYS = {"acme": "sk-acme-214", "globex": "sk-globex-214"}
SCHEMA = {"type": "object", "properties": {"plan": {"type": "string", "pattern": "^[a-z]{3,9}$"}}}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Every check that reached a checker (the verdict was not remembered), with no verdict remembered before."""
    calls: list[tuple[Any, ...]] = []
    real = constraint._CHECKERS.problem

    def problem(*args: Any) -> str | None:
        calls.append(args)
        return real(*args)

    constraint._problem.cache_clear()
    monkeypatch.setattr(constraint._CHECKERS, "problem", problem)
    yield calls
    constraint._problem.cache_clear()


def chat(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A chat request refused after its validation (max_tokens -1): only its grammar's check runs."""
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, **extra}


def test_a_verdict_is_remembered_for_its_own_scope_only(counted: list[tuple[Any, ...]]) -> None:
    for scope in ("acme", "acme", "globex", "acme", "globex"):
        CACHE_SCOPE.set(scope)
        check(Constraint("json_schema", SCHEMA, "response_format"))
    assert len(counted) == 2  # one check for each tenant, each tenant's repeats remembered


def test_the_router_remembers_verdicts_per_tenant(tiny_dir: Path, tmp_path: Path,
                                                  counted: list[tuple[Any, ...]]) -> None:
    """Through the router's edges, the completions' and /tokenize's (a tool's parameters are a schema too)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": t, "key_sha256": hash_key(k)} for t, k in KEYS.items()]}))
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA | {"title": "tool"}}}
    config = RouterConfig(pods=[], api_keys_file=str(keys))
    with TestClient(create_router_app(build_router(config, tiny_dir))) as router:
        for tenant in ("globex", "acme", "acme"):
            auth = {"authorization": f"Bearer {KEYS[tenant]}"}
            assert router.post("/v1/chat/completions", json=chat(SCHEMA), headers=auth).status_code == 400
            tokenized = router.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": [tool]}, headers=auth)
            assert tokenized.status_code == 200, tokenized.text
    assert len(counted) == 4  # the schema and the tool's, each once for globex and once for acme


class HeldChild:
    """A checking child whose verdicts the test hands out: each check holds its checker until its spec's gate
    opens, and says which spec it checks as it starts."""

    asked: ClassVar[list[str]] = []
    gates: ClassVar[dict[str, threading.Event]] = {}
    threads: ClassVar[list[threading.Thread]] = []  # the checks' (regex_check's)

    def ask(self, kind: str, spec_json: str, seconds: float) -> str | None:
        self.asked.append(spec_json)
        self.gates.setdefault(spec_json, threading.Event()).wait()
        return None

    def kill(self) -> None:
        pass


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[HeldChild]]:
    """Fresh checkers whose children are HeldChild; every gate opened at the end, and every check ended."""
    monkeypatch.setattr(HeldChild, "asked", [])
    monkeypatch.setattr(HeldChild, "gates", {})
    monkeypatch.setattr(HeldChild, "threads", [])
    monkeypatch.setattr(constraint, "_Child", HeldChild)
    monkeypatch.setattr(constraint, "_CHECKERS", constraint._Checkers())
    constraint._problem.cache_clear()
    try:
        yield HeldChild
    finally:
        for gate in list(HeldChild.gates.values()):
            gate.set()
        for thread in HeldChild.threads:
            thread.join(timeout=30)
        constraint._problem.cache_clear()


def regex_check(scope: str, regex: str, outcomes: dict[str, object]) -> threading.Thread:
    """`regex` checked in `scope` in a thread of its own; its outcome (None, or the exception) in `outcomes`."""
    def run() -> None:
        CACHE_SCOPE.set(scope)
        try:
            check(Constraint("regex", regex, "x"))
            outcomes[regex] = None
        except Exception as exc:  # the outcome is what the test looks at
            outcomes[regex] = exc
    thread = threading.Thread(target=run, daemon=True)
    HeldChild.gates[f'"{regex}"'] = threading.Event()
    HeldChild.threads.append(thread)
    thread.start()
    return thread


def waits_for_a_checker(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked waiting for a checker (on a condition, before any child was asked)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is threading.Condition.wait.__code__:
            return True
        frame = frame.f_back
    return False


def test_a_tenant_waiting_for_its_first_checker_goes_before_another_s_queue(held: type[HeldChild]) -> None:
    """acme's checks hold both checkers and two more of its checks wait; globex's check, arriving last, gets the
    next checker freed (on the old semaphore it waited behind acme's queue, and with acme looping, past its wait)."""
    outcomes: dict[str, object] = {}
    threads = [regex_check("acme", "a1", outcomes), regex_check("acme", "a2", outcomes)]
    wait_for(lambda: len(held.asked) == constraint.CHECK_WORKERS)
    for scope, regex in (("acme", "a3"), ("acme", "a4"), ("globex", "g1")):  # queued in this order
        threads.append(regex_check(scope, regex, outcomes))
        wait_for(lambda: waits_for_a_checker(threads[-1]))
    assert held.asked == ['"a1"', '"a2"']
    held.gates['"a1"'].set()
    wait_for(lambda: len(held.asked) == 3)
    assert held.asked[2] == '"g1"'
    for gate in held.gates.values():
        gate.set()
    for thread in threads:
        thread.join(timeout=30)
    assert outcomes == dict.fromkeys(("a1", "a2", "a3", "a4", "g1"))


def hold_every_checker(held: type[HeldChild], outcomes: dict[str, object]) -> None:
    """Another tenant's checks on every checker, until the fixture opens their gates."""
    for i in range(constraint.CHECK_WORKERS):
        regex_check("initech", f"held{i}", outcomes)
    wait_for(lambda: len(held.asked) == constraint.CHECK_WORKERS)


def test_no_checker_free_is_the_router_s_retryable_429(held: type[HeldChild], tiny_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes: dict[str, object] = {}
    hold_every_checker(held, outcomes)
    monkeypatch.setattr(constraint, "CHECK_QUEUE_SECONDS", 0.05)
    with TestClient(create_router_app(build_router(RouterConfig(pods=[]), tiny_dir))) as router:
        reply = router.post("/v1/chat/completions", json=chat(SCHEMA) | {"max_tokens": 1})
        tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
        tokenized = router.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    for answer in (reply, tokenized):
        assert answer.status_code == 429, answer.text
        assert answer.headers["retry-after"] == str(constraint.ChecksBusy.retry_after_seconds)
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
        assert "all busy" in error["message"]


@pytest.fixture(scope="module")
def engine_app(tiny_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(EngineHolder(make_engine(tiny_dir)), token=InternalToken(None))) as client:
        yield client


def test_an_engine_remembers_verdicts_per_cache_salt(engine_app: TestClient, counted: list[tuple[Any, ...]]) -> None:
    for salt in ("salt-of-globex", "salt-of-acme", "salt-of-acme", None):
        body = chat(SCHEMA) | ({"cache_salt": salt} if salt else {})
        assert engine_app.post("/v1/chat/completions", json=body).status_code == 400
    assert len(counted) == 3  # globex's salt, acme's, none


def test_no_checker_free_is_the_engine_s_retryable_503(engine_app: TestClient, held: type[HeldChild],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes: dict[str, object] = {}
    hold_every_checker(held, outcomes)
    monkeypatch.setattr(constraint, "CHECK_QUEUE_SECONDS", 0.05)
    reply = engine_app.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": "s",
                                                     "structured_outputs": {"regex": "[a-z]+"}})
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] == str(constraint.ChecksBusy.retry_after_seconds)
    assert "all busy" in reply.json()["error"]["message"]


def test_an_engine_checks_a_grammar_off_its_event_loop(engine_app: TestClient, held: type[HeldChild]) -> None:
    """An engine's request validation waits for a checker (up to its deadline, or the queue's 8 s): on the event
    loop, that wait stalled every stream and every probe of the pod. With a check held, /health still answers."""
    regex = "[a-z]{2,5}"
    held.gates[f'"{regex}"'] = threading.Event()
    replies: dict[str, Any] = {}

    def completion() -> None:
        replies["completion"] = engine_app.post("/v1/completions", json={  # refused once checked (max_tokens)
            "prompt": "x", "max_tokens": -1, "structured_outputs": {"regex": regex}})

    def health() -> None:
        replies["health"] = engine_app.get("/health")

    checking = threading.Thread(target=completion, daemon=True)
    checking.start()
    wait_for(lambda: f'"{regex}"' in held.asked)  # the check holds its checker now
    probe = threading.Thread(target=health, daemon=True)
    probe.start()
    probe.join(timeout=30)  # a bound on a hang, not a timing: the loop answers at once or never
    answered_while_checking = "health" in replies
    held.gates[f'"{regex}"'].set()
    checking.join(timeout=30)
    probe.join(timeout=30)
    assert answered_while_checking, "the event loop was held by the grammar check"
    assert replies["health"].status_code == 200
    assert replies["completion"].status_code == 400 and "max_tokens" in replies["completion"].text
