"""The InferencePool custom resource (docs/contracts.md, contract 5): the schema's one source, and the typed pool.

`crd_manifest()` renders the CustomResourceDefinition checked in under crds/ (a test fails when that file is out
of date). `parse_pool()` gives the operator and `kvmesh up -f pool.yaml` the same view of a pool object: the
schema's defaults filled in, its types, enums and bounds checked, and its cross-field rules applied. Each of
those rules is written once, as a CEL expression for the API server together with the Python check the
operator runs (the API server's defaulting and CEL are missing where no API server is: locally, and for a pool
that predates a rule); the tests evaluate both on the same objects with cel-python and require them to agree.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import yaml

from kvmesh.engine.config import EngineConfig, parse_lora_modules
from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV
from kvmesh.engine.protocol import (
    CACHE_DIR_ENV,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    HOT_CHAINS_DEFAULT,
    HOT_CHAINS_MAX,
    KV_CACHE_DTYPES,
    LORA_ACTIONS,
    QUANTIZATIONS,
    HashAlgo,
)
from kvmesh.engine.typed_fields import check_types
from kvmesh.router.auth import CACHE_SALT_SECRET_ENV
from kvmesh.router.config import MAX_HOLD_SECONDS, RouterConfig
from kvmesh.router.gateway import DEFAULT_WEIGHT, MAX_WEIGHT
from kvmesh.router.picker import PickerConfig

GROUP = "kvmesh.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("kvpool",)  # not "infpool": the Gateway API Inference Extension's InferencePool is another kind
CRD_NAME = f"{PLURAL}.{GROUP}"

MODES = ("aggregated", "disaggregated")
SCALING_MODES = ("operator", "hpa")  # who writes the engines' replicas: this operator, or HPAs it creates
DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32, 64, 128, 256, 512)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
ROLE_REPLICAS = ("both", "prefill", "decode")
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # what the API server accepts as an environment variable's name
MAX_ENV_VARS = 64
DATABASE_URL_ENV = "KVMESH_DATABASE_URL"  # the router's request-log URL, from store.databaseUrlSecret
# variables the operator sets itself: a pool's own env cannot override them
OPERATOR_ENV = ("HOME", CACHE_DIR_ENV, DATABASE_URL_ENV, CACHE_SALT_SECRET_ENV, INTERNAL_TOKEN_FILE_ENV)
SECRET_KEY = r"^[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"  # a Secret's data key: a plain file name, never . or .. or a path
API_KEYS_FILE = "keys.yaml"  # the key of spec.router.apiKeys' Secret that holds the keys file, by default
# AdaptersLoaded only for pools with adapters; RouterStateShared: desired.router_state; MetricsAvailable: once a pod
# did not answer a scrape (handlers)
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "AdaptersLoaded", "RouterStateShared", "MetricsAvailable")
# A Kubernetes resource quantity, as the API server parses one (not negative): a number, then a binary suffix
# (Ki .. Ei), a decimal one (n u m k M G T P E) or an exponent. The looser pattern controller-gen writes let
# 1.2.3 or 4GiGi through, which the API server then refused for the Deployment, failing the reconcile.
QUANTITY = (r"^[+]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
            r"(([KMGTPE]i)|[numkMGTPE]|([eE][-+]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SERVICE_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a DNS-1035 label: a Service's name starts with a letter
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MAX_TOLERATIONS = 32
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # a Secret's or ConfigMap's name
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"  # a Secret's or ConfigMap's data key, as Kubernetes accepts it in a key selector
INT64 = 1 << 63  # the API server reads every integer into 64 bits, and refuses one that does not fit
# camelCase spec fields of `engine` -> the engine's own setting names (engine/config.py)
ENGINE_SETTINGS = {"blockSize": "block_size", "hashAlgo": "hash_algo", "kvCacheMemoryMiB": "kv_cache_memory_mib",
                   "maxNumSeqs": "max_num_seqs", "maxNumBatchedTokens": "max_num_batched_tokens",
                   "maxModelLen": "max_model_len", "enablePrefixCache": "enable_prefix_cache",
                   "maxLoras": "max_loras", "maxLoraRank": "max_lora_rank"}
BUNDLED = "bundled"  # model.source naming the image's bundled model
ADAPTERS_DIR = "/adapters"  # an adapter's own volumeClaim is mounted read-only at ADAPTERS_DIR/NAME
LORA_NAME = r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$"  # what clients send as `model`; also a directory name
MAX_LORA_ADAPTERS = 32
# The adapter sync's memory in a pool's status (operator/lora.py), bounded so a long-lived pool's status stays small:
# names the spec declared that engines may still serve, and refusals (engine pod life x action) not to try again.
MAX_MANAGED_ADAPTERS = 4 * MAX_LORA_ADAPTERS
MAX_ADAPTER_REFUSALS = 256
# scaling.scaleToZero: an idle pool's engines go to 0 after at least a minute (shorter would stop a pool between the
# requests of a slow client); a request that finds none is held by the router up to the activation timeout.
MIN_IDLE_SECONDS = 60
DEFAULT_ACTIVATION_TIMEOUT_SECONDS = 300
MAX_ACTIVATION_TIMEOUT_SECONDS = int(MAX_HOLD_SECONDS)  # the router's own bound on its hold


def _package_version() -> str:
    try:
        return version("kvmesh")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0"


DEFAULT_IMAGE = f"ghcr.io/kvmesh/kvmesh:{_package_version()}"
DEFAULT_ENGINE_PORT = EngineConfig.port
DEFAULT_ROUTER_PORT = RouterConfig.port
# The operator's own Deployment (the chart) names the image and ports its pools default to in these variables.
IMAGE_ENV, ENGINE_PORT_ENV, ROUTER_PORT_ENV = "KVMESH_IMAGE", "KVMESH_ENGINE_PORT", "KVMESH_ROUTER_PORT"
PULL_SECRETS_ENV = "KVMESH_IMAGE_PULL_SECRETS"  # the chart's imagePullSecrets (names, comma-separated)


@dataclass(frozen=True)
class PoolDefaults:
    """What a pool runs when its spec leaves these out: the operator's own image and the chart's ports, not values
    in the CRD. An API server writes a CRD default into the object when it is created, so a default there would
    pin every pool to the image of the day it was made (an upgrade of the chart would not reach it) and to the
    public registry (a chart pointed at a mirror would still pull from it)."""

    image: str = DEFAULT_IMAGE
    engine_port: int = DEFAULT_ENGINE_PORT
    router_port: int = DEFAULT_ROUTER_PORT
    local: bool = False  # `kvmesh up -f`: no image is pulled, its programs are this code whatever image it names
    image_pull_secrets: tuple[str, ...] = ()  # for the operator's image: the Secrets the chart pulls it with

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PoolDefaults:
        """The defaults the operator's Deployment gives (unset: the built-in ones); a bad value stops the operator
        at start, naming the variable."""
        env = os.environ if env is None else env
        ports = {}
        for name, default in ((ENGINE_PORT_ENV, DEFAULT_ENGINE_PORT), (ROUTER_PORT_ENV, DEFAULT_ROUTER_PORT)):
            text = env.get(name, "").strip()
            if text and not (text.isdigit() and 1 <= int(text) <= 65535):
                raise ValueError(f"{name}={text!r} is not a TCP port (1 to 65535)")
            ports[name] = int(text) if text else default
        secrets = tuple(name.strip() for name in env.get(PULL_SECRETS_ENV, "").split(",") if name.strip())
        if bad := [name for name in secrets if not _matches(DNS_SUBDOMAIN, name)]:
            raise ValueError(f"{PULL_SECRETS_ENV}: {', '.join(map(repr, bad))} is not a Secret's name")
        return cls(image=env.get(IMAGE_ENV, "").strip() or DEFAULT_IMAGE, image_pull_secrets=secrets,
                   engine_port=ports[ENGINE_PORT_ENV], router_port=ports[ROUTER_PORT_ENV])

# ---- schema building blocks -----------------------------------------------------------------------------------


# A default the operator fills in but the CRD does not declare. The API server applies a CRD's defaults to every
# pool it serves, so a defaulted field added in a release reaches every stored pool as soon as that CRD is applied:
# an older operator (after a rollback, or before `helm upgrade` rolls it) refuses each pool for a field it does not
# know. Fields added since the first release (tests/data/crd_first_release_fields.txt) default this way.
OPERATOR_DEFAULT = "x-kvmesh-operator-default"


def _operator_default(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its default kept for the operator and left out of the CRD."""
    return {**{k: v for k, v in schema.items() if k != "default"}, OPERATOR_DEFAULT: schema["default"]}


