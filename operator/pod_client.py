"""The one HTTP client of the operator's calls to engine pods: scrapes, warm-ups, warm-up gates
(operator/engines.py) and LoRA adapter calls (operator/lora.py), from every tick's threads (httpx.Client is
thread-safe); each call passes its own timeout and auth.

A client made per call (`httpx.get`) loaded the CA bundle into a new TLS context each time, although the pods are
called over plain http: 36 ms of wall time (31 ms of CPU) per scrape against 2 ms with a shared client, which at
15 pools left healthy pods reported as not answering within their 2 s timeout (66 of 480 pod-ticks), holding up
scale-down. Kopf-free, and importing nothing of the operator's, so every module that calls pods can use it.
"""

from __future__ import annotations

from threading import Lock

import httpx

from kvmesh.engine.protocol import INTERNAL_HTTP_CLIENT
from kvmesh.router.proxy import IDLE_SECONDS

# No cap on connections open at once (a capped pool would queue a scrape behind other pools' and count the wait
# against its timeout: kopf runs many pools' ticks at once, each scraping many pods), and enough kept alive between
# calls for a fleet's pods; an idle one is dropped before the engines' servers drop it (the router's IDLE_SECONDS:
# at httpx's default of 5 s, uvicorn's own, a call reusing a connection idle for just under 5 s met the pod
# closing it, a reset read as a pod that does not answer)
POD_CONNECTION_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=IDLE_SECONDS)

_client: httpx.Client | None = None
_lock = Lock()


def pod_client() -> httpx.Client:
    """The shared client, made at the first call."""
    global _client
    with _lock:
        if _client is None:
            _client = httpx.Client(**INTERNAL_HTTP_CLIENT, limits=POD_CONNECTION_LIMITS)
        return _client


def close_pod_client() -> None:
    """Close the shared client's connections (at the operator's exit); a later call makes a new one."""
    global _client
    with _lock:
        client, _client = _client, None
    if client is not None:
        client.close()
