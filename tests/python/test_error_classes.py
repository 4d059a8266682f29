"""The extension raises nonstop.errors' classes, handed to it by the package
at import (_core.register_errors); it imports no Python module itself."""
import pytest

import nonstop
from nonstop import _core, errors


def _missing_dir_error(tmp_path):
    with pytest.raises(Exception) as e:
        _core.JobDir.open_for_read(str(tmp_path / "missing"))
    return e.value


def test_status_errors_are_the_package_classes(tmp_path):
    err = _missing_dir_error(tmp_path)
    assert type(err) is errors.CheckpointNotFoundError
    assert type(err) is nonstop.CheckpointNotFoundError
    assert isinstance(err, FileNotFoundError) and isinstance(err, nonstop.CheckpointError)
    msg = str(err)
    assert msg and "\n" not in msg and "missing" in msg


def test_the_registered_class_is_the_one_raised(tmp_path):
    class Other(Exception):
        pass

    try:
        _core.register_errors({code: Other for code in range(1, 9)})
        err = _missing_dir_error(tmp_path)
        assert type(err) is Other and "missing" in str(err)
    finally:
        _core.register_errors(errors.BY_STATUS_CODE)
    assert type(_missing_dir_error(tmp_path)) is errors.CheckpointNotFoundError


def test_a_bad_registration_is_refused_and_changes_nothing(tmp_path):
    partial = dict(errors.BY_STATUS_CODE)
    del partial[8]
    with pytest.raises(ValueError, match="status code 8"):
        _core.register_errors({code: KeyError for code in partial})
    with pytest.raises(TypeError, match="not an exception class"):
        _core.register_errors({**errors.BY_STATUS_CODE, 2: int})
    assert type(_missing_dir_error(tmp_path)) is errors.CheckpointNotFoundError
