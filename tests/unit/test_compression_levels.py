"""Compression levels of re-encoded batches: settings, flags, and the batch that leaves.

``interceptor.compression.{gzip,lz4,zstd}_level`` (flags ``--compression-*-level``)
choose the level a batch the interceptor changed is re-compressed with, in the codec
it came in. Defaults: what a producer with default settings writes (gzip 6, LZ4 fast
mode, zstd 3). Out-of-range values are errors that name the key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support.client import Client

from kiproxy.cli import build_parser
from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch
from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression, CompressionLevels
from kiproxy.protocol.framing import parse_request_header
from kiproxy.protocol.messages import ApiKey, parse_request
from kiproxy.protocol.records import decode_batches, encode_batch
from kiproxy.proxy.cli import _overrides
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy.proxy.generation import build_generation
from kiproxy.proxy.produce.disposition import Forward
from kiproxy.proxy.produce.pipeline import ProducePipeline

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
LOW = CompressionLevels(gzip=1, lz4=1, zstd=1)
HIGH = CompressionLevels(gzip=9, lz4=12, zstd=19)


class _Identity(ProduceRequestInterceptor):
    """Returns every batch as it came."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch


_Client = Client

def _partition_records(frame: bytes) -> list[bytes]:
    """The partitions' ``records`` bytes of a Produce request frame."""
    header = parse_request_header(frame)
    assert header.body_offset is not None
    request = parse_request(ApiKey.PRODUCE, header.api_version, frame, header.body_offset)
    return [bytes(p.records) for t in request.topic_data for p in t.partition_data]


def _forwarded_batches(pipeline: ProducePipeline, frame: bytes) -> list[bytes]:
    """The partition ``records`` the pipeline forwards for a golden Produce frame."""
    header = parse_request_header(frame)
    outcome = asyncio.run(pipeline.handle(_Client(), header, frame, None))  # type: ignore[arg-type]
    assert isinstance(outcome, Forward)
    return _partition_records(outcome.frame)


# ---------------------------------------------------------------------------- defaults


def test_defaults_are_what_a_default_producer_writes() -> None:
    assert CompressionLevels() == DEFAULT_LEVELS
    assert (DEFAULT_LEVELS.gzip, DEFAULT_LEVELS.lz4, DEFAULT_LEVELS.zstd) == (6, 1, 3)
    config = ProxyConfig()
    assert config.interceptor.compression.levels() == DEFAULT_LEVELS
    assert ProducePipeline(None).compression_levels == DEFAULT_LEVELS


# ---------------------------------------------------------------------------- the pipeline


@pytest.mark.parametrize("codec", ["gzip", "lz4", "zstd"])
def test_a_changed_batch_is_recompressed_at_the_configured_level(codec: str) -> None:
    frame = (GOLDEN / f"produce_{codec}.bin").read_bytes()
    outputs = {}
    for name, levels in (("low", LOW), ("high", HIGH)):
        config = load_config(None, {
            "interceptor.class": "kiproxy.interceptors.builtin.uppercase:Uppercase",
            f"interceptor.compression.{codec}_level": getattr(levels, codec),
        })
        pipeline = build_generation(config, 1, metrics=None).produce
        assert getattr(pipeline.compression_levels, codec) == getattr(levels, codec)
        [data] = _forwarded_batches(pipeline, frame)
        [batch] = decode_batches(data)
        assert batch.header.compression is Compression[codec.upper()]
        # Byte for byte what the codec writes at that level (compression is deterministic).
        assert data == encode_batch(batch.header, batch.records, levels=levels)
        outputs[name] = data
    assert outputs["low"] != outputs["high"], "the level did not reach the compressor"
    low, high = (decode_batches(outputs[n])[0].records for n in ("low", "high"))
    assert low == high
    assert all(r.value is None or r.value == r.value.upper() for r in low)


def test_an_unchanged_batch_is_forwarded_as_the_client_sent_it() -> None:
    # The client's own bytes pass, whatever the level settings say.
    frame = (GOLDEN / "produce_lz4.bin").read_bytes()
    for interceptor in (None, _Identity()):
        pipeline = ProducePipeline(interceptor, compression_levels=HIGH)
        assert _forwarded_batches(pipeline, frame) == _partition_records(frame)


# ---------------------------------------------------------------------------- config and flags


def test_yaml_section_reaches_the_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text("upstream: [127.0.0.1:1]\n"
                    "interceptor:\n"
                    "  compression: {gzip_level: 1, lz4_level: 9, zstd_level: -5}\n")
    config = load_config(path, {})
    produce = build_generation(config, 1, metrics=None).produce
    assert produce.compression_levels == CompressionLevels(gzip=1, lz4=9, zstd=-5)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text("interceptor:\n  compression: {gzip_level: 1, lz4_level: 9}\n")
    args = build_parser().parse_args([
        "run", "--config", str(path), "--upstream", "127.0.0.1:1",
        "--compression-lz4-level", "3", "--compression-zstd-level", "22"])
    config = load_config(path, _overrides(args))
    assert config.interceptor.compression.levels() == CompressionLevels(
        gzip=1, lz4=3, zstd=22)


@pytest.mark.parametrize(("yaml_text", "key", "says"), [
    ("gzip_level: 0", "interceptor.compression.gzip_level", "must be at least 1, got 0"),
    ("gzip_level: 10", "interceptor.compression.gzip_level", "must be at most 9, got 10"),
    ("lz4_level: 0", "interceptor.compression.lz4_level", "must be at least 1, got 0"),
    ("lz4_level: 18", "interceptor.compression.lz4_level", "must be at most 17, got 18"),
    ("zstd_level: 23", "interceptor.compression.zstd_level", "must be at most 22, got 23"),
    ("zstd_level: -131073", "interceptor.compression.zstd_level",
     "must be at least -131072, got -131073"),
    ("lz4_level: fast", "interceptor.compression.lz4_level", "expected an integer, got 'fast'"),
    ("lz4_level: true", "interceptor.compression.lz4_level", "expected an integer, got true"),
    ("zstd_level: 3.5", "interceptor.compression.zstd_level", "expected an integer, got 3.5"),
    ("snappy_level: 1", "interceptor.compression.snappy_level",
     "unknown key; valid keys here: gzip_level, lz4_level, zstd_level"),
])
def test_bad_levels_name_the_key(tmp_path: Path, yaml_text: str, key: str, says: str) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(f"interceptor:\n  compression:\n    {yaml_text}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert f"{key}: " in str(info.value) and says in str(info.value), str(info.value)


def test_bad_flag_names_the_key() -> None:
    args = build_parser().parse_args(["run", "--compression-gzip-level", "12"])
    with pytest.raises(ConfigError, match=r"interceptor\.compression\.gzip_level: .*9"):
        load_config(None, _overrides(args))


# ---------------------------------------------------------------------------- the codec's own check


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"gzip": 0}, "gzip compression level 0 is not an integer in 1..9"),
    ({"lz4": 18}, "lz4 compression level 18 is not an integer in 1..17"),
    ({"zstd": 23}, "zstd compression level 23 is not an integer in -131072..22"),
    ({"lz4": True}, "lz4 compression level True"),
])
def test_compression_levels_refuse_out_of_range(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        CompressionLevels(**kwargs)
