"""Strategy backends: everything that differs between MultiWorkerMirrored, parameter servers and the
one-machine strategies (OneDevice, CentralStorage), on the
driver's side (roles and bundles, rank assignment, spec rules, how each role is supervised). Each names
the actor-side module that sets its tasks up and runs its steps. No TensorFlow here.

    backend = backends.get(spec.strategy)
"""
from __future__ import annotations

from raytf.backends.base import Backend, RoleSupervision
from raytf.backends.mirrored import MIRRORED
from raytf.backends.one_machine import CENTRAL_STORAGE, ONE_DEVICE
from raytf.backends.parameter_server import PARAMETER_SERVER

BACKENDS: dict[str, Backend] = {b.name: b for b in (MIRRORED, PARAMETER_SERVER, ONE_DEVICE, CENTRAL_STORAGE)}


def get(strategy: str) -> Backend:
    try:
        return BACKENDS[strategy]
    except KeyError:
        raise ValueError(f"strategy {strategy!r} is not one of {sorted(BACKENDS)}") from None


__all__ = ["Backend", "RoleSupervision", "BACKENDS", "get"]
