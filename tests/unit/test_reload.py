"""Reload rules: restart-only keys, all-or-nothing, coalescing, the debounced file watch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kiproxy.cli import build_parser
from kiproxy.proxy.cli import _overrides
from kiproxy.proxy.config.model import (
    DEFAULT_INLINE_ENCODE_SECONDS,
    ConfigError,
    ProxyConfig,
    load_config,
)
from kiproxy.proxy.reload.reloader import (
    FileWatch,
    Reloader,
    ReloadResult,
    config_hash,
    redacted,
    restart_only_changes,
    watched_paths,
)
from kiproxy.proxy.server import ProxyServer

BASE = {"upstream": ["127.0.0.1:9092"]}


def _config(**overrides: Any) -> ProxyConfig:
    return load_config(None, {**BASE, **overrides})


def test_live_settings_are_not_restart_only() -> None:
    old = _config()
    new = _config(**{"interceptor.class": "uppercase", "interceptor.timeout_ms": 100,
                     "max_in_flight": 7, "idle_timeout_ms": 5, "log_level": "DEBUG",
                     "plugins_dir": "/x", "max_frame_size": 1000,
                     "max_inline_encode_ms": 0.5})
    assert restart_only_changes(old, new) == []


@pytest.mark.parametrize(("key", "value", "named"), [
    ("listen", "127.0.0.1:9999", "listen"),
    ("advertised_host", "proxy.example.com", "advertised_host"),
    ("broker_port_start", 20000, "broker_port_start"),
    ("workers", 2, "workers"),
    ("metrics_listen", "127.0.0.1:9404", "metrics_listen"),
    ("upstream", ["127.0.0.1:9093"], "upstream"),
    ("upstream_tls.enabled", True, "upstream_tls"),
    ("log_format", "json", "log_format"),
    ("admin.token_file", "/run/token", "admin"),
    ("dead_letter_sink.bootstrap", "127.0.0.1:19999", "dead_letter_sink"),
    ("audit_sink.bootstrap", "127.0.0.1:19999", "audit_sink"),
])
def test_each_restart_only_key_is_named(key: str, value: Any, named: str) -> None:
    assert restart_only_changes(_config(), _config(**{key: value})) == [named]


def test_turning_client_tls_on_needs_a_restart_but_a_new_certificate_does_not() -> None:
    plain = _config()
    tls_a = _config(**{"tls.cert": "/a.pem", "tls.key": "/a.key"})
    tls_b = _config(**{"tls.cert": "/b.pem", "tls.key": "/b.key"})
    mtls_a = _config(**{"tls.cert": "/a.pem", "tls.key": "/a.key", "tls.client_ca": "/ca1.pem"})
    mtls_b = _config(**{"tls.cert": "/b.pem", "tls.key": "/b.key", "tls.client_ca": "/ca2.pem"})
    assert restart_only_changes(plain, tls_a) == ["tls (turning TLS on or off)"]
    assert restart_only_changes(tls_a, mtls_a) == ["tls.client_ca (turning mTLS on or off)"]
    assert restart_only_changes(tls_a, tls_b) == []
    assert restart_only_changes(mtls_a, mtls_b) == []


class _Harness:
    def __init__(self, files: list[ProxyConfig | Exception], build_fails: bool = False) -> None:
        self.files = files
        self.builds: list[int] = []
        self.applied: list[tuple[int, str]] = []
        self.results: list[ReloadResult] = []
        self.build_fails = build_fails
        self.gate: asyncio.Event | None = None
        self.reloader: Reloader[int] = Reloader(
            config=_config(), generation=1, load=self.load, build=self.build,
            apply=self.apply, on_result=self.results.append)

    def load(self) -> ProxyConfig:
        item = self.files.pop(0) if len(self.files) > 1 else self.files[0]
        if isinstance(item, Exception):
            raise item
        return item

    async def build(self, config: ProxyConfig, generation: int) -> int:
        self.builds.append(generation)
        if self.gate is not None:
            await self.gate.wait()
        if self.build_fails:
            raise RuntimeError("configure() of my_policy:Policy failed: ValueError: boom")
        return generation

    async def apply(self, built: int, config: ProxyConfig, trigger: str) -> None:
        self.applied.append((built, trigger))


async def test_a_good_reload_switches_and_counts_a_generation() -> None:
    h = _Harness([_config(**{"interceptor.class": "uppercase"})])
    result = await h.reloader.reload("http")
    assert result.ok and result.message == "applied" and result.generation == 2
    assert h.applied == [(2, "http")]
    assert h.reloader.config.interceptor.class_name == "uppercase"
    assert result.config_hash == config_hash(h.reloader.config)


async def test_before_load_runs_before_every_load() -> None:
    calls: list[str] = []

    async def before_load() -> None:
        calls.append("before_load")

    def load() -> ProxyConfig:
        calls.append("load")
        return _config()

    async def build(config: ProxyConfig, generation: int) -> int:
        return generation

    async def apply(built: int, config: ProxyConfig, trigger: str) -> None:
        calls.append("apply")

    reloader: Reloader[int] = Reloader(config=_config(), generation=1, load=load,
                                       build=build, apply=apply, before_load=before_load)
    assert (await reloader.reload("http")).ok and (await reloader.reload("signal")).ok
    assert calls == ["before_load", "load", "apply"] * 2


async def test_a_bad_file_changes_nothing_and_says_why() -> None:
    h = _Harness([ConfigError("config file p.yaml: interceptor.timeout: unknown key")])
    before = h.reloader.config
    result = await h.reloader.reload("signal")
    assert not result.ok and result.generation == 1
    assert result.message == "config file p.yaml: interceptor.timeout: unknown key"
    assert h.builds == [] and h.applied == [] and h.reloader.config is before


async def test_a_failing_build_changes_nothing() -> None:
    h = _Harness([_config(**{"interceptor.class": "uppercase"})], build_fails=True)
    result = await h.reloader.reload("watch")
    assert not result.ok and h.applied == [] and h.reloader.generation == 1
    assert "configure() of my_policy:Policy failed" in result.message


async def test_a_restart_only_change_is_refused_whole() -> None:
    h = _Harness([_config(**{"listen": "127.0.0.1:1234", "interceptor.class": "uppercase"})])
    result = await h.reloader.reload("http")
    assert not result.ok and result.restart_required == ("listen",)
    assert result.message == ("listen changed: a restart is needed to apply it; "
                              "nothing was reloaded")
    assert h.builds == [] and h.reloader.config.interceptor.class_name is None


async def test_a_reload_moves_where_the_running_proxy_re_encodes() -> None:
    values = [0.25, -1.0]
    server = ProxyServer(_config(), load=lambda: _config(max_inline_encode_ms=values[0]))
    try:
        assert server.offload.encode_cost.budget == DEFAULT_INLINE_ENCODE_SECONDS
        result = await server.reload("http")
        assert result.ok, result.message
        assert server.offload.encode_cost.budget == pytest.approx(0.00025)
        values.pop(0)
        refused = await server.reload("http")
        assert not refused.ok and "max_inline_encode_ms: must be at least 0" in refused.message
        assert server.offload.encode_cost.budget == pytest.approx(0.00025)
    finally:
        server.offload.close()


def test_the_flag_sets_where_a_starting_proxy_re_encodes() -> None:
    args = build_parser().parse_args(["run", "--upstream", "127.0.0.1:9092",
                                      "--max-inline-encode-ms", "0.2"])
    server = ProxyServer(load_config(None, _overrides(args)))
    try:
        assert server.config.max_inline_encode_ms == 0.2
        assert server.offload.encode_cost.budget == pytest.approx(0.0002)
    finally:
        server.offload.close()


async def test_a_storm_of_triggers_builds_at_most_twice() -> None:
    h = _Harness([_config(**{"interceptor.class": "uppercase"})])
    h.gate = asyncio.Event()
    tasks = [asyncio.create_task(h.reloader.reload("http")) for _ in range(100)]
    await asyncio.sleep(0.01)
    h.gate.set()
    results = await asyncio.gather(*tasks)
    assert all(r.ok for r in results)
    assert h.builds == [2, 3]
    assert h.reloader.generation == 3


def test_redacted_hides_secret_looking_values_but_not_key_paths() -> None:
    config = {"interceptor": {"config": {"password": "hunter2", "api_token": "t",
                                         "keys": {"k1": "secret-value"}, "limit": 3}},
              "tls": {"key": "/etc/kiproxy/tls.key"}}
    out = redacted(config)
    assert out["interceptor"]["config"]["password"] == "***"
    assert out["interceptor"]["config"]["api_token"] == "***"
    assert out["interceptor"]["config"]["limit"] == 3
    assert out["interceptor"]["config"]["keys"] == {"k1": "***"}  # names kept, values not
    assert out["tls"]["key"] == "/etc/kiproxy/tls.key"
    tokens = {"routes": [{"interceptors": [{"class": "header_token_authorizer", "config": {
        "tokens": {"orders": "orders-token", "*": ["tok-a", "tok-b"]}}}]}]}
    assert redacted(tokens)["routes"][0]["interceptors"][0] == {
        "class": "header_token_authorizer", "config": {"tokens": {"orders": "***",
                                                                   "*": ["***", "***"]}}}


def test_watched_paths_name_the_config_file_plugins_dir_and_tls_files(tmp_path: Path) -> None:
    config = _config(**{"plugins_dir": str(tmp_path), "tls.cert": "/c.pem", "tls.key": "/k.pem"})
    assert watched_paths(config, "proxy.yaml") == [
        Path("proxy.yaml"), tmp_path, Path("/c.pem"), Path("/k.pem")]


def _watching(watched: Path, paths: list[Path], debounce: float
             ) -> tuple[FileWatch, list[str]]:
    """A started watch of ``paths`` whose trigger records what ``watched`` holds."""
    fired: list[str] = []

    async def trigger() -> None:
        fired.append(watched.read_text())

    watch = FileWatch(lambda: paths, trigger, interval=0.02, debounce=debounce)
    watch.start()
    return watch, fired


async def _until_fired(fired: list[str], count: int = 1) -> None:
    for _ in range(200):
        if len(fired) >= count:
            return
        await asyncio.sleep(0.02)


async def test_the_file_watch_waits_for_writes_to_settle(tmp_path: Path) -> None:
    watched = tmp_path / "plugin.py"
    watched.write_text("v1")
    watch, fired = _watching(watched, [tmp_path], debounce=0.2)
    await asyncio.sleep(0.1)
    for i in range(5):  # a writer still at work: no trigger yet
        watched.write_text(f"partial {i}")
        await asyncio.sleep(0.05)
    assert fired == []
    watched.write_text("v2")
    await _until_fired(fired)
    await asyncio.sleep(0.3)
    await watch.stop()
    assert fired == ["v2"]


async def test_the_file_watch_counts_from_what_a_reload_by_another_trigger_read(
        tmp_path: Path) -> None:
    # v1 at start; v2 written and reloaded by SIGHUP before the watch settled on it:
    # not reloaded again. v1 written back: the proxy runs v2, the file says v1, so the
    # watch must reload.
    watched = tmp_path / "plugin.py"
    watched.write_text("v1")
    watch, fired = _watching(watched, [tmp_path], debounce=0.1)
    await asyncio.sleep(0.1)
    watched.write_text("v2")
    watch.applied(watch.snapshot())  # what a reload by signal does as it reads v2
    await asyncio.sleep(0.5)
    assert fired == []
    watched.write_text("v1")
    await _until_fired(fired)
    await watch.stop()
    assert fired == ["v1"]


async def test_files_put_back_after_a_failed_watch_reload_reload_nothing(
        tmp_path: Path) -> None:
    # v1 runs; v2 fails to load (the trigger applies nothing) and is not tried again
    # while it stays; v1 written back is what runs: no reload. v3 then applies.
    watched = tmp_path / "proxy.yaml"
    watched.write_text("v1")
    fired: list[str] = []
    watch: FileWatch

    async def trigger() -> None:
        fired.append(watched.read_text())
        if fired[-1] != "v2":
            watch.applied(watch.snapshot())

    watch = FileWatch(lambda: [tmp_path], trigger, interval=0.02, debounce=0.05)
    watch.start()
    await asyncio.sleep(0.1)
    watched.write_text("v2")
    await _until_fired(fired)
    await asyncio.sleep(0.3)
    assert fired == ["v2"]
    watched.write_text("v1")
    await asyncio.sleep(0.5)
    assert fired == ["v2"]
    watched.write_text("v3")
    await _until_fired(fired, 2)
    await watch.stop()
    assert fired == ["v2", "v3"]


async def test_the_file_watch_sees_a_symlink_swap(tmp_path: Path) -> None:
    # How a Kubernetes ConfigMap volume updates: ..data points at a new directory.
    for name, text in (("v1", "a"), ("v2", "b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "proxy.yaml").write_text(text)
    (tmp_path / "..data").symlink_to(tmp_path / "v1")
    (tmp_path / "proxy.yaml").symlink_to(tmp_path / "..data" / "proxy.yaml")
    watch, fired = _watching(tmp_path / "proxy.yaml", [tmp_path / "proxy.yaml"],
                             debounce=0.05)
    await asyncio.sleep(0.1)
    (tmp_path / "..data_tmp").symlink_to(tmp_path / "v2")
    (tmp_path / "..data_tmp").rename(tmp_path / "..data")
    await _until_fired(fired)
    await watch.stop()
    assert fired == ["b"]


def test_forgetting_plugin_modules_makes_a_changed_file_take_effect(tmp_path: Path) -> None:
    from kiproxy.interceptors.api import InterceptContext, Record, RecordBatch
    from kiproxy.interceptors.loader import forget_plugin_modules, load_interceptor

    source = '''
from kiproxy.interceptors import ProduceRequestInterceptor
from suffix_helper import SUFFIX

class Suffix(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        return batch.with_records(r.with_value(r.value + SUFFIX) for r in batch.records)
'''
    (tmp_path / "reload_suffix.py").write_text(source)
    (tmp_path / "suffix_helper.py").write_text("SUFFIX = b'-A'\n")
    batch = RecordBatch(topic="t", partition=0, records=(Record(key=None, value=b"v"),))
    ctx = InterceptContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                           api_version=9, acks=1, transactional_id=None, deadline=0.0)
    try:
        first = load_interceptor("reload_suffix:Suffix", tmp_path)
        (tmp_path / "suffix_helper.py").write_text("SUFFIX = b'-B'\n")
        assert sorted(forget_plugin_modules(tmp_path)) == ["reload_suffix", "suffix_helper"]
        second = load_interceptor("reload_suffix:Suffix", tmp_path)
        assert first.intercept(batch, ctx).records[0].value == b"v-A"
        assert second.intercept(batch, ctx).records[0].value == b"v-B"
    finally:
        forget_plugin_modules(tmp_path)


async def test_the_start_up_line_names_the_bound_address_and_the_advertised_one(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    server = ProxyServer(_config(listen="127.0.0.1:0", advertised_host="127.0.0.2"))
    with caplog.at_level(logging.INFO, logger="kiproxy"):
        await server.start()
    try:
        port = server.bootstrap_address.rsplit(":", 1)[1]
        said = [r.getMessage() for r in caplog.records if "listening on" in r.getMessage()]
        assert said == [f"kiproxy listening on 127.0.0.1:{port}, bootstrap address "
                        f"127.0.0.2:{port} (upstream 127.0.0.1:9092)"], said
    finally:
        await server.stop(grace=0)


def test_every_worker_reports_the_hash_of_the_configuration_as_written() -> None:
    # Each worker derives its own metrics port and audit file; the hash compared across
    # workers to confirm a rollout is the configuration's, not the derived copy's.
    from kiproxy.proxy.reload.reloader import config_hash
    from kiproxy.proxy.workers import worker_config

    written = _config(metrics_listen="127.0.0.1:9404", workers=3,
                      **{"audit.path": "/tmp/kiproxy-audit.jsonl"})
    workers = [worker_config(written, i) for i in range(3)]
    assert [w.metrics_listen for w in workers] == [
        "127.0.0.1:9404", "127.0.0.1:9405", "127.0.0.1:9406"]
    assert {config_hash(w) for w in workers} == {config_hash(written)}
    assert config_hash(_config(metrics_listen="127.0.0.1:9404", workers=3)) != \
        config_hash(written)


def test_a_changed_copy_of_a_workers_settings_hashes_itself() -> None:
    from kiproxy.proxy.reload.reloader import config_hash
    from kiproxy.proxy.workers import worker_config

    written = _config(metrics_listen="127.0.0.1:9404", workers=2)
    changed = worker_config(written, 1).model_copy(update={"max_in_flight": 7})
    assert config_hash(changed) != config_hash(written)
