"""LoRA adapters on the engine simulator, so the router's adapter routing can be exercised with many simulated
pods: `--lora-modules`, the load and unload endpoints, updates in place, /v1/models cards with their parent,
vllm:lora_requests_info, the real engine's 404 for an unknown adapter, blocks hashed with the adapter's name and
weights, and a router over two simulated engines sending an adapter's requests to the one that serves it and caching
its prefix on its own."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from kvmesh.bench.sim_engine import ENGINE_FLAGS, PROFILES, LatencyModel, add_parser, sim_config
from kvmesh.bench.sim_runner import SimEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.model.lora import LoraError
from kvmesh.engine.openai_types import CompletionRequest
from kvmesh.engine.protocol import (
    LOAD_LORA_PATH,
    LORA_FINGERPRINT_FIELD,
    MODELS_PATH,
    UNLOAD_LORA_PATH,
    BlockExtra,
    HashAlgo,
    VllmMetric,
    block_hashes,
)
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .conftest import make_engine
from .engines import serve_engine, serve_router
from .test_lora import submit, write_adapter
from .test_router_lora import listed
from .waiting import wait_for

FREE = LatencyModel(0.0, 0.0, 0.0, 0.0, 1e15)


def sim(**settings: object) -> SimEngine:
    config = EngineConfig(**{"kv_cache_blocks": 64, "max_loras": 2, "max_lora_rank": 8, **settings})  # type: ignore
    return SimEngine(config, PROFILES["cpu-smollm"], FREE)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sim-loras")
    return {name: str(write_adapter(root / name, seed=seed, rank=4, layers=1))
            for name, seed in (("sql", 1), ("poet", 2), ("sql-v2", 3))}


def test_the_cli_takes_adapters_as_the_engines_cli_does(adapters: dict[str, str]) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["sim-engine", "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "3",
                              "--max-lora-rank", "16"])
    config = sim_config(PROFILES["cpu-smollm"], None, {name: getattr(args, name) for name in ENGINE_FLAGS})
    assert (config.lora_modules, config.max_loras, config.max_lora_rank) == ({"sql": adapters["sql"]}, 3, 16)


@pytest.mark.parametrize(("config", "fragment"), [({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias"),
                                                  ({"peft_type": "IA3"}, "IA3"), ({"r": 64}, "rank 64")])
def test_the_simulator_refuses_the_adapters_the_engine_refuses(tmp_path: Path, config: dict[str, object],
                                                               fragment: str) -> None:
    """The same config checks as the engine (one function), so tests against simulated pods see its refusals."""
    path = write_adapter(tmp_path / "bad", seed=5, rank=4, layers=1, **config)
    with pytest.raises(LoraError, match=fragment):
        sim().read_lora("bad", str(path))


def damage(path: Path, how: str) -> None:
    """Spoil an adapter's weights file as a broken copy, a wrong file or another kind of adapter would."""
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "not safetensors":
        weights.write_bytes(b"PK\x03\x04 a zip archive, not a safetensors file")
    elif how == "foreign key":
        save_file({**tensors, "base_model.model.lm_head.weight": torch.zeros(4, 4)}, str(weights))
    else:  # an A without its B
        save_file({k: v for k, v in tensors.items() if ".lora_B." not in k}, str(weights))


@pytest.mark.parametrize(("how", "fragment"), [("truncated", "could not be read"),
                                               ("not safetensors", "could not be read"),
                                               ("foreign key", "lm_head"), ("half", "lacks lora_B")])
def test_a_damaged_weights_file_is_refused_by_the_simulator_as_by_the_engine(
        tmp_path: Path, tiny_dir: Path, how: str, fragment: str) -> None:
    """The weights file's checks that need no base model are one function: an adapter a real engine refuses must
    not load on the simulated pods a test or a benchmark stands in for it."""
    path = write_adapter(tmp_path / "bad", seed=6, rank=4, layers=1)
    damage(path, how)
    refusals = []
    for engine in (sim(), make_engine(tiny_dir, kv_cache_blocks=64, max_loras=2, max_lora_rank=8)):
        with pytest.raises(LoraError, match=fragment) as refused:
            engine.read_lora("bad", str(path))
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1]


