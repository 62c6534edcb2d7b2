"""Warm-up planning (operator/warmup.py): which pods are new, which peer they copy, what they are sent; and the
pool spec's warmupPrefixes."""

from __future__ import annotations

import pytest

from kvmesh.engine.protocol import HOT_CHAINS_DEFAULT
from kvmesh.operator.crd import SpecError, parse_pool
from kvmesh.operator.warmup import ServingPod, Warmup, plan_warmups, warm_body


def pod(name: str, role: str = "both", hit_rate: float = 0.0) -> ServingPod:
    return ServingPod(name, role, f"http://{name}:8000", hit_rate)


def test_pods_that_start_serving_copy_the_warmest_old_pod_of_their_role() -> None:
    old = [pod("a", hit_rate=5.0), pod("b", hit_rate=50.0), pod("p1", "prefill", 1.0)]
    new = [pod("c"), pod("d"), pod("p2", "prefill")]
    plans = plan_warmups(frozenset({"a", "b", "p1"}), old + new, 16)
    assert plans == [Warmup("both", old[1], (new[0], new[1])), Warmup("prefill", old[2], (new[2],))]


def test_nothing_is_warmed_without_a_known_past_an_old_peer_or_a_limit() -> None:
    serving = [pod("a"), pod("b")]
    assert plan_warmups(None, serving, 16) == [], "the first tick cannot tell new pods from old"
    assert plan_warmups(frozenset({"a", "b"}), serving, 16) == [], "no new pod"
    assert plan_warmups(frozenset({"gone"}), serving, 16) == [], "no old pod serves: nothing warm to copy"
    assert plan_warmups(frozenset({"a"}), serving, 0) == [], "warmupPrefixes 0 turns warm-up off"
    assert plan_warmups(frozenset({"a"}), serving, 16) == [Warmup("both", serving[0], (serving[1],))]


def test_equally_warm_peers_are_chosen_by_name() -> None:
    serving = [pod("z"), pod("m"), pod("new")]
    (plan,) = plan_warmups(frozenset({"z", "m"}), serving, 4)
    assert plan.source.name == "m"


def test_the_warm_body_sends_the_hottest_chains_up_to_the_limit() -> None:
    hot = {"chains": [{"hashes": [1, 2, 3], "hits": 9}, {"hashes": [1, 4], "hits": 3}, {"hashes": [7], "hits": 1}]}
    assert warm_body("http://peer:8000", hot, 2) == {"source": "http://peer:8000", "chains": [[1, 2, 3], [1, 4]]}
    assert warm_body("http://peer:8000", {"chains": []}, 2) is None, "a cold peer: nothing to send"


@pytest.mark.parametrize("hot", [{}, {"chains": "x"}, {"chains": [{"hashes": []}]}, {"chains": [{"hashes": ["1"]}]},
                                 {"chains": [[1, 2]]}])
def test_a_malformed_hot_listing_is_refused(hot: dict) -> None:
    with pytest.raises(ValueError, match="hot listing"):
        warm_body("http://peer:8000", hot, 4)


def body(**scaling: object) -> dict:
    return {"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u"},
            "spec": {"model": {"source": "bundled"}, "scaling": scaling}}


def test_warmup_prefixes_defaults_on_and_is_bounded() -> None:
    assert parse_pool(body()).spec["scaling"]["warmupPrefixes"] == HOT_CHAINS_DEFAULT
    assert parse_pool(body(warmupPrefixes=0)).spec["scaling"]["warmupPrefixes"] == 0
    with pytest.raises(SpecError, match="warmupPrefixes"):
        parse_pool(body(warmupPrefixes=-1))
