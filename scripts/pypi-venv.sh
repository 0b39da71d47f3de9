#!/usr/bin/env bash
# Pinned Python packages from PyPI in a virtualenv cached outside the clone, installed once
# (idempotent, quiet when done); prints the virtualenv's bin folder. The scripts that bring a Python
# tool for the tests use it (trustgraph-client.sh, oxigraph-server.sh).
#   pypi-venv.sh NAME PACKAGE==VERSION...    NAME: the virtualenv's folder in the cache
set -euo pipefail
name=$1
shift
venv="${PULSAR_AGENTS_CACHE:-$HOME/.cache/pulsar-agents}/$name"
if [ ! -f "$venv/.complete" ]; then
  # Two tests may ask at once on a machine set up by neither: one installs, the other waits.
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  flock 9
fi
if [ ! -f "$venv/.complete" ]; then
  echo "installing $* from PyPI (once)" >&2
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
  fi
  rm -rf "$venv"
  python3 -m venv "$venv" >/dev/null
  if ! "$venv/bin/pip" install -q --disable-pip-version-check "$@" >"$venv.log" 2>&1; then
    cat "$venv.log" >&2
    exit 1
  fi
  touch "$venv/.complete"
fi
echo "$venv/bin"
