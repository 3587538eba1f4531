"""The ``schema_registry`` interceptor, per record: each check beside passthrough, in one run.

Run from the repository root with the project's virtualenv and a registry
(``make registry`` builds Apicurio Registry; the bench starts it itself)::

    .venv/bin/python -m bench.schema_registry              # writes bench/RESULTS.md
    .venv/bin/python -m bench.schema_registry --no-write   # print only
    .venv/bin/python -m bench.schema_registry --registry-url http://HOST:PORT/apis/ccompat/v7

Schemas are registered and values serialized with confluent-kafka's own
``AvroSerializer``, ``ProtobufSerializer`` and ``JSONSerializer``: a 10-field
record (``id``, ``amount``, ``currency``, ``qty``, ``customer``, ``country``,
``status``, ``ts``, ``express``, ``note``), ``note`` padded so that the
serialized value is 100 B or 1 KiB. One batch of ``--records`` records per case
goes through the proxy's verdict (:func:`~kiproxy.interceptors.verdict.judge`)
again and again on one event loop, with every schema id already cached, so the
figure is the check's own CPU per record (``time.process_time``, best of the
repeats) - what a cached record costs; the registry is not asked once warm.

Cases: ``passthrough`` (an interceptor that returns the batch), ``id`` (framed and
registered: ``value: id``), ``avro`` / ``protobuf`` / ``json`` (``value: payload``),
``avro+2 rules`` (``value: payload`` and two CEL rules). "added us" is the case's
CPU per record less passthrough's.

``--burst`` also runs the cache-miss burst: a proxy process (``kiproxy run``) in
front of Tansu with this interceptor, one producer sending one record at a time
with a cached id (its produce-to-acknowledgement latencies are the figure), and,
in the other phases, another connection sending 100 records to another topic a
quarter into the phase: records with a cached id, as a control for the load
itself, then records that each carry a schema id the proxy has not seen (100
schemas registered just before, differing only in their ``doc``). The phases run
in ``--rounds`` rounds (default 3), each round every phase once, so a change in
the machine's load touches every phase alike; the table gives each figure's
median over the rounds and its range, and how long the burst took from its first
record sent to its last acknowledged. ``--burst-only`` skips the per-record cases
and writes nothing; ``--max-requests-in-flight N`` sets the proxy's
``registry.max_requests_in_flight``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, Record, RecordBatch
from kiproxy.interceptors.builtin.schema_registry import SchemaRegistryValidator
from kiproxy.interceptors.builtin.schema_registry.settings import SchemaRegistrySettings
from kiproxy.interceptors.verdict import Rejected, judge

HEADING = "## schema_registry: CPU per record of each check (bench/schema_registry.py)"
FIELDS = [("id", "string"), ("amount", "double"), ("currency", "string"), ("qty", "int"),
          ("customer", "string"), ("country", "string"), ("status", "string"),
          ("ts", "long"), ("express", "boolean"), ("note", "string")]
AVRO = {"type": "record", "name": "Order", "namespace": "bench",
        "fields": [{"name": n, "type": t} for n, t in FIELDS]}
PROTO = ('syntax = "proto3";\npackage bench;\nmessage Order {\n' + "".join(
    f"  {dict(string='string', double='double', int='int32', long='int64', boolean='bool')[t]}"
    f" {n} = {i + 1};\n" for i, (n, t) in enumerate(FIELDS)) + "}\n")
JSON_SCHEMA = {"title": "bench.Order", "type": "object",
               "required": [n for n, _ in FIELDS],
               "properties": {n: {"type": dict(string="string", double="number", int="integer",
                                               long="integer", boolean="boolean")[t]}
                              for n, t in FIELDS}}
RULES = [{"name": "positive_amount", "expr": "value.amount > 0.0 && value.currency in "
          "['EUR', 'USD']"},
         {"name": "sane_qty", "expr": "size(value.customer) > 0 && value.qty < 1000"}]


class Passthrough(ProduceRequestInterceptor):
    """Returns the batch: the baseline."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch


