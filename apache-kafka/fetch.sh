#!/usr/bin/env bash
# `make kafka`: the Apache Kafka jars named in apache-kafka/pom.xml, resolved from Maven Central
# into a folder laid out like an unpacked Kafka distribution:
#
#   ${KIPROXY_KAFKA_CACHE:-$HOME/.cache/kiproxy/kafka}/kafka_2.13-<version>/
#       libs/*.jar                    the broker, kafka-tools, kafka-clients, log4j2, and their dependencies
#       config/log4j2.yaml            broker logging (stdout)
#       config/tools-log4j2.yaml      tool logging (stderr, warnings only)
#       .kiproxy-complete             stamp: the version and a hash of the pom and config
#
# The folder's path is the last line printed. A folder whose stamp matches is used as it
# is, without Maven (so a filled cache works offline). When Maven cannot resolve, the
# artifacts it could not get are printed and the exit status is 1.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pom="$here/pom.xml"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom" | head -n 1)"
if [ -z "$version" ]; then
    echo "apache-kafka/fetch.sh: no <kafka.version> property in $pom" >&2
    exit 1
fi
cache="${KIPROXY_KAFKA_CACHE:-$HOME/.cache/kiproxy/kafka}"
home="$cache/kafka_2.13-$version"
stamp="$home/.kiproxy-complete"
# The stamp changes whenever the pom or the shipped config does, so an edit refetches.
want="$(printf '%s\n' "$version"; cat "$pom" "$here"/config/*.yaml | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$home/libs/kafka_2.13-$version.jar" ]; then
    echo "$home"
    exit 0
fi

mkdir -p "$cache"
partial="$(mktemp -d "$cache/.partial.XXXXXX")"
trap 'rm -rf "$partial"' EXIT
mvn_log="$partial/maven.log"
echo "Resolving Apache Kafka $version from Maven Central (apache-kafka/pom.xml) ..." >&2
if ! mvn -B -q -f "$pom" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$partial/libs" >"$mvn_log" 2>&1; then
    echo "apache-kafka/fetch.sh: Maven could not resolve Apache Kafka $version's jars." >&2
    # Maven names each missing artifact as group:artifact:type:version in its errors.
    failed="$(grep -oE "(Could not (find|transfer|resolve) artifact|Failure to find|Missing artifact) [^ ]+" "$mvn_log" | sort -u || true)"
    if [ -n "$failed" ]; then
        echo "$failed" >&2
    else
        grep -E "ERROR" "$mvn_log" | head -n 20 >&2 || tail -n 20 "$mvn_log" >&2
    fi
    exit 1
fi
if [ ! -f "$partial/libs/kafka_2.13-$version.jar" ]; then
    echo "apache-kafka/fetch.sh: Maven finished but libs/kafka_2.13-$version.jar is missing" >&2
    exit 1
fi
mkdir -p "$partial/config"
cp "$here"/config/*.yaml "$partial/config/"
printf '%s\n' "$want" >"$partial/.kiproxy-complete"
rm -f "$mvn_log"

# Swap the finished folder in whole, so a reader never sees half a distribution.
rm -rf "$home"
chmod 755 "$partial"
mv "$partial" "$home"
trap - EXIT
echo "$home"
