"""bench.levels: the level sweep's arguments, and that each level is the one encoded.

No timing here: the CPU figures are read from runs, not asserted.
"""

from __future__ import annotations

import pytest
import support.bench  # noqa: F401 - bench/ is not an installed package: this makes it importable

from bench.levels import encode_cost, main, parse_levels
from bench.proxy.stats import json_values
from kiproxy.protocol.compression import Compression


def test_levels_are_read_per_codec() -> None:
    assert parse_levels("zstd=1,3; lz4=1") == {"zstd": (1, 3), "lz4": (1,)}
    assert parse_levels("") == {}


@pytest.mark.parametrize("text", ["zstd", "snappy=1", "zstd=fast"])
def test_a_bad_level_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_levels(text)


def test_the_level_is_the_one_the_batch_is_compressed_with() -> None:
    values = json_values(1024, 50)
    _, fast = encode_cost(Compression.ZSTD, -5, values, 50, seconds=0.0, repeats=1)
    _, small = encode_cost(Compression.ZSTD, 19, values, 50, seconds=0.0, repeats=1)
    assert small < fast  # zstd's strongest level packs these JSON values tighter


def test_the_table_has_a_row_per_level_with_the_default_marked(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--codecs", "zstd", "--sizes", "100", "--levels", "zstd=1",
                 "--records", "20", "--seconds", "0", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| zstd |")]
    assert [row.split("|")[3].strip() for row in rows] == ["1", "3 (default)"]
    assert rows[1].split("|")[6].strip() == rows[1].split("|")[7].strip() == "1.00"
