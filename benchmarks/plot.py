"""Plot a saved ``pymtp bench --json`` result: median tok/s against draft depth.

    python benchmarks/plot.py results.json results.png [--title TEXT]

Same figure as ``pymtp bench --plot``, for results measured earlier (or on another
machine). Needs matplotlib (``pip install matplotlib``); it is not a pymtp dependency.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pymtp.bench import plot_depths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="output of pymtp bench --json")
    ap.add_argument("png", type=Path)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    data = json.loads(args.results.read_text(encoding="utf-8"))
    title = args.title or f"{Path(data['model']).name}, temperature {data.get('temperature', 0):g}"
    plot_depths(data["results"], args.png, title=title)
    print(args.png)


if __name__ == "__main__":
    main()
