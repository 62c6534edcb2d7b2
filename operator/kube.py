"""The operator's thin wrapper of the official Kubernetes client: one request by apiVersion, plural and name, its
answer's JSON or an ApiException, and the create-then-patch, delete and list the reconciler builds on.

Kopf-free, so that the leader election (operator/leader.py) makes its Lease calls through the same request and
error handling before kopf is loaded (a standby never loads it). Each user picks its own retries: the reconciler
and the scaling timer `API_RETRY`, the election none (its retry period is its retry).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Mapping
from http import HTTPStatus
from typing import Any

from kubernetes import client
from kubernetes.client import Configuration
from kubernetes.client.exceptions import ApiException
from urllib3.util.retry import Retry

PLURALS = {"ConfigMap": "configmaps", "Service": "services", "ServiceAccount": "serviceaccounts", "Role": "roles",
           "RoleBinding": "rolebindings", "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
           "HorizontalPodAutoscaler": "horizontalpodautoscalers", "InferencePool": "inferencepools", "Pod": "pods",
           "Secret": "secrets"}

# The reconciler's and the timer's retry policy (kopf's own watch and patch calls have theirs): a dropped
# kept-alive connection, a refused connect, a timeout, and the answers an API server gives while it is busy or
# restarting (429 and 5xx) are tried again a few times with backoff before the call fails (a reconcile then marks
# the pool Degraded; a scaling tick is skipped). Every method the operator uses is safe to repeat, though a first
# attempt may have taken effect before its answer was lost: a POST is `Kube.apply`'s create, whose repeat
# answers 409 and is merge-patched with the same fields (no object here is created by generateName), or
# `Kube.create_or_read`'s, whose repeat answers 409 and reads what the first one stored; each PATCH is
# a merge patch of absolute values and nulls (the same twice is the same once); a repeated DELETE answers 404, which
# `Kube.delete` takes as done.
API_RETRY = Retry(total=3, backoff_factor=0.5, status_forcelist=(429, 500, 502, 503, 504),
                  allowed_methods=frozenset({"GET", "POST", "PATCH", "DELETE"}),
                  raise_on_status=False)  # the last answer comes back, as an ApiException with its status
API_TIMEOUT_SECONDS = 10.0


# What the operator last applied to an object, as compact JSON of the merge patch it sent (without this annotation):
# the third side of `three_way_patch`, as kubectl's client-side apply keeps its last-applied-configuration
LAST_APPLIED_ANNOTATION = "kvmesh.io/last-applied"

Path = tuple[str, ...]  # a key's path in an object, e.g. ("spec", "replicas")


def merged(current: Any, patch: Any) -> Any:
    """`current` with the merge patch (RFC 7386) `patch` applied: what the API server would store."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(current) if isinstance(current, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(out.get(key), value)
    return out


def three_way_patch(last_applied: Mapping[str, Any] | None, patch: Mapping[str, Any],
                    keep: Collection[Path] = ()) -> dict[str, Any]:
    """The merge patch (RFC 7386) that makes an object hold `patch`'s fields and no longer those it was last
    applied with and `patch` no longer has: `patch` plus a null (delete) for every key of `last_applied` absent from
    `patch`, recursively through the maps both have (a list, or a map replaced by another value, is replaced whole
    by a merge patch anyway). A key `last_applied` never had is never nulled: what the API server defaults, what
    others set (their annotations, a scaler's fields). A path in `keep` is never nulled either: a field the
    operator hands to another (a Deployment's replicas when HPAs own them). None for `last_applied` (an object
    made before the operator recorded what it applied): `patch` as it is. A pure function; `patch` is not
    changed."""
    return _three_way(last_applied or {}, patch, frozenset(tuple(p) for p in keep), ())


def _three_way(last: Mapping[str, Any], new: Mapping[str, Any], keep: frozenset[Path], path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in new.items()}
    for key, old in last.items():
        here = (*path, key)
        if key not in new:
            if here not in keep:
                out[key] = None
        elif isinstance(old, Mapping) and isinstance(new[key], Mapping):
            out[key] = _three_way(old, new[key], keep, here)
    return out


