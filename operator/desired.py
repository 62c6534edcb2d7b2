"""The objects an InferencePool should own: a pure function of the pool and the replicas decided for it.

One Deployment per engine role (one for an aggregated pool), a headless Service in front of the engines (the
router discovers them through its EndpointSlices), the router's Deployment and Service, a ConfigMap holding the
`engine` and `router` files that `kvmesh serve --config` and `kvmesh router --config` read (docs/contracts.md,
contract 0), a PodDisruptionBudget per Deployment, the router's ServiceAccount, Role and RoleBinding, and, as asked,
HorizontalPodAutoscalers and a Gateway API Inference Extension InferencePool. The pool's internal-token Secret
(`internal_token_secret`) is built here too, from a token the caller gives (handlers.py creates it once, when it
is missing, and never rewrites it); every engine and router pod mounts it. Every pod runs as non-root on a
read-only root filesystem with probes and resource requests, carries the contract-0 labels, and every object
names the pool as its controlling owner so that Kubernetes' garbage collector removes it with the pool.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV, INTERNAL_TOKEN_HEADER, INTERNAL_TOKEN_KEY
from kvmesh.engine.protocol import DRAIN_PATH, HOST_TIER_DIR, LIVENESS_PATH, POOL_LABEL, ROLE_LABEL, Metric
from kvmesh.operator import rbac
from kvmesh.operator.conditions import ready_replicas
from kvmesh.operator.crd import (
    ADAPTERS_DIR,
    API_KEYS_FILE,
    API_VERSION,
    BUNDLED,
    CACHE_DIR_ENV,
    DATABASE_URL_ENV,
    ENGINE_SETTINGS,
    HOLD_SETTING,
    KIND,
    Pool,
    SpecError,
    setting_names,
)
from kvmesh.operator.lora import declared_adapters
from kvmesh.operator.scaling import SCALED_ROLES, serving_floor
from kvmesh.router.auth import CACHE_SALT_SECRET_ENV
from kvmesh.router.config import GATEWAY_EXT_PROC_PORT, SHUTDOWN_DRAIN_SECONDS, RouterConfig

COMPONENT_LABEL = "app.kubernetes.io/component"  # engine or router: what the engines' Service selects on
CONFIG_HASH_ANNOTATION = "kvmesh.io/config-hash"  # on pod templates: a changed configuration rolls the pods
LORA_MODULES = "lora_modules"  # the engine setting of the pool's adapters, which the operator keeps loaded live
GRACE_SETTING = "warmup_grace_seconds"  # the engine setting of the warm-up gate's grace (`warmup_grace_seconds`)
CONFIG_DIR = "/etc/kvmesh"
MODELS_DIR = "/models"
CACHE_DIR = "/var/cache/kvmesh"  # where a .gguf model is converted at start (the image's own cache is read-only)
# The share of `engine.hostTierMiB` the engine's host tier takes: the tier file's slot records need a little more,
# and a volume past its sizeLimit gets the pod evicted.
HOST_TIER_FILL = 0.95
DRAIN_SECONDS = 300  # how long a terminating engine may finish its streams
# How long a terminating router may take: its endpoint picker's drain and then some (stopping the HTTP server,
# flushing the request log), so the streams a Gateway has open are not cut.
ROUTER_TERMINATION_GRACE_SECONDS = int(SHUTDOWN_DRAIN_SECONDS) + 30
RUN_AS = 65532  # the image's non-root user
GATEWAY_API_VERSION = "inference.networking.k8s.io/v1"
EXT_PROC_CERT_DIR = f"{CONFIG_DIR}/ext-proc-tls"  # where the router reads the picker's mounted certificate
EXT_PROC_PORT_NAME = "grpc-ext-proc"  # the router's endpoint-picker port (the grpc- prefix tells meshes it is gRPC)
API_KEYS_DIR = f"{CONFIG_DIR}/api-keys"  # where the router reads spec.router.apiKeys' Secret (updated in place)
# Where every engine and router pod mounts the pool's internal-token Secret (its `token` key only, updated in place
# by the kubelet), and so the file INTERNAL_TOKEN_FILE_ENV names: engine/internal_token.py
INTERNAL_TOKEN_DIR = f"{CONFIG_DIR}/internal-token"
INTERNAL_TOKEN_PATH = f"{INTERNAL_TOKEN_DIR}/{INTERNAL_TOKEN_KEY}"
INTERNAL_TOKEN_MODE = 0o440  # root's and the pod's fsGroup's (the image's user) to read, no one's to write
# How every Deployment of a pool rolls: a new pod Ready before an old one stops, one at a time. Kubernetes' default
# (25 % surge, 25 % unavailable, rounded down) took one of 4 or more routers down before its replacement was Ready.
# Not in the pod template, so a change of it rolls no pod.
ROLLING_UPDATE: dict[str, Any] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}



# ---- names, labels, owners ---------------------------------------------------------------------------------------


def engine_name(pool: Pool, role: str) -> str:
    return f"{pool.name}-{role}"


def router_name(pool: Pool) -> str:
    return f"{pool.name}-router"


def engines_service_name(pool: Pool) -> str:
    return f"{pool.name}-engines"


def config_name(pool: Pool) -> str:
    return f"{pool.name}-config"


def internal_token_name(pool: Pool) -> str:
    """The pool's internal-token Secret (a pool's name has at most 40 characters: this fits a DNS label)."""
    return f"{pool.name}-internal-token"


def router_address(pool: Pool) -> str:
    return f"http://{router_name(pool)}.{pool.namespace}.svc:{pool.spec['router']['port']}"


@dataclass(frozen=True)
class RouterState:
    """Whether the pool's router replicas share what they keep (the `RouterStateShared` condition)."""

    shared: bool
    reason: str
    message: str


