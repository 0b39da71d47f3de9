#!/usr/bin/env bash
# Oxigraph's own SPARQL server (the `oxigraph` command, `oxigraph serve`), prebuilt on PyPI: a SPARQL
# server this project does not own, as the store behind the aggregator in the tests that keep the
# graph in one (tests/src/sparql_server.rs). Its Rust crate, `oxigraph-cli`, would compile RocksDB a
# second time (15-27 minutes). `oxigraph-server.sh path` installs once (idempotent, quiet when done)
# and prints the folder holding `oxigraph`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The same Oxigraph line as the embedded store's (Cargo.toml: oxigraph 0.5).
version=0.5.13

case "${1:-}" in
  path)
    "$here/pypi-venv.sh" "oxigraph-server-$version" "oxigraph==$version"
    ;;
  *)
    echo "usage: oxigraph-server.sh path" >&2
    exit 2
    ;;
esac
