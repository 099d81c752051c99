from eaglekv.memory.allocator import SlotAllocator
from eaglekv.memory.kv_pool import KVPool
from eaglekv.memory.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "ReqToTokenPool", "SlotAllocator"]
