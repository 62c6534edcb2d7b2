"""`kvmesh bench tiers` at small sizes: every fresh engine serves an untimed cold prompt before anything on it is
timed (a fresh engine's first request pays seconds of one-time cost, which made recompute look flat over prefix
length), and every TTFT cell is the median of three samples that hit what they are meant to hit."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import pytest

from kvmesh.bench import tiers
from kvmesh.cli import main
from kvmesh.engine.engine import Engine
from kvmesh.engine.request import Request

pytestmark = pytest.mark.slow

LENGTHS = (32, 64)


def test_each_fresh_engine_serves_an_untimed_cold_prompt_first_and_each_cell_has_three_samples(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[list[list[int]]] = []  # per engine built by the benchmark, the prompts submitted to it

    class RecordingEngine(Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.prompts: list[list[int]] = []
            prompts.append(self.prompts)

        def submit(self, request: Request) -> None:
            self.prompts.append(list(request.prompt_ids))
            super().submit(request)

    monkeypatch.setattr(tiers, "Engine", RecordingEngine)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", "--model", str(tiny_dir), "--prefix-tokens", ",".join(map(str, LENGTHS)),
                 "--chunks", "1,2", "--copy-blocks", "4", "--disk-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not list(temp.iterdir()), "the benchmark's work folder outlived it"

    served = [p for p in prompts if p]  # the probe that reads the block size serves nothing
    for engine_prompts in served:
        first, timed = engine_prompts[0], engine_prompts[1:]
        assert timed and all(len(first) == len(p) for p in timed)  # the length it warms up for
        assert all(first[:16] != p[:16] for p in timed)  # cold: it shares no block with what is timed

    cells = result["ttft"] + [result["recovery"][kept] for kept in ("host", "disk")]
    assert [(c["prefix_tokens"], c["source"]) for c in result["ttft"]] == [
        (n, s) for n in LENGTHS for s in ("recompute", "device", "host", "disk")]
    for cell in cells:
        assert len(cell["samples_seconds"]) == 3
        assert cell["ttft_seconds"] == statistics.median(cell["samples_seconds"])
        assert cell["min_seconds"] == min(cell["samples_seconds"])
        assert cell["max_seconds"] == max(cell["samples_seconds"])
        hit = 0 if cell["source"] == "recompute" else cell["prefix_tokens"]
        assert cell["cached_tokens"] == [hit] * 3, cell  # the warm-up prompts evicted nothing measured
    assert all(len(r["start_seconds"]) == 3 for r in (result["recovery"]["host"], result["recovery"]["disk"]))
    samples = sum(len(c["samples_seconds"]) for c in cells)
    assert sum(len(p) for p in served) == samples + len(served)  # one untimed request per engine, no more
