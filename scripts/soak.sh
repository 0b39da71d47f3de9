#!/usr/bin/env bash
# The chaos soak's long mode: 500 dialogs and 50 kills by default (DIALOGS, KILLS, SEED override).
# The short mode runs in the test suite (`cargo test --workspace --test soak`). See the README.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests
. scripts/env.sh
cargo build --locked --workspace --all-targets
SOAK_DIALOGS="${DIALOGS:-500}" SOAK_KILLS="${KILLS:-50}" SOAK_SEED="${SEED:-$RANDOM}" \
  SOAK_IN_FLIGHT="${IN_FLIGHT:-16}" RUST_LOG="${RUST_LOG:-off}" \
  cargo test --locked --workspace --test soak -- --nocapture 2>&1 | grep -E '^soak:|^test |panicked|lost|duplicated|wrong'
exit "${PIPESTATUS[0]}"
