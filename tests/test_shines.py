"""`kvmesh bench shines`: its verdicts from hand-made points, and one small sweep over simulated engines that
starts them itself (cache on, then off), plots and writes JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.shines import Point, gains, grows_with_concurrency, point_requests, prefill_share, verdict
from kvmesh.cli import main


def point(cache: bool, c: int, f: float, rps: float, latency: float, ttft: float = 0.0) -> Point:
    return Point(cache, c, f, 8, 0, 1.0, rps, rps * 16, latency, ttft, f if cache else 0.0)


def test_gains_verdict_and_single_request_ceiling() -> None:
    points = [
        point(False, 1, 1.0, 1.0, 1.0, ttft=0.8), point(True, 1, 1.0, 3.0, 0.33),
        point(False, 4, 1.0, 2.0, 2.0, ttft=1.5), point(True, 4, 1.0, 10.0, 0.4),
        point(False, 1, 0.5, 1.0, 1.0, ttft=0.8), point(True, 1, 0.5, 1.5, 0.66),
        point(False, 4, 0.5, 2.0, 2.0, ttft=1.5), point(True, 4, 0.5, 2.2, 1.8),
    ]
    found = {(g.concurrency, g.shared_fraction): g for g in gains(points)}
    assert found[(4, 1.0)].throughput == pytest.approx(5.0) and found[(4, 1.0)].latency == pytest.approx(5.0)
    assert grows_with_concurrency(list(found.values()), 1.0)  # 3x at c=1, 5x at c=4
    assert not grows_with_concurrency(list(found.values()), 0.5)  # 1.5x at c=1, 1.1x at c=4
    assert prefill_share(points) == pytest.approx(0.8)
    text = verdict(points)
    assert "prefill is 80.0%" in text and "5.0x faster" in text
    assert "shared 100%: throughput gain grows with concurrency (c=1: 3.00x, c=4: 5.00x)" in text
    assert "shared 50%: throughput gain does NOT grow with concurrency (c=1: 1.50x, c=4: 1.10x)" in text


def test_point_prompts_share_the_fraction_asked() -> None:
    warmup, timed = point_requests(2000, 0.75, 4, 16, seed=1, vocab=32000)
    assert all(len(r.prompt) == 2000 and r.max_tokens == 16 for r in [warmup, *timed])
    assert all(r.prompt[:1500] == warmup.prompt[:1500] for r in timed)
    assert len({tuple(r.prompt[1500:1516]) for r in [warmup, *timed]}) == 5
    _, none_shared = point_requests(2000, 0.0, 4, 16, seed=1, vocab=32000)
    assert len({tuple(r.prompt[:16]) for r in none_shared}) == 4


@pytest.mark.slow
def test_sweep_over_simulated_engines(tmp_path: Path) -> None:
    """Two concurrency levels, a shared prefix of 0 and 100 %: the engines report the cache hits only when it is
    on, and everything lands in the plot and the JSON."""
    out, png = tmp_path / "shines.json", tmp_path / "shines.png"
    code = main(["bench", "shines", "--sim", "h100-8b", "--prompt-tokens", "256", "--output-tokens", "4",
                 "--concurrency", "1,2", "--fractions", "0,1", "--requests", "2", "--json", str(out),
                 "--plot", str(png)])
    assert code == 0
    data = json.loads(out.read_text())
    points = {(p["cache"], p["concurrency"], p["shared_fraction"]): p for p in data["points"]}
    assert len(points) == 8 and all(p["failed"] == 0 and p["requests"] == 2 for p in points.values())
    for c in (1, 2):
        assert points[(True, c, 1.0)]["hit_ratio"] == pytest.approx(240 / 256)  # all but the last block
        assert points[(True, c, 0.0)]["hit_ratio"] == 0
        assert points[(False, c, 1.0)]["hit_ratio"] == 0
    assert len(data["gains"]) == 4 and "single-request ceiling" in data["verdict"]
    assert png.stat().st_size > 10_000
