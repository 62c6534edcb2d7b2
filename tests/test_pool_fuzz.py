"""InferencePool specs under bad input, through the operator's pure core. Specs are drawn from the CRD's own
schema: values of each field's type inside its bounds and at them, and (the wild draws) past them, of another
type, empty or huge strings, missing and unknown fields, odd adapter lists, arbitrary engine and router settings.
Specs that the fuzzing found accepted and failing later (YAML-only values such as NaN, dates and non-string keys, a
pattern value with a final newline, typed settings the operator reads or renders, env valueFrom of no known kind)
are refused by name at the end (FAILED_LATER).

Whatever the API server accepts (the schema with its Go regular expressions, the list-map keys, the CEL rules),
`parse_pool` accepts too, or refuses with one of the operator's own checks the API server cannot make; whatever it
refuses, `parse_pool` refuses with a SpecError naming the field (which the reconcile handler turns into the pool's
InvalidSpec condition). For every pool that parses, what the handlers and `kvmesh up` derive from it (the objects,
the patches, the ConfigMap's files, the scaling policy and a first decision, the local settings and restarts) is
computed without raising, is valid Kubernetes, and is a pure function: the same twice, the inputs untouched.
The draws are fixed (derandomized) and bounded."""

from __future__ import annotations

import copy
import datetime
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvmesh.operator import desired
from kvmesh.operator.crd import (
    API_VERSION,
    DEFAULT_IMAGE,
    ENGINE_SETTINGS,
    KIND,
    MAX_LORA_ADAPTERS,
    SHARED_ENGINE_SETTINGS,
    SHARED_ROUTER_SETTINGS,
    Pool,
    SpecError,
    defaulted_spec,
    load_pool_file,
    parse_pool,
    spec_schema,
)
from kvmesh.operator.forecast import Scaler, scaling_policy
from kvmesh.operator.local import ignored_locally, restarts, start_inputs
from kvmesh.operator.memory import current_replicas
from kvmesh.operator.warmup import WarmupSettings

from .test_crd import cel_errors, example, strict
from .test_crd_lora import list_map_errors

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCHEMA = spec_schema()
INT64 = 2**63
BASE = parse_pool(example("aggregated.yaml"))  # a running pool that a fuzzed one is an edit of (kvmesh up -f)
# The operator's refusals the API server cannot make: the settings and the picker's weights keep unknown fields, so
# CEL cannot read them; resources are compared as quantities (a request above its limit, an extended resource
# without an equal limit), which the API server refuses only in the pod the operator makes.
OPERATOR_ONLY = re.compile(r"^((engine|router)\.(settings|resources)|router\.weights)\b")
# A message names the field it is about: a spec path, or the object's own fields.
NAMES_A_FIELD = re.compile(r"\b(spec|metadata|apiVersion|" + "|".join(SCHEMA["properties"]) + r")\b")


# ---- the API server, as the tests can have it ----------------------------------------------------------------------


def _go_pattern(validator: Any, pattern: str, value: Any, schema: Any) -> Any:
    """The API server's `pattern`: Go's RE2, where `$` is the end of the text (Python's also matches before a
    final newline)."""
    if isinstance(value, str) and not re.search(pattern.removesuffix("$") + (r"\Z" if pattern.endswith("$") else ""),
                                                value):
        yield jsonschema.ValidationError(f"{value!r} does not match {pattern!r}")


def _int64(validator: Any, kind: Any, value: Any, schema: Any) -> Any:
    """The API server's `type`, which also reads an integer into 64 bits."""
    yield from jsonschema.Draft4Validator.VALIDATORS["type"](validator, kind, value, schema)
    if kind == "integer" and isinstance(value, int) and not -INT64 <= value < INT64:
        yield jsonschema.ValidationError(f"{value} does not fit in an int64")


API_VALIDATOR = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _go_pattern, "type": _int64})(
    strict(SCHEMA))


