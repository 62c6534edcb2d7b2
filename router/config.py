"""Router configuration: defaults, the `router` section of a YAML config file, and flag overrides.

The operator mounts the `router` section of an InferencePool spec; `kvmesh router --config FILE` reads it and
flags win over the file (docs/contracts.md, contract 0), as for the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.engine.body_deadline import DEFAULT_BODY_READ_TIMEOUT_SECONDS, check_body_read_timeout
from kvmesh.engine.protocol import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ROOT, POOL_LABEL, ROLE_LABEL, HashAlgo
from kvmesh.engine.tracing import check_endpoint
from kvmesh.engine.typed_fields import check_http_url, check_port, check_types, read_settings_file
from kvmesh.router.batch_runner import BatchSettings
from kvmesh.router.batches import (
    BATCH_PRIORITY,
    MAX_CONCURRENT_UPLOADS,
    MAX_ENQUEUED_REQUESTS,
    MAX_FILE_BYTES,
    MAX_STORED_BYTES,
    MAX_STORED_FILES,
    FileQuota,
)
from kvmesh.router.limits import BATCH_RATE_SHARE, Limiter, parse_tenants
from kvmesh.router.picker import PickerConfig
from kvmesh.router.proxy import MAX_CONNECTIONS_PER_POD, Upstream
from kvmesh.router.responses_store import RESPONSES_MEMORY_ITEMS, RESPONSES_TTL_SECONDS

DISCOVERY_MODES = ("static", "kubernetes")
GATEWAY_EXT_PROC_PORT = 9002  # the Gateway API Inference Extension's usual endpoint-picker port (the operator's)
# At shutdown (SIGTERM) both edges stop advertising themselves at once (HTTP /health 503, the ext_proc health
# NOT_SERVING) and the requests and streams open then get up to this long to finish (a generation takes seconds
# to minutes); the operator gives the router pod a longer terminationGracePeriodSeconds.
SHUTDOWN_DRAIN_SECONDS = 30.0
# ...and both go on serving new requests at least this long (within that bound), even with none open: a Service
# or Gateway learns of the 503 / NOT_SERVING only at its next probe or health check, and a FailClose Gateway
# fails a request it sends to a picker already gone. Sized to one health-check interval of a Gateway checking
# every 5 s (or a readiness probe's two failures at 2 s), also time for the pod's removal from its Service's
# endpoints to reach the load balancers.
SHUTDOWN_SETTLE_SECONDS = 5.0
# Bodies up to this size are tokenized on the event loop (well under a millisecond); larger ones on a worker
# thread, so a long prompt does not stall other requests' streams.
INLINE_TOKENIZE_BYTES = 8192
# Requests one router holds at once while no pod is ready (hold_without_pods_seconds): each is an open connection
# and its body in memory, so a burst against a pool starting from zero stays bounded.
MAX_HELD_REQUESTS = 1000
MAX_HOLD_SECONDS = 3600.0  # the longest hold (scaling.scaleToZero.activationTimeoutSeconds' bound)
MAX_REQUEST_BODY_BYTES = 32 << 20  # a completion's body the router holds in memory at most, on either edge
EXT_PROC_CERT_FILE, EXT_PROC_KEY_FILE = "tls.crt", "tls.key"  # in ext_proc_cert_dir: a kubernetes.io/tls Secret's keys


@dataclass
class RouterConfig:
    """Everything `kvmesh router` can be told. Field names are the YAML keys (dashes or underscores)."""

    host: str = "127.0.0.1"
    port: int = 8080
    ext_proc_port: int | None = None  # serve Envoy ext_proc here: a Gateway's endpoint picker (router/extproc.py)
    ext_proc_tls: bool = True  # ext_proc over TLS, as gateways dial an endpoint picker; false: plaintext (h2c)
    ext_proc_cert_dir: str | None = None  # tls.crt and tls.key (a mounted Secret); None: self-signed at start
    pods: list[str] = field(default_factory=list)  # engine base URLs (a static pool)
    pods_file: str | None = None  # static discovery from a JSON/YAML file of pods, re-read when it changes
    pool: str = "local"
    discovery: str = "static"  # "static": the `pods` list; "kubernetes": the pool's EndpointSlices, watched
    namespace: str | None = None  # kubernetes: where the slices live; None: the kubeconfig's or the pod's own
    label_selector: str | None = None  # kubernetes: which slices; None: see endpoint_selector()
    kubeconfig: str | None = None  # kubernetes: a kubeconfig file; None: the in-cluster service account
    model: str | None = None  # where the pool's tokenizer lives (HF dir or .gguf); None: the bundled model
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_algo: str = HashAlgo.XXH3.value
    hash_root: int = DEFAULT_HASH_ROOT
    scrape_interval_seconds: float = 0.25  # how often each pod's /metrics and /health are read
    stale_after_seconds: float = 2.0  # a pod whose metrics are older than this is not routed to
    provisional_ttl_seconds: float = 5.0  # how long the router trusts its own routing before events confirm it
    max_hashed_tokens: int = 32768  # the router hashes at most this many leading prompt tokens
    retries: int = 2  # other pods tried when one answers 429/503 or fails before its first byte
    prefill_hop_min_tokens: int = 256  # in a disaggregated pool, shorter uncached prompts skip the prefill pod
    pull_bytes_per_second: float = 150e6  # pod-to-pod KV pull speed the pull-or-recompute choice assumes; 0: never
    pull_setup_seconds: float = 0.02  # a pull's fixed cost before its first byte
    ttft_slo_seconds: float | None = None  # the pool's TTFT SLO: past it, requests are shed by priority (429)
    shed_overload_probability: float = 0.9  # shed when the best pod's KV forecast says it runs out this likely
    priority_headroom: float = 0.5  # each priority level tolerates this much more overload before it is shed
    request_timeout_seconds: float = 600.0
    # a completion's whole body must arrive within this long, or it is answered 408 and closed (slowloris)
    body_read_timeout_seconds: float = DEFAULT_BODY_READ_TIMEOUT_SECONDS
    # a request that finds no pod ready (none at all, not all busy) waits up to this long for one (a pool starting
    # from zero: the operator sets it for scaling.scaleToZero); 0: 503 at once
    hold_without_pods_seconds: float = 0.0
    max_held_requests: int = MAX_HELD_REQUESTS  # held at once at most; past it 503 at once
    # connections the router keeps open to one pod at most; past it a request waits for one (router/proxy.py)
    max_connections_per_pod: int = MAX_CONNECTIONS_PER_POD
    api_keys_file: str | None = None
    cache_salt_secret: str | None = None  # keys the tenants' cache salts; every replica needs the same (a Secret)
    database_url: str | None = None  # the request log (SQLite locally, PostgreSQL in Kubernetes)
    request_log_retention_days: float = 30.0  # rows of the request log older than this are deleted (0: kept)
    # per-tenant limits and weights by tenant name, `default` for tenants without an entry (router/limits.py)
    tenants: dict[str, Any] = field(default_factory=dict)
    rate_limit_replicas: int = 1  # each replica enforces the tenants' limits divided by this (1: each the whole)
    # with database_url: the replicas split each tenant's limits by where its requests arrive (router/limit_sync.py),
    # instead of by rate_limit_replicas
    rate_limit_sync: bool = True
    # the fraction of each of a tenant's limits its Batch API requests get, in buckets of their own: a batch never
    # spends the limits of the tenant's interactive requests (router/limits.py)
    batch_rate_share: float = BATCH_RATE_SHARE
    # picker weights and thresholds by name (picker.PickerConfig's fields; tier_weights a mapping of tier to weight)
    weights: dict[str, Any] = field(default_factory=dict)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL (engine/tracing.py); None: the OTEL_* env
    # the Batch API (router/batch_runner.py; needs database_url): requests of a batch in flight from one replica,
    # requests per input file, an input file's size, and the priority batch requests are sent at (shed first)
    batch_concurrency: int = BatchSettings.concurrency
    batch_max_requests: int = BatchSettings.max_requests
    batch_max_file_bytes: int = MAX_FILE_BYTES
    # requests a tenant's validating and in-progress batches hold at most: POST /v1/batches past it is a 429
    batch_max_enqueued_requests: int = MAX_ENQUEUED_REQUESTS
    # files (uploads, and batches' output and error files) and their bytes one tenant stores at most: an upload past
    # either is a 400; and uploads this replica reads at once, shared fairly by the tenants (batch_api.UploadSlots;
    # none free within UPLOAD_WAIT_SECONDS: a 429, Retry-After 1 s)
    batch_max_stored_files: int = MAX_STORED_FILES
    batch_max_stored_bytes: int = MAX_STORED_BYTES
    batch_max_concurrent_uploads: int = MAX_CONCURRENT_UPLOADS
    batch_priority: int = BATCH_PRIORITY
    batch_order: str = BatchSettings.order  # prefix: requests sharing a prompt prefix sent together; file: as written
    # the Responses API's stored responses (router/responses_store.py): kept this long in the pool's database, or,
    # without one, this many newest per replica in memory
    responses_ttl_seconds: int = RESPONSES_TTL_SECONDS
    responses_memory_items: int = RESPONSES_MEMORY_ITEMS

    def endpoint_selector(self) -> str:
        """The label selector of the pool's engine EndpointSlices. Slices inherit their Service's labels; the
        role clause keeps a router Service labelled with the pool (if there is one) from listing the router."""
        return self.label_selector or f"{POOL_LABEL}={self.pool},{ROLE_LABEL}!=router"

    def validate(self) -> None:
        check_types(self, "router")
        if self.discovery not in DISCOVERY_MODES:
            raise ValueError(f"discovery {self.discovery!r} is not one of {', '.join(DISCOVERY_MODES)}")
        if self.discovery == "kubernetes":
            if self.pods or self.pods_file:
                raise ValueError("with `discovery: kubernetes` the pods come from EndpointSlices: list no pods")
        elif self.pods_file is not None:
            if self.pods:
                raise ValueError("with `pods_file` the pods come from that file: list no pods")
        elif not self.pods:
            raise ValueError("the router needs at least one pod (--pod URL, or `pods:` or `pods_file:` in the config)")
        for url in self.pods:
            check_http_url(url, "pod")
        HashAlgo(self.hash_algo)
        check_port(self.port)
        if self.scrape_interval_seconds <= 0:  # 0 scraped in a busy loop: a whole core, idle
            raise ValueError(f"scrape_interval_seconds must be positive, got {self.scrape_interval_seconds}")
        if self.otlp_traces_endpoint:
            check_endpoint(self.otlp_traces_endpoint)
        if self.ext_proc_port is not None and not (0 < self.ext_proc_port < 65536 and self.ext_proc_port != self.port):
            raise ValueError(f"ext_proc_port {self.ext_proc_port} must be a TCP port (1-65535) other than the "
                             f"HTTP port {self.port}")
        if not isinstance(self.ext_proc_tls, bool):
            raise ValueError(f"ext_proc_tls must be true or false, not {self.ext_proc_tls!r}")
        if self.ext_proc_cert_dir is not None:
            if not self.ext_proc_tls:
                raise ValueError("ext_proc_cert_dir holds a TLS certificate but ext_proc_tls is false (plaintext): "
                                 "drop one of the two")
            files = (EXT_PROC_CERT_FILE, EXT_PROC_KEY_FILE)
            missing = [name for name in files if not (Path(self.ext_proc_cert_dir) / name).is_file()]
            if missing:
                raise ValueError(f"ext_proc_cert_dir {self.ext_proc_cert_dir!r} has no {' and no '.join(missing)}: "
                                 f"it must hold {' and '.join(files)} (e.g. a kubernetes.io/tls Secret, mounted)")
            read_certificate_pair(self.ext_proc_cert_dir)
        if not (isinstance(self.request_log_retention_days, int | float) and self.request_log_retention_days >= 0):
            raise ValueError(f"request_log_retention_days must be a number of days, at least 0 (0: keep every row), "
                             f"not {self.request_log_retention_days!r}")
        PickerConfig.from_weights(self.weights)  # an unknown key or a bad value: named here, not a crash at start
        # bad limits: an error at start, not later
        Limiter(parse_tenants(self.tenants), self.rate_limit_replicas, batch_share=self.batch_rate_share)
        self.batch_settings()
        Upstream(self.request_timeout_seconds, self.max_connections_per_pod)  # a bad bound: an error at start
        check_body_read_timeout(self.body_read_timeout_seconds)
        if self.batch_max_file_bytes < 1:
            raise ValueError(f"batch_max_file_bytes must be at least 1, not {self.batch_max_file_bytes}")
        for name in ("batch_max_enqueued_requests", "batch_max_stored_files", "batch_max_stored_bytes",
                     "batch_max_concurrent_uploads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 0 <= self.hold_without_pods_seconds <= MAX_HOLD_SECONDS:
            raise ValueError(f"hold_without_pods_seconds must be in [0, {MAX_HOLD_SECONDS}], not "
                             f"{self.hold_without_pods_seconds}")
        for name in ("responses_ttl_seconds", "responses_memory_items", "max_held_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")

    def file_quota(self) -> FileQuota:
        return FileQuota(self.batch_max_stored_files, self.batch_max_stored_bytes)

    def batch_settings(self) -> BatchSettings:
        return BatchSettings(concurrency=self.batch_concurrency, max_requests=self.batch_max_requests,
                             order=self.batch_order)


def read_certificate_pair(cert_dir: str) -> tuple[bytes, bytes]:
    """(key, certificate chain), PEM, from cert_dir's tls.key and tls.crt; ValueError saying what is wrong."""
    from cryptography import x509  # imported here: only routers that serve ext_proc with a mounted pair need it
    from cryptography.hazmat.primitives import serialization

    folder = Path(cert_dir)
    key_pem, chain_pem = (folder / EXT_PROC_KEY_FILE).read_bytes(), (folder / EXT_PROC_CERT_FILE).read_bytes()
    try:
        certificate = x509.load_pem_x509_certificate(chain_pem)  # the first of the chain is the server's own
    except ValueError:
        raise ValueError(f"{folder / EXT_PROC_CERT_FILE} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):  # TypeError: an encrypted key
        raise ValueError(f"{folder / EXT_PROC_KEY_FILE} is not an unencrypted PEM private key") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != certificate.public_key().public_bytes(*spki):
        raise ValueError(f"{folder / EXT_PROC_KEY_FILE} is not the key of {folder / EXT_PROC_CERT_FILE}")
    return key_pem, chain_pem


def load_router_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """Defaults, then the file's `router` section (or the whole file), then the flags that were given."""
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    values: dict[str, Any] = {}

    def take(raw: dict[str, Any]) -> None:
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown router setting {key!r}; known: {', '.join(sorted(names))}")
            values[name] = value

    if path is not None:
        data = read_settings_file(path) or {}
        section = data.get("router", data) if isinstance(data, dict) else None
        if not isinstance(section, dict):
            raise ValueError(f"{path}: expected a mapping with a `router` section")
        take(section)
    take({k: v for k, v in (overrides or {}).items() if v is not None and v != []})
    config = RouterConfig(**values)
    config.validate()
    return config
