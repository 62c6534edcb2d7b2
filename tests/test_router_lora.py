"""LoRA adapters at the router: which pods serve a requested adapter (their /v1/models), which run it now
(vllm:lora_requests_info), prompts hashed with the adapter (contract 1), 404 model_not_found on both edges, and
the pool's /v1/models as the union of its pods'.

The first tests set the pods' state by hand (as tests/test_router_extproc.py does): the router's decisions over a
known snapshot, with no pod processes. The end-to-end test at the bottom runs real engines with and without the
adapter loaded.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvmesh.engine.openai_types import CompletionRequest
from kvmesh.engine.protocol import (
    LOAD_LORA_PATH,
    LORA_FINGERPRINT_FIELD,
    UNLOAD_LORA_PATH,
    BlockExtra,
    HashAlgo,
    KVConfig,
    Metric,
    block_hashes,
)
from kvmesh.processes import free_port
from kvmesh.router.app import Router, build_router, create_router_app
from kvmesh.router.config import RouterConfig, load_router_config
from kvmesh.router.extproc import endpoint_of, start_ext_proc
from kvmesh.router.index import PrefixMatch
from kvmesh.router.lora import LoraLoad, ServedModels, union_cards
from kvmesh.router.picker import PickerConfig, PodState, RequestInfo, pick
from kvmesh.router.pods import parse_metrics

from .conftest import make_engine
from .engines import serve_engine, serve_router
from .test_kv_transfer import metric
from .test_lora import write_adapter
from .test_router_extproc import body_chunks, chosen, full_duplex, refusal, request_headers
from .waiting import wait_for

BASE = "tiny"
OLD, NEW = "0123456789abcdef", "fedcba9876543210"  # two fingerprints of an adapter's weights
POD_A, POD_B, POD_C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def models_body(*adapters: str, fingerprint: str | None = None) -> dict[str, Any]:
    """A /v1/models answer as the engine gives it: the base model, then one card per adapter (with `fingerprint`
    as its weights', or none, as an engine that publishes none)."""
    cards = [{"id": BASE, "object": "model", "owned_by": "kvmesh", "root": "/models/tiny"}]
    cards += [{"id": a, "object": "model", "owned_by": "kvmesh", "root": f"/adapters/{a}", "parent": BASE,
               **({LORA_FINGERPRINT_FIELD: fingerprint} if fingerprint else {})} for a in adapters]
    return {"object": "list", "data": cards}


# ---- parsing what the pods say ----------------------------------------------------------------------------------

LORA_METRICS = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7000001e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="poet"} 1.7000009e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7000005e+09
vllm:num_requests_running{model_name="tiny"} 3.0
"""


def test_the_newest_lora_series_is_the_pods_current_adapters() -> None:
    """vLLM keeps a series per label set it has shown, valued with the time it was set: the newest one counts."""
    _, load = parse_metrics(LORA_METRICS)
    assert load == LoraLoad(frozenset({"sql", "chat"}), frozenset({"poet"}), 4)
    assert load.active == {"sql", "chat", "poet"}
    assert parse_metrics("vllm:num_requests_running 0.0\n")[1] == LoraLoad()  # none exported: nothing running


def test_a_pods_model_list_says_which_names_are_adapters_of_which_base() -> None:
    served = ServedModels.of(models_body("sql", "chat"))
    assert served.names == {BASE, "sql", "chat"} and served.adapters == {"sql": BASE, "chat": BASE}
    assert served.fingerprints == {"sql": None, "chat": None}  # an engine that publishes none
    assert ServedModels.of(models_body("sql", fingerprint=OLD)).fingerprints == {"sql": OLD}
    assert ServedModels.of(models_body("sql", "chat", fingerprint=OLD)).without("sql").fingerprints == {"chat": OLD}
    for wrong in ({"data": [{"object": "model"}]}, ["not", "a", "mapping"]):
        with pytest.raises(ValueError, match="list of models"):
            ServedModels.of(wrong)
    union = union_cards([ServedModels.of(models_body("sql")), ServedModels.of(models_body("chat", "sql")),
                         ServedModels.base_only(BASE)])
    assert [c["id"] for c in union] == [BASE, "chat", "sql"]  # base first, then adapters, each once
    assert all(c["parent"] == BASE for c in union[1:]) and "parent" not in union[0]


# ---- the picker ------------------------------------------------------------------------------------------------


def pod(name: str, adapters: tuple[str, ...] = (), active: tuple[str, ...] = (), **extra: Any) -> PodState:
    return PodState(name=name, url=name, model=BASE, models=frozenset({BASE, *adapters}),
                    adapters_active=frozenset(active), adapters_running=len(active), max_loras=2, **extra)


def test_only_pods_serving_the_adapter_are_candidates_and_running_it_is_preferred() -> None:
    pods = [pod("a", ("sql",), ("sql",)), pod("b", ("sql",)), pod("c")]
    request = RequestInfo(model="sql", prompt_tokens=40, block_hashes=(1, 2), lora="sql")
    decision = pick(request, pods, {})
    assert decision.pod is not None and decision.pod.name == "a"
    assert set(decision.scores) == {"a", "b"}  # c serves only the base model: filtered out
    assert decision.scores["a"] - decision.scores["b"] == pytest.approx(PickerConfig().lora_weight * 0.5)
    no_pod = pick(RequestInfo(model="poet", prompt_tokens=40, block_hashes=(1,), lora="poet"), pods, {})
    assert no_pod.pod is None and no_pod.reason == "no-candidates"
    base = pick(RequestInfo(model=BASE, prompt_tokens=40, block_hashes=(1,)), pods, {})
    assert set(base.scores) == {"a", "b", "c"} and len(set(base.scores.values())) == 1  # affinity: adapters only


def test_a_pod_whose_slots_are_all_busy_with_other_adapters_scores_lowest() -> None:
    busy = pod("busy", ("sql", "x", "y"), ("x", "y"))  # both slots taken by other adapters: sql would wait
    free = pod("free", ("sql",))
    request = RequestInfo(model="sql", prompt_tokens=40, block_hashes=(1,), lora="sql")
    assert pick(request, [busy, free], {}).pod.name == "free"  # type: ignore[union-attr]


def test_the_affinity_weight_is_a_router_weight_and_a_cached_prefix_outweighs_it(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("router:\n  pods: [http://127.0.0.1:1]\n  weights: {lora_weight: 0.25}\n")
    config = load_router_config(path)
    assert PickerConfig(**config.weights).lora_weight == 0.25
    running, cached = pod("running", ("sql",), ("sql",)), pod("cached", ("sql",))
    request = RequestInfo(model="sql", prompt_tokens=160, block_hashes=tuple(range(10)), lora="sql")
    match = {"cached": PrefixMatch(blocks=9, by_tier={"device": 9}, provisional=0)}
    assert pick(request, [running, cached], match).pod.name == "cached"  # type: ignore[union-attr]
    assert pick(request, [running, cached], {}).pod.name == "running"  # type: ignore[union-attr]


# ---- the router over a snapshot it is given -----------------------------------------------------------------


def set_pods(router: Router, served: dict[str, tuple[str, ...]], running: dict[str, tuple[str, ...]],
             fingerprints: dict[str, str] | None = None) -> None:
    """Pods as their scrapes would leave them: healthy, configured like the router, with these adapters (of the
    weights `fingerprints` names per pod, or published without one)."""
    for url, adapters in served.items():
        p = router.pods.pods[url]
        p.healthy, p.scraped_at = True, time.monotonic()
        p.kv_config = KVConfig(model=BASE, block_size=16, hash_algo=router.config.hash_algo,
                               hash_root=router.config.hash_root, tokenizer_fingerprint=router.tokenizer.fingerprint,
                               num_device_blocks=1000, boot_id="b")
        p.metrics = {"num_blocks": 1000.0, "block_size": 16.0}
        p.served = ServedModels.of(models_body(*adapters, fingerprint=(fingerprints or {}).get(url)))
        p.lora = LoraLoad(frozenset(running.get(url, ())), frozenset(), 4)


@pytest.fixture
def router(bundled_dir: Path) -> Router:
    r = build_router(RouterConfig(pods=[POD_A, POD_B, POD_C], stale_after_seconds=3600.0), bundled_dir)
    set_pods(r, {POD_A: ("sql",), POD_B: ("sql", "chat"), POD_C: ()}, {POD_B: ("sql",)})
    return r


def test_an_adapters_prompt_is_hashed_with_the_adapter_as_the_engines_hash_it(router: Router) -> None:
    ids = list(range(300, 340))
    for model, lora in (("sql", "sql"), (BASE, None)):
        raw = {"model": model, "prompt": ids, "max_tokens": 1, "cache_salt": "s"}
        info = router.request_info(router_body(raw), 0)
        assert info.lora == lora
        assert list(info.block_hashes) == block_hashes(ids, 16, BlockExtra(lora=lora, cache_salt="s"), HashAlgo.XXH3,
                                                       router.config.hash_root)
    sql = router.request_info(router_body({"model": "sql", "prompt": ids}), 0).block_hashes
    chat = router.request_info(router_body({"model": "chat", "prompt": ids}), 0).block_hashes
    assert not set(sql) & set(chat)  # two adapters never share a cached block


def router_body(raw: dict[str, Any]) -> CompletionRequest:
    return CompletionRequest.model_validate(raw)


def test_during_a_rollout_of_new_weights_each_pod_is_matched_with_its_own_weights_hashes(router: Router) -> None:
    """New weights under the name reach the pods one by one: the router hashes the prompt once per fingerprint
    the pods serving the adapter publish, and each pod's cached prefix is what it holds under its own weights'
    hashes (blocks of other weights it may still hold count for nothing)."""
    set_pods(router, {POD_A: ("sql",), POD_B: ("sql",), POD_C: ()}, {}, {POD_A: OLD, POD_B: NEW})
    ids = list(range(300, 385))  # 5 full blocks
    info = router.request_info(router_body({"model": "sql", "prompt": ids}), 0)
    hashed = {f: tuple(block_hashes(ids, 16, BlockExtra("sql", None, f), HashAlgo.XXH3, router.config.hash_root))
              for f in (OLD, NEW)}
    assert info.lora == "sql" and info.lora_hashes == hashed  # one hashing per weights, no more
    now = time.monotonic()
    router.index.add_provisional(POD_A, hashed[OLD][:4], now, 3600)
    router.index.add_provisional(POD_B, hashed[OLD], now, 3600)  # cached before its weights changed: stale
    router.index.add_provisional(POD_B, hashed[NEW][:2], now, 3600)
    view = router.view(info)
    assert {pod: view.matches[pod].blocks for pod in (POD_A, POD_B)} == {POD_A: 4, POD_B: 2}
    decision = router.decide(info, set(), view=view)
    assert decision.pod is not None and decision.pod.name == POD_A and decision.predicted_cached_tokens == 64
    assert router.decide(info, {POD_A}, view=view).predicted_cached_tokens == 32  # POD_B: its own 2 blocks

    # weights loaded on POD_B after the request was hashed: nothing it holds is credited to it
    set_pods(router, {POD_B: ("sql",)}, {}, {POD_B: "3" * 16})
    assert POD_B not in router.view(info).matches
    # in steady state every pod agrees: one hashing, and the same hashes for every pod
    set_pods(router, {POD_A: ("sql",), POD_B: ("sql",)}, {}, {POD_A: NEW, POD_B: NEW})
    steady = router.request_info(router_body({"model": "sql", "prompt": ids}), 0)
    assert steady.lora_hashes == {NEW: hashed[NEW]} and steady.block_hashes == hashed[NEW]
    assert {pod: m.blocks for pod, m in router.view(steady).matches.items()} == {POD_B: 2}
    set_pods(router, {POD_B: ("sql",)}, {}, {POD_B: OLD})  # as above, within one hashing
    assert POD_B not in router.view(steady).matches


@pytest.mark.asyncio
async def test_the_http_edge_lists_the_union_and_refuses_an_unknown_adapter_with_404(router: Router) -> None:
    app = create_router_app(router)  # no lifespan here: the pods keep the state set above
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(BASE, None), ("chat", BASE), ("sql", BASE)]
        reply = await client.post("/v1/completions", json={"model": "poet", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and "`poet` does not exist" in error["message"]
        assert "sql" in error["message"] and "chat" in error["message"]  # what the pool does serve
    info = router.request_info(router_body({"model": "chat", "prompt": "hi"}), 0)
    assert router.decide(info, set()).pod.name == POD_B  # type: ignore[union-attr]  # the one pod with chat
    sql = router.request_info(router_body({"model": "sql", "prompt": "hi"}), 0)
    assert router.decide(sql, set()).pod.name == POD_B  # type: ignore[union-attr]  # sql runs there already


@pytest_asyncio.fixture
async def stub(router: Router) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)
    await server.stop(settle=0.0)


@pytest.mark.asyncio
async def test_the_gateway_edge_routes_adapters_to_their_pods_and_refuses_unknown_ones(
    router: Router, stub: pb_grpc.ExternalProcessorStub,
) -> None:
    chat = json.dumps({"model": "chat", "prompt": "hello", "max_tokens": 2}).encode()
    replies = await full_duplex(stub, [request_headers(), *body_chunks(chat)])
    assert chosen(replies[0]) == endpoint_of(POD_B)
    poet = json.dumps({"model": "poet", "prompt": "hello", "max_tokens": 2}).encode()
    status, error, _ = refusal((await full_duplex(stub, [request_headers(), *body_chunks(poet)]))[0])
    assert status == 404 and error["error"]["code"] == "model_not_found"  # type: ignore[index]
    status, listed, _ = refusal((await full_duplex(stub, [request_headers("/v1/models", "GET",
                                                                          end_of_stream=True)]))[0])
    assert status == 200 and [m["id"] for m in listed["data"]] == [BASE, "chat", "sql"]  # type: ignore[index]


# ---- end to end: a router over two real engines, one with the adapter -------------------------------------------


def listed(router_url: str) -> dict[str, str | None]:
    return {m["id"]: m.get("parent") for m in httpx.get(router_url + "/v1/models").json()["data"]}


@pytest.mark.slow
def test_an_adapters_requests_go_to_the_engine_serving_it_with_the_hashes_that_engine_publishes(
    tiny_dir: Path, tmp_path: Path,
) -> None:
    sql, poet = write_adapter(tmp_path / "sql", seed=1), write_adapter(tmp_path / "poet", seed=2, rank=4)
    with ExitStack() as stack:
        with_sql = stack.enter_context(serve_engine(make_engine(tiny_dir, lora_modules={"sql": str(sql)},
                                                                max_loras=2, max_lora_rank=8)))
        plain = stack.enter_context(serve_engine(make_engine(tiny_dir, max_loras=2, max_lora_rank=8)))
        base = httpx.get(plain + "/v1/models").json()["data"][0]["id"]
        router = build_router(RouterConfig(pods=[with_sql, plain], scrape_interval_seconds=0.1), tiny_dir)
        url = stack.enter_context(serve_router(router))
        wait_for(lambda: listed(url) == {base: None, "sql": base}, "the router never listed the adapter")
        wait_for(lambda: router.pods.pods[with_sql].lora.max_lora == 2, "the engine's LoRA metric was never read")

        for seed in range(4):  # distinct prompts: no cached prefix decides, only who serves the adapter
            ids = [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(70)]
            body = {"model": "sql", "prompt": ids, "max_tokens": 2, "temperature": 0}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvmesh-pod"] == with_sql and reply.json()["model"] == "sql"
        info = router.request_info(CompletionRequest.model_validate(body), 0)
        assert info.lora == "sql" and len(info.block_hashes) == 4
        confirmed = lambda: router.index.match(info.block_hashes, [with_sql]).get(with_sql)  # noqa: E731
        wait_for(lambda: confirmed() is not None and confirmed().blocks == 4,  # type: ignore[union-attr]
                 "the engine's KV events never confirmed the router's hashes of the adapter's prompt")
        assert info.lora_hashes.keys() == {httpx.get(with_sql + "/v1/models").json()["data"][1][LORA_FINGERPRINT_FIELD]}
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)  # the router's prediction is the real hit
        predicted = int(again.headers["x-kvmesh-predicted-cached-tokens"])
        assert predicted == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        base_info = router.request_info(CompletionRequest.model_validate({**body, "model": base}), 0)
        assert not set(base_info.block_hashes) & set(info.block_hashes)  # the adapter's cache is its own
        assert router.index.match(base_info.block_hashes) == {}  # no pod was sent the base model's prompt

        missing = httpx.post(url + "/v1/completions", json={**body, "model": "poet"}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        loaded = httpx.post(plain + LOAD_LORA_PATH, json={"lora_name": "poet", "lora_path": str(poet)}, timeout=60)
        assert loaded.status_code == 200, loaded.text
        wait_for(lambda: "poet" in listed(url), "an adapter loaded at run time never reached the router")
        reply = httpx.post(url + "/v1/completions", json={**body, "model": "poet"}, timeout=60)
        assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == plain
        assert httpx.post(plain + UNLOAD_LORA_PATH, json={"lora_name": "poet"}, timeout=60).status_code == 200
        wait_for(lambda: "poet" not in listed(url), "an unloaded adapter stayed in the router's list")
        gone = httpx.post(url + "/v1/completions", json={**body, "model": "poet"}, timeout=60)
        assert gone.status_code == 404


@pytest.mark.slow
def test_a_disaggregated_adapter_request_is_handed_to_a_decode_engine_serving_the_adapter(
    tiny_dir: Path, tmp_path: Path,
) -> None:
    """Prefill on the prefill engine with the adapter, decode on the one decode engine that also has it (the
    other would answer 404): the KV handoff of the adapter's blocks succeeds, and the answer is what one engine
    with the adapter gives alone (greedy)."""
    sql = str(write_adapter(tmp_path / "sql", seed=1))
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve_engine(make_engine(tiny_dir, role=role, **loras)))
                for name, role, loras in (("prefill", "prefill", {"lora_modules": {"sql": sql}}),
                                          ("decode-plain", "decode", {}),
                                          ("decode-sql", "decode", {"lora_modules": {"sql": sql}}))}
        router = build_router(RouterConfig(pods=list(urls.values()), scrape_interval_seconds=0.1,
                                           prefill_hop_min_tokens=32), tiny_dir)
        url = stack.enter_context(serve_router(router))
        wait_for(lambda: "sql" in listed(url) and len(httpx.get(url + "/health").json()["pods"]) == 3,
                 "the router never read all three engines")
        for seed in range(3):
            ids = [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(80)]
            body = {"model": "sql", "prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvmesh-pod"] == f"{urls['prefill']},{urls['decode-sql']}"
            alone = httpx.post(urls["decode-sql"] + "/v1/completions", json=body, timeout=60).json()
            assert reply.json()["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert metric(urls["decode-sql"], f"{Metric.KV_TRANSFERS}_total", kind="handoff", outcome="failed") == 0
        assert metric(urls["decode-sql"], f"{Metric.KV_TRANSFERS}_total", kind="handoff", outcome="ok") >= 3


@pytest.mark.slow
def test_a_pod_that_unloaded_the_adapter_since_its_list_was_read_is_skipped_for_the_next(
    tiny_dir: Path, tmp_path: Path,
) -> None:
    """Within the list's refresh lag the router may still send an adapter's request to a pod that unloaded it:
    its 404 sends the request on to another pod serving the adapter, and the router stops counting on that pod."""
    sql = write_adapter(tmp_path / "sql", seed=1)
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_engine(make_engine(tiny_dir, lora_modules={"sql": str(sql)},
                                                             max_loras=2, max_lora_rank=8))) for _ in range(2)]
        router = build_router(RouterConfig(pods=urls, scrape_interval_seconds=0.1), tiny_dir)
        url = stack.enter_context(serve_router(router))
        wait_for(lambda: all(router.pods.pods[u].served is not None and "sql" in router.pods.pods[u].served.names
                             for u in urls), "the router never read both engines' adapters")
        body = {"model": "sql", "prompt": [(i * 104729) % 48000 + 200 for i in range(70)], "max_tokens": 2}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        holder = first.headers["x-kvmesh-pod"]
        other = next(u for u in urls if u != holder)
        info = router.request_info(CompletionRequest.model_validate(body), 0)
        held = lambda: router.index.match(info.block_hashes, [holder]).get(holder)  # noqa: E731
        wait_for(lambda: held() is not None and held().blocks == 4,  # type: ignore[union-attr]
                 "the holder's KV events never arrived")
        router.pods.pods[holder].served_at = time.monotonic() + 3600  # its list is not read again in this test
        assert httpx.post(holder + UNLOAD_LORA_PATH, json={"lora_name": "sql"}, timeout=60).status_code == 200

        again = httpx.post(url + "/v1/completions", json=body, timeout=60)  # the prefix points at the holder
        assert again.status_code == 200, again.text
        assert again.headers["x-kvmesh-pod"] == other
        assert router.metrics.retries._value.get() == 1
        assert "sql" not in router.pods.pods[holder].served.names  # not tried again before its list is read

        router.pods.pods[other].served_at = time.monotonic() + 3600
        assert httpx.post(other + UNLOAD_LORA_PATH, json={"lora_name": "sql"}, timeout=60).status_code == 200
        gone = httpx.post(url + "/v1/completions", json=body, timeout=60)  # no pod serves it any more
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text


def test_a_decode_pod_must_serve_the_adapter_with_the_prefill_pods_weights(router: Router) -> None:
    """While new weights under a name reach the pods one by one, a prefill pod's KV goes only to a decode pod with
    the same weights: one with others would find none of its blocks, recompute, and continue the first token of
    one version with the rest of another. Pods not serving the adapter and base-model requests are not affected."""
    set_pods(router, {POD_A: ("sql",), POD_B: ("sql",), POD_C: ()}, {}, {POD_A: NEW, POD_B: OLD})
    assert router.served_otherwise(POD_A, "sql") == {POD_B}
    assert router.served_otherwise(POD_B, "sql") == {POD_A}
    assert router.served_otherwise(POD_A, None) == set()
    set_pods(router, {POD_A: ("sql",), POD_B: ("sql",), POD_C: ()}, {}, {POD_A: NEW, POD_B: NEW})
    assert router.served_otherwise(POD_A, "sql") == set()
