"""A drain notice inside the one training loop, against a recording runner (no cluster): every rank that
accepts a stop step stops at exactly that step, on the same side of the epoch end's collectives."""
from __future__ import annotations

import numpy as np
import pytest

from raytf.actor import loop
from raytf.actor.context import TaskContext
from raytf.protocol import Outcome, StopAnswer, WorkerPayload
from raytf.job import parse

pytestmark = pytest.mark.timeout(120)

STEPS_PER_EPOCH = 4


class Sums:
    sizes = (1,)

    def results(self, totals):
        return {"examples": 8}


class RecordingRunner:
    """Steps, syncs and validation in the order the loop calls them; `during_validation` runs inside the
    epoch end's validation (where a notice can arrive while the rank waits on the others)."""

    steps = STEPS_PER_EPOCH
    optimizer = None
    validates = True
    own_timing = True
    rescuable = False
    train_acc = eval_acc = Sums()

    def __init__(self, during_validation=None):
        self.calls: list[str] = []
        self.done = 0
        self.during_validation = during_validation

    def start_epoch(self, epoch, totals):
        pass

    def train(self, count, epoch, stopping=lambda: False):
        for _ in range(count):
            if stopping():
                return
            self.done += 1
            self.calls.append(f"step {self.done}")
            yield 0.5

    def epoch_totals(self):
        return np.zeros(1)

    def epoch_notes(self):
        return {}

    def sync_state(self):
        self.calls.append("sync")

    def validate(self):
        self.calls.append("validate")
        if self.during_validation is not None:
            self.during_validation()
            self.during_validation = None
        return np.zeros(1)

    def final_checkpoint_needed(self):
        return False

    def timing(self):
        return {}

    def finish(self):
        return Outcome()


@pytest.fixture
def rank(tmp_path, monkeypatch):
    monkeypatch.setattr(loop.schedules, "learning_rate_at", lambda optimizer, step: 0.1)
    spec = parse({"name": "stop", "model": "m:f", "dataset_fn": "m:d",
                  "train": {"global_batch_size": 8, "epochs": 3, "steps_per_epoch": STEPS_PER_EPOCH}})
    return lambda: TaskContext(0, 2, spec, str(tmp_path)), WorkerPayload(spec)


def test_a_notice_for_a_step_this_rank_finished_before_the_epoch_end_is_refused(rank):
    make_ctx, payload = rank
    ctx = make_ctx()
    answers = []
    runner = RecordingRunner(during_validation=lambda: answers.append(ctx.channel.request_stop(STEPS_PER_EPOCH)))
    outcome = loop.run(runner, payload, ctx)
    # The rank had finished step 4 and gone into the epoch end: stopping there would put it on the far side
    # of the sync and validation that a rank still inside step 4 (which accepts) would never run.
    assert answers == [StopAnswer(False, STEPS_PER_EPOCH)]
    assert outcome.preempted is None and runner.done == 3 * STEPS_PER_EPOCH


def test_a_notice_during_the_epoch_end_stops_every_rank_at_the_next_epochs_step(rank):
    make_ctx, payload = rank
    ctx = make_ctx()
    runner = RecordingRunner(during_validation=lambda: ctx.channel.request_stop(STEPS_PER_EPOCH + 2))
    outcome = loop.run(runner, payload, ctx)
    assert outcome.preempted.step == outcome.steps == STEPS_PER_EPOCH + 2
    assert runner.calls == [f"step {i}" for i in range(1, 5)] + ["sync", "validate", "step 5", "step 6"]


def test_a_notice_for_the_epochs_last_step_stops_before_its_end(rank):
    make_ctx, payload = rank
    ctx = make_ctx()
    runner = RecordingRunner()
    runner.train = _asking_at(runner.train, ctx, after_step=2, stop_at=STEPS_PER_EPOCH)
    outcome = loop.run(runner, payload, ctx)
    # Every rank that accepted step 4 stops right after it, before the epoch end's collectives; the resumed
    # attempt runs the epoch end.
    assert outcome.preempted.step == STEPS_PER_EPOCH
    assert runner.calls == [f"step {i}" for i in range(1, 5)]


def _asking_at(train, ctx, after_step, stop_at):
    def asking(count, epoch, stopping=lambda: False):
        for loss in train(count, epoch, stopping):
            yield loss
            if ctx.channel.progress().global_step == after_step:  # the loop has counted the step just yielded
                assert ctx.channel.request_stop(stop_at).accepted
    return asking


def test_the_step_rate_a_stop_step_is_planned_with_leaves_out_validation_and_checkpoints(rank, monkeypatch):
    make_ctx, _ = rank
    now = [1000.0]
    monkeypatch.setattr("raytf.actor.channel.time.time", lambda: now[0])
    ctx = make_ctx()

    def steps(first, count):
        for g in range(first, first + count):
            now[0] += 0.1  # 10 steps/s
            ctx.channel.train_step(1, g % STEPS_PER_EPOCH or STEPS_PER_EPOCH, None, g, 0.5, 8)

    steps(1, 20)
    ctx.channel.phase("validating")
    now[0] += 30.0  # a long validation pass, then a checkpoint
    ctx.channel.phase("checkpointing")
    now[0] += 10.0
    steps(21, 3)  # the first report after them: the rate must not count the 40 s without steps
    assert ctx.channel.progress().steps_per_s == pytest.approx(10.0, rel=0.05)
    steps(24, 20)
    assert ctx.channel.progress().steps_per_s == pytest.approx(10.0, rel=0.05)


def test_a_rescued_epochs_sums_are_one_ranks_times_the_workers_plus_what_was_restored():
    import numpy as np

    from raytf.actor.rescue import estimated_totals

    # no resume in this epoch: rank 1 added (2 loss, 8 rows) of 3 workers' steps
    assert estimated_totals(np.array([2.0, 8.0]), None, None, 3).tolist() == [6.0, 24.0]
    # a resumed epoch: 100 rows restored (global); the chief's accumulator began with them, a worker's at zero
    restored = np.array([10.0, 100.0])
    assert estimated_totals(np.array([12.0, 108.0]), restored, restored, 2).tolist() == [14.0, 116.0]
    assert estimated_totals(np.array([2.0, 8.0]), None, restored, 2).tolist() == [14.0, 116.0]
