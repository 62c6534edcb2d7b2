"""The InferencePool CRD (operator/crd.py, crds/): the checked-in YAML is current, the schema accepts the example
pools and refuses bad ones as an API server would (jsonschema on the OpenAPI schema, the CEL rules run with
cel-python), and the operator's own reading of a pool (`parse_pool`) agrees with both."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvmesh.operator.crd import (
    API_VERSION,
    DEFAULT_ACTIVATION_TIMEOUT_SECONDS,
    KIND,
    MAX_NAME_LENGTH,
    OBJECT_RULES,
    RULES,
    SpecError,
    complete_spec,
    crd_manifest,
    defaulted_spec,
    load_pool_file,
    parse_pool,
    render_crd,
    spec_schema,
)
from kvmesh.router.gateway import DEFAULT_WEIGHT, MAX_WEIGHT

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "crds" / "inferencepools.kvmesh.io.yaml"
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.yaml"))


def strict(schema: Any) -> Any:
    """The schema as the API server applies it with strict field validation: unknown fields are errors."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


VALIDATOR = jsonschema.Draft4Validator(strict(spec_schema()))  # OpenAPI v3.0: draft 4's boolean exclusiveMinimum


def cel_value(value: Any, schema: dict[str, Any]) -> Any:
    """A JSON value as Kubernetes hands it to CEL: a `number` field is a double even when written 90."""
    if schema.get("type") == "number":
        return celpy.celtypes.DoubleType(value)
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return celpy.celtypes.MapType({
            celpy.celtypes.StringType(k): cel_value(v, props.get(k) or (extra if isinstance(extra, dict) else {}))
            for k, v in value.items()})
    return celpy.json_to_cel(value)


def cel_errors(spec: dict[str, Any]) -> list[str]:
    """The messages of the CEL rules that fail on a defaulted spec, evaluated by cel-python."""
    env = celpy.Environment()
    failed = []
    for rule in RULES:
        target, schema = spec, spec_schema()
        for key in rule.path:
            target, schema = target[key], schema["properties"][key]
        if not env.program(env.compile(rule.cel)).evaluate({"self": cel_value(target, schema)}):
            failed.append(rule.message)
    return failed


def object_cel_errors(body: dict[str, Any]) -> list[str]:
    """The messages of the CEL rules on the whole object (the schema's root) that fail on `body`, as the API
    server evaluates them: `self` is the object, whose metadata.name CEL may read."""
    env = celpy.Environment()
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["x-kubernetes-validations"] == [{"rule": r.cel, "message": r.message} for r in OBJECT_RULES]
    return [rule["message"] for rule in schema["x-kubernetes-validations"]
            if not env.program(env.compile(rule["rule"])).evaluate({"self": cel_value(body, schema)})]


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docs" / "examples" / name).read_text())


def test_the_checked_in_crd_is_rendered_from_operator_crd_py() -> None:
    assert CRD_FILE.read_text() == render_crd(), "crds/ is stale: run `python -m kvmesh.operator.crd > " + str(
        CRD_FILE.relative_to(ROOT)) + "`"


def test_the_crd_is_a_valid_kubernetes_object_with_status_printer_columns_and_a_short_name() -> None:
    crd = crd_manifest()
    kubernetes_validate.validate(crd, "1.30", strict=True)
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["kvpool"] and crd["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Mode"] == ".spec.mode" and columns["Predicted KV"] == ".status.kvUsage.predicted"
    assert "Ready" in columns


