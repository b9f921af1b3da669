"""``pdefit-sweep-summary DIR``: a table of every fit below DIR (the points of a sweep, or any
set of run directories), finished or not.

A point is a directory holding ``status.json`` (written by the training loop at every
checkpoint: running, preempted, done or diverged) or ``summary.json`` (written when the fit
has finished: final loss, parameter errors, wall time over all restarts, restarts).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SKIP = {"checkpoints", ".submitit", ".hydra", "data.zarr"}


def find_points(root: Path) -> list[Path]:
    """Run directories below ``root`` (itself included), sorted by path."""
    points = []
    stack = [root]
    while stack:
        directory = stack.pop()
        if (directory / "status.json").exists() or (directory / "summary.json").exists():
            points.append(directory)
            continue
        stack.extend(p for p in directory.iterdir() if p.is_dir() and p.name not in SKIP)
    return sorted(points)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def overrides(directory: Path) -> list[str] | None:
    """The command-line overrides Hydra recorded for the run (``.hydra/overrides.yaml``)."""
    path = directory / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return [str(x) for x in OmegaConf.load(path)]


def labels(points: Sequence[Path], root: Path) -> list[str]:
    """Each point named by the overrides that tell it apart from the other points (what the
    sweep varies), else by its directory."""
    recorded = [overrides(p) for p in points]
    known = [set(r) for r in recorded if r is not None]
    common = set.intersection(*known) if len(known) > 1 else set()
    names = []
    for point, items in zip(points, recorded, strict=True):
        varying = [x for x in items or [] if x not in common]
        names.append(" ".join(varying) if len(known) > 1 and varying
                     else str(point.relative_to(root)) if point != root else point.name)
    return names


def point_row(directory: Path, label: str) -> dict[str, Any]:
    status, summary = _read(directory / "status.json"), _read(directory / "summary.json")
    done = bool(summary)
    return {
        "point": label,
        "directory": str(directory),
        "status": "done" if done else status.get("status", "?"),
        "steps": summary.get("optimizer_steps") if done else status.get("step"),
        "final_loss": summary.get("final_loss") if done else status.get("loss"),
        "best_loss": summary.get("best_loss", status.get("best_loss")),
        "mean_rel_error": summary.get("mean_rel_error"),
        "max_rel_error": summary.get("max_rel_error"),
        "wall_time_s": summary.get("wall_time_s", status.get("wall_time_s")),
        "restarts": summary.get("restarts", status.get("restarts", 0)),
        "nan_failures": summary.get("nan_failures", status.get("nan_failures", 0)),
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = [("point", "point", str), ("status", "status", str), ("steps", "steps", _int),
               ("final_loss", "final loss", _sci), ("best_loss", "best loss", _sci),
               ("mean_rel_error", "mean err", _pct), ("max_rel_error", "max err", _pct),
               ("wall_time_s", "wall s", _secs), ("restarts", "restarts", _int),
               ("nan_failures", "NaN", _int)]
    cells = [[title for _, title, _ in columns]]
    cells += [[fmt(row.get(key)) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        first = values[0].ljust(widths[0])
        return "  ".join([first, *(v.rjust(w) for v, w in zip(values[1:], widths[1:],
                                                                strict=True))])

    return "\n".join(line(values) for values in cells)


def _int(x: Any) -> str:
    return "—" if x is None else str(int(x))


def _sci(x: Any) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.4e}"


def _pct(x: Any) -> str:
    return "—" if x is None else f"{100 * x:.3f} %"


def _secs(x: Any) -> str:
    return "—" if x is None else f"{x:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdefit-sweep-summary",
        description="One line per fit below a sweep (or any) directory.")
    parser.add_argument("directory", type=Path, nargs="?", default=Path("runs/sweep"),
                        help="a sweep directory, e.g. runs/sweep/<run.name> (default runs/sweep)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    args = parser.parse_args(argv)
    root = args.directory
    if not root.is_dir():
        print(f"{root}: no such directory", file=sys.stderr)
        return 2
    points = find_points(root)
    rows = [point_row(p, label) for p, label in zip(points, labels(points, root), strict=True)]
    if not rows:
        print(f"{root}: no fits found (no status.json or summary.json below it)",
              file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
