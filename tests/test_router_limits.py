"""Per-tenant rate limits and fair sharing: the token buckets and the fair-share rule as pure functions over an
injected clock, the config's errors, and the router's HTTP edge in front of a real in-process engine (the tiny
model), where the limiter's clock is injected too: nothing here sleeps or times anything."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from kvmesh.cli import main
from kvmesh.engine.engine import Engine
from kvmesh.router.app import RouteError, Router, build_router
from kvmesh.router.auth import hash_key, tenant_hash
from kvmesh.router.config import MAX_REQUEST_BODY_BYTES, RouterConfig, load_router_config
from kvmesh.router.limits import (
    Lease,
    Limiter,
    LimitTable,
    Refusal,
    TenantLimits,
    TokenBucket,
    duration,
    parse_tenants,
    unkeyed_tenants,
)
from kvmesh.router.picker import Decision, PodState
from kvmesh.router.shed import ShedPolicy, fair_share, should_shed

from .conftest import make_engine
from .engines import serve_engine, serve_router


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- token buckets ---------------------------------------------------------------------------------------------


def test_a_bucket_refills_continuously_up_to_one_minute() -> None:
    bucket = TokenBucket.full(60, now=0.0)  # one a second
    assert all(bucket.take(1, now=0.0) for _ in range(60))
    assert not bucket.take(1, now=0.0)
    assert bucket.wait_seconds(1, now=0.0) == pytest.approx(1.0)
    assert bucket.take(1, now=1.0)  # a second later, one more: no window to wait out
    assert not bucket.take(1, now=1.5)
    assert bucket.available(now=1000.0) == 60  # never more than a minute's worth
    assert bucket.reset_seconds(now=1000.0) == 0


def test_a_charge_after_the_fact_goes_into_debt() -> None:
    bucket = TokenBucket.full(600, now=0.0)  # ten a second
    bucket.charge(700, now=0.0)
    assert bucket.available(now=0.0) == -100
    assert not bucket.take(1, now=5.0)  # -50 after five seconds
    assert bucket.wait_seconds(1, now=5.0) == pytest.approx(5.1)
    assert bucket.take(1, now=10.1)
    assert math.isinf(bucket.wait_seconds(601, now=10.1))  # more than a minute's worth never fits


def test_reset_durations_read_as_openai_sends_them() -> None:
    assert [duration(s) for s in (0.02, 1, 6.5, 60, 90.25, 3600)] == ["20ms", "1s", "6.5s", "1m0s", "1m30.25s",
                                                                       "60m0s"]


# ---- the limiter ----------------------------------------------------------------------------------------------


def limiter(clock: Clock, replicas: int = 1, **tenants: dict[str, object]) -> Limiter:
    return Limiter(parse_tenants(tenants), replicas, clock)


def test_requests_per_minute_refuse_the_next_request_with_retry_after() -> None:
    clock = Clock()
    limits = limiter(clock, acme={"requests_per_minute": 3})
    leases = [limits.take("acme", 5) for _ in range(3)]
    assert [lease.headers["x-ratelimit-remaining-requests"] for lease in leases] == ["2", "1", "0"]
    refusal = limits.check("acme")
    assert isinstance(refusal, Refusal) and refusal.reason == "requests"
    assert refusal.headers["retry-after"] == "20" and refusal.headers["retry-after-ms"] == "20000"
    assert refusal.headers["x-ratelimit-limit-requests"] == "3"
    assert refusal.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "requests per minute (RPM): limit 3" in refusal.message and "try again in 20s" in refusal.message
    clock.now += 19.9
    assert limits.check("acme") is not None
    clock.now += 0.1  # refilled by then, with no request needed to reset anything
    assert limits.check("acme") is None
    assert not isinstance(limits.take("acme", 5), Refusal)


def test_tokens_per_minute_count_prompt_and_output_tokens() -> None:
    clock = Clock()
    limits = limiter(clock, globex={"tokens_per_minute": 100})
    lease = limits.take("globex", 30)
    assert not isinstance(lease, Refusal) and lease.headers["x-ratelimit-remaining-tokens"] == "70"
    assert "x-ratelimit-limit-requests" not in lease.headers  # only the limited dimensions are told
    lease.close(spent_tokens=90)  # a long answer: 120 of 100 spent
    refusal = limits.check("globex")
    assert isinstance(refusal, Refusal) and refusal.reason == "tokens"
    assert refusal.headers["x-ratelimit-remaining-tokens"] == "0"
    assert refusal.headers["retry-after"] == "13"  # 21 tokens at 100 a minute: 12.6 s
    clock.now += 12.6
    assert limits.check("globex") is None
    assert isinstance(limits.take("globex", 2), Refusal)  # a prompt of 2 needs 2
    too_large = limits.take("globex", 101)
    assert isinstance(too_large, Refusal) and "Request too large" in too_large.message
    assert "retry-after" not in too_large.headers and too_large.headers["x-should-retry"] == "false"  # no wait helps


def test_tenants_are_isolated_and_the_default_applies_to_the_rest() -> None:
    clock = Clock()
    limits = limiter(clock, default={"requests_per_minute": 2, "tokens_per_minute": 1000},
                     acme={"requests_per_minute": 5}, vip={"tokens_per_minute": None})
    for _ in range(5):
        assert not isinstance(limits.take("acme", 1), Refusal)
    assert limits.check("acme") is not None
    for tenant in ("initech", "hooli"):  # no entry: the default's 2 a minute, each their own
        assert not isinstance(limits.take(tenant, 1), Refusal)
        assert not isinstance(limits.take(tenant, 1), Refusal)
        assert limits.check(tenant) is not None
    assert limits.limits("acme") == TenantLimits(5, 1000)  # its own field over the default's, the rest inherited
    assert limits.limits("vip") == TenantLimits(2, None)  # null: unlimited for this tenant
    assert Limiter(LimitTable()).check("anyone") is None and Limiter().take("x", 10**9).headers == {}


def test_concurrent_requests_come_back_when_they_end() -> None:
    limits = limiter(Clock(), acme={"max_concurrent_requests": 2})
    first, second = limits.take("acme", 1), limits.take("acme", 1)
    refusal = limits.check("acme")
    assert isinstance(refusal, Refusal) and refusal.reason == "concurrency"
    assert limits.inflight == {"acme": 2}
    assert not isinstance(first, Refusal) and not isinstance(second, Refusal)
    first.close()
    first.close()  # once only
    assert limits.inflight == {"acme": 1} and limits.check("acme") is None
    second.close(spent_tokens=5)
    assert limits.inflight == {} and first.closed and second.closed


def test_replicas_split_the_limits() -> None:
    limits = limiter(Clock(), replicas=2, acme={"requests_per_minute": 5, "tokens_per_minute": 1000,
                                                "max_concurrent_requests": 3})
    assert limits.limits("acme") == TenantLimits(2.5, 500, 2)
    assert [isinstance(limits.take("acme", 1), Refusal) for _ in range(3)] == [False, False, True]


def test_batch_requests_have_buckets_of_their_own_so_a_batch_never_starves_interactive_traffic() -> None:
    clock = Clock()
    limits = Limiter(parse_tenants({"acme": {"requests_per_minute": 10, "max_concurrent_requests": 4},
                                    "free": {}}), clock=clock, batch_share=0.3)
    batch = [limits.batch.take("acme", 1) for _ in range(5)]
    assert [isinstance(lease, Lease) for lease in batch] == [True] * 2 + [False] * 3  # concurrency: 30 % of 4, up
    for lease in batch[:2]:
        assert isinstance(lease, Lease)
        lease.close()
    third = limits.batch.take("acme", 1)
    assert isinstance(third, Lease)
    third.close()
    refusal = limits.batch.take("acme", 1)  # 3 of 10 a minute: the batch waits on its own bucket
    assert isinstance(refusal, Refusal) and refusal.reason == "requests"
    assert limits.batch.headers("acme")["x-ratelimit-limit-requests"] == "3"
    assert all(isinstance(limits.take("acme", 1), Lease) for _ in range(4))  # the tenant's own limits are whole
    assert limits.inflight == {"acme": 4} and limits.batch.inflight == {}
    assert isinstance(limits.batch.take("free", 10**6), Lease)  # unlimited stays unlimited
    assert Limiter(parse_tenants({"acme": {"requests_per_minute": 1}}), batch_share=0.1).batch.limits(
        "acme").requests_per_minute == 1  # under one a minute: raised to one (a batch waits, it is never refused)
    with pytest.raises(ValueError, match="batch_rate_share must be a number above 0 and at most 1, not 0"):
        RouterConfig(pods=["http://127.0.0.1:1"], batch_rate_share=0).validate()


def test_a_rate_under_one_a_minute_per_replica_is_refused_at_start() -> None:
    """Such a bucket never holds one request: every request would get 429 forever."""
    with pytest.raises(ValueError, match=r"tenants.acme: requests_per_minute split over rate_limit_replicas 3 is "
                                         r"0.67 per replica.*lower rate_limit_replicas"):
        limiter(Clock(), replicas=3, acme={"requests_per_minute": 2})
    with pytest.raises(ValueError, match=r"tenants.default: tokens_per_minute is 0.50 per replica"):
        limiter(Clock(), default={"tokens_per_minute": 0.5})


def test_a_prompt_within_the_tenants_limit_passes_a_replica_whose_share_is_smaller() -> None:
    """tpm 10,000 over 3 replicas: a 5,000-token prompt is more than a replica's minute, not the tenant's; it
    passes once the bucket is full, into debt. Only a prompt over the whole limit is too large. Headers are whole."""
    clock = Clock()
    limits = limiter(clock, replicas=3, acme={"tokens_per_minute": 10_000, "requests_per_minute": 30})
    lease = limits.take("acme", 5_000)
    assert isinstance(lease, Lease) and lease.headers["x-ratelimit-limit-tokens"] == "3333"
    assert lease.headers["x-ratelimit-remaining-tokens"] == "0"
    refused = limits.take("acme", 10)
    assert isinstance(refused, Refusal) and "retry-after" in refused.headers  # waits for the debt to clear
    too_large = limits.take("acme", 10_001)
    assert isinstance(too_large, Refusal) and "limit 10000, requested 10001" in too_large.message
    assert "retry-after" not in too_large.headers


def test_retry_after_is_the_wait_that_clears_every_limit_the_request_is_over() -> None:
    clock = Clock()
    limits = limiter(clock, acme={"requests_per_minute": 60, "tokens_per_minute": 60})
    for _ in range(60):
        assert isinstance(limits.take("acme", 1), Lease)
    refused = limits.check("acme")  # both buckets empty: 1 s for a request, 1 s for a token
    assert refused is not None and refused.headers["retry-after"] == "1"
    clock.now += 1
    lease = limits.take("acme", 1)
    assert isinstance(lease, Lease)
    lease.close(spent_tokens=29)  # 29 tokens into debt: the token bucket needs 30 s, the request bucket 1 s
    refused = limits.check("acme")
    assert refused is not None and refused.reason == "requests" and refused.headers["retry-after"] == "30"


# ---- fair sharing ---------------------------------------------------------------------------------------------


def decision(ttft: float) -> Decision:
    pod = PodState(name="a", url="http://a")
    return Decision(pod=pod, scores={"a": 1.0}, predicted_cached_tokens=0, estimated_ttft_seconds=ttft, reason="load")


def test_the_fair_share_is_weighted_among_tenants_in_flight() -> None:
    def equal(_: str) -> float:
        return 1.0

    share = fair_share({"burst": 8, "steady": 2}, equal, "steady")
    assert (share.inflight, share.share, share.over, share.others_over) == (2, 5.0, False, True)
    assert fair_share({"burst": 8, "steady": 2}, equal, "burst").over
    assert not fair_share({"alone": 9}, equal, "alone").over  # a tenant alone may use the whole pool
    assert not fair_share({"burst": 8, "idle": 0, "steady": 4}, equal, "steady").over  # idle tenants owe nothing
    weighted = {"gold": 3.0, "bronze": 1.0}.__getitem__
    assert not fair_share({"gold": 6, "bronze": 2}, weighted, "gold").over  # 3:1 of 8
    assert fair_share({"gold": 6, "bronze": 3}, weighted, "bronze").over


def test_an_overloaded_pool_sheds_the_tenant_above_its_share() -> None:
    policy = ShedPolicy(ttft_slo_seconds=1.0, priority_headroom=0.5)
    inflight = {"burst": 9, "steady": 1}
    burst, steady = (fair_share(inflight, lambda _: 1.0, t) for t in ("burst", "steady"))
    assert should_shed(decision(0.9), 0, policy, burst) is None  # not overloaded: nobody is shed
    shed = should_shed(decision(1.2), 0, policy, burst)
    assert shed is not None and shed.fair_share and "above its fair share of 5.0" in shed.message
    assert should_shed(decision(1.2), 0, policy, steady) is None  # within its share: not shed for the burst
    assert should_shed(decision(1.2), 0, policy) is not None  # without fairness it would have been
    assert should_shed(decision(1.6), 0, policy, steady) is not None  # protected by one priority level, no more
    alone = fair_share({"steady": 1}, lambda _: 1.0, "steady")
    plain = should_shed(decision(1.2), 0, policy, alone)  # overloaded with no burst to blame: shed by priority
    assert plain is not None and not plain.fair_share


# ---- configuration --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ([1, 2], "must map tenant names to their limits"),
        ({"acme": 5}, r"tenants.acme must be a mapping of limits"),
        ({"acme": {"rpm": 5}}, r"tenants.acme: unknown fields \['rpm'\]; allowed: requests_per_minute"),
        ({"acme": {"requests_per_minute": -1}}, r"tenants.acme: requests_per_minute must be a positive number"),
        ({"acme": {"requests_per_minute": 0}}, "requests_per_minute must be a positive number"),
        ({"acme": {"tokens_per_minute": "lots"}}, "tokens_per_minute must be a positive number"),
        ({"acme": {"tokens_per_minute": True}}, "tokens_per_minute must be a positive number"),
        ({"acme": {"max_concurrent_requests": 0}}, "max_concurrent_requests must be a whole number of at least 1"),
        ({"acme": {"max_concurrent_requests": 1.5}}, "max_concurrent_requests must be a whole number"),
        ({"acme": {"weight": None}}, "weight must be a positive number, not null"),
        ({"default": {"weight": 0}}, r"tenants.default: weight must be a positive number"),
        ({"": {}}, "tenant names must be non-empty strings"),
    ],
)
def test_bad_limits_are_refused_with_what_to_fix(tenants: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tenants(tenants)


def test_bad_limits_stop_the_router_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"router": {"pods": ["http://127.0.0.1:1"],
                                               "tenants": {"acme": {"requests_per_minute": -5}}}}))
    with pytest.raises(ValueError, match="requests_per_minute must be a positive number"):
        load_router_config(path)
    assert main(["router", "--config", str(path)]) == 2
    assert "tenants.acme: requests_per_minute must be a positive number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rate_limit_replicas must be a whole number of at least 1"):
        RouterConfig(pods=["http://127.0.0.1:1"], rate_limit_replicas=0).validate()


def test_limits_for_a_tenant_without_a_key_are_named_and_the_router_still_starts(
        tmp_path: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A misspelt name, or a team whose last key was revoked: said in the log at start, never a router that cannot
    start (a revocation must not crash-loop the next rollout)."""
    table = parse_tenants({"default": {"requests_per_minute": 1}, "acmee": {"requests_per_minute": 9}})
    assert unkeyed_tenants(table, {"acme", "globex"}) == ["acmee"]
    assert unkeyed_tenants(table, {"acme", "acmee"}) == []
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"tenant": "acme", "key_sha256": hash_key("sk-acme")}]}))
    router = build_router(RouterConfig(pods=[], api_keys_file=str(keys), tenants={"acmee": {"requests_per_minute": 9}}),
                          tiny_dir)
    assert router.authenticate({"authorization": "Bearer sk-acme"}) == "acme"
    assert "tenants ['acmee'] have limits but no API key" in caplog.text


