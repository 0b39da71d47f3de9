#!/usr/bin/env bash
# TrustGraph's own Python client library and CLI from PyPI (`trustgraph-base`, `trustgraph-cli`),
# pinned, in a virtualenv cached outside the clone. The drop-in tests publish with them
# (tests/tests/trustgraph.rs). `trustgraph-client.sh path` installs once (idempotent, quiet when done)
# and prints the virtualenv's bin folder.
set -euo pipefail
version=2.11.1
venv="${PULSAR_AGENTS_CACHE:-$HOME/.cache/pulsar-agents}/trustgraph-$version"

ensure_installed() {
  [ -f "$venv/.complete" ] && return 0
  echo "trustgraph-client: installing trustgraph-base and trustgraph-cli $version from PyPI" >&2
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
  fi
  rm -rf "$venv"
  python3 -m venv "$venv" >/dev/null
  if ! "$venv/bin/pip" install -q --disable-pip-version-check \
    "trustgraph-base==$version" "trustgraph-cli==$version" >"$venv.log" 2>&1; then
    cat "$venv.log" >&2
    exit 1
  fi
  touch "$venv/.complete"
}

case "${1:-}" in
  path)
    ensure_installed
    echo "$venv/bin"
    ;;
  *)
    echo "usage: trustgraph-client.sh path" >&2
    exit 2
    ;;
esac
