"""Prefix block hashes, computed the same way by workers (prefix cache) and gateways (routing).

    block 0            block 1            block 2 (partial: never hashed)
    [t0 .. t15]        [t16 .. t31]       [t32 .. t37]
    h0 = H(salt,       h1 = H(h0,
           tokens0)           tokens1)

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes. The salt
(from the tenant) goes into the root, so two tenants never share a chain.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"tierserve-block-hash-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """Hash one full block given its parent's hash (``None`` for the first block)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(_ROOT)
        h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    else:
        h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from ``start_block`` on.

    ``parent`` must be the hash of block ``start_block - 1`` when ``start_block > 0``, so a
    growing sequence hashes each block once.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
