"""``kiproxy check``: load a plugin as the proxy would, run it over samples, say what happens.

Exit status: 0 when the plugin loads, configures and answers every sample
batch (a ``RejectBatch`` is an answer); 2, with the reason on stderr, when it
cannot be loaded or configured, when the sample file cannot be read, or when
the plugin fails on a batch (raises, breaks the record-count rule, returns
something else than a batch, misses the deadline, rejects with ``record_errors``
naming no record of the batch) - and, with
``--fail-on-reject``, when any batch is rejected (a Wasm module's trap or running
out of memory is a failure of the plugin). ``--mode observe`` runs the plugin as a route
in observe mode would: each batch is reported as forwarded as it came, followed
by what it would have been, in the same words (and counted, and failed on, as
it would have been). A plugin repository's CI job can run it as is.

A plugin with a fetch-side hook (``on_consume``) is run on the fetch side too: each
batch as the broker would store it (what the produce side forwarded; the sample itself
for a fetch-side-only plugin) is handed to ``on_consume`` by the proxy's rules
(:func:`kiproxy.interceptors.testing.run_consume`), and what a consumer through the
proxy would read is reported - with "the consumer reads what was produced" when a
plugin on both hooks gives back the records as produced (a round trip, as encryption
does). A hook that fails (raises, changes the record count or an offset, misses the
deadline) exits 2; a ``RefuseFetch`` is an answer, counted as refused (and a failure
with ``--fail-on-reject``).

Loading is the proxy's (:func:`kiproxy.interceptors.testing.load`, the
loader of ``kiproxy run``) and so is every verdict
(:func:`kiproxy.interceptors.testing.run_interceptor`). A ``.wasm`` or
``.wat`` path in place of ``MODULE:CLASS`` is short for the ``wasm``
interceptor with that ``module``.

Sample file (``--sample``): JSON Lines, one record per line::

    {"key": "order-1", "value": "card 4111 1111 1111 1111", "headers": [["src", "web"]]}
    {"value": {"b64": "AAEC"}, "topic": "payments", "partition": 1}

``key``, ``value`` and header values are text (sent as UTF-8), ``null``, or
``{"b64": "..."}`` for any bytes (the Wasm JSON encoding's spelling); every
field is optional, ``timestamp`` (ms) too. ``topic`` (default ``--topic``)
and ``partition`` (default 0) pick the batch: consecutive lines for the same
topic-partition form one batch. Blank lines are skipped. Without
``--sample`` a few built-in records are used: text, a card number, JSON,
binary bytes, a null value, headers. Results are printed in the same format.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kiproxy.interceptors.api import Record, RecordBatch, header_key_text
from kiproxy.interceptors.consume import ConsumedBatch, consume_hook, produce_hook
from kiproxy.interceptors.errors import error_name
from kiproxy.interceptors.flags import (
    INTERCEPTOR_CONFIG,
    INTERCEPTOR_TIMEOUT,
    PLUGINS_DIR,
    FlagError,
    add_flag,
    json_object,
)
from kiproxy.interceptors.json_spelling import spell_bytes
from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.interceptors.testing import (
    DEFAULT_TIMEOUT_MS,
    ConsumeRefusal,
    Outcome,
    Plugin,
    load,
    make_batch,
    make_consumed_batch,
    make_record,
    run_interceptor,
)
from kiproxy.interceptors.verdict import Rejected, stray_text

__all__ = ["COMMANDS", "CheckFailed", "add_parsers", "read_samples", "run"]

COMMANDS = ("check",)
_WASM_SUFFIXES = (".wasm", ".wat")


class CheckFailed(Exception):
    """The plugin or the input cannot be checked; the message says why."""


def add_parsers(subparsers: Any) -> None:
    """Add ``check`` to ``kiproxy``'s subcommands."""
    check = subparsers.add_parser(
        "check", help="load an interceptor as the proxy would and run it over sample records",
        description="Load and configure an interceptor as the proxy would, run it over "
                    "sample records and print what each batch would become. Exit 0 when it "
                    "loads and answers every batch, 2 with the reason when it does not.")
    check.add_argument("spec", metavar="MODULE:CLASS",
                       help="the interceptor (as --interceptor takes it), or a .wasm/.wat file")
    # The plugin flags of `kiproxy run` and `replay`, under check's own spellings.
    add_flag(check, PLUGINS_DIR)
    add_flag(check, INTERCEPTOR_CONFIG.renamed("--config"))
    check.add_argument("--sample", metavar="FILE",
                       help="JSON Lines file of records (default: built-in samples)")
    check.add_argument("--topic", metavar="TOPIC", default="check",
                       help="topic of records that name none (default: check)")
    check.add_argument("--fail-on-reject", action="store_true",
                       help="exit 2 when any sample batch is rejected (for samples that must "
                            "pass; a Wasm module's trap is such a rejection)")
    add_flag(check, INTERCEPTOR_TIMEOUT.renamed("--timeout-ms"), default=DEFAULT_TIMEOUT_MS)
    check.add_argument("--mode", choices=("enforce", "observe"), default="enforce",
                       help="a route's mode: observe forwards every batch as it came and "
                            "reports what the verdict would have done (default enforce)")


