"""A router and a new engine that waits for its warm-up (router/pods.py, issue 5): while the engine's /health says
"warming" the pod is not a candidate (unhealthy to the picker, logged as warming rather than down), and it becomes
one as soon as /health turns 200. A real engine over the tiny model, served in this process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.engine import Engine
from kvmesh.engine.protocol import READY_PATH
from kvmesh.router.index import PrefixIndex
from kvmesh.router.pods import PodSet

from .conftest import make_engine
from .engines import serve_engine
from .waiting import eventually


@contextmanager
def warming_engine(tiny_dir: Path) -> Iterator[tuple[str, Engine]]:
    """A started engine with a long grace behind its app in a thread; yields its URL (answering, not healthy)."""
    engine = make_engine(tiny_dir, kv_cache_blocks=64, warmup_grace_seconds=600)
    with serve_engine(engine, healthy=False) as url:
        yield url, engine


def test_a_warming_pod_is_no_candidate_until_its_health_turns_ok(tiny_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvmesh.router.pods")
    with warming_engine(tiny_dir) as (url, engine):
        expected = engine.kv_config

        async def main() -> None:
            pods = PodSet([url], expected, PrefixIndex(), scrape_interval=0.05, stale_after=5.0)
            await pods.start()
            try:
                pod = pods.pods[url]
                await eventually(lambda: pod.warming)
                await asyncio.sleep(0.2)  # several scrapes: still warming, still no candidate
                (state,) = pods.snapshot()
                assert pod.warming and not state.healthy and not state.draining
                assert any("is warming up" in r.getMessage() for r in caplog.records)
                assert not any("unreachable" in r.getMessage() for r in caplog.records), "warming is not down"
                alive = await asyncio.to_thread(httpx.get, url + "/livez")  # the liveness probe's: not restarted
                assert alive.status_code == 200 and alive.json() == {"status": "alive"}

                await asyncio.to_thread(httpx.post, url + READY_PATH)  # the operator: nothing to copy
                await eventually(lambda: pods.snapshot()[0].healthy)
                assert not pod.warming and pod.kv_config is not None, "admitted, its KV config read"
                assert any("no longer warming" in r.getMessage() for r in caplog.records)
            finally:
                await pods.stop()

        asyncio.run(asyncio.wait_for(main(), 60))