def last_applied(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the operator last applied to `obj` (its LAST_APPLIED_ANNOTATION), or None when it has none, or one
    that is not a JSON object (edited by hand): the object then gets a plain merge patch once."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    text = annotations.get(LAST_APPLIED_ANNOTATION) if isinstance(annotations, Mapping) else None
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def recorded(obj: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` (a copy) with `patch` recorded in its LAST_APPLIED_ANNOTATION."""
    out = copy.deepcopy(dict(obj))
    meta = out.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}),
                           LAST_APPLIED_ANNOTATION: json.dumps(patch, separators=(",", ":"), sort_keys=True)}
    return out


class NameTaken(Exception):
    """An object the operator would create exists and belongs to someone else."""


def _controller(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def same_owner(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
    """Whether the operator may patch `existing` into `wanted`: it has `wanted`'s controller (the same pool, by
    uid), or no controller but `wanted`'s labels (orphaned by a pool of the same name deleted with
    --cascade=orphan). A merge patch replaces ownerReferences whole, so patching anything else would take it over,
    and a later delete of the pool would delete it."""
    ours, theirs = _controller(wanted), _controller(existing)
    if theirs is not None:
        return ours is not None and theirs.get("uid") == ours.get("uid")
    labels = (existing.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in ((wanted.get("metadata") or {}).get("labels") or {}).items())


def owned_by(obj: Mapping[str, Any]) -> str:
    controller = _controller(obj)
    return (f"its controller is {controller.get('kind')} {controller.get('name')}" if controller is not None
            else "it has no controller and not the pool's labels")


class Kube:
    """API calls by apiVersion and plural, through the official client's transport. A call raises ApiException
    for an answer outside 2xx (and for a TLS failure: status 0), urllib3's errors or OSError for no answer, and
    ValueError for an answer that is not JSON."""

    def __init__(self, configuration: Configuration, retries: Retry | bool = API_RETRY,
                 timeout_seconds: float = API_TIMEOUT_SECONDS) -> None:
        configuration = copy.deepcopy(configuration)  # the caller's (kopf's login reads it) stays as it was
        configuration.retries = retries
        self.api = client.ApiClient(configuration)
        self.timeout = timeout_seconds

    @staticmethod
    def path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")

    def call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
             content_type: str = "application/json") -> dict[str, Any]:
        """One request; the answer's JSON object ({} for an empty answer)."""
        request = self.api.param_serialize(method, path, query_params=query or [], body=body,
                                           header_params={"Accept": "application/json", "Content-Type": content_type},
                                           auth_settings=["BearerToken"])
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiException.from_response(http_resp=response, body=data.decode(errors="replace"), data=None)
        if not data:
            return {}
        answer = json.loads(data)
        if not isinstance(answer, dict):
            raise ValueError(f"{method} {path}: an answer that is not a JSON object")
        return answer

    def apply(self, obj: Mapping[str, Any], patch: Mapping[str, Any], keep: Collection[Path] = ()) -> str:
        """Create `obj`; if it exists and is `obj`'s owner's (see `same_owner`), merge-patch `patch` onto it, three
        ways (`three_way_patch`): the fields the operator applied last time and `patch` no longer has are
        deleted, but those of `keep`. Either way the object records `patch` in its LAST_APPLIED_ANNOTATION for the
        next apply. Returns "created" or "patched"; NameTaken when the name is another's."""
        meta = obj["metadata"]
        plural = PLURALS[obj["kind"]]
        try:
            self.call("POST", self.path(obj["apiVersion"], plural, meta["namespace"]), recorded(obj, patch))
            return "created"
        except ApiException as exc:
            if exc.status != HTTPStatus.CONFLICT:
                raise
        existing = self.call("GET", self.path(obj["apiVersion"], plural, meta["namespace"], meta["name"]))
        if not same_owner(obj, existing):
            raise NameTaken(f"{obj['kind']} {meta['name']} exists and is not this pool's ({owned_by(existing)}): "
                            "it is left as it is; delete or rename it, or give the pool another name")
        # the new record in the patch before the diff: the annotations map is then diffed key by key like any other
        # (others' annotations stay), never nulled whole
        body = three_way_patch(last_applied(existing), recorded(patch, patch), keep)
        self.patch(obj["apiVersion"], plural, meta["namespace"], meta["name"], body)
        return "patched"

    def create_or_read(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """The object of `obj`'s name as stored: created from `obj` if there is none (read first, since it usually
        exists), else as it is, never patched (a Secret holding what only its first creation may choose). A
        create that answers 409 (made meanwhile, or a retried create whose first try took effect) reads it."""
        meta = obj["metadata"]
        plural = PLURALS[obj["kind"]]
        try:
            return self.get(obj["apiVersion"], plural, meta["namespace"], meta["name"])
        except ApiException as exc:
            if exc.status != HTTPStatus.NOT_FOUND:
                raise
        try:
            return self.call("POST", self.path(obj["apiVersion"], plural, meta["namespace"]), dict(obj))
        except ApiException as exc:
            if exc.status != HTTPStatus.CONFLICT:
                raise
        return self.get(obj["apiVersion"], plural, meta["namespace"], meta["name"])

    def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any]:
        return self.call("GET", self.path(api_version, plural, namespace, name))

    def delete(self, api_version: str, plural: str, namespace: str, name: str) -> None:
        """Delete one object; its dependents go with it (background propagation). Gone already is done."""
        try:
            self.call("DELETE", self.path(api_version, plural, namespace, name),
                      {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        except ApiException as exc:
            if exc.status != HTTPStatus.NOT_FOUND:
                raise

    def patch(self, api_version: str, plural: str, namespace: str, name: str, body: Mapping[str, Any],
              subresource: str | None = None) -> None:
        """Merge-patch one object, or its `subresource` (`status`)."""
        path = self.path(api_version, plural, namespace, name) + (f"/{subresource}" if subresource else "")
        self.call("PATCH", path, dict(body), content_type="application/merge-patch+json")

    def list(self, api_version: str, plural: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        answer = self.call("GET", self.path(api_version, plural, namespace), query=[("labelSelector", label_selector)])
        return list(answer.get("items") or [])
