"""What the proxy tells operators: logs, metrics, the audit log, rejection lines and
the observer hub; imports no other package of the proxy."""
