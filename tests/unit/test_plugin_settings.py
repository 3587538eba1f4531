"""Typed plugin settings: the loader validates a plugin's config against its model, with
the proxy config's errors, and hands the plugin the model; topics are matched one way."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
    TopicSelector,
)
from kiproxy.interceptors.builtin.pii import PiiMasker
from kiproxy.interceptors.builtin.signing import Signer, SignerSettings
from kiproxy.interceptors.loader import PluginSettingsError, load_interceptor
from kiproxy.interceptors.settings import SettingsError, settings_model

TYPED_PLUGIN = '''
from pydantic import Field
from kiproxy.interceptors import PluginSettings, ProduceRequestInterceptor


class LimitSettings(PluginSettings):
    max_records: int = Field(default=10, gt=0)
    """Records a batch may hold."""
    topics: dict[str, list[str]] = {}
    """Topic -> tags."""


class Limit(ProduceRequestInterceptor[LimitSettings]):
    def configure(self, config: LimitSettings) -> None:
        self.settings = config

    def intercept(self, batch, ctx):
        return batch
'''


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    (tmp_path / "typed_limit.py").write_text(TYPED_PLUGIN)
    return tmp_path


def _problems(plugins: Path, config: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(PluginSettingsError) as caught:
        load_interceptor("typed_limit:Limit", plugins, config)
    assert str(caught.value).startswith("typed_limit:Limit: invalid config: ")
    return caught.value.problems


def test_the_plugin_gets_its_settings_model_validated(plugins: Path) -> None:
    plugin = load_interceptor("typed_limit:Limit", plugins, {"max_records": "5"})
    assert type(plugin.settings).__name__ == "LimitSettings"
    assert plugin.settings.max_records == 5
    assert load_interceptor("typed_limit:Limit", plugins, None).settings.max_records == 10


def test_an_unknown_key_names_the_key_that_was_meant(plugins: Path) -> None:
    assert _problems(plugins, {"max_record": 5}) == (
        "max_record: unknown key; did you mean max_records?",)


def test_a_wrong_type_names_the_key_and_the_expected_type(plugins: Path) -> None:
    assert _problems(plugins, {"max_records": "ten", "topics": {"t": "x"}}) == (
        "max_records: expected an integer, got 'ten'",
        "topics.t: expected a list, got 'x'")
    assert _problems(plugins, {"max_records": 0}) == ("max_records: must be greater than 0, "
                                                      "got 0",)


def test_a_built_in_names_the_key_that_was_meant() -> None:
    with pytest.raises(SettingsError) as caught:
        Signer().configure({"keys": {"k1": "s"}, "key_idd": "k1"})
    assert caught.value.problems == ("key_idd: unknown key; did you mean key_id?",)


def test_a_key_inside_a_mapping_of_models_is_named_with_its_path() -> None:
    with pytest.raises(SettingsError) as caught:
        PiiMasker().configure({"rules": {"ids": {"pattern": "x", "acton": "reject"}},
                               "topics": {"t": ["ids"]}})
    assert caught.value.problems == ("rules.ids.acton: unknown key; did you mean "
                                     "rules.ids.action?",)


def test_configure_called_with_a_mapping_validates_it() -> None:
    class Settings(PluginSettings):
        size: int = Field(default=1, ge=0)
        """A size."""

    class Sized(ProduceRequestInterceptor[Settings]):
        def configure(self, config: Settings) -> None:
            self.size = config.size

        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch

    plugin = Sized()
    plugin.configure({"size": 3})  # type: ignore[arg-type]
    assert plugin.size == 3
    with pytest.raises(ValueError, match="size: must be at least 0, got -1"):
        plugin.configure({"size": -1})  # type: ignore[arg-type]


def test_a_plain_configure_still_gets_the_mapping(tmp_path: Path) -> None:
    (tmp_path / "plain_words.py").write_text(
        "from kiproxy.interceptors import ProduceRequestInterceptor\n"
        "class Words(ProduceRequestInterceptor):\n"
        "    def configure(self, config):\n"
        "        self.config = config\n"
        "    def intercept(self, batch, ctx):\n"
        "        return batch\n")
    plugin = load_interceptor("plain_words:Words", tmp_path, {"anything": [1, 2]})
    assert plugin.config == {"anything": [1, 2]}


def test_the_model_is_found_through_a_generic_base() -> None:
    assert settings_model(Signer) is SignerSettings

    class Untyped(ProduceRequestInterceptor):
        def configure(self, config: Mapping[str, Any]) -> None: ...

        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch

    assert settings_model(Untyped) is None


# ------------------------------------------------------------------ topics

def test_a_topic_selector_takes_the_first_pattern_that_matches_the_whole_name() -> None:
    selector = TopicSelector([("orders|payments", "a"), ("logs\\..*", "b"), (".*", "c")])
    assert [selector.select(t) for t in ("orders", "payments", "logs.app", "ordersx")] == [
        "a", "a", "b", "c"]
    assert TopicSelector([("orders", "a")]).select("my-orders") is None


def test_a_table_of_names_matches_names_exactly_with_a_wildcard_default() -> None:
    selector = TopicSelector.of_names({"orders.v1": 1, "*": 0})
    assert selector.select("orders.v1") == 1
    assert selector.select("ordersXv1") == 0  # a dot in a name is a dot, not "any"
    assert TopicSelector.of_names({"orders": 1}).select("other") is None


def test_a_topic_selector_refuses_a_bad_regex() -> None:
    with pytest.raises(ValueError, match="'\\(' is not a regular expression"):
        TopicSelector([("(", 1)])


@pytest.mark.parametrize("value", [True, False])
def test_true_or_false_where_a_number_is_declared_is_a_wrong_type(plugins: Path,
                                                                  value: bool) -> None:
    # Text converts (a properties file holds only text); a boolean is no count of records.
    assert _problems(plugins, {"max_records": value}) == (
        f"max_records: expected an integer, got {str(value).lower()}",)


def test_true_or_false_inside_a_tuple_list_or_mapping_of_numbers_is_named_too() -> None:
    from kiproxy.interceptors.settings import PluginSettings, SettingsError, parse_settings

    class Numbers(PluginSettings):
        sizes: tuple[int, ...] = ()
        """Tuples come from lists in YAML and JSON."""
        weights: dict[str, float] = {}
        """A mapping of numbers."""

    with pytest.raises(SettingsError) as caught:
        parse_settings(Numbers, {"sizes": [1, True], "weights": {"a": False}})
    assert caught.value.problems == ("sizes[1]: expected an integer, got true",
                                     "weights.a: expected a number, got false")
    assert parse_settings(Numbers, {"sizes": [1, "2"]}).sizes == (1, 2)  # text converts
