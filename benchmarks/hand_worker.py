"""One hand-launched TF worker (no Ray): TF_CONFIG comes from the environment, as a user would write it.
Runs the job's loop as a raytf actor would (raytf's own loop, or the job's train_fn with its ctx), so the
comparison with raytf isolates orchestration cost. Prints one JSON line."""
import json
import os
import sys
import tempfile
import time

from raytf import job as spec
from raytf.actor.context import TaskContext
from raytf.driver import controller


def main(job_file: str, overrides_json: str) -> None:
    import tensorflow as tf

    # Before spec.load: its Keras checks initialise TF, after which collectives cannot be configured.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    job = spec.load(job_file, json.loads(overrides_json))
    payload = controller.build_payload(job)
    payload = payload.__class__(spec=payload.spec, train_data=payload.train_data,
                                train_root=job.data_path(job.spec.data.train), val_data=payload.val_data,
                                val_root=job.data_path(job.spec.data.validation) if job.spec.data.validation else None)
    from raytf.actor import mirrored

    config = json.loads(os.environ["TF_CONFIG"])
    ctx = TaskContext(config["task"]["index"], len(config["cluster"]["worker"]), payload.spec, tempfile.mkdtemp(),
                      payload)
    outcome = mirrored.run(strategy, payload, ctx)
    print(json.dumps({"first_step_at": ctx.channel.first_step_at, "finished_at": time.time(), "steps": outcome.steps,
                      "loss": outcome.history[-1]["loss"]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
