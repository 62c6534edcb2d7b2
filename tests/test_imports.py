"""The import rule of docs/architecture.md: the router and the operator take from the engine only its torch-free
contract modules, so a router or operator image needs no torch (a CPU wheel alone is hundreds of megabytes) and
starts in a fraction of the engine's time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# what the router and operator may load from the engine (docs/architecture.md): contracts, request bodies, the
# output constraints' check, the tokenizer with its cache and its way of showing tools in a prompt, and the one
# tracing setup (OpenTelemetry only, so both programs export their spans the same way), the settings' type check, and
# the engines' settings file (the operator checks engine.settings against the fields the engine starts with, and
# the whole file as the engine validates it: the names of its policies and cost profiles)
ALLOWED = {"kvmesh.engine", "kvmesh.engine.protocol", "kvmesh.engine.openai_types", "kvmesh.engine.constraint",
           "kvmesh.engine.model", "kvmesh.engine.model.tokenizer", "kvmesh.engine.model.token_cache",
           "kvmesh.engine.model.tool_prompt", "kvmesh.engine.tracing", "kvmesh.engine.typed_fields",
           "kvmesh.engine.config", "kvmesh.engine.body_deadline", "kvmesh.engine.kv", "kvmesh.engine.kv.costs",
           "kvmesh.engine.kv.policy", "kvmesh.engine.spec", "kvmesh.engine.internal_token"}
EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "disaggregated.yaml"


def test_the_router_and_the_operator_load_no_torch_and_only_the_engine_s_contract_modules() -> None:
    """Also once the operator has checked a pool's files as the engine and the router check them at start."""
    program = ("import json, sys\n"
               "import kvmesh.router.app, kvmesh.router.extproc, kvmesh.operator.handlers, kvmesh.operator.local\n"
               "from kvmesh.operator.crd import load_pool_file\n"
               "from kvmesh.operator.desired import check_program_files\n"
               f"check_program_files(load_pool_file({str(EXAMPLE)!r}))\n"
               "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", program], check=True, capture_output=True,
                                       text=True).stdout)
    assert "torch" not in loaded and "triton" not in loaded
    assert {m for m in loaded if m.startswith("kvmesh.engine")} <= ALLOWED


def test_the_gateway_loads_no_router_app() -> None:
    """`kvmesh gateway` reads only a body's `model`: it shares the router's plain-ASGI pieces (router/asgi.py), not
    its app (with the tokenizer and the Batch and Responses APIs: 0.63 s of imports down to 0.49 s)."""
    program = "import json, sys\nimport kvmesh.router.gateway_app\nprint(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", program], check=True, capture_output=True,
                                       text=True).stdout)
    assert "kvmesh.router.asgi" in loaded
    assert not {"kvmesh.router.app", "kvmesh.engine.model.tokenizer"} & set(loaded)
