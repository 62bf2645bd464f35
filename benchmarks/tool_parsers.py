"""Tool-call parsers on replies a policy can learn to write: the time to parse each adversarial
family at growing sizes, for every registered parser (``rollgen.serving.tool_parsers``), and the
slope of log(time) against log(size) (1: linear). Beside them, the backtracking regular
expression the built-in parser replaced, on the sizes it finishes in seconds.

    python -m benchmarks.tool_parsers --out out/benchmarks/tool-parsers

Results: ``tool_parsers.json`` (a row per parser, family and size) and ``tool_parsers_slopes.json``.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import print_table, save_all
from rollgen.serving import tool_parsers

#: Each family: a reply of about ``n`` characters.
FAMILIES: dict[str, Callable[[int], str]] = {
    "open tag, then spaces": lambda n: "<tool_call>" + " " * n,
    "open tag, then newlines": lambda n: "<tool_call>" + "\n" * n,
    "open tags and spaces": lambda n: "<tool_call> " * (n // 12 + 1),
    "deep nesting, closed": lambda n: "<tool_call>" + "[" * n + "</tool_call>",
    "many small calls": lambda n: '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * (n // 48 + 1),
}
SIZES = [1_000, 10_000, 100_000, 1_000_000]
#: The sizes the old regular expression is timed at (it is quadratic: 4,000 took about a minute
#: on "open tag, then spaces" in the report that found it).
REGEX_SIZES = [250, 500, 1_000, 2_000]
REGEX = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def timed(parse: Callable[[str], Any], text: str, repeats: int) -> float:
    """The median seconds of ``repeats`` parses of ``text``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        parse(text)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def slope(rows: list[dict[str, Any]]) -> float:
    """The least-squares slope of log(seconds) on log(size)."""
    xs = [math.log(r["size"]) for r in rows]
    ys = [math.log(max(r["seconds"], 1e-9)) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="out/benchmarks/tool-parsers")
    args = parser.parse_args(argv)
    contestants: dict[str, tuple[Callable[[str], Any], list[int]]] = {
        name: (factory().parse, SIZES) for name, factory in tool_parsers().items()
    }
    contestants["the regex hermes replaced"] = (lambda text: REGEX.findall(text), REGEX_SIZES)
    rows: list[dict[str, Any]] = []
    slopes: list[dict[str, Any]] = []
    for name, (parse, sizes) in contestants.items():
        for family, make in FAMILIES.items():
            mine = [
                {"parser": name, "family": family, "size": n, "seconds": timed(parse, make(n), args.repeats)}
                for n in sizes
            ]
            rows += mine
            slopes.append(
                {
                    "parser": name,
                    "family": family,
                    "slope": slope(mine),
                    "largest": sizes[-1],
                    "seconds": mine[-1]["seconds"],
                }
            )
    results = {"rows": rows, "slopes": slopes}
    save_all("tool_parsers", results, args.out)
    print_table(slopes, ["parser", "family", "slope", "largest", "seconds"])
    return results


if __name__ == "__main__":
    main()
