"""TensorFlow's import without the optional stacks Keras 3 pulls in with it where they are installed:
scikit-learn (for `keras.wrappers.SKLearn*`), matplotlib (for `keras.visualization`'s plots) and IPython (for
`keras.saving.KerasFileEditor`'s notebook display). Together ~1.5 of TensorFlow's ~4.3 CPU-s here (0.75, 0.5
and 0.35), paid by every process that imports TensorFlow, for code no raytf task or driver calls.

Keras 3 is imported in the same window: TensorFlow imports it itself (eagerly, for its optimizers' registry),
but under TF_USE_LEGACY_KERAS=1 (`train.keras: legacy`) it imports tf-keras instead, and Keras 3 came later,
from raytf's own modules, with all three (+1.4-1.8 s of every such task's start, measured).

Only in processes that are raytf's own: each task actor, and the console script's driver (`set_lean_driver`).
Never in a user's Python calling `raytf.fit`, whose Keras would lose those classes for the session. All
three import as usual afterwards; only Keras's own references to them stay empty
(docs/known-issues.md).
"""
from __future__ import annotations

import importlib
import os
import sys

LEFT_OUT = ("sklearn", "matplotlib", "IPython")
# Under Keras 3 also SciPy (~0.15 CPU-s): in the import only TensorFlow's own TF1-era Keras (tf.compat.v1's
# training loops) asks for it, for sparse inputs, and takes its absence. tf-keras (`train.keras: legacy`) decides
# while importing whether its image augmentations can use scipy.ndimage, so there it stays.
LEFT_OUT_UNDER_KERAS3 = LEFT_OUT + ("scipy",)

_lean_driver = False  # set by the console script: the driver's process is raytf's own


def import_tensorflow() -> None:
    """Import TensorFlow (and with it Keras 3) with LEFT_OUT's packages hidden from it for the while: Keras
    takes their ImportError as "not installed", its path for optional packages."""
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")  # as TensorFlow reads it
    hidden = [name for name in (LEFT_OUT if legacy else LEFT_OUT_UNDER_KERAS3) if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        importlib.import_module("tensorflow")
        importlib.import_module("keras")  # Keras 3, which raytf's task code uses whatever tf.keras is
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def set_lean_driver() -> None:
    """The console script's driver imports TensorFlow lean too (`import_for_driver`)."""
    global _lean_driver
    _lean_driver = True


def import_for_driver() -> None:
    """Before the driver imports the job's code (which imports TensorFlow): lean in the console script; a
    user's own Python imports TensorFlow as it always does, when the code asks for it."""
    if _lean_driver and "tensorflow" not in sys.modules:
        import_tensorflow()