def _bytes(value: Any, what: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict) and set(value) == {"b64"} and isinstance(value["b64"], str):
        try:
            return base64.b64decode(value["b64"], validate=True)
        except binascii.Error as exc:
            raise ValueError(f"{what}: {{\"b64\": ...}} is not base64 ({exc})") from None
    raise ValueError(f"{what} must be a string, null or {{\"b64\": \"...\"}}, "
                     f"not {json.dumps(value)}")


def _sample_record(doc: Any, offset_delta: int) -> tuple[str | None, int, Record]:
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    unknown = set(doc) - {"key", "value", "headers", "timestamp", "topic", "partition"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}; known: key, value, "
                         "headers, timestamp, topic, partition")
    headers = doc.get("headers", [])
    if not isinstance(headers, list) or not all(
            isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) for h in headers):
        raise ValueError('headers must be a list of [name, value] pairs, e.g. [["src", "web"]]')
    topic, partition, timestamp = doc.get("topic"), doc.get("partition", 0), doc.get("timestamp")
    if topic is not None and not isinstance(topic, str):
        raise ValueError("topic must be a string")
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise ValueError("partition must be an integer")
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, int)):
        raise ValueError("timestamp must be an integer (ms since the epoch)")
    record = make_record(
        _bytes(doc.get("value"), "value"), key=_bytes(doc.get("key"), "key"),
        headers=[(name, _bytes(v, f"header {name!r}")) for name, v in headers],
        timestamp=timestamp, offset_delta=offset_delta)
    return topic, partition, record


