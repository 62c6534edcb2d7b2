"""kopf's own connection (its watches and patches) carries the operator's credentials: the service account's
token in the cluster, a kubeconfig user's token outside it, and a rotated token once the client reads it again.
The client's real loaders build the configuration; no API server is called (none is needed to read what the
operator would send)."""

from __future__ import annotations

import datetime
from pathlib import Path

import yaml
from kubernetes.client import Configuration
from kubernetes.config import incluster_config, kube_config

from kvmesh.operator.handlers import kopf_connection

IN_CLUSTER_ENV = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def in_cluster(tmp_path: Path, token: str, refresh: datetime.timedelta | None = None) -> Configuration:
    """A configuration as `kvmesh operator` loads it in a pod, from a service account's token and CA files."""
    (tmp_path / "token").write_text(token)
    (tmp_path / "ca.crt").write_text("a CA bundle")
    loader = incluster_config.InClusterConfigLoader(str(tmp_path / "token"), str(tmp_path / "ca.crt"),
                                                    environ=IN_CLUSTER_ENV)
    if refresh is not None:
        loader._token_refresh_period = refresh  # the client's own is a minute; a test does not wait it out
    configuration = Configuration()
    loader.load_and_set(configuration)
    return configuration


def test_in_the_cluster_kopf_sends_the_service_account_token(tmp_path: Path) -> None:
    """The in-cluster loader keeps `bearer TOKEN` under BearerToken; kopf was given no token at all (it read a key
    named authorization), so every watch of a chart-installed operator went unauthenticated."""
    info = kopf_connection(in_cluster(tmp_path, "sa-token-1"))
    assert (info.server, info.scheme, info.token) == ("https://10.0.0.1:443", "Bearer", "sa-token-1")
    assert info.ca_path == str(tmp_path / "ca.crt")


def test_a_rotated_service_account_token_reaches_kopf_at_its_next_login(tmp_path: Path) -> None:
    configuration = in_cluster(tmp_path, "sa-token-1", refresh=datetime.timedelta(0))
    assert kopf_connection(configuration).token == "sa-token-1"
    (tmp_path / "token").write_text("sa-token-2")  # the kubelet rotates the projected token
    assert kopf_connection(configuration).token == "sa-token-2"


def test_a_kubeconfig_user_token_reaches_kopf(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "user-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    configuration = Configuration()
    kube_config.load_kube_config(str(path), client_configuration=configuration)
    info = kopf_connection(configuration)
    assert (info.scheme, info.token, info.insecure) == ("Bearer", "user-token", True)


def test_without_a_token_kopf_goes_without_one(tmp_path: Path) -> None:
    """A client certificate's kubeconfig, or the tests' emulator: no bearer scheme with an empty token."""
    configuration = Configuration(host="http://127.0.0.1:1")
    info = kopf_connection(configuration)
    assert (info.scheme, info.token) == (None, None)
