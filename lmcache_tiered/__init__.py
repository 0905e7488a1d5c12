"""lmcache-tiered: striped O_DIRECT io_uring NVMe tiers and warm-up for LMCache."""

__version__ = "0.1.0"