def _served(schema: Any, done: dict[int, Any] | None = None) -> Any:
    """The schema as the CRD declares it: without the operator's own defaults (a part used twice stays one object,
    which the YAML writes once)."""
    done = {} if done is None else done
    if id(schema) not in done:
        if isinstance(schema, dict):
            done[id(schema)] = {k: _served(v, done) for k, v in schema.items() if k != OPERATOR_DEFAULT}
        elif isinstance(schema, list):
            done[id(schema)] = [_served(v, done) for v in schema]
        else:
            return schema
    return done[id(schema)]


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def _int(description: str, minimum: int | None = None, maximum: int | None = None, **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "description": description, **extra}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _num(description: str, minimum: float, maximum: float | None = None, exclusive_min: bool = False,
         **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number", "description": description, "minimum": minimum, **extra}
    if exclusive_min:
        schema["exclusiveMinimum"] = True
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _enum(description: str, values: tuple[Any, ...], default: Any = None) -> dict[str, Any]:
    kind = "integer" if isinstance(values[0], int) else "string"
    schema: dict[str, Any] = {"type": kind, "description": description, "enum": list(values)}
    if default is not None:
        schema["default"] = default
    return schema


_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY}],
             "x-kubernetes-int-or-string": True}


def _resources(description: str, requests: dict[str, str]) -> dict[str, Any]:
    quantities = {"type": "object", "additionalProperties": _QUANTITY}
    return _obj({"requests": quantities, "limits": quantities}, description=description,
                default={"requests": requests})


def _settings(program: str, command: str) -> dict[str, Any]:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "description": f"More {program} settings, passed as they are into the `{program}` section of the file "
                           f"`{command} --config` reads (its own key names)."}


def _env(program: str) -> dict[str, Any]:
    return {"type": "array", "maxItems": MAX_ENV_VARS, "default": [],
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "description": f"more environment variables of each {program} container, as Kubernetes writes them "
                           "(a value, or valueFrom a Secret or ConfigMap key), e.g. OTEL_SERVICE_NAME or "
                           "OTEL_EXPORTER_OTLP_HEADERS; the ones the operator sets cannot be overridden",
            "items": _obj({"name": _str("the variable's name", pattern=ENV_NAME, maxLength=256),
                           "value": {"type": "string", "description": "its value"},
                           "valueFrom": _value_from()},
                          ("name",))}


def _value_from() -> dict[str, Any]:
    """An env var's valueFrom, as Kubernetes takes it: exactly one source, with its required fields (a Deployment
    with anything else is refused by the API server, which the operator would retry forever)."""
    def key_ref(kind: str) -> dict[str, Any]:
        return _obj({"name": _str(f"the {kind}'s name", pattern=DNS_SUBDOMAIN, maxLength=253),
                     "key": _str(f"the {kind}'s key", pattern=CONFIG_KEY, maxLength=253),
                     "optional": {"type": "boolean", "description": f"whether the {kind} or its key may be missing"}},
                    ("name", "key"), description=f"a key of a {kind} in the pool's namespace")

    return _obj({
        "secretKeyRef": key_ref("Secret"),
        "configMapKeyRef": key_ref("ConfigMap"),
        "fieldRef": _obj({"fieldPath": _str("the pod's field, e.g. metadata.name or status.podIP", minLength=1),
                          "apiVersion": _str("the version fieldPath is written in (default v1)", minLength=1)},
                         ("fieldPath",), description="a field of the pod"),
        "resourceFieldRef": _obj({"resource": _str("e.g. limits.cpu or requests.memory", minLength=1),
                                  "containerName": _str("the container (default: this one)", minLength=1),
                                  "divisor": _QUANTITY},
                                 ("resource",), description="a resource of the container"),
    }, description="where its value comes from: exactly one of secretKeyRef, configMapKeyRef, fieldRef and "
                   "resourceFieldRef", minProperties=1, maxProperties=1)


