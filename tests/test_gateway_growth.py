"""A gateway runs for months while pools and adapters come and go: its per-model series (requests by outcome, the
split by router) are those of the models and routers its table has now, not of every one it ever served. Two stub
routers whose /v1/models list what the test says, refreshed by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvmesh.engine.protocol import MODELS_PATH, GatewayMetric
from kvmesh.router.gateway import UNKNOWN_MODEL
from kvmesh.router.gateway_app import Gateway

from .test_gateway import serve_asgi


def listing(models: list[str]) -> Starlette:
    """A router's /v1/models, listing `models` as they are when asked."""

    async def models_(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route(MODELS_PATH, models_), Route("/health", health)])


@pytest.fixture(scope="module")
def routers() -> Iterator[tuple[tuple[str, list[str]], tuple[str, list[str]]]]:
    """Two routers, each with the list of models it serves (the test edits them)."""
    first: list[str] = []
    second: list[str] = []
    with serve_asgi(listing(first)) as a, serve_asgi(listing(second)) as b:
        yield (a, first), (b, second)


def series(gateway: Gateway) -> list[tuple[str, ...]]:
    """The label values of every per-model series the gateway exports."""
    text = generate_latest(gateway.metrics.registry).decode()
    names = (f"{GatewayMetric.REQUESTS}_total{{", f"{GatewayMetric.UPSTREAM_REQUESTS}_total{{")
    return sorted(tuple(value.split('"')[1] for value in line.split("{")[1].split("}")[0].split(","))
                  for line in text.splitlines() if line.startswith(names))


def test_the_series_of_models_and_routers_that_left_the_table_go_at_the_next_refresh(
        routers: tuple[tuple[str, list[str]], tuple[str, list[str]]]) -> None:
    (a, on_a), (b, on_b) = routers
    found = {a: 100, b: 100}

    async def discover() -> dict[str, int]:
        return dict(found)

    gateway = Gateway(discover)

    async def main() -> None:
        await gateway.open()
        try:
            on_a[:], on_b[:] = ["base"], ["base"]
            for i in range(100):  # adapters loaded and unloaded one after the other, on router a
                on_a[:] = ["base", f"adapter-{i}"]
                await gateway.refresh()
                gateway.count(f"adapter-{i}", "ok")
                gateway.took(f"adapter-{i}", a)
            gateway.count("base", "ok")
            gateway.took("base", a)
            gateway.took("base", b)
            gateway.count("no-such-model", "not_found")
            on_a[:] = ["base"]
            del found[b]  # router b's pool is deleted
            await gateway.refresh()
        finally:
            await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert series(gateway) == [("base", a), ("base", "ok"), (UNKNOWN_MODEL, "not_found")]
