"""The C++ extension (nonstop._core), loaded once: the one module that
imports it. It raises the package's error classes, which it is handed here
(it imports no Python module itself). A broken or partial build says so on
use (core()), not on import, so that the errors and the command line work."""
from .errors import BY_STATUS_CODE

try:
    from . import _core
    ERROR = None
except ImportError as e:
    _core = None
    ERROR = str(e)
else:
    _core.register_errors(BY_STATUS_CODE)


def core():
    """The extension; ImportError when it did not load."""
    if _core is None:
        raise ImportError(f"nonstop's C++ extension did not load: {ERROR}")
    return _core
