"""LoRA adapters in the InferencePool: `spec.model.loraAdapters` and `engine.maxLoras`/`maxLoraRank`. The schema
accepts a pool with adapters and refuses duplicate, badly named or too many adapters (jsonschema, the API
server's list-map rule, CEL, and `parse_pool` alike); the engines' ConfigMap file carries them as the engine's
`lora_modules`, read by the real engine config; an adapter on its own PVC is mounted where its path points;
`kvmesh up -f` gives local engines the same adapters."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh.engine.config import load_config
from kvmesh.engine.protocol import DEFAULT_MAX_LORAS
from kvmesh.operator.crd import (
    MAX_LORA_ADAPTERS,
    SpecError,
    complete_spec,
    crd_manifest,
    defaulted_spec,
    parse_pool,
    spec_schema,
)
from kvmesh.operator.desired import config_files, desired_objects
from kvmesh.operator.local import local_engine_settings
from kvmesh.up import plan_from_file

from .test_crd import VALIDATOR, cel_errors, example

ADAPTERS = [{"name": "sql-v1.2", "path": "/models/adapters/sql"},
            {"name": "poet", "path": "/adapters/poet/r16", "volumeClaim": "poet-weights"}]


def spec_with(adapters: list[dict[str, Any]], **engine: Any) -> dict[str, Any]:
    spec = copy.deepcopy(example("aggregated.yaml")["spec"])
    spec["model"]["loraAdapters"] = adapters
    spec["engine"].update(engine)
    return spec


def pool_with(adapters: list[dict[str, Any]], **engine: Any) -> Any:
    return parse_pool({"apiVersion": "kvmesh.io/v1alpha1", "kind": "InferencePool", "metadata": {"name": "chat"},
                       "spec": spec_with(adapters, **engine)})


def list_map_errors(value: Any, schema: dict[str, Any], where: str = "spec") -> list[str]:
    """What the API server refuses beyond the OpenAPI schema for every CRD: a key twice in an
    `x-kubernetes-list-type: map` list (jsonschema does not know that marker, so it is emulated from it here)."""
    errors = []
    if isinstance(value, dict):
        for key, item in value.items():
            child = schema.get("properties", {}).get(key)
            if child is not None:
                errors += list_map_errors(item, child, f"{where}.{key}")
    elif isinstance(value, list) and schema.get("x-kubernetes-list-type") == "map":
        keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value]
        errors += [f"{where}: duplicate {key}" for i, key in enumerate(keys) if key in keys[:i]]
    return errors


def test_a_pool_with_adapters_is_valid_everywhere_and_its_engines_load_them(tmp_path: Path) -> None:
    spec = spec_with(ADAPTERS, maxLoras=4, maxLoraRank=16)
    VALIDATOR.validate(spec)
    assert list_map_errors(spec, spec_schema()) == []
    pool = pool_with(ADAPTERS, maxLoras=4, maxLoraRank=16)
    assert cel_errors(pool.spec) == []
    engine_file = tmp_path / "engine.yaml"
    engine_file.write_text(config_files(pool)["engine.yaml"])
    assert yaml.safe_load(engine_file.read_text())["engine"]["lora_modules"] == {
        "sql-v1.2": "/models/adapters/sql", "poet": "/adapters/poet/r16"}
    config = load_config(engine_file)  # the real engine's reading of the ConfigMap's file
    assert config.lora_modules == {"sql-v1.2": "/models/adapters/sql", "poet": "/adapters/poet/r16"}
    assert (config.max_loras, config.max_lora_rank) == (4, 16)
    assert local_engine_settings(pool)["lora_modules"] == config.lora_modules


def test_kvmesh_up_gives_its_local_engines_the_pools_adapters() -> None:
    plan = plan_from_file(Path(__file__).resolve().parent.parent / "docs" / "examples" / "lora.yaml")
    assert plan.engine["lora_modules"] == {"sql": "/models/adapters/sql", "support-v2": "/adapters/support-v2"}
    assert (plan.engine["max_loras"], plan.engine["max_lora_rank"]) == (4, 16)


def test_a_pool_without_adapters_renders_as_before() -> None:
    """Pools that name no adapter keep their engine file (and so their pods: the file's hash rolls them)."""
    pool = pool_with([])
    assert "lora_modules" not in yaml.safe_load(config_files(pool)["engine.yaml"])["engine"]
    assert complete_spec({"model": {"source": "bundled"}})["model"]["loraAdapters"] == []


def test_an_adapter_on_its_own_claim_is_mounted_read_only_where_its_path_points() -> None:
    pool = pool_with(ADAPTERS)
    deployments = {o["metadata"]["name"]: o for o in desired_objects(pool) if o["kind"] == "Deployment"}
    engine, router = deployments["chat-both"], deployments["chat-router"]
    kubernetes_validate.validate(engine, "1.30", strict=True)
    pod = engine["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": "poet-weights", "readOnly": True}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": "/adapters/poet", "readOnly": True}
    assert not [v for v in router["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]


BAD_NAMES = ["SQL", "-sql", "sql-", "my adapter", "a/b", "x" * 64]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_badly_named_adapter_is_refused_by_the_schema_and_by_parse_pool(name: str) -> None:
    spec = spec_with([{"name": name, "path": "/models/a"}])
    assert list(VALIDATOR.iter_errors(spec)), f"jsonschema accepted {name!r}"
    with pytest.raises(SpecError, match="name"):
        complete_spec(spec)


def test_an_adapter_named_twice_is_refused_as_the_api_server_refuses_a_list_map_key_twice() -> None:
    twice = [{"name": "sql", "path": "/models/a"}, {"name": "sql", "path": "/models/b"}]
    spec = spec_with(twice)
    assert list_map_errors(spec, spec_schema()) == ["spec.model.loraAdapters: duplicate ('sql',)"]
    with pytest.raises(SpecError, match="duplicate name sql"):
        complete_spec(spec)


def test_too_many_adapters_and_adapters_without_a_path_are_refused() -> None:
    many = [{"name": f"a{i}", "path": f"/models/a{i}"} for i in range(MAX_LORA_ADAPTERS + 1)]
    for bad, named in ((many, "at most"), ([{"name": "sql"}], "path"), ([{"name": "sql", "path": ""}], "length")):
        spec = spec_with(bad)
        assert list(VALIDATOR.iter_errors(spec))
        with pytest.raises(SpecError, match=named):
            complete_spec(spec)


RULE_BAD = [
    ([{"name": "poet", "path": "/models/poet", "volumeClaim": "poet-weights"}], {}, "that directory or one below"),
    ([{"name": "poet", "path": "/adapters/poetry", "volumeClaim": "poet-weights"}], {}, "that directory or one below"),
    ([{"name": "smollm2-135m-instruct", "path": "/models/a"}], {}, "the model's own name"),
    ([{"name": "a", "path": "/models/a"}, {"name": "b", "path": "/models/b"}], {"maxLoras": 1}, "maxLoras"),
    # without maxLoras the engines' default holds: more adapters would leave every engine refusing to start
    ([{"name": f"a{i}", "path": f"/models/a{i}"} for i in range(DEFAULT_MAX_LORAS + 1)], {}, "default"),
]


@pytest.mark.parametrize(("adapters", "engine", "message"), RULE_BAD, ids=[r[2] for r in RULE_BAD])
def test_adapter_rules_fail_in_cel_and_in_python_alike(adapters: list[dict[str, Any]], engine: dict[str, Any],
                                                       message: str) -> None:
    spec = spec_with(adapters, **engine)
    assert not list(VALIDATOR.iter_errors(spec))  # each value is fine on its own...
    with pytest.raises(SpecError, match=message):  # ...but not with the others
        complete_spec(spec)
    assert any(message in m for m in cel_errors(defaulted_spec(spec)))


def test_an_adapters_path_may_change_under_its_name_on_update() -> None:
    """New weights under an adapter's name (an in-place update): engines hash an adapter's blocks with its weights,
    so the CRD has no rule on an update (none reads oldSelf) and the changed spec is as valid as any other."""
    changed = spec_with([{"name": "sql-v1.2", "path": "/models/adapters/sql2"}, ADAPTERS[1]])
    assert "oldSelf" not in yaml.safe_dump(crd_manifest())
    assert not list(VALIDATOR.iter_errors(changed)) and not cel_errors(defaulted_spec(changed))
    assert complete_spec(changed)["model"]["loraAdapters"][0]["path"] == "/models/adapters/sql2"
