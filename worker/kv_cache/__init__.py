"""Paged KV cache bookkeeping: which block holds what. Pure Python, no torch."""

from worker.kv_cache.block_pool import BlockPool, KVBlock
from worker.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVBlock", "KVCacheManager"]
