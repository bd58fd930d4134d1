"""raytf's errors. Each carries the process exit code the CLI returns for it."""
from __future__ import annotations


class RaytfError(Exception):
    """Base class: a failure raytf can explain in one message."""

    exit_code = 1


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

    def __init__(self, message: str, causes: dict[str, list[int]] | None = None):
        super().__init__(message)
        self.causes = causes or {}


class CheckpointCorrupt(RaytfError):
    """A checkpoint could not be restored; the controller retries with the one before it."""

    def __init__(self, path: str, cause: str):
        super().__init__(f"checkpoint {path} cannot be restored ({cause})")
        self.path, self.cause = path, cause

    def __reduce__(self):  # raised in an actor, unpickled in the driver
        return type(self), (self.path, self.cause)
