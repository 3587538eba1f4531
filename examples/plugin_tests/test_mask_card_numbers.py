"""Tests of plugins/mask_card_numbers.py with kiproxy's test kit: no broker, no proxy.

The fixtures (kiproxy_load, kiproxy_run, make_batch, make_record) come with kiproxy:
installing it registers them with pytest. Run: pytest examples/plugin_tests
"""

from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


@pytest.fixture
def masker(kiproxy_load):
    # Loaded and configured as `kiproxy run --plugins-dir plugins` would; closed after the test.
    return kiproxy_load("mask_card_numbers:MaskCardNumbers", plugins_dir=PLUGINS,
                        config={"topics": ["payments"]})


def test_card_numbers_are_masked(masker, kiproxy_run, make_batch):
    batch = make_batch("paid with 4111 1111 1111 1111", "no card here", topic="payments")
    outcome = kiproxy_run(masker, batch)
    assert outcome.kind == "transformed"
    assert outcome.values == [b"paid with ****-****-****-1111", b"no card here"]


def test_keys_headers_and_timestamps_are_kept(masker, kiproxy_run, make_batch, make_record):
    record = make_record("4111-1111-1111-1111", key="order-7", headers=[("src", "web")],
                         timestamp=1_700_000_000_000)
    [masked] = kiproxy_run(masker, make_batch(record, topic="payments")).records
    assert (masked.key, masked.headers, masked.timestamp) == \
        (record.key, record.headers, record.timestamp)


def test_a_batch_with_nothing_to_mask_is_forwarded_as_sent(masker, kiproxy_run, make_batch):
    outcome = kiproxy_run(masker, make_batch("order 42 shipped", None, topic="payments"))
    assert outcome.kind == "unchanged"  # the proxy forwards the original bytes


def test_other_topics_pass_untouched(masker, kiproxy_run, make_batch):
    outcome = kiproxy_run(masker, make_batch("4111 1111 1111 1111", topic="logs"))
    assert outcome.kind == "unchanged"
