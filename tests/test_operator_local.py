"""The operator's decisions on one machine (operator/local.py): `kvmesh up -f pool.yaml` reads the pool through
the CRD's one source, and the same scaler runs over local engines' metrics; and the `kvmesh operator` command."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvmesh.cli import main
from kvmesh.engine.protocol import Metric, VllmMetric
from kvmesh.operator.crd import SpecError, load_pool_file, render_crd
from kvmesh.operator.forecast import Scaler, parse_pod
from kvmesh.operator.local import LocalOperator, LocalPod, describe
from kvmesh.up import plan_from_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"


def test_kvmesh_up_reads_a_pool_with_the_cluster_s_defaults_and_checks(tmp_path: Path) -> None:
    plan = plan_from_file(EXAMPLES / "aggregated.yaml")
    assert (plan.name, plan.engines, plan.model, plan.roles) == ("chat", 2, None, None)
    assert plan.engine["kv_cache_memory_mib"] == 512 and "port" not in plan.engine and "host" not in plan.engine
    assert plan.router["pool"] == "chat" and "discovery" not in plan.router
    assert plan.router["ttft_slo_seconds"] == 2
    split = plan_from_file(EXAMPLES / "disaggregated.yaml")
    assert split.roles == ["prefill", "decode", "decode"] and split.engines == 3
    bad = yaml.safe_load((EXAMPLES / "aggregated.yaml").read_text())
    bad["spec"]["replicas"]["both"] = {"min": 4, "max": 2}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(SpecError, match="min must be at most max"):
        plan_from_file(tmp_path / "bad.yaml")


def test_a_local_pool_opens_no_gateway_port(tmp_path: Path) -> None:
    """The cluster's router serves ext_proc for a Gateway; a local router has no Gateway, so no extra port."""
    pool = yaml.safe_load((EXAMPLES / "aggregated.yaml").read_text())
    pool["spec"]["gatewayInferencePool"] = {"enabled": True}
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(pool))
    assert "ext_proc_port" not in plan_from_file(tmp_path / "gw.yaml").router


def test_a_local_pool_reads_no_keys_file_from_a_clusters_secret_mount(tmp_path: Path) -> None:
    """router.apiKeys mounts a Secret in a pod; a local router would fail to start on that path. A keys file of
    this machine, named in router.settings, is kept."""
    pool = yaml.safe_load((EXAMPLES / "aggregated.yaml").read_text())
    pool["spec"]["router"]["apiKeys"] = {"secretName": "pool-keys"}
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(pool))
    assert "api_keys_file" not in plan_from_file(tmp_path / "keys.yaml").router
    pool["spec"]["router"]["settings"] = {"api_keys_file": "/home/me/keys.yaml"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(pool))
    assert plan_from_file(tmp_path / "mine.yaml").router["api_keys_file"] == "/home/me/keys.yaml"


def test_kvmesh_up_refuses_a_bad_pool_file_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pool.yaml").write_text("apiVersion: kvmesh.io/v1alpha1\nkind: InferencePool\n"
                                        "metadata: {name: x}\nspec: {model: {source: bundled}, mode: sharded}\n")
    assert main(["up", "-f", str(tmp_path / "pool.yaml")]) == 2
    assert "mode" in capsys.readouterr().err


def test_kvmesh_operator_renders_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "--render-crd"]) == 0
    assert capsys.readouterr().out == render_crd()
    assert main(["operator", "--kubeconfig", "/nonexistent/kubeconfig"]) == 2


def engine_text(usage: float, p90: float, overload: float) -> str:
    return "\n".join([f"{VllmMetric.KV_USAGE} {usage}",
                      f'{VllmMetric.CACHE_CONFIG}{{block_size="16",num_gpu_blocks="1000"}} 1',
                      *(f'{Metric.FORECAST_USAGE}{{level="{lv}"}} {p90}' for lv in ("p50", "p90", "p99")),
                      f"{Metric.FORECAST_OVERLOAD} {overload}", ""])


def test_the_local_scaler_makes_the_operator_s_decision_from_engine_metrics() -> None:
    pool = load_pool_file(str(EXAMPLES / "aggregated.yaml"))
    scaler = Scaler(pool)
    replicas = {"both": 2}
    hot = [parse_pod(f"engine-{i}", "both", engine_text(0.6, 1.0, 0.4)) for i in range(2)]
    decision = scaler.observe(0.0, hot, replicas)
    assert decision.replicas == {"both": 3}  # ceil(2 x 1000 / 800)
    (line,) = describe(decision, replicas)
    assert line.startswith("both: 2 -> 3 replicas (ScaleUpPredictedOverload")
    calm = [parse_pod(f"engine-{i}", "both", engine_text(0.1, 0.1, 0.0)) for i in range(2)]
    assert describe(scaler.observe(10.0, calm, {"both": 3}), {"both": 3}) == []  # within the stabilization window


def test_an_edited_spec_keeps_what_the_scaler_learnt_of_the_traffic(tmp_path: Path) -> None:
    """`kvmesh up -f` following an edit, as the cluster operator's timer under a changed spec
    (PoolMemory.scaler_for): the scaler takes the new bounds and keeps the traffic estimate and its recent
    recommendations, so the edit neither blinds it nor restarts its stabilization window."""
    pool = load_pool_file(str(EXAMPLES / "aggregated.yaml"))
    operator = LocalOperator(pool)
    hot = [LocalPod(f"engine-{i}", "both", f"http://127.0.0.1:{9000 + i}", engine_text(0.6, 1.0, 0.4), True)
           for i in range(2)]
    assert operator.decide(0.0, hot, {"both": 2}).decision.replicas == {"both": 3}
    learnt = operator.memory.scaler
    assert learnt is not None and learnt.history
    raw = yaml.safe_load((EXAMPLES / "aggregated.yaml").read_text())
    raw["spec"]["replicas"]["both"]["max"] = 2
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(raw))
    edited = load_pool_file(str(tmp_path / "edited.yaml"))
    operator.follow(edited)
    scaler = operator.memory.scaler_for(edited)
    assert (scaler.pool, scaler.traffic, scaler.history) == (edited, learnt.traffic, learnt.history)
    assert operator.memory.scaler_for(edited) is scaler  # rebuilt once per edit, not at every tick
    assert operator.decide(10.0, hot, {"both": 2}).decision.replicas == {"both": 2}  # the new bound


def test_a_local_pool_holds_a_role_whose_serving_engines_did_not_answer() -> None:
    """As the cluster's timer: engines that serve but whose /metrics did not answer this tick (`kvmesh up` counts
    them) are not taken for idle, so their role is not scaled down meanwhile; without them it would be."""
    pool = load_pool_file(str(EXAMPLES / "aggregated.yaml"))

    def pods(n: int) -> list[LocalPod]:
        return [LocalPod(f"engine-{i}", "both", f"http://127.0.0.1:{9000 + i}", engine_text(0.05, 0.05, 0.0), True)
                for i in range(n)]

    held, blind = LocalOperator(pool), LocalOperator(pool)
    for operator in (held, blind):
        operator.decide(0.0, pods(3), {"both": 3})
    assert blind.decide(1000.0, pods(1), {"both": 3}).decision.replicas["both"] < 3
    kept = held.decide(1000.0, pods(1), {"both": 3}, unanswered={"both": 2}).decision
    assert kept.replicas == {"both": 3} and kept.roles["both"].reason == "HoldMissingMetrics"
