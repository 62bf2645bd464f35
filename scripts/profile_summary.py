"""Summary of py-spy raw profiles (``py-spy record -f raw``: a stack and its sample count a
line), as scripts/gpu_serve_profile.sh writes them: each file's samples, then its functions by
samples in them (inclusive) and at the top of the stack (self), line numbers dropped.

    python scripts/profile_summary.py [--top 30] FILE...
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LINE = re.compile(r":\d+\)")


def summarize(path: Path, top: int) -> str:
    own: Counter[str] = Counter()
    inside: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        total += n
        frames = [LINE.sub(")", f) for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            inside[frame] += n
    out = [f"== {path.name}: {total} samples"]
    for title, counts in (("inclusive", inside), ("self", own)):
        out.append(f"-- {title}")
        out += [f"{n:7d} {100 * n / max(total, 1):5.1f}%  {f}" for f, n in counts.most_common(top)]
    return "\n".join(out)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.files:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