def test_the_schema_is_structural() -> None:
    """Every node has a type (or is int-or-string / preserves unknown fields), no object has both properties and
    additionalProperties, and every default passes its own schema."""
    def walk(node: dict[str, Any], where: str) -> None:
        assert "type" in node or node.get("x-kubernetes-int-or-string"), where
        assert not ("properties" in node and "additionalProperties" in node), where
        if "default" in node:
            jsonschema.Draft4Validator(strict(node)).validate(node["default"])
        for key, child in node.get("properties", {}).items():
            walk(child, f"{where}.{key}")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{where}[*]")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")

    walk(crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_example_pools_are_valid(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert (doc["apiVersion"], doc["kind"]) == (API_VERSION, KIND)
    VALIDATOR.validate(doc["spec"])
    pool = load_pool_file(str(path))
    assert cel_errors(pool.spec) == []
    VALIDATOR.validate(pool.spec)  # the defaults the operator fills in pass the schema too


def test_defaults_are_filled_in_as_the_api_server_would() -> None:
    spec = complete_spec({"model": {"source": "bundled"}})
    assert spec["mode"] == "aggregated" and spec["replicas"]["both"] == {"min": 1, "max": 4}
    assert spec["scaling"]["overloadProbability"] == 0.1 and spec["scaling"]["mode"] == "operator"
    assert spec["engine"]["blockSize"] == 16 and spec["router"]["replicas"] == 2
    assert spec["gatewayInferencePool"] == {"enabled": False}
    assert spec["gateway"] == {"weight": DEFAULT_WEIGHT}


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    target = out
    *parents, last = dotted.split(".")
    for key in parents:
        target = target.setdefault(key, {})
    target[last] = value
    return out


SCHEMA_BAD = [
    ("model", None, "model"),  # required
    ("mode", "sharded", "mode"),
    ("engine.blockSize", 24, "blockSize"),
    ("engine.port", 70000, "port"),
    ("engine.resources.requests.cpu", "two", "cpu"),
    ("engine.resources.requests.memory", "4GiGi", "memory"),  # the API server would refuse the Deployment
    ("engine.resources.limits.cpu", "1.2.3", "cpu"),
    ("router.replicas", 0, "replicas"),
    ("scaling.overloadProbability", 0.9, "overloadProbability"),
    ("scaling.mode", "keda", "mode"),
    ("scaling.slo.ttftSeconds", 0, "ttftSeconds"),
    ("replicas.both.min", -1, "min"),
    ("engine.kvCacheMiB", 5, "kvCacheMiB"),  # a misspelt field is refused, not ignored
    ("engine.scheduling.tolerations", [{"key": "gpu", "effect": "NoRun"}], "effect"),
    ("router.scheduling.priorityClassName", "Not_A_Name", "priorityClassName"),
    ("engine.scheduling.nodeSelector", {"gpu": 1}, "gpu"),
    ("engine.scheduling.affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": []}}}, "nodeSelectorTerms: 0 items, at least 1"),  # a pod with it could run nowhere
    ("engine.imagePullSecrets", [{"secret": "regcred"}], "name"),
    ("router.apiKeys", {"secretName": "keys", "key": "../etc/passwd"}, "key"),  # a file name, not a path
    ("router.apiKeys", {"secretName": "keys", "key": ".."}, "key"),
    ("router.apiKeys", {"key": "keys.yaml"}, "secretName"),  # required
    ("engine.env", [{"name": "1BAD NAME", "value": "x"}], "name"),
    ("scaling.scaleToZero", {"idleSeconds": 30}, "idleSeconds"),  # at least a minute
    ("scaling.scaleToZero", {"idleSeconds": 300, "activationTimeoutSeconds": 7200}, "activationTimeoutSeconds"),
    ("scaling.scaleToZero", {"activationTimeoutSeconds": 60}, "idleSeconds"),  # required
    ("scaling.scaleToZero", {"idleSeconds": 120.5}, "idleSeconds"),  # an integer
    ("gateway.weight", MAX_WEIGHT + 1, "weight"),
    ("gateway.weight", -1, "weight"),
    ("gateway.weight", 2.5, "weight"),  # an integer
    ("gateway.weight", "5", "weight"),
    ("gateway.wieght", 5, "wieght"),
]


@pytest.mark.parametrize(("field", "value", "named"), SCHEMA_BAD, ids=[b[0] for b in SCHEMA_BAD])
def test_bad_values_are_refused_by_the_schema_and_by_parse_pool(field: str, value: Any, named: str) -> None:
    spec = example("aggregated.yaml")["spec"]
    bad = _set(spec, field, value)
    if value is None:
        del bad[field]
    assert list(VALIDATOR.iter_errors(bad)), f"jsonschema accepted {field}={value!r}"
    with pytest.raises(SpecError, match=named):
        complete_spec(bad)


