"""OpenAI's GET /v1/models/{model} (`client.models.retrieve`) on the router's two edges: the card of the pool's
/v1/models, or 404 model_not_found; behind the API key; an adapter's name may hold "/". The pods' state is set by
hand, as tests/test_router_lora.py sets it: no pod processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvmesh.processes import free_port
from kvmesh.router.app import Router, build_router, create_router_app
from kvmesh.router.auth import ApiKeys, hash_key
from kvmesh.router.config import RouterConfig
from kvmesh.router.extproc import start_ext_proc

from .test_router_extproc import full_duplex, refusal, request_headers
from .test_router_lora import BASE, POD_A, POD_B, set_pods

ADAPTER = "team/sql-v2"  # LORA_NAME_PATTERN allows "/"
KEY = {"authorization": "Bearer sk-a"}


@pytest.fixture
def router(bundled_dir: Path) -> Router:
    r = build_router(RouterConfig(pods=[POD_A, POD_B], stale_after_seconds=3600.0), bundled_dir)
    set_pods(r, {POD_A: (ADAPTER,), POD_B: ()}, {})
    r.keys = ApiKeys({hash_key("sk-a"): "acme"})
    return r


@pytest.mark.asyncio
async def test_the_http_edge_retrieves_a_model_behind_the_key(router: Router) -> None:
    app = create_router_app(router)  # no lifespan here: the pods keep the state set above
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        listed = (await http.get("/v1/models", headers=KEY)).json()["data"]
        for card in listed:
            reply = await http.get(f"/v1/models/{card['id']}", headers=KEY)
            assert reply.status_code == 200 and reply.json() == card
        assert (await http.get(f"/v1/models/{ADAPTER}", headers=KEY)).json()["parent"] == BASE
        assert (await http.get("/v1/models/team%2Fsql-v2", headers=KEY)).json()["id"] == ADAPTER
        for unknown in ("poet", "team/poet"):
            reply = await http.get(f"/v1/models/{unknown}", headers=KEY)
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model",
                                                                      "invalid_request_error")
            assert f"`{unknown}` does not exist" in error["message"]
        refused = await http.get(f"/v1/models/{BASE}")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        # the official client's retrieve, over the same app
        client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="sk-a", http_client=http, max_retries=0)
        assert (await client.models.retrieve(ADAPTER)).id == ADAPTER
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("poet")


@pytest.mark.asyncio
async def test_a_pool_starting_from_zero_retrieves_what_it_served_last(bundled_dir: Path) -> None:
    """While requests are held (hold_without_pods_seconds) and no pod is up, /v1/models lists what the pool
    served last: a model of it is retrieved alike."""
    router = build_router(RouterConfig(pods=[POD_A], stale_after_seconds=3600.0, hold_without_pods_seconds=5.0),
                          bundled_dir)
    set_pods(router, {POD_A: (ADAPTER,)}, {})
    assert router.model(ADAPTER)["id"] == ADAPTER  # seen once: remembered
    router.pods.pods[POD_A].healthy = False
    assert [c["id"] for c in router.models()["data"]] == [BASE, ADAPTER]
    assert router.model(ADAPTER)["parent"] == BASE


@pytest_asyncio.fixture
async def stub(router: Router) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    port = free_port()
    server = await start_ext_proc(router, "127.0.0.1", port, tls=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)
    await server.stop(settle=0.0)


@pytest.mark.asyncio
async def test_the_gateway_edge_retrieves_a_model(router: Router, stub: pb_grpc.ExternalProcessorStub) -> None:
    """A Gateway sends the route to the picker, which answers it itself, as it answers /v1/models."""
    async def get(path: str, **headers: str) -> tuple[int, dict]:
        status, body, _ = refusal((await full_duplex(stub, [request_headers(path, "GET", end_of_stream=True,
                                                                            **headers)]))[0])
        return status, body  # type: ignore[return-value]

    assert await get(f"/v1/models/{ADAPTER}", **KEY) == (200, router.model(ADAPTER))
    assert (await get("/v1/models/team%2Fsql-v2", **KEY))[1]["id"] == ADAPTER
    status, error = await get("/v1/models/team/poet", **KEY)
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert (await get(f"/v1/models/{BASE}"))[0] == 401
    status, error = await get("/v1/models/", **KEY)  # no id: no route
    assert status == 404 and error["error"]["code"] == "not_found"
