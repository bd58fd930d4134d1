"""raytf's errors. Each carries the process exit code the CLI returns for it."""
from __future__ import annotations


def clip(text: str, limit: int = 300) -> str:
    """A value echoed in a message, cut to `limit` characters (a 1 KB file can hold a value of gigabytes)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class RaytfError(Exception):
    """Base class: a failure raytf can explain in one message. `traceback`: where there is one to show with
    -v and keep in result.json (the failed task's)."""

    exit_code = 1
    traceback: str | None = None


class SpecError(RaytfError):
    """The job spec is invalid (bad key, value, path or function). Found before any actor starts."""

    exit_code = 2


class PlacementTimeout(RaytfError):
    """The cluster could not give the placement group within cluster.reserve_timeout_s."""

    exit_code = 3


class WorkerStartupError(RaytfError):
    """Actors did not start, report in, or bring up TensorFlow's server in time."""

    exit_code = 1


class PortTaken(WorkerStartupError):
    """A TF task's chosen port was taken before TensorFlow could bind it; the rendezvous is retried."""


class TrainingFailed(RaytfError):
    """One or more TF tasks failed while training. `causes` maps a message to the ranks that raised it."""

    exit_code = 1

    def __init__(self, message: str, causes: dict[str, list[int]] | None = None, traceback: str | None = None,
                 per_rank: dict[int, dict] | None = None):
        super().__init__(message)
        self.causes = causes or {}
        self.traceback = traceback
        self.per_rank = per_rank or {}  # rank -> {"error", "traceback"}


class TaskException(RaytfError):
    """An exception raised in a task (the user's code, TensorFlow, raytf's loop), as plain data that survives
    the trip to the driver: the original type's name and message, the user's `file.py:LINE` in the job
    folder (None when no frame is there) and the whole traceback."""

    def __init__(self, type_name: str, message: str, where: str | None, traceback: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.where, self.traceback = type_name, message, where, traceback

    def __reduce__(self):  # raised in an actor, unpickled in the driver
        return type(self), (self.type_name, self.message, self.where, self.traceback)


class NonFiniteLoss(RaytfError):
    """The loss became NaN or infinite (a diverging learning rate, bad input values): the job stops rather than
    go on and export a NaN model as a success (train.nonfinite_loss: continue goes on)."""

    def __init__(self, loss: float, epoch: int, step: int, rank: int):
        super().__init__(f"the loss is {loss} at epoch {epoch}, step {step} (rank {rank}): training diverged or the "
                         f"data holds NaN/inf; lower optimizer.learning_rate, check the data (raytf data inspect), "
                         f"or set train.nonfinite_loss: continue")
        self.loss, self.epoch, self.step, self.rank = loss, epoch, step, rank

    def __reduce__(self):  # raised in an actor, unpickled in the driver
        return type(self), (self.loss, self.epoch, self.step, self.rank)


class NonFiniteWeights(RaytfError):
    """The model's weights hold NaN or inf at the end of training, though the loss stayed finite (NaN or inf
    in the data, usually): nothing is exported."""

    def __init__(self, first: str, count: int, epoch: int, step: int, rank: int):
        super().__init__(f"the model's weights hold NaN or inf after epoch {epoch}, step {step} (rank {rank}; {first}"
                         f"{f' and {count - 1} more' if count > 1 else ''}), though the loss stayed finite: the data "
                         f"likely holds NaN or inf values (raytf data inspect; data.fill_nulls), or training diverged; "
                         f"nothing was exported (train.nonfinite_loss: continue exports it anyway)")
        self.first, self.count, self.epoch, self.step, self.rank = first, count, epoch, step, rank

    def __reduce__(self):  # raised in an actor, unpickled in the driver
        return type(self), (self.first, self.count, self.epoch, self.step, self.rank)


class CheckpointMismatch(RaytfError):
    """A checkpoint that reads fine but does not fit the model (other shapes, missing or extra variables):
    the job's code changed, or checkpoint.dir holds another model's. Never answered with a fresh start."""

    def __init__(self, path: str, cause: str):
        super().__init__(f"checkpoint {path} does not fit this job's model ({cause}); resume it with the model "
                         f"that saved it, or give this job another checkpoint.dir")
        self.path, self.cause = path, cause

    def __reduce__(self):  # raised in an actor, unpickled in the driver
        return type(self), (self.path, self.cause)


class CheckpointCorrupt(RaytfError):
    """A checkpoint could not be restored; the controller retries with the one before it."""

    def __init__(self, path: str, cause: str):
        super().__init__(f"checkpoint {path} cannot be restored ({cause})")
        self.path, self.cause = path, cause

    def __reduce__(self):  # raised in an actor, unpickled in the driver
        return type(self), (self.path, self.cause)
