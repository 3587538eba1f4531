"""One run of the proxy benchmark: start broker, proxy or haproxy, drive a real producer.

:func:`run_once` starts a fresh embedded broker (and the scenario's hop), runs
:func:`run_producer` in a subprocess of its own (warm-up, throughput phase,
paced latency phase) and fills a :class:`~bench.proxy.stats.RunResult` with
its rates, latencies and the CPU each process used. Everything it starts is
stopped before it returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.proxy.cpu import CpuSampler, process_memory
from bench.proxy.paced import paced_phase
from bench.proxy.scenarios import (
    README_PLUGINS,
    ROOT,
    TANSU_NODE_ID,
    Case,
    Scenario,
    readme_plugin,
)
from bench.proxy.stats import RunResult, haproxy_config, json_values


def _producer_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "bootstrap.servers": spec["bootstrap"],
        "client.id": "bench-proxy",
        "acks": str(spec["acks"]),
        "compression.type": spec["codec"],
        "linger.ms": spec["linger_ms"],
        "max.in.flight.requests.per.connection": spec["max_in_flight"],
        # A short queue: what is still queued when a slow scenario's throughput phase
        # hits --max-seconds must drain quickly, and it is plenty for 5 x 1 MB in flight.
        "queue.buffering.max.messages": 100_000,
        "queue.buffering.max.kbytes": 32 * 1024,
        "enable.idempotence": False,
    }


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """Create ``topic`` (``partitions`` partitions, one replica) through ``bootstrap``."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                            replication_factor=1)], operation_timeout=10)
    for future in futures.values():
        future.result(timeout=30)


def _read_first_value(bootstrap: str, topic: str, timeout: float = 10) -> bytes | None:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-check",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                value: bytes | None = msg.value()
                return value
        return None
    finally:
        consumer.close()


