from engine.kv.block_manager import BlockManager
from engine.kv.hashing import hash_block, prefix_block_hashes, prefix_routing_keys, routing_key

__all__ = ["BlockManager", "hash_block", "prefix_block_hashes", "prefix_routing_keys", "routing_key"]