def as_sent(spec: Any) -> Any:
    """The spec as `kubectl apply` can send it (JSON: string keys, finite numbers, integers in 64 bits as the API
    server's decoder reads them, no dates); None if it cannot."""
    def fits(value: Any) -> bool:
        if isinstance(value, dict):
            return all(fits(v) for v in value.values())
        if isinstance(value, list):
            return all(fits(v) for v in value)
        return not isinstance(value, int) or -INT64 <= value < INT64

    try:
        sent = json.loads(json.dumps(spec, allow_nan=False))
    except (TypeError, ValueError):
        return None
    return sent if fits(sent) else None


def api_server_errors(spec: Any) -> list[str]:
    """Why the API server refuses the spec: its schema, its list-map keys, then (on the defaulted spec) its CEL rules;
    empty if it accepts it."""
    if as_sent(spec) is None or spec != as_sent(spec):
        return ["not JSON"]
    errors = [e.message for e in API_VALIDATOR.iter_errors(spec)] or list_map_errors(spec, SCHEMA)
    if errors:
        return errors
    return cel_errors(defaulted_spec(spec))  # the schema passed: its defaults and types are the API server's


# ---- drawing specs from the schema -------------------------------------------------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(-1e6, 1e6) | st.text(max_size=8)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=6)
WRONG_TYPES = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=3) | st.just(
    []) | st.just({}) | st.just(["x"])
HUGE_TEXT = st.sampled_from(["x" * 300, "a" * 5000])


def rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int = 8) -> st.SearchStrategy[Any]:
    return st.integers(1, one_in).flatmap(lambda i: rare if i == 1 else common)


def _settings(where: str, wild: bool) -> st.SearchStrategy[Any]:
    """engine.settings or router.settings: arbitrary keys and values, and the names the operator reads or refuses."""
    names = [*ENGINE_SETTINGS.values(), *SHARED_ENGINE_SETTINGS, "lora_modules", "max-num-seqs"] \
        if where == "engine" else [*SHARED_ROUTER_SETTINGS, "weights", "api_keys_file", "rate_limit_replicas",
                                   "ext_proc_port", "ext_proc_tls"]
    plausible = st.integers(0, 70000) | st.booleans() | st.sampled_from(["x=/a", "", "xxh3", None]) | st.lists(
        st.sampled_from(["a=/x", "b=/y", "bad"]), max_size=2) | st.dictionaries(st.sampled_from(["a", "b", "A B"]),
                                                                                st.sampled_from(["/x", "", 3]))
    key_values = st.dictionaries(st.sampled_from(names), plausible, max_size=3) | st.dictionaries(
        st.text(max_size=6), JSON_VALUES, max_size=3)
    return key_values


WILD_ONE_IN = 25  # a wild draw puts a defect in about one field in this many: a spec has one or two


def near(schema: Mapping[str, Any], where: str = "spec", wild: bool = False) -> st.SearchStrategy[Any]:
    """Values for the schema node at `where`: of its type and within its bounds; with `wild`, some nodes also past
    them, of other types, with unknown fields and without required ones."""
    value = _typed(schema, where, wild)
    return rarely(value, _defect(schema, where) | WRONG_TYPES, WILD_ONE_IN) if wild else value


