"""The disk benchmark (``lmcache-tiered diskbench``): every way to store KV
chunks, ours and LMCache's, stored and read back cold on the same drives."""
