"""The actions the reactor's policy answers with (``pykv.policy``): what the reactor carries out next."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "Deliver", "Fill", "Finish", "Open", "Read", "Write"]


@dataclass(frozen=True)
class Open:
    """Open the block file of load ``transfer``."""
    transfer: int


@dataclass(frozen=True)
class Read:
    """Read the opened file of ``transfer`` into ``slot``."""
    transfer: int
    slot: int


@dataclass(frozen=True)
class Fill:
    """Ask the producer to put store ``transfer``'s payload into ``slot``."""
    transfer: int
    slot: int


@dataclass(frozen=True)
class Write:
    """Write the filled slot of store ``transfer`` to a temp file and publish it."""
    transfer: int
    slot: int


@dataclass(frozen=True)
class Deliver:
    """Hand these ready loads (transfer, slot) to the consumer as one batch."""
    blocks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Finish:
    """``transfer`` ended (``ok`` or not); its slot is already released."""
    transfer: int
    ok: bool


Action = Open | Read | Fill | Write | Deliver | Finish
