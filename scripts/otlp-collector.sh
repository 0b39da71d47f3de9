#!/usr/bin/env bash
# OpenTelemetry's own generated OTLP message classes (PyPI: opentelemetry-proto, on protobuf, and grpcio
# for its gRPC service), for the
# stand-in collector of tests/tests/tracing.rs (tests/otlp/collector.py): what our exporter sends is
# read back by the protocol's own definitions, not by a reader of ours. `otlp-collector.sh path`
# installs once (idempotent, quiet when done) and prints the folder holding its `python`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

case "${1:-}" in
  path)
    "$here/pypi-venv.sh" otlp-collector-1.45.2-grpc "opentelemetry-proto==1.45.2" "protobuf==7.36.2" \
      "grpcio==1.85.3"
    ;;
  *)
    echo "usage: otlp-collector.sh path" >&2
    exit 2
    ;;
esac
