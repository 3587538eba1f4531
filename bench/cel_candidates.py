"""CEL implementations from PyPI, compared: compile and evaluate two rules over a 10-field map.

Run from the repository root (the candidates that are not installed are skipped;
``pip install common-expression-language cel-python`` adds the other two)::

    .venv/bin/python -m bench.cel_candidates

Each candidate compiles ``value.amount > 0.0 && value.currency in ['EUR','USD']``
and ``size(value.customer) > 0 && value.qty < 1000`` and evaluates both over the
same record (a map of 10 fields, plus ``key``, ``headers`` and ``topic``), as
the ``schema_registry`` interceptor does per record: the variables are bound once
per record and each rule evaluated. Figures are microseconds of wall time per
compile of the two rules and per evaluation of both, best of three runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

VALUE = {"id": "o-1", "amount": 12.5, "currency": "EUR", "qty": 3, "customer": "c-9",
         "country": "DE", "status": "new", "note": "x" * 20, "ts": 1_700_000_000_000,
         "express": True}
EXPRS = ["value.amount > 0.0 && value.currency in ['EUR','USD']",
         "size(value.customer) > 0 && value.qty < 1000"]
CONTEXT = {"value": VALUE, "key": b"k", "headers": {}, "topic": "orders"}


def _time(fn: Callable[[], Any], n: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def cel_expr_python(n: int) -> tuple[float, float, list[Any]]:
    from cel_expr_python import cel

    env = cel.NewEnv(variables={"value": cel.Type.DYN, "key": cel.Type.DYN,
                                "headers": cel.Type.Map(cel.Type.STRING, cel.Type.DYN),
                                "topic": cel.Type.STRING})
    programs = [env.compile(e) for e in EXPRS]

    def evaluate() -> list[Any]:
        activation = env.Activation(CONTEXT)
        return [p.eval(activation).value() for p in programs]

    return (_time(lambda: [env.compile(e) for e in EXPRS], max(n // 10, 10)),
            _time(evaluate, n), evaluate())


def common_expression_language(n: int) -> tuple[float, float, list[Any]]:
    import cel

    programs = [cel.compile(e) for e in EXPRS]

    def evaluate() -> list[Any]:
        return [p.execute(CONTEXT) for p in programs]

    return (_time(lambda: [cel.compile(e) for e in EXPRS], max(n // 10, 10)),
            _time(evaluate, n), evaluate())


def cel_python(n: int) -> tuple[float, float, list[Any]]:
    import celpy
    from celpy.adapter import json_to_cel
    from celpy.celtypes import StringType

    env = celpy.Environment()
    programs = [env.program(env.compile(e)) for e in EXPRS]

    def evaluate() -> list[Any]:
        activation = {"value": json_to_cel(VALUE), "topic": StringType("orders")}
        return [bool(p.evaluate(activation)) for p in programs]

    n = max(n // 20, 20)  # pure Python: two orders of magnitude slower
    return (_time(lambda: [env.program(env.compile(e)) for e in EXPRS], max(n // 10, 5)),
            _time(evaluate, n), evaluate())


CANDIDATES = {
    "cel-expr-python (cel-cpp)": cel_expr_python,
    "common-expression-language (cel-rust)": common_expression_language,
    "cel-python (pure Python)": cel_python,
}


def main(argv: list[str] | None = None) -> None:
    """Print one line per installed candidate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000)
    args = parser.parse_args(argv)
    print("| CEL package | compile 2 rules (us) | evaluate 2 rules (us) | result |")
    print("|---|---:|---:|---|")
    for name, run in CANDIDATES.items():
        try:
            compile_us, eval_us, result = run(args.iterations)
        except ModuleNotFoundError as exc:
            print(f"| {name} | not installed ({exc.name}) | | |")
            continue
        print(f"| {name} | {compile_us:.1f} | {eval_us:.2f} | {result} |")


if __name__ == "__main__":
    main()
