"""Exceptions raised by nonstop. Each carries one line that says what failed
and, where possible, what to do. The C++ extension raises these classes,
chosen by the Status code of the failing call."""


class CheckpointError(RuntimeError):
    """Base class of every nonstop error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No such directory, checkpoint or tensor."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes failed a checksum or structural check."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the state: a shape, dtype or name differs,
    or an argument is invalid."""


class IncompatibleCheckpointError(CheckpointError):
    """The directory cannot be used as asked: not a nonstop directory, or
    written by another world size."""


class CheckpointIOError(CheckpointError, OSError):
    """The storage medium failed (EIO, ENOSPC, ...)."""


# Status codes of include/nonstop/status.h -> class.
BY_STATUS_CODE = {
    1: CheckpointMismatchError,   # kInvalidArgument
    2: CheckpointNotFoundError,   # kNotFound
    3: CorruptCheckpointError,    # kCorruption
    4: CheckpointIOError,         # kIOError
    5: IncompatibleCheckpointError,  # kFailedPrecondition
    6: CheckpointError,           # kAborted
    7: CheckpointError,           # kUnavailable
    8: CheckpointError,           # kInternal
}
