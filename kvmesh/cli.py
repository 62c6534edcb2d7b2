"""The one `kvmesh` command: `serve` (an engine), `router`, `gateway` (one endpoint for many pools), `up` (a local
pool), `chat`, `status`, `bench`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kvmesh import __version__
from kvmesh.engine.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_MAX_NUM_SEQS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
)
from kvmesh.processes import LOG_LEVELS, bind_problem

if TYPE_CHECKING:
    from kvmesh.operator.leader import Election
    from kvmesh.up import PoolPlan


def _port(text: str) -> int:
    """argparse's type for a TCP port (a number past 65535 wrapped silently into another port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help says each flag's default (review: it said few), unless its help already does or there is none to
    say (None: the config file's or the program's, which the help then states)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default in (None, False, [], argparse.SUPPRESS)
                or action.help == argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class _SubcommandParser(argparse.ArgumentParser):
    """The parser of each subcommand, `bench`'s own among them: --help says every flag's default, that of a flag
    with no help text too (argparse shows nothing at all for such a flag)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"formatter_class": _DefaultsFormatter, **kwargs})

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.help is None and action.option_strings and action.default not in (None, False, []):
            action.help = "default: %(default)s"
        return action


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run an engine: the OpenAI API for one model")
    p.add_argument("--config", help="YAML file with an `engine` section (flags override it)")
    p.add_argument("--model", help="HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name",
                   help="the name clients give as `model` (default: the model directory's or file's name)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, help="port (default 8000)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' and activations' dtype (default auto: bfloat16 on CUDA and on CPUs with bf16 "
                        "units, else float32)")
    p.add_argument("--device", help="auto, cpu or cuda")
    p.add_argument("--quantization", choices=QUANTIZATIONS, help="int8: int8 weights and activations (CPU)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="auto (default): the model's dtype; int8: a scale per token and head, about 2x the blocks")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                   help="auto (default): the Triton kernels on CUDA, torch on CPU")
    p.add_argument("--block-size", type=int,
                   help=f"tokens per KV cache block, the prefix cache's unit (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--kv-cache-memory-mib", type=int, help="device KV cache budget in MiB (default 512)")
    p.add_argument("--max-num-seqs", type=int,
                   help=f"sequences batched in one step at most (default {DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (chunked prefill)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False)
    p.add_argument("--eviction-policy", choices=["lru", "reuse"], help="lru (default) or reuse: by reuse probability")
    p.add_argument("--queue-policy", choices=["fcfs", "prefix"], help="fcfs (default) or prefix: longest cached first")
    p.add_argument("--max-queue-delay-seconds", type=float, help="prefix queue: the most a request is passed over")
    p.add_argument("--hash-algo", choices=["xxh3_64", "sha256_cbor_64bit"])
    p.add_argument("--role", choices=["prefill", "decode", "both"],
                   help="disaggregated serving: prefill only, decode only (pulling the KV from a prefill engine), "
                        "or both (default)")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--kv-host-memory-mib", type=float, help="host KV tier in shared memory (default 0: off)")
    p.add_argument("--kv-host-path", help="the host tier's file (default /dev/shm/kvmesh-kv-host-<port>.kv)")
    p.add_argument("--kv-disk-mib", type=float, help="disk KV tier (default 0: off)")
    p.add_argument("--kv-disk-path", help="the disk tier's file (default ~/.cache/kvmesh/kv-disk-<port>.kv)")
    p.add_argument("--kv-tier-chunk-blocks", type=int, help="blocks per copy between tiers (default 16)")
    p.add_argument("--kv-tier-cost-profile", help="load-or-recompute costs: measured (default), gpu or cpu")
    p.add_argument("--warmup-grace-seconds", type=float,
                   help="stay unready (/health: warming) after loading until warmed or this long (default 0: off)")
    p.add_argument("--stall-timeout-seconds", type=float,
                   help="a step running longer is a stalled engine: /health and /livez answer 503 (default 60; 0: off)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve under these model names")
    p.add_argument("--max-lora-rank", type=int, help=f"the largest LoRA rank loaded (default {DEFAULT_MAX_LORA_RANK})")
    p.add_argument("--max-loras", type=int, help=f"LoRA adapters loaded at once (default {DEFAULT_MAX_LORAS})")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (default: off)')
    p.add_argument("--otlp-traces-endpoint",
                   help="export OpenTelemetry traces over OTLP/HTTP here, e.g. http://collector:4318/v1/traces "
                        "(default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; unset: no tracing)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="the least severe log lines shown")


INTERRUPTED_DURING_LOAD = 130  # as a shell reports a Ctrl-C


def _serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from kvmesh.engine.config import EngineConfig, load_config
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.internal_token import InternalToken
    from kvmesh.engine.server import EngineHolder, create_app
    from kvmesh.engine.tracing import ENGINE_SERVICE, setup_tracing

    try:
        flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineConfig)}
        config = load_config(args.config, flags)
        tracing = setup_tracing(ENGINE_SERVICE, config.otlp_traces_endpoint)
    except (OSError, ValueError) as exc:
        print(f"kvmesh serve: {exc}", file=sys.stderr)
        return 2
    try:  # before the model loads: a file that cannot be read was a traceback with the loader running
        token = InternalToken.from_env()
    except (OSError, ValueError) as exc:
        print(f"kvmesh serve: {exc}", file=sys.stderr)
        return 2
    # before the model loads in a thread of its own: a taken port stopped the process in the middle of torch's
    # work there, which aborted it (SIGABRT) instead of saying why
    if (problem := bind_problem(config.port, config.host)) is not None:
        print(f"kvmesh serve: cannot listen on {config.host}:{config.port}: {problem}", file=sys.stderr)
        return 2
    if config.threads:
        torch.set_num_threads(config.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    holder = EngineHolder(loader=lambda: Engine(config))
    loading = holder.load_in_background()

    def on_exit() -> None:
        if holder.engine is not None:
            holder.engine.close()  # also syncs and unlocks the KV tier files
        tracing.shutdown()  # the last batch of spans

    uvicorn.run(create_app(holder, tracing, on_exit, token), host=config.host, port=config.port,
                log_level=args.log_level)
    if loading.is_alive():  # stopped (Ctrl-C) while the model loads: the interpreter's own exit would abort
        print("kvmesh serve: stopped while the model was loading", file=sys.stderr)  # the loader inside torch
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED_DURING_LOAD)
    return 0


def _router_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run a router: one OpenAI endpoint in front of engines")
    p.add_argument("--config", help="YAML file with a `router` section (flags override it)")
    p.add_argument("--pod", dest="pods", action="append", default=[], help="an engine's base URL (repeatable)")
    p.add_argument("--model", help="HF directory or .gguf holding the pool's tokenizer (default: the bundled model)")
    p.add_argument("--host")
    p.add_argument("--port", type=_port, help="port (default 8080)")
    p.add_argument("--ext-proc-port", type=_port,
                   help="also serve Envoy ext_proc (gRPC) here, as a Gateway API Inference Extension endpoint picker")
    p.add_argument("--ext-proc-plaintext", dest="ext_proc_tls", action="store_false", default=None,
                   help="serve ext_proc without TLS (a gateway configured for h2c); default: TLS")
    p.add_argument("--ext-proc-cert-dir",
                   help="directory with tls.crt and tls.key for ext_proc's TLS (default: a self-signed certificate)")
    p.add_argument("--pool", help="the pool's name (for the request log)")
    p.add_argument("--database-url", help="the request log and the Batch API's store, e.g. sqlite:///pool.db")
    p.add_argument("--api-keys-file", help="YAML of tenants and sha256 key hashes; no file: no auth")
    p.add_argument("--otlp-traces-endpoint",
                   help="export OpenTelemetry traces over OTLP/HTTP here, e.g. http://collector:4318/v1/traces "
                        "(default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; unset: no tracing)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="the least severe log lines shown")


def _router(args: argparse.Namespace) -> int:
    from kvmesh.engine.model.loader import resolve_model_dir
    from kvmesh.router.app import build_router, run_router
    from kvmesh.router.config import RouterConfig, load_router_config

    try:
        flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(RouterConfig)}
        config = load_router_config(args.config, flags)
        for port in (config.port, config.ext_proc_port):  # taken: one line, not a traceback from the lifespan
            if port is not None and (problem := bind_problem(port, config.host)) is not None:
                raise ValueError(f"cannot listen on {config.host}:{port}: {problem}")
        router = build_router(config, resolve_model_dir(config.model))
    except (OSError, ValueError, TypeError) as exc:  # TypeError: an unknown picker weight
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_router(router, log_level=args.log_level)  # drains both edges at SIGTERM or SIGINT, then returns
    return 0


def _gateway_parser(sub: argparse._SubParsersAction) -> None:
    from kvmesh.engine.body_deadline import DEFAULT_BODY_READ_TIMEOUT_SECONDS
    from kvmesh.router.gateway import (
        API_KEY_ENV,
        DEFAULT_MAX_FAILURES,
        DEFAULT_PORT,
        DEFAULT_REFRESH_SECONDS,
        DEFAULT_WEIGHT,
        MAX_WEIGHT,
    )

    p = sub.add_parser("gateway", help="run a gateway: one OpenAI endpoint for every pool's router, by model name",
                       epilog=f"${API_KEY_ENV}: an API key shown to routers that ask one for /v1/models, unless "
                              "--api-key-file is given")
    found = p.add_mutually_exclusive_group(required=True)
    found.add_argument("--router", dest="routers", action="append", default=[],
                       help="a pool router's base URL (repeatable)")
    found.add_argument("--kubernetes", action="store_true",
                       help="the routers of the InferencePools in --namespace (default: every namespace)")
    p.add_argument("--router-weight", dest="router_weights", action="append", default=[], metavar="URL=WEIGHT",
                   help=f"with --router: that router's share of the requests for a model several routers list, "
                        f"0 to {MAX_WEIGHT} (default {DEFAULT_WEIGHT}; 0 drains it); repeatable")
    p.add_argument("--namespace", help="with --kubernetes: list the pools of this namespace only")
    p.add_argument("--kubeconfig", help="with --kubernetes: a kubeconfig file (default: the pod's service account)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--refresh-seconds", type=float, default=DEFAULT_REFRESH_SECONDS,
                   help=f"how often the routers are found and their /v1/models read (default "
                        f"{DEFAULT_REFRESH_SECONDS:g})")
    p.add_argument("--max-failures", type=int, default=DEFAULT_MAX_FAILURES,
                   help=f"a router that missed this many refreshes in a row leaves the model table (default "
                        f"{DEFAULT_MAX_FAILURES})")
    p.add_argument("--api-key-file", metavar="PATH",
                   help="a file holding the API key shown to routers that ask one for /v1/models, re-read at every "
                        "refresh (a rotated Secret is used without a restart); missing or empty: no key")
    p.add_argument("--body-read-timeout-seconds", type=float, default=DEFAULT_BODY_READ_TIMEOUT_SECONDS,
                   help=f"a request's whole body must arrive within this long, or it is answered 408 and its "
                        f"connection closed (default {DEFAULT_BODY_READ_TIMEOUT_SECONDS:g}, as the router's)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="the least severe log lines shown")


def _gateway(args: argparse.Namespace) -> int:
    from kvmesh.engine.body_deadline import check_body_read_timeout
    from kvmesh.operator.crd import GROUP, PLURAL, VERSION
    from kvmesh.router.discovery import kube_configuration
    from kvmesh.router.gateway_app import ApiKeyFile, Discover, Gateway, PoolDiscovery, api_key_from_env, run_gateway
    from kvmesh.router.gateway_app import static_routers as static

    if args.refresh_seconds <= 0 or args.max_failures < 1:
        print("kvmesh gateway: --refresh-seconds must be positive and --max-failures at least 1", file=sys.stderr)
        return 2
    try:
        check_body_read_timeout(args.body_read_timeout_seconds)
    except ValueError as exc:
        print(f"kvmesh gateway: {exc}", file=sys.stderr)
        return 2
    if args.kubernetes and args.router_weights:
        print("kvmesh gateway: --router-weight is for --router; with --kubernetes each pool's spec.gateway.weight "
              "is its weight", file=sys.stderr)
        return 2
    try:
        discover: Discover = static(args.routers, args.router_weights)
    except ValueError as exc:
        print(f"kvmesh gateway: {exc}", file=sys.stderr)
        return 2
    if args.kubernetes:
        try:
            discover = PoolDiscovery(kube_configuration(args.kubeconfig), (GROUP, VERSION, PLURAL), args.namespace)
        except ValueError as exc:  # no kubeconfig and not in a cluster
            print(f"kvmesh gateway: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key_file = ApiKeyFile(args.api_key_file) if args.api_key_file else None
    gateway = Gateway(discover, args.refresh_seconds, args.max_failures, api_key_from_env(), key_file,
                      body_read_timeout_seconds=args.body_read_timeout_seconds)
    run_gateway(gateway, args.host, args.port, args.log_level)
    return 0


def _up_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local pool: engines and a router as processes")
    p.add_argument("-f", "--file", help="an InferencePool YAML file")
    p.add_argument("--engines", type=int, help="number of engines (default 2)")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled model)")
    p.add_argument("--port", type=int, default=8080, help="the router's port (default 8080)")
    p.add_argument("--ready-file",
                   help="write the endpoint here once every process is healthy (removed when the pool stops)")
    p.add_argument("--targets-file", help="write Prometheus file_sd targets for every process here (JSON)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the work folder (the processes' logs, the router's SQLite database) after a clean stop; "
                        "it is always kept when the pool fails")
    p.add_argument("--state-dir",
                   help="where the pool's work folder goes (default $KVMESH_STATE_DIR, else $XDG_STATE_HOME/kvmesh, "
                        "else ~/.local/state/kvmesh: out of reach of /tmp cleaners)")
    from kvmesh.bench.sim_engine import PROFILES

    p.add_argument("--sim", nargs="?", const="cpu-smollm", choices=sorted(PROFILES),
                   help="simulated engines (kvmesh sim-engine) of this profile (default cpu-smollm): no model runs")


def _up(args: argparse.Namespace) -> int:
    """Everything a user can get wrong is checked here, before a model is converted or a process started: one line
    and exit status 2."""
    if args.ready_file:  # before the imports below (seconds): a killed run's would say "ready" meanwhile
        with contextlib.suppress(OSError):  # a folder that does not exist: refused below
            Path(args.ready_file).unlink(missing_ok=True)
    from kvmesh.up import PoolPlan, plan_from_file, run_pool, startup_problem, state_dir

    def refuse(problem: str) -> int:
        print(f"kvmesh up: {problem}", file=sys.stderr)
        return 2

    if not 1 <= args.port <= 65535:
        return refuse(f"--port {args.port}: a port is a number from 1 to 65535")
    try:
        plan = plan_from_file(args.file) if args.file else PoolPlan()
    except (OSError, ValueError) as exc:
        return refuse(str(exc))
    if args.engines is not None:
        if problem := _engines_problem(plan, args.engines, args.file):
            return refuse(problem)
        plan.engines = args.engines
    if args.sim:  # simulated engines load no weights: the bundled tokenizer indexes their prompts
        if args.model:
            return refuse("simulated engines use the bundled tokenizer; give no --model with --sim")
        if plan.model:
            return refuse(f"with --sim the pool file's model.source must be bundled (the simulated engines load no "
                          f"weights); {args.file} names {plan.model}")
    if args.model:
        plan.model = args.model
    if args.sim:
        plan.sim = args.sim
    state = Path(args.state_dir).expanduser() if args.state_dir else state_dir()
    if problem := startup_problem(plan, args.port, args.ready_file, args.targets_file, state):
        return refuse(problem)
    return run_pool(plan, args.port, args.ready_file, args.targets_file, keep_logs=args.keep_logs, state=state)


def _engines_problem(plan: PoolPlan, engines: int, file: str | None) -> str | None:
    """Why `--engines` cannot set this pool's engines, or None. A disaggregated pool's engines are its roles'
    replicas (prefill and decode), which one number cannot say; a pool file's number must lie within its replicas,
    or its scaler would at once scale the pool back inside them."""
    if engines < 1:
        return "--engines must be at least 1"
    pool = plan.pool
    if pool is None:
        return None
    if pool.mode == "disaggregated":
        return (f"--engines does not apply to a disaggregated pool ({file} runs prefill and decode engines): edit "
                f"spec.replicas in the file instead")
    low, high = pool.bounds("both")
    if not max(low, 1) <= engines <= high:
        return (f"--engines {engines} is outside {file}'s replicas ({low}..{high}): give a number within them, or "
                f"edit spec.replicas")
    return None


def _operator_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator: InferencePools into engines and routers")
    p.add_argument("--kubeconfig", help="a kubeconfig file (default: the in-cluster service account)")
    p.add_argument("-n", "--namespace", dest="namespaces", action="append", default=[],
                   help="watch pools in this namespace (repeatable; default: every namespace)")
    p.add_argument("--tick-seconds", type=float, default=5.0,
                   help="how often each pool's scaler wakes (its spec's intervalSeconds decides when it acts)")
    p.add_argument("--metrics-port", type=_port, help="serve the operator's Prometheus metrics on this port")
    p.add_argument("--health-port", type=_port, help="serve a liveness probe at /healthz on this port")
    p.add_argument("--render-crd", action="store_true", help="print the InferencePool CRD and exit")
    from kvmesh.bench.args import positive_int
    from kvmesh.operator.leader import DEFAULT_LEASE_NAME, Timing

    p.add_argument("--workers", type=positive_int, metavar="THREADS",
                   help="how many pools' handlers (scaling ticks, reconciles) run at once, each in a thread that "
                        "mostly waits on the API server and the pods (default and sizing: docs/operator.md)")

    timing = Timing()
    p.add_argument("--leader-elect", action="store_true",
                   help="reconcile only while holding a Lease, so that replicas stand by (identity: POD_NAME)")
    p.add_argument("--leader-elect-lease-name", default=DEFAULT_LEASE_NAME, help="the Lease's name")
    p.add_argument("--leader-elect-namespace",
                   help="the Lease's namespace (default: POD_NAMESPACE, else the kubeconfig's namespace)")
    p.add_argument("--leader-elect-lease-duration", type=int, default=timing.lease_seconds, metavar="SECONDS",
                   help=f"how long a standby waits for a silent leader (default {timing.lease_seconds})")
    p.add_argument("--leader-elect-renew-deadline", type=float, default=timing.renew_deadline_seconds,
                   metavar="SECONDS", help="a leader that cannot renew for this long exits "
                   f"(default {timing.renew_deadline_seconds:g})")
    p.add_argument("--leader-elect-retry-period", type=float, default=timing.retry_seconds, metavar="SECONDS",
                   help=f"how often candidates try and leaders renew (default {timing.retry_seconds:g})")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="the least severe log lines shown")


def _election(args: argparse.Namespace) -> Election | None:
    """The --leader-elect flags as an Election; ValueError for durations that would let two leaders overlap."""
    from kvmesh.operator.leader import Election, Timing
    from kvmesh.router.discovery import default_namespace

    if not args.leader_elect:
        return None
    timing = Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                    args.leader_elect_retry_period)
    timing.check()
    namespace = args.leader_elect_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace:
        namespace = default_namespace(args.kubeconfig)  # ValueError for a kubeconfig that cannot be used
    return Election(namespace, args.leader_elect_lease_name, timing=timing)


def _operator(args: argparse.Namespace) -> int:
    if args.render_crd:
        from kvmesh.operator.crd import render_crd

        print(render_crd(), end="")
        return 0
    if args.tick_seconds <= 0:
        print("kvmesh operator: --tick-seconds must be positive", file=sys.stderr)
        return 2
    for flag, port in (("--metrics-port", args.metrics_port), ("--health-port", args.health_port)):
        if port is not None and (problem := bind_problem(port, "0.0.0.0")) is not None:  # one line, not a traceback
            print(f"kvmesh operator: {flag} {port}: {problem}", file=sys.stderr)
            return 2
    from kvmesh.operator.handlers import OperatorConfig, run

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(OperatorConfig(kubeconfig=args.kubeconfig, namespaces=tuple(args.namespaces),
                           tick_seconds=args.tick_seconds, metrics_port=args.metrics_port,
                           health_port=args.health_port, election=_election(args),
                           **({"workers": args.workers} if args.workers is not None else {})))
    except ValueError as exc:  # no kubeconfig and not in a cluster; election durations that overlap leaders
        print(f"kvmesh operator: {exc}", file=sys.stderr)
        return 2
    return 0


API_KEY_ENV = "KVMESH_API_KEY"  # `kvmesh chat`'s and `kvmesh status`'s key for a router with API keys
API_KEY_HELP = f"an API key of the router's, for a router with API keys (default: ${API_KEY_ENV})"


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    from kvmesh.bench.args import positive_int

    p = sub.add_parser("chat", help="send one chat message to an OpenAI-compatible endpoint and print the answer",
                       epilog=f"${API_KEY_ENV}: the API key sent, unless --api-key is given")
    p.add_argument("message")
    p.add_argument("--url", default="http://127.0.0.1:8080",
                   help="the endpoint's base URL, with or without /v1 (default: kvmesh up's router; an engine "
                        "of its own listens on :8000)")
    p.add_argument("--api-key", help=API_KEY_HELP)
    p.add_argument("--max-tokens", type=positive_int, default=64, help="the answer's length at most, in tokens")
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the endpoint to become healthy and answer (a 503 is asked again)")


CHAT_QUIET_SECONDS = 3.0  # `kvmesh chat` waits this long for /health before it says what it waits for


def api_key_headers(key: str | None) -> dict[str, str]:
    """The header carrying `key` (--api-key), else $KVMESH_API_KEY, else none."""
    key = key or os.environ.get(API_KEY_ENV)
    return {"authorization": f"Bearer {key}"} if key else {}


def checked_base_url(url: str) -> str:
    """The server's base URL from what the user gave (the --url of `kvmesh chat`, `status`, `bench serve`): the
    OpenAI base URL (`.../v1`, what `kvmesh up` prints and clients are configured with) as well as the server's.
    ValueError, saying what to fix, for a URL no retry makes work: no http(s) scheme, a port that is not a
    number."""
    import httpx

    from kvmesh.bench.serve import base_url

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url}: give the scheme too, e.g. http://{url}")
    try:
        httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"--url {url}: {exc}") from None
    return base_url(url)


def _chat(args: argparse.Namespace) -> int:
    """Wait for the endpoint (a pool may still be starting: connection refused and 503 are asked again, and said
    after a few seconds), ask once, print the answer. What no wait fixes fails at once: no scheme, a server that
    has no /health (404: not a kvmesh endpoint, or a wrong path); what breaks during the question is one line."""
    import time

    import httpx

    from kvmesh.bench.serve import user_http_client

    def fail(problem: str, code: int = 1) -> int:
        print(f"kvmesh chat: {problem}", file=sys.stderr)
        return code

    try:
        base = checked_base_url(args.url)
    except ValueError as exc:
        return fail(str(exc), 2)
    started = time.monotonic()
    deadline, said = started + args.wait, False
    with httpx.Client(base_url=base, timeout=300, headers=api_key_headers(args.api_key),
                      **user_http_client(base)) as client:
        while True:
            try:
                status = client.get("/health", timeout=10).status_code
            except httpx.UnsupportedProtocol as exc:
                return fail(f"--url {args.url}: {exc}", 2)
            except httpx.TransportError:
                status = None
            if status == 200:
                break
            if status == 404:
                return fail(f"{base}/health answered 404: is {args.url} a kvmesh router or engine?")
            if time.monotonic() > deadline:
                return fail(f"{base} did not become healthy in {args.wait:.0f} s")
            if not said and time.monotonic() - started >= CHAT_QUIET_SECONDS:
                why = "it does not answer" if status is None else f"/health answers {status}"
                print(f"kvmesh chat: waiting for {base} to become healthy ({why}; up to {args.wait:.0f} s) ...",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)
        body = {"messages": [{"role": "user", "content": args.message}], "max_tokens": args.max_tokens,
                "temperature": 0}
        try:
            reply = client.post("/v1/chat/completions", json=body)
            # another router replica may not see an engine yet (or its pool is starting from zero): ask again
            while reply.status_code == 503 and time.monotonic() < deadline:
                time.sleep(1.0)
                reply = client.post("/v1/chat/completions", json=body)
        except httpx.TransportError as exc:  # the connection broke, or no answer within the timeout
            return fail(f"{base} did not answer the question: {exc or type(exc).__name__}")
        if reply.status_code != 200:
            return fail(f"HTTP {reply.status_code}: {reply.text}")
        try:
            answer = reply.json()
            content = answer["choices"][0]["message"]["content"]
            usage = answer["usage"]
            counts = (f"[{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} completion tokens, "
                      f"{(usage.get('prompt_tokens_details') or {}).get('cached_tokens', 0)} cached]")
        except (ValueError, LookupError, TypeError):
            return fail(f"the answer is not a chat completion: {reply.text[:200]!r}")
        print(content)
        print(counts, file=sys.stderr)
    return 0


def _status_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="a router's pods: state, load, KV use and forecast, the cached blocks it indexes",
                       epilog=f"${API_KEY_ENV}: the API key sent, unless --api-key is given (a router with API keys "
                              "shows its pool to a tenant with read_pool_status: true only)")
    p.add_argument("--url", default="http://127.0.0.1:8080",
                   help="the router's base URL, with or without /v1 (default: kvmesh up's)")
    p.add_argument("--api-key", help=API_KEY_HELP)
    p.add_argument("--json", action="store_true", help="print the router's document (GET /kvmesh/pool) as it is")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="print it again every SECONDS until Ctrl-C")


def _status(args: argparse.Namespace) -> int:
    from kvmesh.status import run

    try:
        args.url = checked_base_url(args.url)
    except ValueError as exc:
        print(f"kvmesh status: {exc}", file=sys.stderr)
        return 2
    return run(args)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvmesh.bench.args import positive_int, positive_ints

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True, parser_class=_SubcommandParser)
    e = bench.add_parser("engine", help="engine throughput and prefix-cache TTFT, beside transformers' generate")
    e.add_argument("--concurrency", type=positive_ints, default="1,8,32", help="comma-separated request counts")
    e.add_argument("--prompt-tokens", type=int, default=128)
    e.add_argument("--output-tokens", type=int, default=128)
    e.add_argument("--prefix-tokens", type=int, default=2000)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="the engine's quantization; the transformers baseline gets the same (dynamic int8)")
    e.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    e.add_argument("--rounds", type=positive_int, default=3,
                   help="turns of the engine and transformers at the top concurrency; the ratio is their median")
    e.add_argument("--json", help="write the results here as JSON")
    k = bench.add_parser("kernels", help="Triton kernels: correctness, decode GB/s beside copy bandwidth and SDPA")
    from kvmesh.engine.kernels.bench import add_arguments as add_kernel_bench_arguments

    add_kernel_bench_arguments(k)
    from kvmesh.bench.router import add_parser as add_router_bench

    add_router_bench(bench)
    from kvmesh.bench.transfer import add_parser as add_transfer_bench

    add_transfer_bench(bench)
    from kvmesh.bench.routing import add_parser as add_cluster_bench

    add_cluster_bench(bench)
    from kvmesh.bench.disagg import add_parser as add_disagg_bench

    add_disagg_bench(bench)
    from kvmesh.bench.autoscale import add_parser as add_autoscale_bench

    add_autoscale_bench(bench)
    from kvmesh.bench.serve import add_parser as add_serve_bench

    add_serve_bench(bench)
    from kvmesh.bench.eviction import add_parser as add_eviction_bench

    add_eviction_bench(bench)
    from kvmesh.bench.queue import add_parser as add_queue_bench

    add_queue_bench(bench)
    from kvmesh.bench.shines import add_parser as add_shines_bench

    add_shines_bench(bench)
    from kvmesh.bench.tiers import add_parser as add_tiers_bench

    add_tiers_bench(bench)
    from kvmesh.bench.kvcache import add_parser as add_kv_cache_bench

    add_kv_cache_bench(bench)
    from kvmesh.bench.lora import add_parser as add_lora_bench

    add_lora_bench(bench)
    from kvmesh.bench.structured import add_parser as add_structured_bench

    add_structured_bench(bench)
    from kvmesh.bench.spec import add_parser as add_spec_bench

    add_spec_bench(bench)
    from kvmesh.bench.batch import add_parser as add_batch_bench

    add_batch_bench(bench)


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "router":
        from kvmesh.bench.router import run as run_router_bench

        return run_router_bench(args)
    if args.bench == "batch":
        from kvmesh.bench.batch import run as run_batch_bench

        return run_batch_bench(args)
    if args.bench == "spec":
        from kvmesh.bench.spec import run as run_spec_bench

        return run_spec_bench(args)
    if args.bench == "structured":
        from kvmesh.bench.structured import run as run_structured_bench

        return run_structured_bench(args)
    if args.bench == "lora":
        from kvmesh.bench.lora import run as run_lora_bench

        return run_lora_bench(args)
    if args.bench == "kv-cache":
        from kvmesh.bench.kvcache import run as run_kv_cache_bench

        return run_kv_cache_bench(args)
    if args.bench == "tiers":
        from kvmesh.bench.tiers import run as run_tiers_bench

        return run_tiers_bench(args)
    if args.bench == "shines":
        from kvmesh.bench.shines import run as run_shines_bench

        return run_shines_bench(args)
    if args.bench == "eviction":
        from kvmesh.bench.eviction import run as run_eviction_bench

        return run_eviction_bench(args)
    if args.bench == "queue":
        from kvmesh.bench.queue import run as run_queue_bench

        return run_queue_bench(args)
    if args.bench == "serve":
        from kvmesh.bench.serve import run as run_serve_bench

        return run_serve_bench(args)
    if args.bench == "cluster":
        from kvmesh.bench.routing import run as run_cluster_bench

        return run_cluster_bench(args)
    if args.bench == "disagg":
        from kvmesh.bench.disagg import run as run_disagg_bench

        return run_disagg_bench(args)
    if args.bench == "autoscale":
        from kvmesh.bench.autoscale import run as run_autoscale_bench

        return run_autoscale_bench(args)
    if args.bench == "kernels":
        from kvmesh.engine.kernels.bench import run as run_kernel_bench

        return run_kernel_bench(args)
    if args.bench == "transfer":
        from kvmesh.bench.transfer import run as run_transfer_bench

        return run_transfer_bench(args)
    from kvmesh.bench.engine import run_engine_bench

    return run_engine_bench(args)


def _sim_engine(args: argparse.Namespace) -> int:
    from kvmesh.bench.sim_engine import run as run_sim_engine

    return run_sim_engine(args)


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> NoReturn:
    """Exit 2 through the parser of the subcommand given (its usage, not the top level's), with the closest flag it
    has for a mistyped one: `kvmesh up --prot 1` said only `kvmesh: error: unrecognized arguments`."""
    target = parser
    for name in ("command", "bench"):  # down the subcommands given: `kvmesh bench serve` has two
        chosen = getattr(args, name, None)
        actions = [a for a in target._actions if isinstance(a, argparse._SubParsersAction)]
        if chosen is None or not actions or chosen not in actions[0].choices:
            break
        target = actions[0].choices[chosen]
    flags = [flag for action in target._actions for flag in action.option_strings]
    mistyped = next((e.split("=", 1)[0] for e in extras if e.startswith("--")), None)
    close = difflib.get_close_matches(mistyped, flags, n=1) if mistyped else []
    target.error(f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {close[0]}?)" if close else ""))


def main(argv: Sequence[str] | None = None) -> int:
    """The `kvmesh` command. A Ctrl-C before a command has set up its own (while its modules load, a second or
    two) ends it with 130 and one line, not a KeyboardInterrupt traceback; a closed pipe on stdout ends it
    quietly."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("kvmesh: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # its reader went away (`kvmesh status --json | head`): what it wanted, it has
        devnull = os.open(os.devnull, os.O_WRONLY)  # else the exit's own flush of stdout fails again, and says so
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh", description="KV-cache-aware LLM serving")
    parser.add_argument("--version", action="version", version=f"kvmesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    _serve_parser(sub)
    _router_parser(sub)
    _gateway_parser(sub)
    _up_parser(sub)
    _operator_parser(sub)
    _chat_parser(sub)
    _status_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if next((a for a in argv if not a.startswith("-")), None) == "bench":
        _bench_parser(sub)
    else:  # the benchmarks' parsers load their modules (torch among them: a second and 150 MiB), for them only
        sub.add_parser("bench", help="benchmarks (`kvmesh bench --help` lists them)")
    from kvmesh.bench.sim_engine import add_parser as add_sim_engine

    add_sim_engine(sub)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
    handlers = {"serve": _serve, "router": _router, "gateway": _gateway, "up": _up, "operator": _operator,
                "chat": _chat, "status": _status, "bench": _bench, "sim-engine": _sim_engine}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
