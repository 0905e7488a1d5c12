"""``lmcache-tiered soak --mp`` (issue 51, part 3): a brief run of a real
``lmcache server`` with TieredL2Adapter, driven through LMCache's own
multi-process client under every fault (the server SIGKILLed and restarted on
its directories, a real redis-server stopped, killed and filled, real records
damaged); and the checker's rules, shared with the in-process soak, on a
driver whose reads are made up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_tiered.cli import main
from lmcache_tiered.soak.driver import Driver
from lmcache_tiered.testing import CPUConnector


@pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (.ci/run installs it)",
)
def test_a_brief_mp_soak_under_every_fault_passes(tmp_path: Path) -> None:
    """Two kills of the server, the three store faults and damaged records
    in 60 s: every chunk acknowledged (in warm's files) before a kill is
    served exact by the next server, no wrong byte, the damage is a checksum
    miss, and the samples are the server's."""
    out = tmp_path / "soak.json"
    code = main(
        [
            "soak", "--mp", "--dir", str(tmp_path / "run"), "--json", str(out),
            "--duration", "60s", "--faults", "kill=25s,store=16s,damage=9s",
            "--outage", "5s", "--plot", "none",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["failures"] == [] and code == 0
    assert result["subject"] == "lmcache server"
    kinds = [f["kind"] for f in result["faults"]]
    assert kinds.count("kill") == 2 and result["restarts"] == 2
    store_faults = [f["what"] for f in result["faults"] if f["kind"] == "store"]
    assert [w.split()[0] for w in store_faults] == ["SIGSTOP", "killed,", "full,"]
    assert result["deaths"] == [] and result["stopped_in_s"] is not None
    # acknowledged means found in warm's files under the server's own keys:
    # the restarted servers served them back, every byte compared
    assert result["acked"] > 20 and result["checked_chunks"] > 20
    assert result["wrong_chunks"] == 0 and result["lost_chunks"] == 0
    assert result["damaged"] >= 1 and result["corrupt_seen"] >= 1
    # an lmcache server: hundreds of MiB, dozens of threads (the client is
    # a separate process, not sampled)
    assert all(s["rss"] > 200 << 20 and s["threads"] > 10 for s in result["samples"])


class MadeUp(Driver):
    """A driver whose reads serve what the test says: the rules alone."""

    def __init__(self, served: dict[int, tuple[int, int]]) -> None:
        super().__init__(
            {"conversations": {"count": 4, "blocks": 4, "seed": 0}, "first_request": 0}
        )
        self.connector = CPUConnector(2, 2, 64, torch.bfloat16)
        self.served = served
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.lines.append((kind, fields))

    def read(self, conversation: int, depth: int) -> tuple[int, int]:
        return self.served[conversation]

    def write(self, conversation: int, depth: int) -> bool:
        raise AssertionError("not asked")

    def damage(self, acked: dict[str, int]) -> None:
        raise AssertionError("not asked")

    def state(self) -> dict[str, Any]:
        return {}

    def where(self, conversation: int, depth: int, chunk: int) -> str:
        return f"tier-of-{conversation}/{chunk}"

    def close(self) -> None:
        pass


def test_a_restarted_driver_counts_losses_wrong_chunks_and_damage_allowances() -> None:
    """Two chunks (256 tokens) per 512-token block. Conversation 1 is served
    4 of its 6 chunks: 2 lost. Conversation 2's last chunk was damaged at
    its acknowledged depth: 3 of 4 served is whole. Conversation 0's chunk
    with a wrong byte counts as wrong, never as served right."""
    driver = MadeUp({0: (4, 1), 1: (4, 0), 2: (3, 0)})
    driver.verify({"0": 2, "1": 3, "2": 2}, damaged={"2": 2})
    ((kind, ready),) = driver.lines
    assert kind == "ready"
    assert ready["checked_chunks"] == 11
    assert ready["lost_chunks"] == 2
    assert ready["wrong_chunks"] == 1
    assert ready["lost_conversations"] == [
        "1: chunks 4-5 of 6, the first in tier-of-1/4"
    ]


def test_a_chunk_is_served_only_where_hit_and_wrong_on_one_flipped_byte() -> None:
    """``served_chunks`` compares every byte of each hit chunk with what was
    stored for its tokens; a chunk the read did not hit is not served."""
    driver = MadeUp({})
    kv = driver.kv(3, 2)  # 1024 tokens: 4 chunks
    hit = torch.zeros(1024, dtype=torch.bool)
    hit[:768] = True  # a 3-chunk prefix
    assert driver.served_chunks(kv, hit, 3, 2) == (3, 0)
    kv[1, 0, 300, 1, 7] += 1  # one element of chunk 1 (tokens 256-511)
    assert driver.served_chunks(kv, hit, 3, 2) == (3, 1)
    # checked as another conversation's: chunk 0 (the shared opening block)
    # is right, chunk 1 is the flipped one, chunk 2 is another's bytes
    assert driver.served_chunks(kv, hit, 2, 2) == (3, 2)