RULE_BAD = [
    ("replicas.both", {"min": 5, "max": 2}, "min must be at most max"),
    ("replicas.decode", {"min": 3, "max": 1}, "min must be at most max"),
    ("scaling.podStartupSeconds", 120.5, "horizonSeconds must be at least"),
    ("store", {"databaseUrl": "sqlite://", "databaseUrlSecret": {"name": "s", "key": "k"}}, "not both"),
    ("replicas.both", {"min": 0, "max": 2}, "at least one pod"),
    ("scaling", {"mode": "hpa", "scaleToZero": {"idleSeconds": 600}}, "scaleToZero needs scaling.mode operator"),
    ("scaling", {"mode": "hpa", "scaleDownStabilizationSeconds": 3601}, "at most 3600 with scaling.mode hpa"),
    ("engine.env", [{"name": "KVMESH_CACHE_DIR", "value": "/x"}], "the operator sets"),
    ("router.env", [{"name": "HOME", "value": "/root"}], "the operator sets"),
    ("router.env", [{"name": "OTEL_SERVICE_NAME", "value": "r",
                     "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}], "not both"),
    ("engine.scheduling.tolerations", [{"value": "x", "effect": "NoSchedule"}], "without a key needs operator Exists"),
    ("router.scheduling.tolerations", [{"key": "gpu", "operator": "Exists", "value": "yes"}], "Exists takes no value"),
    ("engine.scheduling.tolerations", [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30}],
     "tolerationSeconds needs effect NoExecute"),
]


@pytest.mark.parametrize(("field", "value", "message"), RULE_BAD, ids=[b[0] for b in RULE_BAD])
def test_cross_field_rules_fail_in_cel_and_in_python_alike(field: str, value: Any, message: str) -> None:
    bad = _set(example("aggregated.yaml")["spec"], field, value)
    assert not list(VALIDATOR.iter_errors(bad))  # each value is fine on its own...
    with pytest.raises(SpecError, match=message):  # ...but not with the others
        complete_spec(bad)
    assert any(message in m for m in cel_errors(defaulted_spec(bad)))


def test_a_disaggregated_pool_needs_prefill_and_decode_pods_but_not_both() -> None:
    spec = example("disaggregated.yaml")["spec"]
    fine = _set(spec, "replicas.both", {"min": 0, "max": 1})
    assert cel_errors(complete_spec(fine)) == []
    starved = _set(spec, "replicas.prefill", {"min": 0, "max": 2})
    with pytest.raises(SpecError, match="at least one pod"):
        complete_spec(starved)


def test_engine_settings_cannot_set_what_the_router_and_services_share_with_the_engines() -> None:
    """A block size, hashing or model given to the engines alone would have the router refuse every pod: the spec
    is refused instead, naming the field that sets it."""
    spec = example("aggregated.yaml")["spec"]
    assert complete_spec(_set(spec, "engine.settings", {"max_num_seqs": 8, "kv_disk_mib": 64}))  # others pass
    with pytest.raises(SpecError, match=r"block_size is set by engine\.blockSize; hash_root is set by nothing"):
        complete_spec(_set(spec, "engine.settings", {"block_size": 32, "hash_root": 7}))
    with pytest.raises(SpecError, match=r"model is set by model\.source"):
        complete_spec(_set(spec, "engine.settings", {"model": "/models/other"}))


@pytest.mark.parametrize("weight", [0, 1, MAX_WEIGHT])
def test_a_gateway_weight_from_0_drained_to_the_maximum_is_valid(weight: int) -> None:
    spec = _set(example("aggregated.yaml")["spec"], "gateway.weight", weight)
    assert not list(VALIDATOR.iter_errors(spec))
    assert complete_spec(spec)["gateway"] == {"weight": weight}


def test_pool_objects_need_a_short_dns_name_and_the_right_kind() -> None:
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "Chat_Pool"},
            "spec": {"model": {"source": "bundled"}}}
    with pytest.raises(SpecError, match="starting with a letter"):
        parse_pool(body)
    with pytest.raises(SpecError, match="expected apiVersion"):
        parse_pool({**body, "kind": "Deployment"})
    pool = parse_pool({**body, "metadata": {"name": "chat", "namespace": "ml", "generation": 3}})
    assert (pool.name, pool.namespace, pool.generation, pool.roles) == ("chat", "ml", 3, ("both",))


