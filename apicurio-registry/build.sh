#!/usr/bin/env bash
# `make registry`: Apicurio Registry (version pinned in apicurio-registry/pom.xml), built from
# Maven Central as a Quarkus fast-jar application into
#
#   ${KIPROXY_REGISTRY_CACHE:-$HOME/.cache/kiproxy/registry}/apicurio-registry-<version>/
#       quarkus-app/quarkus-run.jar   the runnable application (java -jar)
#       .kiproxy-complete             stamp: the version and a hash of the pom
#
# The last line printed is the path of quarkus-run.jar. A folder whose stamp matches is used
# as it is, without Maven (so a filled cache works offline). When Maven fails, its errors are
# printed and the exit status is 1. Run the jar with in-memory storage (the default) on
# 127.0.0.1, e.g.:
#   java -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port=8081 \
#        -Dregistry.rules.global.compatibility=BACKWARD -jar <quarkus-run.jar>
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pom="$here/pom.xml"
version="$(sed -n 's:.*<registry.version>\(.*\)</registry.version>.*:\1:p' "$pom" | head -n 1)"
if [ -z "$version" ]; then
    echo "apicurio-registry/build.sh: no <registry.version> property in $pom" >&2
    exit 1
fi
cache="${KIPROXY_REGISTRY_CACHE:-$HOME/.cache/kiproxy/registry}"
home="$cache/apicurio-registry-$version"
stamp="$home/.kiproxy-complete"
jar="$home/quarkus-app/quarkus-run.jar"
# The stamp changes whenever the pom does, so an edit rebuilds.
want="$(printf '%s\n' "$version"; sha256sum <"$pom" | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$jar" ]; then
    echo "$jar"
    exit 0
fi

for tool in java mvn; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "apicurio-registry/build.sh: '$tool' not found: the registry build needs Java 17+ and Maven (Debian: apt-get install openjdk-17-jre-headless maven)" >&2
        exit 1
    fi
done
mkdir -p "$cache"
partial="$(mktemp -d "$cache/.partial.XXXXXX")"
trap 'rm -rf "$partial"' EXIT
cp "$pom" "$partial/pom.xml"
mvn_log="$partial/maven.log"
echo "Building Apicurio Registry $version from Maven Central (apicurio-registry/pom.xml; about a minute cold) ..." >&2
# The app's own application.properties sets %prod.quarkus.package.type=legacy-jar; a system
# property of the same profile overrides it.
if ! mvn -B -q -f "$partial/pom.xml" package -DskipTests \
        '-D%prod.quarkus.package.type=fast-jar' >"$mvn_log" 2>&1; then
    echo "apicurio-registry/build.sh: Maven could not build Apicurio Registry $version." >&2
    failed="$(grep -oE "(Could not (find|transfer|resolve) artifact|Failure to find|Missing artifact) [^ ]+" "$mvn_log" | sort -u || true)"
    if [ -n "$failed" ]; then
        echo "$failed" >&2
    else
        grep -E "ERROR" "$mvn_log" | head -n 20 >&2 || tail -n 20 "$mvn_log" >&2
    fi
    exit 1
fi
if [ ! -f "$partial/target/quarkus-app/quarkus-run.jar" ]; then
    echo "apicurio-registry/build.sh: Maven finished but target/quarkus-app/quarkus-run.jar is missing" >&2
    exit 1
fi
mv "$partial/target/quarkus-app" "$partial/quarkus-app"
rm -rf "$partial/target" "$mvn_log"
printf '%s\n' "$want" >"$partial/.kiproxy-complete"

# Swap the finished folder in whole, so a reader never sees half an application.
rm -rf "$home"
chmod 755 "$partial"
mv "$partial" "$home"
trap - EXIT
echo "$jar"
