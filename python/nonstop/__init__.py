"""nonstop: checkpoints every few iterations without stalling training."""

__version__ = "0.1.0"

from . import _core  # noqa: E402


def build_info() -> dict:
    """What this build of the C++ engine contains."""
    return {"cuda": _core.built_with_cuda()}
