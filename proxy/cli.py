"""``kiproxy run``: the proxy in front of a cluster.

``add_parsers`` adds the subcommand to the ``kiproxy`` parser (:mod:`kiproxy.cli`);
``run`` executes it and returns the exit code. ``kiproxy dev``
(:mod:`kiproxy.localbrokers.dev`) shares the proxy's flags (:func:`add_flags`),
the start-up (:func:`run` with its own ``body``) and :func:`serve_until_stopped`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.proxy.brokers.discovery import UpstreamUnreachable, check_upstream
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config, parse_json_object
from kiproxy.proxy.observe.collector import freeze_imported
from kiproxy.proxy.observe.logs import setup_logging
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.server import ProxyServer

log = logging.getLogger("kiproxy")

__all__ = ["COMMANDS", "add_flags", "add_parsers", "run", "serve", "serve_until_stopped"]

COMMANDS = ("run",)

Body = Callable[[ProxyConfig, argparse.Namespace, dict[str, Any]], int]
"""What runs once the configuration is loaded: returns the exit code."""


def add_flags(p: argparse.ArgumentParser, *, upstream: bool) -> None:
    """The proxy's settings as flags on ``p``; without the upstream ones for ``dev``."""
    p.add_argument("--config", metavar="FILE", help="YAML config file; flags override it")
    if upstream:
        p.add_argument("--upstream", metavar="HOST:PORT", action="append",
                       help="bootstrap server of the real cluster (repeatable)")
        p.add_argument("--wait-for-upstream", action="store_true", default=None,
                       help="keep trying the upstream at start (/readyz false until it "
                            "answers) instead of exiting when it does not answer")
        p.add_argument("--upstream-startup-timeout-ms", metavar="MS", type=int,
                       help="how long to try the upstream at start before exiting "
                            "(default 10000)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="bootstrap listener address (default 127.0.0.1:9192)")
    p.add_argument("--advertised-host", metavar="HOST",
                   help="host named in rewritten metadata (default: the listen host)")
    p.add_argument("--broker-port-start", metavar="PORT", type=int,
                   help="node N is served on PORT+N (default: listen port + 1)")
    p.add_argument("--node-port", metavar="NODE=PORT", action="append",
                   help="serve node NODE on PORT instead (repeatable)")
    p.add_argument("--plugins-dir", metavar="DIR",
                   help="directory searched first for interceptor modules")
    p.add_argument("--interceptor", metavar="MODULE:CLASS",
                   help="the interceptor every produced batch goes through")
    p.add_argument("--interceptor-config", metavar="JSON",
                   help="JSON object passed to the interceptor's configure()")
    p.add_argument("--interceptor-timeout-ms", metavar="MS", type=int,
                   help="per-batch deadline (default 5000)")
    p.add_argument("--interceptor-isolation", metavar="MODE", choices=("inline", "process"),
                   help="inline (default: on the event loop) or process (worker processes, "
                        "killed at the deadline or on a crash and replaced)")
    p.add_argument("--interceptor-workers", metavar="N", type=int,
                   help="worker processes with --interceptor-isolation process (default 2)")
    p.add_argument("--compression-gzip-level", metavar="LEVEL", type=int,
                   help="gzip level of batches the interceptor changed, 1-9 (default 6)")
    p.add_argument("--compression-lz4-level", metavar="LEVEL", type=int,
                   help="LZ4 level of batches the interceptor changed, 1-17 "
                        "(default 1: fast mode; 3 and above: LZ4HC)")
    p.add_argument("--compression-zstd-level", metavar="LEVEL", type=int,
                   help="zstd level of batches the interceptor changed, -131072..22 (default 3)")
    p.add_argument("--max-frame-size", metavar="BYTES", type=int,
                   help="largest request frame accepted (default 104857600)")
    p.add_argument("--max-in-flight", metavar="N", type=int,
                   help="responses owed to one client before reads pause (default 100)")
    p.add_argument("--audit-log", metavar="PATH",
                   help="write a JSON Lines audit event per produced topic-partition to PATH")
    p.add_argument("--audit-requests", action="store_true", default=None,
                   help="also audit requests of other APIs (one event each)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve /metrics, /healthz and /readyz on HOST:PORT")
    if upstream:  # `kiproxy dev` runs one process
        p.add_argument("--workers", metavar="N", type=int,
                       help="processes sharing the listeners with SO_REUSEPORT (default 1)")
    p.add_argument("--max-connections", metavar="N", type=int,
                   help="client connections open at once (default 10000)")
    p.add_argument("--max-buffered-bytes", metavar="BYTES", type=int,
                   help="response bytes buffered per client before its reads pause "
                        "(default 8388608)")
    p.add_argument("--max-decompressed-batch-bytes", metavar="BYTES", type=int,
                   help="largest decompressed records block of one batch; larger ones are "
                        "refused with INVALID_RECORD (default 33554432)")
    p.add_argument("--max-decompression-ratio", metavar="N", type=int,
                   help="largest decompressed/compressed ratio past 4 MiB of output "
                        "(default 256; 0: no ratio check)")
    p.add_argument("--max-decode-memory", metavar="BYTES", type=int,
                   help="process-wide bytes of large batches being decoded or held "
                        "decoded; more waits (default 268435456)")
    p.add_argument("--max-inline-encode-ms", metavar="MS", type=float,
                   help="CPU a transformed batch may be expected to take to re-compress "
                        "on the event loop; more goes to a thread (default 1)")
    p.add_argument("--max-client-buffered-bytes", metavar="BYTES", type=int,
                   help="process-wide bytes of partial request frames held; past it "
                        "connections' reads pause (default 268435456)")
    p.add_argument("--idle-timeout-ms", metavar="MS", type=int,
                   help="close idle client connections after MS (default 600000; 0: never)")
    tls = p.add_argument_group("TLS")
    tls.add_argument("--tls-cert", metavar="FILE", help="PEM certificate for client-facing TLS")
    tls.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    tls.add_argument("--tls-client-ca", metavar="FILE",
                     help="require client certificates signed by this CA (mTLS)")
    tls.add_argument("--tls-min-version", metavar="VERSION", choices=("TLSv1.2", "TLSv1.3"),
                     help="TLSv1.2 (default) or TLSv1.3")
    if upstream:  # the embedded broker of `kiproxy dev` speaks plain TCP
        tls.add_argument("--upstream-tls", action="store_true", default=None,
                         help="connect to brokers with TLS "
                              "(system CA store unless --upstream-tls-ca)")
        tls.add_argument("--upstream-tls-ca", metavar="FILE",
                         help="PEM CA bundle of the brokers' certificates "
                              "(implies --upstream-tls)")
        tls.add_argument("--upstream-tls-cert", metavar="FILE",
                         help="client certificate presented to brokers")
        tls.add_argument("--upstream-tls-key", metavar="FILE",
                         help="private key of --upstream-tls-cert")
        tls.add_argument("--upstream-tls-no-verify-hostname", action="store_true", default=None,
                         help="do not check broker host names against their certificates")
    p.add_argument("--log-level", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--log-format", metavar="FORMAT", choices=("text", "json"),
                   help="text (key=value pairs, default) or json")


def add_parsers(subparsers: Any) -> None:
    """Add ``run`` to ``kiproxy``'s subcommands."""
    run = subparsers.add_parser("run", help="run the proxy in front of a Kafka cluster",
                                description="Run the proxy in front of a Kafka cluster.")
    add_flags(run, upstream=True)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    node_ports = None
    if args.node_port:
        node_ports = {}
        for item in args.node_port:
            node, _, port = item.partition("=")
            if not node.strip().isdigit() or not port.strip().isdigit():
                raise ConfigError(f"--node-port {item!r}: expected NODE=PORT")
            node_ports[int(node)] = int(port)
    interceptor_config = (
        parse_json_object(args.interceptor_config, "--interceptor-config")
        if args.interceptor_config else None
    )
    return {
        "upstream": getattr(args, "upstream", None),
        "wait_for_upstream": getattr(args, "wait_for_upstream", None),
        "upstream_startup_timeout_ms": getattr(args, "upstream_startup_timeout_ms", None),
        "listen": args.listen,
        "advertised_host": args.advertised_host,
        "broker_port_start": args.broker_port_start,
        "node_ports": node_ports,
        "plugins_dir": args.plugins_dir,
        "interceptor.class": args.interceptor,
        "interceptor.config": interceptor_config,
        "interceptor.timeout_ms": args.interceptor_timeout_ms,
        "interceptor.isolation": args.interceptor_isolation,
        "interceptor.workers": args.interceptor_workers,
        "interceptor.compression.gzip_level": args.compression_gzip_level,
        "interceptor.compression.lz4_level": args.compression_lz4_level,
        "interceptor.compression.zstd_level": args.compression_zstd_level,
        "max_frame_size": args.max_frame_size,
        "max_in_flight": args.max_in_flight,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "audit.path": args.audit_log,
        "audit.requests": args.audit_requests,
        "metrics_listen": args.metrics_listen,
        "workers": getattr(args, "workers", None),
        "max_connections": args.max_connections,
        "max_buffered_bytes": args.max_buffered_bytes,
        "max_decompressed_batch_bytes": args.max_decompressed_batch_bytes,
        "max_decompression_ratio": args.max_decompression_ratio,
        "max_decode_memory": args.max_decode_memory,
        "max_inline_encode_ms": args.max_inline_encode_ms,
        "max_client_buffered_bytes": args.max_client_buffered_bytes,
        "idle_timeout_ms": args.idle_timeout_ms,
        "tls.cert": args.tls_cert,
        "tls.key": args.tls_key,
        "tls.client_ca": args.tls_client_ca,
        "tls.min_version": args.tls_min_version,
        "upstream_tls.enabled": getattr(args, "upstream_tls", None),
        "upstream_tls.ca": getattr(args, "upstream_tls_ca", None),
        "upstream_tls.cert": getattr(args, "upstream_tls_cert", None),
        "upstream_tls.key": getattr(args, "upstream_tls_key", None),
        "upstream_tls.verify_hostname":
            False if getattr(args, "upstream_tls_no_verify_hostname", None) else None,
    }


async def serve(config: ProxyConfig, on_ready: Any = None, *,
                load: Callable[[], ProxyConfig] | None = None,
                config_file: str | None = None,
                siblings: tuple[tuple[str, int], ...] = ()) -> None:
    """Run the proxy until SIGINT/SIGTERM, then shut down gracefully; SIGHUP reloads
    (``load`` reads the configuration again)."""
    metrics = Metrics() if config.metrics_listen is not None else None
    server = ProxyServer(config, metrics=metrics, load=load, siblings=siblings,
                         config_file=config_file)  # builds generation 1, or raises
    # Signal handlers go in before the server announces itself, so a supervisor
    # that stops the proxy right after reading the bootstrap line gets a clean
    # shutdown rather than a KeyboardInterrupt traceback.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[Any]] = set()

    def on_sighup() -> None:
        task = loop.create_task(server.reload("signal"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    await server.start()
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    log.info("shutting down: letting in-flight requests finish (grace %d ms)",
             config.shutdown_grace_ms)
    await server.stop()


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _keep_freed_memory() -> None:
    """Let glibc keep freed heap memory instead of returning it after every request,
    in one arena that ``malloc_trim(0)`` can give back whole.

    A produce request is typically a few hundred KiB to a few MiB; with glibc's
    defaults such blocks are mapped and unmapped (or the heap trimmed) per request,
    and every page of the next one is faulted in again: measured (bench/RESULTS.md,
    "Keeping freed memory"), ~440,000 minor faults and about 1 CPU s more per GB of
    records on every proxied path. Blocks up to 32 MiB now come from the heap, and up
    to 128 MiB of free heap is kept for reuse between requests; after a burst of large
    frames or decoded batches :class:`kiproxy.proxy.net.buffers.HeapTrimmer` gives it back
    with ``malloc_trim(0)``. Every thread allocates from the one main arena: the
    decode threads' own arenas would keep their free top (up to 64 MiB each) resident
    for good, since ``malloc_trim`` trims only the main arena's top and the trim
    threshold stops the threads' arenas from shrinking themselves; measured, this
    costs nothing on the bench. A no-op where the C library is not glibc, or with
    ``KIPROXY_KEEP_FREED_MEMORY=0`` in the environment (glibc's own tuning then
    applies, e.g. through ``GLIBC_TUNABLES``).
    """
    if os.environ.get("KIPROXY_KEEP_FREED_MEMORY", "1") == "0":
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_ARENA_MAX, 1)
    mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
    mallopt(_M_TRIM_THRESHOLD, 128 * 1024 * 1024)


def _run(coro: Any) -> None:
    _keep_freed_memory()
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def run(args: argparse.Namespace, body: Body | None = None, **fixed: Any) -> int:
    """Load the configuration (the file, the flags over it, then ``fixed``), set up
    logging and run ``body`` (default: serve in front of the configured upstream);
    returns the exit code."""
    try:
        overrides = {**_overrides(args), **fixed}
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(*exc.lines(), sep="\n", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    freeze_imported()  # before any generation, connection or worker exists
    try:
        return (body or _serve_upstream)(config, args, overrides)
    except UpstreamUnreachable as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1
    except PluginLoadError as exc:
        print(f"kiproxy: plugin error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(*exc.lines(), sep="\n", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1


def _serve_upstream(config: ProxyConfig, args: argparse.Namespace,
                    overrides: dict[str, Any]) -> int:
    if not config.upstream:
        print("kiproxy: config error: upstream: at least one HOST:PORT is required "
              "(--upstream or the config file's upstream list)", file=sys.stderr)
        return 2
    if not config.wait_for_upstream:
        _run(check_upstream(config))
    if config.workers > 1:
        return _serve_workers(config, args.config, overrides)
    serve_until_stopped(config, args.config, overrides)
    return 0


def serve_until_stopped(config: ProxyConfig, config_file: str | None,
                        overrides: dict[str, Any]) -> None:
    """Serve ``config`` in this process until SIGINT/SIGTERM; a reload reads
    ``config_file`` again with ``overrides`` over it."""
    _run(serve(config, on_ready=_print_ready,
               load=partial(load_config, config_file, overrides), config_file=config_file))


def worker_config(config: ProxyConfig, index: int) -> ProxyConfig:
    """The settings of worker ``index``: its own metrics port and audit file."""
    update: dict[str, Any] = {}
    if config.metrics_listen is not None:
        host, port = config.metrics_listen_address
        update["metrics_listen"] = f"{host}:{port + index}"
    if config.audit.path is not None:
        update["audit"] = config.audit.model_copy(
            update={"path": f"{config.audit.path}.w{index}"})
    return config.model_copy(update=update)


def _worker_load(config_file: str | None, overrides: dict[str, Any],
                 index: int) -> ProxyConfig:
    return worker_config(load_config(config_file, overrides), index)


def _siblings(config: ProxyConfig, index: int) -> tuple[tuple[str, int], ...]:
    """The metrics endpoints of the other workers (``POST /reload`` reaches them all)."""
    if config.metrics_listen is None:
        return ()
    host, port = config.metrics_listen_address
    return tuple((host, port + j) for j in range(config.workers) if j != index)


def _serve_workers(config: ProxyConfig, config_file: str | None,
                   overrides: dict[str, Any]) -> int:
    """Fork ``config.workers`` processes serving the same listeners; wait for them."""
    if config.listen_address[1] == 0:
        raise ConfigError("workers: several workers need a fixed listen port, not 0")
    if config.broker_port_start is None and not config.node_ports:
        log.info("workers: node listeners on listen port + 1 + node id")
    children: list[int] = []
    for index in range(config.workers):
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                _run(serve(worker_config(config, index),
                           on_ready=_print_ready if index == 0 else None,
                           load=partial(_worker_load, config_file, overrides, index),
                           config_file=config_file, siblings=_siblings(config, index)))
            except BaseException:
                log.exception("worker %d failed", index)
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        children.append(pid)

    def forward(sig: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward)  # every worker reloads
    failed = 0
    for child in children:
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
    if failed:
        log.error("%d of %d workers exited with an error", failed, len(children))
    return 1 if failed else 0


def _print_ready(server: ProxyServer) -> None:
    if server.metrics_address is not None:
        print(f"kiproxy: metrics on http://{server.metrics_address}/metrics", flush=True)
    print(f"kiproxy: bootstrap address {server.bootstrap_address}", flush=True)
