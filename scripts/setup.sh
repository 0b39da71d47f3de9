#!/usr/bin/env bash
# Installs everything the build and the tests need on a fresh machine. Idempotent and quiet when done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v pulsar-lite >/dev/null 2>&1; then
  echo "setup: installing pulsar-lite from PyPI" >&2
  python3 -m pip install -q --disable-pip-version-check 'pulsar-lite==0.2.*' >/dev/null
fi

scripts/patch-pulsar.sh
