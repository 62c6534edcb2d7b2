"""A router and engine that run for weeks: what clients choose (model names, API keys, paths, headers, bodies,
when they hang up) must not add Prometheus series or leave per-request state behind. A few hundred varied
requests through a router in front of a simulated engine; the full soak (tens of thousands, RSS and sizes
sampled) is the same mix, run by hand."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.bench.sim_engine import PROFILES, LatencyModel
from kvmesh.bench.sim_runner import SimEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import Engine
from kvmesh.router.app import Router, build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_engine, serve_router, wait_idle
from .test_router_disconnect import wait_nothing_in_flight

FREE = LatencyModel(0.0, 0.0, 0.0, 0.0, 1e15)  # every step takes no modelled time
KEYS = {"key-acme": "acme", "key-globex": "globex"}


@dataclass
class Pool:
    router: Router
    url: str  # the router's
    engine: Engine
    engine_url: str


@pytest.fixture
def pool(bundled_dir: Path, tmp_path: Path) -> Iterator[Pool]:
    keys = tmp_path / "keys.yaml"
    keys.write_text(json.dumps({"keys": [{"tenant": t, "key_sha256": hashlib.sha256(k.encode()).hexdigest()}
                                         for k, t in KEYS.items()]}))
    engine = SimEngine(EngineConfig(kv_cache_blocks=128), PROFILES["cpu-smollm"], FREE)
    with serve_engine(engine) as engine_url:
        router = build_router(RouterConfig(pods=[engine_url], api_keys_file=str(keys), cache_salt_secret="s",
                                           tenants={"globex": {"max_concurrent_requests": 1}}), bundled_dir)
        with serve_router(router) as url:
            yield Pool(router, url, engine, engine_url)


def series(metrics_text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items())))
            for family in text_string_to_metric_families(metrics_text) for s in family.samples}


def varied_requests(client: httpx.Client, url: str, model: str, rng: random.Random, count: int) -> set[str]:
    """`count` requests as clients send them: known and unknown models and keys, random paths and headers,
    malformed bodies, streams cut after their first line. Returns the random values sent."""
    sent: set[str] = set()
    for i in range(count):
        token = f"zq{rng.getrandbits(40):x}"
        sent.add(token)
        key = rng.choice([*KEYS, f"bad-{token}"])
        headers = {"authorization": f"Bearer {key}", "x-kvmesh-workload": f"w-{token}",
                   "x-kvmesh-priority": rng.choice(["1", "7", token])}
        body = {"model": rng.choice([model, f"m-{token}"]), "prompt": f"hello {token} " * rng.randint(1, 20),
                "max_tokens": rng.randint(1, 4)}
        kind = i % 5
        if kind == 0:
            client.post(url + "/v1/completions", headers=headers, json=body)
        elif kind == 1:  # a stream its client cuts after the first line
            body |= {"stream": True, "max_tokens": 40, "ignore_eos": True}
            with client.stream("POST", url + "/v1/completions", headers=headers, json=body) as reply:
                next(reply.iter_lines(), None)
        elif kind == 2:
            client.post(url + "/v1/chat/completions", headers=headers,
                        json={"model": body["model"], "messages": [{"role": token, "content": token}]})
        elif kind == 3:
            client.post(url + rng.choice(["/v1/completions", "/v1/chat/completions"]), headers=headers,
                        content=rng.choice([b"{" + token.encode(), json.dumps({token: 1, "prompt": 5}).encode()]))
        else:
            client.request(rng.choice(["GET", "POST"]), f"{url}/{token}/{token}", headers=headers)
    return sent


def test_client_chosen_values_add_no_series_and_leave_no_state(pool: Pool) -> None:
    rng = random.Random(110)
    model = pool.engine.model_name
    router_start = series(httpx.get(pool.url + "/metrics").text)
    with httpx.Client(timeout=30) as client:
        sent = varied_requests(client, pool.url, model, rng, 150)
        engine_after_first = series(httpx.get(pool.engine_url + "/metrics").text)
        sent |= varied_requests(client, pool.url, model, rng, 150)
    wait_idle(pool.engine)
    wait_nothing_in_flight(pool.router)
    router_text, engine_text = httpx.get(pool.url + "/metrics").text, httpx.get(pool.engine_url + "/metrics").text
    # every series the router has was made at its start: none names a model, key, path or header sent
    assert series(router_text) == router_start
    # the engine's series are made once (a finish reason first seen, a histogram's first use): more varied
    # requests add none
    assert series(engine_text) == engine_after_first
    assert not [token for token in sent if token in router_text or token in engine_text]
    # nothing of the requests is left: the engine's requests and block tables, the tenants' slots
    assert not pool.engine.requests and not pool.engine.kv.seqs
    assert not pool.engine.scheduler.waiting and not pool.engine.scheduler.running
    assert not pool.router.limits.inflight
