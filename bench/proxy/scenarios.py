"""The proxy benchmark's matrix: scenarios (what sits between producer and broker) and cases.

:data:`SCENARIOS` names every way the benchmark puts something (or nothing)
between the producer and the broker; a :class:`Case` is one record size and
codec. The constants are the matrix's defaults and the paths it uses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parents[1] / "RESULTS.md"
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
README_PLUGINS = Path(__file__).resolve().parents[1] / "out" / "readme-plugins"
"""Where the README's plugin is written, as printed there (:func:`readme_plugin`)."""
SECTION = "## Proxy: end to end (producer, proxy, broker)"
TANSU_NODE_ID = 111
"""The node id Tansu gives itself; kiproxy serves it on ``broker_port_start + 111``."""
MB = 1_000_000
GB = 1_000_000_000

SIZES = (100, 1024)
CODECS = ("none", "lz4", "zstd")

VALIDATOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "kind"],
    "properties": {"id": {"type": "integer", "minimum": 0}, "kind": {"type": "string"}},
}



@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One way of putting something (or nothing) between the producer and the broker."""

    name: str
    kind: str
    """``direct``, ``haproxy``, ``forwarder`` (:mod:`bench.proxy.forwarder`) or ``kiproxy``."""
    description: str
    interceptor: str | None = None
    """``MODULE:CLASS`` for ``kiproxy run --interceptor``."""
    interceptor_config: Mapping[str, Any] | None = None
    plugins_dir: Path | None = None
    transforms: bool = False
    """Stored values are upper-cased (checked on one record of the first round)."""
    stored_prefix: str | None = None
    """Stored values start with this (checked on the same record)."""
    by_default: bool = True
    """Run when ``--scenarios`` is not given (off for scenarios that only make sense
    with other flags, such as ``pii`` with ``--workers`` and ``--connections``)."""


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(name="direct", kind="direct", description="producer to broker, no hop"),
    Scenario(name="haproxy", kind="haproxy",
             description="haproxy 'mode tcp', nbthread 1, broker advertises haproxy's port"),
    Scenario(name="uvloop", kind="forwarder", by_default=False,
             description="bench/proxy/forwarder.py: bytes copied both ways by a bare uvloop "
                         "process, the floor of a Python proxy; broker advertises its port"),
    Scenario(name="passthrough", kind="kiproxy", description="kiproxy, no interceptor"),
    Scenario(name="identity", kind="kiproxy", interceptor="identity:Identity",
             plugins_dir=PLUGINS,
             description="kiproxy, bench/plugins/identity.py (decode, return the batch)"),
    Scenario(name="uppercase", kind="kiproxy",
             interceptor="kiproxy.interceptors.builtin.uppercase:Uppercase", transforms=True,
             description="kiproxy, kiproxy.interceptors.builtin.uppercase:Uppercase "
                         "(decode, transform, re-encode)"),
    Scenario(name="readme", kind="kiproxy", interceptor="readme:Readme", plugins_dir=PLUGINS,
             transforms=True,
             description="kiproxy, bench/plugins/readme.py (every value rewritten the way the "
                         "README teaches: batch.with_records(r.with_value(r.value.upper()) ...))"),
    Scenario(name="no_secrets", kind="kiproxy", interceptor="no_secrets:NoSecrets",
             plugins_dir=README_PLUGINS, interceptor_config={"word": "id"}, stored_prefix='{"***":',
             description="kiproxy, the README's plugin as printed there (plugins/no_secrets.py; "
                         "word \"id\", which every value holds, so every value is "
                         "rewritten)"),
    Scenario(name="pii", kind="kiproxy", interceptor="pii_masker",
             interceptor_config={"topics": {"*": ["email", "card", "ssn", "iban", "ipv4"]}},
             by_default=False,
             description="kiproxy, the built-in pii_masker with its five rules on every topic "
                         "(regular expressions over every value: CPU-bound in the proxy; run "
                         "it by name, with --workers and --connections, to see scaling)"),
    Scenario(name="validator", kind="kiproxy",
             interceptor="kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator",
             interceptor_config={"default_schema": VALIDATOR_SCHEMA},
             description="kiproxy, kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator, "
                         "default_schema " + json.dumps(VALIDATOR_SCHEMA, separators=(",", ":"))),
)}


def readme_plugin(into: Path = README_PLUGINS) -> Path:
    """Write the README's plugin (its ``plugins/no_secrets.py`` block) into ``into``,
    as printed there, and return the module's path."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```python\n# plugins/no_secrets\.py\n(.*?)```", text, re.S)
    if found is None:
        raise LookupError("README.md no longer holds a plugins/no_secrets.py block")
    into.mkdir(parents=True, exist_ok=True)
    module = into / "no_secrets.py"
    module.write_text(found.group(1))
    return module


@dataclass(frozen=True, slots=True, order=True)
class Case:
    """Record size and codec of one cell of the matrix."""

    value_size: int
    codec: str

    @property
    def label(self) -> str:
        """``100 B`` / ``1 KiB``."""
        return f"{self.value_size // 1024} KiB" if self.value_size % 1024 == 0 \
            else f"{self.value_size} B"