@pytest.mark.parametrize("length", [1, MAX_NAME_LENGTH, MAX_NAME_LENGTH + 1, 63])
def test_a_pool_name_longer_than_the_operator_takes_is_refused_by_the_api_server(length: int) -> None:
    """kubectl apply of a pool named past 40 characters fails at once, with the rule's message, instead of being
    stored and reported Degraded/InvalidSpec by the operator afterwards (parse_pool, the same limit)."""
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "a" * length, "namespace": "ml"},
            "spec": {"model": {"source": "bundled"}}}
    errors = object_cel_errors(body)
    assert [r.check(body) for r in OBJECT_RULES] == [length <= MAX_NAME_LENGTH, True]  # the Python twins agree
    if length <= MAX_NAME_LENGTH:
        assert errors == []
        assert parse_pool(body).name == "a" * length
    else:
        assert errors and "metadata.name: at most 40 characters" in errors[0]
        with pytest.raises(SpecError, match="at most 40 characters"):
            parse_pool(body)


@pytest.mark.parametrize(("name", "valid"), [("chat", True), ("chat-v2", True), ("c", True), ("1chat", False),
                                           ("chat.v2", False), ("-chat", False), ("chat-", False)])
def test_a_pool_name_no_service_can_carry_is_refused_by_the_api_server(name: str, valid: bool) -> None:
    """`1chat` passed the CRD and parse_pool, then its Services (1chat-router, 1chat-engines: a Service's name must
    start with a letter) were refused at every apply, and no Deployment was ever made."""
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": "ml"},
            "spec": {"model": {"source": "bundled"}}}
    errors = object_cel_errors(body)
    assert [r.check(body) for r in OBJECT_RULES] == [True, valid]
    if valid:
        assert errors == [] and parse_pool(body).name == name
    else:
        assert errors and "starting with a letter" in errors[0]
        with pytest.raises(SpecError, match="starting with a letter"):
            parse_pool(body)


@pytest.mark.parametrize(("resources", "said"), [
    ({"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}, "requests.cpu 4 is above limits.cpu 2"),
    ({"requests": {"memory": "5Gi"}, "limits": {"memory": "4096Mi"}}, "requests.memory 5Gi is above limits.memory"),
    ({"requests": {"nvidia.com/gpu": 1}}, "nvidia.com/gpu is an extended resource"),
    ({"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 1}}, "is above limits.nvidia.com/gpu"),
])
def test_resources_the_api_server_refuses_in_a_pod_are_a_spec_error(resources: dict[str, Any], said: str) -> None:
    """These passed the CRD and the operator, then every apply of the Deployment was a 422 the pool reported only as
    'Unprocessable Entity', retried forever."""
    for program in ("engine", "router"):
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "chat"},
                "spec": {"model": {"source": "bundled"}, program: {"resources": resources}}}
        with pytest.raises(SpecError, match=re.escape(f"{program}.resources: ") + ".*" + re.escape(said)):
            parse_pool(body)


@pytest.mark.parametrize("resources", [{"requests": {"cpu": "500m"}, "limits": {"cpu": "0.5"}},
                                       {"limits": {"nvidia.com/gpu": 1}},
                                       {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": 1}},
                                       {"requests": {"hugepages-2Mi": "1Gi"}, "limits": {"hugepages-2Mi": "1Gi"}},
                                       {"requests": {"cpu": 2, "memory": "4Gi"}, "limits": {"memory": "8Gi"}}])
def test_resources_a_pod_may_have_are_taken(resources: dict[str, Any]) -> None:
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "chat"},
            "spec": {"model": {"source": "bundled"}, "engine": {"resources": resources}}}
    assert parse_pool(body).spec["engine"]["resources"] == resources


@pytest.mark.parametrize("edit", [{"metadata": ["chat"]}, {"metadata": "chat"}, {"spec": ["model"]},
                                  {"metadata": {"name": "chat", "labels": ["a"]}},
                                  {"metadata": {"name": "chat", "generation": "x"}}])
def test_a_pool_object_of_another_shape_is_a_spec_error_naming_the_field(edit: dict[str, Any]) -> None:
    # as `kubectl apply` or an edit of a `kvmesh up -f` file may hand it: a clear SpecError, not an AttributeError
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "chat"},
            "spec": {"model": {"source": "bundled"}}, **edit}
    with pytest.raises(SpecError, match=r"metadata|spec"):
        parse_pool(body)


