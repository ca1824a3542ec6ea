"""Where caches live: the block store (safetensors blocks + a versioned SQLite index on
local disk) and the block pool in front of it (an in-memory tier under a byte budget)."""
