"""The context cache as a system: stable block identity (block_hash.py), the bytes of one KV block across
every layer's pool (block_io.py), and the disk tier that keeps blocks across restarts (disk_store.py).
The RAM tier is the engine's own pool (engine/block_manager.py), which keys its blocks on the same ids."""
