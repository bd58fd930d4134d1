"""A hang, named: when the watchdog finds ranks without progress, every rank's threads' stacks go into
<output.dir>/hangs/attempt-<n>/rank-<r>.txt, and one line per rank says what it was doing (raytf.actor.stacks):
the user's code, storage I/O, input, a TensorFlow step or collective. result.json keeps the lines (`hangs`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

STACKS_TIMEOUT_S = 5.0  # a rank's answer; a process blocked holding Python's lock cannot answer at all


def lines(answers: list[dict | None], hung: list[int], role_of: dict[int, str], progress: list | None = None) -> list[str]:
    """One line per rank, with its last step and phase where it said them: `rank 1 (worker, step 30 train, no
    progress): user code at stall.py:15 in gen`."""
    out = []
    for rank, answer in enumerate(answers):
        seen = progress[rank] if progress and rank < len(progress) else None
        last = f", step {seen.global_step} {seen.phase}" if seen is not None else ""
        who = f"rank {rank} ({role_of.get(rank, 'worker')}{last}{', no progress' if rank in hung else ''})"
        if answer is None:
            out.append(f"{who}: did not answer within {STACKS_TIMEOUT_S:g}s (its process is gone, or holds Python's lock)")
            continue
        line = f"{who}: {answer['doing']}" + (f" at {answer['where']}" if answer.get("where") else "")
        if answer.get("others"):
            line += "; user code in " + ", ".join(answer["others"][:3])
        out.append(line)
    return out


def write(folder: Path, attempt: int, answers: list[dict | None], said: list[str]) -> str:
    """rank-<r>.txt per rank (its line, then every thread's stack) in <folder>/hangs/attempt-<n>/; returns
    that folder relative to output.dir."""
    where = Path("hangs") / f"attempt-{attempt}"
    while (folder / where).exists():  # a resumed run counts its attempts from 1 again: never overwrite
        where = where.with_name(where.name + "-1")
    target = folder / where
    target.mkdir(parents=True)
    for rank, (answer, line) in enumerate(zip(answers, said)):
        (target / f"rank-{rank}.txt").write_text(line + "\n\n" + (answer["text"] if answer else "") + "\n")
    return str(where)


def name(attempt, backend, hung: list[int], progress: list, number: int, output_dir: Path, mode: str,
         say) -> dict[str, Any]:
    """Ask every rank of `attempt` where it is, write the report, `say` it; result.json's entry for the hang.
    `progress`: each rank's last progress (its step and phase: train, validating, checkpointing, ...)."""
    answers = attempt.group.stacks(STACKS_TIMEOUT_S)
    said = lines(answers, hung, {t.rank: backend.role_name(t) for t in attempt.tasks}, progress)
    folder = write(output_dir, number, answers, said)
    say(f"raytf: no progress from {backend.who(hung)}; every rank's stacks are in {folder}/"
        + (" (failure.hang_mode observe: the job goes on)" if mode == "observe" else ""))
    for line in said:
        say(f"raytf:   {line}")
    return {"attempt": number, "ranks": hung, "folder": folder, "lines": said, "torn_down": mode != "observe"}