def _scheduling(program: str) -> dict[str, Any]:
    """Where the program's pods may run, as a pod spec says it: GPU nodes are tainted and labelled, and a platform
    keeps routers off them. Each field with the pod spec's own schema (the parts a pool needs), so a mistake is the
    API server's refusal of the pool, not a Deployment it refuses later."""
    toleration = _obj({
        "key": _str("the taint's key (empty with operator Exists: every taint)", maxLength=316),
        "operator": _enum("Equal (the key and value match) or Exists (the key matches)", ("Equal", "Exists")),
        "value": _str("the taint's value (with operator Equal)", maxLength=63),
        "effect": _enum("the taint's effect it tolerates (empty: every effect)", TAINT_EFFECTS),
        "tolerationSeconds": _int("with effect NoExecute: how long the pod stays after the taint appears", 0),
    }, description="a toleration, as a pod spec gives one")
    labels = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}, "maxProperties": 64}
    expressions = {"type": "array", "maxItems": 16, "items": _obj({
        "key": _str("a label key", minLength=1, maxLength=316),
        "operator": _enum("how the values match", ("In", "NotIn", "Exists", "DoesNotExist")),
        "values": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 63}},
    }, ("key", "operator"))}
    selector = _obj({"matchLabels": labels, "matchExpressions": expressions}, description="a label selector")
    node_expressions = {**expressions, "items": _obj({
        "key": _str("a node label key (or field, in matchFields)", minLength=1, maxLength=316),
        "operator": _enum("how the values match", ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")),
        "values": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 63}},
    }, ("key", "operator"))}
    node_term = _obj({"matchExpressions": node_expressions, "matchFields": node_expressions})
    pod_term = _obj({"labelSelector": selector, "namespaceSelector": selector,
                     "namespaces": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 63}},
                     "topologyKey": _str("the node label whose value groups nodes (kubernetes.io/hostname, a zone)",
                                         minLength=1, maxLength=316)}, ("topologyKey",))
    weight = _int("the preference's weight", 1, 100)
    pod_affinity = _obj({
        "requiredDuringSchedulingIgnoredDuringExecution": {"type": "array", "maxItems": 16, "items": pod_term},
        "preferredDuringSchedulingIgnoredDuringExecution": {"type": "array", "maxItems": 16, "items": _obj(
            {"weight": weight, "podAffinityTerm": pod_term}, ("weight", "podAffinityTerm"))}})
    affinity = _obj({
        "nodeAffinity": _obj({
            "requiredDuringSchedulingIgnoredDuringExecution": _obj(
                {"nodeSelectorTerms": {"type": "array", "minItems": 1, "maxItems": 16, "items": node_term}},
                ("nodeSelectorTerms",)),
            "preferredDuringSchedulingIgnoredDuringExecution": {"type": "array", "maxItems": 16, "items": _obj(
                {"weight": weight, "preference": node_term}, ("weight", "preference"))}}),
        "podAffinity": pod_affinity,
        "podAntiAffinity": pod_affinity,
    }, description="node affinity, and pod affinity and anti-affinity, as a pod spec gives them")
    spread = _obj({
        "maxSkew": _int("how unevenly the pods may spread", 1),
        "topologyKey": _str("the node label whose values are the domains (a zone, a hostname)", minLength=1,
                            maxLength=316),
        "whenUnsatisfiable": _enum("what a pod that would exceed maxSkew does", ("DoNotSchedule", "ScheduleAnyway")),
        "labelSelector": selector,
        "minDomains": _int("domains counted at least (with DoNotSchedule)", 1),
        "nodeAffinityPolicy": _enum("whether nodeAffinity and nodeSelector limit the domains", ("Honor", "Ignore")),
        "nodeTaintsPolicy": _enum("whether taints limit the domains", ("Honor", "Ignore")),
    }, ("maxSkew", "topologyKey", "whenUnsatisfiable"), description="a topology spread constraint")
    return _operator_default(_obj({
        "nodeSelector": {**labels, "description": "node labels the pods' node must have"},
        "tolerations": {"type": "array", "maxItems": MAX_TOLERATIONS, "default": [], "items": toleration,
                        "description": "taints the pods tolerate (nvidia.com/gpu on GPU nodes, for instance)"},
        "affinity": affinity,
        "topologySpreadConstraints": {"type": "array", "maxItems": 16, "items": spread,
                                      "description": "how the pods spread over zones or nodes, as a pod spec gives "
                                                     "them"},
        "priorityClassName": _str("the pods' PriorityClass", pattern=DNS_SUBDOMAIN, maxLength=253),
        "runtimeClassName": _str("the pods' RuntimeClass (nvidia, on clusters that name the GPU runtime so)",
                                 pattern=DNS_SUBDOMAIN, maxLength=253),
    }, description=f"where the {program} pods run (the pod spec's fields of the same names); a local pool "
                   "(`kvmesh up -f`) ignores them", default={}))


def _role_replicas(role: str) -> dict[str, Any]:
    return _obj({"min": _int(f"fewest {role} pods", 0, 1000, default=1),
                 "max": _int(f"most {role} pods", 1, 1000, default=4)},
                description=f"bounds of the {role} pods' replicas", default={})


# ---- cross-field rules: one CEL expression and its Python twin ----------------------------------------------


HPA_MAX_WINDOW_SECONDS = 3600  # Kubernetes refuses a HorizontalPodAutoscaler stabilization window past this


@dataclass(frozen=True)
class Rule:
    """A CEL rule the API server checks (x-kubernetes-validations at `path`), and the same rule in Python."""

    path: tuple[str, ...]  # where in the spec the rule sits; `self` is the object there
    cel: str
    message: str
    check: Callable[[Mapping[str, Any]], bool]


