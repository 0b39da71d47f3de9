# Sourced by the project's scripts: one cargo target directory outside the clone, kept between runs on
# the same machine so CI and demos reuse compiled dependencies (a cold build still fits CI's limit).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pulsar-agents/target}"
export CARGO_TERM_QUIET="${CARGO_TERM_QUIET:-true}"
