# Sourced by the project's scripts: one cargo target directory outside the clone, kept between runs on
# the same machine so CI and demos reuse compiled dependencies (a cold build still fits CI's limit).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pulsar-agents/target}"
export CARGO_TERM_QUIET="${CARGO_TERM_QUIET:-true}"

# Cargo decides whether a workspace crate is fresh from the absolute source paths recorded when it was
# last built. When another clone built into this target directory last, its artifacts look fresh here
# and would be tested instead of this checkout (seen: a test binary reading another clone's files).
# So when the checkout changes, our own crates are cleaned; dependencies (RocksDB) stay compiled.
own_target_dir() {
  local here marker members
  here=$(pwd -P)
  marker="$CARGO_TARGET_DIR/.checkout"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$here" ]; then
    return 0
  fi
  if [ -d "$CARGO_TARGET_DIR" ]; then
    members=$(cargo metadata --no-deps --format-version 1 --locked 2>/dev/null \
      | python3 -c 'import json,sys; print(" ".join("-p " + p["name"] for p in json.load(sys.stdin)["packages"]))')
    if [ -n "$members" ]; then
      # shellcheck disable=SC2086
      cargo clean --quiet $members 2>/dev/null || true
    fi
  fi
  mkdir -p "$CARGO_TARGET_DIR"
  echo "$here" >"$marker"
}
own_target_dir
