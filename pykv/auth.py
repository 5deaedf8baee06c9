"""Authenticated blocks: the key file of ``auth_key_file`` and the keyed BLAKE3 MAC of a block.

The key file is text, one key per line: ``KEY_ID HEX`` with a key id of 1..16 letters, digits,
``.``, ``_`` or ``-`` and 64 hex digits (32 key bytes); blank lines and lines starting with ``#``
are ignored. The first key signs new blocks (the write key); every key listed verifies (the
read keys), so a key rotates by putting the new one first and removing the old one once its
blocks are gone. The file must be a regular file that neither group nor others may read.

A signed block (header version 2, ``pykv.format``) carries its key id and the MAC of its header
bytes 0..175 followed by its payload; a signed coded block (version 4) the MAC of bytes 0..175,
its codec field 208..463 and its stored payload (``pykv.format.signed_parts``). A reader with a
key ring accepts a block only when that MAC verifies under the key its id names: an unsigned
block, one of a key id not in the ring and one whose MAC differs are all refused (``AuthStatus``).
The key bytes appear in no message, log line or ``repr``: only the file's path and the key ids do.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import os
import stat
from dataclasses import dataclass, field
from typing import Mapping

import blake3

from pykv.errors import InputError, PykvError
from pykv.format import MAC_BYTES, MAC_FIELD, BlockHeader, signed_parts, valid_key_id

KEY_BYTES = 32
MAX_KEYS = 64
MAX_KEY_FILE_BYTES = 64 << 10
HASH_THREADS = blake3.blake3.AUTO
"""By default a block's MAC is hashed on blake3's own thread pool (all cores), so a few verifier
threads keep up with several devices' reads and the last block of a load is hashed soonest;
``KeyRing.hash_threads`` (config ``mac_threads``) bounds it."""


class KeyFileError(InputError):
    """The key file cannot be used: unreadable, readable by others, or malformed (never quoted)."""

    def __init__(self, path: object, reason: str, field: str = "auth_key_file") -> None:
        super().__init__(f"{field} {path}: {reason}")
        self.path = path
        self.reason = reason


class AuthStatus(enum.Enum):
    """What a key ring says of one block."""

    VALID = "signed"  # signed with a key of the ring, MAC verified
    UNSIGNED = "unsigned"  # a v1 block: no MAC at all
    UNKNOWN_KEY = "foreign-key"  # signed with a key id the ring does not hold
    BAD_MAC = "bad-mac"  # a key the ring holds, and the MAC differs: forged or damaged

    @property
    def reason(self) -> str:
        return _REASONS[self]


_REASONS = {AuthStatus.VALID: "MAC verified", AuthStatus.UNSIGNED: "unsigned block (a key is required)",
            AuthStatus.UNKNOWN_KEY: "signed with a key id not in the key file",
            AuthStatus.BAD_MAC: "MAC mismatch"}


class AuthError(PykvError):
    """A block that a key ring refuses (``status``), naming the file."""

    def __init__(self, path: object, status: AuthStatus) -> None:
        super().__init__(f"{path}: {status.reason}")
        self.path = path
        self.status = status
        self.reason = status.reason


@dataclass(frozen=True, repr=False)
class KeyRing:
    """The keys of a key file: ``write_id`` signs, every key verifies. ``repr`` shows ids only."""

    path: str
    write_id: bytes
    _keys: Mapping[bytes, bytes] = field(compare=False)
    hash_threads: int = HASH_THREADS  # threads hashing one block's MAC (blake3's max_threads)

    def with_hash_threads(self, threads: int) -> "KeyRing":
        """This ring hashing each MAC on ``threads`` threads (0: blake3's pool over all cores)."""
        return dataclasses.replace(self, hash_threads=threads or HASH_THREADS)

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(key_id.decode() for key_id in self._keys)

    def __repr__(self) -> str:
        return f"KeyRing({self.path!r}, write={self.write_id.decode()!r}, read={list(self.key_ids)!r})"

    __str__ = __repr__

    def holds(self, header: BlockHeader) -> bool:
        """Whether ``header`` is signed with a key id of the ring (its MAC not checked: ``check`` does)."""
        return header.signed and header.key_id in self._keys

    def hasher(self, header: BlockHeader, head: bytes | memoryview) -> "blake3.blake3 | AuthStatus":
        """A keyed hasher fed the header's signed bytes (``head``: the encoded header), ready for the
        payload; or the status that makes hashing moot (``UNSIGNED``, ``UNKNOWN_KEY``)."""
        if not header.signed:
            return AuthStatus.UNSIGNED
        key = self._keys.get(header.key_id)
        if key is None:
            return AuthStatus.UNKNOWN_KEY
        hasher = blake3.blake3(key=key, max_threads=self.hash_threads)
        for part in signed_parts(head):
            hasher.update(part)
        return hasher

    def signing_hasher(self, head: bytes | memoryview) -> "blake3.blake3":
        """A hasher of the write key fed ``head``'s signed bytes (a header encoded with ``write_id``)."""
        hasher = blake3.blake3(key=self._keys[self.write_id], max_threads=self.hash_threads)
        for part in signed_parts(head):
            hasher.update(part)
        return hasher


def verdict(hasher: "blake3.blake3 | AuthStatus", header: BlockHeader) -> AuthStatus:
    """The status once the whole payload went into ``hasher`` (from ``KeyRing.hasher``)."""
    if isinstance(hasher, AuthStatus):
        return hasher
    return AuthStatus.VALID if hmac.compare_digest(hasher.digest(), header.mac) else AuthStatus.BAD_MAC


def check(ring: KeyRing, header: BlockHeader, head: bytes | memoryview, payload: bytes | memoryview) -> AuthStatus:
    """The ring's status of a block: ``head`` its encoded header, ``payload`` its (unpadded) payload."""
    hasher = ring.hasher(header, head)
    if not isinstance(hasher, AuthStatus):
        hasher.update(memoryview(payload)[:header.payload_length])
    return verdict(hasher, header)


def authenticate(ring: KeyRing, header: BlockHeader, head: bytes | memoryview, payload: bytes | memoryview,
                 *, path: object = "<buffer>") -> None:
    """Raise ``AuthError`` unless the block is signed with a key of ``ring`` and its MAC verifies."""
    status = check(ring, header, head, payload)
    if status is not AuthStatus.VALID:
        raise AuthError(path, status)


def sign(ring: KeyRing, head: bytearray | memoryview, payload: bytes | memoryview) -> bytes:
    """Write the MAC into ``head`` (a header encoded with ``ring.write_id``) and return it."""
    hasher = ring.signing_hasher(head)
    hasher.update(payload)
    mac = hasher.digest()
    memoryview(head).cast("B")[MAC_FIELD] = mac
    return mac


def load_key_ring(path: str | os.PathLike[str], *, field: str = "kv_connector_extra_config.auth_key_file") -> KeyRing:
    """Read the key file at ``path``; ``KeyFileError`` (naming ``field``, the file and the line, never
    its text) if it cannot serve."""
    where = os.fspath(path)
    try:
        return _load(where)
    except KeyFileError as exc:
        raise KeyFileError(where, exc.reason, field) from None


def _load(where: str) -> KeyRing:
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(where, f"cannot open ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(where, "not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(where, f"mode {stat.S_IMODE(st.st_mode):04o} lets group or others read it; "
                                      "chmod 600 (owner only)")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(where, f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(where, f"larger than {MAX_KEY_FILE_BYTES} bytes: not a key file")
    return KeyRing(where, *_parse(where, data))


def _parse(where: str, data: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    keys: dict[bytes, bytes] = {}
    for number, line in enumerate(data.split(b"\n"), start=1):
        line = line.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not valid_key_id(parts[0]):
            raise KeyFileError(where, f"line {number}: expected KEY_ID HEX (key id: 1..16 letters, digits, "
                                      "'.', '_' or '-')")
        key_id, text = parts
        try:
            key = bytes.fromhex(text.decode("ascii"))
        except ValueError:
            key = b""
        if len(key) != KEY_BYTES:
            raise KeyFileError(where, f"line {number}: key {key_id.decode()} is not {2 * KEY_BYTES} hex digits")
        if key_id in keys:
            raise KeyFileError(where, f"line {number}: key id {key_id.decode()} given twice")
        keys[key_id] = key
        if len(keys) > MAX_KEYS:
            raise KeyFileError(where, f"more than {MAX_KEYS} keys")
    if not keys:
        raise KeyFileError(where, "no key (expected lines of KEY_ID HEX, the first one signs)")
    return next(iter(keys)), keys


def write_key_file(path: str | os.PathLike[str], keys: Mapping[str, bytes]) -> None:
    """Create a key file (mode 0600, refusing to replace one) with ``keys`` in order: the first signs."""
    lines = ["# pykv auth keys: KEY_ID HEX; the first key signs, every key verifies"]
    for key_id, key in keys.items():
        if not valid_key_id(key_id.encode()) or len(key) != KEY_BYTES:
            raise ValueError(f"key {key_id!r}: the id must be 1..16 of [A-Za-z0-9._-] and the key {KEY_BYTES} bytes")
        lines.append(f"{key_id} {key.hex()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")


assert MAC_BYTES == blake3.blake3.digest_size