def test_scale_to_zero_allows_a_minimum_of_zero_in_cel_and_in_python_alike() -> None:
    """min 0 is refused without scaling.scaleToZero (above) and is the point with it, in either mode; max stays at
    least 1, and the operator writes the activation timeout (default 300 s) into the routers' hold."""
    aggregated = _set(_set(example("aggregated.yaml")["spec"], "replicas.both", {"min": 0, "max": 2}),
                      "scaling.scaleToZero", {"idleSeconds": 600})
    full = complete_spec(aggregated)
    assert full["scaling"]["scaleToZero"] == {"idleSeconds": 600,
                                              "activationTimeoutSeconds": DEFAULT_ACTIVATION_TIMEOUT_SECONDS}
    assert cel_errors(full) == []
    disaggregated = _set(_set(example("disaggregated.yaml")["spec"], "replicas.prefill", {"min": 0, "max": 2}),
                         "scaling.scaleToZero", {"idleSeconds": 60, "activationTimeoutSeconds": 3600})
    disaggregated = _set(disaggregated, "replicas.decode", {"min": 0, "max": 2})
    assert cel_errors(complete_spec(disaggregated)) == []
    no_max = _set(aggregated, "replicas.both", {"min": 0, "max": 0})
    assert list(VALIDATOR.iter_errors(no_max))
    with pytest.raises(SpecError, match="max"):
        complete_spec(no_max)


def test_router_settings_cannot_set_the_hold_that_scale_to_zero_sets() -> None:
    spec = _set(example("aggregated.yaml")["spec"], "scaling.scaleToZero", {"idleSeconds": 600})
    with pytest.raises(SpecError, match=r"hold_without_pods_seconds is set by scaling\.scaleToZero"):
        complete_spec(_set(spec, "router.settings", {"hold_without_pods_seconds": 5}))
    plain = _set(example("aggregated.yaml")["spec"], "router.settings", {"hold_without_pods_seconds": 5})
    assert complete_spec(plain)["router"]["settings"] == {"hold_without_pods_seconds": 5}  # a router's own choice


@pytest.mark.parametrize(("weights", "message"), [
    ({"prefix": 2.0}, "unknown picker weight 'prefix' \\(did you mean 'prefix_weight'\\?\\)"),
    ({"prefix_weight": "high"}, "prefix_weight must be a number"),
    ({"tier_weights": {"ssd": 0.5}}, "unknown tier 'ssd'"),
    ({"tier_weights": {"host": 1.5}}, "tier_weights.host must be in"),
])
def test_router_weights_are_checked_as_the_router_checks_them(weights: dict[str, Any], message: str) -> None:
    """The schema keeps `router.weights` open (tier_weights is a mapping among numbers, which a structural schema
    cannot say); the operator and `kvmesh up -f` refuse what the router would refuse at start (it crash-looped)."""
    with pytest.raises(SpecError, match=message):
        complete_spec(_set(example("aggregated.yaml")["spec"], "router.weights", weights))
    with pytest.raises(SpecError, match=r"router\.settings: weights is set by router\.weights"):
        complete_spec(_set(example("aggregated.yaml")["spec"], "router.settings", {"weights": weights}))
    taken = complete_spec(_set(example("aggregated.yaml")["spec"], "router.weights",
                               {"prefix_weight": 2, "tier_weights": {"host": 0.5}}))
    assert taken["router"]["weights"] == {"prefix_weight": 2, "tier_weights": {"host": 0.5}}
