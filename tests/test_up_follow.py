"""`kvmesh up -f pool.yaml` follows edits of its file as the operator follows the CRD: a broken edit, one that
only a new `kvmesh up` could apply (the pool's name, here with an engine setting: none of it is applied) and one
no engine would start with (an unknown setting) are reported and change nothing (the pool serves on); a valid
edit raises the replica bounds (a new engine starts and serves) and swaps the LoRA adapters in the running engine
through the operator's adapter sync, while the engine started after the edit starts with the new list; a refused
adapter is not retried over ticks counted by a full engine's retries. Simulated engines; the checks of what an
edit may change are pure and tested first (the rolls of engines and router an edit of their settings starts:
tests/test_up_roll.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from kvmesh.engine.protocol import LOAD_LORA_PATH, MODELS_PATH, UNLOAD_LORA_PATH, OperatorMetric
from kvmesh.operator.crd import parse_pool
from kvmesh.operator.local import LocalOperator, ignored_locally, needs_restart, start_inputs
from kvmesh.operator.lora import EnginePod, served_adapters
from kvmesh.processes import free_port, launch
from kvmesh.up import PoolFile

from .engines import stop_up
from .test_lora import write_adapter
from .test_operator_lora_state import hanging_engine
from .test_up_scaling import engine_urls, operator_url, pool_headers, sample, wait_for


def pool(**spec: object) -> object:
    base = {"model": {"source": "bundled"}, "replicas": {"both": {"min": 1, "max": 1}}}
    return parse_pool({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "p"},
                       "spec": {**base, **spec}})


def test_what_the_processes_started_with_needs_a_restart_the_rest_is_live_or_a_clusters_only() -> None:
    before = pool(scaling={"warmupPrefixes": 64})
    live = pool(replicas={"both": {"min": 2, "max": 3}}, scaling={"warmupPrefixes": 64, "intervalSeconds": 2},
                model={"source": "bundled", "loraAdapters": [{"name": "sql", "path": "/a/sql"}]})
    assert needs_restart(before, live) == [] and ignored_locally(before, live) == []  # type: ignore[arg-type]
    # a cluster's only: changes nothing locally, said so, and the edit's replicas are followed with it
    cluster = pool(replicas={"both": {"min": 1, "max": 3}}, scaling={"warmupPrefixes": 64},
                   engine={"image": "x/y:2", "resources": {"requests": {"cpu": "8"}}}, router={"replicas": 3})
    assert needs_restart(before, cluster) == []  # type: ignore[arg-type]
    assert ignored_locally(before, cluster) == ["engine.image", "engine.resources", "router.replicas"]  # type: ignore
    # what the engines, the engines the scaler adds, or the router read at start, even under spec.scaling
    restart = {
        "engine.yaml max_num_seqs": pool(scaling={"warmupPrefixes": 64}, engine={"maxNumSeqs": 7}),
        "engine.yaml forecast_horizon_seconds": pool(scaling={"warmupPrefixes": 64, "horizonSeconds": 600}),
        "router.yaml ttft_slo_seconds": pool(scaling={"warmupPrefixes": 64, "slo": {"ttftSeconds": 0.5}}),
        "engine-scaled.yaml warmup_grace_seconds": pool(scaling={"warmupPrefixes": 0}),
        "engines model": pool(scaling={"warmupPrefixes": 64}, model={"source": "/models/other"}),
    }
    for named, edited in restart.items():
        assert named in needs_restart(before, edited), named  # type: ignore[arg-type]
    assert start_inputs(live) == start_inputs(before)  # type: ignore[arg-type]


def test_the_file_is_polled_by_its_signature_and_an_edit_by_rename_counts(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("a: 1\n")
    watched = PoolFile(path)
    assert watched.changed() and not watched.changed()  # the first poll reads it; then nothing changed
    replacement = tmp_path / "new.yaml"
    replacement.write_text("a: 2\n")
    os.replace(replacement, path)  # as editors save
    assert watched.changed() and not watched.changed()
    path.unlink()
    assert watched.changed()  # gone: read again, and the read's error is reported


def test_reading_an_edit_never_raises_a_malformed_one_is_reported(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pool.yaml"
    head = "apiVersion: kvmesh.io/v1alpha1\nkind: InferencePool\n"
    path.write_text(head + "metadata: [p]\nspec: {model: {source: bundled}}\n")
    pool, problem = PoolFile(path).read()
    assert pool is None and "metadata and spec must be mappings" in str(problem)
    path.write_text(head + "metadata: {name: p}\nspec: {model: {source: bundled}}\n")
    pool, problem = PoolFile(path).read()
    assert problem is None and pool.name == "p" and pool.namespace == "local"

    def unforeseen(path: object) -> None:  # fault injection: a shape no check foresaw fails inside the reader
        raise KeyError("model")

    monkeypatch.setattr("kvmesh.up.read_pool_file", unforeseen)
    pool, problem = PoolFile(path).read()
    assert pool is None and "KeyError('model')" in str(problem)


@pytest.mark.timeout(8)  # the cluster's budget (10 s) on `kvmesh up`'s supervision thread would fail here
def test_a_hanging_load_holds_the_local_tick_for_its_small_budget_only() -> None:
    adapters = pool(model={"source": "bundled", "loraAdapters": [{"name": "sql", "path": "/a/sql"}]})
    operator = LocalOperator(adapters)  # type: ignore[arg-type]
    with hanging_engine() as (url, seen):
        engine = EnginePod("engine-0", "both", url)
        tick = operator.sync_adapters([engine], {engine.life})
    assert seen[-1].startswith("POST /v1/load_lora_adapter")  # the load was tried...
    assert tick.status is not None and tick.status.reason == "Pending"  # ...and is retried at the next tick


POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {{name: follow}}
spec:
  model:
    source: bundled
    loraAdapters: [{adapters}]
  engine: {{kvCacheMemoryMiB: 8, maxLoras: 2, maxLoraRank: 8{engine}}}
  replicas:
    both: {{min: {low}, max: {high}}}
  scaling: {{intervalSeconds: 1}}
"""


