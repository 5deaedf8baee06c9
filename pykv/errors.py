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


class RootError(InputError):
    """A root that is not an existing directory. pykv never creates one (``pykv init`` does, on
    request): a device that did not mount must not become an empty directory on another disk."""


class NestedTreeError(RootError):
    """A directory inside an existing tree (a namespace, shard or state directory): never a root."""


class MembershipError(InputError):
    """Devices that cannot form one set: a marker copied over another device's tree, or a device
    whose ``.pykv/set.json`` shows it serves in another set (``pykv.membership``)."""


class UnsafePathError(PykvError, OSError):
    """A name or file pykv will not act on: not one path component, outside the root, not a
    regular file, or larger than its kind allows. An ``OSError`` too, so callers that already
    handle a failed open or rename handle it the same way."""


class NotEmptyRootError(NotATreeError):
    """A directory that holds files but no tree marker: pykv will not make it a tree."""
