"""Extism plugins against kiproxy's own Wasm ABI and Python: the cost per record.

Run from the repository root with the project's virtualenv (Node.js and npm build
the AssemblyScript plugins the first time; they are cached)::

    python -m bench.extism             # about 30 seconds; prints a Markdown table
    python -m bench.extism --quick     # shorter repeats, for a smoke test

One batch of ``--records`` records (16-byte keys, one header, lower-case values
of 100 B and of 1 KiB) is upper-cased again and again; wall time per record
(``time.perf_counter``, one thread, nothing else running in the process) is
reported - median of three interleaved repeats. Rows:

* **Extism, a call per record** - the extism interceptor's call path
  (``ExtismPlugin.run``: JSON out, the ``transform`` export, JSON back) with the
  AssemblyScript ``uppercase`` test plugin; the worker-thread hop the proxy adds
  per batch is not included.
* **Extism, batch export** - the same plugin's ``transform_batch`` (a JSON array).
* **kiproxy Wasm ABI v1 / v2** - ``examples/wasm/uppercase.wat`` (binary layout)
  in the wasm interceptor, inline.
* **Python, per record** - a plain Python plugin rebuilding each record with
  ``value.upper()``; **Python Uppercase** - the built-in (compiled loop).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiproxy.interceptors import InterceptContext, Record, RecordBatch
from kiproxy.interceptors.builtin.uppercase import Uppercase, UppercaseSettings
from kiproxy.interceptors.builtin.wasm.interceptor import WasmInterceptor, WasmSettings

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent


def _batch(records: int, size: int) -> RecordBatch:
    value = (b"lower case text " * (size // 16 + 1))[:size]
    return RecordBatch(topic="bench", partition=0, records=tuple(
        Record(key=f"key-{i:012d}".encode(), value=value, headers=[("source", b"bench")],
               timestamp=1_700_000_000_000 + i, offset_delta=i) for i in range(records)))


def _ctx() -> InterceptContext:
    return InterceptContext(client_id="bench", client_address="127.0.0.1:1", principal=None,
                            api_version=9, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + 3600)


class PythonPerRecord:
    """A Python plugin doing the same work record by record."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Upper-case each value."""
        return batch.with_records(
            Record(key=r.key, value=None if r.value is None else r.value.upper(),
                   headers=r.headers, timestamp=r.timestamp, offset_delta=r.offset_delta)
            for r in batch.records)


def _extism(wasm: Path, batch_function: str | None) -> Callable[[RecordBatch], Any]:
    from kiproxy.interceptors.builtin.extism.plugin import Cancel, ExtismPlugin, PluginSpec

    plugin = ExtismPlugin(PluginSpec(source=str(wasm), batch_function=batch_function),
                          "bench")
    return lambda batch: plugin.run(batch, Cancel())


def _wasm(function: str, abi: int) -> Callable[[RecordBatch], Any]:
    plugin = WasmInterceptor()
    plugin.configure(WasmSettings.model_validate(
        {"module": str(ROOT / "examples" / "wasm" / "uppercase.wat"), "function": function,
         "abi": abi, "encoding": "binary", "threaded": False, "fuel": 10**12}))
    ctx = _ctx()
    return lambda batch: plugin.intercept(batch, ctx)


def _python(plugin: Any) -> Callable[[RecordBatch], Any]:
    ctx = _ctx()
    return lambda batch: plugin.intercept(batch, ctx)


def _per_record_us(call: Callable[[RecordBatch], Any], batch: RecordBatch,
                   target: float) -> float:
    out = call(batch)  # warm up; and check that it upper-cases
    assert out.records[0].value == (batch.records[0].value or b"").upper(), out.records[0]
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < target:
        call(batch)
        done += len(batch.records)
    return (time.perf_counter() - started) / done * 1e6


def main(argv: list[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.extism", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100, help="records per batch")
    parser.add_argument("--target", type=float, default=1.0, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="0.2 s repeats")
    args = parser.parse_args(argv)
    target = 0.2 if args.quick else args.target
    sys.path.insert(0, str(ROOT / "tests"))
    wasm = importlib.import_module("support.extism_plugins").build()["uppercase"]
    baseline = Uppercase()
    baseline.configure(UppercaseSettings())
    rows: list[tuple[str, Callable[[RecordBatch], Any]]] = [
        ("Extism, a call per record (transform)", _extism(wasm, None)),
        ("Extism, batch export (transform_batch)", _extism(wasm, "transform_batch")),
        ("kiproxy Wasm ABI v1 (uppercase.wat, binary)", _wasm("transform", 1)),
        ("kiproxy Wasm ABI v2 (uppercase.wat, binary)", _wasm("transform_batch", 2)),
        ("Python plugin, per record", _python(PythonPerRecord())),
        ("Python Uppercase (built-in)", _python(baseline)),
    ]
    sizes = (100, 1024)
    samples: dict[tuple[str, int], list[float]] = {}
    for size in sizes:
        batch = _batch(args.records, size)
        for _ in range(3):  # interleaved, so drift in machine speed hits every row alike
            for name, call in rows:
                samples.setdefault((name, size), []).append(
                    _per_record_us(call, batch, target))
    print(f"{args.records} records per batch; microseconds per record (wall), median of 3\n")
    print("| interceptor | 100 B | 1 KiB |")
    print("|---|---:|---:|")
    for name, _ in rows:
        cells = [f"{statistics.median(samples[name, size]):.2f}" for size in sizes]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
