"""`kvmesh bench lora` on the tiny random model: every setup serves every request in full, the one-at-a-time
setup really computes one adapter a step while multi-LoRA mixes them, the memory line is N x the weights against
the weights plus the slots, and bad options stop with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvmesh.bench.lora import BASE, MIXED, ONE_AT_A_TIME, SETUPS, CountingEngine, assign_adapters, serve
from kvmesh.cli import main
from kvmesh.engine.config import EngineConfig

REQUESTS, OUT, N, RANK = 6, 5, 3, 4  # requests, output tokens a request, adapters, rank


def bench(tiny_dir: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "lora.json"
    argv = ["bench", "lora", "--model", str(tiny_dir), "--dtype", "float32", "--adapters", str(N), "--rank",
            str(RANK), "--concurrency", str(REQUESTS), "--prompt-tokens", "20", "--output-tokens", str(OUT),
            "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_every_setup_serves_every_request_and_batches_as_it_claims(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    result = bench(tiny_dir, tmp_path, "--repeats", "2")
    runs = result["runs"]
    assert sorted(r["setup"] for r in runs) == sorted(SETUPS * 2)
    assert [r["setup"] for r in runs[:3]] != [r["setup"] for r in runs[3:]]  # the order rotates
    for r in runs:
        assert r["requests_completed"] == REQUESTS and r["output_tokens"] == REQUESTS * OUT, r
        assert r["output_tokens_per_second"] > 0 and 0 < r["mean_ttft_seconds"] <= r["seconds"]
        assert r["mean_ttft_seconds"] <= r["p90_ttft_seconds"] * 1.0001 and r["mean_itl_seconds"] > 0
    medians = result["medians"]
    assert set(medians) == set(SETUPS)
    assert medians[BASE]["max_adapters_per_step"] == 0
    # round-robin, all arriving at once: the first step prefills every adapter's requests together
    assert medians[MIXED]["max_adapters_per_step"] == N
    alone = [r for r in runs if r["setup"] == ONE_AT_A_TIME]
    assert all(r["max_adapters_per_step"] == 1 and r["mean_adapters_per_step"] == 1.0 for r in alone)
    # a wave per adapter: more steps than serving them all at once
    assert all(r["steps"] > medians[MIXED]["steps"] for r in alone)
    assert result["requests_per_adapter"] == [REQUESTS // N] * N

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    weights = sum(p.numel() * 4 for p in reference.parameters())  # tied embeddings counted once
    m = result["memory"]
    assert m["weight_bytes"] == weights
    assert m["merged_bytes"] == N * weights
    # slots: max_loras (= N) x rank x (in + out features of the seven projections: 1024 here) x 2 layers x 4 bytes
    assert m["lora_slot_bytes"] == N * RANK * 1024 * 2 * 4
    assert m["multi_lora_bytes"] == weights + m["lora_slot_bytes"]
    assert m["ratio"] == pytest.approx(N * weights / (weights + m["lora_slot_bytes"]))

    table = capsys.readouterr().out
    for setup in SETUPS:
        assert f"| {setup} |" in table
    assert f"| merged, one engine per adapter ({N} engines) |" in table


def test_zipf_skew_and_fewer_targets(tiny_dir: Path, tmp_path: Path) -> None:
    result = bench(tiny_dir, tmp_path, "--skew", "2", "--targets", "q_proj,v_proj", "--max-lora-rank", "8",
                   "--max-loras", "4")
    counts = result["requests_per_adapter"]
    assert sum(counts) == REQUESTS and counts[0] == max(counts)
    alone = result["medians"][ONE_AT_A_TIME]
    assert alone["requests_completed"] == REQUESTS and alone["max_adapters_per_step"] == 1
    assert result["medians"][MIXED]["max_adapters_per_step"] == sum(1 for c in counts if c)
    # the slots are sized by the engine's settings, whatever the adapters use
    assert result["memory"]["lora_slot_bytes"] == 4 * 8 * 1024 * 2 * 4


def test_a_request_that_fails_is_not_counted_as_served(tiny_dir: Path) -> None:
    engine = CountingEngine(EngineConfig(model=str(tiny_dir), dtype="float32", kv_cache_blocks=64, max_loras=1,
                                         max_lora_rank=4))
    stats = serve(engine, [[100, 101, 102]] * 2, [None, "not-loaded"], OUT, [[0, 1]], "check")
    assert stats.requests_completed == 1 and stats.output_tokens == OUT  # the unknown adapter's request errored
    assert stats.max_adapters_per_step == 0


def test_assignment_is_round_robin_or_seeded_zipf() -> None:
    assert assign_adapters(7, 3, 0.0, seed=1) == [0, 1, 2, 0, 1, 2, 0]
    skewed = assign_adapters(2000, 4, 1.0, seed=1)
    assert skewed == assign_adapters(2000, 4, 1.0, seed=1)
    shares = [skewed.count(k) / 2000 for k in range(4)]
    expected = [1 / (k + 1) / sum(1 / (j + 1) for j in range(4)) for k in range(4)]
    assert shares == pytest.approx(expected, abs=0.04)


@pytest.mark.parametrize("extra, message", [
    (["--adapters", "5", "--max-loras", "4"], "--adapters 5 do not fit in --max-loras 4"),
    (["--rank", "32", "--max-lora-rank", "16"], "--rank 32 is above --max-lora-rank 16"),
    (["--targets", "q_proj,lm_head"], "unknown: lm_head"),
    (["--output-tokens", "1"], "--output-tokens must be at least 2"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--skew", "-1"], "--skew must be 0"),
    (["--prompt-tokens", "1000", "--output-tokens", "100"], "exceeds the model's context of 1024"),
])
def test_bad_options_stop_with_a_message(tiny_dir: Path, extra: list[str], message: str, capsys) -> None:
    assert main(["bench", "lora", "--model", str(tiny_dir), *extra]) == 2
    assert message in capsys.readouterr().err
