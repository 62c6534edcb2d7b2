"""The CRD across releases. The API server applies a CRD's defaults to every pool it serves, so a defaulted field
that a release adds reaches every stored pool the moment its CRD is applied: an older operator, still running before
`helm upgrade` rolls it or running again after a rollback, refuses each pool for a field it does not know. Fields
added since the baseline release default in the operator, not in the CRD."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.operator.crd import complete_spec, crd_manifest

ROOT = Path(__file__).resolve().parent.parent
BASELINE = {line for line in (ROOT / "tests" / "data" / "crd_fields_2026-12-05.txt").read_text().splitlines()
            if line and not line.startswith("#")}
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.yaml"))


def served_spec_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def children(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """A schema node's children and their paths (`[]` an item of a list, `{}` a value of a map)."""
    found = [(f"{path}.{name}", sub) for name, sub in (schema.get("properties") or {}).items()]
    if "items" in schema:
        found.append((f"{path}[]", schema["items"]))
    if isinstance(schema.get("additionalProperties"), dict):
        found.append((f"{path}{{}}", schema["additionalProperties"]))
    return found


def with_api_server_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """`value` defaulted as the API server does when it reads a stored object: each absent field that has a default
    gets it, in every object present."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out = dict(value)
        for name, sub in (schema.get("properties") or {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_api_server_defaults(out[name], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for name in set(out) - set(schema.get("properties") or {}):
                out[name] = with_api_server_defaults(out[name], schema["additionalProperties"])
        return out
    if isinstance(value, list) and "items" in schema:
        return [with_api_server_defaults(item, schema["items"]) for item in value]
    return value


def field_paths(value: Any, schema: dict[str, Any], path: str = "spec") -> set[str]:
    """The schema paths of the fields `value` has."""
    found = {path}
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties") or {}
        for name, item in value.items():
            sub = props.get(name, schema.get("additionalProperties"))
            sub_path = f"{path}.{name}" if name in props else f"{path}{{}}"
            if isinstance(sub, dict):
                found |= field_paths(item, sub, sub_path)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            found |= field_paths(item, schema["items"], f"{path}[]")
    return found


def test_the_crd_defaults_no_field_the_baseline_operator_does_not_know() -> None:
    """Below a field the baseline knows (present in pools it runs), every defaulted field is one it knows too;
    below a newer field (which a pool has only if its author wrote it) defaults may be anything."""
    newly_defaulted = []
    stack = [("spec", served_spec_schema())]
    while stack:
        path, schema = stack.pop()
        for sub_path, sub in children(schema, path):
            if "default" in sub and path in BASELINE and sub_path not in BASELINE:
                newly_defaulted.append(sub_path)
            stack.append((sub_path, sub))
    assert not newly_defaulted, (
        f"the CRD defaults {newly_defaulted}, which the operator of the baseline release refuses in every pool once "
        "this CRD is applied: default them in the operator instead (operator/crd.py's _operator_default)")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_a_pool_read_back_under_this_crd_has_only_the_fields_its_author_wrote_or_the_baseline_knows(
        example: Path) -> None:
    spec = next(d for d in yaml.safe_load_all(example.read_text()) if d and d.get("kind") == "InferencePool")["spec"]
    schema = served_spec_schema()
    added = field_paths(with_api_server_defaults(spec, schema), schema) - field_paths(spec, schema)
    assert added, "the API server defaults fields into every pool (a check that can see none checks nothing)"
    assert added <= BASELINE, f"fields the API server adds that the baseline operator refuses: {added - BASELINE}"


def test_the_operator_fills_in_the_defaults_the_crd_leaves_out() -> None:
    spec = complete_spec({"model": {"source": "bundled"}})
    assert spec["gateway"]["weight"] == 100
    assert spec["engine"]["scheduling"]["tolerations"] == [] and spec["router"]["scheduling"]["tolerations"] == []