def router_state(pool: Pool) -> RouterState:
    """Several router replicas share stored responses, the Batch API's files and batches, and the split of tenant
    limits only through the pool's database (spec.store); without one each keeps its own, which a user learns
    from a 404 on a Responses continuation that another replica stored."""
    replicas = pool.spec["router"]["replicas"]
    if replicas <= 1:
        return RouterState(True, "SingleRouter", "one router replica keeps the pool's stored responses and tenant "
                           "limits itself")
    if pool.spec["store"]:
        return RouterState(True, "Database", f"the {replicas} router replicas share stored responses, the Batch "
                           "API and tenant limits through spec.store")
    return RouterState(False, "NoStore", f"{replicas} router replicas and no spec.store: each keeps its own stored "
                       "responses (a Responses API continuation that reaches another replica gets 404), each "
                       "enforces tenant limits alone (a tenant spread over them may get up to "
                       f"{replicas} times its limits; router.settings.rate_limit_replicas divides them instead), "
                       "and the Batch API answers 501; set spec.store, or router.replicas: 1")


def labels(pool: Pool, role: str) -> dict[str, str]:
    """Contract 0's labels, plus the recommended app.kubernetes.io ones."""
    return {POOL_LABEL: pool.name, ROLE_LABEL: role, COMPONENT_LABEL: "router" if role == "router" else "engine",
            "app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/instance": pool.name,
            "app.kubernetes.io/managed-by": "kvmesh-operator"}


def selector(pool: Pool, role: str) -> dict[str, str]:
    return {POOL_LABEL: pool.name, ROLE_LABEL: role}


def owner_reference(pool: Pool) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": pool.name, "uid": pool.uid, "controller": True,
            "blockOwnerDeletion": True}


def _meta(pool: Pool, name: str, object_labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace, "labels": object_labels,
            "ownerReferences": [owner_reference(pool)]}


def internal_token_secret(pool: Pool, token: str) -> dict[str, Any]:
    """The pool's internal-token Secret holding `token` under INTERNAL_TOKEN_KEY: created once by the operator
    when missing, never patched (a new token only by deleting the Secret: docs/operator.md), owned by the pool."""
    encoded = base64.b64encode(token.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(pool, internal_token_name(pool), {POOL_LABEL: pool.name}),
            "data": {INTERNAL_TOKEN_KEY: encoded}}


def secret_token(secret: Mapping[str, Any]) -> str | None:
    """The token a pool's internal-token Secret holds (as the API server returns it: base64 in `data`), or None
    when its key is missing or not base64 of text."""
    encoded = (secret.get("data") or {}).get(INTERNAL_TOKEN_KEY)
    if not isinstance(encoded, str):
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode().strip()
    except (ValueError, UnicodeDecodeError):
        return None


