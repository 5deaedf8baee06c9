"""``fp8-zstd`` on the KV's device (``DeviceFp8Zstd``): stores quantized there, loads decoded there.

A store runs ``fp8``'s device step (``device_codec.encode_fp8``: the scales and codes copied into
the slot); the worker then has the codec threads code those bytes with the zstd layer in place
(``CodecStage.recode``). A load copies the stored bytes to the device, decodes every zstd frame
of its step in one call of the frame decoder into rows of fp8 bytes (``DeviceZstdFrames``), then
dequantizes all rows at once and scatters the payloads' pages into the KV blocks. Where nvCOMP is
missing, fails its start check or ``codec_decode`` is ``cpu``, ``DeviceFp8HostZstd`` takes its
place: the codec threads decode the zstd layer of each load (in parallel, beside the reads) into
a scratch buffer, and ``fp8``'s device step loads those bytes (``connector.codecs.device_codec_for``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pykv.codec.fp8 import decode_rows
from pykv.codec.fp8_zstd import Fp8ZstdCodec

from pykv.connector.copier import CopyTask, TorchCopier
from pykv.connector.device_codec import (STEP_BYTES, DeviceFp8, Issued, encode_fp8, largest_fp8_payload,
                                         whole_groups_refusal)
from pykv.connector.device_zstd import DeviceZstdFrames
from pykv.connector.zstd_frames import FrameDecoder


class DeviceFp8Zstd(DeviceZstdFrames):
    """``fp8-zstd`` stores (the fp8 step) and loads on the KV's device; ``payload_lengths``: the raw
    payload length of each KV group's storage blocks (whole groups, else ``InputError`` at start)."""

    name = "fp8-zstd"
    step_bytes = STEP_BYTES * 3 // 4  # its scratch: the payloads and about half as much twice (stored, rows)
    host_layer = True  # stores: the codec threads code the slot's fp8 bytes with ``codec.frames``

    def __init__(self, codec: Fp8ZstdCodec, copier: TorchCopier, payload_lengths: Sequence[int],
                 frames: FrameDecoder | None = None, *, checked: bool = True, authenticated: bool = False,
                 streams: bool | None = None, step_blocks: int | None = None) -> None:
        largest = largest_fp8_payload(codec.fp8, payload_lengths)
        super().__init__(codec.params, codec.frames, copier, largest, codec.inner_length(largest), frames,
                         checked=checked, authenticated=authenticated, streams=streams, step_blocks=step_blocks)
        self.codec = codec

    def raw_refusal(self, params: str, raw_length: int) -> str | None:
        return whole_groups_refusal(raw_length, self.codec.group) or super().raw_refusal(params, raw_length)

    def _encode(self, task: CopyTask) -> Issued:
        return encode_fp8(self, self.codec.fp8, task)

    def _row_length(self, raw: int) -> int:
        return self.codec.inner_length(raw)

    def _from_rows(self, rows: torch.Tensor, payloads: torch.Tensor) -> torch.Tensor:
        return decode_rows(rows, payloads, self.codec.fp8)


class DeviceFp8HostZstd(DeviceFp8):
    """``fp8-zstd`` with its zstd layer on the codec threads both ways: stores are ``fp8``'s device
    step, then ``CodecStage.recode``; loads (``host_frames``) reach this decoder as the fp8 bytes
    the codec threads decoded from the stored bytes (``unlayered`` says how many)."""

    name = "fp8-zstd"
    host_layer = True
    host_frames = True

    def __init__(self, codec: Fp8ZstdCodec, copier: TorchCopier, payload_lengths: Sequence[int], *,
                 streams: bool | None = None, step_blocks: int | None = None) -> None:
        super().__init__(codec.fp8, copier, payload_lengths, streams=streams, step_blocks=step_blocks)
        self.fp8_zstd, self.params, self.layer = codec, codec.params, codec.frames

    def unlayered(self, params: str, raw_length: int) -> int | None:
        """The fp8 bytes under the zstd layer of a block of codec ``params`` and ``raw_length`` raw
        bytes (from the trusted header's length), or None where this engine refuses the block."""
        return None if self.raw_refusal(params, raw_length) else self.fp8_zstd.inner_length(raw_length)
