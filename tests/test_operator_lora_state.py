"""The adapter sync's memory survives an operator restart (it lives in the pool's status), stays bounded, and a
tick's adapter calls keep to one budget: the status round trip and the pruning (pure), a hanging engine against
a real one (the tick returns within its budget, the real engine still gets its adapter), and two kopf runs in a row
against kmock's emulator, the pod's IP a real in-process engine's: an adapter dropped from the spec while no
operator ran is unloaded by the next one, and a refusal the first one announced is neither retried nor announced
again."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import kopf
import pytest

from kvmesh.engine.protocol import OperatorMetric
from kvmesh.operator.crd import MAX_ADAPTER_REFUSALS, MAX_MANAGED_ADAPTERS, PLURAL
from kvmesh.operator.handlers import OperatorConfig, register
from kvmesh.operator.lora import (
    LOAD,
    OK,
    REFUSED,
    RETRY,
    UNLOAD,
    ActionResult,
    AdapterAction,
    AdapterMemory,
    EnginePod,
    EngineSync,
    served_adapters,
    summarize,
    sync_pool,
)
from kvmesh.router.discovery import kube_configuration

from .conftest import make_engine
from .engines import serve_engine
from .test_lora import ATTN_QV, write_adapter
from .test_operator import (
    NS,
    POOLS,
    Cluster,
    Env,
    conditions,
    eventually,
    pod_body,
    pool_body,
    run,
    serve_operator_resources,
    write_kubeconfig,
)
from .test_operator_lora import served_by

# ---- the memory in status (pure) -------------------------------------------------------------------------------


def test_the_memory_round_trips_through_the_status_and_skips_what_it_did_not_write() -> None:
    memory = AdapterMemory(refused={("chat-both-x", "uid-1", 2): {AdapterAction(LOAD, "b", "/v2"),
                                                                  AdapterAction(UNLOAD, "z")}},
                           managed={"a", "b", "z"})
    status = memory.to_status()
    assert status["managed"] == ["a", "b", "z"]
    assert status["refused"][0] == {"pod": "chat-both-x", "podUid": "uid-1", "restarts": 2, "action": "load",
                                    "adapter": "b", "path": "/v2"}
    back = AdapterMemory.from_status({"adapters": status})
    assert (back.refused, back.managed) == (memory.refused, memory.managed)
    hand_edited = {"adapters": {"managed": ["a", 7], "refused": [
        {"pod": "p", "action": "load", "adapter": "b"},  # a load without its path
        {"pod": "p", "action": "delete", "adapter": "b"}, "junk",
        {"pod": "p", "action": "unload", "adapter": "c"}]}}
    back = AdapterMemory.from_status(hand_edited)
    assert back.managed == {"a"} and back.refused == {("p", "", 0): {AdapterAction(UNLOAD, "c")}}
    assert AdapterMemory.from_status({}).refused == {}


def sync(pod: EnginePod, served: dict[str, str], *results: ActionResult, error: str | None = None) -> EngineSync:
    return EngineSync(pod, tuple(results), served=served, error=error)


def test_a_dropped_name_is_forgotten_only_once_every_engine_alive_was_read_without_it() -> None:
    a, b = EnginePod("a", "both", "http://a", uid="ua"), EnginePod("b", "both", "http://b", uid="ub")
    memory = AdapterMemory(managed={"keep", "gone"})
    declared = {"keep": "/k"}
    # b is alive but not read (not Ready): it may still serve "gone"
    memory.learn([sync(a, {"keep": "/k"})], declared, {a.life, b.life})
    assert memory.managed == {"keep", "gone"}
    # both read, but b's unload failed: still served
    busy = ActionResult(AdapterAction(UNLOAD, "gone"), "retry", "409")
    memory.learn([sync(a, {"keep": "/k"}), sync(b, {"gone": "/g"}, busy)], declared, {a.life, b.life})
    assert memory.managed == {"keep", "gone"}
    # both read, b's unload done: forgotten (its status entry goes with it)
    done = ActionResult(AdapterAction(UNLOAD, "gone"), OK, "unloaded")
    memory.learn([sync(a, {"keep": "/k"}), sync(b, {"gone": "/g"}, done)], declared, {a.life, b.life})
    assert memory.managed == {"keep"}


def test_past_the_status_bound_refusals_are_neither_retried_nor_announced_again_and_the_status_stays_bounded(
) -> None:
    # 20 engines x 16 adapters on broken storage: 320 refusals, more than the status holds
    pods = [EnginePod(f"engine-{i:02d}", "both", f"http://p{i}", uid=f"u{i}") for i in range(20)]
    declared = {f"a{j:02d}": f"/broken/{j}" for j in range(16)}
    calls: list[str] = []

    def act(url: str, action: AdapterAction, timeout: float) -> tuple[int | None, str]:
        calls.append(url)
        return 400, "no adapter_config.json"

    memory = AdapterMemory()
    first = sync_pool(pods, declared, memory, read=lambda url, timeout: {}, act=act, budget=60)
    assert sum(r.outcome == REFUSED for s in first for r in s.results) == len(calls) == 320
    for _ in range(3):  # the next ticks: all held, no call, no new refusal (no Event)
        calls.clear()
        again = sync_pool(pods, declared, memory, read=lambda url, timeout: {}, act=act, budget=60)
        assert calls == [] and sum(len(s.held) for s in again) == 320
    assert len(memory.to_status()["refused"]) == MAX_ADAPTER_REFUSALS
    names = AdapterMemory(managed={f"old-{i}" for i in range(MAX_MANAGED_ADAPTERS + 5)} | set(declared),
                          asked=declared).to_status()["managed"]
    assert len(names) == MAX_MANAGED_ADAPTERS and set(declared) <= set(names)  # the declared ones are kept


def test_a_refusal_goes_when_the_spec_stops_asking_for_it_so_an_adapter_added_back_is_tried_once_more() -> None:
    pod = EnginePod("engine-0", "both", "http://p0", uid="u0")
    served: dict[str, str] = {}
    uploaded, loads = False, []

    def act(url: str, action: AdapterAction, timeout: float) -> tuple[int | None, str]:
        if action.kind == UNLOAD:
            served.pop(action.name, None)
            return 200, "ok"
        loads.append(action.name)
        if not uploaded:
            return 400, "no adapter_config.json"
        served[action.name] = action.path or ""
        return 200, "ok"

    def tick(declared: dict[str, str]) -> str:
        return summarize(sync_pool([pod], declared, memory, read=lambda url, timeout: dict(served), act=act),
                         declared).reason

    memory = AdapterMemory()
    assert tick({"sql": "/a/sql"}) == "Refused" and tick({"sql": "/a/sql"}) == "Refused" and loads == ["sql"]
    uploaded = True  # the user uploads the files, removes the entry and adds it back
    assert tick({}) == "Loaded" and memory.to_status()["refused"] == []
    assert tick({"sql": "/a/sql"}) == "Loaded" and served == {"sql": "/a/sql"} and loads == ["sql", "sql"]


def test_an_unload_refusal_holds_while_the_spec_stays_and_goes_when_the_name_is_declared_again() -> None:
    pod = EnginePod("engine-0", "both", "http://p0", uid="u0")
    memory = AdapterMemory(managed={"x"})
    unloads: list[str] = []

    def act(url: str, action: AdapterAction, timeout: float) -> tuple[int | None, str]:
        unloads.append(action.name)
        assert action.kind == UNLOAD, action
        return 400, "cannot unload"

    def tick(declared: dict[str, str]) -> list[EngineSync]:
        return sync_pool([pod], declared, memory, read=lambda url, timeout: {"x": "/old"}, act=act)

    tick({})  # dropped from the spec: the unload is refused...
    tick({})
    assert unloads == ["x"] and memory.refused == {pod.life: {AdapterAction(UNLOAD, "x")}}  # ...and not retried
    tick({"x": "/old"})  # declared again with what it serves: nothing to unload, the refusal is gone
    assert unloads == ["x"] and memory.refused == {}
    tick({})  # dropped again: the spec changed, tried once more
    assert unloads == ["x", "x"]


# ---- the budget: a hanging engine next to a real one -------------------------------------------------------------


@contextlib.contextmanager
def hanging_engine() -> Iterator[tuple[str, list[str]]]:
    """Fault injection, not a mock: a loopback HTTP server that answers GET /v1/models (no adapters) and then
    never answers the POST that follows, as an engine stuck reading an adapter from slow storage. Yields its URL
    and the request lines it received."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            request = conn.recv(65536).decode(errors="replace")
            seen.append(request.split("\r\n", 1)[0])
            if request.startswith("GET"):
                body = b'{"object": "list", "data": [{"id": "base", "root": "base", "parent": null}]}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                conn.close()
            else:
                held.append(conn)  # never answered

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("state-loras")
    return {name: str(write_adapter(root / name, seed=seed, rank=4, targets=ATTN_QV, layers=1))
            for name, seed in (("a", 21), ("b", 22))}