# ---- configuration files ---------------------------------------------------------------------------------------------


def _model_path(pool: Pool) -> str | None:
    source = pool.spec["model"]["source"]
    return None if source == BUNDLED else source


def engine_settings(pool: Pool) -> dict[str, Any]:
    """The `engine` section of the engines' file (the engine's own key names); the role comes as a flag."""
    spec, model = pool.spec["engine"], pool.spec["model"]
    out: dict[str, Any] = {"host": "0.0.0.0", "port": spec["port"], "dtype": model["dtype"],
                           "quantization": model["quantization"], "kv_cache_dtype": model["kvCacheDtype"],
                           "forecast_horizon_seconds": pool.spec["scaling"]["horizonSeconds"]}
    if _model_path(pool):
        out["model"] = _model_path(pool)
    if "name" in model:
        out["served_model_name"] = model["name"]
    if model["loraAdapters"]:
        out[LORA_MODULES] = declared_adapters(pool)
    out.update({ENGINE_SETTINGS[k]: v for k, v in spec.items() if k in ENGINE_SETTINGS})
    if spec["hostTierMiB"]:  # the tier in the volume mounted for it (its default path is under HOST_TIER_DIR)
        out["kv_host_memory_mib"] = int(spec["hostTierMiB"] * HOST_TIER_FILL)
    out.update(setting_names(spec.get("settings") or {}))  # dashed names as the engine reads them
    return out


def engine_adapters(pool: Pool) -> dict[str, str] | None:
    """The adapters the engines' file names (`model.loraAdapters`, unless `engine.settings` sets `lora_modules`
    itself), name -> directory, which the operator keeps loaded in running engines; None when the settings give
    them in another form (a list of `name=path`): the operator then leaves running engines' adapters alone."""
    modules = engine_settings(pool).get(LORA_MODULES) or {}
    return dict(modules) if isinstance(modules, Mapping) else None


def router_settings(pool: Pool) -> dict[str, Any]:
    """The `router` section of the router's file: Kubernetes discovery of this pool's engines, and the hashing
    settings the engines use (a router refuses pods whose settings differ)."""
    spec, engine, scaling = pool.spec["router"], pool.spec["engine"], pool.spec["scaling"]
    out: dict[str, Any] = {"host": "0.0.0.0", "port": spec["port"], "pool": pool.name, "discovery": "kubernetes",
                           "namespace": pool.namespace, "block_size": engine["blockSize"],
                           "hash_algo": engine["hashAlgo"]}
    if _model_path(pool):
        out["model"] = _model_path(pool)
    if "weights" in spec:
        out["weights"] = dict(spec["weights"])
    if "ttftSeconds" in scaling["slo"]:
        out["ttft_slo_seconds"] = scaling["slo"]["ttftSeconds"]
    if "scaleToZero" in scaling:  # a request that finds no engine waits while the pool starts from zero
        out[HOLD_SETTING] = scaling["scaleToZero"]["activationTimeoutSeconds"]
    if "databaseUrl" in pool.spec["store"]:
        out["database_url"] = pool.spec["store"]["databaseUrl"]
    if "apiKeys" in spec:
        out["api_keys_file"] = f"{API_KEYS_DIR}/{spec['apiKeys'].get('key', API_KEYS_FILE)}"
    gateway = pool.spec["gatewayInferencePool"]
    if gateway["enabled"]:  # the Gateway's endpoint picker: Envoy ext_proc over gRPC
        out["ext_proc_port"] = GATEWAY_EXT_PROC_PORT
        if "tlsSecretName" in gateway:
            out["ext_proc_cert_dir"] = EXT_PROC_CERT_DIR
    out.update(setting_names(spec.get("settings") or {}))  # dashed names as the router reads them
    return out


def ext_proc_port(pool: Pool) -> int | None:
    """The port the router serves the Gateway's ext_proc stream on, as its file says; None when it serves none."""
    return router_settings(pool).get("ext_proc_port")


def ext_proc_tls(pool: Pool) -> bool:
    """Whether that port serves TLS (the router's default, with a self-signed certificate), as its file says."""
    return router_settings(pool).get("ext_proc_tls", RouterConfig.ext_proc_tls)


