"""kcat and older librdkafka through the proxy.

librdkafka before 2.2.0 skips a tagged field one byte short (librdkafka #4278);
Tansu writes every tagged field of its ApiVersions v3 answer, defaults included,
so Debian 12's kcat 1.7.1 (librdkafka 2.0.2) fails straight against the embedded
broker with "ApiVersionRequest failed: Local: Read underflow". The proxy passes
the answer on in Kafka's own encoding (default-valued tagged fields left out),
which every client reads the same way and which those versions can parse.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import subprocess
import typing
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from kiproxy.protocol.framing import encode_response_header
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.proxy.brokers.api_versions import cut_api_versions_frame

_TAGS_WITH_DEFAULTS = (
    b"\x04"  # four tagged fields, each holding its default value:
    b"\x00\x01\x01"  # SupportedFeatures: empty
    b"\x01\x08" + b"\xff" * 8 +  # FinalizedFeaturesEpoch: -1
    b"\x02\x01\x01"  # FinalizedFeatures: empty
    b"\x03\x01\x00"  # ZkMigrationReady: false
)


def _api_versions_v3_with_default_tags() -> bytes:
    """An ApiVersions v3 answer encoded the way Tansu 0.6 encodes it."""
    response_cls = response_type(ApiKey.API_VERSIONS, 3)
    entry_cls = typing.get_args(typing.get_type_hints(response_cls)["api_keys"])[0]
    message = response_cls(
        error_code=ErrorCode.none, throttle_time=datetime.timedelta(0), api_keys=(
            entry_cls(api_key=ApiKey.PRODUCE, min_version=0, max_version=11),
            entry_cls(api_key=ApiKey.METADATA, min_version=0, max_version=12)))
    body = serialize(message)
    assert body.endswith(b"\x00")  # kio leaves the default-valued tags out
    return encode_response_header(7, 0) + body[:-1] + _TAGS_WITH_DEFAULTS


def test_default_valued_tagged_fields_are_left_out_of_the_api_versions_answer() -> None:
    frame = _api_versions_v3_with_default_tags()
    cut = cut_api_versions_frame(3, frame)
    assert not cut.endswith(_TAGS_WITH_DEFAULTS) and cut.endswith(b"\x00")
    before = parse_response(ApiKey.API_VERSIONS, 3, frame, 4)
    after = parse_response(ApiKey.API_VERSIONS, 3, cut, 4)
    assert dataclasses.asdict(after) == dataclasses.asdict(before)  # the same answer


def test_an_answer_already_in_kafkas_encoding_passes_unchanged() -> None:
    frame = _api_versions_v3_with_default_tags()
    canonical = cut_api_versions_frame(3, frame)
    assert cut_api_versions_frame(3, canonical) is canonical


KCAT = shutil.which("kcat") or shutil.which("kafkacat")
needs_kcat = pytest.mark.skipif(
    KCAT is None, reason="kcat is not installed (Debian: apt-get install kcat)")


@needs_kcat
def test_kcat_produces_and_consumes_through_the_proxy(start_proxy: Any, topic: str) -> None:
    assert KCAT is not None
    proxy = start_proxy()
    produced = subprocess.run([KCAT, "-b", proxy.bootstrap, "-P", "-t", topic, "-p", "0",
                               "-K", ":"], input="k1:hello\nk2:world\n", capture_output=True,
                              text=True, timeout=60)
    assert produced.returncode == 0, produced.stderr
    assert "Read underflow" not in produced.stderr
    consumed = subprocess.run([KCAT, "-b", proxy.bootstrap, "-C", "-t", topic, "-p", "0",
                               "-o", "beginning", "-e", "-f", "%k=%s\\n"],
                              capture_output=True, text=True, timeout=60)
    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout.splitlines() == ["k1=hello", "k2=world"]