@pytest.fixture
def engine_url(tiny_dir: Path, weights: dict[str, str]) -> Iterator[str]:
    engine = make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, max_lora_rank=8, lora_modules={"a": weights["a"]})
    with serve_engine(engine) as url:
        yield url


@pytest.mark.slow
@pytest.mark.timeout(28)  # a tick that waited for the hanging load's own 30 s timeout would fail here (the budget: 6 s)
def test_a_hanging_engine_holds_the_tick_no_longer_than_its_budget_and_the_others_get_their_adapters(
        engine_url: str, weights: dict[str, str]) -> None:
    declared = {"a": weights["a"], "b": weights["b"]}
    memory = AdapterMemory()
    with hanging_engine() as (stuck_url, seen):
        stuck, real = EnginePod("stuck", "both", stuck_url, uid="u1"), EnginePod("real", "both", engine_url, uid="u2")
        syncs = sync_pool([stuck, real], declared, memory, budget=6.0)
        assert syncs[1].error is None and [(r.action.name, r.outcome) for r in syncs[1].results] == [("b", OK)]
        assert served_adapters(httpx.get(engine_url + "/v1/models").json()) == declared
        # the stuck engine: its first load ran out of the budget (no answer: retried next tick), the rest deferred
        assert [(r.action.name, r.outcome) for r in syncs[0].results] == [("a", RETRY)]
        assert syncs[0].deferred == (AdapterAction(LOAD, "b", weights["b"]),)
        status = summarize(syncs, declared)
        assert (status.ok, status.reason) == (False, "Pending") and "budget" in status.message
        assert memory.refused == {} and memory.busy == set()  # no answer is no refusal
        assert [line.split()[0] for line in seen] == ["GET", "POST"]


