"""``microspeed plot CSV_DIR -o curves.png``: draw the curves a ``csv_monitor`` run wrote.

``CSV_DIR`` is a job folder (``output_path/job_name``, holding ``Train_Samples_*.csv``) or a folder
above one or several job folders: every folder below it that holds csv files is one job, drawn as
one line per panel. Panels: training loss and learning rate, then the fp16 loss scale and the
gradient norm when a job logged them. The x-axis is the csv ``step`` column, which is the number of
samples seen (DeepSpeed's layout). Files written by DeepSpeed itself are read the same way.
Drawing uses matplotlib's Agg backend (no display needed) and never touches pyplot's global state.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

#: Panels in drawing order: (series name = the csv header / last part of the event name, title, log y-axis).
PANELS: tuple[tuple[str, str, bool], ...] = (
    ("train_loss", "training loss", False),
    ("lr", "learning rate", False),
    ("loss_scale", "fp16 loss scale", True),
    ("grad_norm", "gradient norm (before clipping)", False),
)

_REQUIRED_ANY = ("train_loss", "lr")


class PlotError(Exception):
    """What the user gave cannot be drawn (no folder, no csv files, no loss or lr series)."""


def read_series(path: str | os.PathLike) -> tuple[str, list[float], list[float]]:
    """Read one csv_monitor file: ``(series name, steps, values)``.

    The series name is the header's second column (DeepSpeed writes the last part of the event
    name there), or the file name's last ``_``-part when there is no header. Rows that are not two
    numbers (a header repeated by an appended run) are skipped.
    """
    path = Path(path)
    name = None
    xs: list[float] = []
    ys: list[float] = []
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.reader(fh):
            if len(row) < 2:
                continue
            try:
                x, y = float(row[0]), float(row[1])
            except ValueError:
                if name is None and row[0].strip() == "step":
                    name = row[1].strip()
                continue
            xs.append(x)
            ys.append(y)
    if name is None:
        name = path.stem.removeprefix("Train_Samples_")
    return name, xs, ys


def find_jobs(root: str | os.PathLike) -> dict[str, Path]:
    """Job folders at or below ``root`` (folders holding ``*.csv``), ``{label: folder}``, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise PlotError(f"{root}: no such folder. Give the csv_monitor folder (output_path/job_name).")
    folders = sorted({p.parent for p in root.rglob("*.csv") if p.is_file()})
    if not folders:
        raise PlotError(
            f"{root}: no .csv files in this folder or below it. Give the folder a csv_monitor run wrote "
            '(output_path/job_name, enabled with "csv_monitor": {"enabled": true, ...} in the ds_config).'
        )
    jobs = {}
    for folder in folders:
        label = folder.name if folder != root else root.resolve().name
        if label in jobs:
            label = str(folder.relative_to(root))
        jobs[label] = folder
    return jobs


def load_jobs(jobs: dict[str, Path]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """``{job: {series name: (steps, values)}}`` for every csv file of every job folder."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for label, folder in jobs.items():
        series = {}
        for path in sorted(folder.glob("*.csv")):
            name, xs, ys = read_series(path)
            if xs:
                series[name] = (xs, ys)
        out[label] = series
    return out


def draw(data: dict[str, dict[str, tuple[list[float], list[float]]]], output: str | os.PathLike,
         title: str | None = None) -> list[str]:
    """Draw the panels that have data into the PNG ``output``; return the panel series names drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = [p for p in PANELS if any(p[0] in series for series in data.values())]
    if not any(p[0] in _REQUIRED_ANY for p in present):
        found = sorted({name for series in data.values() for name in series})
        raise PlotError(f"no train_loss or lr series among the csv files (found: {', '.join(found) or 'none'}).")
    cols = 2 if len(present) > 1 else 1
    rows = math.ceil(len(present) / cols)
    fig = Figure(figsize=(6.0 * cols, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (key, panel_title, log_y) in zip(axes, present, strict=False):
        for label, series in data.items():
            if key in series:
                xs, ys = series[key]
                ax.plot(xs, ys, label=label, linewidth=1.2, marker="." if len(xs) <= 50 else None)
        ax.set_title(panel_title)
        ax.set_xlabel("samples (csv 'step')")
        ax.grid(True, alpha=0.3)
        if log_y:
            ax.set_yscale("log", base=2)
        if len(data) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(present):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    output = Path(output)
    if output.parent and not output.parent.exists():
        output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    return [p[0] for p in present]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``microspeed plot``: returns 0 when the PNG was written, 1 with a message otherwise."""
    parser = argparse.ArgumentParser(
        prog="microspeed plot",
        description="Draw loss and learning-rate curves (and loss scale / grad norm) from a csv_monitor folder.",
    )
    parser.add_argument("csv_dir", metavar="CSV_DIR", help="csv_monitor job folder (output_path/job_name) or a parent")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default: curves.png)")
    parser.add_argument("--title", default=None, help="title above the panels")
    opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("microspeed plot: needs matplotlib. Run `pip install matplotlib` "
              "(or `pip install 'microspeed[monitor]'`).", file=sys.stderr)
        return 1
    try:
        data = load_jobs(find_jobs(opts.csv_dir))
        drawn = draw(data, opts.output, title=opts.title)
    except PlotError as exc:
        print(f"microspeed plot: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {opts.output}: {', '.join(drawn)} for {len(data)} job(s) ({', '.join(data)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