RULES: tuple[Rule, ...] = (
    *(Rule(("replicas", role), "self.min <= self.max", f"replicas.{role}: min must be at most max",
           lambda s: s["min"] <= s["max"]) for role in ROLE_REPLICAS),
    Rule(("scaling",), "self.horizonSeconds >= self.podStartupSeconds",
         "scaling.horizonSeconds must be at least podStartupSeconds: a scale-up must be ready before it is needed",
         lambda s: s["horizonSeconds"] >= s["podStartupSeconds"]),
    *(Rule((program, "env"), f"self.all(e, !(e.name in {list(OPERATOR_ENV)}))",
           f"{program}.env: the operator sets {', '.join(OPERATOR_ENV)} itself",
           lambda s: all(e["name"] not in OPERATOR_ENV for e in s)) for program in ("engine", "router")),
    *(Rule((program, "env"), "self.all(e, !(has(e.value) && has(e.valueFrom)))",
           f"{program}.env: give a variable a value or valueFrom, not both",
           lambda s: all(not ("value" in e and "valueFrom" in e) for e in s)) for program in ("engine", "router")),
    *(Rule((program, "scheduling", "tolerations"),
           "self.all(t, (has(t.key) && t.key != '') || (has(t.operator) && t.operator == 'Exists'))",
           f"{program}.scheduling.tolerations: a toleration without a key needs operator Exists",
           lambda s: all(t.get("key") or t.get("operator") == "Exists" for t in s))
      for program in ("engine", "router")),
    *(Rule((program, "scheduling", "tolerations"),
           "self.all(t, !(has(t.operator) && t.operator == 'Exists' && has(t.value) && t.value != ''))",
           f"{program}.scheduling.tolerations: operator Exists takes no value",
           lambda s: all(not (t.get("operator") == "Exists" and t.get("value")) for t in s))
      for program in ("engine", "router")),
    *(Rule((program, "scheduling", "tolerations"),
           "self.all(t, !has(t.tolerationSeconds) || (has(t.effect) && t.effect == 'NoExecute'))",
           f"{program}.scheduling.tolerations: tolerationSeconds needs effect NoExecute",
           lambda s: all("tolerationSeconds" not in t or t.get("effect") == "NoExecute" for t in s))
      for program in ("engine", "router")),
    Rule(("store",), "!(has(self.databaseUrl) && has(self.databaseUrlSecret))",
         "store: give databaseUrl or databaseUrlSecret, not both",
         lambda s: not ("databaseUrl" in s and "databaseUrlSecret" in s)),
    Rule(("model",), "!has(self.name) || self.loraAdapters.all(a, a.name != self.name)",
         "model.loraAdapters: an adapter cannot take the model's own name",
         lambda s: all(a["name"] != s.get("name") for a in s["loraAdapters"])),
    Rule(("model", "loraAdapters"),
         f"self.all(a, !has(a.volumeClaim) || a.path == '{ADAPTERS_DIR}/' + a.name || "
         f"a.path.startsWith('{ADAPTERS_DIR}/' + a.name + '/'))",
         f"model.loraAdapters: an adapter's volumeClaim is mounted at {ADAPTERS_DIR}/NAME, so its path must be that "
         "directory or one below it",
         lambda s: all("volumeClaim" not in a or a["path"] == f"{ADAPTERS_DIR}/{a['name']}"
                       or a["path"].startswith(f"{ADAPTERS_DIR}/{a['name']}/") for a in s)),
    Rule((), "size(self.model.loraAdapters) <= "
             f"(has(self.engine.maxLoras) ? self.engine.maxLoras : {DEFAULT_MAX_LORAS})",
         f"model.loraAdapters: more adapters than engine.maxLoras (default {DEFAULT_MAX_LORAS}; every loaded adapter "
         "takes one of its slots)",
         lambda s: len(s["model"]["loraAdapters"]) <= s["engine"].get("maxLoras", DEFAULT_MAX_LORAS)),
    Rule((), "has(self.scaling.scaleToZero) || (self.mode == 'aggregated' ? self.replicas.both.min >= 1 : "
             "(self.replicas.prefill.min >= 1 && self.replicas.decode.min >= 1))",
         "the pool's mode needs at least one pod of each of its roles: replicas.both.min (aggregated), or "
         "replicas.prefill.min and replicas.decode.min (disaggregated); a min of 0 needs scaling.scaleToZero",
         lambda s: "scaleToZero" in s["scaling"] or (
             s["replicas"]["both"]["min"] >= 1 if s["mode"] == "aggregated"
             else s["replicas"]["prefill"]["min"] >= 1 and s["replicas"]["decode"]["min"] >= 1)),
    Rule(("scaling",), f"self.mode == 'operator' || self.scaleDownStabilizationSeconds <= {HPA_MAX_WINDOW_SECONDS}",
         f"scaling.scaleDownStabilizationSeconds: at most {HPA_MAX_WINDOW_SECONDS} with scaling.mode hpa (a "
         "HorizontalPodAutoscaler's stabilization window is capped there); longer needs mode operator",
         lambda s: s["mode"] == "operator" or s["scaleDownStabilizationSeconds"] <= HPA_MAX_WINDOW_SECONDS),
    Rule(("scaling",), "!has(self.scaleToZero) || self.mode == 'operator'",
         "scaling.scaleToZero needs scaling.mode operator: an HPA never scales a Deployment to 0, and only the "
         "operator sees the requests the routers hold",
         lambda s: "scaleToZero" not in s or s["mode"] == "operator"),
)


# A pool's name prefixes the names of the objects it owns (NAME-engines, NAME-router, NAME-prefill and their pods,
# NAME-internal-token), which must stay valid names: a Service's is a DNS label of at most 63 characters
MAX_NAME_LENGTH = 40

# Rules on the whole object (the openAPIV3Schema's root, where CEL may read metadata.name): `self` is the pool
OBJECT_RULES: tuple[Rule, ...] = (
    Rule((), f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
         f"metadata.name: at most {MAX_NAME_LENGTH} characters: it prefixes the names of the objects the pool owns "
         "(NAME-engines, NAME-router, NAME-prefill, NAME-internal-token), which must stay valid Kubernetes names",
         lambda o: len(str((o.get("metadata") or {}).get("name") or "")) <= MAX_NAME_LENGTH),
    Rule((), f"self.metadata.name.matches('{SERVICE_NAME}')",
         "metadata.name: lowercase letters, digits and '-', starting with a letter: it names the pool's Services "
         "(NAME-router, NAME-engines), which Kubernetes refuses otherwise (1chat, chat.v2)",
         lambda o: _matches(SERVICE_NAME, str((o.get("metadata") or {}).get("name") or ""))),
)


def _with_rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    rules = [{"rule": r.cel, "message": r.message} for r in RULES if r.path == path]
    if rules:
        schema["x-kubernetes-validations"] = rules
    for name, child in schema.get("properties", {}).items():
        _with_rules(child, (*path, name))
    return schema