def test_an_engine_whose_call_outlasts_the_tick_is_not_called_again_until_it_ends() -> None:
    """A call that ignores its timeout (the HTTP client's timeouts bound each read, not a trickling answer): the
    tick returns anyway, and the next one leaves that engine alone instead of piling a second call on it. The
    engine here is a stand-in function: what is tested is the sync's bookkeeping, with no engine to run."""
    release = threading.Event()
    calls: list[str] = []

    def read(url: str, timeout: float) -> dict[str, str]:
        return {}

    def act(url: str, action: AdapterAction, timeout: float) -> tuple[int | None, str]:
        calls.append(url)
        release.wait(30)
        return 200, ""

    memory = AdapterMemory()
    pod = EnginePod("slow", "both", "http://slow", uid="u")
    first = sync_pool([pod], {"a": "/a"}, memory, read=read, act=act, budget=1.0)
    assert "budget" in (first[0].error or "") and memory.busy == {pod.life}
    second = sync_pool([pod], {"a": "/a"}, memory, read=read, act=act, budget=1.0)
    assert "still out" in (second[0].error or "") and calls == ["http://slow"]
    release.set()
    for _ in range(100):
        if not memory.busy:
            break
        threading.Event().wait(0.05)
    assert memory.busy == set()  # the call ended: the next tick syncs it again


# ---- two operators in a row, against the emulator ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[tuple[Cluster, str]]:
    async with Cluster() as k8s, kmock.Server(k8s) as server:
        serve_operator_resources(k8s)
        yield k8s, str(server.url).rstrip("/")


