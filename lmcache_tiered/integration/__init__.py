"""The faces LMCache and vLLM call: the in-process storage plugin
(:mod:`.backend`), the multi-process server's L2 adapter (:mod:`.mp`) and its
ledger of L1 buffers (:mod:`.l2_ledger`), and the vLLM plugin that forwards
warm-up hints (:mod:`.vllm_plugin`).

Users name two of them by their stable paths, ``lmcache_tiered.backend`` and
``lmcache_tiered.mp``, which re-export from here.

May import: every layer below (cache, warm-up, storage, io, foundation);
nothing imports it but those two paths, the bench, the ops tools and tests.
"""