# ---- through the router, in front of a real engine -------------------------------------------------------------

KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-2", "initech": "sk-initech-3"}
TENANTS = {"default": {"requests_per_minute": 2}, "acme": {"requests_per_minute": 3},
           "globex": {"requests_per_minute": None, "tokens_per_minute": 100}}


@dataclass
class Served:
    url: str
    router: Router
    clock: Clock


@pytest.fixture(scope="module")
def engine_url(tiny_dir: Path) -> Iterator[str]:
    engine: Engine = make_engine(tiny_dir, kv_cache_blocks=256, max_model_len=512)
    with serve_engine(engine) as url:
        yield url
    engine.kv.check_invariants()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"tenant": t, "key_sha256": hash_key(k)} for t, k in KEYS.items()]}))
    return path


@pytest.fixture(scope="module")
def limited(engine_url: str, keys_file: Path, tiny_dir: Path) -> Iterator[Served]:
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1, api_keys_file=str(keys_file),
                                       tenants=TENANTS), tiny_dir)
    with serve_router(router) as url:
        yield Served(url, router, Clock())


@pytest.fixture
def served(limited: Served) -> Served:
    """The module's router with fresh buckets on a clock the test moves."""
    limited.clock = Clock()
    limited.router.limits = Limiter(parse_tenants(TENANTS), clock=limited.clock)
    return limited