def config_files(pool: Pool) -> dict[str, str]:
    """The ConfigMap's files. The engines' file also holds the warm-up grace (`warmup_grace_seconds`): only pods
    starting read it, so it is left out of the pods' hash (`config_hash` hashes `engine_settings`)."""
    engine = {**engine_settings(pool), GRACE_SETTING: warmup_grace_seconds(pool)}
    return {"engine.yaml": yaml.safe_dump({"engine": engine}, sort_keys=True),
            "router.yaml": yaml.safe_dump({"router": router_settings(pool)}, sort_keys=True)}


# Settings that name files in a volume of the pod (a Secret's certificate): there, not on the operator's disk
POD_FILE_SETTINGS = ("ext_proc_cert_dir",)


def check_program_files(pool: Pool) -> None:
    """The engines' and the router's files checked as their programs check them at start (the values, not only
    the names and types the spec's checks cover: an eviction policy that does not exist, a port two settings
    share), so a pool that would crash-loop every new pod is refused as InvalidSpec instead. SpecError."""
    for program, config, settings in (("engine", EngineConfig, engine_settings(pool)),
                                      ("router", RouterConfig, router_settings(pool))):
        known = {f.name for f in dataclasses.fields(config)}
        try:
            config(**{k: v for k, v in settings.items() if k in known and k not in POD_FILE_SETTINGS}).validate()
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{program}.settings: {exc}") from None


def config_hash(pool: Pool, engine: bool) -> str:
    """A pod template's hash of the one file its program reads, so a change rolls only the pods that read it: a
    router setting (a tenant's limits) must not restart the engines and empty their caches. The engines' hash
    leaves the adapter list out: the operator loads and unloads adapters in running engines (operator/lora.py),
    so a changed list must not roll them; a new pod reads the whole file at start. (An adapter on its own
    volumeClaim still rolls them: its volume is in the pod template.)"""
    if engine:
        managed = engine_adapters(pool) is not None  # a list of name=path is not kept in step: it rolls the pods
        settings = {k: v for k, v in engine_settings(pool).items() if k != LORA_MODULES or not managed}
    else:
        settings = router_settings(pool)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


# ---- pods ------------------------------------------------------------------------------------------------------------

POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "capabilities": {"drop": ["ALL"]}}

# preStop: ask the engine to drain (contract 0) and wait until its running and queued requests are done, so a
# scale-in or a rollout cuts no stream; the router stops sending on the 503 /health or the terminating slice. An
# exec hook, not an httpGet one: the drain needs the pool's internal token, read from the mounted file (each try:
# a rotation may replace it meanwhile), which an httpGet hook cannot send. A refused or failed try (a 401 while a
# new token spreads, the file being replaced) is tried again each second; DRAIN_TRIES in a row end it (an engine that
# no longer answers has nothing to drain).
DRAIN_TRIES = 5
DRAIN_SCRIPT = """import json, os, time, urllib.request as u
end, failed = time.time() + {seconds}, 0
while time.time() < end and failed < {tries}:
    try:
        f = os.environ.get("{env}")
        h = {{"{header}": open(f).read().strip()}} if f else {{}}
        r = json.load(u.urlopen(u.Request("http://127.0.0.1:{port}{path}", method="POST", headers=h), timeout=5))
        failed = 0
        if r["running"] + r["waiting"] == 0:
            break
    except Exception:
        failed += 1
    time.sleep(1)
"""


def adapter_mounts(pool: Pool) -> list[tuple[str, str]]:
    """(claim, mount path) of each LoRA adapter on a volume claim of its own, in the spec's order: where the
    engine pods mount them, and what a pod must mount to be sent a load of the adapter."""
    return [(a["volumeClaim"], f"{ADAPTERS_DIR}/{a['name']}") for a in pool.spec["model"]["loraAdapters"]
            if "volumeClaim" in a]


