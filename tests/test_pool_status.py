"""The router's view of its pool (router/pool_status.py) and `kvmesh status`'s table of it, from real pod records, a
real prefix index fed by event batches, and the pod set's own snapshots. Through a router: tests/test_router_e2e.py."""

from __future__ import annotations

from kvmesh.engine.protocol import KVEvent, KVEventBatch
from kvmesh.router.index import PrefixIndex
from kvmesh.router.picker import PodState
from kvmesh.router.pods import Pod
from kvmesh.router.pool_status import pod_state, pool_status
from kvmesh.status import render

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def test_each_pod_shows_its_state_load_forecast_and_the_blocks_the_index_holds_by_tier() -> None:
    index = PrefixIndex()
    stored = KVEvent("stored", tuple(range(1, 11)), tier="device", token_count=160)
    offloaded = KVEvent("stored", (1, 2, 3), tier="host", token_count=48)
    assert index.apply(A, KVEventBatch("boot-a", 1, (stored, offloaded)))
    assert index.apply(B, KVEventBatch("boot-b", 1, (KVEvent("stored", (1, 2), token_count=32),)))
    pods = {
        A: Pod(A, healthy=True, scraped_at=99.0, metrics={"events_seq": 3.0}),  # published two batches more
        B: Pod(B, healthy=True, warming=True, scraped_at=99.5),
        C: Pod(C, refused="hash xxh3_64/1 differs from the router's"),
    }
    states = [PodState(A, A, running=3, waiting=1, inflight=2, kv_usage=0.42, forecast_usage_p90=0.8,
                       overload_probability=0.25, num_blocks=512),
              PodState(B, B, role="decode", stale=True), PodState(C, C, healthy=False)]
    doc = pool_status(pods, states, index, now=100.0)
    a, b, c = doc["pods"]
    assert (a["state"], b["state"], c["state"]) == ("healthy", "warming", "refused")
    assert a["indexed_blocks"] == {"device": 10, "host": 3, "disk": 0}
    assert b["indexed_blocks"] == {"device": 2, "host": 0, "disk": 0}
    assert c["indexed_blocks"] == {"device": 0, "host": 0, "disk": 0}  # never in the index
    assert (a["running"], a["waiting"], a["inflight"], a["kv_usage"], a["forecast_usage_p90"]) == (3, 1, 2, 0.42, 0.8)
    assert a["event_lag_batches"] == 2 and b["event_lag_batches"] is None  # B publishes no sequence number
    assert a["metrics_age_seconds"] == 1.0 and c["metrics_age_seconds"] is None  # C never scraped
    assert b["role"] == "decode" and b["stale"] and c["reason"].startswith("hash")
    assert doc["index"]["blocks"] == 10  # distinct hashes in any tier, over all pods

    table = render(doc).splitlines()
    assert table[0].split()[:3] == ["POD", "STATE", "ROLE"]
    row = table[1].split()
    assert row[0] == "10.0.0.1:8000" and row[1] == "healthy" and "42%" in row and "10/3/0" in row
    assert table[4] == "3 pods, 1 healthy, 1 starting; 10 distinct blocks indexed"  # B warms up
    assert table[5] == f"{C}: hash xxh3_64/1 differs from the router's"  # why a refused pod is not routed to


def test_pod_state_order_refused_then_draining_then_warming() -> None:
    assert pod_state(Pod(A, healthy=True, draining=True, refused="x")) == "refused"
    assert pod_state(Pod(A, healthy=True, draining=True, warming=True)) == "draining"
    assert pod_state(Pod(A, warming=True)) == "warming"
    assert pod_state(Pod(A, loading=True)) == "loading"
    assert pod_state(Pod(A)) == "unhealthy"
