"""The vLLM names pykv uses, and which version-dependent ones this vLLM has (0.26 to 0.33).

Imported by ``compat_metrics`` and ``compat_adapters`` and re-exported by ``pykv.connector.compat``,
which the rest of pykv imports instead. The version table is in ``compat``'s docstring.
"""

from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: F401
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: F401  (re-exported)
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import (  # noqa: F401  (re-exported)
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: F401

VLLM_VERSION: str = vllm.__version__

# 33+: the scheduler calls ``on_reset_flushed`` once workers reported every job in flight at a reset.
HAS_RESET_FLUSHED = hasattr(OffloadingManager, "on_reset_flushed")
SYNC_LOAD_KEY = "sync_load_budget_bytes"


def _minor(version: str) -> int:
    parts = version.split(".")
    try:
        return int(parts[1])
    except (IndexError, ValueError):
        return 0


VLLM_MINOR = _minor(VLLM_VERSION)

try:  # 27+: an enum; 26: plain strings (vllm.distributed.kv_events.MEDIUM_*)
    from vllm.v1.kv_offload.base import Medium
    STORAGE_MEDIUM: Any = Medium.STORAGE
except ImportError:  # pragma: no cover - 0.26
    STORAGE_MEDIUM = "STORAGE"

DEFAULT_OFFLOAD_POLICY = getattr(OffloadPolicy, "CHUNK_LEVEL", None) or getattr(OffloadPolicy, "BLOCK_LEVEL")

try:  # gauges on the offload metrics route (with OffloadingConnectorStats.set_gauge)
    from vllm.v1.kv_offload.base import OffloadingGaugeMetadata
except ImportError:  # pragma: no cover - a vLLM whose specs export counters only
    OffloadingGaugeMetadata = None  # type: ignore[assignment,misc]
HAS_OFFLOAD_GAUGES = OffloadingGaugeMetadata is not None and hasattr(OffloadingConnectorStats, "set_gauge")

try:  # 30+: request-level failure reporting
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    HAS_TRANSFER_RESULTS = True
except ImportError:  # pragma: no cover - 0.26 to 0.29
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]
    HAS_TRANSFER_RESULTS = False
