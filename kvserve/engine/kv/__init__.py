"""The KV manager and its tiers: the pool's blocks and block tables (manager), the KV groups a model's layers share
(groups), who may keep cached blocks (eviction), and the lower tiers behind `LowerTier` (host memory, disk).
Pure: block ids, token counts and byte buffers; no torch."""
