#!/usr/bin/env bash
# Apache Pulsar's standalone broker for the end-to-end tier that runs on it (the test harness starts
# and stops it; see tests/src/apache.rs). `apache-pulsar.sh path` fetches pulsar-broker and its runtime
# jars from Maven Central once (cached outside the clone, idempotent, quiet when done) and prints the
# folder of jars. The version and why: scripts/apache-pulsar/pom.xml.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=$(sed -n 's:.*<version>\(4\.[0-9.]*\)</version>.*:\1:p' "$here/apache-pulsar/pom.xml" | head -1)
cache="${PULSAR_AGENTS_CACHE:-$HOME/.cache/pulsar-agents}/apache-pulsar-$version"
lib="$cache/lib"

ensure_maven() {
  command -v java >/dev/null 2>&1 && command -v mvn >/dev/null 2>&1 && return 0
  echo "apache-pulsar: installing a JDK and Maven" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jdk-headless maven >/dev/null
}

fetch() {
  [ -f "$cache/.complete" ] && return 0
  ensure_maven
  echo "apache-pulsar: fetching pulsar-broker $version and its jars from Maven Central (~240 MB, once)" >&2
  rm -rf "$lib"
  mkdir -p "$cache"
  if ! mvn -B -q -s "$here/apache-pulsar/settings.xml" -f "$here/apache-pulsar/pom.xml" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$lib" \
    >"$cache/fetch.log" 2>&1; then
    cat "$cache/fetch.log" >&2
    exit 1
  fi
  touch "$cache/.complete"
}

case "${1:-}" in
  path)
    fetch
    echo "$lib"
    ;;
  *)
    echo "usage: apache-pulsar.sh path" >&2
    exit 2
    ;;
esac
