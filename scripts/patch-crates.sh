#!/usr/bin/env bash
# Builds .vendor/<crate> for each published crate we patch: the crate as crates.io publishes it, with
# our patch from patches/ applied; the workspace's [patch.crates-io] points at these folders. Only
# the patches are ours and committed; the crates' sources are fetched from crates.io.
# - pulsar: pulsar-lite sends payload frames without the optional magic/CRC prefix, and TCP_NODELAY
#   (see PULSAR-LITE.md and the patch's header); a broker restart logged as warnings, not errors.
# - oxigraph: a write transaction's keys go to RocksDB sorted, repeats once (the patch's header).
# - spareval: a cancellation token also checked between an operator's rows, with a budget of the
#   bindings a query's operators may produce (the patch's header).
# Idempotent and quiet when done; fails loudly if a patch stops applying.
set -euo pipefail
cd "$(dirname "$0")/.."
# The fetching projects' folders, removed however the script ends.
work_dirs=()
trap 'rm -rf "${work_dirs[@]}"' EXIT

vendor() {
  local crate=$1 version=$2 patch_file=$3
  local dest=.vendor/$crate
  local stamp
  stamp="$version $(sha256sum "$patch_file" | cut -d' ' -f1)"
  if [ -f "$dest/.patched" ] && [ "$(cat "$dest/.patched")" = "$stamp" ]; then
    return 0
  fi
  echo "setup: fetching $crate $version and applying $patch_file" >&2
  local work
  work=$(mktemp -d)
  work_dirs+=("$work")
  mkdir -p "$work/src"
  touch "$work/src/lib.rs"
  cat > "$work/Cargo.toml" <<TOML
[package]
name = "fetch-$crate"
version = "0.0.0"
edition = "2021"
[dependencies]
$crate = { version = "=$version", default-features = false }
TOML
  cargo fetch -q --manifest-path "$work/Cargo.toml"
  local src
  src=$(cargo metadata --format-version 1 --manifest-path "$work/Cargo.toml" \
    | python3 -c "import json,sys; m=json.load(sys.stdin); print([p['manifest_path'] for p in m['packages'] if p['name']=='$crate'][0])")
  src=$(dirname "$src")
  rm -rf "$dest"
  mkdir -p .vendor
  cp -r "$src" "$dest"
  chmod -R u+w "$dest"
  if ! patch -s -p1 -d "$dest" --no-backup-if-mismatch < "$patch_file"; then
    echo "setup: ERROR: $patch_file no longer applies to $crate $version" >&2
    exit 1
  fi
  echo "$stamp" > "$dest/.patched"
}

vendor pulsar 6.9.1 patches/pulsar-6.9.1-pulsar-lite.patch
vendor oxigraph 0.5.13 patches/oxigraph-0.5.13-rocksdb-writes.patch
vendor spareval 0.2.9 patches/spareval-0.2.9-binding-budget.patch
