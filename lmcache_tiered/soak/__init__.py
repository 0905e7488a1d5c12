"""``lmcache-tiered soak``: the seed's long stability gate as a command
(:mod:`~lmcache_tiered.soak.command`), its worker process
(:mod:`~lmcache_tiered.soak.worker`) and its verdict
(:mod:`~lmcache_tiered.soak.report`)."""
