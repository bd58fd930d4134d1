"""What a sweep leaves behind: the table of trials, the best trial (a ready-to-run job spec and its model),
sweep.json, and a picture of the metric over global batch size x learning rate. Pure except for writing
files; matplotlib is imported only to draw."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from raytf.job import apply_overrides

COMPLETED, STOPPED, ERROR, UNFINISHED = "completed", "stopped early", "error", "unfinished"
UNRUNNABLE = "unrunnable"  # a searcher's suggestion that is no job (its trial failed at once, the searcher told)


@dataclasses.dataclass
class SweepResult:
    name: str
    metric: str
    mode: str
    output_dir: str
    rows: list[dict[str, Any]]  # one per trial, in point order
    best: dict[str, Any] | None  # the completed trial with the best final metric
    best_spec_path: str | None
    best_model_path: str | None
    sweep_json: str
    plot_path: str | None
    table: str
    max_concurrent_trials: int
    rejected: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wall_s: float | None = None
    utilization: float | None = None  # busy CPU-seconds (trial time x reserved CPUs) / available CPU-seconds
    interrupted: bool = False  # trials left unfinished: `--resume` continues them
    best_exports: dict[str, str] = dataclasses.field(default_factory=dict)  # the best trial's, format -> path
    # tune.search.algorithm, and the search's path: each trial's metric in trial order, with the best so far
    search: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def trial_status(tune_status: str, epochs: int, planned_epochs: int) -> str:
    """Tune's status plus what happened: a trial Tune terminated before its last epoch was stopped early.
    HyperBand may pause a trial at its last report, after its job finished: all epochs reported is complete."""
    if tune_status == "ERROR":
        return ERROR
    if tune_status == "TERMINATED" or (tune_status == "PAUSED" and epochs >= planned_epochs):
        return COMPLETED if epochs >= planned_epochs else STOPPED
    return UNFINISHED


def search_path(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The search as it went: trial by trial (rows in trial order), its last reported metric (None for one
    that reported nothing) and the best any trial had reached by then."""
    path, best = [], None
    for r in rows:
        value = r["final"] if r["final"] is not None and math.isfinite(r["final"]) else None
        if value is not None:
            best = value if best is None else (min(best, value) if mode == "min" else max(best, value))
        path.append({"point": r["point"], "status": r["status"], "value": value, "best_so_far": best})
    return path


def lineage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pbt's exploits, in trial order: which trial took which one's state, after which epoch, at which step,
    and the values it went on with."""
    return [{"point": r["point"], **entry} for r in rows for entry in r.get("restores", ())
            if entry["from"] != r["point"]]


def best_of(values: list[float], mode: str) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return None
    return min(finite) if mode == "min" else max(finite)


def best_row(rows: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The completed trial with the best final metric: its saved model is that final state, which an
    early-stopped trial does not have."""
    done = [r for r in rows if r["status"] == COMPLETED and r["final"] is not None and math.isfinite(r["final"])]
    if not done:
        return None
    key = (lambda r: r["final"]) if mode == "min" else (lambda r: -r["final"])
    return min(done, key=key)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def table(rows: list[dict[str, Any]], metric: str, space_keys: list[str], best: dict[str, Any] | None) -> str:
    """One line per trial: point, status, its values, the learning rate raytf's loop ran with (none for a
    train_fn: its optimizer is its own), final and best metric, epochs, seconds. The best trial is marked with *."""
    short = [k.rsplit(".", 1)[-1] for k in space_keys]
    rates = any(r["learning_rate"] is not None for r in rows)
    columns = ["", "point", "status", *short, *(["lr"] if rates else []), f"final {metric}", f"best {metric}",
               "epochs", "time (s)"]
    lines = []
    for r in rows:
        mark = "*" if best is not None and r["point"] == best["point"] else ""
        lines.append([mark, r["point"], r["status"], *(_fmt(r["config"].get(k)) for k in space_keys),
                      *([_fmt(r["learning_rate"])] if rates else []), _fmt(r["final"]), _fmt(r["best"]),
                      str(r["epochs"]), _fmt(None if r["time_s"] is None else round(r["time_s"], 1))])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(columns)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()  # noqa: E731
    errors = [f"{r['point']} error: {r['error']}" for r in rows if r.get("error")]
    return "\n".join([fmt(columns), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines] + errors)


def best_spec_yaml(job_raw: Mapping[str, Any], overrides: Mapping[str, Any], header: str) -> str:
    """The job spec of the best trial: the sweep's job part with the trial's values (learning rate as
    scaled), no tune section; `overrides` also renames it and points output.dir elsewhere."""
    raw = apply_overrides(job_raw, overrides)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None, width=110)


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers never see half a file
    return path


