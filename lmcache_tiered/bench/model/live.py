"""A request in the serving model: what the engine loop
(:mod:`lmcache_tiered.bench.model.serving`) and ``lmcache server``'s road
(:mod:`lmcache_tiered.bench.model.prefetch_road`) know of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Live:
    """A request in the server (times: GPU clock, wall seconds since start)."""

    index: int
    arrival: float
    scheduled: float = 0.0
    loaded: float = 0.0
    #: tier of each chunk the lookup found, in prefix order
    hits: list[str] = field(default_factory=list)
    #: keys of the chunks the lookup found below LMCache's CPU tier
    below_cpu: list[Any] = field(default_factory=list)
    #: prompt tokens vLLM's GPU prefix cache held
    gpu_cached: int = 0
    #: prompt tokens LMCache loaded (past the GPU's share, chunk-aligned)
    loaded_tokens: int = 0
    cached: int = 0
    #: prompt tokens computed so far (cached ones included)
    computed: int = 0
    output_left: int = 0
    first_token: float = 0.0
