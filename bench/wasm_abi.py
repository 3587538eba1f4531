"""WasmInterceptor throughput: ABI v1 (a call per record) against ABI v2 (a call per batch).

Run from the repository root with the project's virtualenv::

    python -m bench.wasm_abi             # about 20 seconds; prints a Markdown table
    python -m bench.wasm_abi --quick     # shorter repeats, for a smoke test

One batch of ``--records`` records (100-byte lower-case values, 16-byte keys,
one header) goes through ``intercept`` again and again, inline (``threaded:
false``), and records per second of CPU time (``time.process_time``) are
reported - median of three interleaved repeats. The baseline, measured in the
same run, is the built-in Python ``Uppercase`` interceptor doing the same work.

Rows:

* **uppercase.wat, binary** - ``examples/wasm/uppercase.wat``: ``transform``
  (v1) and ``transform_batch`` (v2), the binary layout.
* **echo.wat, binary / json** - ``tests/wasm/echo.wat`` returns its input: the
  cost of the host side of the ABI alone (encode, call, decode) per encoding.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiproxy.interceptors import InterceptContext, Record, RecordBatch
from kiproxy.interceptors.builtin.uppercase import Uppercase, UppercaseSettings
from kiproxy.interceptors.builtin.wasm.interceptor import WasmInterceptor, WasmSettings

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent


def _batch(records: int) -> RecordBatch:
    return RecordBatch(topic="bench", partition=0, records=tuple(
        Record(key=f"key-{i:012d}".encode(), value=(b"lower case text " * 7)[:100],
               headers=[("source", b"bench")], timestamp=1_700_000_000_000 + i, offset_delta=i)
        for i in range(records)))


def _ctx() -> InterceptContext:
    return InterceptContext(client_id="bench", client_address="127.0.0.1:1", principal=None,
                            api_version=9, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + 3600)


def _wasm(module: str, function: str, abi: int, encoding: str) -> WasmInterceptor:
    plugin = WasmInterceptor()
    plugin.configure(WasmSettings.model_validate(
        {"module": str(ROOT / module), "function": function, "abi": abi,
         "encoding": encoding, "threaded": False, "fuel": 10**12}))
    return plugin


def _rate(plugin: Any, batch: RecordBatch, target: float) -> float:
    ctx = _ctx()
    plugin.intercept(batch, ctx)  # warm up (instantiation)
    done = 0
    started = time.process_time()
    while time.process_time() - started < target:
        plugin.intercept(batch, ctx)
        done += len(batch.records)
    return done / (time.process_time() - started)


def main(argv: list[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.wasm_abi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=500, help="records per batch")
    parser.add_argument("--target", type=float, default=1.0, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="0.2 s repeats")
    args = parser.parse_args(argv)
    target = 0.2 if args.quick else args.target
    batch = _batch(args.records)

    baseline = Uppercase()
    baseline.configure(UppercaseSettings())
    rows: list[tuple[str, Callable[[], Any]]] = [
        ("Python Uppercase (baseline)", lambda: baseline),
        ("uppercase.wat, binary, ABI v1", lambda: _wasm(
            "examples/wasm/uppercase.wat", "transform", 1, "binary")),
        ("uppercase.wat, binary, ABI v2", lambda: _wasm(
            "examples/wasm/uppercase.wat", "transform_batch", 2, "binary")),
        ("echo.wat, binary, ABI v1", lambda: _wasm("tests/wasm/echo.wat", "echo_binary", 1,
                                                   "binary")),
        ("echo.wat, binary, ABI v2", lambda: _wasm("tests/wasm/echo.wat", "echo_binary", 2,
                                                   "binary")),
        ("echo.wat, json, ABI v1", lambda: _wasm("tests/wasm/echo.wat", "echo_json", 1, "json")),
        ("echo.wat, json, ABI v2", lambda: _wasm("tests/wasm/echo.wat", "echo_json", 2, "json")),
    ]
    plugins = [(name, make()) for name, make in rows]
    samples: dict[str, list[float]] = {name: [] for name, _ in plugins}
    for _ in range(3):  # interleaved, so drift in machine speed hits every row alike
        for name, plugin in plugins:
            samples[name].append(_rate(plugin, batch, target))
    base = statistics.median(samples[plugins[0][0]])
    print(f"{args.records} records per batch, 100-byte values; records/s of CPU time, "
          "median of 3\n")
    print("| interceptor | records/s | vs baseline |")
    print("|---|---:|---:|")
    for name, _ in plugins:
        rate = statistics.median(samples[name])
        print(f"| {name} | {rate:,.0f} | {rate / base:.3g}x |")
    for _, plugin in plugins:
        close = getattr(plugin, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    main()
