"""Kubernetes discovery: the pure rule from EndpointSlices to the router's pods, PodSet's run-time membership,
the settings, and the watcher against kmock's KubernetesEmulator, which stands in for a kube-apiserver (none
runs here): a real HTTP server that the official kubernetes client lists and watches like the real one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kubernetes.client import (
    DiscoveryV1EndpointPort,
    V1Endpoint,
    V1EndpointConditions,
    V1EndpointSlice,
    V1ObjectMeta,
)

from kvmesh.engine.protocol import KVConfig
from kvmesh.processes import free_port
from kvmesh.router.config import RouterConfig, load_router_config
from kvmesh.router.discovery import desired_pods, endpoint_url
from kvmesh.router.index import PrefixIndex
from kvmesh.router.pods import PodSet

from .waiting import eventually

SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
EXPECTED = KVConfig(model="", block_size=16, hash_algo="xxh3_64", hash_root=0, tokenizer_fingerprint="t",
                    num_device_blocks=0, boot_id="")


def endpoint(address: str, ready: bool | None = True, serving: bool | None = None,
             terminating: bool | None = None) -> V1Endpoint:
    return V1Endpoint(addresses=[address],
                      conditions=V1EndpointConditions(ready=ready, serving=serving, terminating=terminating))


def make_slice(name: str, endpoints: list[V1Endpoint], ports: list[tuple[str | None, int]] | None = None,
               address_type: str = "IPv4") -> V1EndpointSlice:
    return V1EndpointSlice(
        metadata=V1ObjectMeta(name=name),
        address_type=address_type,
        endpoints=endpoints,
        ports=[DiscoveryV1EndpointPort(name=n, port=p) for n, p in (ports if ports is not None else [("http", 80)])],
    )


# ---- the pure rule ---------------------------------------------------------------------------------------------


def test_ready_endpoints_of_every_slice_are_routed_to() -> None:
    slices = [make_slice("a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]), make_slice("b", [endpoint("10.0.0.3")])]
    assert desired_pods(slices) == {"http://10.0.0.1:80": False, "http://10.0.0.2:80": False,
                                    "http://10.0.0.3:80": False}


def test_not_ready_endpoints_are_left_out_and_unset_conditions_read_as_the_api_says() -> None:
    slices = [make_slice("a", [endpoint("10.0.0.1", ready=False, serving=False), endpoint("10.0.0.2", ready=None),
                               V1Endpoint(addresses=["10.0.0.3"])])]
    assert desired_pods(slices) == {"http://10.0.0.2:80": False, "http://10.0.0.3:80": False}


def test_terminating_endpoints_drain_while_serving_and_leave_after() -> None:
    slices = [make_slice("a", [
        endpoint("10.0.0.1", ready=False, serving=True, terminating=True),  # finishing its streams
        endpoint("10.0.0.2", ready=False, serving=False, terminating=True),  # done: gone
        endpoint("10.0.0.3", ready=True, terminating=True),  # publishNotReadyAddresses: still terminating
    ])]
    assert desired_pods(slices) == {"http://10.0.0.1:80": True, "http://10.0.0.3:80": True}


def test_an_endpoint_in_two_slices_drains_only_if_both_say_so() -> None:
    moving = [make_slice("old", [endpoint("10.0.0.1", ready=False, serving=True, terminating=True)]),
              make_slice("new", [endpoint("10.0.0.1")])]
    assert desired_pods(moving) == {"http://10.0.0.1:80": False}
    assert desired_pods(reversed(moving)) == {"http://10.0.0.1:80": False}


def test_the_port_is_the_one_named_http_or_else_the_first() -> None:
    named = make_slice("a", [endpoint("10.0.0.1")], ports=[("metrics", 9090), ("http", 8000)])
    unnamed = make_slice("b", [endpoint("10.0.0.2")], ports=[(None, 8001), ("grpc", 9000)])
    portless = make_slice("c", [endpoint("10.0.0.3")], ports=[])
    assert desired_pods([named, unnamed, portless]) == {"http://10.0.0.1:8000": False, "http://10.0.0.2:8001": False}
    assert desired_pods([named], port_name="metrics") == {"http://10.0.0.1:9090": False}


def test_ipv6_addresses_are_bracketed() -> None:
    assert endpoint_url("fd00::5", 8000) == "http://[fd00::5]:8000"
    assert desired_pods([make_slice("a", [endpoint("fd00::5")], address_type="IPv6")]) == {"http://[fd00::5]:80": False}


# ---- settings ----------------------------------------------------------------------------------------------------


def test_static_needs_pods_and_kubernetes_takes_none(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one pod"):
        load_router_config(None)
    with pytest.raises(ValueError, match="list no pods"):
        load_router_config(None, {"discovery": "kubernetes", "pods": ["http://10.0.0.1:8000"]})
    with pytest.raises(ValueError, match="discovery 'consul'"):
        load_router_config(None, {"discovery": "consul", "pods": ["http://10.0.0.1:8000"]})
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"router": {"discovery": "kubernetes", "pool": "demo", "namespace": "ml"}}))
    config = load_router_config(path)
    assert (config.discovery, config.namespace, config.kubeconfig) == ("kubernetes", "ml", None)
    assert config.endpoint_selector() == "kvmesh.io/pool=demo,kvmesh.io/role!=router"
    assert RouterConfig(label_selector="app=engines").endpoint_selector() == "app=engines"


# ---- PodSet membership at run time -------------------------------------------------------------------------------


def run(main: Callable[[], Coroutine[Any, Any, None]], seconds: float = 20.0) -> None:
    """Run an async test body with a hard bound, so a stuck watch fails the test instead of hanging it."""
    asyncio.run(asyncio.wait_for(main(), seconds))


def running_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if not t.done()}


def test_sync_adds_drains_and_removes_pods_with_their_tasks() -> None:
    port = free_port()
    a, b = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"

    async def main() -> None:
        index = PrefixIndex()
        pods = PodSet([a], EXPECTED, index, scrape_interval=0.05, stale_after=2.0)
        await pods.start()
        pods.sync({a: False, b: False})
        assert set(pods.pods) == {a, b}
        assert {f"scrape {b}", f"events {b}"} <= running_tasks()
        pods.sync({a: False, b: True})
        assert pods.pods[b].draining and not pods.pods[a].draining
        await asyncio.sleep(0.15)  # a few failed scrapes: draining still holds
        assert [s.draining for s in pods.snapshot()] == [False, True]
        index.add_provisional(b, [1, 2, 3], time.monotonic(), ttl=60)
        pods.sync({a: False})
        assert set(pods.pods) == {a} and b not in index.pods()
        await eventually(lambda: not {f"scrape {b}", f"events {b}"} & running_tasks(),  # cancelled mid-connect
                         "the removed pod's tasks to end")
        await pods.stop()
        assert not {f"scrape {a}", f"events {a}"} & running_tasks()

    run(main)


# ---- the watcher against the emulator ----------------------------------------------------------------------------


def slice_body(name: str, namespace: str, addresses: dict[str, dict[str, bool]], port: int) -> dict[str, Any]:
    """An EndpointSlice as the API serves it: address -> conditions."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kvmesh.io/pool": "demo", "kubernetes.io/service-name": "demo-engines"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": conditions} for address, conditions in addresses.items()],
    }


