"""What a task's process clears before its next job, when a sweep runs trials one after another in it.

A sweep keeps a trial's actors when its job succeeds (raytf.driver.ray_group), and the next trial on the
same placement group sets them up again, with the same TF_CONFIG: TensorFlow 2.21 re-forms a collective
group in processes that were in it only with the same cluster (same addresses, same ranks), and its
process-wide settings (threads, determinism, memory growth) cannot change once its runtime has started, so
those are part of the key a kept group is matched on (raytf.backends.base.Backend.process_key). Importing
TensorFlow is most of a short trial's start: a kept process skips it.

What the last job left in the process is dropped here: Keras's global state (its models and layer names,
so a layer is named as in a fresh process) and the garbage it held. Module-level state in the user's own
code stays, as with Ray Tune's reuse_actors (tune.reuse_processes: false turns reuse off).
"""
from __future__ import annotations

import gc
import sys


def fresh_start() -> None:
    import keras

    keras.backend.clear_session()
    if "tf_keras" in sys.modules:  # a train_fn's tf.keras (TF_USE_LEGACY_KERAS) keeps its own
        sys.modules["tf_keras"].backend.clear_session()
    gc.collect()
