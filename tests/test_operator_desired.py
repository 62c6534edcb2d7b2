"""The objects a pool owns (operator/desired.py), as pure functions of the pool: valid Kubernetes objects,
secure pods, configuration files the real programs read, discovery that finds the engines, RBAC from
operator/rbac.py; and the engines' metrics as the operator reads them (operator/forecast.py)."""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvmesh import cli
from kvmesh.engine.config import EngineConfig, load_config
from kvmesh.engine.internal_token import (
    INTERNAL_TOKEN_FILE_ENV,
    INTERNAL_TOKEN_HEADER,
    INTERNAL_TOKEN_KEY,
    InternalToken,
    new_token,
    write_token_file,
)
from kvmesh.engine.protocol import DRAIN_PATH, HOST_TIER_DIR, POOL_LABEL, ROLE_LABEL
from kvmesh.operator import rbac
from kvmesh.operator.crd import ENGINE_SETTINGS, Pool, PoolDefaults, SpecError, load_pool_file, parse_pool
from kvmesh.operator.desired import (
    CONFIG_HASH_ANNOTATION,
    HANDED_OFF,
    HOST_TIER_FILL,
    INTERNAL_TOKEN_DIR,
    check_program_files,
    desired_objects,
    engine_settings,
    internal_token_name,
    internal_token_secret,
    owner_reference,
    patch_body,
    router_state,
    secret_token,
)
from kvmesh.operator.forecast import Counters, TrafficEstimator, parse_pod, scaling_policy
from kvmesh.operator.kube import last_applied, merged, recorded, three_way_patch
from kvmesh.operator.local import local_engine_settings
from kvmesh.router.config import GATEWAY_EXT_PROC_PORT, SHUTDOWN_DRAIN_SECONDS, load_router_config
from kvmesh.router.picker import PickerConfig

ROOT = Path(__file__).resolve().parent.parent
AGGREGATED = ROOT / "docs" / "examples" / "aggregated.yaml"
DISAGGREGATED = ROOT / "docs" / "examples" / "disaggregated.yaml"


def pool(path: Path = AGGREGATED, **spec: Any) -> Pool:
    doc = yaml.safe_load(path.read_text())
    doc["spec"].update(spec)
    doc["metadata"]["uid"] = "uid-1"
    return parse_pool(doc)


@pytest.mark.parametrize(("spec", "message"), [
    ({"engine": {"settings": {"eviction_policy": "bogus"}}}, "engine.settings: "),
    ({"engine": {"settings": {"kv_host_memory_mib": -5}}}, "engine.settings: "),
    ({"engine": {"settings": {"queue_policy": "nope"}}}, "engine.settings: "),
    ({"router": {"port": GATEWAY_EXT_PROC_PORT}, "gatewayInferencePool": {"enabled": True}}, "router.settings: "),
])
def test_settings_the_programs_would_refuse_at_start_are_an_invalid_spec(spec: dict[str, Any], message: str) -> None:
    """Values (not only names and types) checked as the engine and the router check their files at start: a pool
    the operator applied with these would crash-loop every new pod while its status read Reconciled."""
    with pytest.raises(SpecError, match=message):
        check_program_files(pool(**spec))
    check_program_files(pool())  # the example itself is fine