def _volumes(pool: Pool, engine: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_name(pool)}},
        {"name": "tmp", "emptyDir": {}},
        # a volume, not an env var or subPath: the kubelet updates it in place when the Secret is made anew
        {"name": "internal-token", "secret": {"secretName": internal_token_name(pool),
                                              "items": [{"key": INTERNAL_TOKEN_KEY, "path": INTERNAL_TOKEN_KEY}],
                                              "defaultMode": INTERNAL_TOKEN_MODE}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True},
    ]
    if _converts(pool):
        volumes.append({"name": "cache", "emptyDir": {}})
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    if "volumeClaim" in pool.spec["model"]:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": pool.spec["model"]["volumeClaim"],
                                                                    "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    if engine:  # adapters on their own claims: each at ADAPTERS_DIR/NAME, where its path points (the CRD's rule)
        for i, (claim, path) in enumerate(adapter_mounts(pool)):
            volumes.append({"name": f"lora-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
            mounts.append({"name": f"lora-{i}", "mountPath": path, "readOnly": True})
    host_tier = pool.spec["engine"]["hostTierMiB"]
    if engine and host_tier:
        volumes.append({"name": "host-tier", "emptyDir": {"medium": "Memory", "sizeLimit": f"{host_tier}Mi"}})
        mounts.append({"name": "host-tier", "mountPath": HOST_TIER_DIR})
    return volumes, mounts


def _converts(pool: Pool) -> bool:
    """Whether the pods convert the model at start: a .gguf file does; the image's bundled model is converted at
    build time, and a Hugging Face directory needs no conversion."""
    return str(pool.spec["model"]["source"]).lower().endswith(".gguf")


def _env(pool: Pool) -> list[dict[str, Any]]:
    env = [{"name": "HOME", "value": "/tmp"}, {"name": INTERNAL_TOKEN_FILE_ENV, "value": INTERNAL_TOKEN_PATH}]
    if _converts(pool):
        env.append({"name": CACHE_DIR_ENV, "value": CACHE_DIR})
    return env


def _pool_env(pool: Pool, program: str) -> list[dict[str, Any]]:
    """The pool's own variables for that program (`engine.env`, `router.env`), placed after the operator's so they
    may refer to them as $(NAME); the CRD refuses names the operator sets, so none is given twice."""
    return copy.deepcopy(pool.spec[program].get("env") or [])


def _placement(pool: Pool, program: str) -> dict[str, Any]:
    """The pod spec's fields of where the program's pods run and what they pull with: `scheduling` as the spec gives
    it, and the pool's image pull Secrets (engines and routers run the same image by default)."""
    out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in pool.spec[program]["scheduling"].items() if v}
    if secrets := pool.spec["engine"]["imagePullSecrets"]:
        out["imagePullSecrets"] = copy.deepcopy(secrets)
    return out


def _pod_template(pool: Pool, role: str, container: dict[str, Any], engine: bool,
                  service_account: str | None = None) -> dict[str, Any]:
    volumes, mounts = _volumes(pool, engine)
    container = {**container, "volumeMounts": mounts, "securityContext": CONTAINER_SECURITY,
                 "imagePullPolicy": pool.spec["engine"]["imagePullPolicy"]}
    spec: dict[str, Any] = {"securityContext": POD_SECURITY, "containers": [container], "volumes": volumes,
                            "enableServiceLinks": False, **_placement(pool, "engine" if engine else "router")}
    if service_account:
        spec["serviceAccountName"] = service_account
    else:
        spec["automountServiceAccountToken"] = False
    if engine:
        spec["terminationGracePeriodSeconds"] = DRAIN_SECONDS + 30
    return {"metadata": {"labels": labels(pool, role),
                         "annotations": {CONFIG_HASH_ANNOTATION: config_hash(pool, engine)}},
            "spec": spec}


def warmup_grace_seconds(pool: Pool) -> float:
    """How long a new engine pod stays unready waiting for its warm-up (0: no gate): the spec's grace while
    warm-up is on. In the ConfigMap's file (`config_files`), not in `engine_settings`: a local pool (`kvmesh up
    -f`) reads those, and its first engines have no peer to be warmed from; it gives the grace only to the
    engines its scaler adds (and warms them). Not in the pod template either: an engine reads it only as it
    starts, so a changed grace must not roll the running engines; the pods started later read the new file."""
    scaling = pool.spec["scaling"]
    return float(scaling["warmupGraceSeconds"]) if scaling["warmupPrefixes"] > 0 else 0.0


def _probes(port: str = "http", liveness_path: str | None = None) -> dict[str, Any]:
    """Ready while /health answers 200 (not while loading, warming up or draining); the startup probe gives a
    model several minutes to load before liveness counts. Alive while `liveness_path` answers 200 (an engine's
    /livez: loading, warming and draining too, never restarted for those; not a stopped process, whose port still
    accepts connections, nor one whose step has stalled), else while the port accepts."""
    alive = ({"httpGet": {"path": liveness_path, "port": port}, "timeoutSeconds": 5} if liveness_path
             else {"tcpSocket": {"port": port}})
    return {
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {**alive, "periodSeconds": 10, "failureThreshold": 3},
        "startupProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2, "failureThreshold": 300},
    }


def engine_deployment(pool: Pool, role: str, replicas: int) -> dict[str, Any]:
    spec = pool.spec["engine"]
    container = {
        "name": "engine",
        "image": spec["image"],
        "command": ["kvmesh", "serve", "--config", f"{CONFIG_DIR}/engine.yaml", "--role", role],
        "ports": [{"name": "http", "containerPort": spec["port"], "protocol": "TCP"}],
        "env": _env(pool) + _pool_env(pool, "engine"),
        "resources": copy.deepcopy(spec["resources"]),
        "lifecycle": {"preStop": {"exec": {"command": [
            "python", "-c", DRAIN_SCRIPT.format(seconds=DRAIN_SECONDS, port=spec["port"], path=DRAIN_PATH,
                                                env=INTERNAL_TOKEN_FILE_ENV, header=INTERNAL_TOKEN_HEADER,
                                                tries=DRAIN_TRIES)]}}},
        **_probes(liveness_path=LIVENESS_PATH),
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(pool, engine_name(pool, role), labels(pool, role)),
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector(pool, role)},
                 "strategy": copy.deepcopy(ROLLING_UPDATE),
                 "template": _pod_template(pool, role, container, engine=True)},
    }


