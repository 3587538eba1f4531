"""What the proxy tells operators: logs, metrics, the audit log, rejection lines, the
observer hub and the side-copy sinks (dead-letter copies, audit events); imports no other
package of the proxy but the configuration model."""
