"""The study commands end to end on small traces: a table, JSON and a PNG, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.routing import PREFIX_LOAD_NAME
from kvmesh.cli import main


def mooncake(path: Path) -> Path:
    rows = []
    for i in range(60):  # ten conversations of six turns, each turn extending the last
        conversation, turn = i % 10, i // 10
        ids = [0, *range(1000 * conversation + 1, 1000 * conversation + 3 + turn)]
        rows.append({"timestamp": 500 * i, "input_length": 512 * len(ids) - 100, "output_length": 20,
                     "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_cluster_writes_a_table_json_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "cdf.png"
    code = main(["bench", "cluster", "--trace", str(mooncake(tmp_path / "t.jsonl")), "--instances", "4",
                 "--prefill-speed", "4000", "--json", str(out), "--plot", str(png)])
    assert code == 0
    body = json.loads(out.read_text())
    policies = [row["policy"] for row in body["rows"]]
    assert policies[0] == "random" and policies[-1] == "kvmesh" and len(policies) == 8
    assert PREFIX_LOAD_NAME in policies  # the baseline the routing headline is measured against
    kvmesh = body["rows"][-1]
    assert 0 < kvmesh["hit_ratio"] <= body["ideal_hit_ratio"] + 1e-9
    assert png.stat().st_size > 0 and "| kvmesh |" in capsys.readouterr().out


def test_bench_autoscale_on_a_small_azure_trace(tmp_path: Path) -> None:
    trace = tmp_path / "a.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.0000000,{300 + 7 * i},{20 + i % 30}\n" for i in range(240)))
    out = tmp_path / "a.json"
    code = main(["bench", "autoscale", "--trace", str(trace), "--speedup", "4", "--initial", "1",
                 "--hpa-targets", "0.8", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"].split(" ")[0] for r in rows] == ["static", "reactive", "kvmesh"]
    assert all(r["replica_seconds"] > 0 for r in rows)


def test_bench_autoscale_scale_to_zero_on_a_small_azure_trace(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "a.csv"  # 40 requests, a 10-minute gap, 40 more
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:{15 + i // 40 * 10:02d}:{i % 40:02d}.0000000,{300 + 7 * i},{20 + i % 30}\n" for i in range(80)))
    out = tmp_path / "z.json"
    code = main(["bench", "autoscale", "--scale-to-zero", "--trace", str(trace), "--pools", "2",
                 "--idle-seconds", "60", "--cold-start-seconds", "30", "--json", str(out)])
    assert code == 0
    body = json.loads(out.read_text())
    kept, zero = body["rows"]
    assert (kept["variant"], zero["variant"]) == ("min 1 instance", "scale to zero")
    assert zero["replica_seconds"] < kept["replica_seconds"] and zero["held"] > 0 and zero["wakes"] >= 1
    assert kept["held"] == 0 and zero["served"] + zero["failed"] == kept["served"] == 80
    assert "| scale to zero |" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["bench", "cluster", "--trace", "/no/such/trace.jsonl"],
    ["bench", "cluster", "--weight", "prefix_weight=lots"],
    ["bench", "autoscale", "--hpa-targets", "2"],
    ["bench", "autoscale", "--scale-to-zero", "--idle-seconds", "10"],
    ["bench", "disagg", "--instances", "1"],
])
def test_bad_input_is_a_message_not_a_crash(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # refused by argparse itself, with its usage line
        code = exc.code
    assert code == 2
    assert "kvmesh bench" in capsys.readouterr().err
