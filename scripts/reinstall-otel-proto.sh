#!/bin/sh
# xds-protos (Envoy's ext_proc messages) ships an older copy of opentelemetry-proto's files at the same paths, and
# whichever package installs last wins: lay opentelemetry-proto down again, at the version installed, after every
# install that may bring xds-protos (the OTLP exporter needs its own). The Makefile and the Dockerfile both run it.
# Usage: reinstall-otel-proto.sh PYTHON [PIP-INSTALL-OPTION...]
set -eu
python=${1:?usage: $0 PYTHON [PIP-INSTALL-OPTION...]}
shift
version=$("$python" -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')
exec "$python" -m pip install "$@" --force-reinstall --no-deps "opentelemetry-proto==$version"
