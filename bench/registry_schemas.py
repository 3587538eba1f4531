"""Register N distinct Avro schemas in a schema registry, quickly: the new IDs a cache-miss
burst needs (``python -m bench.registry_schemas URL N [--subject-prefix P]``).

Contract: ``register_schemas(url, n)`` registers ``n`` distinct 10-field Avro record
schemas (one subject each, ``<prefix>-<i>-value``) over a few threads of confluent-kafka's
``SchemaRegistryClient`` and returns their IDs in order; the command prints one
``subject id`` line each and the rate on stderr. Against the local registry (``make
registry``, ``kiproxy dev --registry``): it stops by itself after ``n`` registrations.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["avro_schema", "register_schemas"]


def avro_schema(i: int) -> str:
    """A 10-field Avro record schema, different for each ``i``."""
    types = ["string", "double", "long", "int", "boolean"]
    fields = [{"name": f"f{j}", "type": types[j % len(types)]} for j in range(10)]
    return json.dumps({"type": "record", "name": f"Bench{i}", "namespace": "bench",
                       "fields": fields})


def register_schemas(url: str, n: int, *, prefix: str | None = None,
                     threads: int = 8) -> list[tuple[str, int]]:
    """Register ``n`` new schemas; returns ``(subject, id)`` pairs in order."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    prefix = prefix or f"bench-{uuid.uuid4().hex[:6]}"
    clients: dict[int, Any] = {}

    def one(i: int) -> tuple[str, int]:
        import threading
        key = threading.get_ident()
        if key not in clients:
            clients[key] = SchemaRegistryClient({"url": url})
        subject = f"{prefix}-{i}-value"
        return subject, int(clients[key].register_schema(subject, Schema(avro_schema(i), "AVRO")))

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(n)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("url", help="the registry API's base URL, e.g. "
                                    "http://127.0.0.1:8081/apis/ccompat/v7")
    parser.add_argument("n", type=int, help="how many schemas")
    parser.add_argument("--subject-prefix", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    pairs = register_schemas(args.url, args.n, prefix=args.subject_prefix)
    elapsed = time.perf_counter() - started
    for subject, schema_id in pairs:
        print(subject, schema_id)
    print(f"{len(pairs)} schemas in {elapsed:.2f} s ({len(pairs) / elapsed:.0f}/s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
