"""Sweep summaries and PNG plots from the finished runs (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from cascade.ablation.grid import Grid, PlotSpec, Run, Sweep, sweep_runs

Y_LABELS = {
    "acceptance": "acceptance of stage 0",
    "speedup": "speed-up over autoregressive",
    "tokens_per_s": "decode tokens/s",
}


def figure_value(run: Run, rows: dict[str, dict], y: str) -> float | None:
    row = rows.get(run.id)
    if row is None:
        return None
    if y == "acceptance":
        return next(iter(row["acceptance"].values()), None)
    if y == "speedup":
        baseline = rows.get(run.baseline().id)
        return row["tokens_per_s"] / baseline["tokens_per_s"] if baseline else None
    return row["tokens_per_s"]


def sweep_summary(grid: Grid, sweep: Sweep, rows: dict[str, dict]) -> list[dict[str, Any]]:
    """One entry per run of ``sweep`` that finished: its varied settings and figures."""
    return [
        {
            "run_id": run.id,
            **{key: run.get(key) for key in sweep.vary},
            "tokens_per_s": rows[run.id]["tokens_per_s"],
            "speedup": figure_value(run, rows, "speedup"),
            "acceptance": rows[run.id]["acceptance"],
            "mean_accepted_run": rows[run.id]["mean_accepted_run"],
        }
        for run in sweep_runs(grid, sweep)
        if run.id in rows
    ]


def plot_sweep(name: str, grid: Grid, sweep: Sweep, rows: dict[str, dict], out: Path) -> Path | None:
    """Draw ``sweep`` as its plot spec says into ``out/<name>.png``; None if nothing to draw yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for run in sweep_runs(grid, sweep) if run.id in rows]
    if not runs or sweep.plot is None:
        return None
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    if sweep.plot.kind == "time_split":
        draw_time_split(axes, runs, rows, list(sweep.vary))
    else:
        draw_lines(axes, runs, rows, sweep.plot)
    axes.set_title(name.replace("_", " "))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = out / f"{name}.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def draw_lines(axes, runs: list[Run], rows: dict[str, dict], spec: PlotSpec) -> None:
    lines: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        value = figure_value(run, rows, spec.y)
        if value is not None:
            lines[run.get(spec.series) if spec.series else spec.y].append((run.get(spec.x), value))
    for label, points in lines.items():
        points.sort()
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=str(label))
    axes.set_xlabel(spec.x)
    axes.set_ylabel(Y_LABELS[spec.y])
    if spec.y == "speedup":
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    if spec.series:
        axes.legend(title=spec.series)


def draw_time_split(axes, runs: list[Run], rows: dict[str, dict], varied: list[str]) -> None:
    """Stacked bars: each stage's forward time per generated token (ms)."""
    labels = [" ".join(str(run.get(key)) for key in varied) for run in runs]
    bottoms = [0.0] * len(runs)
    stage_names = list(dict.fromkeys(stage for run in runs for stage in rows[run.id]["stage_time_s"]))
    for stage in stage_names:
        heights = [1000 * rows[run.id]["stage_time_s"].get(stage, 0.0) / run.get("new_tokens") for run in runs]
        axes.bar(labels, heights, bottom=bottoms, label=stage)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.set_ylabel("ms per generated token (forward time by stage)")
    axes.legend(fontsize="small")
