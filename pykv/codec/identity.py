"""``none``: the payload stored as it is (the format before codecs)."""

from __future__ import annotations

from pykv.codec.base import Buffer, Codec, CodecError, byte_view, finish


class IdentityCodec(Codec):
    """Stores the payload's bytes unchanged; decoding checks only the length."""

    name = "none"

    @property
    def params(self) -> str:
        return "none"

    def encoded_bound(self, payload_len: int) -> int:
        return payload_len

    def encode(self, src: Buffer, out: Buffer | None = None) -> bytes | int:
        return finish(self.name, byte_view(src), out)

    def decode(self, src: Buffer, dst: Buffer) -> None:
        stored, target = byte_view(src), byte_view(dst, writable=True)
        if len(stored) != len(target):
            raise CodecError(self.name, f"{len(stored)} stored bytes for a payload of {len(target)}")
        target[:] = stored
