"""A client that leaves a non-streaming request through the router: the router closes its upstream call and
the engine aborts the request (an in-process engine whose steps are slowed, so the timing is certain)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.engine import Engine
from kvmesh.router.app import build_router
from kvmesh.router.config import RouterConfig

from .engines import serve_router
from .test_server import _aborts, served, wait_idle

__all__ = ["served"]  # the fixture: one in-process engine behind uvicorn


def test_a_client_that_leaves_stops_the_request_on_the_engine(
    served: tuple[str, Engine], tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = served
    real_run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda seqs: (time.sleep(0.01), real_run(seqs))[1])
    before = _aborts(engine)
    with serve_router(build_router(RouterConfig(pods=[url], scrape_interval_seconds=0.1), tiny_dir)) as router:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router + "/v1/completions", json={"prompt": "x", "max_tokens": 400, "ignore_eos": True},
                       timeout=0.5)
        wait_idle(engine)
        assert _aborts(engine) == before + 1
        metrics = httpx.get(router + "/metrics").text
        assert 'kvmesh_router_requests_total{outcome="client_gone",route="aggregated"} 1.0' in metrics
