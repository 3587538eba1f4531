"""Structured logs: one line per event, ``key=value`` pairs or a JSON object.

``--log-format text`` (default) writes ``ts=... level=... logger=... msg="..."``
followed by any context fields; ``--log-format json`` writes the same fields as
one JSON object per line. Connection-level lines carry ``client_address`` and
``client_id`` as fields (pass them with ``extra=``), and the message text names
them too so a plain reader sees them.
"""

from __future__ import annotations

import json
import logging
import time

__all__ = ["CONTEXT_FIELDS", "JsonFormatter", "KeyValueFormatter", "setup_logging"]

CONTEXT_FIELDS = ("client_address", "client_id", "principal", "topic", "partition", "node_id")
"""``extra=`` fields that are written when a log call sets them."""


def _fields(record: logging.LogRecord) -> dict[str, object]:
    out: dict[str, object] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for name in CONTEXT_FIELDS:
        value = record.__dict__.get(name)
        if value is not None:
            out[name] = value
    return out


def _kv(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``key=value`` lines (logfmt)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        line = " ".join(f"{k}={_kv(v)}" for k, v in fields.items())
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


def setup_logging(level: str, fmt: str) -> None:
    """Send the root logger's records to stderr in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