def _typed(schema: Mapping[str, Any], where: str, wild: bool) -> st.SearchStrategy[Any]:
    if "anyOf" in schema:  # a quantity: an integer or a string like 500m or 4Gi
        return st.integers(0, 64) | st.from_regex(r"[1-9][0-9]{0,3}(m|Mi|Gi|k)?", fullmatch=True)
    kind = schema.get("type")
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        program = where.split(".")[-2] if where.endswith(".settings") else ""
        return _settings(program, wild) if program else st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3)
    if kind == "object" and "properties" in schema:
        return _object(schema, where, wild)
    if kind == "object":
        keys = st.text(min_size=1, max_size=12) | st.sampled_from(["cpu", "memory", "prefix", "load"])
        return st.dictionaries(keys, near(schema["additionalProperties"], where + ".*", wild), max_size=3)
    if kind == "array":
        return _list(schema, where, wild)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if kind == "integer":
        low, high = schema.get("minimum", -INT64), schema.get("maximum", INT64 - 1)
        return st.sampled_from([low, high]) | st.integers(low, min(high, low + 2048)) | st.integers(low, high)
    if kind == "number":
        low, high = schema["minimum"], schema.get("maximum", 1e9)
        exclusive = bool(schema.get("exclusiveMinimum"))
        numbers = st.sampled_from([high] if exclusive else [low, high]) | st.floats(low, high, exclude_min=exclusive)
        if math.floor(high) > low:  # a YAML or JSON number written without a point
            numbers |= st.integers(math.floor(low) + 1, math.floor(high))
        return numbers
    if kind == "boolean":
        return st.booleans()
    if "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= schema.get("maxLength", 253))
    low, high = schema.get("minLength", 0), schema.get("maxLength", 1024)
    return st.text(min_size=low, max_size=min(high, 24)) | st.sampled_from(
        ["x" * high, "/models/x.gguf", "bundled", "\u00f6\t'\"{{}}"])


def _defect(schema: Mapping[str, Any], where: str) -> st.SearchStrategy[Any]:
    """A value of the node's type just past its bounds, a string changed, an unknown field or a required one
    missing."""
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -INT64), schema.get("maximum", INT64 - 1)
        return st.sampled_from([low - 1, high + 1, INT64, -INT64 - 1, float(low), str(high)])
    if kind == "number":
        low, high = schema["minimum"], schema.get("maximum", 1e308)
        return st.sampled_from([low - 1e-9, low - 1, high + 1e-6, min(high * 10, 1e308), str(high)])
    if kind == "string" or "anyOf" in schema:
        typed = _typed(schema, where, wild=False)
        return typed.map(lambda s: f"{s} ".upper()) | st.just("") | HUGE_TEXT
    if kind == "object" and "properties" in schema:
        required = schema.get("required", ())
        drawn = _object(schema, where, wild=False)
        return drawn.map(lambda d: {**d, "kvCacheMiB": 5}) | drawn.map(
            lambda d: {k: v for k, v in d.items() if k not in required})
    return WRONG_TYPES


def _object(schema: Mapping[str, Any], where: str, wild: bool) -> st.SearchStrategy[Any]:
    props = schema["properties"]
    required = set(schema.get("required", ()))
    fields = {k: near(v, f"{where}.{k}", wild) for k, v in props.items()}
    return st.fixed_dictionaries({k: fields[k] for k in required},
                                 optional={k: s for k, s in fields.items() if k not in required})