def datum(size_hint: int, i: int) -> dict[str, Any]:
    return {"id": f"o-{i}", "amount": 12.5, "currency": "EUR", "qty": 3, "customer": "c-9",
            "country": "DE", "status": "new", "ts": 1_700_000_000_000 + i, "express": True,
            "note": "x" * size_hint}


def sized(make: Callable[[dict[str, Any]], bytes], size: int, i: int) -> bytes:
    """A serialized value of exactly ``size`` bytes, padding ``note``."""
    pad = max(size - len(make(datum(0, i))), 0)
    for extra in range(pad, -1, -1):  # varint lengths grow with the pad
        value = make(datum(extra, i))
        if len(value) <= size:
            return value
    return make(datum(0, i))


def proto_class() -> Any:
    from google.protobuf import descriptor_pb2, message_factory
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "bench.proto").write_text(PROTO)
        out = os.path.join(tmp, "set.pb")
        assert protoc.main(["protoc", f"-I{tmp}", f"--descriptor_set_out={out}",
                            os.path.join(tmp, "bench.proto")]) == 0
        files = descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())
    return message_factory.GetMessages(list(files.file))["bench.Order"]


def serializers(url: str, run: str) -> dict[str, Callable[[dict[str, Any]], bytes]]:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.schema_registry.json_schema import JSONSerializer
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    client = SchemaRegistryClient({"url": url})
    order = proto_class()
    avro = AvroSerializer(client, json.dumps(AVRO))
    proto = ProtobufSerializer(order, client, {"use.deprecated.format": False})
    js = JSONSerializer(json.dumps(JSON_SCHEMA), client)

    def ctx(kind: str) -> Any:
        return SerializationContext(f"bench{run}-{kind}", MessageField.VALUE)

    return {
        "avro": lambda d: bytes(avro(d, ctx("avro"))),
        "protobuf": lambda d: bytes(proto(order(**d), ctx("protobuf"))),
        "json": lambda d: bytes(js(d, ctx("json"))),
    }


def interceptors(url: str, run: str) -> dict[str, tuple[Any, str]]:
    """case -> (interceptor, topic)."""
    def configured(topics: dict[str, Any]) -> SchemaRegistryValidator:
        plugin = SchemaRegistryValidator()
        plugin.configure(SchemaRegistrySettings.model_validate(
            {"registry": {"url": url}, "topics": topics}))
        return plugin

    t = {k: f"bench{run}-{k}" for k in ("avro", "protobuf", "json")}
    return {
        "passthrough": (Passthrough(), t["avro"]),
        "id": (configured({t["avro"]: {"value": "id"}}), t["avro"]),
        "avro": (configured({t["avro"]: {"value": "payload"}}), t["avro"]),
        "protobuf": (configured({t["protobuf"]: {"value": "payload"}}), t["protobuf"]),
        "json": (configured({t["json"]: {"value": "payload"}}), t["json"]),
        "avro+2 rules": (configured({t["avro"]: {"value": "payload", "rules": RULES}}),
                         t["avro"]),
    }


def cpu_per_record(plugin: Any, batch: RecordBatch, seconds: float) -> float:
    """Best-of-5 CPU microseconds per record of judging ``batch``."""
    ctx = InterceptContext(client_id="bench", client_address="bench", principal=None,
                           api_version=9, acks=-1, transactional_id=None, deadline=0.0)
    loop = asyncio.new_event_loop()
    try:
        verdict = loop.run_until_complete(judge(plugin, batch, ctx, name="b", timeout=None))
        assert not isinstance(verdict, Rejected), verdict
        best = float("inf")
        for _ in range(5):
            n, start, t0 = 0, time.monotonic(), time.process_time()
            while time.monotonic() - start < seconds / 5:
                loop.run_until_complete(judge(plugin, batch, ctx, name="b", timeout=None))
                n += 1
            best = min(best, (time.process_time() - t0) / (n * len(batch.records)) * 1e6)
        return best
    finally:
        loop.close()


