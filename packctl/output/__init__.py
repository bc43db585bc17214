"""The output directory being written: the lock, the partial directory and its journal, shard
bytes (encoded and stitched), and the commit that makes OUT appear whole or not at all."""
