"""The engine simulator keeps the engine's contracts: the same metric families, KV events, cached tokens and KV
transfer, from the engine's own code, with a latency model instead of a forward pass. Nothing here asserts a
time: the latency model's arithmetic is checked as arithmetic, and most tests run it at zero cost."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.bench.sim_engine import PROFILES, LatencyModel, sim_config
from kvmesh.bench.sim_runner import FIRST_ORDINARY_TOKEN, SimEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import HashAlgo, block_hashes
from kvmesh.engine.request import Request, RequestOutput
from kvmesh.engine.runner import StepInput
from kvmesh.engine.sampling import SamplingParams

from .engines import serve_engine

FREE = LatencyModel(0.0, 0.0, 0.0, 0.0, 1e15)  # every step takes no modelled time


def sim(profile: str = "cpu-smollm", latency: LatencyModel = FREE, **settings: object) -> SimEngine:
    config = EngineConfig(**{"kv_cache_blocks": 64, **settings})  # type: ignore[arg-type]
    return SimEngine(config, PROFILES[profile], latency)


def generate(engine: Engine, request_id: str, prompt: list[int], max_tokens: int = 4,
             **params: object) -> tuple[list[int], RequestOutput]:
    outs: list[RequestOutput] = []
    engine.submit(Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                          on_output=outs.append))
    engine.run_until_idle()
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def test_latency_model_adds_prefill_tokens_decode_sequences_and_context() -> None:
    model = LatencyModel(prefill_seconds_per_token=0.002, decode_step_seconds=0.04, decode_seconds_per_seq=0.003,
                         decode_seconds_per_context_token=1e-5, transfer_bytes_per_second=1e9)
    prefill = StepInput([0], 0, list(range(100)), True)
    decodes = [StepInput([0], 50, [7], True), StepInput([1], 9, [8], True)]
    assert model.step_seconds([prefill]) == pytest.approx(0.2)
    assert model.step_seconds(decodes) == pytest.approx(0.04 + 2 * 0.003 + (51 + 10) * 1e-5)
    assert model.step_seconds([prefill, *decodes]) == pytest.approx(0.2 + 0.04 + 0.006 + 61e-5)
    with pytest.raises(ValueError):
        LatencyModel(-1.0, 0.0, 0.0, 0.0, 1.0)


def test_answers_are_deterministic_across_pods_and_sampling_settings() -> None:
    a, b = sim(), sim()
    prompt = list(range(200, 260))
    greedy, out = generate(a, "g", prompt, max_tokens=6, temperature=0.0)
    sampled, _ = generate(b, "s", prompt, max_tokens=6, temperature=1.0, seed=3)
    other, _ = generate(a, "o", list(range(300, 360)), max_tokens=6)
    assert greedy == sampled and len(greedy) == 6 and out.finish_reason == "length"
    assert other != greedy
    assert all(t >= FIRST_ORDINARY_TOKEN and t not in a.tokenizer.eos_token_ids for t in greedy + other)
    assert out.completion_tokens == 6 and out.prompt_tokens == 60


def test_prefix_cache_skips_the_cached_part_and_reports_it() -> None:
    engine = sim()
    shared = list(range(1000, 1064))  # four 16-token blocks
    generate(engine, "first", shared + list(range(2000, 2036)))
    computed = engine.runner.computed_tokens
    _, out = generate(engine, "second", shared + list(range(3000, 3036)))
    assert out.cached_tokens == 64
    assert engine.runner.computed_tokens - computed == 36 + 3  # the uncached prompt, then 3 fed-back tokens
    off = sim(enable_prefix_cache=False)
    generate(off, "first", shared + list(range(2000, 2036)))
    assert generate(off, "second", shared + list(range(3000, 3036)))[1].cached_tokens == 0
    engine.kv.check_invariants()


def test_kv_events_name_the_prompt_blocks_and_evictions() -> None:
    engine = sim(kv_cache_blocks=12)  # 192 tokens: the third prompt evicts the first's blocks
    prompts = [list(range(k, k + 100)) for k in (1000, 5000, 9000)]
    for i, prompt in enumerate(prompts):
        generate(engine, f"r{i}", prompt)
    events = [e for batch in engine.events.read(0) for e in batch.events]
    stored = [h for e in events if e.kind == "stored" for h in e.block_hashes]
    removed = [h for e in events if e.kind == "removed" for h in e.block_hashes]
    for prompt in prompts:
        expected = block_hashes(prompt[:96], 16, algo=HashAlgo(engine.config.hash_algo), root=engine.config.hash_root)
        assert set(expected) <= set(stored)
    first = block_hashes(prompts[0][:96], 16, algo=HashAlgo(engine.config.hash_algo), root=engine.config.hash_root)
    assert removed and set(removed) & set(first)
    snapshot = {h for hashes in engine.events.snapshot().blocks.values() for h in hashes}
    assert snapshot == {h for h in stored if engine.kv.pool.lookup(h) is not None}  # the events add up to the pool
    engine.kv.check_invariants()


def _families(text: bytes) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text.decode())}


def test_exports_exactly_the_engines_metric_families(tiny_engine: Engine) -> None:
    engine = sim()
    shared = list(range(1000, 1064))
    generate(engine, "a", [*shared, 5, 6, 7])
    generate(engine, "b", [*shared, 8, 9, 10])
    generate(tiny_engine, "metrics-families", [*shared, 5, 6, 7])  # labelled series appear once observed
    assert _families(engine.metrics.render()) == _families(tiny_engine.metrics.render())
    samples = {s.name: s.value for f in text_string_to_metric_families(engine.metrics.render().decode())
               for s in f.samples}
    assert samples["vllm:prefix_cache_hits_total"] == 64
    assert samples["vllm:prefix_cache_queries_total"] == 134


def test_profile_sets_block_bytes_and_default_kv_budget() -> None:
    config = sim_config(PROFILES["h100-8b"], None, {})
    assert config.kv_cache_memory_mib == 60 * 1024
    assert sim_config(PROFILES["h100-8b"], None, {"kv_cache_memory_mib": 100}).kv_cache_memory_mib == 100
    engine = SimEngine(config, PROFILES["h100-8b"], FREE)
    per_block = 32 * 2 * 16 * 8 * 128 * 2  # layers x (K, V) x tokens x KV heads x head dim x bf16
    assert engine.kv_config.block_bytes == per_block
    assert engine.kv.pool.num_blocks == 60 * 1024 * (1 << 20) // per_block
    assert engine.max_model_len == 131072


def test_http_api_usage_events_and_a_pull_between_simulated_pods() -> None:
    prompt = list(range(4000, 4100))
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    with serve_engine(sim()) as a, serve_engine(sim()) as b, httpx.Client(timeout=60) as client:
        assert client.get(f"{a}/v1/kv/config").json()["block_bytes"] == 737280  # SmolLM2's shape, fp32
        first = client.post(f"{a}/v1/completions", json=body).json()
        again = client.post(f"{a}/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert again["choices"][0]["text"] == first["choices"][0]["text"] != ""
        with client.stream("GET", f"{a}/v1/kv/events", params={"after": 0}) as events:
            batch = httpx.Response(200, content=next(events.iter_lines())).json()
        assert batch["events"][0]["type"] == "stored" and batch["events"][0]["block_hashes"]
        pull = {**body, "kv_transfer": {"mode": "pull", "source": a, "tokens": 96}}
        pulled = client.post(f"{b}/v1/completions", json=pull).json()
        details = pulled["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == 96 and details["kvmesh_cached_by_source"]["peer"] == 96
        assert pulled["choices"][0]["text"] == first["choices"][0]["text"]
        assert "vllm:num_requests_running" in client.get(f"{b}/metrics").text
