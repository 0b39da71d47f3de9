#!/usr/bin/env bash
# Apache Pulsar's standalone broker for the end-to-end tier that runs on it (the test harness starts
# and stops it; see tests/src/apache.rs). `apache-pulsar.sh path` fetches pulsar-broker and its runtime
# jars from Maven Central once (cached outside the clone, idempotent, quiet when done) and prints the
# folder of jars. The version and why: scripts/apache-pulsar/pom.xml.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The broker's version: the <version> line after pulsar-broker's artifactId (the pom takes other
# modules at other versions).
version=$(sed -n '/<artifactId>pulsar-broker<\/artifactId>/{n;s:.*<version>\([0-9.]*\)</version>.*:\1:p;}' \
  "$here/apache-pulsar/pom.xml")
[ -n "$version" ] || { echo "apache-pulsar.sh: no pulsar-broker version in apache-pulsar/pom.xml" >&2; exit 1; }
cache="${PULSAR_AGENTS_CACHE:-$HOME/.cache/pulsar-agents}/apache-pulsar-$version"
lib="$cache/lib"

fetch() {
  # Quick once fetched; it checks the jars again when their pinned list changes.
  "$here/maven-jars.sh" "$here/apache-pulsar/pom.xml" "$lib" "pulsar-broker $version and its jars (~240 MB)"
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