def spec_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of `spec` (structural, with defaults and CEL rules)."""
    model = _obj({
        "source": _str("where the weights come from: a Hugging Face directory or a .gguf file (under /models when "
                       "volumeClaim is set), or `bundled` for the image's SmolLM2-135M-Instruct", minLength=1),
        "name": _str("the model name clients send (default: the source's name)", minLength=1, maxLength=256),
        "volumeClaim": _str("a PersistentVolumeClaim holding the weights, mounted read-only at /models",
                            pattern=DNS_LABEL),
        "dtype": _enum("weights dtype (and the KV cache's, with kvCacheDtype auto)", DTYPES, "auto"),
        "quantization": _enum("int8: int8 weights and activations (CPU)", QUANTIZATIONS, "none"),
        "kvCacheDtype": _enum("how engines store K and V: auto (the model's dtype) or int8 (a scale per token and "
                              "head; about twice the cached tokens of bf16 in the same memory)", KV_CACHE_DTYPES,
                              "auto"),
        "loraAdapters": {
            "type": "array", "maxItems": MAX_LORA_ADAPTERS, "default": [],
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "description": "LoRA adapters every engine loads at start (PEFT directories); clients ask for one by "
                           "sending its name as `model`, and the router sends those requests only to pods serving it",
            "items": _obj({
                "name": _str("the model name clients send to use the adapter", pattern=LORA_NAME, maxLength=63),
                "path": _str(f"the adapter's directory as the engine pods see it: under /models on the model's "
                             f"volumeClaim, under {ADAPTERS_DIR}/NAME on the adapter's own volumeClaim, or in the "
                             "image", minLength=1, maxLength=1024),
                "volumeClaim": _str(f"a PersistentVolumeClaim holding the adapter, mounted read-only at "
                                    f"{ADAPTERS_DIR}/NAME", pattern=DNS_LABEL),
            }, ("name", "path")),
        },
    }, ("source",), description="the model every engine of the pool serves")
    engine = _obj({
        "image": _str(f"the kvmesh image (default: the operator's own, {IMAGE_ENV} in its Deployment: the chart's "
                      f"image)", minLength=1),
        "imagePullPolicy": _enum("when to pull the image", PULL_POLICIES, "IfNotPresent"),
        "imagePullSecrets": {
            "type": "array", "maxItems": 16, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "description": f"Secrets in the pool's namespace the engine and router pods pull their images with "
                           f"(default, for the operator's own image: the chart's imagePullSecrets, {PULL_SECRETS_ENV} "
                           f"in its Deployment)",
            "items": _obj({"name": _str("the Secret's name", pattern=DNS_SUBDOMAIN, maxLength=253)}, ("name",))},
        "port": _int(f"the engines' HTTP port (default: the chart's ports.engine, {DEFAULT_ENGINE_PORT} without "
                     f"it)", 1, 65535),
        "blockSize": _enum("tokens per KV block (engines and router must agree)", BLOCK_SIZES, DEFAULT_BLOCK_SIZE),
        "hashAlgo": _enum("block hash construction (docs/contracts.md, contract 1)", tuple(a.value for a in HashAlgo),
                          HashAlgo.XXH3.value),
        "kvCacheMemoryMiB": _int("device KV cache budget per engine", 1),
        "maxNumSeqs": _int("sequences per batch", 1),
        "maxNumBatchedTokens": _int("tokens per step (chunked prefill)", 1),
        "maxModelLen": _int("longest context", 1),
        "enablePrefixCache": {"type": "boolean", "description": "cache and share prompt prefixes"},
        "maxLoras": _int(f"LoRA adapters an engine holds at once (the engine's default: {DEFAULT_MAX_LORAS})", 1, 256),
        "maxLoraRank": _int(f"the largest LoRA rank an engine loads (the engine's default: {DEFAULT_MAX_LORA_RANK})",
                            1, 1024),
        "hostTierMiB": _int("memory-backed volume at /dev/shm for the host KV tier, which takes 95 % of it (0: no "
                            "tier); it survives an engine restart", 0, default=0),
        "settings": _settings("engine", "kvmesh serve"),
        "env": _env("engine"),
        "resources": _resources("each engine container's resources", {"cpu": "2", "memory": "4Gi"}),
        "scheduling": _scheduling("engine"),
    }, description="the engine pods", default={})
    router = _obj({
        "replicas": _int("router pods", 1, 64, default=2),
        "image": _str("the router's image (default: the engine's)", minLength=1),
        "port": _int(f"the router's HTTP port (default: the chart's ports.router, {DEFAULT_ROUTER_PORT} without "
                     f"it)", 1, 65535),
        "weights": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                    "description": "the picker's weights and bounds by name (docs/router.md: prefix_weight, "
                                   "kv_weight, ..., tier_weights: {device, host, disk}), checked as the router "
                                   "checks them"},
        "apiKeys": _obj({
            "secretName": _str("a Secret holding the router's API keys file ({keys: [{tenant, key_sha256}]}), "
                               "mounted read-only and re-read when it changes (keys rotate without a restart)",
                               pattern=DNS_LABEL),
            "key": _str("the Secret's key that holds the keys file (a file name in the mounted directory)",
                        pattern=SECRET_KEY, maxLength=253, default=API_KEYS_FILE),
            "cacheSaltKey": _str("a key of the same Secret holding the secret that keys each tenant's cache salt "
                                 "(without it the salts are keyed by the pool's name)", pattern=SECRET_KEY,
                                 maxLength=253),
        }, ("secretName",), description="API keys: each maps to a tenant, which gets its own prefix cache salt and "
                                        "its limits (router.settings.tenants); without them auth is off"),
        "settings": _settings("router", "kvmesh router"),
        "env": _env("router"),
        "resources": _resources("each router container's resources", {"cpu": "500m", "memory": "1Gi"}),
        "scheduling": _scheduling("router"),
    }, description="the router in front of the engines", default={})
    store = _obj({
        "databaseUrl": _str("the routers' database (the request log, the Batch API, stored responses, the split of "
                            "tenant limits): a SQLAlchemy URL, e.g. postgresql+psycopg://host/kvmesh", minLength=1),
        "databaseUrlSecret": _obj({"name": _str("Secret name", pattern=DNS_LABEL), "key": _str("key", minLength=1)},
                                  ("name", "key"), description="a Secret key holding the URL (with its password)"),
    }, description="the routers' database: the request log (contract 6), the Batch API's files and batches, the "
                   "Responses API's stored responses and the split of tenant limits between router replicas; none: "
                   "no log, the Batch API answers 501, each replica keeps its own responses and limits",
        default={})
    scaling = _obj({
        "mode": _enum("who sets the engines' replicas: the operator, or HPAs it creates on the forecast metric",
                      SCALING_MODES, "operator"),
        "targetUtilization": _num("KV utilization each role is sized for", 0.1, 0.95, default=0.8),
        "horizonSeconds": _num("how far ahead KV usage is predicted", 1, 3600, default=90),
        "podStartupSeconds": _num("how long a new engine pod takes to serve (the horizon must cover it)", 0, 3600,
                                  default=60),
        "overloadProbability": _num("scale up when P(KV usage > 95 % within the horizon) reaches this", 0.001, 0.5,
                                    default=0.1),
        "intervalSeconds": _num("how often the pool is evaluated", 1, 3600, default=15),
        "scaleUpStabilizationSeconds": _num("a scale-up waits until every recommendation in this window agrees", 0,
                                            3600, default=0),
        "scaleDownStabilizationSeconds": _num("a scale-down keeps the most pods that the demand seen in this window "
                                              "needed (a forecast peak counts until its horizon has passed)",
                                              0, 86400, default=300),
        "warmupPrefixes": _int("a new engine pod pulls this many of a peer's hottest prefix chains once it serves; "
                               "0: no warm-up", 0, HOT_CHAINS_MAX, default=HOT_CHAINS_DEFAULT),
        "warmupGraceSeconds": _num("with warm-up on, a new engine pod stays unready (its /health says warming) until "
                                   "its warm-up ends or this many seconds pass; 0: it serves at once, warmed later",
                                   0, 600, default=60),
        "scaleToZero": _obj({
            "idleSeconds": _int("with no request in the pool for this long, every engine role goes to 0 replicas",
                                MIN_IDLE_SECONDS),
            "activationTimeoutSeconds": _int("how long a router holds a request while the pool starts from zero "
                                             "(pod start plus model load), then answers 503 with Retry-After", 1,
                                             MAX_ACTIVATION_TIMEOUT_SECONDS,
                                             default=DEFAULT_ACTIVATION_TIMEOUT_SECONDS),
        }, ("idleSeconds",), description="scale every engine role to 0 when the pool is idle, and back to "
                                         "max(min, 1) on the first request, which the routers hold meanwhile "
                                         "(routers never scale to 0); allows replicas.*.min 0"),
        "slo": _obj({"ttftSeconds": _num("time-to-first-token objective: the router sheds by priority past it", 0,
                                         exclusive_min=True),
                     "itlSeconds": _num("inter-token latency objective: decode pods (or pods that do both) are "
                                        "scaled so that each one's decode step, fitted by batch and KV read, stays "
                                        "within it", 0, exclusive_min=True)},
                    description="latency objectives", default={}),
    }, description="scaling by predicted KV utilization", default={})
    gateway = _obj({"enabled": {"type": "boolean", "default": False,
                                "description": "also create an inference.networking.k8s.io/v1 InferencePool that "
                                               "selects the engines and names the kvmesh router as its endpoint "
                                               "picker"},
                    "tlsSecretName": _str("a Secret of type kubernetes.io/tls (tls.crt, tls.key; cert-manager makes "
                                          "one) the router serves the endpoint picker with, re-read when it is "
                                          "renewed; without it the router makes a self-signed certificate at start",
                                          pattern=DNS_LABEL)},
                   description="Gateway API Inference Extension interop", default={})
    spec = _obj({
        "model": model,
        "mode": _enum("aggregated: every engine prefills and decodes; disaggregated: prefill and decode pods",
                      MODES, "aggregated"),
        "engine": engine,
        "replicas": _obj({role: _role_replicas(role) for role in ROLE_REPLICAS},
                         description="replica bounds per role", default={}),
        "router": router,
        "store": store,
        "scaling": scaling,
        "gatewayInferencePool": gateway,
        "gateway": _operator_default(_obj({"weight": _int(
            "this pool's share of the requests `kvmesh gateway` sends for a model other pools list too: its weight "
            "over the sum of theirs (a canary at 5 then 25 %); 0 drains it while another pool's weight is above 0 "
            "(when every one is 0 they share equally)", 0, MAX_WEIGHT, default=DEFAULT_WEIGHT)},
            description="how `kvmesh gateway` routes to this pool", default={})),
    }, ("model",), description="the desired pool")
    return _with_rules(spec)


def status_schema() -> dict[str, Any]:
    counts = _obj({"desired": _int("replicas asked for", 0), "ready": _int("replicas ready", 0)})
    condition = _obj({
        "type": _enum("condition", CONDITION_TYPES),
        "status": _enum("True, False or Unknown", ("True", "False", "Unknown")),
        "reason": _str("CamelCase reason"),
        "message": _str("what happened"),
        "lastTransitionTime": _str("when status last changed", format="date-time"),
        "observedGeneration": _int("the generation this condition is about", 0),
    }, ("type", "status"))
    return _obj({
        "observedGeneration": _int("the spec generation last reconciled", 0),
        "replicas": {"type": "object", "description": "replicas per role", "additionalProperties": counts},
        "ready": _str("ready/desired per role, for printing"),
        "kvUsage": _obj({"observed": {"type": "number"}, "predicted": {"type": "number"},
                         "overloadProbability": {"type": "number"}},
                        description="the KV pods' usage now, at the horizon (policy level), and P(> 95 %)"),
        "routerAddress": _str("the router's in-cluster URL"),
        "lastDecision": _obj({"time": _str("since when the pool has had this decision (its reasons and replicas)",
                                           format="date-time"), "reason": _str("why"),
                              "replicas": {"type": "object", "additionalProperties": {"type": "integer"}}}),
        "conditions": {"type": "array", "items": condition, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "adapters": _obj({
            "managed": {"type": "array", "maxItems": MAX_MANAGED_ADAPTERS, "items": {"type": "string"},
                        "description": "names the spec declared that an engine may still serve: unloaded once "
                                       "dropped from the spec, forgotten once no engine serves them"},
            "refused": {"type": "array", "maxItems": MAX_ADAPTER_REFUSALS, "description":
                        "adapter actions an engine refused, per engine pod life: not tried again on it",
                        "items": _obj({
                            "pod": _str("the engine pod"),
                            "podUid": _str("its uid"),
                            "restarts": _int("its containers' restarts when it refused (a restart is a new life)",
                                             0),
                            "action": _enum("what was refused", LORA_ACTIONS),
                            "adapter": _str("the adapter's name"),
                            "path": _str("the directory a refused load named"),
                        }, ("pod", "action", "adapter"))},
        }, description="the operator's LoRA adapter sync, kept here so a restarted operator carries on"),
    }, description="what the operator observed")


PRINTER_COLUMNS: tuple[dict[str, Any], ...] = (
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Predicted KV", "type": "number", "jsonPath": ".status.kvUsage.predicted", "format": "float"},
    {"name": "Router", "type": "string", "jsonPath": ".status.routerAddress", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition, as crds/ holds it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": list(SHORT_NAMES),
                      "categories": ["kvmesh"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                "schema": {"openAPIV3Schema": {**_obj({
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "spec": _served(spec_schema()),
                    "status": status_schema(),
                }, ("spec",), description="A pool of engines serving one model behind a KV-cache-aware router"),
                    "x-kubernetes-validations": [{"rule": r.cel, "message": r.message} for r in OBJECT_RULES]}},
            }],
        },
    }


def render_crd() -> str:
    """The YAML of crds/inferencepools.kvmesh.io.yaml."""
    header = "# Generated by `python -m kvmesh.operator.crd` from operator/crd.py; do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


# ---- reading a pool ----------------------------------------------------------------------------------------------


class SpecError(ValueError):
    """A pool spec the operator cannot use; the message names the field."""


def _check(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """`value` with defaults filled in, checked against `schema` (the subset of OpenAPI this module uses); unknown
    fields are refused, as `kubectl apply` does with strict field validation."""
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return _check(value, option, where)
            except SpecError:
                continue
        raise SpecError(f"{where}: {value!r} is not a valid value")
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            raise SpecError(f"{where}: expected an object, got {type(value).__name__}")
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            _check_json(value, where)
            return dict(value)
        out: dict[str, Any] = {}
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                out[key] = _check(item, props[key], f"{where}.{key}")
            elif extra is not None:
                out[key] = _check(item, extra, f"{where}.{key}")
            else:
                raise SpecError(f"{where}: unknown field {key!r}; known: {', '.join(props)}")
        for key, prop in props.items():
            for default in (prop[k] for k in ("default", OPERATOR_DEFAULT) if k in prop and key not in out):
                out[key] = _check(default, prop, f"{where}.{key}")
        for key in schema.get("required", ()):
            if key not in out:
                raise SpecError(f"{where}.{key} is required")
        if not schema.get("minProperties", 0) <= len(value) <= schema.get("maxProperties", len(value)):
            raise SpecError(f"{where}: give exactly one of {', '.join(props)}, got {', '.join(value) or 'none'}"
                            if schema.get("maxProperties") == 1 else f"{where}: {len(value)} fields is out of bounds")
        return out
    if kind == "array":
        return _check_list(value, schema, where)
    if kind == "string":
        if not isinstance(value, str):
            raise SpecError(f"{where}: expected a string, got {value!r}")
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            raise SpecError(f"{where}: length {len(value)} is out of bounds")
        if "pattern" in schema and not _matches(schema["pattern"], value):
            raise SpecError(f"{where}: {value!r} does not match {schema['pattern']}")
    elif kind in ("integer", "number"):
        number_ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not number_ok or (kind == "integer" and not isinstance(value, int)):
            raise SpecError(f"{where}: expected {'an integer' if kind == 'integer' else 'a number'}, got {value!r}")
        _check_json(value, where)
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value < low or (schema.get("exclusiveMinimum") and value == low)):
            raise SpecError(f"{where}: {value} is below the minimum {low}")
        if high is not None and value > high:
            raise SpecError(f"{where}: {value} is above the maximum {high}")
    elif kind == "boolean" and not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError(f"{where}: {value!r} is not one of {', '.join(map(str, schema['enum']))}")
    return value


def _matches(pattern: str, value: str) -> bool:
    """The API server's `pattern` (Go's RE2, where `$` ends the text): every pattern here is anchored at both ends,
    and fullmatch keeps Python's `$` from also matching before a final newline."""
    return re.fullmatch(pattern, value) is not None