def _list(schema: Mapping[str, Any], where: str, wild: bool) -> st.SearchStrategy[Any]:
    items = near(schema["items"], where + "[]", wild)
    if where == "spec.model.loraAdapters":  # adapters named alike, or like the model, or mounted elsewhere
        items = rarely(items, st.sampled_from([{"name": "a", "path": "/adapters/a", "volumeClaim": "pvc"},
                                               {"name": "a", "path": "/models/a"},
                                               {"name": "m", "path": "/adapters/b", "volumeClaim": "pvc"}]), 3)
    if where.endswith(".env"):
        items = rarely(items, st.sampled_from([{"name": "HOME", "value": "/"}, {"name": "A", "value": "1"},
                                               {"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]), 3)
    lists = st.lists(items, max_size=4)
    if wild:  # past the list's bound (adapters: also past the engines' default slots)
        lists = rarely(lists, st.integers(0, MAX_LORA_ADAPTERS).map(
            lambda n: [{"name": f"a{i}", "path": f"/models/a{i}"} for i in range(n + 1)]), 10)
    return lists


def pool_bodies(wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    names = st.sampled_from(["chat", "a", "p" * 40])
    if wild:
        names = rarely(names, st.sampled_from(["p" * 41, "Chat", "", 7]), WILD_ONE_IN)
    return st.builds(lambda name, spec: {"apiVersion": API_VERSION, "kind": KIND,
                                         "metadata": {"name": name, "namespace": "ml", "uid": "uid-1"}, "spec": spec},
                     names, near(SCHEMA, "spec", wild))


# What the operator observed of a pool: the replicas it decided last (kept in its status), sane or not.
STATUSES = st.fixed_dictionaries({}, optional={"replicas": st.dictionaries(
    st.sampled_from(["both", "prefill", "decode", "router"]),
    st.fixed_dictionaries({}, optional={"desired": st.integers(-5, 2000) | WRONG_TYPES}) | WRONG_TYPES, max_size=3)})


# ---- what the handlers and kvmesh up derive from a pool ----------------------------------------------------------


def derived(pool: Pool, status: Mapping[str, Any]) -> dict[str, Any]:
    """Everything the reconcile handler, the scaling timer and `kvmesh up -f` compute from a parsed pool."""
    replicas = current_replicas(pool, status)
    objects = desired.desired_objects(pool, replicas)
    policy = scaling_policy(pool)
    decision = Scaler(pool).observe(1000.0, [], replicas)  # the timer's first tick, before any engine answers
    return {"replicas": replicas, "objects": objects, "patches": [desired.patch_body(pool, o) for o in objects],
            "files": desired.config_files(pool), "adapters": desired.engine_adapters(pool),
            "router_state": desired.router_state(pool), "address": desired.router_address(pool),
            "policy": policy, "decision": decision.replicas, "warmup": WarmupSettings.of(pool),
            "local": start_inputs(pool), "restarts": restarts(BASE, pool), "ignored": ignored_locally(BASE, pool)}


def check_parse(body: dict[str, Any]) -> Pool | None:
    """parse_pool's answer agrees with the API server's; the pool, or None if refused."""
    sent = copy.deepcopy(body)
    refusal = api_server_errors(body["spec"])
    try:
        pool = parse_pool(body)
    except SpecError as exc:
        assert NAMES_A_FIELD.search(str(exc)), f"a SpecError that names no field: {exc}"
        assert refusal or OPERATOR_ONLY.search(str(exc)) or "metadata.name" in str(exc), \
            f"the API server accepts what parse_pool refuses ({exc}): {body['spec']!r}"
        pool = None
    else:
        assert not refusal, f"parse_pool accepts what the API server refuses ({refusal}): {body['spec']!r}"
    assert body == sent or as_sent(sent) is None, "parse_pool changed the object it read"
    return pool


@FUZZ
@given(pool_bodies(wild=True), STATUSES)
def test_any_spec_is_read_as_the_api_server_reads_it_or_refused_naming_its_field(
        body: dict[str, Any], status: dict[str, Any]) -> None:
    pool = check_parse(body)
    if pool is not None:
        derived(pool, status)


def valid_kubernetes(obj: dict[str, Any]) -> None:
    if obj["apiVersion"] != desired.GATEWAY_API_VERSION:  # the Gateway extension's CRD: not in kubernetes-validate
        kubernetes_validate.validate(obj, "1.30", strict=True)


@settings(FUZZ, max_examples=60)
@given(pool_bodies(wild=False), STATUSES)
def test_an_accepted_pool_renders_valid_objects_as_a_pure_function(body: dict[str, Any],
                                                                    status: dict[str, Any]) -> None:
    pool = check_parse(body)
    assume(pool is not None)
    spec, observed = copy.deepcopy(pool.spec), copy.deepcopy(status)
    first = derived(pool, status)
    assert first == derived(pool, status) == derived(parse_pool(body), status)
    assert (pool.spec, status) == (spec, observed), "deriving the pool's objects changed its spec or status"
    for obj in first["objects"]:
        valid_kubernetes(obj)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for role, n in first["replicas"].items():
        low, high = pool.bounds(role)
        assert low <= n <= high


# Specs the fuzzing found accepted and failing later: a crash in the operator, or an object the API server refuses
# (an ApiError retried for ever instead of InvalidSpec). Each is refused, naming its field; the draws cover them too.
FAILED_LATER = {
    "nan-target-utilization-crashes-the-hpa": ({"scaling": {"mode": "hpa", "targetUtilization": float("nan")}},
                                               "scaling.targetUtilization"),
    "inf-horizon": ({"scaling": {"horizonSeconds": float("inf")}}, "scaling.horizonSeconds"),
    "an-integer-past-64-bits": ({"engine": {"kvCacheMemoryMiB": 2**63}}, "engine.kvCacheMemoryMiB"),
    "nan-in-engine-settings": ({"engine": {"settings": {"kv_disk_mib": [float("nan")]}}},
                               "engine.settings.kv_disk_mib"),
    "yaml-date-in-engine-settings": ({"engine": {"settings": {"x": datetime.date(2026, 1, 1)}}}, "engine.settings.x"),
    "int-key-in-engine-settings": ({"engine": {"settings": {0: "a"}}}, "engine.settings"),
    "router-settings-ext-proc-port-false": ({"router": {"settings": {"ext_proc_port": False}}},
                                            "router.settings.ext_proc_port"),
    "router-settings-ext-proc-port-string": ({"router": {"settings": {"ext_proc_port": "9002"}}},
                                             "router.settings.ext_proc_port"),
    "router-settings-ext-proc-port-70000": ({"router": {"settings": {"ext_proc_port": 70000}}},
                                            "router.settings.ext_proc_port"),
    "router-settings-ext-proc-port-the-http-port": ({"router": {"settings": {"ext_proc_port": 8080}}},
                                                    "router.settings.ext_proc_port"),
    "router-settings-ext-proc-tls-a-string": ({"router": {"settings": {"ext_proc_tls": "no"}}}, "ext_proc_tls"),
    "router-settings-port": ({"router": {"settings": {"port": 9000}}}, "router.port"),
    "router-settings-host": ({"router": {"settings": {"host": "127.0.0.1"}}}, "router.settings: host"),
    "router-settings-hash-algo-dashed": ({"router": {"settings": {"hash-algo": "sha256"}}}, "engine.hashAlgo"),
    "engine-settings-max-num-seqs-0-breaks-the-scaling-policy": ({"engine": {"settings": {"max_num_seqs": 0}}},
                                                                 "engine.settings.max_num_seqs"),
    "engine-settings-max-num-seqs-a-string": ({"engine": {"settings": {"max_num_seqs": "abc"}}},
                                              "engine.settings.max_num_seqs"),
    "engine-settings-max-num-seqs-null": ({"engine": {"settings": {"max_num_seqs": None}}},
                                          "engine.settings.max_num_seqs"),
    "engine-settings-max-loras-past-the-spec-bound": ({"engine": {"settings": {"max-loras": 257}}},
                                                      "engine.settings.max_loras"),
    "engine-settings-of-the-wrong-type": ({"engine": {"settings": {"kv_disk_mib": "lots"}}}, "kv_disk_mib"),
    "engine-settings-lora-modules-not-name-path": ({"engine": {"settings": {"lora_modules": ["bad"]}}},
                                                   "engine.settings.lora_modules"),
    "volume-claim-with-a-final-newline": ({"model": {"source": "/models/m", "volumeClaim": "weights\n"}},
                                          "model.volumeClaim"),
    "env-value-from-of-no-known-kind": ({"engine": {"env": [{"name": "A", "valueFrom": {"": None}}]}},
                                        "engine.env[0].valueFrom"),
    "env-value-from-of-two-kinds": ({"router": {"env": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.name"}, "secretKeyRef": {"name": "s", "key": "k"}}}]}},
                                    "router.env[0].valueFrom"),
    "env-value-from-of-no-kind": ({"engine": {"env": [{"name": "A", "valueFrom": {}}]}}, "engine.env[0].valueFrom"),
    "env-secret-key-ref-without-its-key": ({"engine": {"env": [{"name": "A", "valueFrom": {
        "secretKeyRef": {"name": "s"}}}]}}, "engine.env[0].valueFrom.secretKeyRef.key"),
}


@pytest.mark.parametrize(("edit", "field"), FAILED_LATER.values(), ids=FAILED_LATER)
def test_specs_that_failed_later_are_refused_naming_the_field(edit: dict[str, Any], field: str) -> None:
    body = example("aggregated.yaml")
    body["spec"].update(edit)
    with pytest.raises(SpecError, match=re.escape(field)):
        parse_pool(body)


def test_settings_within_their_bounds_pass() -> None:
    body = example("aggregated.yaml")
    body["spec"]["engine"]["settings"] = {"max_num_seqs": 1, "max-loras": 256, "kv_disk_mib": 64.5,
                                          "lora_modules": ["a=/models/a"], "speculative_config": None}
    body["spec"]["router"]["settings"] = {"ext_proc_port": 9100, "ext_proc_tls": False, "retries": 1}
    body["spec"]["engine"]["env"] = [{"name": "P", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                     {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s.x", "key": ".k"}}},
                                     {"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu",
                                                                                     "divisor": "1m"}}}]
    pool = parse_pool(body)
    assert desired.ext_proc_port(pool) == 9100
    assert scaling_policy(pool).max_batch == 1
    assert not api_server_errors(body["spec"])


def test_a_setting_the_pools_own_image_does_not_know_is_refused_with_a_hint() -> None:
    """A typo in engine.settings made every engine pod crash-loop on `unknown engine setting`; the operator runs the
    same code as its own image, so it refuses the pool instead, naming the setting it was probably meant to be."""
    body = example("aggregated.yaml")
    body["spec"]["engine"]["settings"] = {"max-num-seq": 8}
    with pytest.raises(SpecError, match=r"engine\.settings: unknown setting 'max_num_seq' \(did you mean "
                                        r"'max_num_seqs'\?\)"):
        parse_pool(body)
    body = example("aggregated.yaml")
    body["spec"]["router"]["settings"] = {"retires": 1, "zzz": 2}
    with pytest.raises(SpecError, match=r"router\.settings: unknown setting 'retires' \(did you mean 'retries'\?\), "
                                        r"'zzz'"):
        parse_pool(body)


def test_a_setting_unknown_here_passes_to_an_image_of_its_own() -> None:
    """An image other than the operator's may be newer and know more: its engines (or router) judge the name."""
    body = example("aggregated.yaml")
    body["spec"]["engine"]["image"] = "registry.internal/kvmesh:next"
    body["spec"]["engine"]["settings"] = {"paged_kernel_variant": "v2"}
    body["spec"]["router"]["settings"] = {"picker_plugin": "x"}
    pool = parse_pool(body)
    assert desired.engine_settings(pool)["paged_kernel_variant"] == "v2"
    assert desired.router_settings(pool)["picker_plugin"] == "x"
    body["spec"]["router"]["image"] = DEFAULT_IMAGE
    with pytest.raises(SpecError, match=r"router\.settings: unknown setting 'picker_plugin'"):
        parse_pool(body)


def test_a_local_pool_runs_this_code_whatever_image_it_names(tmp_path: Path) -> None:
    """`kvmesh up -f` pulls no image: its engines are this code, so a name they do not know is refused even when the
    file names another image (the engines would refuse it at start)."""
    body = example("aggregated.yaml")
    body["spec"]["engine"]["image"] = "registry.internal/kvmesh:next"
    body["spec"]["engine"]["settings"] = {"max-num-seq": 8}
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(body))
    assert parse_pool(body).spec["engine"]["settings"] == {"max-num-seq": 8}  # a cluster leaves it to that image
    with pytest.raises(SpecError, match="did you mean 'max_num_seqs'"):
        load_pool_file(str(path))
