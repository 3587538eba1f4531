"""Helpers the tests share that are not fixtures: Apache Kafka's Java client, driven from Python."""
