"""`kvmesh bench cluster --router-replicas`: kvmesh's router as independent replicas in the cluster simulator.

Each replica reads every instance's KV events but keeps its own provisional entries, scrapes every scrape
interval and counts only its own requests in between; so a burst dealt to several replicas piles onto the pod
each of them sees as best, and arrivals further apart than a scrape interval do not."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvmesh.bench.policies import RouterReplicasPolicy
from kvmesh.bench.routing import spread_arrivals
from kvmesh.bench.sim import Cluster, ClusterSpec, LatencyModel, SimRequest, build_requests, simulate
from kvmesh.bench.traces import TraceRequest
from kvmesh.cli import main
from kvmesh.router.config import RouterConfig

BLOCK = 512  # the Mooncake trace's block tokens
SPEC = ClusterSpec({"prefill": 4}, cache_tokens=BLOCK * 64, latency=LatencyModel(prefill_tokens_per_second=4096))
SCRAPE_SECONDS = RouterConfig().scrape_interval_seconds


def busy_then_burst(gap: float) -> list[SimRequest]:
    """Three long prompts (1.6 s of prefill) take three of the four instances, 0.3 s apart (every replica scrapes
    between them); from t=1 s eight short ones (0.5 s) arrive `gap` seconds apart: the idle instance is everyone's
    best pick until its queue shows."""
    busy = [TraceRequest(0.3 * i, BLOCK * 13, 1, tuple(range(100 * i + 1, 100 * i + 14))) for i in range(3)]
    burst = [TraceRequest(1.0 + gap * i, BLOCK * 4, 1, tuple(range(1000 + 10 * i, 1004 + 10 * i))) for i in range(8)]
    return build_requests(busy + burst)


def largest_pile(requests: list[SimRequest]) -> int:
    """Most burst requests (those from t=1 s) that one instance prefilled."""
    return max(Counter(r.prefill_instance for r in requests if r.arrival >= 1.0).values())


@pytest.mark.parametrize("seed", range(4))
def test_a_burst_dealt_to_replicas_piles_onto_one_instance(seed: int) -> None:
    requests = busy_then_burst(gap=0.0)
    one = simulate(requests, SPEC, RouterReplicasPolicy(1, seed))
    eight = simulate(requests, SPEC, RouterReplicasPolicy(8, seed))
    # one replica counts what it sent since the last scrape: the idle instance's queue grows as it sends
    assert largest_pile(one.requests) <= 5
    assert largest_pile(eight.requests) > largest_pile(one.requests)
    assert eight.mean_ttft > 1.1 * one.mean_ttft


@pytest.mark.parametrize("seed", range(4))
def test_arrivals_further_apart_than_a_scrape_interval_do_not_pile(seed: int) -> None:
    """Each replica has scraped since the last arrival: what the others sent is in the numbers it reads."""
    requests = busy_then_burst(gap=1.2 * SCRAPE_SECONDS)
    one = simulate(requests, SPEC, RouterReplicasPolicy(1, seed))
    eight = simulate(requests, SPEC, RouterReplicasPolicy(8, seed))
    assert largest_pile(eight.requests) <= 4
    assert eight.mean_ttft <= 1.02 * one.mean_ttft


def test_each_replica_indexes_every_instance_but_only_its_own_decisions() -> None:
    requests = build_requests([TraceRequest(0.0, BLOCK * 4, 1, tuple(range(10 * i + 1, 10 * i + 5)))
                               for i in range(6)])
    policy = RouterReplicasPolicy(2, seed=0)
    cluster = Cluster(SPEC, policy)
    for request in requests:  # all at t=0: no prefill has ended, so no block is confirmed yet
        cluster.route(request)
    assert {id(r) for r in policy.taken_by.values()} == {id(r) for r in policy.router_replicas}  # both dealt some
    for request in requests:
        sent_to = next(i.name for i in cluster.instances.values() if request in i.queue or i.prefilling is request)
        for replica in policy.router_replicas:
            match = replica.index.match(request.block_hashes, None, cluster.now).get(sent_to)
            if replica is policy.taken_by[request.rid]:
                assert match is not None and match.blocks == match.provisional == 4
            else:
                assert match is None  # another replica's decision: unknown until the instance's events say so

    # once the instances have computed the blocks, their events have reached every replica alike
    policy = RouterReplicasPolicy(3, seed=0)
    simulate(requests, SPEC, policy)
    first, *others = [replica.index for replica in policy.router_replicas]
    held = {pod: first.held_blocks(pod) for pod in first.pods()}
    assert sum(blocks["device"] for blocks in held.values()) == 6 * 4
    for index in others:
        assert {pod: index.held_blocks(pod) for pod in index.pods()} == held


def test_a_replica_sees_another_replicas_request_at_its_next_scrape() -> None:
    policy = RouterReplicasPolicy(2, seed=0)
    cluster = Cluster(SPEC, policy)
    (request,) = build_requests([TraceRequest(0.0, BLOCK * 4, 2, (1, 2, 3, 4))])
    cluster.route(request)
    taker = policy.taken_by[request.rid]
    (other,) = [r for r in policy.router_replicas if r is not taker]
    instance = cluster.instances[next(i.name for i in cluster.instances.values() if i.prefilling is request)]
    assert taker.view(instance).state().load == 1  # its own request, not yet scraped
    assert other.view(instance).state().load == 0
    other.scrape(instance)
    assert other.view(instance).state().load == 1 and other.view(instance).state().inflight == 0
    taker.scrape(instance)  # counted once: by the scrape now, no longer as unseen
    assert taker.view(instance).state().load == 1 and taker.view(instance).state().unseen_requests == 0


def test_spreading_moves_each_arrival_within_the_window_after_it() -> None:
    requests = build_requests([TraceRequest(3.0 * (i // 5), BLOCK, 1, (i + 1,)) for i in range(20)])
    spread = spread_arrivals(requests, 3.0, seed=1)
    original = {r.rid: r.arrival for r in requests}
    assert [r.arrival for r in spread] == sorted(r.arrival for r in spread)
    assert all(original[r.rid] <= r.arrival < original[r.rid] + 3.0 for r in spread)
    assert len({r.arrival for r in spread}) == 20  # no two at one instant any more
    assert [r.arrival for r in spread_arrivals(requests, 3.0, seed=1)] == [r.arrival for r in spread]
    assert [r.arrival for r in spread_arrivals(requests, 0.0, seed=1)] == [r.arrival for r in requests]


def mooncake(path: Path, requests: list[SimRequest]) -> Path:
    rows = [{"timestamp": r.arrival * 1000, "input_length": r.prompt_tokens, "output_length": r.output_tokens,
             "hash_ids": list(r.hash_ids)} for r in requests]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_option_adds_a_replica_table_and_changes_nothing_else(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(mooncake(tmp_path / "t.jsonl", busy_then_burst(gap=0.0)))
    common = ["bench", "cluster", "--trace", trace, "--instances", "4", "--cache-tokens", str(BLOCK * 64),
              "--prefill-speed", "4096"]
    assert main([*common, "--json", str(tmp_path / "plain.json")]) == 0
    plain_out = capsys.readouterr().out
    assert main([*common, "--router-replicas", "4", "8", "--json", str(tmp_path / "replicas.json")]) == 0
    replicas_out = capsys.readouterr().out
    plain, replicas = (json.loads((tmp_path / name).read_text()) for name in ("plain.json", "replicas.json"))

    assert replicas_out.startswith(plain_out) and "| router replicas |" not in plain_out
    assert "router_replicas" not in plain and replicas["rows"] == plain["rows"]
    rows = replicas["router_replicas"]["rows"]
    assert [r["replicas"] for r in rows] == [1, 4, 8] and rows[0]["ttft_ratio"] == 1.0
    assert rows[-1]["ttft_ratio"] > 1.1  # the burst piles up
    assert replicas["router_replicas"]["scrape_interval_seconds"] == SCRAPE_SECONDS
    assert "| 8 |" in replicas_out

    # spread over 2 s, the burst's arrivals are mostly further apart than a scrape interval
    assert main([*common, "--router-replicas", "8", "--spread-arrivals", "2", "--json",
                 str(tmp_path / "spread.json")]) == 0
    spread = json.loads((tmp_path / "spread.json").read_text())
    assert spread["spread_arrivals_seconds"] == 2.0 and "arrivals spread over 2 s" in capsys.readouterr().out
    assert spread["router_replicas"]["rows"][-1]["ttft_ratio"] < rows[-1]["ttft_ratio"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--router-replicas", "0"], "--router-replicas must be at least 1, got 0"),
    (["--router-replicas", "2", "-1"], "--router-replicas must be at least 1, got -1"),
    (["--spread-arrivals", "-3"], "--spread-arrivals must be 0 or more seconds, got -3.0"),
    (["--spread-arrivals", "nan"], "--spread-arrivals must be 0 or more seconds, got nan"),
])
def test_bad_flags_exit_2_with_a_message(flags: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(mooncake(tmp_path / "t.jsonl", busy_then_burst(gap=0.0)))
    assert main(["bench", "cluster", "--trace", trace, "--prefill-speed", "4096", *flags]) == 2
    assert f"kvmesh bench cluster: {message}" in capsys.readouterr().err
