#!/usr/bin/env bash
# The runtime jars of one Maven pom, fetched from Maven Central into a folder once (idempotent, quiet
# when done), after installing a JDK and Maven when either is missing. The scripts that run a JVM
# service for the tests use it (apache-pulsar.sh, fuseki.sh, librarian.sh).
#   maven-jars.sh POM DIR WHAT    WHAT: what is fetched, for the one line said while fetching
# Every jar is checked against `jars.sha256` beside the pom (`sha256sum` lines, one a jar, no other
# jar allowed): what runs is what was tested, whatever the repository or the cache serves. Maven's
# own check against the repository's checksums is strict too (-C). A folder fetched before the list
# changed is checked again, and fetched afresh only if it differs. After changing the pom, write the
# list again from a fresh fetch: `(cd DIR && sha256sum *.jar) > jars.sha256`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pom=$1
dir=$2
what=$3
manifest="$(dirname "$pom")/jars.sha256"
[ -f "$manifest" ] || { echo "maven-jars: no $manifest (the jars' pinned sha256)" >&2; exit 1; }
pinned=$(sha256sum "$manifest" | cut -d' ' -f1)
[ "$(cat "$dir/.complete" 2>/dev/null)" = "$pinned" ] && exit 0

# The folder holds exactly the pinned jars, each with its pinned sha256.
matches() {
  [ -d "$dir" ] || return 1
  [ "$(cd "$dir" && find . -maxdepth 1 -name '*.jar' | sed 's:^\./::' | sort)" \
    = "$(awk '{print $2}' "$manifest" | sed 's:^\*::' | sort)" ] || return 1
  (cd "$dir" && sha256sum --check --quiet --strict "$manifest" >/dev/null 2>&1)
}

# Two tests may ask at once on a machine set up by neither: one fetches, the other waits.
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
[ "$(cat "$dir/.complete" 2>/dev/null)" = "$pinned" ] && exit 0
if matches; then
  echo "$pinned" >"$dir/.complete"
  exit 0
fi
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
if ! mvn -B -q -C -s "$here/apache-pulsar/settings.xml" -f "$pom" \
  dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$dir" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
if ! matches; then
  echo "maven-jars: the jars fetched into $dir are not the ones pinned in $manifest:" >&2
  (cd "$dir" && sha256sum --check --quiet "$manifest" 2>&1 | head -20) >&2 || true
  # Jars on one side only (a pom that pulls in another dependency): named too.
  comm -3 <(cd "$dir" && find . -maxdepth 1 -name '*.jar' | sed 's:^\./::' | sort) \
    <(awk '{print $2}' "$manifest" | sed 's:^\*::' | sort) \
    | sed 's:^\t:  pinned, not fetched\: :; t; s:^:  fetched, not pinned\: :' >&2 || true
  exit 1
fi
echo "$pinned" >"$dir/.complete"
