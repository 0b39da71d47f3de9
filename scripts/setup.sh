#!/usr/bin/env bash
# Installs what the build and the demo need on a fresh machine (the pulsar-lite broker, our patch
# of the `pulsar` crate, the system packages the build needs); with `--tests`, also everything the
# test suite runs against (MCP servers, a small model, TrustGraph's client, Apache Pulsar, Fuseki,
# Oxigraph's server, the manifests' validator). Idempotent and quiet when done.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=false
[ "${1:-}" = "--tests" ] && tests=true

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
# libclang-dev: oxigraph's RocksDB build needs bindgen. clang: .cargo/config.toml compiles RocksDB's
# C++ with it (faster than GCC).
for pkg in libclang-dev clang; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# pip installs pulsar-lite (and, for the tests, TrustGraph's client into venvs); a distribution's
# Python comes without pip or venv. patch: scripts/patch-crates.sh applies our crate patches.
python3 -c 'import pip' >/dev/null 2>&1 || need_apt+=(python3-pip)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v patch >/dev/null 2>&1 || need_apt+=(patch)
# docker-compose (Debian's): validates docker-compose.yml in scripts/check-deploy.sh.
# openssl: makes the private CA and broker certificate of tests/tests/pulsar_tls.rs.
# strace: shows tests/tests/provenance.rs when the aggregator's store syncs its writes to disk.
if $tests; then
  dpkg -s docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
  command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
  command -v strace >/dev/null 2>&1 || need_apt+=(strace)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup: ${need_apt[*]} must be installed (as root: apt-get install ${need_apt[*]})" >&2; exit 1; }
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

scripts/pulsar-lite.sh path >/dev/null
scripts/patch-crates.sh
$tests || exit 0

# Node.js runs the MCP servers the end-to-end tests call (written by others, and one of ours on
# the TypeScript SDK; pinned in tests/mcp-servers/package-lock.json).
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing nodejs npm" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
fi
mcp_dir=tests/mcp-servers
mcp_stamp=$(sha256sum "$mcp_dir/package-lock.json" | cut -d' ' -f1)
if [ "$(cat "$mcp_dir/node_modules/.installed" 2>/dev/null)" != "$mcp_stamp" ]; then
  echo "setup: installing the MCP test servers (npm ci)" >&2
  (cd "$mcp_dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null 2>&1) \
    || { echo "setup: ERROR: npm ci failed in $mcp_dir" >&2; exit 1; }
  echo "$mcp_stamp" >"$mcp_dir/node_modules/.installed"
fi

# The Kubernetes manifests' validator, with the Kubernetes schemas inside (scripts/check-deploy.sh).
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null)" != "1.37.0" ]; then
  echo "setup: installing kubernetes-validate from PyPI" >&2
  python3 -m pip install -q --disable-pip-version-check 'kubernetes-validate==1.37.0' >/dev/null 2>&1 \
    || python3 -m pip install -q --disable-pip-version-check --break-system-packages 'kubernetes-validate==1.37.0' >/dev/null
fi

# A real small model and its runtime (node-llama-cpp's prebuilt llama.cpp) for the real-model tests.
scripts/small-model.sh path >/dev/null

# TrustGraph's own client library and CLI (PyPI), which the drop-in tests publish with.
scripts/trustgraph-client.sh path >/dev/null
# Apache Pulsar's standalone broker (Maven Central, ~240 MB once) for the tier of tests run on it.
scripts/apache-pulsar.sh path >/dev/null
# Apache Jena Fuseki (Maven Central, ~40 MB once): a SPARQL server we do not own, as the graph store
# behind the aggregator in the tests that need one.
scripts/fuseki.sh path >/dev/null
# Oxigraph's own SPARQL server (PyPI, prebuilt), the other server we do not own that the tests keep
# the graph in.
scripts/oxigraph-server.sh path >/dev/null
# OpenTelemetry's OTLP message classes (PyPI), which the traces test's stand-in collector reads our
# spans with.
scripts/otlp-collector.sh path >/dev/null
# TrustGraph's librarian (PyPI) with Apache Cassandra (Maven Central, ~70 MB once) and moto's S3
# server behind it, for the test that keeps documents in it (DOCUMENT_STORE=librarian).
scripts/librarian.sh path >/dev/null
