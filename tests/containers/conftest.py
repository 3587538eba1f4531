"""The container tests' shared fixtures: the project's image and the Apache Kafka image,
each built (or reused) once per session by deploy/image.py, as `make image` and
`make kafka-image` do; a skip with the reason where no container engine can run."""

from __future__ import annotations

import pytest

from .engine import Image, NoEngine, NoKafkaJars, build_image


@pytest.fixture(scope="session")
def image() -> Image:
    """The project's image (``make image``)."""
    try:
        built = build_image()
    except NoEngine as exc:
        pytest.skip(f"no container engine: {exc}")
    print(f"\nimage {built.ref} ({built.engine}): {built.size_bytes() / 1e6:.0f} MB, "
          f"built in {built.build_seconds:.0f} s (0: reused)")
    return built


@pytest.fixture(scope="session")
def kafka_image(image: Image) -> Image:
    """An Apache Kafka image for docker-compose.yml (``make kafka-image``)."""
    try:
        return build_image("kafka")
    except NoKafkaJars as exc:
        pytest.skip(f"apache/kafka cannot be pulled and make kafka failed: {exc}")