def router_deployment(pool: Pool) -> dict[str, Any]:
    spec = pool.spec["router"]
    command = ["kvmesh", "router", "--config", f"{CONFIG_DIR}/router.yaml"]
    env = _env(pool)
    secret = pool.spec["store"].get("databaseUrlSecret")
    if secret:  # the URL carries a password: from the Secret, expanded by the kubelet into the flag
        env.append({"name": DATABASE_URL_ENV, "valueFrom": {"secretKeyRef": dict(secret)}})
        command += ["--database-url", f"$({DATABASE_URL_ENV})"]
    salt_key = spec.get("apiKeys", {}).get("cacheSaltKey")
    if salt_key:  # every replica keys the tenants' salts alike; a pod reads it at start
        env.append({"name": CACHE_SALT_SECRET_ENV,
                    "valueFrom": {"secretKeyRef": {"name": spec["apiKeys"]["secretName"], "key": salt_key}}})
    env += _pool_env(pool, "router")
    container = {
        "name": "router",
        "image": spec.get("image") or pool.spec["engine"]["image"],
        "command": command,
        "ports": [{"name": "http", "containerPort": spec["port"], "protocol": "TCP"}],
        "env": env,
        "resources": copy.deepcopy(spec["resources"]),
        **_probes(),
    }
    if ext_proc_port(pool) is not None:
        container["ports"].append({"name": EXT_PROC_PORT_NAME, "containerPort": ext_proc_port(pool), "protocol": "TCP"})
    template = _pod_template(pool, "router", container, engine=False, service_account=router_name(pool))
    template["spec"]["terminationGracePeriodSeconds"] = ROUTER_TERMINATION_GRACE_SECONDS
    keys = spec.get("apiKeys")
    if keys:  # a volume, not an env var or subPath: the kubelet updates it in place and the router re-reads it
        key = keys.get("key", API_KEYS_FILE)
        template["spec"]["volumes"].append(
            {"name": "api-keys", "secret": {"secretName": keys["secretName"], "items": [{"key": key, "path": key}]}})
        template["spec"]["containers"][0]["volumeMounts"].append(
            {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    tls_secret = pool.spec["gatewayInferencePool"].get("tlsSecretName")
    if ext_proc_port(pool) is not None and tls_secret:  # the kubelet renews the files in place when the Secret is
        template["spec"]["volumes"].append({"name": "ext-proc-tls", "secret": {"secretName": tls_secret}})
        template["spec"]["containers"][0]["volumeMounts"].append(
            {"name": "ext-proc-tls", "mountPath": EXT_PROC_CERT_DIR, "readOnly": True})
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(pool, router_name(pool), labels(pool, "router")),
        "spec": {"replicas": spec["replicas"], "selector": {"matchLabels": selector(pool, "router")},
                 "strategy": copy.deepcopy(ROLLING_UPDATE), "template": template},
    }


# ---- the rest ----------------------------------------------------------------------------------------------------


def config_map(pool: Pool) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(pool, config_name(pool), {POOL_LABEL: pool.name}), "data": config_files(pool)}


