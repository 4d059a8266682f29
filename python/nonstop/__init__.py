"""nonstop: checkpoints every few iterations without stalling training.

    ckpt = nonstop.Checkpointer("runs/ckpt", state={"model": model, "optim": opt}, every=10)
    start = ckpt.restore()
    for step in range((start or -1) + 1, total_steps):
        train_step()
        ckpt.step(step)
    ckpt.close()

See docs/PYTHON.md.
"""

__version__ = "0.1.0"

from .errors import (CheckpointError, CheckpointIOError, CheckpointMismatchError,  # noqa: E402
                     CheckpointNotFoundError, CorruptCheckpointError,
                     IncompatibleCheckpointError)

from . import _ext  # noqa: E402
from ._ext import ERROR as _CORE_ERROR  # noqa: E402
from ._ext import _core  # noqa: E402,F401  nonstop._core: the extension, None when it did not load


def build_info() -> dict:
    """What this build of the C++ engine contains."""
    return {"cuda": _ext.core().built_with_cuda()}


# Checkpoint management (no torch needed): nonstop.list(dir), nonstop.delete(dir, step).
from ._manage import delete  # noqa: E402
from ._manage import list_checkpoints as list  # noqa: E402,A001

# The public API, imported eagerly so that IDEs and type checkers see it
# (the package ships py.typed). Without torch only the errors and
# build_info() are there (the command line needs no more); the other names
# then raise an ImportError that says so.
try:
    import torch as _torch  # noqa: F401
    _TORCH_ERROR = None
except ImportError as e:
    _TORCH_ERROR = str(e)

if _TORCH_ERROR is None:
    from ._checkpointer import Checkpointer  # noqa: E402
    from ._export import export  # noqa: E402
    from ._restore import LoadedCheckpoint, load  # noqa: E402
    from ._handle import CheckpointHandle  # noqa: E402
    # docs/PREEMPTION.md
    from ._preempt import EXIT_PREEMPTED, Preempted, worker_init_fn  # noqa: E402
else:
    def __getattr__(name):
        if name in _TORCH_NAMES:
            raise ImportError(f"nonstop.{name} needs torch, which did not import: {_TORCH_ERROR}")
        raise AttributeError(f"module 'nonstop' has no attribute {name!r}")

_TORCH_NAMES = ("Checkpointer", "load", "LoadedCheckpoint", "CheckpointHandle", "export",
                "Preempted", "EXIT_PREEMPTED", "worker_init_fn")

__all__ = [*_TORCH_NAMES, "build_info", "list", "delete", "CheckpointError", "CheckpointIOError",
           "CheckpointMismatchError", "CheckpointNotFoundError", "CorruptCheckpointError",
           "IncompatibleCheckpointError"]
