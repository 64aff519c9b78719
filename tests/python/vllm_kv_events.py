"""vLLM's KV-event schema, as vLLM declares it (`vllm/distributed/kv_events.py`
after vllm-project/vllm#42892: `EventBatch` array-like, each event a msgspec
struct tagged by `type` and encoded as a map), shared by the tests that
publish or read KV events independently of our Rust code
(`test_kv_events.py`, `test_kv_index.py`, `test_worker_kv_events.py`).
"""

from typing import Any

import msgspec

# The replay stream's end marker: sequence -1 as 8 bytes, big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- vLLM's schema, as vLLM declares it ---------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
