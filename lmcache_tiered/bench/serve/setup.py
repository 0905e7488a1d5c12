"""What a serve-bench variant's servers are started with (one owner for it:
the run and its report both read it)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lmcache_tiered.bench.serve.tiny_model import TinyLlama


class UsageError(ValueError):
    """A setting of the command line is wrong; the message says which."""


@dataclass(frozen=True, slots=True)
class ServeSetup:
    """Everything a variant's servers are started with."""

    model_dir: Path
    model: TinyLlama
    warm: tuple[Path, ...]
    concurrency: int
    #: prompt tokens per step (vLLM's max_num_batched_tokens)
    token_budget: int
    #: vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE): its own prefix cache
    kv_cache_gb: float
    #: LMCache's L1 (CPU) and vLLM's CPU offload tier, the same for all
    l1_gb: float
    warm_gb: float
    max_model_len: int
    logs: Path
    #: cold tier drives (``--cold``; none: warm only) and their capacity
    cold: tuple[Path, ...] = ()
    cold_gb: float = 0.0
    #: what the ``+admit`` variants' read-time admission recomputes at
    #: (``tiered.recompute_tokens_per_s``; None: no such variant)
    recompute_tokens_per_s: float | None = None

    @property
    def kv_cache_tokens(self) -> int:
        return kv_cache_tokens(self.kv_cache_gb, self.model)


def kv_cache_tokens(gb: float, model: TinyLlama) -> int:
    """Tokens of ``model`` that ``gb`` GiB of vLLM's own KV cache hold."""
    return int(gb * 2**30 // model.kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class Drives:
    """One variant's directories on the warm drives and the cold ones."""

    warm: list[Path]
    cold: list[Path]

    @property
    def all(self) -> list[Path]:
        return self.warm + self.cold


@contextmanager
def variant_dirs(name: str, setup: ServeSetup) -> Iterator[Drives]:
    """A fresh subdirectory per drive for one variant, removed afterwards."""

    def fresh(drives: Sequence[Path]) -> list[Path]:
        return [
            Path(tempfile.mkdtemp(prefix=f"serve-bench-{name}-", dir=d)) for d in drives
        ]

    drives = Drives(fresh(setup.warm), fresh(setup.cold))
    try:
        yield drives
    finally:
        for d in drives.all:
            shutil.rmtree(d, ignore_errors=True)


def drive_dirs(
    option: str | None, scratch: Path, flag: str = "--warm"
) -> tuple[Path, ...]:
    """The directories ``flag`` names; none given: one in ``scratch`` for
    warm, none for cold."""
    if not option:
        if flag != "--warm":
            return ()
        default = scratch / "warm"
        default.mkdir()
        return (default,)
    dirs = tuple(Path(p).expanduser().resolve() for p in option.split(",") if p)
    for d in dirs:
        if not d.is_dir():
            raise UsageError(f"{flag}: {d} is not a directory")
    return dirs
