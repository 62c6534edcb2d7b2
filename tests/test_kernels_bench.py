"""The kernel benchmark keeps working where it must run: from the source tree on a machine with only torch,
triton and numpy (no kvmesh installed), and as `kvmesh bench kernels`. Here it runs its CPU smoke sizes under
Triton's interpreter; its correctness pass must hold and every section must report."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "engine" / "kernels"
ALLOWED = {"torch", "triton", "numpy"} | set(sys.stdlib_module_names)


def test_kernel_modules_import_only_torch_triton_numpy_and_each_other() -> None:
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in ALLOWED, f"{path.name} imports {name}"


def check_report(report: dict) -> None:
    assert report["interpreted"] is True
    kernels = {c["kernel"] for c in report["correctness"]}
    assert kernels == {"decode splits=1", "decode splits=4", "decode int8", "extend", "kv_write", "kv_write int8",
                       "gather/scatter"}
    assert {c["dtype"] for c in report["correctness"]} == {"float16", "bfloat16", "float32"}
    assert all(c["ok"] for c in report["correctness"])
    assert {(r["context"], r["batch"]) for r in report["decode"]} == {(64, 1), (64, 2), (256, 1), (256, 2)}
    assert all(r["kernel_gbps"] > 0 and r["sdpa_gbps"] > 0 for r in report["decode"])
    sweep = report["decode_launch_sweep"]
    assert [launch["block_n"] for launch in sweep["launches"]] == [64, 32]  # the default first
    assert all(share > 0 for launch in sweep["launches"] for share in launch["share_of_copy"])  # all ran, all right
    assert sweep["best_worst_share"] >= sweep["default_worst_share"] > 0
    assert [(r["context"], r["batch"]) for r in report["decode_int8"]] == [(256, 1)]
    assert report["decode_int8"][0]["int8_us"] > 0 and report["decode_int8"][0]["model_dtype_us"] > 0
    assert all(r["kernel_tflops"] > 0 for r in report["extend"])
    assert report["block_copy"][0]["gather_gbps"] > 0 and report["copy_gbps"] > 0


@pytest.mark.slow
def test_bench_runs_from_the_source_tree_without_kvmesh(tmp_path: Path) -> None:
    """`python engine/kernels/bench.py`, with every import of kvmesh made to fail, from another directory; its
    throughput runs in the dtype asked for."""
    out = tmp_path / "kernels.json"
    blocked = (
        "import runpy, sys; sys.modules['kvmesh'] = None; "
        f"sys.argv = ['bench.py', '--dtype', 'float16', '--json', {str(out)!r}]; "
        f"runpy.run_path({str(KERNELS / 'bench.py')!r}, run_name='__main__')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", blocked], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not a performance number" in done.stderr
    report = json.loads(out.read_text())
    check_report(report)
    assert report["dtype"] == "float16"


def options(help_text: str) -> list[str]:
    """The options section of an argparse --help, less its own -h line: what a user can pass."""
    section = help_text.split("options:", 1)[1]
    return [line for line in section.splitlines() if line.strip() and "-h, --help" not in line
            and "show this help message" not in line]


def test_kvmesh_bench_kernels_takes_the_same_options_as_the_script() -> None:
    """`kvmesh bench kernels` is the script's parser and run (the run itself is the test above, one copy of ~30 s
    under the interpreter): the same options with the same choices, and a dtype outside them refused the same."""
    env = {**os.environ, "COLUMNS": "200"}
    cli = subprocess.run([sys.executable, "-m", "kvmesh.cli", "bench", "kernels", "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    script = subprocess.run([sys.executable, str(KERNELS / "bench.py"), "--help"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert cli.returncode == script.returncode == 0, cli.stderr + script.stderr
    assert options(cli.stdout) == options(script.stdout) and any("--dtype" in line for line in options(cli.stdout))
    bad = subprocess.run([sys.executable, "-m", "kvmesh.cli", "bench", "kernels", "--dtype", "int4"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'int4'" in bad.stderr
