#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit, contract and end-to-end tests (the latter against a
# real pulsar-lite broker started by the test harness, and a tier of them again on Apache Pulsar).
# `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests
. scripts/env.sh
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== deployment files"
scripts/check-deploy.sh
echo "== cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
echo "== build binaries (the end-to-end tests run them)"
cargo build --locked --workspace --all-targets
# A failing tier must not hide the next ones: each tier's status is kept and the script goes on.
set +e
echo "== cargo test"
cargo test --locked --workspace --no-fail-fast -- --skip chaos_soak 2>&1 | tee "${TMPDIR:-/tmp}/pulsar-agents-test.log" | grep -vE '^\s*$'
status=${PIPESTATUS[0]}
# The chaos soak's short mode runs alone (it starts eight processes and kills them) and shows its
# counts; the long mode is scripts/soak.sh.
echo "== chaos soak (short mode)"
RUST_LOG=off cargo test --locked --workspace --test soak -- --nocapture 2>&1 \
  | tee -a "${TMPDIR:-/tmp}/pulsar-agents-test.log" | grep -E '^soak: ([^0-9]|[0-9]+ dialogs)|^test |panicked|^test result'
soak_status=${PIPESTATUS[0]}
[ "$soak_status" -eq 0 ] || status=$soak_status
# The Apache Pulsar tier: the same end-to-end tests on Apache Pulsar's own standalone broker
# (scripts/apache-pulsar.sh), each test with a fresh JVM broker: ReACT streaming, SIGKILLs and a
# broker restart, effectively-once, the supervisor with two replicas, hostile input, the drop-in
# driven by TrustGraph's own CLI and client library, long observations as references, cancel; then effectively-once and the chaos soak's
# short mode (with its broker restart) with the graph in Apache Jena Fuseki. (tests/tests/pulsar_auth.rs, JWT
# authentication and authorization, and tests/tests/message_limits.rs, the broker's message size
# limit, run on Apache Pulsar in the main run above.)
echo "== Apache Pulsar tier"
AGENT_E2E_BROKER=apache cargo test --locked --workspace --no-fail-fast \
  --test react --test failures --test once --test supervisor --test hostile --test trustgraph \
  --test long_dialogs --test run_control --test fork \
  -- --test-threads 2 2>&1 \
  | tee -a "${TMPDIR:-/tmp}/pulsar-agents-test.log" | grep -E '^test result|FAILED|panicked'
apache_status=${PIPESTATUS[0]}
[ "$apache_status" -eq 0 ] || status=$apache_status
# Effectively-once again with the graph in a SPARQL server we do not own (Apache Jena Fuseki, behind
# the aggregator, which owns the journal), and the chaos soak on that topology.
echo "== Apache Pulsar, the graph in Apache Jena Fuseki"
AGENT_E2E_BROKER=apache AGENT_E2E_STORE=fuseki cargo test --locked --workspace --no-fail-fast \
  --test once -- --test-threads 2 2>&1 \
  | tee -a "${TMPDIR:-/tmp}/pulsar-agents-test.log" | grep -E '^test result|FAILED|panicked'
fuseki_status=${PIPESTATUS[0]}
[ "$fuseki_status" -eq 0 ] || status=$fuseki_status
AGENT_E2E_BROKER=apache AGENT_E2E_STORE=fuseki RUST_LOG=off cargo test --locked --workspace --test soak -- --nocapture 2>&1 \
  | tee -a "${TMPDIR:-/tmp}/pulsar-agents-test.log" | grep -E '^soak: ([^0-9]|[0-9]+ dialogs)|^test |panicked|^test result'
apache_soak_status=${PIPESTATUS[0]}
[ "$apache_soak_status" -eq 0 ] || status=$apache_soak_status
set -e
passed=$(grep -Eo '[0-9]+ passed' "${TMPDIR:-/tmp}/pulsar-agents-test.log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "${TMPDIR:-/tmp}/pulsar-agents-test.log" | awk '{s+=$1} END {print s+0}')
echo "$passed passed, $failed failed"
exit "$status"