def post(served: Served, tenant: str, prompt: int = 8, **extra: object) -> httpx.Response:
    body = {"prompt": list(range(100, 100 + prompt)), "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(served.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                      timeout=60)


def rate_limited(served: Served, tenant: str, reason: str) -> float:
    text = httpx.get(served.url + "/metrics").text
    assert tenant not in text  # tenants are named by their pseudonym only
    line = f'kvmesh_router_rate_limited_total{{reason="{reason}",tenant="{tenant_hash(tenant)}"}} '
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


@pytest.mark.slow
def test_the_requests_past_a_tenants_rpm_get_429_until_its_bucket_refills(served: Served) -> None:
    before = rate_limited(served, "acme", "requests")
    outcomes = served.router.metrics.requests
    errors, limited = (outcomes.labels(o, "aggregated", "client")._value.get() for o in ("error", "rate_limited"))
    answers = [post(served, "acme") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "3" for a in answers)
    refused = post(served, "acme")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "20" and refused.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "try again in 20s" in error["message"]
    assert rate_limited(served, "acme", "requests") == before + 1
    # a quota reached is not an error of the pool: its own outcome, so error ratios stay clean
    assert outcomes.labels("rate_limited", "aggregated", "client")._value.get() == limited + 1
    assert outcomes.labels("error", "aggregated", "client")._value.get() == errors
    served.clock.now += 20  # a third of a minute later: one request's worth
    again = post(served, "acme")
    assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.slow
def test_the_openai_client_sees_a_rate_limit_error(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEYS["initech"], max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(2):  # initech has no entry: the default's 2 a minute
        client.completions.create(model=model, prompt="hello", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model, prompt="hello", max_tokens=1)
    assert info.value.code == "rate_limit_exceeded"
    assert info.value.response.headers["x-ratelimit-limit-requests"] == "2"
    assert int(info.value.response.headers["retry-after"]) == 30


@pytest.mark.slow
def test_tokens_per_minute_are_charged_the_output_tokens_too(served: Served) -> None:
    first = post(served, "globex", prompt=10, max_tokens=30, ignore_eos=True)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 30
    assert first.headers["x-ratelimit-remaining-tokens"] == "90"  # at admission: the prompt's 10
    assert "x-ratelimit-limit-requests" not in first.headers  # globex has no RPM
    stream = post(served, "globex", prompt=10, max_tokens=45, ignore_eos=True, stream=True)
    assert stream.status_code == 200 and stream.headers["x-ratelimit-remaining-tokens"] == "50"  # 100 - 10 - 30 - 10
    assert stream.text.rstrip().endswith("data: [DONE]") and '"usage"' not in stream.text  # the client's stream
    refused = post(served, "globex", prompt=10)  # the stream's 45 output tokens left 5
    assert refused.status_code == 429 and refused.headers["x-ratelimit-remaining-tokens"] == "5"
    assert "tokens per minute (TPM): limit 100, used 95, requested 10" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "3"  # 5 more tokens: 3 s
    assert post(served, "acme").status_code == 200  # another tenant's bucket is its own
    served.clock.now += 3
    assert post(served, "globex", prompt=10).status_code == 200


@pytest.mark.slow
def test_every_prompt_of_a_several_prompt_completion_is_charged(served: Served) -> None:
    """The router routes by the first prompt, and charges every prompt at admission (40 prompts of 1,000 tokens
    once passed a limit of 2,000 a minute, only the first counted); the outputs when the usage comes back."""
    prompts = [list(range(100, 102)), list(range(200, 240))]
    several = httpx.post(served.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 1, "temperature": 0},
                         headers={"Authorization": f"Bearer {KEYS['globex']}"}, timeout=60)
    assert several.status_code == 200 and several.json()["usage"]["prompt_tokens"] == 42
    assert several.headers["x-ratelimit-remaining-tokens"] == "58"  # at admission: both prompts
    after = post(served, "globex", prompt=1)
    assert after.headers["x-ratelimit-remaining-tokens"] == str(100 - 42 - 2 - 1)  # both prompts and the outputs


@pytest.mark.slow
def test_a_tenant_over_its_limit_leaves_the_others_served(served: Served) -> None:
    for _ in range(3):
        assert post(served, "acme").status_code == 200
    assert post(served, "acme").status_code == 429
    assert post(served, "globex").status_code == 200
    assert post(served, "initech").status_code == 200
    missing = post(served, "initech", model="no-such-model")  # refused after admission: the headers still come
    assert missing.status_code == 404 and missing.headers["x-ratelimit-remaining-requests"] == "0"
    assert served.router.limits.inflight == {}  # every answered request gave its slot back


@pytest.mark.slow
def test_a_request_that_fails_after_admission_gives_its_slot_back(served: Served,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault past admission (the pods' view failing, as a bug would) is a 500, and the tenant's concurrency slot
    comes back with it: the edge closes every request's lease where its handling ends."""
    def broken(*_: object) -> None:
        raise RuntimeError("a bug past admission")

    monkeypatch.setattr(served.router, "view", broken)
    assert post(served, "acme").status_code == 500
    assert served.router.limits.inflight == {}
    monkeypatch.undo()
    assert post(served, "acme").status_code == 200 and served.router.limits.inflight == {}


@pytest.mark.slow
def test_both_edges_share_the_admission_that_limits(served: Served) -> None:
    """`Router.admit` is what the HTTP edge and a Gateway's ext_proc stream both call: a tenant over its limit is
    refused there, before its body is even parsed."""
    for _ in range(2):
        assert post(served, "initech").status_code == 200
    headers = {"authorization": f"Bearer {KEYS['initech']}"}
    with pytest.raises(RouteError) as info:
        asyncio.run(served.router.admit(b"not even JSON", headers, chat=False))
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.headers["retry-after"] == "30"


@pytest.mark.slow
def test_a_batchs_requests_spend_the_batch_buckets_not_the_interactive_ones(served: Served) -> None:
    """The batch runner's requests are admitted with `batch` (router/app.py's send_batch_request): the tenant's
    batch share (half of its 2 a minute: one) runs out while its interactive requests still pass, and a Responses
    API request, which also comes with its tenant, counts as interactive."""
    body = json.dumps({"prompt": [100, 101, 102], "max_tokens": 1}).encode()
    admitted = asyncio.run(served.router.admit(body, {}, chat=False, tenant="initech", batch=True))
    assert admitted.trace.lease is not None
    admitted.trace.lease.close()
    with pytest.raises(RouteError) as info:
        asyncio.run(served.router.admit(body, {}, chat=False, tenant="initech", batch=True))
    assert info.value.status == 429
    inside = asyncio.run(served.router.admit(body, {}, chat=False, tenant="initech"))
    assert inside.trace.lease is not None
    inside.trace.lease.close()
    assert post(served, "initech").status_code == 200
    assert post(served, "initech").status_code == 429  # the interactive two a minute, spent by the two above


@pytest.mark.slow
def test_an_overloaded_pool_sheds_the_tenant_above_its_fair_share(engine_url: str, keys_file: Path,
                                                                  tiny_dir: Path) -> None:
    """A TTFT SLO no pod can meet overloads the pool for every request; the tenants' requests in flight are taken
    from the router's limiter directly, as open requests hold them (the engine answers too fast to hold real ones
    open without timing)."""
    router = build_router(RouterConfig(pods=[engine_url], scrape_interval_seconds=0.1, api_keys_file=str(keys_file),
                                       ttft_slo_seconds=1e-6, priority_headroom=1e9), tiny_dir)
    with serve_router(router) as url:
        served = Served(url, router, Clock())
        alone = post(served, "globex")
        assert alone.status_code == 429 and alone.json()["error"]["code"] == "overloaded"  # no burst to blame
        burst = [router.limits.take("acme", 1) for _ in range(3)]
        assert post(served, "globex").status_code == 200  # within its share: not shed for acme's burst
        burst.append(router.limits.take("globex", 1))  # globex in flight too: acme's next request is over its share
        shed = post(served, "acme")
        assert shed.status_code == 429 and "above its fair share" in shed.json()["error"]["message"]
        assert int(shed.headers["retry-after"]) >= 1
        assert rate_limited(served, "acme", "fair_share") == 1 and rate_limited(served, "globex", "fair_share") == 0
        del burst


def test_a_completion_body_is_bounded_and_a_stranger_refused_before_it_is_read(served: Served) -> None:
    """The key is checked before the body is read: a stranger's oversized body is a 401, not a 413; a tenant's
    body over the bound is a 413 that says the bound (the router never holds more of it)."""
    oversized = b'{"prompt": "' + b"x" * (MAX_REQUEST_BODY_BYTES + 1) + b'"}'
    stranger = httpx.post(served.url + "/v1/completions", content=oversized, timeout=60,
                          headers={"Authorization": "Bearer sk-nobody", "content-type": "application/json"})
    assert stranger.status_code == 401
    tenant = httpx.post(served.url + "/v1/completions", content=oversized, timeout=60,
                        headers={"Authorization": f"Bearer {KEYS['acme']}", "content-type": "application/json"})
    assert tenant.status_code == 413 and "exceeds 32 MiB" in tenant.json()["error"]["message"]
