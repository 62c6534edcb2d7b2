"""`kvmesh status` (its options: cli.py): a router's view of its pool as a table (router/pool_status.py makes the
document), once or every few seconds, or the document itself as JSON. A router with API keys asks one for it:
`$KVMESH_API_KEY`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from kvmesh.bench.serve import user_http_client
from kvmesh.cli import API_KEY_ENV, api_key_headers
from kvmesh.engine.internal_token import TOKEN_REFUSED_CODE
from kvmesh.engine.protocol import STARTING_POD_STATES, TIERS
from kvmesh.router.pool_status import POOL_STATUS_PATH

if TYPE_CHECKING:
    import httpx

_COLUMNS = ("POD", "STATE", "ROLE", "RUN", "WAIT", "SENT", "KV", "P90", "P(OVER)", f"INDEXED {'/'.join(TIERS)}", "LAG",
            "AGE")


def run(args: argparse.Namespace) -> int:
    """Print the router's view once (1 if it cannot be had), or every `--watch` seconds until Ctrl-C: then a poll
    that fails (the router restarting, a pool still starting) is said and the next one tried, as `watch` would."""
    import httpx

    if args.watch is not None and args.watch <= 0:
        print("kvmesh status: --watch takes a number of seconds above 0", file=sys.stderr)
        return 2
    headers = api_key_headers(getattr(args, "api_key", None))
    with httpx.Client(base_url=args.url, timeout=10, headers=headers, **user_http_client(args.url)) as client:
        try:
            while True:
                doc, problem = _poll(client, args.url)
                if doc is not None:
                    print(json.dumps(doc, indent=2) if args.json else render(doc), flush=True)
                else:
                    print(f"kvmesh status: {problem}", file=sys.stderr, flush=True)
                if args.watch is None:
                    return 0 if doc is not None else 1
                time.sleep(args.watch)
                print()
        except KeyboardInterrupt:
            return 0


def _poll(client: httpx.Client, url: str) -> tuple[dict[str, Any] | None, str]:
    """The router's pool document, or None and why not (no answer, not a 200, not JSON)."""
    import httpx

    try:
        reply = client.get(POOL_STATUS_PATH)
    except httpx.TransportError as exc:
        return None, f"{url} did not answer: {exc or type(exc).__name__}"
    if reply.status_code == 401:
        if _error_code(reply) == TOKEN_REFUSED_CODE:  # an engine of a pool: it answers its pool's token only
            return None, (f"{url} is a pool's engine, not a router (it answered HTTP 401 {TOKEN_REFUSED_CODE}): "
                          "give --url the router's URL (kvmesh up's: http://127.0.0.1:8080)")
        return None, (f"{url}{POOL_STATUS_PATH} answered HTTP 401: this router has API keys; set ${API_KEY_ENV} "
                      "(or --api-key) to one of them")
    if reply.status_code == 403:
        return None, (f"{url}{POOL_STATUS_PATH} answered HTTP 403: this API key's tenant may not read the pool's "
                      "status; the router's tenants config must give it `read_pool_status: true` (docs/router.md, "
                      "\"The pool as a router sees it\")")
    if reply.status_code != 200:
        return None, (f"{url}{POOL_STATUS_PATH} answered HTTP {reply.status_code} (is it a kvmesh router?): "
                      f"{reply.text[:200]}")
    try:
        doc = reply.json()
    except ValueError:
        return None, f"{url}{POOL_STATUS_PATH} answered something that is not JSON: {reply.text[:200]!r}"
    if not isinstance(doc, dict):
        return None, f"{url}{POOL_STATUS_PATH} answered JSON that is no pool document: {reply.text[:200]!r}"
    return doc, ""


def _error_code(reply: httpx.Response) -> object:
    """The `code` of an OpenAI-shaped error body (`{"error": {"code": ...}}`), or None."""
    try:
        error = reply.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def render(doc: dict[str, Any]) -> str:
    """The table: a line a pod (numbers as the router last scraped them; SENT: requests this router has in flight
    there; INDEXED: blocks of its cache in the router's index by tier), then the pool's totals."""
    rows = [_COLUMNS] + [_row(pod) for pod in doc["pods"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    serving = sum(1 for pod in doc["pods"] if pod["state"] == "healthy")
    starting = sum(1 for pod in doc["pods"] if pod["state"] in STARTING_POD_STATES)
    lines.append(f"{len(doc['pods'])} pods, {serving} healthy" + (f", {starting} starting" if starting else "")
                 + f"; {doc['index']['blocks']} distinct blocks indexed")
    lines += [f"{pod['name']}: {pod['reason']}" for pod in doc["pods"] if pod["reason"]]
    return "\n".join(lines)


def _row(pod: dict[str, Any]) -> tuple[str, ...]:
    def percent(x: float) -> str:
        return f"{100 * x:.0f}%"

    blocks = pod["indexed_blocks"]
    age = pod["metrics_age_seconds"]
    lag = pod["event_lag_batches"]
    return (pod["name"].removeprefix("http://").removeprefix("https://"),
            pod["state"] + (" (stale)" if pod["stale"] and pod["state"] == "healthy" else "")
            + (f" {percent(progress)}" if (progress := pod.get("load_progress")) is not None else ""),
            pod["role"], str(pod["running"]), str(pod["waiting"]), str(pod["inflight"]),
            percent(pod["kv_usage"]), percent(pod["forecast_usage_p90"]), f"{pod['overload_probability']:.2f}",
            "/".join(str(blocks[t]) for t in TIERS),
            "-" if lag is None else str(lag), "-" if age is None else f"{age:.1f}s")
