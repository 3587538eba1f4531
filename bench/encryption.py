"""Record encryption benchmark: CPU per record to seal and open values, data keys cached.

Run from the repository root with the project's virtualenv::

    python -m bench.encryption            # writes bench/RESULTS.md
    python -m bench.encryption --no-write # print only

Batches of 100 records with 100 B and 1 KiB values are sealed with
:meth:`~kiproxy.interceptors.builtin.record_encryption.RecordCipher.encrypt` and
opened with :meth:`~kiproxy.interceptors.builtin.record_encryption.RecordCipher.decrypt`
(one coroutine per batch on one event loop, as a hook calls them), data keys from a
key file and already cached, so no KMS call is measured. The baseline, measured in the
same run, is AES-256-GCM alone (``cryptography``'s ``AESGCM.encrypt`` of each value under
a fresh nonce): what the envelope adds on top of the cipher is the ratio.

CPU time is ``time.process_time`` on one thread; each cell is the median of five
repeats of about ``--target`` seconds each, the operations interleaved. Also given:
the bytes a sealed record adds (marker header with a key-file wrapped key, nonce, tag).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from bench.results import write_results
from kiproxy.interceptors import Record
from kiproxy.interceptors.builtin.record_encryption import (
    DataKeyCache,
    KeyFileKms,
    RecordCipher,
)
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file

__all__ = ["main"]

BATCH = 100
SIZES = (100, 1024)


def _cpu_us(op: Callable[[], Any], target: float) -> float:
    n = 1
    while True:
        start = time.process_time()
        for _ in range(n):
            op()
        spent = time.process_time() - start
        if spent >= target:
            return spent / n * 1e6
        n = max(n * 2, int(n * target / max(spent, 1e-6)))


def _operations(loop: asyncio.AbstractEventLoop, kms: KeyFileKms, size: int,
                ) -> tuple[dict[str, Callable[[], Any]], int]:
    records = [Record(key=b"key-%05d" % i, value=os.urandom(size), offset_delta=i)
               for i in range(BATCH)]
    writer = RecordCipher(DataKeyCache(kms))
    reader = RecordCipher(DataKeyCache(kms))
    sealed = loop.run_until_complete(writer.encrypt("orders", records, key_reference="KEK"))
    assert loop.run_until_complete(reader.decrypt("orders", sealed)) == tuple(records)
    added = (sum(len(r.value or b"") + sum(len(h.key) + len(h.value or b"")
                                           for h in r.headers) for r in sealed)
             - sum(len(r.value or b"") for r in records)) // BATCH
    aead, values = AESGCM(os.urandom(32)), [r.value or b"" for r in records]

    def aes_gcm_alone() -> None:
        for value in values:
            nonce = os.urandom(12)
            aead.encrypt(nonce, value, None)

    return {
        "encrypt (RecordCipher)": lambda: loop.run_until_complete(
            writer.encrypt("orders", records, key_reference="KEK")),
        "decrypt (RecordCipher)": lambda: loop.run_until_complete(
            reader.decrypt("orders", sealed)),
        "AES-256-GCM alone (baseline)": aes_gcm_alone,
    }, added


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.3,
                        help="seconds of CPU per repeat (default 0.3)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    rows, overhead = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys.yaml"
        write_key_file(path, {"KEK": (1, {1: os.urandom(32)})})
        kms = KeyFileKms(path)
        for size in SIZES:
            ops, overhead[size] = _operations(loop, kms, size)
            samples: dict[str, list[float]] = {name: [] for name in ops}
            for _ in range(5):
                for name, op in ops.items():
                    samples[name].append(_cpu_us(op, args.target))
            base = statistics.median(samples["AES-256-GCM alone (baseline)"]) / BATCH
            for name, values in samples.items():
                us = statistics.median(values) / BATCH
                seconds_per_gb = us / size * 1e9 / 1e6
                rows.append(f"| {size:,} B | {name} | {us:.2f} | {seconds_per_gb:.1f} | "
                            f"{us / base:.2f} |")
    loop.close()
    load = os.getloadavg()
    text = "\n".join([
        "## Record encryption: CPU per record to seal and open values (data keys cached)",
        "",
        "Command: `python -m bench.encryption` (from the repository root, project "
        "virtualenv)",
        "",
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}; "
        f"shared with other work (load average {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f}).",
        f"- Batches of {BATCH} records, values only (no sealed headers), one event loop; "
        "data keys from a key file, unwrapped once before measuring (no KMS call).",
        "- CPU µs per record (`time.process_time`, one thread), median of 5 repeats of "
        f"about {args.target} s; CPU s per GB of values; \"x AES-GCM\" is against "
        "`AESGCM.encrypt` of the same values alone.",
        f"- A sealed record is {overhead[SIZES[0]]} bytes longer (marker header with a "
        "64-byte key-file wrapped key, 12-byte nonce, 16-byte tag); an AWS KMS wrapped "
        "key and ARN add about 200 more, which batch compression takes back since every "
        "record of a batch repeats them.",
        "",
        "| value | operation | CPU µs/record | CPU s/GB | x AES-GCM |",
        "|---:|---|---:|---:|---:|",
        *rows,
    ])
    print(text)
    if not args.no_write:
        write_results(text, "encryption")
    return text


if __name__ == "__main__":
    main()
