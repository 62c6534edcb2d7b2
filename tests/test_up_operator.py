"""The operator's tick inside `kvmesh up -f` (operator/local.py's LocalOperator) over engines' metrics texts: new
engines are warmed from the peer whose cache served the most hits since the last tick, and each decision lands in
the operator's own registry under its names and labels, with the local pool's namespace. The HTTP of a warm-up
and the processes are tested in tests/test_up_scaling.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.protocol import OperatorMetric, VllmMetric
from kvmesh.operator.local import LocalOperator, LocalPod, Tick
from kvmesh.up import LOCAL_NAMESPACE, plan_from_file

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def engine(name: str, cached_tokens: float, usage: float = 0.9, ready: bool = True) -> LocalPod:
    """An engine's /metrics as the scaler reads it: a busy cache, and the prompt tokens it served from cache."""
    text = "\n".join([f"{VllmMetric.KV_USAGE} {usage}", f"{VllmMetric.RUNNING} 4",
                      f'{VllmMetric.CACHE_CONFIG}{{block_size="16",num_gpu_blocks="1000"}} 1',
                      f"# TYPE {VllmMetric.PREFIX_HITS} counter",
                      f"{VllmMetric.PREFIX_HITS}_total {cached_tokens}", ""])
    return LocalPod(name, "both", f"http://127.0.0.1:1/{name}", text, ready)


def series(operator: LocalOperator) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(operator.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_the_local_tick_plans_warming_new_engines_from_the_hottest_peer_and_records_its_decisions() -> None:
    plan = plan_from_file(EXAMPLES / "aggregated.yaml")
    assert plan.pool.namespace == LOCAL_NAMESPACE  # the namespace its engines' targets carry
    operator = LocalOperator(plan.pool)
    assert operator.gated  # warmupPrefixes defaults to 16: engines the scaler adds wait for their warm-up

    first = operator.decide(0.0, [engine("engine-0", 0), engine("engine-1", 0)], {"both": 2})
    assert first.warmups.warmups == () and first.warmups.open_now == ()  # the pool's first engines: nothing
    before, after = {"both": 2}, first.decision.replicas
    assert after["both"] > 2  # a busy pool grows
    operator.record(first.decision, after, before)
    labels = (("pool", "chat"), ("pool_namespace", LOCAL_NAMESPACE), ("role", "both"))
    got = series(operator)
    assert got[(f"{OperatorMetric.SCALING_DECISIONS}_total", tuple(sorted((*labels, ("direction", "up")))))] == 1
    assert got[(f"{OperatorMetric.SCALING_DECISIONS}_total", tuple(sorted((*labels, ("direction", "down")))))] == 0
    assert got[(OperatorMetric.DESIRED_REPLICAS, labels)] == after["both"]

    # engine-1 served five times the hits of engine-0 since; engine-2 answers /metrics but is not ready yet
    second = operator.decide(15.0, [engine("engine-0", 100), engine("engine-1", 500),
                                    engine("engine-2", 0, usage=0.0, ready=False)], after)
    (warmup,) = second.warmups.warmups
    assert warmup.source.name == "engine-1" and [t.name for t in warmup.targets] == ["engine-2"]
    assert warmup.source.url == "http://127.0.0.1:1/engine-1"


def test_each_local_tick_is_one_evaluation_in_the_operator_s_heartbeat() -> None:
    """`kvmesh up`'s tick counts in the cluster timer's heartbeat (operator/metrics.py `evaluation`): one ok per
    tick decided and carried out, an error for one that cannot read an engine's metrics or whose carrying out
    fails (an engine that cannot be started: raised on, `kvmesh up` reports it and the next tick tries again),
    stamped with the wall clock and the pool's interval, which the Stalled alert compares."""
    plan = plan_from_file(EXAMPLES / "aggregated.yaml")
    operator = LocalOperator(plan.pool)

    def value(name: str, **labels: str) -> float | None:
        return operator.metrics.registry.get_sample_value(name, {"pool_namespace": LOCAL_NAMESPACE, "pool": "chat",
                                                                 **labels})

    def counted() -> tuple[float | None, float | None]:
        return (value(f"{OperatorMetric.EVALUATIONS}_total", outcome="ok"),
                value(f"{OperatorMetric.EVALUATIONS}_total", outcome="error"))

    assert counted() == (None, None) and value(OperatorMetric.LAST_EVALUATION) is None  # none before a first tick
    start = time.time()
    carried: list[Tick] = []
    for step in range(3):
        operator.tick(15.0 * step, [engine("engine-0", 0), engine("engine-1", 0)], {"both": 2}, carried.append)
    assert counted() == (3, 0) and len(carried) == 3
    stamped = value(OperatorMetric.LAST_EVALUATION)
    assert stamped is not None and start <= stamped <= time.time()  # Unix time, not the scaler's clock (0 to 30)
    assert value(OperatorMetric.EVALUATION_INTERVAL) == plan.pool.spec["scaling"]["intervalSeconds"]

    broken = LocalPod("engine-0", "both", "http://127.0.0.1:1/engine-0", "not prometheus text {", True)
    with pytest.raises(ValueError):
        operator.tick(45.0, [broken], {"both": 2}, carried.append)
    assert counted() == (3, 1) and len(carried) == 3  # nothing to carry out

    def no_engine_starts(_: Tick) -> None:
        raise OSError(24, "Too many open files")

    with pytest.raises(OSError):
        operator.tick(60.0, [engine("engine-0", 0), engine("engine-1", 0)], {"both": 2}, no_engine_starts)
    assert counted() == (3, 2)


def test_a_local_pool_never_loads_kopf() -> None:
    """`kvmesh up -f` runs the operator's tick without Kubernetes: reading the pool, deciding, warming and
    recording must not import kopf (a fresh interpreter, since this test process has it from other tests)."""
    code = f"""
import sys
from kvmesh.cli import main
from kvmesh.up import plan_from_file
from kvmesh.operator.local import LocalOperator, LocalPod, describe, local_engine_settings, local_router_settings
plan = plan_from_file({str(EXAMPLES / "aggregated.yaml")!r})
operator = LocalOperator(plan.pool)
text = "{VllmMetric.KV_USAGE} 0.5\\n"
tick = operator.decide(0.0, [LocalPod("engine-0", "both", "http://127.0.0.1:1", text, True)], {{"both": 2}})
operator.record(tick.decision, tick.decision.replicas, {{"both": 2}})
describe(tick.decision, {{"both": 2}})
print(sorted(m for m in sys.modules if m.split(".")[0] == "kopf"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
