#!/usr/bin/env bash
# The runtime jars of one Maven pom, fetched from Maven Central into a folder once (idempotent, quiet
# when done), after installing a JDK and Maven when either is missing. The scripts that run a JVM
# service for the tests use it (apache-pulsar.sh, fuseki.sh, librarian.sh).
#   maven-jars.sh POM DIR WHAT    WHAT: what is fetched, for the one line said while fetching
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pom=$1
dir=$2
what=$3
[ -f "$dir/.complete" ] && exit 0
# Two tests may ask at once on a machine set up by neither: one fetches, the other waits.
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
[ -f "$dir/.complete" ] && exit 0
if ! command -v java >/dev/null 2>&1 || ! command -v mvn >/dev/null 2>&1; then
  echo "maven-jars: installing a JDK and Maven" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jdk-headless maven >/dev/null
fi
echo "fetching $what from Maven Central (once)" >&2
rm -rf "$dir"
mkdir -p "$dir"
log="$dir/../$(basename "$dir")-fetch.log"
if ! mvn -B -q -s "$here/apache-pulsar/settings.xml" -f "$pom" \
  dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$dir" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
touch "$dir/.complete"
