"""Warming a pod from a peer (issue 5): the KV manager's hottest prefix chains, and between two real engine
processes (the tiny model) GET /v1/kv/hot on one and POST /v1/kv/warm on the other, directly and through the
operator's warm call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.kv.blocks import KVCacheManager
from kvmesh.engine.protocol import KV_HOT_PATH, KV_WARM_PATH, NO_EXTRA, HashAlgo, block_hashes
from kvmesh.operator.engines import http_warm
from kvmesh.operator.warmup import ServingPod, Warmup
from kvmesh.processes import free_port

from .engines import tiny_engines
from .test_kv_transfer import complete, metric, tokens


def serve(kv: KVCacheManager, seq: str, prompt: list[int]) -> None:
    """Admit, compute and finish one request the way the scheduler does."""
    kv.allocate(seq, len(prompt), kv.find_prefix(seq, prompt))
    kv.commit(seq, prompt, len(prompt))
    kv.free(seq)


def test_hot_chains_list_reused_prefixes_hottest_first_from_the_root() -> None:
    kv = KVCacheManager(32, 4)
    system = list(range(8))  # two blocks every prompt shares
    a, b, cold = [*system, *range(100, 109)], [*system, *range(200, 205)], list(range(300, 313))
    for prompt, times in ((a, 3), (b, 2), (cold, 1)):
        for i in range(times):
            serve(kv, f"{prompt[-1]}-{i}", prompt)
    chains = kv.hot_chains(10)
    a_hashes, b_hashes = kv.prefix_hashes("x", a), kv.prefix_hashes("y", b)
    # a: 4 full blocks reused twice; b: the shared 2 plus 1 block of its own, reused once; cold never reused
    assert [(c.hashes, c.hits) for c in chains] == [(a_hashes, 2), (b_hashes[:3], 1)]
    assert kv.hot_chains(1) == chains[:1]
    kv.check_invariants()


def test_of_equally_hot_chains_the_longer_makes_the_cut() -> None:
    """Ties go to the longer chain even when the limit cuts among them (what a warm-up copies first)."""
    kv = KVCacheManager(32, 4)
    short, long = [*range(500, 504), 1], [*range(600, 616), 1]  # one reused block; four
    for prompt in (short, short, long, long):  # the short prompt first: its blocks get the lower ids
        serve(kv, f"{prompt[0]}-{len(kv.seqs)}-{id(prompt)}", prompt)
    (best,) = kv.hot_chains(1)
    assert best.hashes == kv.prefix_hashes("z", long)[:4] and best.hits == 1
    kv.check_invariants()


def test_a_chain_whose_ancestor_is_gone_is_left_out() -> None:
    kv = KVCacheManager(8, 4)
    ids = kv.allocate_unregistered("import", 2)
    assert ids is not None
    kv.register_filled(ids, [11, 12], parent=99)  # pulled after a prefix this pod held, evicted since
    kv.free("import")
    for block_id in ids:
        kv.pool.blocks[block_id].hits = 1  # as if reused: no prompt's tokens hash to these made-up hashes
    assert kv.hot_chains(5) == []
    kv.register_filled(kv.allocate_unregistered("root", 1) or [], [99], parent=None)
    assert [c.hashes for c in kv.hot_chains(5)] == [[99, 11, 12]]


@pytest.fixture(scope="module")
def pods(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with tiny_engines(tiny_dir, tmp_path_factory.mktemp("warm")) as procs:
        source, fresh = procs
        yield source, fresh


def warm(url: str, source: str, chains: list[list[int]]) -> dict:
    reply = httpx.post(url + KV_WARM_PATH, json={"source": source, "chains": chains}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
def test_a_fresh_pod_warmed_from_a_peer_serves_the_hot_prefix_from_cache(pods: tuple[str, str]) -> None:
    source, fresh = pods
    hot, warm_one = tokens(31, 100), tokens(32, 70)
    answers = [complete(source, prompt=hot, max_tokens=1, temperature=0) for _ in range(3)]
    for _ in range(2):
        complete(source, prompt=warm_one, max_tokens=1, temperature=0)
    config = httpx.get(source + "/v1/kv/config").json()
    expected = [block_hashes(p[: (len(p) - 1) // 16 * 16], 16, NO_EXTRA, HashAlgo(config["hash_algo"]),
                             config["hash_root"]) for p in (hot, warm_one)]

    listed = httpx.get(source + KV_HOT_PATH, params={"limit": 8}).json()["chains"]
    assert [(c["hashes"], c["hits"]) for c in listed] == [(expected[0], 2), (expected[1], 1)]

    pulled = warm(fresh, source, [c["hashes"] for c in listed])
    assert pulled == {"blocks_pulled": 6 + 4, "blocks_present": 0, "failed": 0, "errors": []}
    computed = metric(fresh, "kvmesh_computed_tokens_total")
    served = complete(fresh, prompt=hot, max_tokens=1, temperature=0)
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert metric(fresh, "kvmesh_computed_tokens_total") - computed == 100 - 96, "only the tail is computed"
    assert served["choices"][0]["token_ids"] == answers[0]["choices"][0]["token_ids"], "the pulled KV is right"

    again = warm(fresh, source, [c["hashes"] for c in listed])
    assert again == {"blocks_pulled": 0, "blocks_present": 6 + 4, "failed": 0, "errors": []}


@pytest.mark.slow
def test_warming_from_an_unreachable_peer_counts_failures(pods: tuple[str, str]) -> None:
    _, fresh = pods
    failed = metric(fresh, "kvmesh_kv_transfers_total", kind="warm", outcome="failed")
    answer = warm(fresh, f"http://127.0.0.1:{free_port()}", [[1, 2, 3], [4]])
    assert (answer["blocks_pulled"], answer["failed"], len(answer["errors"])) == (0, 2, 2)
    assert metric(fresh, "kvmesh_kv_transfers_total", kind="warm", outcome="failed") == failed + 2
    assert httpx.get(fresh + "/health").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"source": "http://127.0.0.1:1", "chains": []},
    {"source": "http://127.0.0.1:1", "chains": [[]]},
    {"source": "ftp://peer", "chains": [[1]]},
    {"chains": [[1]]},
    {"source": "http://127.0.0.1:1", "chains": [["not a hash"]]},
])
def test_a_bad_warm_request_is_a_400_that_says_why(pods: tuple[str, str], body: dict) -> None:
    reply = httpx.post(pods[1] + KV_WARM_PATH, json=body)
    assert reply.status_code == 400 and reply.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["0", "100000", "many"])
def test_a_bad_hot_limit_is_a_400(pods: tuple[str, str], limit: str) -> None:
    reply = httpx.get(pods[0] + KV_HOT_PATH, params={"limit": limit})
    assert reply.status_code == 400 and "limit" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_the_operators_warm_call_copies_a_peers_hot_prefixes_between_real_engines(pods: tuple[str, str]) -> None:
    source, fresh = pods
    prompt = tokens(33, 60)
    for _ in range(2):
        complete(source, prompt=prompt, max_tokens=1, temperature=0)
    gone = f"http://127.0.0.1:{free_port()}"
    plan = Warmup("both", ServingPod("a", "both", source, 1.0),
                  (ServingPod("b", "both", fresh), ServingPod("gone", "both", gone)))
    answers = http_warm(plan, 16)
    assert answers["b"]["blocks_pulled"] == 3 and answers["b"]["failed"] == 0, answers  # the one chain b lacked
    assert isinstance(answers["gone"], httpx.HTTPError), "an unreachable new pod is reported, not raised"
    served = complete(fresh, prompt=prompt, max_tokens=1, temperature=0)
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
