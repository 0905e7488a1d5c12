"""lmcache-tiered: striped O_DIRECT io_uring NVMe tiers and warm-up for LMCache.

Its layers, each importing only those below it:

- foundation: ``config`` (the settings), ``keys``, ``metrics``, ``_lmcache``
  (every reach into LMCache's moved and private names);
- :mod:`.io`: the I/O engines (io_uring, threads);
- :mod:`.storage`: one tier's records on disk or in a store;
- :mod:`.warmup`: policies that plan promotions, and the promoter;
- :mod:`.cache`: the tiers composed into one cache;
- :mod:`.integration`: the faces LMCache and vLLM call (``backend`` and
  ``mp`` at the top are their stable paths);
- then the tools: :mod:`.bench`, :mod:`.ops`, :mod:`.soak`, :mod:`.cli`,
  :mod:`.testing`.
"""

__version__ = "0.1.0"