def _check_json(value: Any, where: str) -> None:
    """Refuse what `kubectl apply` cannot send and the API server would not store, but a YAML file for `kvmesh up`
    or a client's own object can hold: NaN and infinities, integers past 64 bits, non-string keys, dates and other
    types. The operator would fail on them later (a hash, an autoscaler, a ConfigMap), retrying for ever."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise SpecError(f"{where}: {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(f"{where}: {value} is not a finite number")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise SpecError(f"{where}: key {key!r} is not a string")
            _check_json(item, f"{where}.{key}")
    else:
        raise SpecError(f"{where}: {value!r} is a {type(value).__name__}, not a string, number, true or false, null, "
                        "list or mapping")


def _check_list(value: Any, schema: Mapping[str, Any], where: str) -> list[Any]:
    """A list's items checked, its length bounded, and (x-kubernetes-list-type map) its keys unique, as the API
    server refuses a list map with a key twice."""
    if not isinstance(value, list):
        raise SpecError(f"{where}: expected a list, got {type(value).__name__}")
    if len(value) > schema.get("maxItems", len(value)):
        raise SpecError(f"{where}: {len(value)} items, at most {schema['maxItems']} allowed")
    if len(value) < schema.get("minItems", 0):
        raise SpecError(f"{where}: {len(value)} items, at least {schema['minItems']} needed")
    items = [_check(item, schema["items"], f"{where}[{i}]") for i, item in enumerate(value)]
    keys = schema.get("x-kubernetes-list-map-keys")
    if keys:
        seen: set[tuple[Any, ...]] = set()
        for item in items:
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                raise SpecError(f"{where}: duplicate {', '.join(keys)} {', '.join(map(str, key))}")
            seen.add(key)
    return items


def defaulted_spec(spec: Any) -> dict[str, Any]:
    """The spec with every default filled in, after the schema's per-field checks (the cross-field rules not yet)."""
    return _check(spec, spec_schema(), "spec")