@contextlib.asynccontextmanager
async def operator_run(k8s: Cluster, server: str, tmp_path: Path) -> AsyncIterator[Env]:
    """One operator process's life: a new kopf run with its own memo and metrics, and a clock running 10x the
    test's (so each pool's intervalSeconds passes quickly)."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server)
    clock = [1000.0]
    registry = kopf.OperatorRegistry()
    metrics = register(registry, OperatorConfig(namespaces=(NS,), tick_seconds=0.2, clock=lambda: clock[0]),
                       kube_configuration(str(kubeconfig)))
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, standalone=True, namespaces=[NS], stop_flag=stop,
                                             ready_flag=ready))

    async def ticking() -> None:
        while True:
            await asyncio.sleep(0.05)
            clock[0] += 0.5

    clock_task = asyncio.create_task(ticking())
    await asyncio.wait_for(ready.wait(), 20)
    try:
        yield Env(k8s, clock, metrics)
        assert not task.done(), "the operator exited"
    finally:
        clock_task.cancel()
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 20)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_restarted_operator_unloads_what_was_dropped_meanwhile_and_does_not_retry_a_refusal(
        engine_url: str, weights: dict[str, str], tmp_path: Path) -> None:
    port = int(engine_url.rsplit(":", 1)[1])
    missing = str(tmp_path / "no-such-adapter")

    def spec(adapters: dict[str, str]) -> dict[str, Any]:
        return {"engine": {"port": port, "maxLoras": 4, "maxLoraRank": 8}, "replicas": {"both": {"min": 1, "max": 1}},
                "scaling": {"intervalSeconds": 1},
                "model": {"source": "bundled", "loraAdapters": [{"name": n, "path": p} for n, p in adapters.items()]}}

    ready_pod = pod_body("chat-both-0", "127.0.0.1")
    ready_pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    def kept(env: Env) -> dict[str, Any]:
        return env.pool().get("status", {}).get("adapters") or {}

    async def main() -> None:
        async with cluster() as (k8s, server):
            async with operator_run(k8s, server, tmp_path) as first:
                await k8s.post(POOLS, json=pool_body(**spec({"a": weights["a"], "b": weights["b"], "bad": missing})))
                await k8s.post(f"/api/v1/namespaces/{NS}/pods", json=ready_pod)
                await eventually(lambda: served_by(engine_url) == {"a": weights["a"], "b": weights["b"]})
                await eventually(lambda: first.events("AdapterRefused"))
                status = await eventually(lambda: (s := kept(first)).get("refused") and s)
                assert status["managed"] == ["a", "b", "bad"]
                (refusal,) = status["refused"]
                assert (refusal["pod"], refusal["action"], refusal["adapter"], refusal["path"]) == \
                    ("chat-both-0", "load", "bad", missing)
                assert refusal["podUid"] == first.get("v1/pods", "chat-both-0")["metadata"]["uid"]
                pending = pod_body("chat-both-1", "")  # scheduled, no address yet: no engine to wait for
                del pending["status"]["podIP"]
                pending["status"]["phase"] = "Pending"
                await k8s.post(f"/api/v1/namespaces/{NS}/pods", json=pending)

            # no operator runs: the spec drops `a`
            # (written into the emulator's store: with no operator, a PATCH through it waits on the stopped watches)
            (stored,) = [o for (r, ns, name), o in k8s.objects.items() if r.plural == PLURAL and name == "chat"]
            stored.patch({"metadata": {"generation": stored.raw["metadata"]["generation"] + 1},
                          "spec": spec({"b": weights["b"], "bad": missing})})
            assert served_by(engine_url) == {"a": weights["a"], "b": weights["b"]}

            async with operator_run(k8s, server, tmp_path) as second:
                await eventually(lambda: served_by(engine_url) == {"b": weights["b"]})
                await eventually(lambda: kept(second).get("managed") == ["b", "bad"])  # `a`: gone everywhere
                begun = second.ticks()
                await eventually(lambda: second.ticks() >= begun + 5)  # five more whole ticks of the new operator
                assert len(second.events("AdapterRefused")) == 1  # the first operator's, not announced again
                assert second.sample(f"{OperatorMetric.LORA_ACTIONS}_total", role="both", action="load",
                                     outcome="refused") == 0  # and not tried again
                assert second.sample(f"{OperatorMetric.LORA_ACTIONS}_total", role="both", action="unload",
                                     outcome="ok") == 1
                refused = await eventually(lambda: conditions(second)["AdaptersLoaded"]["reason"] == "Refused"
                                           and conditions(second)["AdaptersLoaded"])
                assert "bad" in refused["message"]

    run(main, 140)
