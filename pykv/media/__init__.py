"""Storage media: where block files live (``base.Medium`` is the contract).

A new medium is one new module here plus one line in ``MEDIA``. ``"striped"`` is not a
medium of its own kind but a composition: one leaf medium per device of a ``DeviceSet``.
``build.py`` opens a set's medium by these names (``open_store_medium``).
"""

from __future__ import annotations

from pykv.deviceset import DeviceSet
from pykv.media.base import Medium, OpenSpec, WriteTarget
from pykv.media.posix import PosixMedium
from pykv.media.striped import StripedMedium
from pykv.tree import KVTree

MEDIA: dict[str, type[Medium]] = {
    "posix": PosixMedium,  # over a KVTree; option ``direct``
    "striped": StripedMedium,  # over a DeviceSet; option ``media``: one leaf medium per device
}


def open_medium(name: str, over: KVTree | DeviceSet, **options: object) -> Medium:
    """The medium called ``name`` over ``over`` (``options``: the medium's own, e.g. ``direct``)."""
    try:
        medium = MEDIA[name]
    except KeyError:
        raise ValueError(f"unknown medium {name!r}; one of: {', '.join(sorted(MEDIA))}") from None
    return medium(over, **options)


__all__ = ["MEDIA", "Medium", "OpenSpec", "PosixMedium", "StripedMedium", "WriteTarget", "open_medium"]
