"""pykv: an external KV cache for vLLM on NVMe SSDs and shared filesystems."""

__version__ = "0.1.0"
