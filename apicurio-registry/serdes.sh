#!/usr/bin/env bash
# `make registry-serdes`: Apicurio Registry's Java Avro serde (version pinned in
# apicurio-registry/serdes/pom.xml) and the jars it needs on top of an Apache Kafka
# distribution's libs, copied from Maven Central into
#
#   ${KIPROXY_REGISTRY_CACHE:-$HOME/.cache/kiproxy/registry}/apicurio-serdes-<version>/
#       libs/*.jar          the serde, its registry client, Avro
#       .kiproxy-complete   stamp: the version and a hash of the pom
#
# The last line printed is the libs folder. A folder whose stamp matches is used as it is,
# without Maven. When Maven fails, its errors are printed and the exit status is 1.
# tests/support/apicurio_producer.py compiles tests/java/ApicurioProducer.java against it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pom="$here/serdes/pom.xml"
version="$(sed -n 's:.*<serdes.version>\(.*\)</serdes.version>.*:\1:p' "$pom" | head -n 1)"
if [ -z "$version" ]; then
    echo "apicurio-registry/serdes.sh: no <serdes.version> property in $pom" >&2
    exit 1
fi
cache="${KIPROXY_REGISTRY_CACHE:-$HOME/.cache/kiproxy/registry}"
home="$cache/apicurio-serdes-$version"
stamp="$home/.kiproxy-complete"
want="$(printf '%s\n' "$version"; sha256sum <"$pom" | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -d "$home/libs" ]; then
    echo "$home/libs"
    exit 0
fi

if ! command -v mvn >/dev/null 2>&1; then
    echo "apicurio-registry/serdes.sh: 'mvn' not found: resolving the Apicurio serde needs Maven (Debian: apt-get install maven)" >&2
    exit 1
fi
mkdir -p "$cache"
partial="$(mktemp -d "$cache/.partial-serdes.XXXXXX")"
trap 'rm -rf "$partial"' EXIT
mvn_log="$partial/maven.log"
echo "Resolving the Apicurio Registry $version Avro serde from Maven Central (apicurio-registry/serdes/pom.xml) ..." >&2
if ! mvn -B -q -f "$pom" dependency:copy-dependencies -DoutputDirectory="$partial/libs" \
        >"$mvn_log" 2>&1; then
    echo "apicurio-registry/serdes.sh: Maven could not resolve the Apicurio serde $version." >&2
    failed="$(grep -oE "(Could not (find|transfer|resolve) artifact|Failure to find|Missing artifact) [^ ]+" "$mvn_log" | sort -u || true)"
    if [ -n "$failed" ]; then
        echo "$failed" >&2
    else
        grep -E "ERROR" "$mvn_log" | head -n 20 >&2 || tail -n 20 "$mvn_log" >&2
    fi
    exit 1
fi
rm -f "$mvn_log"
printf '%s\n' "$want" >"$partial/.kiproxy-complete"
rm -rf "$home"
chmod 755 "$partial"
mv "$partial" "$home"
trap - EXIT
echo "$home/libs"
