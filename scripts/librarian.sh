#!/usr/bin/env bash
# TrustGraph's own librarian (trustgraph-flow 2.11.1, PyPI), the document store of a TrustGraph
# deployment, with what it needs behind it and no Docker: Apache Cassandra 5.0 for its metadata
# (jars from Maven Central) and moto's S3 server (PyPI) for its blobs. The tests that keep documents
# in the librarian start it on a broker (tests/src/librarian.rs).
#   librarian.sh path                      install once (idempotent, quiet when done), print the cache
#   librarian.sh start DIR PULSAR_URL      start Cassandra, S3 and the librarian; their logs in DIR
#   librarian.sh stop DIR                  stop what `start DIR` started
# The broker must have a config service that lists the workspace `default` (TrustGraph 2.x: key
# `default` of type `workspace` in workspace `__workspaces__`) before the librarian starts.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=2.11.1
cassandra=$(grep -A1 '<artifactId>cassandra-all</artifactId>' "$here/librarian/pom.xml" | sed -n 's:.*<version>\(.*\)</version>.*:\1:p')
cache="${PULSAR_AGENTS_CACHE:-$HOME/.cache/pulsar-agents}/librarian-$version-cassandra-$cassandra"

install() {
  if [ -f "$cache/.complete" ]; then
    # Quick once fetched; it checks the jars again when their pinned list changes.
    "$here/maven-jars.sh" "$here/librarian/pom.xml" "$cache/cassandra" "cassandra-all $cassandra and its jars"
    return 0
  fi
  echo "librarian: installing TrustGraph's librarian $version (PyPI) and Cassandra $cassandra (Maven Central), once" >&2
  rm -rf "$cache"
  mkdir -p "$cache"
  "$here/maven-jars.sh" "$here/librarian/pom.xml" "$cache/cassandra" "cassandra-all $cassandra and its jars"
  python3 -m venv "$cache/venv" >/dev/null
  # The librarian alone needs none of trustgraph-flow's other dependencies (vector stores, models).
  if ! { "$cache/venv/bin/pip" install -q --disable-pip-version-check \
      "trustgraph-base==$version" 'scylla-driver==3.29.12' 'minio==7.2.20' \
      'moto[s3]==5.2.5' 'flask==3.1.3' 'flask-cors==6.0.5' \
    && "$cache/venv/bin/pip" install -q --disable-pip-version-check --no-deps "trustgraph-flow==$version"; \
    } >"$cache/pip.log" 2>&1; then
    cat "$cache/pip.log" >&2
    exit 1
  fi
  touch "$cache/.complete"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits until `cmd` succeeds, or fails naming `what` and showing its log.
wait_for() {
  local what=$1 log=$2 tries=$3
  shift 3
  for _ in $(seq "$tries"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "librarian.sh: $what did not come up; its log:" >&2
  tail -n 40 "$log" >&2
  return 1
}

start() {
  local dir=$1 pulsar=$2
  install
  mkdir -p "$dir/cassandra-data" "$dir/conf"
  if python3 -c 'import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(("127.0.0.1", 9042)) != 0)'; then
    echo "librarian.sh: port 9042 (Cassandra's, where the librarian looks) is taken" >&2
    exit 1
  fi
  sed -e "s:@DATA@:$dir/cassandra-data:g" -e "s:@STORAGE_PORT@:$(free_port):g" \
    "$here/librarian/cassandra.yaml" >"$dir/conf/cassandra.yaml"
  cp "$here/librarian/logback.xml" "$dir/conf/logback.xml"
  # Java 17's module flags Cassandra 5.0 needs (from its jvm17-server.options).
  local opens=() pkg
  for pkg in java.base/jdk.internal.misc java.base/jdk.internal.ref java.base/sun.nio.ch \
    java.management.rmi/com.sun.jmx.remote.internal.rmi java.rmi/sun.rmi.registry \
    java.rmi/sun.rmi.server java.sql/java.sql java.base/java.lang.ref jdk.unsupported/sun.misc; do
    opens+=(--add-exports "$pkg=ALL-UNNAMED")
  done
  for pkg in java.base/java.lang.module java.base/jdk.internal.loader java.base/jdk.internal.ref \
    java.base/jdk.internal.reflect java.base/jdk.internal.math java.base/jdk.internal.module \
    java.base/jdk.internal.util.jar jdk.management/com.sun.management.internal java.base/sun.nio.ch \
    java.base/java.io java.base/java.nio java.base/java.util.concurrent java.base/java.util \
    java.base/java.util.concurrent.atomic java.base/java.lang java.base/java.math \
    java.base/java.lang.reflect java.base/java.net; do
    opens+=(--add-opens "$pkg=ALL-UNNAMED")
  done
  local jamm
  jamm=$(ls "$cache"/cassandra/jamm-*.jar)
  (cd "$dir" && exec java -Xms256m -Xmx768m -XX:+UseG1GC -XX:ActiveProcessorCount=2 -Xss512k \
    -javaagent:"$jamm" -Djdk.attach.allowAttachSelf=true -Dcassandra-foreground=yes \
    -Dcassandra.config="file://$dir/conf/cassandra.yaml" \
    -Dlogback.configurationFile="$dir/conf/logback.xml" \
    -Dcassandra.storagedir="$dir/cassandra-data" -Dcassandra.skip_wait_for_gossip_to_settle=0 \
    -Dcassandra.initial_token=0 "${opens[@]}" \
    -cp "$dir/conf:$cache/cassandra/*" org.apache.cassandra.service.CassandraDaemon \
    >"$dir/cassandra.log" 2>&1) &
  echo $! >"$dir/cassandra.pid"
  local s3
  s3=$(free_port)
  "$cache/venv/bin/moto_server" -H 127.0.0.1 -p "$s3" >"$dir/s3.log" 2>&1 &
  echo $! >"$dir/s3.pid"
  wait_for "Cassandra" "$dir/cassandra.log" 240 \
    python3 -c 'import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(("127.0.0.1", 9042)))'
  wait_for "the S3 server" "$dir/s3.log" 60 \
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$s3/')"
  # No metrics port, no Loki: nothing else is deployed here.
  "$cache/venv/bin/librarian" -p "$pulsar" --no-metrics --no-loki-enabled \
    --cassandra-host 127.0.0.1 --object-store-endpoint "127.0.0.1:$s3" \
    --object-store-access-key test --object-store-secret-key test >"$dir/librarian.log" 2>&1 &
  echo $! >"$dir/librarian.pid"
}

stop() {
  local dir=$1 name pid
  for name in librarian s3 cassandra; do
    pid=$(cat "$dir/$name.pid" 2>/dev/null) || continue
    # The librarian can sit in a retry loop that ignores SIGTERM: what is left is killed.
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  done
}

case "${1:-}" in
  path)
    install
    echo "$cache"
    ;;
  start)
    start "${2:?usage: librarian.sh start DIR PULSAR_URL}" "${3:?usage: librarian.sh start DIR PULSAR_URL}"
    ;;
  stop)
    stop "${2:?usage: librarian.sh stop DIR}"
    ;;
  *)
    echo "usage: librarian.sh path | start DIR PULSAR_URL | stop DIR" >&2
    exit 2
    ;;
esac