def per_record(url: str, records: int, seconds: float) -> list[tuple[str, int, float]]:
    run = str(int(time.time()))[-6:]
    makers = serializers(url, run)
    cases = interceptors(url, run)
    rows = []
    for size in (100, 1024):
        values = {k: [sized(m, size, i) for i in range(records)] for k, m in makers.items()}
        for case, (plugin, topic) in cases.items():
            kind = "avro" if case in ("passthrough", "id", "avro+2 rules") else case
            batch = RecordBatch(topic=topic, partition=0, records=tuple(
                Record(key=None, value=v, offset_delta=i) for i, v in enumerate(values[kind])))
            rows.append((case, size, cpu_per_record(plugin, batch, seconds)))
    return rows


# ------------------------------------------------------------------ the cache-miss burst


@contextmanager
def registry(url: str | None) -> Iterator[str]:
    """``url``, or an Apicurio Registry of the bench's own (the jar ``make registry`` builds)."""
    if url is not None:
        yield url
        return
    from kiproxy_dev.apicurio import ApicurioRegistry, find_registry_jar

    jar = find_registry_jar()
    if jar is None:
        raise SystemExit("no Apicurio Registry jar: run `make registry` (or pass --registry-url)")
    with ApicurioRegistry(jar) as started:
        yield started.url


PHASES = ("no burst", "100 records, cached id", "100 records, 100 new ids",
          "100 records, cached id; 100 new ids asked by another process")
"""The burst phases, run in this order in every round. The last one is the control for
the machine: the burst's records carry a cached id, and the registry requests the proxy
would make for 100 new ids (schema, then subjects, two at a time) are made at the same
moment by another process, so the registry's and an HTTP client's CPU land on the
machine without the proxy's loop doing any of it."""

ASKER = """
import sys, threading, urllib.request
url, ids = sys.argv[1], [int(i) for i in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.readline()
def ask(share):
    for i in share:
        for path in (f"/schemas/ids/{i}", f"/schemas/ids/{i}/versions"):
            urllib.request.urlopen(url + path, timeout=10).read()
threads = [threading.Thread(target=ask, args=(ids[k::2],)) for k in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print("done", flush=True)
"""
"""The other process of the last phase: waits for a line, then asks the registry."""


