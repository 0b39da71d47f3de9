#!/usr/bin/env bash
# Installs what is needed, builds, and runs one real agent dialog end to end on embedded defaults:
# a pulsar-lite broker, the orchestrator, and the scripted LLM (or your own endpoint when
# OPENAI_BASE_URL is set). The dialog streams, then its provenance is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/env.sh
cargo build --locked -p agentctl
question=${1:-"How many hours are in a leap year?"}
"$CARGO_TARGET_DIR/debug/agentctl" up --port 0 --sparql-port 0 --data-dir .data/demo-broker --question "$question"
echo
echo "Look again at this run: $CARGO_TARGET_DIR/debug/agentctl explain --last   (or --format mermaid)"
