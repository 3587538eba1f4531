"""Instructions per Produce request of the produce path: this tree against a base commit.

Run from the repository root with the project's virtualenv (needs ``valgrind``,
``apt-get install valgrind``)::

    python -m bench.instructions --base 0b6c14d          # prints the table; updates RESULTS.md
    python -m bench.instructions --base HEAD~1 --no-write

CPU seconds on a machine shared with other work move by several per cent from
run to run, which hides the few per cent a change to the hot path costs or
saves. An instruction count does not move: each tree runs once under
callgrind (``valgrind --tool=callgrind``), which counts the instructions
executed between two marks the child sets around the measured calls (it
calls ``getppid()`` to zero the counters and ``getpgrp()`` to dump them), so
the imports and the setup are not counted. Same input, same count, to a
tenth of a per cent (``PYTHONHASHSEED`` is fixed). An instruction count is
not time (a cache miss or a system call costs more than its instructions),
so the end-to-end A/B (:mod:`bench.ab`) still has the last word; this one
says which change moved the count, and by how much.

The base commit is exported and built as :mod:`bench.ab` does (kept under the
system's temporary directory, keyed by the commit). Cases:

* ``PLUGIN/SIZE/CODEC xN``: ``ProducePipeline.handle`` on one Produce v9 request
  of 3 partitions of N records (:mod:`bench.intercept`'s request and plugins;
  decode and re-encode on the calling thread), per request. ``x250`` is the
  per-GB shape, ``x1`` the per-request one.
* ``passthrough``: the same request with no interceptor (read the acks, forward), as
  the connection asks for it: ``forward_as_received``, a plain call.
* ``round trip``: one Produce v11 request of one 100-byte record through a whole
  proxy connection on uvloop and its answer back (:mod:`bench.round_trip`: the
  client socket's framing, dispatch, the upstream write, matching, rewriting and
  the write back), the stand-in client and broker included; the user-space part of
  the per-request cost.
* ``round trip uppercase``: the same through the built-in ``uppercase`` interceptor
  (decode, the interceptor, re-encode): a Python transform's per-request cost.
* ``produce answer``: what every answer to a Produce v10+ request the pipeline only
  forwards goes through (``kiproxy.proxy.produce.pipeline._node_rewriter``), on a
  Produce v11 answer of 3 partitions without ``node_endpoints``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = ("identity/100/none x250", "uppercase/1024/none x250", "identity/100/none x1",
         "uppercase/100/none x1", "passthrough", "produce answer", "round trip",
         "round trip uppercase")
"""The default cases (see the module docstring)."""
CALLS = {"produce answer": 2000, "round trip": 500, "round trip uppercase": 500}
"""Calls measured per case (default ``--calls``)."""
UPPERCASE = "kiproxy.interceptors.builtin.uppercase:Uppercase"
"""The interceptor of ``round trip uppercase``."""


def _produce_answer(partitions: int) -> bytes:
    """A Produce v11 response frame (header v1) with no errors and no node_endpoints."""
    body = b"\x02" + bytes([len(b"bench") + 1]) + b"bench" + bytes([partitions + 1])
    for p in range(partitions):  # index, error, base offset, append time, log start
        body += struct.pack(">ihqqq", p, 0, 1000 + p, -1, 0) + b"\x01\x00\x00"
    body += b"\x00" + struct.pack(">i", 0) + b"\x00"  # topic tags, throttle, tags
    return struct.pack(">i", 7) + b"\x00" + body


def _prepare(case: str) -> Any:
    """A callable making ``n`` measured calls of ``case`` (one coroutine for all of them,
    so the event loop's own round trips are not counted)."""
    import asyncio
    import importlib.util
    if case.startswith("round trip"):
        import uvloop
        spec = importlib.util.spec_from_file_location("bench_round_trip",
                                                      ROOT / "bench/round_trip.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        uv = uvloop.new_event_loop()
        settings = ({"interceptor": {"class": UPPERCASE}} if case == "round trip uppercase"
                    else None)
        send = uv.run_until_complete(module.round_trips(settings=settings))

        def trips(n: int) -> None:
            uv.run_until_complete(send(n))
        return trips
    if case == "produce answer":
        from kiproxy.proxy.produce.pipeline import _node_rewriter
        frame = _produce_answer(3)
        rewrite = _node_rewriter(11, lambda i, h, p: ("proxy", p))
        assert rewrite is not None

        def answers(n: int) -> None:
            for _ in range(n):
                rewrite(frame)
        return answers
    spec = importlib.util.spec_from_file_location("bench_intercept", ROOT / "bench/intercept.py")
    assert spec is not None and spec.loader is not None
    intercept = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(intercept)
    shape, _, count = case.partition(" x")
    plugin = "identity/100/none" if shape == "passthrough" else shape
    pipeline, client, header, frame = intercept._setup(plugin, int(count or 1), 3, inline=True)
    if shape == "passthrough":
        from kiproxy.proxy.produce.pipeline import ProducePipeline
        pipeline = ProducePipeline()
    loop = asyncio.new_event_loop()

    at_once = getattr(pipeline, "forward_as_received", None)  # absent from older trees

    async def handle(n: int) -> None:
        for _ in range(n):
            if at_once is None or at_once(header, frame, None) is None:
                await pipeline.handle(client, header, frame, None)

    def requests(n: int) -> None:
        loop.run_until_complete(handle(n))
    return requests


def _child(cases: list[str], calls: int) -> None:
    """Under callgrind: per case, warm up, zero the counters, ``calls`` calls, dump."""
    import logging
    logging.disable(logging.WARNING)
    for case in cases:
        run = _prepare(case)
        run(3)
        n = CALLS.get(case, calls)
        os.getppid()  # --zero-before=getppid
        run(n)
        os.getpgrp()  # --dump-before=getpgrp


def count(tree: Path, cases: list[str], calls: int) -> dict[str, float]:
    """Instructions per call of each case with ``tree``'s kiproxy."""
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               "--zero-before=getppid", "--dump-before=getpgrp", sys.executable,
               str(Path(__file__).resolve()), "--child", ",".join(cases), "--calls", str(calls)]
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"callgrind run in {tree} failed: {done.stderr.strip()[-400:]}")
        result = {}
        for i, case in enumerate(cases, 1):
            dump = Path(f"{out}.{i}").read_text()
            total = next(int(line.split()[1]) for line in dump.splitlines()
                         if line.startswith(("summary:", "totals:")))
            result[case] = total / CALLS.get(case, calls)
        return result


