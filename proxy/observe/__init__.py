"""What the proxy tells operators: logs, metrics, the audit log, rejection lines, the
observer hub and the dead-letter sink; imports no other package of the proxy but the
configuration model."""