# Engine settings the spec gives elsewhere, because the router and the pods' Services must agree with the engines
# (a router refuses every pod whose hashing or model differs from its own): engine.settings cannot set them. The
# API server cannot refuse them (engine.settings keeps unknown fields, which CEL cannot read): the operator does,
# with the pool's InvalidSpec condition, and `kvmesh up -f` before it starts anything.
SHARED_ENGINE_SETTINGS = {**{ENGINE_SETTINGS[field]: f"engine.{field}" for field in ("blockSize", "hashAlgo")},
                          "hash_root": "nothing (engines and router use the protocol's root)",
                          "model": "model.source", "port": "engine.port", "host": "nothing (the operator's)",
                          "role": "mode"}


# Router settings the operator writes into the router's file itself, from the spec or the pool's object: the
# router's container port, probes and Service name its port, and it must find and agree with the engines.
SHARED_ROUTER_SETTINGS = {"host": "nothing (the operator's)", "port": "router.port", "pool": "metadata.name",
                          "discovery": "nothing (the operator's)", "namespace": "metadata.namespace",
                          "weights": "router.weights (checked there; here it replaced them whole, unchecked)",
                          **{k: v for k, v in SHARED_ENGINE_SETTINGS.items() if k in ("block_size", "hash_algo",
                                                                                     "hash_root", "model")}}
_PORT = _int("a TCP port", 1, 65535)
HOLD_SETTING = "hold_without_pods_seconds"  # the router's, which scaling.scaleToZero sets


def setting_names(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings by the name their program reads them under (its loader takes dashes for underscores): how the
    operator checks them and writes them into the programs' files, so the scaler reads `max-num-seqs` too."""
    return {key.replace("-", "_"): value for key, value in settings.items()}


def _refuse_shared(program: str, settings: Mapping[str, Any], shared: Mapping[str, str], why: str) -> None:
    taken = [key for key in shared if key in settings]
    if taken:
        raise SpecError(f"{program}.settings: " + "; ".join(f"{key} is set by {shared[key]}" for key in taken)
                        + f" ({why})")


def _check_types(program: str, config: type, settings: Mapping[str, Any], own_image: bool) -> None:
    """The names and types the program's own config checks at start (engine/typed_fields.py). A name it does not
    know is refused when the pool runs the operator's own image, whose programs are this code (the engine would
    refuse it at start, and its pods crash-loop); with another image it is left to that image, which may be newer."""
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(settings) - known)
    if own_image and unknown:
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                 else repr(name) for name in unknown]
        raise SpecError(f"{program}.settings: unknown setting {', '.join(hints)}; docs/{program}.md lists the "
                        f"{program}'s settings (an image that knows more can be set in {program}.image)")
    try:
        check_types(config(**{k: v for k, v in settings.items() if k in known}), program)
    except ValueError as exc:
        raise SpecError(f"{program}.settings: {exc}") from None


def _check_settings(full: Mapping[str, Any], own_images: Mapping[str, bool]) -> None:
    """engine.settings and router.settings as far as the API server cannot check them (they keep unknown fields):
    no setting the spec owns elsewhere, the bounds of the spec field of the same name (engine.settings.max_num_seqs
    as engine.maxNumSeqs: the scaler reads it), the names and types the programs check at start, and a port the
    operator renders into the router's container and Service that Kubernetes accepts."""
    engine = setting_names(full["engine"].get("settings") or {})
    _refuse_shared("engine", engine, SHARED_ENGINE_SETTINGS,
                   "the routers and Services must agree with the engines on it")
    fields = spec_schema()["properties"]["engine"]["properties"]
    for spec_field, name in ENGINE_SETTINGS.items():
        if name in engine:
            _check(engine[name], fields[spec_field], f"engine.settings.{name}")
    if "lora_modules" in engine:
        try:
            engine["lora_modules"] = parse_lora_modules(engine["lora_modules"])
        except ValueError as exc:
            raise SpecError(f"engine.settings.lora_modules: {exc}") from None
    _check_types("engine", EngineConfig, engine, own_images["engine"])
    router = setting_names(full["router"].get("settings") or {})
    _refuse_shared("router", router, SHARED_ROUTER_SETTINGS,
                   "the router's container, probes and Service, and the engines, must agree with it")
    if "scaleToZero" in full["scaling"] and HOLD_SETTING in router:
        raise SpecError(f"router.settings: {HOLD_SETTING} is set by scaling.scaleToZero.activationTimeoutSeconds")
    if "ext_proc_port" in router:
        _check(router["ext_proc_port"], _PORT, "router.settings.ext_proc_port")
        if router["ext_proc_port"] == full["router"]["port"]:
            raise SpecError(f"router.settings.ext_proc_port: {router['ext_proc_port']} is router.port already")
    _check_types("router", RouterConfig, router, own_images["router"])
    try:
        PickerConfig.from_weights(full["router"].get("weights") or {})
    except ValueError as exc:
        raise SpecError(f"router.{exc}" if str(exc).startswith("weights.") else f"router.weights: {exc}") from None


