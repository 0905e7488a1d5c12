"""The benchmarks: tools above the core, one sub-package per product.

- :mod:`~lmcache_tiered.bench.model`: the measurement model
  (``lmcache-tiered bench``): a workload replayed through the real LMCache
  engine and real I/O, the GPU and the drives modelled;
- :mod:`~lmcache_tiered.bench.serve`: the real-server benchmark
  (``lmcache-tiered serve-bench``): vLLM and ``lmcache server`` over HTTP,
  with the model's prediction of the same run beside it;
- :mod:`~lmcache_tiered.bench.disk`: the disk benchmark
  (``lmcache-tiered diskbench``): cold-read bandwidth of every way to store KV;
- :mod:`~lmcache_tiered.bench.common`: what they share (workload traces,
  tables, pictures, progress).

Each product imports ``common`` and the core; ``serve`` also runs ``model``
beside a real server. The command lines in :mod:`lmcache_tiered.cli` import
these, never the reverse.
"""
