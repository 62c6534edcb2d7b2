"""The pull-or-recompute decision as a pure function."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from kvmesh.engine.openai_types import CompletionRequest
from kvmesh.engine.protocol import KVConfig
from kvmesh.router.app import View, build_router
from kvmesh.router.config import RouterConfig
from kvmesh.router.index import PrefixMatch
from kvmesh.router.picker import Decision, PickerConfig, PodState, RequestInfo
from kvmesh.router.pull import PullPolicy, plan_pull

from .test_router_lora import NEW, OLD, POD_A, POD_B, POD_C, set_pods

BLOCK_BYTES = 737_280  # SmolLM2, fp32


def match(blocks: int, provisional: int = 0) -> PrefixMatch:
    return PrefixMatch(blocks, {"device": blocks, "host": 0, "disk": 0}, provisional)


def pods(speed: float = 500.0) -> list[PodState]:
    return [PodState(name=n, url=f"http://{n}", prefill_tokens_per_second=speed) for n in ("a", "b", "c")]


def test_a_slow_prefill_pulls_the_longest_prefix_from_a_peer() -> None:
    a, b, c = pods()
    request = RequestInfo("m", 1000, tuple(range(62)))
    plan = plan_pull(a, request, [a, b, c], {"a": match(4), "b": match(40), "c": match(20)}, BLOCK_BYTES,
                     PickerConfig())
    assert plan is not None and plan.source.name == "b" and plan.tokens == 640 and plan.seconds_saved > 0


def test_fast_prefill_or_a_slow_link_recomputes() -> None:
    a, b, _ = pods(speed=1e7)
    request = RequestInfo("m", 1000, tuple(range(62)))
    assert plan_pull(a, request, [a, b], {"b": match(40)}, BLOCK_BYTES, PickerConfig()) is None
    a, b, _ = pods(speed=500.0)
    slow_link = PullPolicy(bytes_per_second=1e3)
    assert plan_pull(a, request, [a, b], {"b": match(40)}, BLOCK_BYTES, PickerConfig(), slow_link) is None


def test_nothing_to_gain_and_unusable_peers() -> None:
    a, b, _ = pods()
    request = RequestInfo("m", 1000, tuple(range(62)))
    assert plan_pull(a, request, [a, b], {"a": match(40), "b": match(41)}, BLOCK_BYTES, PickerConfig()) is None
    sick = PodState(name="b", url="http://b", healthy=False)
    assert plan_pull(a, request, [a, sick], {"b": match(40)}, BLOCK_BYTES, PickerConfig()) is None
    # blocks the peer holds only provisionally (not yet computed there) cannot be fetched
    assert plan_pull(a, request, [a, b], {"b": match(40, provisional=40)}, BLOCK_BYTES, PickerConfig()) is None


def test_the_last_block_stays_to_compute() -> None:
    a, b, _ = pods()
    request = RequestInfo("m", 64, tuple(range(4)))  # 4 full blocks; the engine computes the 64th token
    plan = plan_pull(a, request, [a, b], {"b": match(4)}, BLOCK_BYTES, PickerConfig(), PullPolicy(setup_seconds=0))
    assert plan is not None and plan.tokens == 48


def test_blocks_are_pulled_only_from_pods_storing_them_alike(bundled_dir: Path) -> None:
    """During a rolling change of kvCacheDtype a pool holds both formats; a pull between them would be refused
    by the engine (its bytes mean nothing to the other format), so the router never plans one."""
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    router = build_router(RouterConfig(pods=urls, stale_after_seconds=3600.0), bundled_dir)
    formats = {urls[0]: ("int8", 100), urls[1]: ("auto", 400), urls[2]: ("int8", 100)}
    for url, pod in router.pods.pods.items():
        pod.healthy, pod.scraped_at = True, time.monotonic()
        pod.kv_config = KVConfig(model="m", block_size=16, hash_algo=router.config.hash_algo,
                                 hash_root=router.config.hash_root, tokenizer_fingerprint=router.tokenizer.fingerprint,
                                 num_device_blocks=1000, boot_id="b", kv_cache_dtype=formats[url][0],
                                 block_bytes=formats[url][1])
        pod.metrics = {"num_blocks": 1000.0, "block_size": 16.0, "prefill_tokens_per_second": 1.0}
    info = RequestInfo(model="m", prompt_tokens=400, block_hashes=tuple(range(1, 26)))
    chosen = next(p for p in router.view(info).pods if p.name == urls[0])
    decision = Decision(chosen, {}, 0, 0.0, "test")

    def holders(*names: str) -> set[str | None]:
        view = router.view(info)
        matches = {n: match(24) for n in names}
        plan = router.plan_pull(decision, info, View(view.pods, matches))
        return {plan.source.name if plan else None}

    assert holders(urls[1]) == {None}  # only a pod of the other format has the prefix: recompute
    assert holders(urls[1], urls[2]) == {urls[2]}  # a pod of the same format has it: pull from that one


def test_an_adapters_prefix_is_pulled_only_from_pods_serving_the_same_weights(bundled_dir: Path) -> None:
    """While new weights under an adapter's name reach the pods one by one, the chosen pod pulls by its own
    weights' hashes (its blocks' `lora:NAME@FINGERPRINT`): a peer serving other weights holds none of those, so the
    router plans no pull from it (it would cost a round trip for nothing) and none at all when the chosen pod's
    weights changed after the request was hashed. A pod's weights read by the router may still be up to a refresh
    old; the engine then pulls nothing or recomputes what it pulled (docs/engine.md, LoRA adapters)."""
    router = build_router(RouterConfig(pods=[POD_A, POD_B, POD_C], stale_after_seconds=3600.0), bundled_dir)

    def serve(weights: dict[str, str]) -> None:
        set_pods(router, {url: ("sql",) for url in weights}, {}, weights)
        for url in weights:
            pod = router.pods.pods[url]
            assert pod.kv_config is not None
            pod.kv_config = dataclasses.replace(pod.kv_config, block_bytes=BLOCK_BYTES)
            pod.metrics["prefill_tokens_per_second"] = 1.0  # computing is slow: a pull of any prefix pays

    serve({POD_A: NEW, POD_B: OLD, POD_C: NEW})
    info = router.request_info(CompletionRequest.model_validate({"model": "sql", "prompt": list(range(300, 700))}), 0)
    assert info.lora_hashes.keys() == {OLD, NEW}

    def source(holders: dict[str, int]) -> str | None:
        view = router.view(info)
        chosen = next(p for p in view.pods if p.name == POD_A)
        plan = router.plan_pull(Decision(chosen, {}, 0, 0.0, "test"), info,
                                View(view.pods, {name: match(blocks) for name, blocks in holders.items()}))
        return plan.source.name if plan else None

    assert source({POD_B: 24}) is None  # only a pod of the old weights holds the prefix: recompute
    assert source({POD_B: 24, POD_C: 20}) == POD_C  # the shorter prefix of the same weights is the one to pull
    serve({POD_A: "3" * 16})  # weights loaded there since the request was hashed
    assert source({POD_B: 24, POD_C: 20}) is None
    serve({POD_A: NEW})
    assert source({POD_B: 24, POD_C: 20}) == POD_C  # as before: only the weights made the difference
