"""Failure routing as values: which failed step means corrupt, refused stores or a quiet log line."""

from __future__ import annotations

import errno

import pytest

from pykv.failures import BlockFailure, Step, os_failure

STORE_STEPS = {Step.MKDIR, Step.OPEN_FOR_WRITE, Step.WRITE, Step.FSYNC, Step.PUBLISH}


@pytest.mark.parametrize("step", list(Step))
def test_only_a_failed_check_or_authentication_is_corruption(step):
    assert BlockFailure(step, errno.EIO).corrupt is (step in (Step.CHECK, Step.AUTH))


@pytest.mark.parametrize("step", list(Step))
def test_only_store_steps_on_the_medium_refuse_stores(step):
    """A fill or copy failure is the engine's, a load step's failure is not the medium refusing stores."""
    assert BlockFailure(step, errno.ENOSPC).medium_refuses_stores is (step in STORE_STEPS)


@pytest.mark.parametrize("code, expected", [(errno.ENOENT, True), (errno.ENOSPC, True), (errno.EROFS, True),
                                            (errno.EACCES, True), (errno.EDQUOT, True), (errno.EPERM, True),
                                            (errno.EIO, False), (errno.ELOOP, False), (None, False)])
def test_expected_comes_from_the_errno_not_the_message(code, expected):
    assert BlockFailure(Step.OPEN, code, detail="whatever the message says").expected is expected


def test_os_failure_takes_a_negative_completion_result_or_an_oserror():
    from_result = os_failure(Step.READ, -errno.EIO)
    from_error = os_failure(Step.MKDIR, PermissionError(errno.EACCES, "Permission denied"))
    assert (from_result.step, from_result.errno) == (Step.READ, errno.EIO)
    assert (from_error.step, from_error.errno, str(from_error)) == (Step.MKDIR, errno.EACCES,
                                                                     "mkdir: Permission denied")
    assert str(BlockFailure(Step.COPY)) == "copy: failed"
