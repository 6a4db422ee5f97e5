"""Prefix block hashes, computed the same way by workers (prefix cache) and gateways (routing).

    block 0            block 1            block 2 (partial: never hashed)
    [t0 .. t15]        [t16 .. t31]       [t32 .. t37]
    h0 = H(salt,       h1 = H(h0,
           tokens0)           tokens1)

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes. The salt
(from the tenant) goes into the root, so two tenants never share a chain.

A worker's request also hashes the blocks of its output tokens, and the first block that holds one
is hashed with the position where the outputs begin: an output token's K/V were computed as a
decode row (attending alone), the same token in a later prompt is computed as a prompt row (in
tiles), with other bits. So a later prompt never hits an answer's blocks (its answer cannot depend
on whether its history was cached), while the request itself, resumed after a preemption, or
another with the same prompt and the same output, does. A gateway hashes prompts only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"tierserve-block-hash-v1"


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    salt: str | None = None,
    outputs_from: int | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (``None`` for the first block); ``outputs_from``:
    the offset in the block of the request's first output token, for the block that holds it."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(_ROOT)
        h.update(b"\x00" if salt is None else b"\x01" + salt.encode())
    else:
        h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if outputs_from is not None:  # a longer input than any prompt block's of this size
        h.update(b"\x02" + struct.pack("<q", outputs_from))
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
    num_prompt_tokens: int | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from ``start_block`` on.

    ``parent`` must be the hash of block ``start_block - 1`` when ``start_block > 0``, so a
    growing sequence hashes each block once. ``num_prompt_tokens``: where a request's output tokens
    begin in ``token_ids`` (None: they are all prompt); the block holding the first is marked.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    # (block, offset in it) of the first output token
    marked = None if num_prompt_tokens is None else divmod(num_prompt_tokens, block_size)
    for i in range(start_block, num_full):
        mark = marked[1] if marked is not None and i == marked[0] else None
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt, mark)
        hashes.append(parent)
    return hashes