def run_producer(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The producer side of one run (runs in its own process: ``--worker SPEC``).

    Creates the topic, warms up, then runs the throughput phase and the paced
    latency phase, sampling the CPU of ``spec["pids"]`` at the phase boundaries.
    """
    from confluent_kafka import Producer

    bootstrap, topic, partitions = spec["bootstrap"], spec["topic"], spec["partitions"]
    values = json_values(spec["value_size"], 1000)
    n_values = len(values)
    create_topic(bootstrap, topic, partitions)
    sampler = CpuSampler(spec["pids"])
    errors: list[str] = []

    def on_error(err: Any, msg: Any) -> None:
        if err is not None and len(errors) < 5:
            errors.append(str(err))

    def warm_up(producer: Any) -> int:
        for i in range(spec["warmup"]):
            producer.produce(topic, values[i % n_values], partition=i % partitions)
        if producer.flush(30):
            raise RuntimeError("warm-up records were not delivered within 30 s")
        return int(spec["warmup"])

    # Throughput: producers that report only failed deliveries; with --connections N,
    # N of them, each with connections of its own, taking turns by 1,000 records.
    producers = [Producer({**_producer_config(spec), "delivery.report.only.error": True,
                           "on_delivery": on_error})
                 for _ in range(spec.get("connections", 1))]
    for producer in producers:
        warm_up(producer)
    if errors:
        return {"error": f"warm-up: {errors[0]}"}
    count = spec["records"]
    proxy_pid = spec["pids"].get("proxy")
    memory_before = process_memory(proxy_pid) if proxy_pid else None
    before = sampler.sample()
    t0 = time.perf_counter()
    stop_at = t0 + spec["max_seconds"]
    i = 0
    producer = producers[0]
    produce, poll = producer.produce, producer.poll
    while i < count:
        try:
            produce(topic, values[i % n_values], partition=i % partitions)
        except BufferError:
            poll(0.001)
            continue
        i += 1
        if not i % 1000:
            if time.perf_counter() > stop_at:
                break  # a slow scenario: fewer records rather than a longer run
            producer = producers[i // 1000 % len(producers)]
            produce, poll = producer.produce, producer.poll
    count = i
    left = sum(p.flush(120) for p in producers)
    seconds = time.perf_counter() - t0
    cpu = CpuSampler.delta(before, sampler.sample())
    if left:
        errors.append(f"{left} records not delivered after flush")
    result: dict[str, Any] = {"records": count, "seconds": seconds, "cpu": cpu}
    memory_after = process_memory(proxy_pid) if proxy_pid else None
    if memory_before is not None and memory_after is not None:
        result["proxy_minflt"] = memory_after["minflt"] - memory_before["minflt"]
        result["proxy_rss"] = memory_after.get("rss")
        result["proxy_peak_rss"] = memory_after.get("hwm")
    if errors:
        result["error"] = f"throughput phase: {errors[0]}"
        return result

    if spec["latency_seconds"] <= 0:  # a capacity round: throughput only
        return result
    # Latency: a paced producer; librdkafka's own latency of every (or every sampled) record.
    offered = spec.get("offered_rps") or spec["load_fraction"] * count / seconds
    result["offered_rps"] = offered
    if offered > count / seconds:
        # Above this scenario's own throughput the latency is just queue growth.
        result["saturated"] = True
        return result
    result.update(paced_phase(spec, _producer_config(spec), values, sampler, offered,
                              sent_before=[spec["warmup"]] * len(producers) + [count],
                              warm_up=warm_up))
    if "error" in result:
        return result
    if spec.get("check"):
        value = _read_first_value(bootstrap, topic)
        result["check"] = None if value is None else value[:40].decode("latin-1")
    return result


# --------------------------------------------------------------------------- processes


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _broker_port_start() -> int:
    # Node N is served on start + N; pick start so that Tansu's node 111 gets a free port.
    for _ in range(50):
        port = _free_port()
        if port - TANSU_NODE_ID > 1024:
            return port - TANSU_NODE_ID
    raise RuntimeError("no free port found for the proxy's broker listener")


def _wait_listening(port: int, proc: subprocess.Popen[Any], what: str,
                    timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _stop(proc: subprocess.Popen[Any] | None, timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class _Tail:
    """Keeps the last lines a process printed (and notices one line)."""

    def __init__(self, proc: subprocess.Popen[str], marker: str) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._marker = marker
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines = [*self.lines[-40:], line.rstrip("\n")]
            if self._marker in line:
                self.ready.set()
        self.ready.set()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass(slots=True)
class Setup:
    """What one run started: the broker, perhaps a proxy, and where the producer connects."""

    bootstrap: str
    pids: dict[str, int]
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)


def _no_attach(setup: Setup) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that confines the child (and all it starts) to ``cpus``, or None."""
    if not cpus:
        return None
    frozen = set(cpus)
    return lambda: os.sched_setaffinity(0, frozen)


def niced(steps: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that lowers a child's priority by ``steps`` nice steps (0: none)."""
    if not steps:
        return None

    def lower() -> None:
        os.nice(steps)

    return lower


@contextlib.contextmanager
def started(scenario: Scenario, workdir: Path, proxy_flags: Sequence[str],
            proxy_cpus: set[int] | None = None, others_nice: int = 0,
            tree: Path = ROOT) -> Iterator[Setup]:
    """Start a fresh broker and the scenario's proxy; stop both afterwards.

    The broker listens on a free loopback port with memory storage; a kiproxy scenario
    runs ``kiproxy run`` with the scenario's interceptor and ``proxy_flags``. The
    :class:`Setup` says where a client connects and the processes' pids. With
    ``proxy_cpus`` the hop runs on those CPUs only (set before it starts, so that every
    thread and worker process it makes inherits them). With ``others_nice`` the broker
    runs that many nice steps below this process's priority (the hop does not).
    ``tree`` is the source tree kiproxy is imported from (another commit's, for an
    A/B run: ``bench.ab``).
    """
    from kiproxy_dev.tansu import broker_binary

    pin = pinned(proxy_cpus)
    broker_port = _free_port()
    advertised = broker_port
    hop_port = None
    if scenario.kind in ("haproxy", "forwarder"):  # a hop the broker must advertise
        hop_port = _free_port()
        advertised = hop_port
    setup = Setup(bootstrap=f"127.0.0.1:{broker_port}", pids={})
    log = open(workdir / "broker.log", "ab")  # noqa: SIM115 - closed below
    try:
        broker = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{broker_port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}",
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
            preexec_fn=niced(others_nice))
        setup.processes.append(broker)
        setup.pids["broker"] = broker.pid
        _wait_listening(broker_port, broker, "the Tansu broker")
        if scenario.kind == "haproxy":
            assert hop_port is not None
            cfg = workdir / "haproxy.cfg"
            cfg.write_text(haproxy_config(hop_port, broker_port))
            hap = subprocess.Popen([haproxy_binary() or "haproxy", "-f", str(cfg), "-db"],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, preexec_fn=pin)
            setup.processes.append(hap)
            setup.pids["proxy"] = hap.pid
            _wait_listening(hop_port, hap, "haproxy")
            setup.bootstrap = f"127.0.0.1:{hop_port}"
        elif scenario.kind == "forwarder":
            assert hop_port is not None
            _hop(setup, [sys.executable, "-m", "bench.proxy.forwarder", str(hop_port),
                         str(broker_port)], "ready", "the uvloop forwarder", 30,
                 cwd=ROOT, preexec_fn=pin)
            setup.bootstrap = f"127.0.0.1:{hop_port}"
        elif scenario.kind == "kiproxy":
            listen = _free_port()
            cmd = [sys.executable, "-m", "kiproxy", "run",
                   "--upstream", f"127.0.0.1:{broker_port}", "--listen", f"127.0.0.1:{listen}",
                   "--broker-port-start", str(_broker_port_start()), "--log-level", "WARNING",
                   *proxy_flags]
            if scenario.interceptor:
                cmd += ["--interceptor", scenario.interceptor]
            if scenario.interceptor_config is not None:
                cmd += ["--interceptor-config", json.dumps(scenario.interceptor_config)]
            if scenario.plugins_dir is not None:
                if scenario.plugins_dir == README_PLUGINS:
                    readme_plugin()
                cmd += ["--plugins-dir", str(scenario.plugins_dir)]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if tree != ROOT:  # `-m kiproxy` imports from the working directory first
                env["PYTHONPATH"] = str(tree)
            _hop(setup, cmd, "bootstrap address", "kiproxy", 60, cwd=tree, env=env,
                 preexec_fn=pin)
            setup.bootstrap = f"127.0.0.1:{listen}"
        yield setup
    finally:
        for proc in reversed(setup.processes):
            _stop(proc)
        log.close()


def _hop(setup: Setup, cmd: list[str], marker: str, what: str, timeout: float,
         **popen: Any) -> None:
    """Start ``cmd``, the hop, kept in ``setup``; return once it printed ``marker``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, **popen)
    setup.processes.append(proc)
    tail = _Tail(proc, marker)
    if not tail.ready.wait(timeout) or proc.poll() is not None:
        raise RuntimeError(f"{what} did not start:\n{tail.text}")
    setup.pids["proxy"] = proc.pid


def haproxy_binary() -> str | None:
    explicit = os.environ.get("HAPROXY")
    if explicit:
        return explicit if Path(explicit).exists() else None
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).exists()), None)


def kiproxy_has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "kiproxy", "run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    return flag in out.stdout


@dataclass(slots=True, kw_only=True)
class Options:
    """What the command line asked for."""

    records: dict[int, int]
    """Throughput-phase records per value size."""
    warmup: int
    latency_seconds: float
    load_fraction: float
    partitions: int
    acks: str
    linger_ms: float
    max_in_flight: int
    proxy_flags: list[str]
    max_seconds: float = 10.0
    """The throughput phase stops producing after this long (slow scenarios)."""
    timeout: float = 600
    proxy_cpus: set[int] | None = None
    """CPUs the hop is confined to (the broker and the producer get this process's)."""
    others_nice: int = 0
    """Nice steps the broker and the producer run below the hop (0: the same priority)."""
    latency_sample: int = 1
    """The paced phase times a random 1 in ``latency_sample`` records (1: every record)."""
    connections: int = 1
    """Producer instances of the throughput phase, each with connections of its own
    (so that ``--workers`` has connections to spread)."""


def run_once(scenario: Scenario, case: Case, round_: int, options: Options,
             offered_rps: float | None, check: bool,
             attach: Callable[[Setup], contextlib.AbstractContextManager[None]] | None = None,
             ) -> RunResult:
    """Start a broker (and proxy), run the producer process against it, collect the result."""
    result = RunResult(scenario=scenario.name, case=case, round=round_,
                       load=os.getloadavg()[0])
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        try:
            with started(scenario, Path(tmp), options.proxy_flags,
                         options.proxy_cpus, options.others_nice) as setup, \
                    (attach or _no_attach)(setup):
                return measure(setup, scenario, case, round_, options, offered_rps, check)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            result.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return result


def measure(setup: Setup, scenario: Scenario, case: Case, round_: int, options: Options,
            offered_rps: float | None, check: bool) -> RunResult:
    """Run the producer process against a started ``setup`` and collect its result."""
    result = RunResult(scenario=scenario.name, case=case, round=round_,
                       load=os.getloadavg()[0])
    spec = {
        "bootstrap": setup.bootstrap, "topic": f"bench-{uuid.uuid4().hex[:8]}",
        "partitions": options.partitions, "value_size": case.value_size,
        "codec": case.codec, "acks": options.acks, "linger_ms": options.linger_ms,
        "max_in_flight": options.max_in_flight,
        "records": options.records[case.value_size], "warmup": options.warmup,
        "max_seconds": options.max_seconds,
        "latency_seconds": options.latency_seconds,
        "load_fraction": options.load_fraction, "offered_rps": offered_rps,
        "pids": setup.pids, "check": check, "connections": options.connections,
        "latency_sample": options.latency_sample,
    }
    out = subprocess.run(
        [sys.executable, "-m", "bench.proxy", "--worker", json.dumps(spec)],
        cwd=ROOT, capture_output=True, text=True, timeout=options.timeout,
        check=False, preexec_fn=niced(options.others_nice))
    if out.returncode != 0 or not out.stdout.strip():
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        result.error = f"producer exited {out.returncode}: " + " | ".join(tail)
        return result
    data = json.loads(out.stdout.strip().splitlines()[-1])
    _fill(result, data, scenario)
    return result


def _fill(result: RunResult, data: Mapping[str, Any], scenario: Scenario) -> None:
    cpu = data.get("cpu") or {}
    paced_cpu = data.get("paced_cpu") or {}
    result.records = int(data.get("records", 0))
    result.seconds = float(data.get("seconds", 0.0))
    result.proxy_cpu = cpu.get("proxy")
    result.proxy_user_cpu = cpu.get("proxy_user")
    result.broker_cpu = cpu.get("broker")
    result.producer_cpu = cpu.get("self")
    result.proxy_minflt = data.get("proxy_minflt")
    result.proxy_rss = data.get("proxy_rss")
    result.proxy_peak_rss = data.get("proxy_peak_rss")
    result.other_cpu = cpu.get("other")
    result.offered_rps = data.get("offered_rps")
    result.paced_rps = data.get("paced_rps")
    result.paced_records = int(data.get("paced_records", 0))
    result.paced_seconds = float(data.get("paced_seconds", 0.0))
    result.paced_proxy_cpu = paced_cpu.get("proxy")
    result.paced_other_cpu = paced_cpu.get("other")
    result.paced_producer_cpu = paced_cpu.get("self")
    result.paced_broker_cpu = paced_cpu.get("broker")
    result.latency_sample = int(data.get("latency_sample", 1))
    result.saturated = bool(data.get("saturated"))
    result.p50_ms = data.get("p50_ms")
    result.p99_ms = data.get("p99_ms")
    result.p999_ms = data.get("p999_ms")
    result.check = data.get("check")
    result.error = data.get("error")
    if result.error is None and result.check is not None:
        upper = result.check == result.check.upper()
        if scenario.transforms != upper:
            result.error = (f"stored value {result.check!r} is "
                            f"{'not ' if scenario.transforms else ''}upper-cased")
        elif scenario.stored_prefix and not result.check.startswith(scenario.stored_prefix):
            result.error = (f"stored value {result.check!r} does not start with "
                            f"{scenario.stored_prefix!r}")