def test_router_replicas_share_their_state_only_through_a_database() -> None:
    """Several router replicas without spec.store each keep their own stored responses: the condition says so,
    and how to fix it; one replica, or a database, is fine."""
    alone = router_state(pool(router={"replicas": 1}))
    assert (alone.shared, alone.reason) == (True, "SingleRouter")
    apart = router_state(pool(router={"replicas": 3}, store={}))
    assert (apart.shared, apart.reason) == (False, "NoStore")
    assert "3 router replicas" in apart.message and "404" in apart.message and "spec.store" in apart.message
    assert "up to 3 times its limits" in apart.message  # each replica enforces them whole (rate_limit_replicas 1)
    together = router_state(pool(router={"replicas": 3}, store={"databaseUrlSecret": {"name": "db", "key": "url"}}))
    assert (together.shared, together.reason) == (True, "Database")


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def matches(selector: str, object_labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics for the `k=v` and `k!=v` clauses the router uses."""
    for clause in selector.split(","):
        if "!=" in clause:
            key, value = clause.split("!=")
            if object_labels.get(key) == value:
                return False
        else:
            key, value = clause.split("=")
            if object_labels.get(key) != value:
                return False
    return True


@pytest.mark.parametrize("path", [AGGREGATED, DISAGGREGATED], ids=["aggregated", "disaggregated"])
def test_every_object_is_a_valid_kubernetes_object_owned_by_the_pool(path: Path) -> None:
    p = pool(path)
    for obj in desired_objects(p):
        if obj["apiVersion"].startswith("inference.networking.k8s.io"):
            continue  # a CRD of the Gateway API Inference Extension: not in kubernetes-validate's schemas
        kubernetes_validate.validate(obj, "1.30", strict=True)
    for obj in desired_objects(p):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferencePool", p.name, "uid-1", True)
        assert obj["metadata"]["namespace"] == p.namespace and obj["metadata"]["labels"][POOL_LABEL] == p.name


def test_an_aggregated_pool_has_one_engine_deployment_and_a_disaggregated_one_two() -> None:
    agg = by_kind(desired_objects(pool()), "Deployment")
    assert set(agg) == {"chat-both", "chat-router"}
    dis = desired_objects(pool(DISAGGREGATED))
    deployments = by_kind(dis, "Deployment")
    assert set(deployments) == {"docs-prefill", "docs-decode", "docs-router"}
    for role in ("prefill", "decode"):
        d = deployments[f"docs-{role}"]
        assert d["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == role
        assert d["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--role", role]
    assert set(by_kind(dis, "PodDisruptionBudget")) == {"docs-prefill", "docs-decode", "docs-router"}
    gateway = by_kind(dis, "InferencePool")["docs"]
    assert gateway["spec"]["endpointPickerRef"]["name"] == "docs-router"
    assert gateway["spec"]["selector"]["matchLabels"] == by_kind(dis, "Service")["docs-engines"]["spec"]["selector"]


def test_a_terminating_router_outlasts_its_endpoint_pickers_drain() -> None:
    """At shutdown the router lets the streams a Gateway has open finish for SHUTDOWN_DRAIN_SECONDS: its pod must
    not be killed before."""
    for path in (AGGREGATED, DISAGGREGATED):
        (router,) = [d for name, d in by_kind(desired_objects(pool(path)), "Deployment").items()
                     if name.endswith("-router")]
        assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > SHUTDOWN_DRAIN_SECONDS + 10


def test_the_gateway_pool_names_the_ext_proc_port_the_router_serves(tmp_path: Path) -> None:
    """A Gateway calls the endpoint picker its InferencePool names over ext_proc: that Service port must lead to
    the port the router's own configuration file makes it serve, and the chart's policies must let the Gateway in."""
    objects = desired_objects(pool(DISAGGREGATED))
    ref = by_kind(objects, "InferencePool")["docs"]["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["failureMode"]) == ("Service", "docs-router", "FailClose")
    (port,) = [p for p in by_kind(objects, "Service")["docs-router"]["spec"]["ports"]
               if p["port"] == ref["port"]["number"]]
    assert "appProtocol" not in port  # TLS (the router's default): not h2c, which would tell a Gateway plaintext
    (container,) = by_kind(objects, "Deployment")["docs-router"]["spec"]["template"]["spec"]["containers"]
    (target,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    (tmp_path / "router.yaml").write_text(by_kind(objects, "ConfigMap")["docs-config"]["data"]["router.yaml"])
    served = load_router_config(tmp_path / "router.yaml")
    assert served.ext_proc_port == target["containerPort"] == GATEWAY_EXT_PROC_PORT
    assert served.ext_proc_tls and served.ext_proc_cert_dir is None  # a self-signed certificate, made at start
    # a pool that turns TLS off (router.settings) gets a Service that says plaintext HTTP/2, as the router serves
    doc = yaml.safe_load(DISAGGREGATED.read_text())
    doc["spec"]["router"]["settings"] = {"ext_proc_tls": False}
    doc["metadata"]["uid"] = "uid-1"
    objects = desired_objects(parse_pool(doc))
    (port,) = [p for p in by_kind(objects, "Service")["docs-router"]["spec"]["ports"] if p["name"] == "grpc-ext-proc"]
    assert port["appProtocol"] == "kubernetes.io/h2c"
    (tmp_path / "router.yaml").write_text(by_kind(objects, "ConfigMap")["docs-config"]["data"]["router.yaml"])
    assert load_router_config(tmp_path / "router.yaml").ext_proc_tls is False
    # without the Gateway pool the router opens no gRPC port
    plain = desired_objects(pool())
    assert [p["name"] for p in by_kind(plain, "Service")["chat-router"]["spec"]["ports"]] == ["http"]
    (tmp_path / "router.yaml").write_text(by_kind(plain, "ConfigMap")["chat-config"]["data"]["router.yaml"])
    assert load_router_config(tmp_path / "router.yaml").ext_proc_port is None

    from . import test_chart as chart

    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
               "podSelector": {"matchLabels": {"app": "envoy"}}}
    chart.PODS["gateway"] = ("gateway", {"app": "envoy"})
    try:
        for peers, reaches in (([], False), ([gateway], True)):
            policies = chart.by_kind(chart.manifests(chart.render({"networkPolicy": {"gateway": peers}})),
                                     "NetworkPolicy")
            assert chart.allowed(policies, "gateway", "router", GATEWAY_EXT_PROC_PORT) is reaches
            assert not chart.allowed(policies, "client", "router", GATEWAY_EXT_PROC_PORT)
    finally:
        del chart.PODS["gateway"]


def test_a_tls_secret_is_what_the_router_serves_the_gateway_with() -> None:
    """gatewayInferencePool.tlsSecretName (cert-manager's Secret): mounted read-only where the router's own file
    tells it to read the certificate; without it, no mount and a self-signed certificate (test above)."""
    doc = yaml.safe_load(DISAGGREGATED.read_text())
    doc["spec"]["gatewayInferencePool"]["tlsSecretName"] = "picker-tls"
    doc["metadata"]["uid"] = "uid-1"
    objects = desired_objects(parse_pool(doc))
    settings = yaml.safe_load(by_kind(objects, "ConfigMap")["docs-config"]["data"]["router.yaml"])["router"]
    template = by_kind(objects, "Deployment")["docs-router"]["spec"]["template"]["spec"]
    (volume,) = [v for v in template["volumes"] if v.get("secret") and v["name"] != "internal-token"]
    (mount,) = [m for m in template["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert volume["secret"] == {"secretName": "picker-tls"} and mount["readOnly"]
    assert settings["ext_proc_cert_dir"] == mount["mountPath"]
    kubernetes_validate.validate(by_kind(objects, "Deployment")["docs-router"], "1.30", strict=True)
    engines = by_kind(objects, "Deployment")["docs-decode"]["spec"]["template"]["spec"]
    assert not [v for v in engines["volumes"] if v.get("secret") and v["name"] != "internal-token"], \
        "only the router reads the certificate"


def test_an_api_keys_secret_is_mounted_where_the_router_reads_its_keys_and_salt() -> None:
    """router.apiKeys: the keys file is a Secret volume (updated in place by the kubelet, which the router re-reads),
    at the path the router's own file names; the salt secret an env var from the same Secret; engines get neither."""
    doc = yaml.safe_load(DISAGGREGATED.read_text())
    doc["spec"]["router"]["apiKeys"] = {"secretName": "pool-keys", "cacheSaltKey": "salt"}
    doc["metadata"]["uid"] = "uid-1"
    objects = desired_objects(parse_pool(doc))
    settings = yaml.safe_load(by_kind(objects, "ConfigMap")["docs-config"]["data"]["router.yaml"])["router"]
    router = by_kind(objects, "Deployment")["docs-router"]
    template = router["spec"]["template"]["spec"]
    (volume,) = [v for v in template["volumes"] if v.get("secret") and v["name"] != "internal-token"]
    (mount,) = [m for m in template["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert volume["secret"] == {"secretName": "pool-keys", "items": [{"key": "keys.yaml", "path": "keys.yaml"}]}
    assert mount["readOnly"] and "subPath" not in mount  # a subPath mount is never updated
    assert settings["api_keys_file"] == f"{mount['mountPath']}/keys.yaml"
    (salt,) = [e for e in template["containers"][0]["env"] if e["name"] == "KVMESH_CACHE_SALT_SECRET"]
    assert salt["valueFrom"]["secretKeyRef"] == {"name": "pool-keys", "key": "salt"}
    kubernetes_validate.validate(router, "1.30", strict=True)
    engines = by_kind(objects, "Deployment")["docs-decode"]["spec"]["template"]["spec"]
    assert not [v for v in engines["volumes"] if v.get("secret") and v["name"] != "internal-token"], \
        "only the router reads the keys"
    assert all(e["name"] != "KVMESH_CACHE_SALT_SECRET" for e in engines["containers"][0]["env"])

    doc["spec"]["router"]["apiKeys"] = {"secretName": "pool-keys", "key": "tenants.yaml"}
    objects = desired_objects(parse_pool(doc))
    settings = yaml.safe_load(by_kind(objects, "ConfigMap")["docs-config"]["data"]["router.yaml"])["router"]
    assert settings["api_keys_file"].endswith("/tenants.yaml")


def test_a_pools_own_environment_reaches_its_programs_after_the_operators() -> None:
    """engine.env and router.env (OTEL_* for tracing, a token from a Secret): appended to what the operator sets,
    each only on its own program's pods, and the Deployments stay valid."""
    doc = yaml.safe_load(DISAGGREGATED.read_text())
    doc["spec"]["engine"]["env"] = [{"name": "OTEL_SERVICE_NAME", "value": "chat-engine"},
                                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]
    doc["spec"]["router"]["env"] = [{"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"}]
    doc["metadata"]["uid"] = "uid-1"
    deployments = by_kind(desired_objects(parse_pool(doc)), "Deployment")
    for name in ("docs-prefill", "docs-decode"):
        env = deployments[name]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert env[0]["name"] == "HOME" and env[-2:] == doc["spec"]["engine"]["env"]
        assert all(e["name"] != "OTEL_TRACES_SAMPLER" for e in env)
        kubernetes_validate.validate(deployments[name], "1.30", strict=True)
    env = deployments["docs-router"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[-1] == {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"}
    assert all(e["name"] != "HF_TOKEN" for e in env)
    kubernetes_validate.validate(deployments["docs-router"], "1.30", strict=True)


def test_a_dashed_engine_setting_is_written_and_scaled_on_under_the_engines_own_name() -> None:
    """`max-num-seqs` in engine.settings is what the engine reads as max_num_seqs: the file has it once, under that
    name (not beside the spec's default), and the ITL sizing caps its batch at it."""
    dashed = pool(engine={"settings": {"max-num-seqs": 8}})
    written = engine_settings(dashed)
    assert written["max_num_seqs"] == 8 and "max-num-seqs" not in written
    assert scaling_policy(dashed).max_batch == 8


def test_replicas_start_at_the_minimum_and_stay_within_bounds() -> None:
    p = pool(DISAGGREGATED)
    deployments = by_kind(desired_objects(p), "Deployment")
    assert (deployments["docs-prefill"]["spec"]["replicas"], deployments["docs-decode"]["spec"]["replicas"]) == (1, 2)
    deployments = by_kind(desired_objects(p, {"prefill": 99, "decode": 0}), "Deployment")
    assert (deployments["docs-prefill"]["spec"]["replicas"], deployments["docs-decode"]["spec"]["replicas"]) == (4, 2)


def test_pods_are_non_root_read_only_probed_resourced_and_drain_before_stopping() -> None:
    for d in by_kind(desired_objects(pool()), "Deployment").values():
        spec = d["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        if container["name"] == "engine":  # /livez: 200 while loading, warming or draining; not a stopped process
            assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
        else:
            assert "tcpSocket" in container["livenessProbe"]
        assert container["resources"]["requests"]
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in writable
    engine = by_kind(desired_objects(pool()), "Deployment")["chat-both"]["spec"]["template"]["spec"]
    (container,) = engine["containers"]
    assert DRAIN_PATH in container["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert engine["terminationGracePeriodSeconds"] > 300
    host = next(v for v in engine["volumes"] if v["name"] == "host-tier")
    assert host["emptyDir"] == {"medium": "Memory", "sizeLimit": "1024Mi"}
    assert {"name": "host-tier", "mountPath": HOST_TIER_DIR} in container["volumeMounts"]
    # ...and the engines keep their host tier there: the volume alone served nothing (the tier was off)
    settings = engine_settings(pool())
    assert settings["kv_host_memory_mib"] == int(1024 * HOST_TIER_FILL) and "kv_host_path" not in settings
    assert "kv_host_memory_mib" not in engine_settings(pool(engine={"hostTierMiB": 0}))
    assert engine_settings(pool(engine={"settings": {"kv_host_memory_mib": 100}}))["kv_host_memory_mib"] == 100
    # The bundled model was converted when the image was built: nothing overrides the image's cache; a .gguf
    # file is converted at start into a writable volume.
    assert "KVMESH_CACHE_DIR" not in {e["name"] for e in container["env"]}
    gguf = by_kind(desired_objects(pool(model={"source": "/models/m.gguf", "volumeClaim": "weights"})), "Deployment")
    (gguf_container,) = gguf["chat-both"]["spec"]["template"]["spec"]["containers"]
    cache = {e["name"]: e.get("value") for e in gguf_container["env"]}["KVMESH_CACHE_DIR"]
    assert cache in {m["mountPath"] for m in gguf_container["volumeMounts"] if not m.get("readOnly")}
    # The router gets the ServiceAccount whose Role lets it read EndpointSlices; engines get no API token.
    router = by_kind(desired_objects(pool()), "Deployment")["chat-router"]["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "chat-router" and engine["automountServiceAccountToken"] is False


@pytest.mark.parametrize("path", [AGGREGATED, DISAGGREGATED], ids=["aggregated", "disaggregated"])
def test_every_engine_and_router_pod_mounts_the_pools_internal_token(path: Path) -> None:
    """The pool's Secret, its `token` key only, read-only, where KVMESH_INTERNAL_TOKEN_FILE points: in every
    Deployment's pods (engines and router), none of which may change it. The Secret itself is the pool's, holds
    the token it was made with, and is not among the objects applied (and so patched) at every reconcile."""
    p = parse_pool({**yaml.safe_load(path.read_text()), "metadata": {"name": "docs", "namespace": "ns", "uid": "u-1"}})
    objects = desired_objects(p)
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {*(f"docs-{r}" for r in p.roles), "docs-router"}
    for d in deployments.values():
        spec = d["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "internal-token"]
        assert volume["secret"]["secretName"] == internal_token_name(p) == "docs-internal-token"
        assert volume["secret"]["items"] == [{"key": INTERNAL_TOKEN_KEY, "path": INTERNAL_TOKEN_KEY}]
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "internal-token"]
        assert mount == {"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[INTERNAL_TOKEN_FILE_ENV] == f"{INTERNAL_TOKEN_DIR}/{INTERNAL_TOKEN_KEY}"
        kubernetes_validate.validate(d, "1.30", strict=True)
    assert "Secret" not in {o["kind"] for o in objects}
    token = new_token()
    secret = internal_token_secret(p, token)
    kubernetes_validate.validate(secret, "1.30", strict=True)
    assert secret["metadata"]["name"] == "docs-internal-token" and secret["metadata"]["namespace"] == "ns"
    assert secret["metadata"]["ownerReferences"] == [owner_reference(p)]
    assert base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode() == token == secret_token(secret)
    assert secret_token({"data": {}}) is None and secret_token({"data": {INTERNAL_TOKEN_KEY: "not base64!"}}) is None
    # the longest pool name still makes a valid Secret name
    long = parse_pool({**yaml.safe_load(path.read_text()), "metadata": {"name": "p" * 40, "namespace": "ns"}})
    assert len(internal_token_name(long)) <= 63


def test_the_engines_drain_hook_sends_the_pools_internal_token(tmp_path: Path) -> None:
    """preStop is an exec hook (an httpGet hook cannot read the mounted token): the script, run as the kubelet
    runs it with the container's environment, drains the engine with the token the file holds now; a refusal (a
    401 while a new token spreads) is tried again, not the end of the drain."""
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.path, self.headers.get(INTERNAL_TOKEN_HEADER)))
            if len(seen) == 1:
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.dumps({"running": 0, "waiting": 0}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p = pool(engine={"port": server.server_address[1]})
        (container,) = by_kind(desired_objects(p), "Deployment")["chat-both"]["spec"]["template"]["spec"]["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "python"
        token_file = tmp_path / "token"
        write_token_file(token_file, "t" * 32)
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        subprocess.run([sys.executable, *command[1:]], check=True, timeout=30,
                       env={**env, INTERNAL_TOKEN_FILE_ENV: str(token_file)})
        assert seen == [(DRAIN_PATH, InternalToken(token_file).value())] * 2
    finally:
        server.shutdown()
        server.server_close()


def test_the_configuration_files_are_read_by_the_real_engine_and_router(tmp_path: Path) -> None:
    for path in (AGGREGATED, DISAGGREGATED):
        p = pool(path)
        data = by_kind(desired_objects(p), "ConfigMap")[f"{p.name}-config"]["data"]
        (tmp_path / "engine.yaml").write_text(data["engine.yaml"])
        (tmp_path / "router.yaml").write_text(data["router.yaml"])
        engine = load_config(tmp_path / "engine.yaml")
        router = load_router_config(tmp_path / "router.yaml")
        assert (engine.host, engine.port, engine.block_size) == ("0.0.0.0", p.spec["engine"]["port"],
                                                                 router.block_size)
        assert engine.hash_algo == router.hash_algo
        assert engine.forecast_horizon_seconds == p.spec["scaling"]["horizonSeconds"]
        PickerConfig(**router.weights)  # the weights name real picker settings
        assert (router.discovery, router.pool, router.namespace) == ("kubernetes", p.name, p.namespace)
    assert load_config(tmp_path / "engine.yaml").handoff_ttl_seconds == 30  # engine.settings passes through
    assert set(ENGINE_SETTINGS.values()) <= {f for f in EngineConfig.__dataclass_fields__}


def engine_flags(container: dict[str, Any], config_file: Path) -> EngineConfig:
    """What the real `kvmesh serve` makes of a container's command (its --config pointed at `config_file`)."""
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers())
    args = parser.parse_args(container["command"][1:])
    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)}
    return load_config(config_file, flags)


def test_with_warm_up_on_engines_stay_unready_until_warmed_and_are_never_restarted_for_it(tmp_path: Path) -> None:
    def engine(p: Pool) -> EngineConfig:
        objects = desired_objects(p)
        (tmp_path / "engine.yaml").write_text(by_kind(objects, "ConfigMap")["chat-config"]["data"]["engine.yaml"])
        (container,) = by_kind(objects, "Deployment")["chat-both"]["spec"]["template"]["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", "a warming pod is in no Service"
        assert container["livenessProbe"]["httpGet"]["path"] == "/livez", "200 while warming: never restarted for it"
        assert "httpGet" not in container["startupProbe"]
        return engine_flags(container, tmp_path / "engine.yaml")

    assert engine(pool()).warmup_grace_seconds == 60
    assert engine(pool(scaling={"warmupGraceSeconds": 15})).warmup_grace_seconds == 15
    assert engine(pool(scaling={"warmupPrefixes": 0})).warmup_grace_seconds == 0, "nothing warms them: no gate"
    # a local pool (kvmesh up -f) reads the same engine settings and has no operator to warm its engines
    assert "warmup_grace_seconds" not in local_engine_settings(pool())


def test_a_changed_warm_up_grace_reaches_new_engines_through_the_config_map_and_rolls_none() -> None:
    """An engine reads its grace only as it starts: a changed grace (or warm-up turned off) is in the file new pods
    read, and not in the engines' pod template, whose change would restart every engine and empty its cache."""
    def engines(p: Pool) -> tuple[dict[str, Any], float]:
        objects = desired_objects(p)
        engine_file = yaml.safe_load(by_kind(objects, "ConfigMap")["chat-config"]["data"]["engine.yaml"])
        return by_kind(objects, "Deployment")["chat-both"]["spec"]["template"], engine_file["engine"][
            "warmup_grace_seconds"]

    scaling = yaml.safe_load(AGGREGATED.read_text())["spec"]["scaling"]
    template, grace = engines(pool())
    assert grace == 60
    for changed, expected in ((pool(scaling={**scaling, "warmupGraceSeconds": 15}), 15),
                              (pool(scaling={**scaling, "warmupPrefixes": 0}), 0)):
        assert engines(changed) == (template, expected)


def test_the_router_discovers_the_engines_through_their_service_and_may_read_endpointslices() -> None:
    """EndpointSlices inherit their Service's labels: the router's selector must match the engines' Service and
    not the router's own."""
    p = pool()
    objects = desired_objects(p)
    services = by_kind(objects, "Service")
    data = by_kind(objects, "ConfigMap")["chat-config"]["data"]
    selector = load_router_config_from_text(data["router.yaml"]).endpoint_selector()
    assert matches(selector, services["chat-engines"]["metadata"]["labels"])
    assert not matches(selector, services["chat-router"]["metadata"]["labels"])
    assert services["chat-engines"]["spec"]["clusterIP"] == "None"
    engine_labels = by_kind(objects, "Deployment")["chat-both"]["spec"]["template"]["metadata"]["labels"]
    assert all(engine_labels[k] == v for k, v in services["chat-engines"]["spec"]["selector"].items())
    role = by_kind(objects, "Role")["chat-router"]
    assert role["rules"] == [perm.rule() for perm in rbac.ROUTER]
    for perm in rbac.ROUTER:  # the operator holds what it grants (Kubernetes forbids escalation)
        assert all(rbac.allows(rbac.OPERATOR, perm.group, perm.resource, verb) for verb in perm.verbs)


def load_router_config_from_text(text: str) -> Any:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return load_router_config(f.name)


def test_a_configuration_change_rolls_the_pods_that_read_it_and_a_replica_change_does_not() -> None:
    """One hash per program's file: an engine setting rolls the engines (and the router only when its own file
    changes), a router setting such as a tenant's limits rolls only the routers: the engines keep their caches."""
    def template_hash(p: Pool, name: str = "chat-both", replicas: dict[str, int] | None = None) -> str:
        d = by_kind(desired_objects(p, replicas), "Deployment")[name]
        return d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    base = pool()
    assert template_hash(base) == template_hash(base, replicas={"both": 4})
    changed = pool(engine={**base.spec["engine"], "maxNumSeqs": 8})
    assert template_hash(changed) != template_hash(base)
    assert template_hash(changed, "chat-router") == template_hash(base, "chat-router")
    limited = pool(router={**base.spec["router"], "settings": {"tenants": {"default": {"requests_per_minute": 60}}}})
    assert template_hash(limited, "chat-router") != template_hash(base, "chat-router")
    assert template_hash(limited) == template_hash(base)
    hashed = pool(engine={**base.spec["engine"], "blockSize": 32})  # in both files: both roll
    assert template_hash(hashed) != template_hash(base)
    assert template_hash(hashed, "chat-router") != template_hash(base, "chat-router")


def test_every_deployment_starts_a_new_pod_before_it_stops_an_old_one() -> None:
    """Kubernetes' default strategy (25 % surge, 25 % unavailable rounded down) took one of 4 or more routers down
    before its replacement was Ready; the routers roll as the engines do, one new pod at a time, none down."""
    base = pool()
    for p in (pool(router={**base.spec["router"], "replicas": 4}), pool(DISAGGREGATED)):
        for name, deployment in by_kind(desired_objects(p), "Deployment").items():
            assert deployment["spec"]["strategy"] == {
                "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, name


def test_the_routers_new_strategy_reaches_a_running_pool_without_rolling_its_routers() -> None:
    """An upgrade from a release whose router Deployment had no strategy: the operator's apply (a three-way merge
    patch, `Kube.apply`) onto the live Deployment, as that release recorded it and the API server defaulted it,
    changes its strategy and nothing of its pod template, so no new ReplicaSet: no router pod rolls for it."""
    p = pool(router={**pool().spec["router"], "replicas": 4})
    new = patch_body(p, by_kind(desired_objects(p), "Deployment")["chat-router"])
    before = copy.deepcopy(new)
    del before["spec"]["strategy"]  # what the previous release applied: the rest is the same spec's
    live = recorded(before, before)
    live["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
    after = merged(live, three_way_patch(last_applied(live), recorded(new, new), HANDED_OFF))
    assert after["spec"]["template"] == live["spec"]["template"]
    assert {k for k, v in after["spec"].items() if live["spec"].get(k) != v} == {"strategy"}
    assert after["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_hpa_mode_creates_autoscalers_on_the_forecast_and_never_patches_engine_replicas() -> None:
    p = pool(scaling={"mode": "hpa", "horizonSeconds": 90, "podStartupSeconds": 60})
    objects = desired_objects(p)
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["chat-both"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "800m"
    deployments = by_kind(objects, "Deployment")
    assert "replicas" not in patch_body(p, deployments["chat-both"])["spec"]
    assert patch_body(p, deployments["chat-router"])["spec"]["replicas"] == 2
    assert "replicas" in patch_body(pool(), by_kind(desired_objects(pool()), "Deployment")["chat-both"])["spec"]


def test_the_store_secret_reaches_the_router_as_a_flag() -> None:
    router = by_kind(desired_objects(pool(DISAGGREGATED)), "Deployment")["docs-router"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["--database-url", "$(KVMESH_DATABASE_URL)"]
    env = {e["name"]: e for e in container["env"]}
    assert env["KVMESH_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "kvmesh-request-log", "key": "url"}


def test_the_example_files_load_through_load_pool_file() -> None:
    assert load_pool_file(str(DISAGGREGATED)).roles == ("prefill", "decode")


# ---- the engines' metrics as the operator reads them ------------------------------------------------------------


def test_a_real_engine_s_metrics_parse_into_an_observation(tiny_engine: Any) -> None:
    metrics = parse_pod("pod-a", "both", tiny_engine.metrics.render().decode())
    obs = metrics.observation
    assert obs.num_blocks == tiny_engine.config.kv_cache_blocks
    assert set(obs.forecast) == {"p50", "p90", "p99"}
    assert metrics.block_size == tiny_engine.config.block_size


def test_traffic_is_estimated_from_counter_deltas_and_restarts_are_skipped() -> None:
    est = TrafficEstimator()
    est.update(0, [("a", Counters())], 16)
    t = est.update(10, [("a", Counters(finished=20, finished_seconds=40, prompt_tokens=20 * 300,
                                       output_tokens=20 * 100, cached_tokens=20 * 100, in_flight=5))], 16)
    assert t.arrival_rate == pytest.approx(2.5)  # 20 finished + 5 more in flight in 10 s
    assert t.blocks_per_request == 25  # (300 + 100) / 16
    assert (t.request_seconds, t.uncached_prompt_tokens, t.output_tokens) == (2.0, 200.0, 100.0)
    assert t.decode_context_tokens == 300 + 100 / 2  # a decoding request attends to its prompt and half its output
    restarted = est.update(20, [("a", Counters(finished=1, in_flight=1))], 16)
    # counters fell: the pod restarted, and what it counted since arrived in this interval (no negative traffic)
    assert restarted.arrival_rate == pytest.approx(0.2)


def test_scheduling_and_pull_secrets_reach_each_programs_pods_and_are_valid_pod_specs() -> None:
    """GPU nodes are tainted and labelled, and a platform keeps routers off them: engine.scheduling and
    router.scheduling are the pod spec's own fields for each program's pods; the pool's pull Secrets go to both
    (they run one image by default), and a pool that names its own image does not get the operator's."""
    gpu = {"nodeSelector": {"nvidia.com/gpu.product": "H100"},
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
           "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
               "weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                 "labelSelector": {"matchLabels": {"kvmesh.io/pool": "docs"}}}}]}},
           "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                          "whenUnsatisfiable": "ScheduleAnyway"}],
           "priorityClassName": "inference-high", "runtimeClassName": "nvidia"}
    doc = yaml.safe_load(DISAGGREGATED.read_text())
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["engine"] = {**doc["spec"].get("engine", {}), "scheduling": gpu,
                             "imagePullSecrets": [{"name": "regcred"}]}
    doc["spec"]["router"] = {**doc["spec"].get("router", {}), "scheduling": {"nodeSelector": {"pool": "cpu"}}}
    deployments = by_kind(desired_objects(parse_pool(doc)), "Deployment")
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        kubernetes_validate.validate(deployment, "1.30", strict=True)
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        if name.endswith("-router"):
            assert pod["nodeSelector"] == {"pool": "cpu"} and "tolerations" not in pod and "affinity" not in pod
        else:
            assert {k: pod[k] for k in gpu} == gpu
    defaults = PoolDefaults(image_pull_secrets=("operator-cred",))
    own = by_kind(desired_objects(parse_pool(yaml.safe_load(AGGREGATED.read_text()), defaults)), "Deployment")
    assert all(d["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "operator-cred"}] for d in own.values())
    doc = yaml.safe_load(AGGREGATED.read_text())
    doc["spec"]["engine"] = {**doc["spec"].get("engine", {}), "image": "example.org/kvmesh:dev"}
    other = by_kind(desired_objects(parse_pool(doc, defaults)), "Deployment")
    assert all("imagePullSecrets" not in d["spec"]["template"]["spec"] for d in other.values())
