"""What the router remembers of a try: a pod that refuses a request (503) or is never reached keeps none of its
provisional index entries (they would credit it with a prefix it will not compute and steer the next requests to
the pod that refuses), and each request counts in a pod's load and prefill queue once: in what the router sent
since the pod's last report until a report that began after it comes back, then in the report's own numbers.
Loopback stub pods (kvmesh bench router's stub), as in test_router_broken_reply.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from kvmesh.engine.openai_types import CompletionRequest
from kvmesh.router.app import Booking
from kvmesh.router.index import PrefixIndex
from kvmesh.router.pods import Pod, Unseen

from .test_router_broken_reply import routed, stub_pod

PROMPT = {"prompt": "the same long prompt, word after word, " * 20, "max_tokens": 1}


async def refuse(body: dict, writer: asyncio.StreamWriter) -> bool:
    """A pod draining: 503 to every completion, the connection kept."""
    out = b'{"error": {"message": "draining", "type": "server_error"}}'
    writer.write(b"HTTP/1.1 503 X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
    await writer.drain()
    return True


def test_a_pod_that_refuses_keeps_no_provisional_prefix(tiny_dir: Path) -> None:
    with stub_pod(tiny_dir, answer=refuse) as refusing, stub_pod(tiny_dir) as serving, \
            routed(tiny_dir, [refusing.url, serving.url]) as (url, router):
        info = router.request_info(CompletionRequest(**PROMPT), 0)  # type: ignore[arg-type]
        assert len(info.block_hashes) > 4
        # an earlier decision sent this prompt to the refusing pod: it is the first choice for it now
        router.index.add_provisional(refusing.url, info.block_hashes, time.monotonic(), 60.0)
        reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=30)
        assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == serving.url
        assert len(refusing.bodies) == 1  # tried first (its prefix), refused, then the other pod
        matches = router.index.match(info.block_hashes, now=time.monotonic())
        assert refusing.url not in matches  # its entries went with the refused try, not after their TTL
        assert matches[serving.url].blocks == len(info.block_hashes)  # the pod that took it holds them
        reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=30)
        assert reply.headers["x-kvmesh-pod"] == serving.url and len(refusing.bodies) == 1
        assert all(p.inflight == 0 and p.unseen.requests == 0 for p in router.pods.pods.values())


async def hang_up(body: dict, writer: asyncio.StreamWriter) -> bool:
    """A pod failing before its first byte: the connection closed without an answer."""
    return False


def test_a_pod_that_fails_before_its_first_byte_keeps_no_provisional_prefix(tiny_dir: Path) -> None:
    with stub_pod(tiny_dir) as serving, stub_pod(tiny_dir, answer=hang_up) as leaving, \
            routed(tiny_dir, [leaving.url, serving.url]) as (url, router):
        info = router.request_info(CompletionRequest(**PROMPT), 0)  # type: ignore[arg-type]
        router.index.add_provisional(leaving.url, info.block_hashes, time.monotonic(), 60.0)
        reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=30)
        assert reply.status_code == 200 and reply.headers["x-kvmesh-pod"] == serving.url
        assert leaving.bodies  # tried first
        assert leaving.url not in router.index.match(info.block_hashes, now=time.monotonic())


def test_a_booking_counts_in_what_the_pods_report_lacks_until_a_later_report() -> None:
    pod = Pod("http://a")
    index = PrefixIndex()
    expires = index.add_provisional(pod.name, (1, 2, 3), now=0.0, ttl=5.0)
    sent = Booking(pod, 500, (index, (1, 2, 3), expires))
    assert (pod.inflight, pod.unseen.requests, pod.unseen.tokens) == (1, 1, 500)
    epoch = pod.unseen.reading()  # a scrape begins...
    during = Booking(pod, 300)  # ...a request is sent while it runs: it may or may not be in its numbers
    pod.unseen.read(epoch)  # ...and comes back: the first request is in the pod's running and queue now
    assert (pod.inflight, pod.unseen.requests, pod.unseen.tokens) == (2, 1, 300)
    sent.close()  # ended after the report counted it: the report overstates the pod by it until the next read
    assert (pod.inflight, pod.unseen.requests, pod.unseen.ended_requests) == (1, 1, 1)
    during.close()
    during.close()  # once only
    assert (pod.inflight, pod.unseen.requests, pod.unseen.tokens, pod.unseen.ended_requests) == (0, 0, 0, 1)
    pod.unseen.read(pod.unseen.reading())  # a read begun after it ended: its numbers lack it
    assert pod.unseen.ended_requests == 0
    assert index.match((1, 2, 3), now=1.0)["http://a"].blocks == 3  # closed, answered: its entries stay

    refused = Booking(pod, 200, (index, (1, 2, 3), index.add_provisional(pod.name, (1, 2, 3), now=1.0, ttl=5.0)))
    refused.withdraw()
    assert (pod.inflight, pod.unseen.requests, pod.unseen.tokens) == (0, 0, 0)
    assert index.match((1, 2, 3), now=2.0) == {}
    assert Unseen().requests == 0
