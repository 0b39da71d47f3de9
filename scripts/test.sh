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
log="${TMPDIR:-/tmp}/pulsar-agents-test.log"
: >"$log"
echo "== cargo test"
# End-to-end tests mostly wait (on brokers, timers, child processes): at two threads a quarter of
# the two cores was busy, so they run four at a time. The tests that take long on their own (the
# real small model, about 3 min on one core; the Apache Pulsar JWT, TLS, message-size and
# closed-consumer tests, one JVM broker each) run beside the others instead of after them. (Six at a
# time beside those once left a supervisor fan-out unfinished after 60 s on a saturated machine;
# alone, six passed every time.)
alone=(small_model pulsar_auth pulsar_tls message_limits broker_closes listener_subscriptions)
alone_args=()
for name in "${alone[@]}"; do alone_args+=(--test "$name"); done
# In a process group of its own, so that stopping this script stops it and whatever it started.
setsid cargo test --locked -p agent-e2e --no-fail-fast "${alone_args[@]}" -- --test-threads 3 \
  >"$log.alone" 2>&1 &
alone_pid=$!
trap 'kill -- -"$alone_pid" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
e2e_args=()
for file in tests/tests/*.rs; do
  name=$(basename "$file" .rs)
  case " ${alone[*]} soak " in *" $name "*) continue ;; esac
  e2e_args+=(--test "$name")
done
cargo test --locked --workspace --exclude agent-e2e --no-fail-fast 2>&1 | tee -a "$log" | grep -vE '^\s*$'
status=${PIPESTATUS[0]}
cargo test --locked -p agent-e2e --no-fail-fast --lib "${e2e_args[@]}" -- --test-threads 4 2>&1 \
  | tee -a "$log" | grep -vE '^\s*$'
e2e_status=${PIPESTATUS[0]}
[ "$e2e_status" -eq 0 ] || status=$e2e_status
wait "$alone_pid"
alone_status=$?
trap - EXIT INT TERM
[ "$alone_status" -eq 0 ] || status=$alone_status
echo "== the long-running end-to-end tests (${alone[*]}), run beside the others"
tee -a "$log" <"$log.alone" | grep -vE '^\s*$'
# The chaos soak's short mode runs alone (it starts eight processes and kills them) and shows its
# counts; the long mode is scripts/soak.sh.
echo "== chaos soak (short mode)"
RUST_LOG=off cargo test --locked --workspace --test soak -- --nocapture 2>&1 \
  | tee -a "$log" | grep -E '^soak: ([^0-9]|[0-9]+ dialogs)|^test |panicked|^test result'
soak_status=${PIPESTATUS[0]}
[ "$soak_status" -eq 0 ] || status=$soak_status
# Effectively-once and the chaos soak again with every orchestrator continuing its dialogs in
# process (--continue-in-process: a dialog's next step runs where the step before it was recorded,
# its request kept in the journal instead of put on the broker).
echo "== continued in process (pulsar-lite)"
AGENT_E2E_CONTINUE_IN_PROCESS=1 cargo test --locked --workspace --no-fail-fast --test once \
  -- --test-threads 3 2>&1 | tee -a "$log" | grep -E '^test result|FAILED|panicked'
chain_status=${PIPESTATUS[0]}
[ "$chain_status" -eq 0 ] || status=$chain_status
AGENT_E2E_CONTINUE_IN_PROCESS=1 RUST_LOG=off cargo test --locked --workspace --test soak \
  -- --nocapture 2>&1 \
  | tee -a "$log" | grep -E '^soak: ([^0-9]|[0-9]+ dialogs)|^test |panicked|^test result'
chain_soak_status=${PIPESTATUS[0]}
[ "$chain_soak_status" -eq 0 ] || status=$chain_soak_status
# The Apache Pulsar tier: the same end-to-end tests on Apache Pulsar's own standalone broker
# (scripts/apache-pulsar.sh), each test with a fresh JVM broker: ReACT streaming, SIGKILLs and a
# broker restart, effectively-once, the supervisor with two replicas, hostile input, the drop-in
# driven by TrustGraph's own CLI and client library, long observations as references, cancel; then
# effectively-once and the chaos soak's short mode (with its broker restart) with the graph in Apache
# Jena Fuseki and in Oxigraph's server. (tests/tests/pulsar_auth.rs, JWT
# authentication and authorization, tests/tests/pulsar_tls.rs, TLS with a private CA,
# tests/tests/message_limits.rs, the broker's message size limit, tests/tests/broker_closes.rs,
# a consumer the broker closes and refuses, and tests/tests/listener_subscriptions.rs, a reader's
# subscription ending with it, run on Apache Pulsar in the main run above.) This first tier is docker-compose.yml's topology, so its broker has the compose
# file's settings (new entries dispatched at once, write-buffer marks of 16 MiB); the tiers with the
# graph in a SPARQL server keep standalone's defaults, as an existing cluster most likely has them.
echo "== Apache Pulsar tier (as docker-compose.yml sets it up)"
# `compose`: the test harness reads the broker settings docker-compose.yml gives Apache Pulsar (its
# `PULSAR_PREFIX_` lines; none found fails the tier, not a tier on defaults: tests/src/lib.rs).
AGENT_E2E_BROKER=apache AGENT_E2E_APACHE_SETTINGS=compose \
  cargo test --locked --workspace --no-fail-fast \
  --test react --test failures --test once --test supervisor --test hostile --test trustgraph \
  --test long_dialogs --test run_control --test fork \
  -- --test-threads 3 2>&1 \
  | tee -a "$log" | grep -E '^test result|FAILED|panicked'
apache_status=${PIPESTATUS[0]}
[ "$apache_status" -eq 0 ] || status=$apache_status
# Effectively-once again with the graph in SPARQL servers we do not own (Apache Jena Fuseki, then
# Oxigraph's own server, each behind the aggregator, which owns the journal), and the chaos soak on
# that topology.
for store in fuseki oxigraph; do
  echo "== Apache Pulsar, the graph in $store"
  AGENT_E2E_BROKER=apache AGENT_E2E_STORE=$store cargo test --locked --workspace --no-fail-fast \
    --test once -- --test-threads 3 2>&1 \
    | tee -a "$log" | grep -E '^test result|FAILED|panicked'
  store_status=${PIPESTATUS[0]}
  [ "$store_status" -eq 0 ] || status=$store_status
  AGENT_E2E_BROKER=apache AGENT_E2E_STORE=$store RUST_LOG=off cargo test --locked --workspace --test soak -- --nocapture 2>&1 \
    | tee -a "$log" | grep -E '^soak: ([^0-9]|[0-9]+ dialogs)|^test |panicked|^test result'
  store_soak_status=${PIPESTATUS[0]}
  [ "$store_soak_status" -eq 0 ] || status=$store_soak_status
done
set -e
passed=$(grep -Eo '[0-9]+ passed' "$log" | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' "$log" | awk '{s+=$1} END {print s+0}')
# CI shows only the end of this output: name what failed, and why, where it will be read.
if [ "$failed" -gt 0 ] || [ "$status" -ne 0 ]; then
  echo "== what failed"
  grep -E '^test .+ \.\.\. FAILED$' "$log" | sort | uniq -c || true
  grep -A 4 -E "panicked at" "$log" | grep -vE '^\s*$' | cut -c1-400 | head -n 60 || true
fi
echo "$passed passed, $failed failed"
exit "$status"
