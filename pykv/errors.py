"""Exceptions raised by the pykv core. Each names the path or field at fault."""

from __future__ import annotations


class PykvError(Exception):
    """Base class of every pykv error."""


class FormatError(PykvError):
    """A cache file's header or payload is not what format v1 allows."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class ChecksumError(FormatError):
    """The header or payload checksum does not match the bytes read."""


class NotATreeError(PykvError):
    """A directory lacks the ``pykv-tree.json`` marker or the marker is invalid."""


class InputError(PykvError):
    """A user-supplied value (size, depth, duration, config key) cannot be used."""