def write_json(path: Path, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def plot(rows: list[dict[str, Any]], metric: str, mode: str, path: Path, title: str) -> Path | None:
    """Two panels, three for pbt. Left: the final metric of each trial over global batch size (x, log2) and
    learning rate (y, log): one dot per trial, coloured and labelled by its value; early-stopped trials
    hollow, the best one starred. Middle: the search's path, each trial's metric in trial order and the best
    so far, with the trials that could not run or failed marked on the axis. Right (pbt): each trial's
    metric per epoch, a dashed line from the trial whose checkpoint it took to where it went on."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["final"] is not None and math.isfinite(r["final"])
             and r["global_batch_size"] and r["learning_rate"]]
    exploits = lineage(rows)
    fig, axes = plt.subplots(1, 3 if exploits else 2, figsize=(18.0 if exploits else 12.0, 4.8), dpi=110)
    ax, path_ax = axes[0], axes[1]
    _plot_path(path_ax, search_path(rows, mode), metric)
    if exploits:
        _plot_lineage(axes[2], rows, exploits, metric)
    best = best_row(rows, mode)
    if shown:
        xs = [r["global_batch_size"] for r in shown]
        ys = [r["learning_rate"] for r in shown]
        vs = [r["final"] for r in shown]
        cmap = "viridis_r" if mode == "min" else "viridis"
        full = [r["status"] == COMPLETED for r in shown]
        points = ax.scatter(xs, ys, c=vs, cmap=cmap, s=220, edgecolors="black",
                            linewidths=[1.0 if f else 2.0 for f in full])
        for r, x, y, v, f in zip(shown, xs, ys, vs, full):
            if not f:  # early-stopped: hollow, so its (early) value is not mistaken for a final one
                ax.scatter([x], [y], s=90, c="white", edgecolors="none")
            ax.annotate(f"{v:.3g}", (x, y), textcoords="offset points", xytext=(0, 13), ha="center", fontsize=8)
        if not all(full):
            ax.scatter([], [], s=60, c="white", edgecolors="black", linewidths=2.0, label="stopped early (hollow)")
        if best is not None:
            ax.scatter([best["global_batch_size"]], [best["learning_rate"]], marker="*", s=120, c="red", zorder=3,
                       label=f"best: {best['point']}")
        if best is not None or not all(full):
            ax.legend(loc="best", fontsize=8)
        fig.colorbar(points, ax=ax, label=f"final {metric}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(set(xs)), [str(x) for x in sorted(set(xs))])
        ax.set_yticks(sorted(set(ys)), [f"{y:.3g}" for y in sorted(set(ys))])
        ax.minorticks_off()
        ax.margins(0.25)
    else:
        ax.text(0.5, 0.5, "no trial reported the metric with a rate raytf knows\n(a train_fn's is its own: see the "
                "table)", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("global batch size")
    ax.set_ylabel("learning rate (as trained)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_path(ax, path: list[dict[str, Any]], metric: str) -> None:
    order = list(range(1, len(path) + 1))
    reported = [(i, p["value"]) for i, p in zip(order, path) if p["value"] is not None]
    if reported:
        ax.scatter([i for i, _ in reported], [v for _, v in reported], s=30, c="tab:blue", label=f"trial's {metric}")
        best = [(i, p["best_so_far"]) for i, p in zip(order, path) if p["best_so_far"] is not None]
        ax.step([i for i, _ in best], [v for _, v in best], where="post", c="tab:red", label="best so far")
    failed = [i for i, p in zip(order, path) if p["status"] in (UNRUNNABLE, ERROR)]
    if failed:
        low = ax.get_ylim()[0] if reported else 0
        ax.scatter(failed, [low] * len(failed), marker="x", c="gray", label="could not run / failed")
    if path:
        ax.legend(loc="best", fontsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial (in the order they were started)")
    ax.set_ylabel(metric)
    ax.set_title("the search's path", fontsize=9)


def _plot_lineage(ax, rows: list[dict[str, Any]], exploits: list[dict[str, Any]], metric: str) -> None:
    """Each trial's metric per epoch as Tune saw it; an exploit drawn from the donor's value at that epoch to
    the taker's next one."""
    colours = {}
    for r in rows:
        if r["history"]:
            line, = ax.plot(range(1, len(r["history"]) + 1), r["history"], marker="o", ms=3, label=r["point"])
            colours[r["point"]] = line.get_color()
    by_point = {r["point"]: r["history"] for r in rows}
    for e in exploits:
        donor, taker, at = by_point.get(e["from"], []), by_point.get(e["point"], []), e["after_epoch"]
        if len(donor) >= at and len(taker) > at:
            ax.plot([at, at + 1], [donor[at - 1], taker[at]], ls="--", c=colours.get(e["point"], "gray"), lw=1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="best", fontsize=7)
    ax.set_xlabel("epoch (dashed: took another trial's checkpoint)")
    ax.set_ylabel(metric)
    ax.set_title("pbt: each trial's lineage", fontsize=9)
