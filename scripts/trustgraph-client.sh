#!/usr/bin/env bash
# TrustGraph's own Python client library and CLI from PyPI (`trustgraph-base`, `trustgraph-cli`),
# pinned, in a virtualenv cached outside the clone. The drop-in tests publish with them
# (tests/tests/trustgraph.rs). `trustgraph-client.sh path` installs once (idempotent, quiet when done)
# and prints the virtualenv's bin folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=2.11.1

case "${1:-}" in
  path)
    "$here/pypi-venv.sh" "trustgraph-$version" "trustgraph-base==$version" "trustgraph-cli==$version"
    ;;
  *)
    echo "usage: trustgraph-client.sh path" >&2
    exit 2
    ;;
esac