def main(argv: list[str] | None = None) -> int:
    """Count both trees, print the table and record it."""
    p = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the commit to compare against (A)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--calls", type=int, default=20, help="requests measured per case")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child.split(","), args.calls)
        return 0
    if not args.base:
        print("--base COMMIT is required", file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    from bench.ab import base_tree, this_tree
    cases = [c for c in args.cases.split(",") if c]
    trees = (base_tree(args.base), this_tree())
    a, b = (count(t.path, cases, args.calls) for t in trees)
    lines = ["| case | A instructions | B instructions | B/A |", "|---|---:|---:|---:|"]
    lines += [f"| {c} | {a[c]:,.0f} | {b[c]:,.0f} | {b[c] / a[c]:.3f}x |" for c in cases]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        from bench.results import write_results
        command = "python -m bench.instructions " + " ".join(
            sys.argv[1:] if argv is None else argv)
        write_results("\n".join([
            "## Instructions per call of the produce path (callgrind)", "",
            f"A = `{trees[0].commit}`, B = `{trees[1].commit}`, "
            f"{datetime.date.today().isoformat()}. Command: `{command}`. Instructions per "
            "call counted by callgrind between marks set around the measured calls "
            "(deterministic; not time): see the module docstring of "
            "`bench/instructions.py` for the cases. Below 1.000x: B executes fewer.", "",
            table]), "instructions")
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path.pop(0)  # the bench directory: kiproxy must come from PYTHONPATH
    sys.exit(main())