def engines_service(pool: Pool) -> dict[str, Any]:
    """Headless: its EndpointSlices list every engine pod, which the router reads. The slices inherit these
    labels: the pool label, and no role label, so the router's `role!=router` selector keeps them."""
    port = pool.spec["engine"]["port"]
    meta_labels = {POOL_LABEL: pool.name, COMPONENT_LABEL: "engine"}
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, engines_service_name(pool), meta_labels),
            "spec": {"clusterIP": "None", "selector": {POOL_LABEL: pool.name, COMPONENT_LABEL: "engine"},
                     "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def router_service(pool: Pool) -> dict[str, Any]:
    port = pool.spec["router"]["port"]
    ports = [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    if ext_proc_port(pool) is not None:
        ports.append({"name": EXT_PROC_PORT_NAME, "port": ext_proc_port(pool), "targetPort": EXT_PROC_PORT_NAME,
                      "protocol": "TCP"})
        if not ext_proc_tls(pool):  # h2c says plaintext HTTP/2; over TLS it names none, as the extension's own Service
            ports[-1]["appProtocol"] = "kubernetes.io/h2c"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, router_name(pool), labels(pool, "router")),
            "spec": {"type": "ClusterIP", "selector": selector(pool, "router"), "ports": ports}}


def router_rbac(pool: Pool) -> list[dict[str, Any]]:
    name, meta_labels = router_name(pool), labels(pool, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool, name, meta_labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(pool, name, meta_labels),
         "rules": [p.rule() for p in rbac.ROUTER]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(pool, name, meta_labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}]},
    ]


def disruption_budget(pool: Pool, role: str) -> dict[str, Any]:
    name = router_name(pool) if role == "router" else engine_name(pool, role)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(pool, name, labels(pool, role)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(pool, role)}}}


def hpa_level(overload_probability: float) -> str:
    """The forecast level an HPA targets: the quantile closest to the pool's overload threshold."""
    return "p99" if overload_probability <= 0.03 else "p90" if overload_probability <= 0.3 else "p50"


def autoscaler(pool: Pool, role: str) -> dict[str, Any]:
    """An HPA on each pod's forecast KV usage, served by a custom-metrics adapter (prometheus-adapter) from the
    engines' own metric: Kubernetes then scales on predicted, not current, utilization."""
    low, high = pool.bounds(role)
    scaling = pool.spec["scaling"]
    target = f"{round(scaling['targetUtilization'] * 1000)}m"
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(pool, engine_name(pool, role), labels(pool, role)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": engine_name(pool, role)},
            "minReplicas": max(1, low), "maxReplicas": high,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": Metric.FORECAST_USAGE,
                           "selector": {"matchLabels": {"level": hpa_level(scaling["overloadProbability"])}}},
                "target": {"type": "AverageValue", "averageValue": target}}}],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": int(scaling["scaleUpStabilizationSeconds"])},
                "scaleDown": {"stabilizationWindowSeconds": int(scaling["scaleDownStabilizationSeconds"])}},
        },
    }


def gateway_pool(pool: Pool) -> dict[str, Any]:
    """A Gateway API Inference Extension InferencePool over the same engines, naming the router's ext_proc port
    as the endpoint picker. FailClose: with the picker down, the Gateway refuses rather than route blind."""
    return {"apiVersion": GATEWAY_API_VERSION, "kind": "InferencePool",
            "metadata": _meta(pool, pool.name, {POOL_LABEL: pool.name}),
            "spec": {"selector": {"matchLabels": {POOL_LABEL: pool.name, COMPONENT_LABEL: "engine"}},
                     "targetPorts": [{"number": pool.spec["engine"]["port"]}],
                     "endpointPickerRef": {"name": router_name(pool), "kind": "Service",
                                           "port": {"number": ext_proc_port(pool)},
                                           "failureMode": "FailClose"}}}


