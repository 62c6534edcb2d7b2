"""What `kvmesh up` says as it starts a pool from a file (review): "1 engine", not "1 engines", and the file's
fields a local pool ignores (a cluster's only: engine.resources, engine.scheduling, router.replicas) are said at
start, as they were only after an edit of the file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvmesh.processes import free_port, launch, stop
from kvmesh.up import cluster_only_fields, read_pool_file

from .test_up_observe import EXAMPLES
from .test_up_scaling import wait_for

POOL = """
apiVersion: kvmesh.io/v1alpha1
kind: InferencePool
metadata: {name: local}
spec:
  model: {source: bundled}
  engine: {resources: {limits: {cpu: "2"}}, scheduling: {nodeSelector: {disk: ssd}}, blockSize: 32}
  router: {replicas: 3}
  replicas:
    both: {min: 1, max: 1}
"""


def test_cluster_only_fields_are_those_a_local_pool_ignores(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(POOL)
    # blockSize feeds the engines: not ignored; the examples' cluster fields are
    assert cluster_only_fields(read_pool_file(path)) == ["engine.resources", "engine.scheduling", "router.replicas"]
    assert cluster_only_fields(read_pool_file(EXAMPLES / "aggregated.yaml")) == ["engine.resources"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_start_says_one_engine_and_the_ignored_fields(tmp_path: Path) -> None:
    path, ready, log = tmp_path / "pool.yaml", tmp_path / "ready", tmp_path / "up.log"
    path.write_text(POOL)
    proc = launch([sys.executable, "-m", "kvmesh.cli", "up", "--sim", "-f", str(path), "--port", str(free_port()),
                   "--ready-file", str(ready)], log, new_session=True)
    try:
        wait_for(ready.exists, "the pool to be ready", proc, log, timeout=120)
    finally:
        stop([proc], timeout=30)
    said = log.read_text()
    assert "kvmesh up: starting 1 simulated (cpu-smollm) engine and a router" in said, said
    assert (f"kvmesh up: {path}: ignored locally, a cluster's only: engine.resources, engine.scheduling, "
            "router.replicas") in said, said
    assert said.index("ignored locally") < said.index("ready:"), said
