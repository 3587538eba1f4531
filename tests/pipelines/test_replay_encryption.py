"""``kiproxy replay --fetch-hook record_encryption``: a topic encrypted through the proxy
is read through the hook (decrypted) and written by ``--interceptor record_encryption``
under another KEK into ``--output-topic``, as docs/record-encryption.md and
docs/spark.md describe. Checked with a real proxy, a real broker and Spark (local
mode): the output topic holds only sealed values naming the new KEK, a consumer through
the proxy reads them as produced, and nothing is reported rejected.

The KMS is a key file: Spark's Python workers take their environment from the JVM the
session fixture started, so AWS credentials set by a test would not reach them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import launch_proxy
from integration.test_fetch_hook import _create, _produce, _read

from kiproxy.cli import main as kiproxy_main
from kiproxy.interceptors.builtin.record_encryption import MARKER_HEADER
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(300)


def test_replay_decrypts_through_the_fetch_hook_and_reencrypts_under_another_key(
        broker: EmbeddedBroker, spark: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    write_key_file(keys, {"KEK_old": (1, {1: os.urandom(32)}),
                          "KEK_new": (1, {1: os.urandom(32)})})
    kms = {"type": "key_file", "path": str(keys)}
    old, new = {"kms": kms, "key": "KEK_old"}, {"kms": kms, "key": "KEK_new"}
    topic = f"replay-enc-{uuid.uuid4().hex[:8]}"
    out = f"{topic}-rekeyed"
    _create(broker.bootstrap, topic)
    values = [f"card 4111 1111 1111 {i:04}".encode() for i in range(40)]
    proxy = launch_proxy(broker.bootstrap, interceptor="record_encryption",
                         interceptor_config=old)
    try:
        _produce(proxy.bootstrap, topic, values)
        assert all((m.headers() or [])[-1][0] == MARKER_HEADER and b"4111" not in m.value()
                   for m in _read(broker.bootstrap, [topic], len(values)))

        report = tmp_path / "report"
        assert kiproxy_main([
            "replay", "--bootstrap", broker.bootstrap, "--topic", topic,
            "--fetch-hook", "record_encryption", "--fetch-hook-config", json.dumps(old),
            "--interceptor", "record_encryption", "--interceptor-config", json.dumps(new),
            "--output-topic", out, "--report", str(report), "--no-progress"]) == 0
        summary = json.loads((report / "summary.json").read_text())
        assert (summary["rejected_records"], summary["written_records"]) == (0, len(values))

        stored = _read(broker.bootstrap, [out], len(values))
        assert len(stored) == len(values)
        for message in stored:
            name, descriptor = (message.headers() or [])[-1]
            assert name == MARKER_HEADER and b"KEK_new" in descriptor
            assert b"KEK_old" not in descriptor and b"4111" not in message.value()
        through_proxy = _read(proxy.bootstrap, [out], len(values))
        assert [m.value() for m in through_proxy] == values, proxy.log[-3000:]
    finally:
        proxy.stop()