def test_an_update_in_place_runs_on_the_simulator_as_on_the_engine(adapters: dict[str, str]) -> None:
    """The simulator's adapters are the engine's: load_inplace points the name at the new weights while a request
    runs; that request answers as the old weights do to its end, one queued after as the new weights do, and the
    old slot is freed when the old request ends."""
    engine = sim(lora_modules={"sql": adapters["sql"]})
    ids = list(range(4000, 4040))
    reference = submit(engine, "sql", ids, max_tokens=8)
    engine.run_until_idle()
    before = engine.loras.loaded["sql"]
    old = submit(engine, "sql", ids, max_tokens=8)
    engine.step()
    engine.add_lora(engine.read_lora("sql", adapters["sql-v2"]), inplace=True)
    new = submit(engine, "sql", ids, max_tokens=8)
    engine.step()
    assert old.final.finish_reason is None and set(engine.loras.retired) == {before.slot}
    engine.run_until_idle()
    assert old.tokens == reference.tokens != new.tokens
    assert (old.final.cached_tokens, new.final.cached_tokens) == (32, 0)  # each finds only its own weights' blocks
    assert engine.loras.retired == {} and engine.loras.free_slots() == [before.slot]


def lora_info(text: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == VllmMetric.LORA_REQUESTS_INFO]


