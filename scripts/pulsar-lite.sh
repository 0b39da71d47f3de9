#!/usr/bin/env bash
# The embedded broker: `pulsar-lite.sh start PORT DATA_DIR`, `stop DATA_DIR`, `path` (the binary).
# Installs pulsar-lite from PyPI when it is missing. Its settings: pulsar-lite.toml beside this script.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

binary() {
  python3 - <<'PY' 2>/dev/null
import os, pulsar_lite
print(os.path.join(os.path.dirname(pulsar_lite.__file__), "bin", "pulsar-lite"))
PY
}

# The version we run, and the sha256 of its broker binary for each platform PyPI has a wheel for:
# what runs is what was tested, not whatever 0.2.x PyPI serves next, nor a binary changed in
# transit or on disk.
VERSION=0.2.0
case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) BINARY_SHA256=fe0efa852084a257aa4fe8212e9ff46e617309520e6e7d438731d5a3d2c9e7be ;;
  Darwin/arm64) BINARY_SHA256=320bb644b6d442a0b448d2f685abf7a28af5119b6545540dce50b9d245b66e6c ;;
  *)
    echo "pulsar-lite: $VERSION has wheels for Linux x86_64 and macOS arm64 only, not $(uname -s) $(uname -m); run the tests on Apache Pulsar instead (AGENT_E2E_BROKER=apache)" >&2
    exit 1
    ;;
esac

sha256() {
  if command -v sha256sum >/dev/null; then sha256sum "$1"; else shasum -a 256 "$1"; fi | cut -d' ' -f1
}

pinned() {
  [ -x "$1" ] && [ "$(sha256 "$1")" = "$BINARY_SHA256" ]
}

ensure_installed() {
  if ! bin=$(binary) || ! pinned "$bin"; then
    echo "pulsar-lite: installing $VERSION from PyPI" >&2
    local pip=(python3 -m pip install -q --disable-pip-version-check "pulsar-lite==$VERSION")
    # An installed package whose binary was changed or deleted on disk is "already satisfied" to
    # pip: reinstalled whole.
    if [ -n "${bin:-}" ]; then pip+=(--force-reinstall --no-deps); fi
    "${pip[@]}" >/dev/null 2>&1 || "${pip[@]}" --break-system-packages >/dev/null
    bin=$(binary)
    pinned "$bin" || {
      echo "pulsar-lite: $bin is not the pinned $VERSION binary (sha256 $BINARY_SHA256)" >&2
      exit 1
    }
  fi
  echo "$bin"
}

cmd=${1:-}
case "$cmd" in
  path)
    ensure_installed
    ;;
  start)
    port=${2:?usage: pulsar-lite.sh start PORT DATA_DIR}
    data=${3:?usage: pulsar-lite.sh start PORT DATA_DIR}
    bin=$(ensure_installed)
    mkdir -p "$data"
    data=$(cd "$data" && pwd)
    if [ -f "$data/pid" ] && kill -0 "$(cat "$data/pid")" 2>/dev/null; then
      echo "pulsar-lite already running (pid $(cat "$data/pid"))" >&2
      exit 0
    fi
    # Write-buffer marks and metrics: the same file the embedded broker uses, which says why.
    cp "$here/pulsar-lite.toml" "$data/broker.toml"
    nohup "$bin" --config "$data/broker.toml" --addr "127.0.0.1:$port" --db-path "$data/broker" \
      --log-level warn > "$data/broker.log" 2>&1 &
    echo $! > "$data/pid"
    for _ in $(seq 1 100); do
      if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "pulsar-lite listening on pulsar://127.0.0.1:$port (pid $(cat "$data/pid"), log $data/broker.log)" >&2
        exit 0
      fi
      sleep 0.1
    done
    echo "pulsar-lite did not start; see $data/broker.log" >&2
    exit 1
    ;;
  stop)
    data=${2:?usage: pulsar-lite.sh stop DATA_DIR}
    if [ -f "$data/pid" ]; then
      pid=$(cat "$data/pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$data/pid"
    fi
    ;;
  *)
    echo "usage: pulsar-lite.sh start PORT DATA_DIR | stop DATA_DIR | path" >&2
    exit 2
    ;;
esac