def complete_spec(spec: Any, defaults: PoolDefaults = PoolDefaults()) -> dict[str, Any]:
    """The spec with every default filled in (the operator's image and ports from `defaults`), after the schema's
    checks, the cross-field rules and the checks of engine and router settings."""
    full = defaulted_spec(spec)
    engine_image = full["engine"].get("image", defaults.image)
    own_images = {"engine": defaults.local or engine_image == defaults.image,
                  "router": defaults.local or full["router"].get("image", engine_image) == defaults.image}
    pull_secrets = [{"name": name} for name in defaults.image_pull_secrets] if engine_image == defaults.image else []
    full["engine"] = {"image": defaults.image, "port": defaults.engine_port, "imagePullSecrets": pull_secrets,
                      **full["engine"]}
    full["router"] = {"port": defaults.router_port, **full["router"]}
    for rule in RULES:
        target: Any = full
        for key in rule.path:
            target = target[key]
        if not rule.check(target):
            raise SpecError(rule.message)
    _check_settings(full, own_images)
    for program in ("engine", "router"):
        _check_resources(program, full[program]["resources"])
    return full


NATIVE_RESOURCES = ("cpu", "memory", "ephemeral-storage")  # and hugepages-*; any other is an extended resource


def _check_resources(program: str, resources: Mapping[str, Any]) -> None:
    """SpecError for what the API server refuses in a pod, so the pool says so (InvalidSpec) instead of failing
    at every apply: a request above its limit, an extended resource (nvidia.com/gpu) requested without an equal
    limit."""
    from kubernetes.utils.quantity import parse_quantity  # here: `kvmesh up` reads pools without the client

    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    for name, request in requests.items():
        limit = limits.get(name)
        if limit is not None and parse_quantity(request) > parse_quantity(limit):
            raise SpecError(f"{program}.resources: requests.{name} {request} is above limits.{name} {limit}, which "
                            "Kubernetes refuses")
        extended = name not in NATIVE_RESOURCES and not name.startswith("hugepages-")
        if extended and (limit is None or parse_quantity(limit) != parse_quantity(request)):
            raise SpecError(f"{program}.resources: {name} is an extended resource, which Kubernetes takes only with "
                            f"limits.{name} equal to requests.{name}: give it as a limit alone, e.g. "
                            f"limits: {{{name}: {request}}}")


@dataclass(frozen=True)
class Pool:
    """An InferencePool as the operator and `kvmesh up` use it: name, namespace and the completed spec."""

    name: str
    namespace: str
    spec: dict[str, Any]
    uid: str = ""
    generation: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return str(self.spec["mode"])

    @property
    def roles(self) -> tuple[str, ...]:
        """The engine roles this pool runs."""
        return mode_roles(self.mode)

    def bounds(self, role: str) -> tuple[int, int]:
        r = self.spec["replicas"][role]
        return int(r["min"]), int(r["max"])


def mode_roles(mode: str) -> tuple[str, ...]:
    """The engine roles a pool of `mode` runs."""
    return ("both",) if mode == "aggregated" else ("prefill", "decode")


def spec_roles(spec: Any) -> tuple[str, ...]:
    """The engine roles a pool spec as stored asks for (its mode, defaulted as the CRD does), read leniently: a
    spec that is not a mapping asks for none."""
    if not isinstance(spec, Mapping):
        return ()
    return mode_roles(str(spec.get("mode") or "aggregated"))


def parse_pool(body: Mapping[str, Any], defaults: PoolDefaults = PoolDefaults()) -> Pool:
    """A pool object (as the API serves it, or as a YAML file holds it), checked and completed."""
    if body.get("kind", KIND) != KIND or body.get("apiVersion", API_VERSION) != API_VERSION:
        raise SpecError(f"expected apiVersion {API_VERSION} kind {KIND}, got {body.get('apiVersion')} "
                        f"{body.get('kind')}")
    meta = body.get("metadata") or {}
    if not isinstance(meta, Mapping) or not isinstance(body.get("spec", {}), Mapping):
        raise SpecError(f"metadata and spec must be mappings, got {type(meta).__name__} and "
                        f"{type(body.get('spec')).__name__}")
    if not isinstance(meta.get("labels") or {}, Mapping) or not isinstance(meta.get("generation") or 0, int):
        raise SpecError(f"metadata.labels must be a mapping and metadata.generation an integer, got "
                        f"{meta.get('labels')!r} and {meta.get('generation')!r}")
    name = meta.get("name")
    if not isinstance(name, str) or not _matches(SERVICE_NAME, name) or len(name) > MAX_NAME_LENGTH:
        raise SpecError(f"metadata.name must be at most {MAX_NAME_LENGTH} characters: lowercase letters, digits and "
                        f"'-', starting with a letter (it prefixes the pool's objects, its Services among them), got "
                        f"{name!r}")
    if "spec" not in body:
        raise SpecError("spec is required")
    return Pool(name=name, namespace=meta.get("namespace") or "default", spec=complete_spec(body["spec"], defaults),
                uid=meta.get("uid", ""), generation=int(meta.get("generation") or 0),
                labels=dict(meta.get("labels") or {}))


def load_pool_file(path: str) -> Pool:
    """The one InferencePool a YAML file holds, as `kvmesh up -f` runs it (the operator reads pools from the API)."""
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    pools = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(pools) != 1:
        kinds = [str(d.get("kind")) if isinstance(d, dict) else type(d).__name__ for d in docs]
        near = [f" (did you mean {KIND}?)" if difflib.get_close_matches(k, [KIND], cutoff=0.7) else "" for k in kinds]
        found = ", ".join(f"{k}{hint}" for k, hint in zip(kinds, near, strict=True)) or "no YAML documents"
        raise SpecError(f"{path}: expected one {KIND}, found {len(pools)} among its documents' kinds: {found}")
    return parse_pool(pools[0], PoolDefaults(local=True))


if __name__ == "__main__":
    print(render_crd(), end="")
