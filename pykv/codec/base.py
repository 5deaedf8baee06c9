"""The codec contract: how a block's payload is stored and restored, and how a codec fails.

A codec turns the payload bytes a storage block carries (its ``Geometry.payload_length``,
known from the engine, never read from the stored bytes) into stored bytes and back. Stored
bytes are untrusted: ``decode`` checks every length against the trusted payload length and
raises ``CodecError`` for anything else, never crashes, hangs or allocates more than that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pykv.errors import InputError, PykvError

Buffer = bytes | bytearray | memoryview
"""Any C-contiguous bytes-like object (numpy arrays and CPU tensors' ``numpy()`` included)."""


class CodecError(PykvError):
    """Stored bytes a codec refuses to decode (``reason`` says why), or a payload it cannot
    encode (a length its parameters do not divide, non-finite values for ``fp8``). A refused
    block is a miss: recomputed, never loaded."""

    def __init__(self, codec: str, reason: str) -> None:
        super().__init__(f"codec {codec}: {reason}")
        self.codec = codec
        self.reason = reason


class UnknownCodecError(InputError):
    """A configured codec name that no codec has (one line naming the known ones)."""


def byte_view(buffer: object, *, writable: bool = False) -> memoryview:
    """``buffer`` as a flat memoryview of bytes; ``TypeError`` if it is not contiguous (or not
    writable when ``writable``)."""
    view = memoryview(buffer)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise TypeError("codec buffers must be C-contiguous")
    if writable and view.readonly:
        raise TypeError("the destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Codec(ABC):
    """One way of storing payloads. ``name`` is the configuration name; ``params`` the exact
    encoding (name, format revision and every setting the stored bytes depend on): it goes into
    the block header and the namespace so engines with different codecs never share blocks.
    Settings that change only speed (threads) stay out of ``params``."""

    name: str

    @property
    @abstractmethod
    def params(self) -> str:
        """The encoding's identity, e.g. ``planes-zstd:v1,elem=2,level=1,chunk=1048576``."""

    @abstractmethod
    def encoded_bound(self, payload_len: int) -> int:
        """The most bytes ``encode`` stores for a payload of ``payload_len`` bytes (sizes staging
        slots); ``CodecError`` if this codec cannot encode that length."""

    @abstractmethod
    def encode(self, src: Buffer, out: Buffer | None = None) -> bytes | int:
        """Stored bytes of the payload ``src``: returned as ``bytes``, or written at the start of
        ``out`` (at least ``encoded_bound(len(src))`` bytes) and their count returned."""

    @abstractmethod
    def decode(self, src: Buffer, dst: Buffer) -> None:
        """Restore a payload from stored bytes ``src`` into ``dst``, whose length is the trusted
        payload length; ``CodecError`` for stored bytes that do not decode to exactly that."""

    def decode_bytes(self, src: Buffer, payload_len: int) -> bytes:
        """``decode`` into a new buffer of ``payload_len`` bytes (tests, tools)."""
        out = bytearray(payload_len)
        self.decode(src, out)
        return bytes(out)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.params}>"


def finish(codec: str, stored: memoryview, out: Buffer | None) -> bytes | int:
    """Return ``stored`` as bytes, or copy it into ``out`` and return its length."""
    if out is None:
        return stored.tobytes()
    target = byte_view(out, writable=True)
    if len(target) < len(stored):
        raise CodecError(codec, f"output buffer of {len(target)} bytes is smaller than the "
                                f"{len(stored)} encoded bytes")
    target[:len(stored)] = stored
    return len(stored)