def read_samples(path: str | Path, topic: str) -> list[RecordBatch]:
    """The batches of a JSON Lines sample file (see the module docstring)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckFailed(f"cannot read sample file {path}: {exc}") from None
    groups: list[tuple[str, int, list[Record]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            at = len(groups[-1][2]) if groups else 0
            record_topic, partition, record = _sample_record(doc, at)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise CheckFailed(f"sample file {path} line {number}: {exc}") from None
        record_topic = record_topic or topic
        if not groups or groups[-1][:2] != (record_topic, partition):
            groups.append((record_topic, partition, []))
            record = record.with_offset_delta(0)
        groups[-1][2].append(record)
    if not groups:
        raise CheckFailed(f"sample file {path} holds no records")
    return [make_batch(records=records, topic=t, partition=p) for t, p, records in groups]


def builtin_samples(topic: str) -> list[RecordBatch]:
    """Typical records (text, a card number, JSON, binary, a null value, headers), then a
    batch of one upper-case value."""
    return [make_batch(
        "hello, world",
        make_record("card 4111 1111 1111 1111 paid", key="order-1",
                    headers=[("src", "web"), ("trace", None)], offset_delta=1),
        make_record('{"id": 1, "kind": "order"}', key="order-2", offset_delta=2),
        make_record(b"\x00\x01\xfe\xff", offset_delta=3),
        make_record(None, key="tombstone", offset_delta=4),
        topic=topic), make_batch("PLEASE READ THIS", topic=topic)]


_json_bytes = spell_bytes("tagged")
"""Bytes as the Wasm JSON encoding spells them (text, else ``{"b64": ...}``)."""


SHOWN_BYTES = 1024
"""Bytes of a key, value or header value a record line shows; the rest is counted."""


def _shown(data: bytes | None) -> object:
    """``data`` as a record line spells it, cut to :data:`SHOWN_BYTES` (a plugin's output may
    be megabytes: the line says how many bytes were left out)."""
    if data is None or len(data) <= SHOWN_BYTES:
        return _json_bytes(data)
    cut = SHOWN_BYTES
    while cut > SHOWN_BYTES - 3 and data[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character
        cut -= 1
    return {"first": _json_bytes(data[:cut]), "bytes": len(data)}


def _record_line(record: Record) -> str:
    return json.dumps({"key": _shown(record.key), "value": _shown(record.value),
                       "headers": [[header_key_text(h.key), _shown(h.value)]
                                   for h in record.headers],
                       "timestamp": record.timestamp}, ensure_ascii=False)


def _record_error(index: int, message: str | None) -> str:
    """``record N: MESSAGE``, once: a plugin may have written the prefix itself (as the
    schema_registry interceptor does, for the producer's log)."""
    prefix = f"record {index}"
    if message is None:
        return prefix
    return message if message.startswith(prefix + ":") else f"{prefix}: {message}"


def _report(number: int, batch: RecordBatch, outcome: Outcome, out: TextIO) -> None:
    where = f"batch {number}: {batch.topic}[{batch.partition}], {_records(len(batch))}"
    if outcome.would is not None:  # observe mode: what it would have been, said the same way
        where += ": forwarded as it came (observe mode); would have been"
        outcome = outcome.would
    if outcome.kind == "rejected":
        print(f"{where}: rejected with {outcome.error} ({outcome.code}): {outcome.message}",
              file=out)
        for index, message in outcome.record_errors:
            print(f"  {_record_error(index, message)}", file=out)
        stray = _stray(outcome)
        if stray:
            print(f"  record_errors naming no record of the batch, left out: {stray}",
                  file=out)
        return
    if outcome.kind == "unchanged":
        print(f"{where}: forwarded unchanged", file=out)  # observed: the same words
        return
    changed = [i for i, (a, b) in enumerate(zip(batch.records, outcome.records, strict=True))
               if a != b]
    print(f"{where}: transformed ({len(changed)} changed)", file=out)
    for index in changed:
        print(f"  record {index}: {_record_line(outcome.records[index])}", file=out)


def _stray(outcome: Outcome) -> str:
    """The record errors of a rejection that name no record of its batch, or ''."""
    verdict = outcome.verdict
    if not isinstance(verdict, Rejected) or not verdict.stray_record_errors:
        return ""
    return stray_text(verdict.stray_record_errors)


def _report_fetch(number: int, batch: RecordBatch, stored: tuple[Record, ...],
                  fetched: ConsumedBatch | ConsumeRefusal, produced: bool, out: TextIO) -> str:
    """Print what a consumer through the proxy would read of ``stored``; return the kind.
    Without a produce-side line before it (``produced`` false) the line names the batch."""
    where = (f"batch {number}: fetched" if produced else
             f"batch {number}: {batch.topic}[{batch.partition}], {_records(len(batch))}: fetched")
    if isinstance(fetched, ConsumeRefusal):
        print(f"{where}: refused with {error_name(fetched.code)} ({fetched.code}): "
              f"{fetched.message}", file=out)
        return "refused"
    if fetched.records is stored:
        print(f"{where}: unchanged", file=out)
        return "unchanged"
    changed = [i for i, (a, b) in enumerate(zip(stored, fetched.records, strict=True))
               if a != b]
    round_trip = produced and fetched.records == batch.records
    print(f"{where}: transformed ({len(changed)} changed)"
          + ("; the consumer reads what was produced" if round_trip else ""), file=out)
    if not round_trip:
        for index in changed:
            print(f"  record {index}: {_record_line(fetched.records[index])}", file=out)
    return "transformed"


def _records(n: int) -> str:
    return f"{n} record" if n == 1 else f"{n} records"


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def _plugin(args: argparse.Namespace) -> Plugin:
    config: dict[str, Any] = {}
    if args.config:
        try:  # the rule of --interceptor-config: inline JSON, or a JSON or YAML file
            config = json_object("--config")(args.config)
        except FlagError as exc:
            raise CheckFailed(str(exc)) from None
    spec = args.spec
    if spec.endswith(_WASM_SUFFIXES) and ":" not in spec:
        config = {"module": spec, **config}
        spec = "wasm"
    try:
        return load(spec, plugins_dir=args.plugins_dir, config=config)
    except PluginLoadError as exc:
        raise CheckFailed(str(exc)) from None


def check(args: argparse.Namespace, out: TextIO) -> None:
    """Load, run and report; raises :class:`CheckFailed` with the reason to exit 2."""
    batches = (read_samples(args.sample, args.topic) if args.sample
               else builtin_samples(args.topic))
    with _plugin(args) as plugin:
        produces = produce_hook(plugin.interceptor) is not None
        # As the proxy: a route or link in observe mode runs no fetch-side hook.
        has_consume = consume_hook(plugin.interceptor) is not None
        observed_out = args.mode == "observe" and has_consume
        consumes = has_consume and not observed_out
        faults: list[str] = []
        counts = {"unchanged": 0, "transformed": 0, "rejected": 0}
        fetch_counts = {"unchanged": 0, "transformed": 0, "refused": 0}
        for number, batch in enumerate(batches, 1):
            stored = batch.records
            if produces:
                outcome = run_interceptor(plugin, batch, timeout_ms=args.timeout_ms,
                                          mode=args.mode)
                _report(number, batch, outcome, out)
                verdict = outcome.would or outcome  # observe mode: counted as it would be
                counts[verdict.kind] += 1
                if verdict.fault is not None or (args.fail_on_reject
                                                 and not verdict.forwarded):
                    faults.append(f"batch {number}: {(outcome.message or '').rstrip('.')}")
                elif stray := _stray(verdict):
                    faults.append(f"batch {number}: rejected with record_errors naming no "
                                  f"record of its {_records(len(batch))}: {stray}")
                if outcome.kind == "rejected":
                    continue  # nothing stored: nothing to fetch
                stored = outcome.records
            if consumes:
                fetched = plugin.consume(make_consumed_batch(batch.with_records(stored)),
                                         timeout_ms=args.timeout_ms)
                kind = _report_fetch(number, batch, stored, fetched, produces, out)
                fetch_counts[kind] += 1
                if isinstance(fetched, ConsumeRefusal) and (
                        fetched.reason != "refused" or args.fail_on_reject):
                    faults.append(f"batch {number} fetched: {fetched.message.rstrip('.')}")
    would = "would be " if args.mode == "observe" else ""
    parts = []
    if produces:
        parts.append(", ".join(f"{n} {would}{kind}" for kind, n in counts.items())
                     + (" (observe mode: every batch forwarded as it came)" if would else ""))
    if consumes:
        parts.append("fetched: " + ", ".join(f"{n} {kind}" for kind, n in fetch_counts.items()))
    if observed_out:
        parts.append("fetch side not run (observe mode runs no fetch-side hook: consumers "
                     "read what is stored)")
    print(f"{plugin.name}: loaded; {_batches(len(batches))}: {'; '.join(parts)}", file=out)
    if faults:
        raise CheckFailed(f"{plugin.name} failed on {len(faults)} of {_batches(len(batches))}"
                          + (" (--fail-on-reject)" if args.fail_on_reject else "") + ": "
                          + "; ".join(faults))


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``kiproxy check``; returns the exit code (0 or 2)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check(args, out or sys.stdout)
    except CheckFailed as exc:
        print(f"kiproxy check: {exc}", file=err or sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kiproxy check`` on its own (``python -m kiproxy.interceptors.check``)."""
    parser = argparse.ArgumentParser(prog="kiproxy")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["check", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
