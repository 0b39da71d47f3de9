#!/usr/bin/env bash
# Builds .vendor/pulsar: the published `pulsar` crate with our patch applied (see PULSAR-LITE.md:
# pulsar-lite sends payload frames without the optional magic/CRC prefix). Only the patch is ours and
# committed; the crate source is fetched from crates.io. Idempotent; fails loudly if the patch stops applying.
set -euo pipefail
cd "$(dirname "$0")/.."
version=6.9.1
patch_file=patches/pulsar-${version}-pulsar-lite.patch
dest=.vendor/pulsar
stamp="$version $(sha256sum "$patch_file" | cut -d' ' -f1)"
if [ -f "$dest/.patched" ] && [ "$(cat "$dest/.patched")" = "$stamp" ]; then
  exit 0
fi
echo "setup: fetching pulsar $version and applying $patch_file" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
touch "$work/src/lib.rs"
cat > "$work/Cargo.toml" <<TOML
[package]
name = "fetch-pulsar"
version = "0.0.0"
edition = "2021"
[dependencies]
pulsar = { version = "=$version", default-features = false }
TOML
cargo fetch -q --manifest-path "$work/Cargo.toml"
src=$(cargo metadata --format-version 1 --manifest-path "$work/Cargo.toml" \
  | python3 -c "import json,sys; m=json.load(sys.stdin); print([p['manifest_path'] for p in m['packages'] if p['name']=='pulsar'][0])")
src=$(dirname "$src")
rm -rf "$dest"
mkdir -p .vendor
cp -r "$src" "$dest"
chmod -R u+w "$dest"
if ! patch -s -p1 -d "$dest" --no-backup-if-mismatch < "$patch_file"; then
  echo "setup: ERROR: $patch_file no longer applies to pulsar $version" >&2
  exit 1
fi
echo "$stamp" > "$dest/.patched"