def write_pool(path: Path, adapters: dict[str, Path], low: int = 1, high: int = 1, engine: str = "",
               text: str | None = None) -> None:
    """Saved as editors save: a new file renamed over the old one."""
    listed = ", ".join(f"{{name: {n}, path: {p}}}" for n, p in adapters.items())
    partial = path.with_suffix(".partial")
    partial.write_text(text if text is not None else POOL.format(adapters=listed, low=low, high=high, engine=engine))
    os.replace(partial, path)


def served(url: str, log: Path) -> dict[str, str]:
    return served_adapters(httpx.get(url + MODELS_PATH, headers=pool_headers(log), timeout=10).json())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kvmesh_up_follows_edits_of_its_pool_file(tmp_path: Path) -> None:
    sql, poet, x, y = (write_adapter(tmp_path / name, seed=seed, rank=4, layers=1)
                       for name, seed in (("sql", 1), ("poet", 2), ("by-hand-1", 3), ("by-hand-2", 4)))
    pool_file = tmp_path / "pool.yaml"
    write_pool(pool_file, {"sql": sql})
    port, ready, targets, log = free_port(), tmp_path / "ready", tmp_path / "targets.json", tmp_path / "up.log"
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "-f", str(pool_file), "--sim", "--port", str(port),
                   "--ready-file", str(ready), "--targets-file", str(targets)], log)
    url = f"http://127.0.0.1:{port}"

    def logged(text: str) -> bool:
        return text in log.read_text()

    try:
        wait_for(ready.exists, "the pool to be ready", proc, log)
        first = engine_urls(targets)["engine-0"]
        assert served(first, log) == {"sql": str(sql)}

        # a broken edit: said, and nothing changes
        write_pool(pool_file, {}, text="spec: [unclosed\n")
        wait_for(lambda: logged("changed but cannot be used"), "the broken edit to be reported", proc, log)
        renamed = POOL.format(adapters=f"{{name: sql, path: {sql}}}", low=1, high=1, engine=", maxNumSeqs: 7")
        write_pool(pool_file, {}, text=renamed.replace("name: follow}", "name: renamed}"))
        wait_for(lambda: logged("must share (router.yaml pool), which no rolling restart can change; none of this "
                                "edit is applied"), "the edit needing a new kvmesh up to be reported", proc, log)
        # a setting no engine would start with: refused with the pool file, before any engine is replaced
        write_pool(pool_file, {"sql": sql}, low=1, high=1, engine=", settings: {kv_cache_blockz: 9}")
        wait_for(lambda: logged("cannot be used: engine.settings: unknown setting 'kv_cache_blockz' (did you mean "
                                "'kv_cache_blocks'?)"), "the unknown setting to be reported", proc, log)
        assert not logged("rolling engine-0")
        reply = httpx.post(url + "/v1/completions", json={"model": "sql", "prompt": [1, 2, 3], "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200 and list(engine_urls(targets)) == ["engine-0"]

        # a valid edit: two engines, `poet` instead of `sql`, and an adapter no engine can load
        missing = tmp_path / "missing"
        write_pool(pool_file, {"poet": poet, "bad": missing}, low=2, high=2)
        wait_for(lambda: logged("changed: following it (replicas both 2..2; adapters poet, bad)"),
                 "the edit followed", proc, log)
        wait_for(lambda: len(engine_urls(targets)) == 2, "a second engine for the new minimum", proc, log)
        wait_for(lambda: all(served(u, log) == {"poet": str(poet)} for u in engine_urls(targets).values()),
                 "both engines to serve only the new adapter", proc, log)
        assert logged("adapters: engine-0: unload LoRA adapter 'sql'")
        assert logged("adapters: engine-0: load LoRA adapter 'poet'")
        assert not logged("adapters: engine-1: load LoRA adapter 'poet'")  # it started with the new list
        operator = operator_url(targets)
        counted = {"pool_namespace": "local", "pool": "follow", "role": "both"}

        def actions(action: str, outcome: str) -> float | None:
            return sample(operator, f"{OperatorMetric.LORA_ACTIONS}_total", **counted, action=action, outcome=outcome)

        # `bad` is refused once by each engine, said once each, and then held, not retried at each tick
        wait_for(lambda: actions("load", "refused") == 2, "both engines to refuse the missing adapter", proc, log)
        assert (actions("load", "ok"), actions("unload", "ok")) == (1, 1)
        assert logged("adapters Refused: refused, change the spec")
        wait_for(lambda: httpx.post(url + "/v1/completions", json={"model": "poet", "prompt": [1, 2, 3],
                                                                    "max_tokens": 2}, timeout=60).status_code == 200,
                 "the router to route the new adapter", proc, log)

        # Ticks counted, not waited for: adapters loaded by hand under names the spec never declared (left alone by
        # the sync) take both slots (maxLoras 2) in `poet`'s place, so each engine answers its load 409 and the
        # sync retries it at every tick; all the while `bad` stays held.
        def crowd_out_poet(engine: str) -> bool:
            token = pool_headers(log)  # the pool's engines answer only its members
            if served(engine, log).keys() != {"by-hand-1", "by-hand-2"}:  # a tick may reload `poet` in between
                httpx.post(engine + LOAD_LORA_PATH, json={"lora_name": "by-hand-1", "lora_path": str(x)},
                           headers=token, timeout=10)
                httpx.post(engine + UNLOAD_LORA_PATH, json={"lora_name": "poet"}, headers=token, timeout=10)
                httpx.post(engine + LOAD_LORA_PATH, json={"lora_name": "by-hand-2", "lora_path": str(y)},
                           headers=token, timeout=10)
            return served(engine, log).keys() == {"by-hand-1", "by-hand-2"}

        wait_for(lambda: all([crowd_out_poet(u) for u in engine_urls(targets).values()]),
                 "adapters loaded by hand to take both slots of each engine", proc, log)
        retried = actions("load", "retry") or 0
        wait_for(lambda: (actions("load", "retry") or 0) >= retried + 2 * 3, "three ticks retrying `poet` on both "
                 "engines", proc, log)
        assert actions("load", "refused") == 2
        for engine in ("engine-0", "engine-1"):
            assert log.read_text().count(f"adapters: {engine}: load LoRA adapter 'bad'") == 1
        assert all(served(u, log).keys() == {"by-hand-1", "by-hand-2"} for u in engine_urls(targets).values())
        assert proc.poll() is None
    finally:
        stop_up(proc, log)
