"""`kvmesh status` (its options: cli.py): a router's view of its pool as a table (router/pool_status.py makes the
document), once or every few seconds, or the document itself as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvmesh.engine.protocol import STARTING_POD_STATES, TIERS
from kvmesh.router.pool_status import POOL_STATUS_PATH

_COLUMNS = ("POD", "STATE", "ROLE", "RUN", "WAIT", "SENT", "KV", "P90", "P(OVER)", f"INDEXED {'/'.join(TIERS)}", "LAG",
            "AGE")


def run(args: argparse.Namespace) -> int:
    import httpx

    if args.watch is not None and args.watch <= 0:
        print("kvmesh status: --watch takes a number of seconds above 0", file=sys.stderr)
        return 2
    with httpx.Client(base_url=args.url, timeout=10) as client:
        try:
            while True:
                try:
                    reply = client.get(POOL_STATUS_PATH)
                except httpx.TransportError as exc:
                    print(f"kvmesh status: {args.url} did not answer: {exc}", file=sys.stderr)
                    return 1
                if reply.status_code != 200:
                    print(f"kvmesh status: {args.url}{POOL_STATUS_PATH} answered HTTP {reply.status_code} (is it a "
                          f"kvmesh router?): {reply.text[:200]}", file=sys.stderr)
                    return 1
                doc = reply.json()
                print(json.dumps(doc, indent=2) if args.json else render(doc), flush=True)
                if args.watch is None:
                    return 0
                time.sleep(args.watch)
                print()
        except KeyboardInterrupt:
            return 0


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
