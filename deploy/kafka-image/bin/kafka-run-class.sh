#!/bin/sh
# kafka-run-class.sh CLASS ARGS...: the distribution's libs on the class path.
# shellcheck disable=SC2086
exec java ${KAFKA_HEAP_OPTS:--Xmx256m} ${KAFKA_OPTS:-} -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="${KAFKA_LOG4J_CONFIG:-/opt/kafka/config/tools-log4j2.yaml}" \
    -cp "/opt/kafka/libs/*" "$@"
