"""Decompression bombs: what a burst of them costs other clients, and what the limit costs
ordinary traffic.

Run from the repository root with the project's virtualenv::

    python -m bench.bombs                          # this tree only
    python -m bench.bombs --baseline /work/main    # also a baseline tree, same run

1. **Burst** (per tree, per bomb kind): a kiproxy process (``uppercase`` plugin, so
   every batch is decoded) in front of an embedded Tansu broker. Another client sends
   ApiVersions in a loop and a third sends small Produce v8 requests (one batch of
   ten 100-byte records, acks=1) in a loop, each on its own connection, while 16
   connections send one bomb each at once (three bursts). Reported: the p50, p99 and
   max round trip of the other clients' requests during the bursts, and the proxy's
   peak RSS over its baseline.
2. **Limit CPU** (this tree): decoding ordinary batches (100 JSON-like records of
   about 1 KiB, each codec) with the bounded decompression against cramjam's plain
   one-shot decompression of the same block, and through the inline decode lease
   against ``decode_batches`` itself; CPU time per batch, median of five repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the bombs and raw sockets of tests/hardening

from hardening.bombs import (  # noqa: E402
    BOMBS,
    RssSampler,
    bomb_request,
    produce_request,
    rss_of,
)
from hardening.raw_kafka import api_versions_frame, connect, recv_frame  # noqa: E402

from kiproxy.protocol.compression import Compression  # noqa: E402
from kiproxy.protocol.records import Record, build_batch, decode_batches  # noqa: E402
from kiproxy_dev.tansu import EmbeddedBroker, free_port  # noqa: E402

CLIENTS = 16
BURSTS = 3


def launch_uppercase(tree: Path, upstream: str,
                     env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``kiproxy run`` with the uppercase interceptor from ``tree`` (extra ``env`` on top);
    returns the process and its bootstrap address once it printed it."""
    listen = free_port()
    cmd = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
           "--listen", f"127.0.0.1:{listen}", "--broker-port-start", str(free_port() - 111),
           "--interceptor", "uppercase", "--log-level", "ERROR"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), **(env or {})})
    assert proc.stdout is not None
    for line in proc.stdout:
        if "bootstrap address" in line:
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
    return proc, f"127.0.0.1:{listen}"


def _loop(address: str, frames: list[bytes], stop: threading.Event,
          out: list[float]) -> None:
    sock = connect(address, timeout=120)
    try:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            sock.sendall(frames[i % len(frames)])
            recv_frame(sock)
            out.append(time.perf_counter() - t0)
            i += 1
            time.sleep(0.002)
    finally:
        sock.close()


def _burst(address: str, frame: bytes) -> None:
    socks = [connect(address, timeout=120) for _ in range(CLIENTS)]
    threads = [threading.Thread(target=s.sendall, args=(frame,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in socks:
        recv_frame(s)
        s.close()


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def burst_case(tree: Path, broker: EmbeddedBroker, kind: str) -> str:
    """One tree, one bomb kind: a Markdown table row."""
    codec, build = BOMBS[kind]
    bomb = bomb_request(f"bomb-{kind}", codec, build())
    small = [produce_request("small", build_batch([Record(value=b"x" * 100, timestamp=0)] * 10),
                             client_id="other")]
    proc, address = launch_uppercase(tree, broker.bootstrap)
    try:
        _burst(address, small[0])  # topic created, warm
        baseline = rss_of(proc.pid)
        stop = threading.Event()
        api: list[float] = []
        produce: list[float] = []
        loops = [threading.Thread(target=_loop, args=(address, [api_versions_frame(1)], stop,
                                                      api)),
                 threading.Thread(target=_loop, args=(address, small, stop, produce))]
        with RssSampler(proc.pid) as sampler:
            for t in loops:
                t.start()
            time.sleep(0.3)
            for _ in range(BURSTS):
                _burst(address, bomb)
            stop.set()
            for t in loops:
                t.join(60)
        growth = (sampler.peak - baseline) / 2**20
        return (f"| {tree.name} | {kind} | {_ms(api, .5):.1f} | {_ms(api, .99):.1f} | "
                f"{_ms(api, 1):.0f} | {_ms(produce, .5):.1f} | {_ms(produce, .99):.1f} | "
                f"{_ms(produce, 1):.0f} | {growth:.0f} |")
    finally:
        proc.terminate()
        proc.wait(15)


def _cpu(fn: object, n: int) -> float:
    best = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            fn()  # type: ignore[operator]
        best.append((time.process_time() - t0) / n)
    return statistics.median(best)


def limit_cpu() -> list[str]:
    """Bounded decompression and the inline lease against plain decoding, per codec."""
    import random

    from kiproxy.protocol.records import DEFAULT_DECOMPRESSION_LIMITS
    from kiproxy.proxy.produce.offload import BatchOffload

    rng = random.Random(7)
    words = [b"user", b"order", b"amount", b"status", b"shipped", b"pending", b"eu-west"]
    records = [Record(key=b"k%06d" % i, value=b"{" + b",".join(
        b'"%s":"%s%d"' % (rng.choice(words), rng.choice(words), rng.randrange(10**6))
        for _ in range(40)) + b"}", timestamp=1_700_000_000_000 + i) for i in range(100)]
    rows = []
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS)
    # Snappy is left out: its path (the declared length checked first) did not change.
    for codec in (Compression.GZIP, Compression.LZ4, Compression.ZSTD):
        rows.append(_codec_row(codec, records, offload))
    return rows


def _codec_row(codec: Compression, records: list[Record], offload: Any) -> str:
    import cramjam

    from kiproxy.protocol.compression import decompress

    batch = build_batch(records, compression=codec)
    block = batch[61:]
    raw_size = len(decompress(codec, block, 1 << 30))
    module = getattr(cramjam, codec.name.lower())

    def plain() -> object:
        return module.decompress(block)
    n = 300
    t_plain = _cpu(plain, n)
    t_bounded = _cpu(lambda: decompress(codec, block, 32 << 20), n)
    lease = offload.lease()
    t_decode = _cpu(lambda: decode_batches(batch), n)
    t_lease = _cpu(lambda: _inline(lease, batch), n)
    return (f"| {codec.name.lower()} | {len(block):,} -> {raw_size:,} | "
            f"{t_plain * 1e6:.1f} | {t_bounded * 1e6:.1f} | {t_bounded / t_plain:.2f} | "
            f"{t_decode * 1e6:.0f} | {t_lease * 1e6:.0f} | {t_lease / t_decode:.2f} |")


def _inline(lease: object, batch: bytes) -> None:
    coro = lease.decode(batch)  # type: ignore[attr-defined]
    try:
        coro.send(None)  # the inline path finishes without suspending
    except StopIteration:
        return
    raise AssertionError("an ordinary batch left the inline path")


def main() -> int:
    """Run both parts and print Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another tree to run the burst on first")
    parser.add_argument("--kinds", default="zstd,gzip", help="bomb kinds (default zstd,gzip)")
    args = parser.parse_args()
    print("| tree | bomb | ApiVersions p50 ms | p99 ms | max ms | Produce p50 ms | p99 ms | "
          "max ms | peak RSS over baseline MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    broker = EmbeddedBroker()
    broker.start()
    try:
        trees = ([args.baseline] if args.baseline else []) + [ROOT]
        for kind in args.kinds.split(","):
            for tree in trees:
                print(burst_case(tree, broker, kind), flush=True)
    finally:
        broker.stop()
    print()
    print("| codec | block bytes (compressed -> raw) | cramjam one-shot us | bounded us | "
          "ratio | decode_batches us | inline lease us | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for row in limit_cpu():
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