def write_kubeconfig(path: Path, server: str, namespace: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test", "namespace": namespace}}],
        "current-context": "emulator",
    }))
    return path


@pytest.mark.timeout(30)
def test_the_watcher_follows_endpointslices_in_the_emulator(tmp_path: Path) -> None:
    """Slices created, marked terminating and deleted in the emulator reach the PodSet: pods join, drain, leave
    (and leave the index). The first list fails (500) and the first watch expires (410 Gone): the watcher backs
    off, lists again and carries on. A slice in another namespace is never seen."""
    port = free_port()
    ready, draining = {"ready": True}, {"ready": False, "serving": True, "terminating": True}
    one, two, three = (f"http://127.0.0.{i}:{port}" for i in (2, 3, 4))

    async def main() -> None:
        async with kmock.KubernetesEmulator() as k8s, kmock.Server(k8s) as server:
            k8s.resources["discovery.k8s.io/v1/endpointslices"] = {"kind": "EndpointSlice", "namespaced": True}
            failed: list[str] = []

            def once(kind: str) -> Callable[[kmock.Request], bool]:
                def first(_: kmock.Request) -> bool:
                    if kind in failed:
                        return False
                    failed.append(kind)
                    return True
                return first

            k8s[kmock.action.LIST][once("list")] << kmock.KubernetesError(status=500, reason="InternalError")
            expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                   "message": "too old resource version"}}
            k8s[kmock.action.WATCH][once("watch")] << (expired,)

            ns = SLICES.format(ns="pool")
            await k8s.post(ns, json=slice_body("demo-a", "pool", {"127.0.0.2": ready, "127.0.0.3": ready}, port))
            await k8s.post(SLICES.format(ns="elsewhere"),
                           json=slice_body("demo-x", "elsewhere", {"127.0.0.9": ready}, port))

            kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/"), "pool")
            config = load_router_config(None, {"discovery": "kubernetes", "pool": "demo",
                                               "kubeconfig": str(kubeconfig), "scrape_interval_seconds": 0.05})
            index = PrefixIndex()
            pods = PodSet.from_config(config, EXPECTED, index)
            await pods.start()
            try:
                await eventually(lambda: set(pods.pods) == {one, two})
                await eventually(lambda: len(k8s[kmock.action.LIST]) == 3)  # failed, listed, listed after 410
                assert failed == ["list", "watch"] and set(pods.pods) == {one, two}

                await k8s.post(ns, json=slice_body("demo-b", "pool", {"127.0.0.4": ready}, port))
                await eventually(lambda: set(pods.pods) == {one, two, three})
                assert not any(pod.draining for pod in pods.pods.values())

                await k8s.patch(f"{ns}/demo-a", json=slice_body("demo-a", "pool",
                                                                {"127.0.0.2": ready, "127.0.0.3": draining}, port))
                await eventually(lambda: pods.pods[two].draining)
                assert not pods.pods[one].draining and set(pods.pods) == {one, two, three}

                index.add_provisional(three, [7, 8], time.monotonic(), ttl=60)
                await k8s.delete(f"{ns}/demo-b")
                await eventually(lambda: set(pods.pods) == {one, two})
                assert three not in index.pods()
            finally:
                await pods.stop()
            assert not pods.discovery._thread.is_alive()  # type: ignore[union-attr]

    run(main)
