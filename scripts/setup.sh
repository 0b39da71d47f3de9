#!/usr/bin/env bash
# Installs everything the build and the tests need on a fresh machine. Idempotent and quiet when done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
# libclang-dev: oxigraph's RocksDB build needs bindgen.
for pkg in pkg-config libssl-dev libclang-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

scripts/pulsar-lite.sh path >/dev/null
scripts/patch-pulsar.sh
