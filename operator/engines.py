"""The operator's HTTP calls to engine pods: read /metrics, warm a new pod from a peer's hottest prefixes, open
a pod's warm-up gate. Each pod's failure is returned, never raised: a pod that does not answer must not stop
the tick for the others.

Every call but the scrape (/metrics is open) carries the pool's internal token (engine/internal_token.py) when
given one as `auth`: the cluster operator's, read from the pool's Secret (`InternalToken.fixed`), or `kvmesh up`'s,
read from its work folder.

Every call goes through the operator's one client for pods (operator/pod_client.py).

Kopf-free: the cluster operator (operator/handlers.py) and the local one inside `kvmesh up -f`
(operator/local.py) make the same calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import httpx

from kvmesh.engine.protocol import KV_HOT_PATH, KV_WARM_PATH, READY_PATH, serving_metrics
from kvmesh.operator.pod_client import pod_client
from kvmesh.operator.warmup import ServingPod, Warmup, WarmupUnanswered, warm_body

SCRAPE_TIMEOUT_SECONDS = 2.0
WARM_TIMEOUT_SECONDS = 60.0  # one new pod's whole warm-up; the scaling tick waits for it (targets in parallel)

SCRAPE_WORKERS = 16  # pods scraped at once

Scraper = Callable[[str], str]  # URL -> Prometheus text

def http_scrape(url: str) -> str:
    response = pod_client().get(url, timeout=SCRAPE_TIMEOUT_SECONDS)
    response.raise_for_status()
    return serving_metrics(response.text)  # a loading engine is a pod that does not answer yet


def scrape_all(urls: Mapping[str, str], scrape: Scraper = http_scrape,
               timeout: float = SCRAPE_TIMEOUT_SECONDS) -> dict[str, str | Exception]:
    """Per pod (name -> its /metrics URL), its text or why there is none, all pods at once: a slow pod delays no
    other's observation, and the whole scrape ends within `timeout` (a pod not answered by then gets a
    TimeoutError; its call ends by itself, within its own HTTP timeout)."""
    if not urls:
        return {}
    workers = ThreadPoolExecutor(max_workers=min(SCRAPE_WORKERS, len(urls)), thread_name_prefix="scrape")
    futures = {name: workers.submit(scrape, url) for name, url in urls.items()}
    wait(futures.values(), timeout=timeout)
    workers.shutdown(wait=False, cancel_futures=True)
    texts: dict[str, str | Exception] = {}
    for name, future in futures.items():
        if not future.done() or future.cancelled():  # still running, or never started (more pods than workers)
            texts[name] = TimeoutError(f"{urls[name]} did not answer within {timeout:g} s")
        elif (error := future.exception()) is not None:
            texts[name] = error if isinstance(error, Exception) else RuntimeError(repr(error))
        else:
            texts[name] = future.result()
    return texts


def http_warm(plan: Warmup, limit: int, auth: httpx.Auth | None = None) -> dict[str, dict[str, Any] | Exception | None]:
    """Read the source pod's hottest chains once, then ask every target to pull them from it, in parallel (`auth`:
    the pool's internal token, sent with each call; the targets send their own to the source as they pull)."""
    try:
        hot = pod_client().get(plan.source.url + KV_HOT_PATH, params={"limit": limit},
                               timeout=SCRAPE_TIMEOUT_SECONDS, auth=auth)
        hot.raise_for_status()
        request = warm_body(plan.source.url, hot.json(), limit)
    except (httpx.HTTPError, ValueError) as exc:
        return {t.name: exc for t in plan.targets}
    if request is None:
        return dict.fromkeys((t.name for t in plan.targets), None)

    def one(target: ServingPod) -> dict[str, Any] | Exception:
        try:
            reply = pod_client().post(target.url + KV_WARM_PATH, json=request, timeout=WARM_TIMEOUT_SECONDS,
                                      auth=auth)
            reply.raise_for_status()
            return reply.json()
        except httpx.ReadTimeout:  # it has the request: its copy goes on, and its gate opens when it ends
            return WarmupUnanswered(f"no answer from {target.name} within {WARM_TIMEOUT_SECONDS:g} s")
        except (httpx.HTTPError, ValueError) as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(8, len(plan.targets))) as pool:
        return dict(zip((t.name for t in plan.targets), pool.map(one, plan.targets), strict=True))


def http_open_gates(pods: Sequence[ServingPod], auth: httpx.Auth | None = None) -> dict[str, Exception | None]:
    """POST /v1/admin/ready to each pod (with the pool's token, `auth`), in parallel: it has nothing to be warmed
    with, so it serves now."""

    def one(pod: ServingPod) -> Exception | None:
        try:
            pod_client().post(pod.url + READY_PATH, timeout=SCRAPE_TIMEOUT_SECONDS, auth=auth).raise_for_status()
            return None
        except httpx.HTTPError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(8, len(pods))) as pool:
        return dict(zip((p.name for p in pods), pool.map(one, pods), strict=True))