@pytest.mark.slow
def test_adapters_load_unload_list_count_and_hash_as_on_the_engine(tiny_dir: Path, adapters: dict[str, str]) -> None:
    prompt = list(range(4000, 4040))  # two full blocks
    with ExitStack() as stack, httpx.Client(timeout=60) as client:
        url = stack.enter_context(serve_engine(sim(lora_modules={"sql": adapters["sql"]})))
        real = stack.enter_context(serve_engine(make_engine(tiny_dir, kv_cache_blocks=64)))
        cards = client.get(url + MODELS_PATH).json()["data"]
        base = cards[0]["id"]
        assert [(c["id"], c.get("parent"), c["root"]) for c in cards] == [(base, None, base),
                                                                         ("sql", base, adapters["sql"])]
        assert lora_info(client.get(url + "/metrics").text)[0]["max_lora"] == "2"

        # an adapter's answer is its own, and its blocks are hashed with its name, apart from the base model's
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
        as_sql = client.post(url + "/v1/completions", json={**body, "model": "sql"}).json()
        as_base = client.post(url + "/v1/completions", json=body).json()
        assert as_sql["model"] == "sql" and as_sql["choices"][0]["text"] != as_base["choices"][0]["text"]
        assert as_base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the adapter's blocks are not its
        with client.stream("GET", f"{url}/v1/kv/events", params={"after": 0}) as events:
            first = httpx.Response(200, content=next(events.iter_lines())).json()
        stored = [h for e in first["events"] if e["type"] == "stored" for h in e["block_hashes"]]
        algo, root = HashAlgo(EngineConfig.hash_algo), EngineConfig.hash_root
        weights = cards[1][LORA_FINGERPRINT_FIELD]  # the weights' fingerprint: its blocks are hashed with it too
        assert stored[:2] == block_hashes(prompt[:32], 16, BlockExtra("sql", None, weights), algo, root)

        # unknown adapter: the engine's 404, field for field
        unknown = {**body, "model": "nope"}
        sim_404, real_404 = (client.post(u + "/v1/completions", json=unknown) for u in (url, real))
        assert sim_404.status_code == real_404.status_code == 404
        strip = ("message",)  # it names each engine's base model
        assert {k: v for k, v in sim_404.json()["error"].items() if k not in strip} == \
            {k: v for k, v in real_404.json()["error"].items() if k not in strip}

        # loaded and unloaded at run time; other weights under a loaded name taken in place (load_inplace: every slot
        # taken, the adapter idle, so in its own slot), hashed apart and answering apart
        loaded = client.post(url + LOAD_LORA_PATH, json={"lora_name": "poet", "lora_path": adapters["poet"]})
        assert loaded.status_code == 200, loaded.text
        assert [c["id"] for c in client.get(url + MODELS_PATH).json()["data"]] == [base, "sql", "poet"]
        full = client.post(url + LOAD_LORA_PATH, json={"lora_name": "extra", "lora_path": adapters["sql-v2"]})
        assert full.status_code == 409  # max_loras 2
        swapped = client.post(url + LOAD_LORA_PATH, json={"lora_name": "sql", "lora_path": adapters["sql-v2"],
                                                          "load_inplace": True})
        assert swapped.status_code == 200, swapped.text
        (card,) = [c for c in client.get(url + MODELS_PATH).json()["data"] if c["id"] == "sql"]
        assert card[LORA_FINGERPRINT_FIELD] != weights
        again = client.post(url + "/v1/completions", json={**body, "model": "sql"}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # none of the old weights' blocks
        assert again["choices"][0]["text"] != as_sql["choices"][0]["text"]  # the new weights' answer
        assert client.post(url + UNLOAD_LORA_PATH, json={"lora_name": "sql"}).status_code == 200
        missing = client.post(url + LOAD_LORA_PATH, json={"lora_name": "x", "lora_path": "/no/such/dir"})
        assert missing.status_code == 400 and "PEFT" in missing.json()["error"]["message"]
        assert client.post(url + UNLOAD_LORA_PATH, json={"lora_name": "sql"}).status_code == 404


@pytest.mark.slow
def test_a_router_over_simulated_engines_sends_an_adapters_requests_to_its_engine_and_caches_them_apart(
        bundled_dir: Path, adapters: dict[str, str]) -> None:
    with ExitStack() as stack:
        with_sql = stack.enter_context(serve_engine(sim(lora_modules={"sql": adapters["sql"]})))
        plain = stack.enter_context(serve_engine(sim()))
        base = httpx.get(plain + MODELS_PATH).json()["data"][0]["id"]
        router = build_router(RouterConfig(pods=[with_sql, plain], scrape_interval_seconds=0.1), bundled_dir)
        url = stack.enter_context(serve_router(router))
        wait_for(lambda: listed(url) == {base: None, "sql": base}, "the router never listed the adapter")
        wait_for(lambda: router.pods.pods[with_sql].lora.max_lora == 2, "the engine's LoRA metric was never read")

        for seed in range(4):  # distinct prompts: only who serves the adapter decides
            ids = [(seed * 7919 + i * 104729) % 48000 + 200 for i in range(70)]
            body = {"model": "sql", "prompt": ids, "max_tokens": 2, "temperature": 0}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == with_sql, reply.text
        info = router.request_info(CompletionRequest.model_validate(body), 0)
        confirmed = lambda: router.index.match(info.block_hashes, [with_sql]).get(with_sql)  # noqa: E731
        wait_for(lambda: confirmed() is not None and confirmed().blocks == 4,  # type: ignore[union-attr]
                 "the simulated engine's KV events never confirmed the router's hashes of the adapter's prompt")
        base_info = router.request_info(CompletionRequest.model_validate({**body, "model": base}), 0)
        assert not set(base_info.block_hashes) & set(info.block_hashes)

        gone = httpx.post(url + "/v1/completions", json={**body, "model": "poet"}, timeout=60)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert httpx.post(plain + LOAD_LORA_PATH, json={"lora_name": "poet", "lora_path": adapters["poet"]},
                          timeout=60).status_code == 200
        wait_for(lambda: "poet" in listed(url), "an adapter loaded at run time never reached the router")
        reply = httpx.post(url + "/v1/completions", json={**body, "model": "poet"}, timeout=60)
        assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == plain
