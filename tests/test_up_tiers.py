"""An engine that leaves a local pool for good takes its KV tier files with it, whichever way it left: a crashed
engine the scaler removes, and a roll's surge that exited, as one stopped on purpose. A preallocated host tier is
its size of RAM in /dev/shm until deleted, and a pool runs for days. On records of engines whose processes are only
polled, with tier files where `kvmesh up` names them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.up import CRASHED, SERVING, STARTING, LocalEngines, plan_from_file

from .test_up_observe import EXAMPLES, engine
from .test_up_restart import exited


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[LocalEngines]:
    pool = LocalEngines(plan_from_file(EXAMPLES / "aggregated.yaml"), [], tmp_path, None)
    yield pool
    pool.remove_tier_files()  # this run's, whatever the test left


def with_tiers(engines: LocalEngines, *names: str) -> None:
    """Engine `names`' host and disk tier files, as their engines would have made them."""
    for name in names:
        for path in engines.tier_paths(name):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"kv")


def tiered(engines: LocalEngines) -> list[str]:
    """The engines of this run that have tier files, by name."""
    return sorted({name for name in (f"engine-{i}" for i in range(4))
                   if any(path.exists() for path in engines.tier_paths(name))})


def test_a_crashed_engine_the_scaler_removes_takes_its_tier_files(
        engines: LocalEngines, sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    engines.engines = [engine("engine-0", sleeper, tmp_path), engine("engine-1", exited(), tmp_path, CRASHED)]
    with_tiers(engines, "engine-0", "engine-1")
    engines.scale("both", 1, {"engine-0": 0, "engine-1": 10})  # the crashed one goes first, not restarted
    assert [(e.child.name, e.state) for e in engines.engines] == [("engine-0", SERVING)]
    assert tiered(engines) == ["engine-0"]


def test_a_rolled_in_engine_that_exits_takes_its_tier_files(
        engines: LocalEngines, sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    engines.engines = [engine("engine-0", sleeper, tmp_path)]
    engines.roll(["engine.yaml max_num_seqs"], [])
    surge = engine("engine-1", exited(), tmp_path, STARTING)  # a new engine that could not start
    surge.replaces = "engine-0"
    engines.engines.append(surge)
    with_tiers(engines, "engine-0", "engine-1")
    with httpx.Client() as client:
        engines.progress(client)
    assert [(e.child.name, e.state) for e in engines.engines] == [("engine-0", SERVING)] and not engines.rolling
    assert tiered(engines) == ["engine-0"]