def initial_replicas(pool: Pool) -> dict[str, int]:
    """Each role's minimum; a pool that scales to zero starts serving (one pod a role) and idles down, so its router
    sees a pod and lists its models (a router that never did lists none, and a gateway would not route to it)."""
    return {role: serving_floor(*pool.bounds(role), "scaleToZero" in pool.spec["scaling"]) for role in pool.roles}


def desired_objects(pool: Pool, replicas: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """Every object the pool owns, in the order to create them (configuration and identities before the pods
    that use them). `replicas` per engine role, bounded by the spec; missing roles start at their minimum."""
    wanted = initial_replicas(pool) | dict(replicas or {})
    objects: list[dict[str, Any]] = [config_map(pool), *router_rbac(pool), engines_service(pool),
                                     router_service(pool)]
    for role in pool.roles:
        low, high = pool.bounds(role)
        objects.append(engine_deployment(pool, role, min(max(wanted[role], low), high)))
        objects.append(disruption_budget(pool, role))
        if pool.spec["scaling"]["mode"] == "hpa":
            objects.append(autoscaler(pool, role))
    objects += [router_deployment(pool), disruption_budget(pool, "router")]
    if pool.spec["gatewayInferencePool"]["enabled"]:
        objects.append(gateway_pool(pool))
    return objects


# ---- a change of mode: make before break -------------------------------------------------------------------------

# The kinds of a role's own objects, all named after the role's Deployment: what a previous mode's role keeps
ROLE_KINDS = ("Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler")


def previous_roles(pool: Pool, deployments: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """The engine roles with a Deployment that the pool's mode does not run (`deployments` by role): left by a
    change of mode."""
    return tuple(r for r in SCALED_ROLES if r not in pool.roles and r in deployments)


def mode_serves(pool: Pool, deployments: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether every engine role of the pool's mode can serve: its Deployment has a ready pod, or is held at 0
    replicas (a pool scaled to zero wakes through its routers, as any pool at 0)."""
    ready = ready_replicas(deployments, pool.roles)
    return all(r in deployments and (ready[r] >= 1 or (deployments[r].get("spec") or {}).get("replicas", 1) == 0)
               for r in pool.roles)


def retained_roles(pool: Pool, deployments: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """The previous mode's roles whose objects are kept after a change of mode, so the pool never stops serving
    while the new roles' pods load the model: all of them while the new roles cannot serve yet and one of them
    has a ready pod; none once the new roles serve, or when the old ones serve nobody either. A pure function of
    the spec and the Deployments' observed status, evaluated at each reconcile and scaling tick, so the switch
    completes without a further edit, and a restarted operator carries it on from what it sees."""
    previous = previous_roles(pool, deployments)
    if mode_serves(pool, deployments) or not any(ready_replicas(deployments, previous).values()):
        return ()
    return previous


def retained_objects(pool: Pool, roles: tuple[str, ...]) -> set[tuple[str, str]]:
    """(kind, name) of the retained roles' objects (`retained_roles`): their Deployment and what goes with it (its
    budget, its HPA in `scaling.mode: hpa`), left as they were."""
    return {(kind, engine_name(pool, role)) for role in roles for kind in ROLE_KINDS}


# The fields the operator may stop applying but must never delete (`Kube.apply`'s `keep`): a Deployment's replicas,
# left to its HPA in `scaling.mode: hpa` (deleting them would reset the Deployment to 1 replica)
HANDED_OFF: tuple[tuple[str, ...], ...] = (("spec", "replicas"),)


def patch_body(pool: Pool, obj: dict[str, Any]) -> dict[str, Any]:
    """What to patch onto an existing object: all of it, except engine replicas when HPAs own them (the
    operator must not fight the user's autoscaler). `Kube.apply` deletes what the last patch had and this one
    lacks (a field removed from the spec), except HANDED_OFF."""
    if pool.spec["scaling"]["mode"] == "hpa" and obj["kind"] == "Deployment" and \
            obj["metadata"]["labels"].get(ROLE_LABEL) != "router":
        obj = copy.deepcopy(obj)
        del obj["spec"]["replicas"]
    return obj
