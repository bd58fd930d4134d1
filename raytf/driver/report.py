"""The driver's view of a run: the live progress line, the summary table, result.json and the
artifacts (model, TensorBoard events) written into output.dir."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from raytf.protocol import Progress


@dataclasses.dataclass
class Result:
    """result.json, read and written by this class only (`to_dict`, `from_dict`, `write`): one record for a run
    however it was started (raytf run, raytf.fit, a submitted job, a sweep's trial)."""

    name: str
    strategy: str
    status: str  # running, succeeded, failed, interrupted, or stopped (a sweep's scheduler stopped the trial)
    output_dir: str
    tasks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    examples_per_s: float | None = None
    model_path: str | None = None  # model.keras (output.export: keras)
    model_load: str | None = None  # what loading model.keras takes, when more than load_model(path)
    exports: dict[str, str] = dataclasses.field(default_factory=dict)  # format -> path, e.g. saved_model
    # workers whose input wait (or, under parameter servers, step time) stands out, and what they cost
    stragglers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tensorboard_dir: str | None = None
    wall_s: float | None = None
    time_to_first_step_s: float | None = None
    rendezvous_attempts: int = 1
    processes_reused: int = 0  # tasks that ran in processes kept from the sweep's previous trial (raytf.actor.reuse)
    workers: int | None = None  # in the attempt that finished (fewer than asked after an elastic restart)
    # that attempt's global batch, accumulation steps, per-replica batch, and which of them an elastic
    # restart kept ("per_replica_batch", "global_batch"; "as_asked" with all workers)
    batch: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # when, why, ranks, nodes, resumed step
    hangs: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # each hang named (raytf.driver.hangs)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # reserve_s, start_s, train_s, finish_s
    error: str | None = None  # why it failed; for "stopped", the scheduler's reason
    traceback: str | None = None  # a failed task's whole traceback (-v prints it)
    # parameter_server: where each model variable lives ({path: [device per shard]}), the evaluator's
    # results per checkpoint, and workers that died and were (or could not be) brought back
    variable_devices: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    evaluations_error: str | None = None  # the evaluator failed or did not finish; training still counts
    worker_losses: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # each start of the run on its storage (raytf.driver.attempts): cluster, host, start, end, why it ended
    attempts: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "Result":
        """A result.json read back (keys this version does not know are left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})

    def json_text(self) -> str:
        # strict JSON: a NaN or infinite number is null (json.dumps would write bare NaN, which parsers refuse)
        return json.dumps(finite(self.to_dict()), indent=2, default=str, allow_nan=False) + "\n"

    def write(self, folder: Path | None = None) -> Path:
        """result.json in `folder`: output.dir, or for output.dir on object storage the local staging folder
        shipped up to it (default: output_dir, a local path)."""
        if folder is None and "://" in self.output_dir:  # never a local folder named "s3:"
            raise ValueError(f"result.json for output.dir {self.output_dir} is written to its staging folder")
        path = Path(folder or self.output_dir) / "result.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        from raytf.driver.packaging import mark_output  # a later job's package leaves this folder out

        mark_output(path.parent)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.json_text())
        os.replace(tmp, path)  # readers never see half a file
        return path


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float, however deep, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_artifacts(output_dir: Path, artifacts: dict[str, bytes]) -> None:
    for rel, blob in artifacts.items():
        target = output_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob)


def fmt(value: Any) -> str:
    """A metric as the terminal shows it: 4 decimals, small values (a decayed learning rate) in e-notation."""
    if isinstance(value, float):
        if 0 < abs(value) < 1e-3:  # a decayed learning rate is not 0.0000
            return f"{value:.2e}"
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def worker_lines(tasks: list[dict[str, Any]]) -> str:
    """One line per worker: where its time went in the steps it ran."""
    lines = []
    for t in tasks:
        if t.get("timed_steps"):
            rate = f", {t['examples_per_s']:,.0f} ex/s" if t.get("examples_per_s") else ""
            # the first step of each attempt traces the step function and is left out of the timing
            ran = f"{t['steps']} steps, " if t.get("steps") else ""
            lines.append(f"rank {t['rank']} ({t['role']} on {t['node_ip']}): {ran}{t['timed_steps']} timed: input wait "
                         f"{t['input_wait_s']:.2f} s, step {t['step_s']:.2f} s{rate}")
    return "\n".join(lines)


def summary_table(history: list[dict[str, Any]]) -> str:
    """Per-epoch metrics as a fixed-width table."""
    if not history:
        return "(no epochs completed)"
    skip = {"step"}
    columns = [c for c in history[0] if c not in skip]
    columns = ["epoch"] + [c for c in columns if c != "epoch"]
    rows = [[fmt(h.get(c, "")) for c in columns] for h in history]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(cell.rjust(w) for cell, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in rows])


class ProgressDisplay:
    """One live line on a terminal (rewritten in place); on a pipe or file, a line every few seconds.
    Epoch lines always print, so logs keep the per-epoch metrics."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False, interval_s: float = 5.0):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = 0.0 if self.live else interval_s
        self._last = 0.0
        self._started = time.time()
        self._width = 0

    def message(self, text: str) -> None:
        if not self.quiet:
            self._clear()
            print(text, file=self.stream, flush=True)

    def epoch(self, metrics: dict[str, Any]) -> None:
        shown = "  ".join(f"{k} {fmt(v)}" for k, v in metrics.items() if k not in ("epoch", "step", "seconds"))
        self.message(f"epoch {metrics['epoch']} done in {metrics.get('seconds', 0):.1f}s: {shown}")

    def update(self, chief: "Progress | None", examples_per_s: float | None) -> None:
        if self.quiet or chief is None:
            return
        now = time.time()
        if chief.phase != "train" or now - self._last < self.interval_s:
            return
        self._last = now
        rate = f"{examples_per_s:,.0f} ex/s" if examples_per_s else "-- ex/s"
        loss = float("nan") if chief.loss is None else chief.loss
        text = (f"epoch {chief.epoch} step {chief.step}/{chief.steps} "
                f"loss {loss:.4f} {rate} [{now - self._started:.0f}s]")
        if self.live:
            self._width = max(self._width, len(text))
            print("\r" + text.ljust(self._width), end="", file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)

    def _clear(self) -> None:
        if self.live and self._width:
            print("\r" + " " * self._width + "\r", end="", file=self.stream, flush=True)
            self._width = 0
