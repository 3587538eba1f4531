"""The produce pipeline without sockets: CPU per record of ``ProducePipeline.handle``.

Run from the repository root with the project's virtualenv::

    python -m bench.intercept                       # this tree, prints a table
    python -m bench.intercept --ab /path/to/other   # A/B: that tree against this one
    python -m bench.intercept --profile uppercase/1024/none   # cProfile, top 20

One Produce request (v9, flexible) of ``--partitions`` partitions, each holding one
batch of ``--records`` records (16-byte key, one header, JSON-looking values of
100 B or 1 KiB, idempotent-producer fields), is built once per case; a pipeline with
the plugin handles it again and again on one event loop, and the process CPU time
(``time.process_time``, the best of the repeats: other work on the machine only
ever adds to it) per record is the figure: parse, decode, CRC, plugin,
verdict, re-encode, and rebuilding the forwarded request. "wall ms/request" is the
best elapsed time of a request (decode and encode threads may overlap the loop's
work, so it can be less than the request's CPU). No broker, no sockets, so
the machine's load hurts it far less than the end-to-end bench, and ``--ab`` runs the
two trees alternately (one child process per tree and round) so that drift hits both.

``--cold-caches MIB`` copies that many MiB between requests, outside the timed part, so
that each request starts with the CPU caches holding other work, as in a proxy where
the kernel's network path, the broker and the clients run on the same cores between
two requests; each request is then timed on its own. The difference from the default
(hot) figure is what the request's working set costs to bring back in: a request that
touches fewer objects and less code loses less to it.

Plugins: ``identity`` (returns the batch), ``uppercase`` (the built-in),
``readme`` (``batch.with_records(r.with_value(r.value.upper()) for r in
batch.records)``, the way the README teaches), ``no_secrets`` (the README's plugin
as printed there, word ``id``, which every value holds), ``mask`` (the README's example,
``r.with_value(r.value.replace(word, b"***"))``, on values without the word: every
record copied, the batch judged unchanged), ``stamp`` (the built-in header
stamper), ``reject1`` (rejects partition 0, keeps the others unchanged),
``validator`` (the built-in JSON Schema validator with ``bench.proxy``'s schema:
``id`` and ``kind`` required). Values are JSON objects
(``{"id":N,"kind":WORD,"note":"WORDS..."}``) of exactly the record size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "measure"]

PLUGINS = ("identity", "uppercase", "readme", "no_secrets", "mask", "stamp", "reject1",
           "validator")
SCHEMA = {"type": "object", "required": ["id", "kind"],
          "properties": {"id": {"type": "integer", "minimum": 0}, "kind": {"type": "string"}}}
SIZES = (100, 1024)
CODECS = ("none", "lz4", "zstd")
SECTION = "## Intercept micro-benchmark: CPU per record of the produce pipeline"
ROOT = Path(__file__).resolve().parent.parent


def _plugin(name: str) -> Any:
    from kiproxy.interceptors import ProduceRequestInterceptor, RejectBatch

    if name == "uppercase":
        from kiproxy.interceptors.builtin.uppercase import Uppercase
        return Uppercase()
    if name == "stamp":
        from kiproxy.interceptors.builtin.headers import StampHeaders, StampHeadersSettings
        stamper = StampHeaders()
        stamper.configure(StampHeadersSettings(headers={"x-env": "bench"}))
        return stamper
    if name == "validator":
        from kiproxy.interceptors.builtin.json_schema import (
            JsonSchemaSettings,
            JsonSchemaValidator,
        )
        validator = JsonSchemaValidator()
        validator.configure(JsonSchemaSettings.model_validate({"default_schema": SCHEMA}))
        return validator

    class Identity(ProduceRequestInterceptor):
        def intercept(self, batch: Any, ctx: Any) -> Any:
            return batch

    class Readme(ProduceRequestInterceptor):
        def intercept(self, batch: Any, ctx: Any) -> Any:
            return batch.with_records(r.with_value(r.value.upper()) for r in batch.records)

    class Mask(ProduceRequestInterceptor):
        def intercept(self, batch: Any, ctx: Any) -> Any:
            return batch.with_records(
                r.with_value(r.value.replace(b"hunter2", b"***")) if r.value else r
                for r in batch.records)

    class RejectFirst(ProduceRequestInterceptor):
        def intercept(self, batch: Any, ctx: Any) -> Any:
            if batch.partition == 0:
                raise RejectBatch("partition 0 is closed", error="POLICY_VIOLATION")
            return batch

    if name == "no_secrets":  # the README's plugin as printed there, word "id"
        from bench.proxy.scenarios import README_PLUGINS, readme_plugin
        from kiproxy.interceptors.loader import load_interceptor
        readme_plugin()
        return load_interceptor("no_secrets:NoSecrets", README_PLUGINS, {"word": "id"})

    plugins: dict[str, Any] = {"identity": Identity, "readme": Readme, "mask": Mask,
                               "reject1": RejectFirst}
    return plugins[name]()


def _frame(size: int, codec: str, records: int, partitions: int) -> bytes:
    import datetime
    import random

    from kio.schema.produce.v9.request import (
        PartitionProduceData,
        ProduceRequest,
        TopicProduceData,
    )
    from kio.schema.types import TopicName
    from kio.static.primitive import Records, i16, i32, i32Timedelta

    from kiproxy.protocol.compression import Compression
    from kiproxy.protocol.framing import encode_request_header
    from kiproxy.protocol.messages import serialize
    from kiproxy.protocol.records import Header, Record, build_batch

    rng = random.Random(42)
    words = ("order", "payment", "status", "pending", "shipped", "refund", "lisbon", "sku")
    parts = []
    for p in range(partitions):
        recs = []
        for i in range(records):
            head = f'{{"id":{rng.randint(0, 99999)},"kind":"{rng.choice(words)}","note":"'
            text = ""
            while len(text) < size:
                text += f"{rng.choice(words)} {rng.randint(0, 99999)} "
            value = (head + text)[:size - 2] + '"}'
            recs.append(Record(key=f"key-{p}-{i:010d}".encode(), value=value.encode(),
                               headers=(Header("source", b"bench"),),
                               timestamp=1_700_000_000_000 + i))
        batch = build_batch(recs, compression=Compression[codec.upper()], producer_id=4242,
                            producer_epoch=0, base_sequence=p * records)
        parts.append(PartitionProduceData(index=i32(p), records=Records(batch)))
    topic = TopicProduceData(name=TopicName("bench"), partition_data=tuple(parts))
    request = ProduceRequest(transactional_id=None, acks=i16(-1),
                             timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
                             topic_data=(topic,))
    return encode_request_header(0, 9, 7, "bench", 2) + serialize(request)


def _setup(case: str, records: int, partitions: int,
           inline: bool = False) -> tuple[Any, Any, Any, bytes]:
    import asyncio  # noqa: F401  (the pipeline needs it imported)

    from kiproxy.interceptors.identity import ClientIdentity
    from kiproxy.protocol.framing import parse_request_header
    from kiproxy.proxy.net.sasl import SaslTracker
    from kiproxy.proxy.produce.pipeline import ProducePipeline

    plugin, size, codec = case.split("/")

    class Client:
        identity = ClientIdentity(client_host="127.0.0.1", client_port=9, client_id="bench")
        sasl = SaslTracker()
        log_context: dict[str, object] = {}

    frame = _frame(int(size), codec, records, partitions)
    offload = None
    if inline:  # everything on the calling thread, where cProfile sees it
        from kiproxy.protocol.records import DEFAULT_DECOMPRESSION_LIMITS
        from kiproxy.proxy.produce.offload import BatchOffload
        offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS, inline_bytes=1 << 30)
    pipeline = ProducePipeline(_plugin(plugin), name=plugin, offload=offload)
    return pipeline, Client(), parse_request_header(frame), frame


def measure(case: str, records: int, partitions: int, seconds: float,
            repeats: int, cold_mib: int = 0) -> dict[str, Any]:
    """CPU time of ``ProducePipeline.handle`` on one request of ``case`` (PLUGIN/SIZE/CODEC).

    ``partitions`` batches of ``records`` records; the best of ``repeats`` repeats of about
    ``seconds`` CPU seconds each. Returns ``us_per_record``, ``ms_per_request`` and
    ``request_bytes`` (the Produce request as sent, compressed). With ``cold_mib``, that
    many MiB are copied before each request, untimed (``--cold-caches``).
    """
    import asyncio
    import logging

    from kiproxy.proxy.malloc import keep_freed_memory

    logging.disable(logging.WARNING)
    keep_freed_memory()  # glibc tuned as `kiproxy run` tunes it
    pipeline, client, header, frame = _setup(case, records, partitions)
    loop = asyncio.new_event_loop()

    source, sink = bytearray(cold_mib << 20), bytearray(cold_mib << 20)
    timed = [0.0, 0.0]  # CPU and wall seconds inside handle(), when caches are made cold

    async def run(n: int) -> None:
        if not cold_mib:
            for _ in range(n):
                await pipeline.handle(client, header, frame, None)
            return
        for _ in range(n):
            sink[:] = source  # the caches now hold other work
            t0, w0 = time.process_time(), time.perf_counter()
            await pipeline.handle(client, header, frame, None)
            timed[0] += time.process_time() - t0
            timed[1] += time.perf_counter() - w0

    def timing(n: int) -> tuple[float, float, float]:
        """CPU and wall seconds per request of ``n`` requests, and the CPU seconds per
        request of the whole loop (the copies included)."""
        timed[:] = [0.0, 0.0]
        t0, w0 = time.process_time(), time.perf_counter()
        loop.run_until_complete(run(n))
        spent = (time.process_time() - t0) / n
        if cold_mib:
            return timed[0] / n, timed[1] / n, spent
        return spent, (time.perf_counter() - w0) / n, spent

    loop.run_until_complete(run(2))
    started = time.process_time()
    n, per_call = 1, seconds
    while time.process_time() - started < seconds / 4:
        per_call = timing(n)[2]
        n *= 2
    n = max(1, int(seconds / max(per_call, 1e-9)))
    samples, walls = [], []
    for _ in range(repeats):
        cpu, wall, _ = timing(n)
        samples.append(cpu)
        walls.append(wall)
    loop.close()
    per_request = min(samples)  # interference from other work only ever adds
    return {"case": case, "us_per_record": per_request * 1e6 / (records * partitions),
            "ms_per_request": per_request * 1e3, "wall_ms_per_request": min(walls) * 1e3,
            "request_bytes": len(frame)}


def _profile(case: str, records: int, partitions: int, top: int) -> None:
    import asyncio
    import cProfile
    import logging
    import pstats

    from kiproxy.proxy.malloc import keep_freed_memory

    logging.disable(logging.WARNING)
    keep_freed_memory()
    pipeline, client, header, frame = _setup(case, records, partitions, inline=True)
    loop = asyncio.new_event_loop()

    async def run(n: int) -> None:
        for _ in range(n):
            await pipeline.handle(client, header, frame, None)

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    loop.run_until_complete(run(40))
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def _child(tree: str, cases: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--records",
           str(args.records), "--partitions", str(args.partitions), "--seconds",
           str(args.seconds), "--repeats", str(args.repeats), "--cases", ",".join(cases),
           "--cold-caches", str(args.cold_caches)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _cases(args: argparse.Namespace) -> list[str]:
    if args.cases:
        return [c for c in args.cases.split(",") if c]
    return [f"{p}/{s}/{c}" for p in args.plugins.split(",") for s in SIZES for c in CODECS]


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=250, help="records per partition")
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.3, help="CPU seconds per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plugins", default="identity,uppercase,readme")
    parser.add_argument("--cases", default="", help="PLUGIN/SIZE/CODEC,... (overrides --plugins)")
    parser.add_argument("--ab", metavar="TREE", help="another tree to compare against (A)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations for --ab")
    parser.add_argument("--profile", metavar="CASE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help="write bench/RESULTS.md")
    parser.add_argument("--cold-caches", type=int, default=0, metavar="MIB",
                        help="copy MIB MiB between requests, untimed (see the docstring)")
    args = parser.parse_args(argv)
    if args.profile:
        _profile(args.profile, args.records, args.partitions, 25)
        return
    cases = _cases(args)
    if args.child:
        for case in cases:
            print(json.dumps(measure(case, args.records, args.partitions, args.seconds,
                                      args.repeats, args.cold_caches)), flush=True)
        return
    trees = ([("A", args.ab)] if args.ab else []) + [("B", str(ROOT))]
    results: dict[tuple[str, str], list[float]] = {}
    walls: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds if args.ab else 1):
        for label, tree in trees:
            for row in _child(tree, cases, args):
                results.setdefault((label, row["case"]), []).append(row["us_per_record"])
                walls.setdefault((label, row["case"]), []).append(
                    row.get("wall_ms_per_request", float("nan")))
    lines = ["| case | " + " | ".join(f"{lab} us/record" for lab, _ in trees)
             + (" | B/A" if args.ab else "")
             + " | " + " | ".join(f"{lab} wall ms/request" for lab, _ in trees) + " |",
             "|---|" + "---:|" * (2 * len(trees) + (1 if args.ab else 0))]
    for case in cases:
        cells = [min(results[(lab, case)]) for lab, _ in trees]
        ratio = f" {cells[1] / cells[0]:.2f} |" if args.ab else ""
        wall = " | ".join(f"{min(walls[(lab, case)]):.3f}" for lab, _ in trees)
        lines.append(f"| {case} | " + " | ".join(f"{c:.3f}" for c in cells) + " |" + ratio
                     + f" {wall} |")
    table = "\n".join(lines)
    setup = (f"load average {os.getloadavg()[0]:.1f}; {args.partitions} partitions x "
             f"{args.records} records per request; best of {args.rounds if args.ab else 1} "
             f"round(s) x {args.repeats} repeats (CPU time)"
             + (f"; {args.cold_caches} MiB copied before each request, untimed"
                if args.cold_caches else ""))
    print(setup)
    print(table)
    if args.write:
        _write(table, setup, args, argv)


def _write(table: str, setup: str, args: argparse.Namespace, argv: list[str] | None) -> None:
    import datetime

    from bench.results import write_results

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m bench.intercept " + " ".join(sys.argv[1:] if argv is None else argv)
    trees = (f"A = `{args.ab}`, B = this tree (commit {commit})" if args.ab
             else f"commit {commit}")
    write_results("\n".join([
        SECTION, "",
        f"`{command}` ({when}; {trees}). {setup}. CPU microseconds per record of "
        "`ProducePipeline.handle` on one Produce v9 request (no sockets, no broker); "
        "see the module docstring of `bench/intercept.py` for the plugins.", "",
        table, ""]), "intercept")


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path.pop(0)  # the bench directory: kiproxy must come from PYTHONPATH
    main()
