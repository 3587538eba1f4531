"""Broker-style ``.properties`` files: the broker-side Wasm interceptor's keys, read as they are.

An operator moving from the broker-side design brings its file unchanged::

    produce.request.interceptor.wasm.topics=test-topic,orders
    produce.request.interceptor.wasm.test-topic.path=/path/to/plugin.wasm
    produce.request.interceptor.wasm.orders.path=orders.wasm

``topics`` is a comma-separated list; each topic needs its ``.path`` (a
relative path is resolved against the file's folder). Further per-topic keys
kiproxy reads, all optional: ``.function``, ``.batch.function``,
``.timeout.ms``, ``.max.pages``, ``.wasi`` (true/false), ``.binary``
(refuse/base64) and ``.config.<name>`` (an Extism config value). Keys outside
``produce.request.interceptor.wasm.`` (the rest of a broker's file) are
ignored; an unknown key under it, or a topic without ``.path``, is an error
naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import javaproperties

__all__ = ["PREFIX", "read_properties"]

PREFIX = "produce.request.interceptor.wasm."
_KEYS = {"path": "plugin", "function": "function", "batch.function": "batch_function",
         "timeout.ms": "timeout_ms", "max.pages": "max_pages", "wasi": "wasi",
         "binary": "binary"}
_INTS = {"timeout_ms", "max_pages"}


def _value(setting: str, text: str, key: str) -> Any:
    if setting in _INTS:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}={text}: expected a whole number") from None
    if setting == "wasi":
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{key}={text}: expected true or false")
        return text.lower() == "true"
    return text


def read_properties(path: str | Path) -> dict[str, dict[str, Any]]:
    """Topic -> plugin settings (the ``topics`` config mapping) from a ``.properties`` file."""
    file = Path(path)
    try:
        with file.open(encoding="utf-8") as f:
            props: dict[str, str] = javaproperties.load(f)
    except OSError as exc:
        raise ValueError(f"properties file {file}: {exc.strerror or exc}") from None
    where = f"properties file {file}"
    listed = props.get(PREFIX + "topics")
    if not listed or not listed.strip():
        raise ValueError(f"{where}: {PREFIX}topics is missing or empty (a comma-separated "
                         "list of topics)")
    topics: dict[str, dict[str, Any]] = {t.strip(): {} for t in listed.split(",")
                                         if t.strip()}
    for key, text in props.items():
        if not key.startswith(PREFIX) or key == PREFIX + "topics":
            continue
        rest = key.removeprefix(PREFIX)
        topic = next((t for t in sorted(topics, key=len, reverse=True)
                      if rest.startswith(t + ".")), None)
        if topic is None:
            raise ValueError(f"{where}: {key} names no topic of {PREFIX}topics ({listed})")
        name = rest.removeprefix(topic + ".")
        settings = topics[topic]
        if name.startswith("config."):
            settings.setdefault("config", {})[name.removeprefix("config.")] = text
        elif name in _KEYS:
            settings[_KEYS[name]] = _value(_KEYS[name], text.strip(), key)
        else:
            raise ValueError(f"{where}: unknown key {key}; per topic: "
                             f"{', '.join(sorted([*_KEYS, 'config.<name>']))}")
    for topic, settings in topics.items():
        if "plugin" not in settings:
            raise ValueError(f"{where}: {PREFIX}{topic}.path is missing (the plugin of "
                             f"topic {topic})")
        settings["plugin"] = str(file.parent / settings["plugin"])
    return topics