def burst(url: str, steady_records: int, rounds: int,
          registry_settings: dict[str, Any] | None = None) -> dict[str, list[dict[str, float]]]:
    """The steady producer's latencies (ms) in each phase of each round."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from kiproxy_dev.tansu import EmbeddedBroker, free_port

    run = str(int(time.time()))[-6:]
    steady_topic, burst_topic = f"steady{run}", f"burst{run}"
    client = SchemaRegistryClient({"url": url})
    serializer = AvroSerializer(client, json.dumps(AVRO))
    broker = EmbeddedBroker()
    broker.start()
    listen = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "kiproxy", "run", "--upstream", broker.bootstrap,
         "--listen", f"127.0.0.1:{listen}", "--broker-port-start", str(free_port() - 111),
         "--interceptor", "schema_registry", "--interceptor-config", json.dumps({
             "registry": {"url": url, **(registry_settings or {})}, "topics": {
                 steady_topic: {"value": "payload"}, burst_topic: {"value": "payload"}}})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    try:
        assert proxy.stdout is not None
        for line in proxy.stdout:
            if "bootstrap address" in line:
                break
        # Keep reading what the proxy writes, so a full pipe never blocks its loop.
        threading.Thread(target=lambda: output.extend(proxy.stdout or ()), daemon=True).start()
        bootstrap = f"127.0.0.1:{listen}"
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for future in admin.create_topics(
                [NewTopic(t, 1, 1) for t in (steady_topic, burst_topic)]).values():
            future.result(15)
        steady_value = bytes(serializer(
            datum(900, 0), SerializationContext(steady_topic, MessageField.VALUE)))
        # The control burst goes to the burst topic too (not the steady producer's
        # partition), with an id registered there and cached by a first record.
        cached_value = bytes(serializer(
            datum(900, 0), SerializationContext(burst_topic, MessageField.VALUE)))
        cached_id = int.from_bytes(cached_value[1:5], "big")
        steady_phase(Producer, bootstrap, steady_topic, steady_value, 50, burst_topic,
                     [cached_id])  # warms both ids, the connections and the topics
        results: dict[str, list[dict[str, float]]] = {phase: [] for phase in PHASES}
        for round_ in range(rounds):
            for phase in PHASES:
                ids: list[int] = []
                new: list[int] = []
                if phase != PHASES[0]:
                    ids = [cached_id] * 100
                if phase in PHASES[2:]:
                    for i in range(100):  # 100 schemas the proxy has never seen
                        # Another doc: a new id for a schema the same records decode with
                        # (and that the registry's BACKWARD rule accepts).
                        schema = dict(AVRO, doc=f"burst {run}, round {round_}, {phase}, {i}")
                        new.append(client.register_schema(f"{burst_topic}-value",
                                                          Schema(json.dumps(schema), "AVRO")))
                asker = None
                if phase == PHASES[2]:
                    ids = new
                elif phase == PHASES[3]:
                    asker = subprocess.Popen([sys.executable, "-c", ASKER, url, *map(str, new)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True)
                    assert asker.stdout is not None
                    if asker.stdout.readline().strip() != "ready":  # started before the phase
                        raise RuntimeError("the other process did not start")
                try:
                    results[phase].append(steady_phase(
                        Producer, bootstrap, steady_topic, steady_value, steady_records,
                        burst_topic, ids, asker))
                finally:
                    if asker is not None:
                        asker.kill()
                        asker.wait()
        return results
    except BaseException:
        print("".join(output[-30:]), file=sys.stderr)
        raise
    finally:
        proxy.terminate()
        proxy.wait(30)
        broker.stop()


def steady_phase(producer_cls: Any, bootstrap: str, topic: str, value: bytes, count: int,
                 burst_topic: str, ids: list[int],
                 asker: subprocess.Popen[str] | None = None) -> dict[str, float]:
    """One phase: ``count`` records one at a time on one connection, the burst of ``ids``
    on another a quarter in (and ``asker`` told to start then). The steady latencies, and
    how long the burst took."""
    steady = producer_cls({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": 1})
    burster = producer_cls({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": 1,
                            "max.in.flight": 100})
    burster.list_topics(burst_topic, 10)  # connected before the phase starts
    payload = value[5:]
    failed: list[Any] = []
    burst_done: list[float] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    def burst_delivered(err: Any, _msg: Any) -> None:
        delivered(err, _msg)
        burst_done.append(time.perf_counter())

    latencies: list[float] = []
    burst_start = 0.0
    for i in range(count):
        if ids and i == count // 4:  # the burst lands a quarter into the phase
            burst_start = time.perf_counter()
            if asker is not None and asker.stdin is not None:
                asker.stdin.write("go\n")
                asker.stdin.flush()
            for n, schema_id in enumerate(ids):
                burster.produce(burst_topic, b"\x00" + schema_id.to_bytes(4, "big") + payload,
                                partition=0, on_delivery=burst_delivered)
                if n % 10 == 9:
                    burster.poll(0)
        t0 = time.perf_counter()
        steady.produce(topic, value, partition=0, on_delivery=delivered)
        if steady.flush(10):
            raise RuntimeError(f"the steady producer's record {i} was not acknowledged in 10 s")
        latencies.append((time.perf_counter() - t0) * 1000)
        burster.poll(0)
    burster.flush(30)
    if asker is not None and asker.stdout is not None and \
            asker.stdout.readline().strip() != "done":
        raise RuntimeError("the other process did not finish asking the registry")
    if failed:
        raise RuntimeError(f"{len(failed)} records were refused, first: {failed[0]}")
    latencies.sort()
    return {"p50": latencies[len(latencies) // 2],
            "p99": latencies[int(len(latencies) * 0.99) - 1],
            "max": latencies[-1], "n": len(latencies),
            "burst": (max(burst_done) - burst_start) * 1000 if ids else 0.0}


def _spread(values: list[float]) -> str:
    """The median of the rounds, and their range."""
    ordered = sorted(values)
    mid = ordered[len(ordered) // 2]
    if len(ordered) == 1:
        return f"{mid:.2f}"
    return f"{mid:.2f} ({ordered[0]:.2f}-{ordered[-1]:.2f})"


def render(rows: list[tuple[str, int, float]],
           burst_rows: dict[str, list[dict[str, float]]] | None, command: str) -> str:
    base = {size: us for case, size, us in rows if case == "passthrough"}
    lines = [HEADING, "",
             f"{datetime.date.today().isoformat()}, {platform.machine()} "
             f"({os.cpu_count()} cores, shared with other work), Python "
             f"{platform.python_version()}. Command: `{command}`", "",
             "| check | value | CPU us/record | added us/record | CPU s/GB of values |",
             "|---|---|---:|---:|---:|"]
    for case, size, us in rows:
        lines.append(f"| {case} | {size} B | {us:.2f} | {us - base[size]:+.2f} | "
                     f"{us / size * 1e3:.2f} |")
    if burst_rows:
        rounds = len(next(iter(burst_rows.values())))
        lines += ["", "Cache-miss burst: one producer sends a record at a time with a cached id; "
                  "a quarter into each phase another connection sends 100 records to another "
                  "topic (with a cached id, then with 100 ids the proxy has not seen; in the "
                  "last phase with a cached id while another process asks the registry what "
                  "the proxy would ask for 100 new ids: the machine's share of a burst). The "
                  f"steady producer's produce-to-acknowledgement latency, median of {rounds} "
                  "rounds (range); burst: from its first record sent to its last acknowledged:",
                  "", "| phase | records | p50 ms | p99 ms | max ms | burst ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        for phase, runs in burst_rows.items():
            lines.append(
                f"| {phase} | {runs[0]['n']:.0f} | {_spread([r['p50'] for r in runs])} | "
                f"{_spread([r['p99'] for r in runs])} | {_spread([r['max'] for r in runs])} | "
                f"{_spread([r['burst'] for r in runs]) if runs[0]['burst'] else '-'} |")
    added = {(case, size): us - base[size] for case, size, us in rows}
    lines += ["", "Against the issue's targets: the id check adds "
              f"{max(added[('id', 100)], added[('id', 1024)]):.2f} us a record (target 0.3); "
              f"the Avro payload check {max(added[('avro', 100)], added[('avro', 1024)]):.2f} "
              "us (target 3); its CPU per GB in the proxy is in the next section "
              "(bench/schema_registry_cpu.py)."]
    if burst_rows:
        p99 = {phase: sorted(r["p99"] for r in runs)[len(runs) // 2]
               for phase, runs in burst_rows.items()}
        lines.append(f"A burst of 100 new ids raises the other connection's p99 from "
                     f"{p99[PHASES[0]]:.2f} to {p99[PHASES[2]]:.2f} ms; the same registry "
                     f"requests made by another process raise it to {p99[PHASES[3]]:.2f} ms, "
                     "the machine's share (the registry's JVM answering on the same cores).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the cases, print the table, record it (unless ``--no-write``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry-url")
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=2.5, help="per case")
    parser.add_argument("--burst", action="store_true", help="also run the cache-miss burst")
    parser.add_argument("--steady-records", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3,
                        help="burst rounds (each runs every phase once)")
    parser.add_argument("--max-requests-in-flight", type=int,
                        help="the proxy's registry.max_requests_in_flight (default: its own)")
    parser.add_argument("--burst-only", action="store_true",
                        help="run only the cache-miss burst (implies --no-write)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    settings = ({} if args.max_requests_in_flight is None
                else {"max_requests_in_flight": args.max_requests_in_flight})
    with registry(args.registry_url) as url:
        if args.burst_only:
            print(render([], burst(url, args.steady_records, args.rounds, settings),
                         "burst only"))
            return
        rows = per_record(url, args.records, args.seconds)
        burst_rows = (burst(url, args.steady_records, args.rounds, settings)
                      if args.burst else None)
    command = "python -m bench.schema_registry" + (" --burst" if args.burst else "")
    text = render(rows, burst_rows, command)
    print(text)
    if not args.no_write:
        from bench.results import write_results
        write_results(text, "schema-registry")


if __name__ == "__main__":
    main()
