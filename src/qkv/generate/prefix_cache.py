"""Prefix caching for the paged KV cache: full blocks keyed by their tokens and every token
before them, shared read-only between requests (Kwon et al., 2023, "vLLM"; Zheng et al.,
2024, "SGLang").

A block of ``b`` positions that a request filled is *registered* under the SHA-256 chain hash
of the request's tokens up to the block's end (the hash of the block before it, then the
block's ``b`` token ids), so two requests share a block exactly when everything before the
block's end is the same. A new request takes the longest run of registered blocks its prompt
starts with, holds them (a reference count), and computes only the rest; its last prompt
token is always computed, since its logits choose the first new token.

A block no request holds stays registered, *idle*, until the pool runs short: new blocks come
from the free list first, then from the idle blocks least recently used, which are dropped
from the registry as they are taken. A registered block is never written again (requests
write only their own positions past the shared prefix), so sharing cannot change a request's
keys and values.

Shapes: ``b`` block size, ``P`` prompt length.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from qkv.nn.paged_cache import PagedKVCache

__all__ = ["PrefixCache"]


class PrefixCache:
    """The registry of shareable blocks over one :class:`~qkv.nn.paged_cache.PagedKVCache`,
    and the allocator every request's blocks go through.

    Args:
        cache: the paged cache whose free list this manages.
        share: register and share blocks (False: a plain allocator; nothing is shared).

    Attributes:
        hit_tokens: prompt positions read from shared blocks so far.
        queried_tokens: prompt positions of every request so far.
        evicted: idle blocks dropped from the registry to make room.
    """

    def __init__(self, cache: PagedKVCache, share: bool = True) -> None:
        self.cache, self.size, self.share = cache, cache.block_size, share
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # block -> requests holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered, unheld; LRU first
        self.hit_tokens = self.queried_tokens = self.evicted = 0

    def chain(self, tokens: Sequence[int]) -> list[bytes]:
        """The chain hash of each full block of ``tokens``."""
        out, previous = [], b""
        for start in range(0, len(tokens) - self.size + 1, self.size):
            block = ",".join(map(str, tokens[start : start + self.size])).encode()
            previous = hashlib.sha256(previous + b"|" + block).digest()
            out.append(previous)
        return out

    @property
    def available(self) -> int:
        """Blocks a request could be given now: free, or idle (evictable)."""
        return len(self.cache.free) + len(self.idle)

    @property
    def held(self) -> int:
        """Blocks some request holds."""
        return self.cache.num_blocks - self.available

    def acquire(self, prompt: Sequence[int], blocks: int) -> tuple[list[int], int] | None:
        """``blocks`` blocks for a request whose prompt is ``prompt``: the shared ones its
        prompt starts with (all but its last token at most), then new ones.

        Returns:
            ``(table, cached)``: the block table and how many prompt positions it already
            holds; None when the pool has too few blocks now (the caller waits).
        """
        shared: list[int] = []
        for h in self.chain(prompt[: len(prompt) - 1]) if self.share else ():
            block = self.by_hash.get(h)
            if block is None:
                break
            shared.append(block)
        reusable_idle = sum(1 for b in shared if b in self.idle)
        if blocks - len(shared) > self.available - reusable_idle:
            return None
        for b in shared:
            self.idle.pop(b, None)
            self.refs[b] = self.refs.get(b, 0) + 1
        table = shared + [self._take() for _ in range(blocks - len(shared))]
        self.hit_tokens += len(shared) * self.size
        self.queried_tokens += len(prompt)
        return table, len(shared) * self.size

    def _take(self) -> int:
        """A block for one request: free, else the least recently used idle one."""
        if self.cache.free:
            block = self.cache.free.pop()
        else:
            block, _ = self.idle.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
            self.evicted += 1
        self.refs[block] = 1
        return block

    def register(self, table: Sequence[int], tokens: Sequence[int]) -> None:
        """Register the full blocks of ``table`` that hold ``tokens`` (a request's positions
        ``0 .. len(tokens) - 1``, all written); a block whose content another block already
        holds stays private."""
        if not self.share:
            return
        for block, h in zip(table, self.chain(tokens), strict=False):
            if block in self.hash_of or h in self.by_hash:
                continue
            self.by_hash[h], self.hash_of[block] = block, h

    def release(self, table: Sequence[int]) -> None:
        """A request gives its blocks back: registered ones become idle (most recently used
        last), the others free."""
        for block in table:
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            del self.refs[block]
            if block in self.hash_of:
                self.idle[block] = None
            else:
                self.cache.free.append(block)
