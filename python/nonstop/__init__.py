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

try:
    from . import _core  # noqa: E402
    _CORE_ERROR = None
except ImportError as e:  # a broken or partial build: say so on use, not on import
    _core = None
    _CORE_ERROR = str(e)


def build_info() -> dict:
    """What this build of the C++ engine contains."""
    if _core is None:
        raise ImportError(f"nonstop's C++ extension did not load: {_CORE_ERROR}")
    return {"cuda": _core.built_with_cuda()}


def __getattr__(name):
    # The torch-facing parts are imported on first use, so `import nonstop`
    # stays cheap for the CLI and for tools without torch.
    if name in ("Checkpointer", "load", "LoadedCheckpoint"):
        from . import _checkpointer
        return getattr(_checkpointer, name)
    if name in ("Preempted", "EXIT_PREEMPTED"):  # preemption notices: docs/PREEMPTION.md
        from . import _preempt
        return getattr(_preempt, name)
    if name == "export":  # safetensors, or format="dcp" (_dcp.py)
        from ._dcp import export
        return export
    raise AttributeError(f"module 'nonstop' has no attribute {name!r}")


__all__ = ["Checkpointer", "load", "export", "LoadedCheckpoint", "Preempted", "EXIT_PREEMPTED",
           "build_info", "CheckpointError",
           "CheckpointIOError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CorruptCheckpointError", "IncompatibleCheckpointError"]
