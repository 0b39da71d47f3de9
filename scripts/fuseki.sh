#!/usr/bin/env bash
# Apache Jena Fuseki, a standalone SPARQL 1.1 server this project does not own, for the tests that
# keep the graph (provenance and the journal) in it behind the aggregator (the test harness starts and
# stops it; see tests/src/sparql_server.rs). `fuseki.sh path` fetches jena-fuseki-main and its runtime jars
# from Maven Central once (cached outside the clone, idempotent, quiet when done) and prints the folder
# of jars. The version and why: scripts/fuseki/pom.xml.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=$(grep -A1 '<artifactId>jena-fuseki-main</artifactId>' "$here/fuseki/pom.xml" | sed -n 's:.*<version>\(.*\)</version>.*:\1:p')
# A change to the pom (another jar) fetches afresh.
pom_digest=$(sha256sum "$here/fuseki/pom.xml" | cut -c1-8)
cache="${PULSAR_AGENTS_CACHE:-$HOME/.cache/pulsar-agents}/jena-fuseki-$version-$pom_digest"
lib="$cache/lib"

fetch() {
  # Quick once fetched; it checks the jars again when their pinned list changes.
  "$here/maven-jars.sh" "$here/fuseki/pom.xml" "$lib" "jena-fuseki-main $version and its jars"
}

case "${1:-}" in
  path)
    fetch
    echo "$lib"
    ;;
  *)
    echo "usage: fuseki.sh path" >&2
    exit 2
    ;;
esac
