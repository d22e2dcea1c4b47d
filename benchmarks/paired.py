"""Per-pass paired ratios from a `benchmarks/peers.py` log: within each pass, one configuration's
tokens/s over another's, and the median over passes. Two runs of one pass share the host's load
of that minute, so this ratio is steadier than the ratio of two medians on a shared machine.

    python3 benchmarks/paired.py peers.log nd-default/ds-zero1 nd-fsdp/floor
"""

from __future__ import annotations

import re
import statistics
import sys

PASS = re.compile(r"pass (\d+) (\S+)\s+([\d,]+) tok/s\s+([\d,]+) tok/CPU-s")


def main(path: str, pairs: list[str]) -> None:
    runs: dict[int, dict[str, tuple[int, int]]] = {}
    with open(path) as f:
        for line in f:
            if m := PASS.match(line):
                runs.setdefault(int(m[1]), {})[m[2]] = (int(m[3].replace(",", "")), int(m[4].replace(",", "")))
    for pair in pairs:
        num, den = pair.split("/")
        both = [runs[p] for p in sorted(runs) if num in runs[p] and den in runs[p]]
        if not both:
            sys.exit(f"{path}: no pass ran both {num} and {den}")
        wall = [r[num][0] / r[den][0] for r in both]
        cpu = [r[num][1] / r[den][1] for r in both]
        print(f"{num} / {den}: per pass {' / '.join(f'{x:.2f}' for x in wall)}; median {statistics.median(wall):.2f} "
              f"(tokens per CPU-second: {statistics.median(cpu):.2f})")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
