#!/bin/sh
# Start one KRaft node from the environment, as apache/kafka's /etc/kafka/docker/run does:
# every KAFKA_* variable (but the JVM's) is a setting, KAFKA_FOO_BAR -> foo.bar,
# with __ -> _ and ___ -> - (as the official image's KafkaDockerWrapper does).
set -eu
props=/tmp/server.properties
env | sed -n 's/^KAFKA_\([A-Z0-9_]*\)=\(.*\)$/\1=\2/p' \
    | grep -Ev '^(HEAP_OPTS|OPTS|JVM_PERFORMANCE_OPTS|LOG4J_OPTS|LOG4J_CONFIG|GC_LOG_OPTS|JMX_OPTS|DEBUG)=' \
    | while IFS='=' read -r name value; do
        key="$(printf '%s' "$name" | tr 'A-Z' 'a-z' \
            | sed 's/___/-/g; s/__/@/g; s/_/./g; s/@/_/g')"
        printf '%s=%s\n' "$key" "$value"
    done > "$props"
: "${CLUSTER_ID:?set CLUSTER_ID (the Compose file does)}"
/opt/kafka/bin/kafka-run-class.sh kafka.tools.StorageTool format --ignore-formatted \
    -t "$CLUSTER_ID" -c "$props"
KAFKA_LOG4J_CONFIG=/opt/kafka/config/log4j2.yaml exec /opt/kafka/bin/kafka-run-class.sh \
    kafka.Kafka "$props"
