"""What ``lmcache-tiered diskbench`` reports: its placements' figures, the
medians and paired ratios of them, and the table with the multi-process
contenders' comparison and goals.

May touch: nothing (numbers in, text out).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from lmcache_tiered.bench.common import report
from lmcache_tiered.bench.disk.mpbench import OURS
from lmcache_tiered.storage.layout import payload_checksum

#: Every in-process contender's name (its JSON fields are ``<name>_read_gbps``,
#: ``<name>_cpu_s_per_gb``, ``<name>_write_gbps``) and its row in the table.
CONTENDERS = {
    "lmcache_local_disk": "LMCache LocalDiskBackend (O_DIRECT)",
    "rust_raw_block": "LMCache RustRawBlockBackend",
    "tiered": "TieredBackend",
}
#: the project's goals against LMCache's multi-process adapters: reads over
#: bandwidth-capped drives vs the best on one drive and the best over all of
#: them; at RAM speed at least par, at most one checksum pass more CPU; writes
#: at least par everywhere
CAPPED_VS_ONE, CAPPED_VS_MANY, UNCAPPED_VS_BEST, WRITE_VS_BEST = 3.0, 1.5, 1.0, 1.0
#: A contender whose write GB/s moved more than this between placements wrote
#: at a pace set by something other than its drives: on drives in a VM's RAM,
#: the host handing the VM memory (0.1-0.5 GB/s here once a fresh rig has used
#: what the VM held, against 2-4 GB/s before; docs/diskbench.md)
UNSTEADY_WRITES = 2.0


@dataclass
class Placement:
    """One fresh set of files for every contender, and its rounds."""

    fill_order: list[str]
    ceiling_gbps: list[float] = field(default_factory=list)
    read_gbps: dict[str, list[float]] = field(default_factory=dict)
    #: storage bytes read per byte served, per contender and round
    disk_share: dict[str, list[float]] = field(default_factory=dict)
    #: CPU seconds per GB read, per contender and round
    cpu_s_per_gb: dict[str, list[float]] = field(default_factory=dict)
    write_gbps: dict[str, float] = field(default_factory=dict)
    #: the multi-process contenders (``--mp``): what each is, and its restart
    mp: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: why LMCache's raw_block adapter is not among them, if it is not
    mp_unavailable: str | None = None

    def record(self, name: str, gbps: float, cpu_s_per_gb: float) -> None:
        """One contender's cold read in the next round."""
        self.read_gbps.setdefault(name, []).append(gbps)
        self.cpu_s_per_gb.setdefault(name, []).append(cpu_s_per_gb)


def paired_median(
    placements: list[Placement], over: str, under: str | None = None
) -> float | None:
    """Median over all rounds of ``over``'s GB/s divided by ``under``'s (or
    the ceiling's) in the same round."""
    ratios: list[float] = []
    for p in placements:
        base = p.ceiling_gbps if under is None else p.read_gbps.get(under)
        if over in p.read_gbps and base:
            ratios += [a / b for a, b in zip(p.read_gbps[over], base, strict=True)]
    return statistics.median(ratios) if ratios else None


def median_of(placements: list[Placement], name: str, what: str) -> float | None:
    """Median of a contender's per-round figures (or per-placement writes)."""
    samples: list[float] = []
    for p in placements:
        value = getattr(p, what).get(name)
        if value is not None:
            samples += value if isinstance(value, list) else [value]
    return statistics.median(samples) if samples else None


def unsteady_writes(placements: list[Placement]) -> dict[str, list[float]]:
    """Each contender whose write GB/s moved more than
    :data:`UNSTEADY_WRITES` x between placements: its lowest and highest."""
    spans: dict[str, list[float]] = {}
    for name in sorted({n for p in placements for n in p.write_gbps}):
        figures = [p.write_gbps[name] for p in placements if name in p.write_gbps]
        if min(figures) * UNSTEADY_WRITES < max(figures):
            spans[name] = [min(figures), max(figures)]
    return spans


def checksum_s_per_gb(nbytes: int = 256 << 20) -> float:
    """CPU seconds one CRC32C pass (the tier's payload checksum) takes per GB
    here: the CPU our adapter may spend beyond LMCache's."""
    data = memoryview(bytearray(nbytes))
    payload_checksum(data)  # warm
    start = time.process_time()
    payload_checksum(data)
    return (time.process_time() - start) / (nbytes / 1e9)


def mp_result(
    placements: list[Placement], capped: bool, unsteady: Collection[str] = ()
) -> dict[str, Any]:
    """The multi-process contenders' medians, paired ratios and goals (those
    for capped drives judged only if ``capped``, the others only if not; the
    write goal not where a side's writes are ``unsteady``)."""
    described: dict[str, dict[str, Any]] = {}
    for p in placements:
        for name, info in p.mp.items():
            lost = described.get(name, {}).get("restart") == "lost"
            described[name] = info | ({"restart": "lost"} if lost else {})
    contenders = {
        name: info
        | {
            "read_gbps": median_of(placements, name, "read_gbps"),
            "cpu_s_per_gb": median_of(placements, name, "cpu_s_per_gb"),
            "write_gbps": median_of(placements, name, "write_gbps"),
        }
        for name, info in described.items()
    }
    ratios = {
        f"{OURS}_vs_{name}": paired_median(placements, OURS, name)
        for name in [*contenders, "tiered"]
        if name != OURS
    }
    checksum = checksum_s_per_gb()
    return {
        "mp": contenders,
        "mp_raw_block_unavailable": placements[0].mp_unavailable,
        "mp_paired_ratios": ratios,
        "mp_goals": goals(contenders, ratios, checksum, capped, unsteady),
        "checksum_s_per_gb": checksum,
        "reads_capped": capped,
    }


def goals(
    contenders: dict[str, dict[str, Any]],
    ratios: dict[str, float | None],
    checksum: float,
    capped: bool,
    unsteady: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Ours against the best LMCache configuration of each kind a release
    offers (best: the highest median read GB/s; lowest CPU for the CPU goal);
    each goal is ``judged`` only on the drives it is set for, the write goal
    only where neither side's writes are in ``unsteady``."""
    ours = contenders.get(OURS)
    theirs = {
        name: info
        for name, info in contenders.items()
        if name != OURS
        and info["released"]
        and not info.get("store")  # a cold tier's store, not a disk adapter
        and info["read_gbps"] is not None
    }
    if ours is None or ours["read_gbps"] is None or not theirs:
        return []

    def fastest(adapters: str) -> str | None:
        names = [
            n
            for n, info in theirs.items()
            if adapters == "any" or (info["adapters"] == 1) == (adapters == "one")
        ]
        return max(names, key=lambda n: theirs[n]["read_gbps"], default=None)

    out: list[dict[str, Any]] = []
    for adapters, goal, where in [
        ("one", CAPPED_VS_ONE, "capped drives"),
        ("many", CAPPED_VS_MANY, "capped drives"),
        ("any", UNCAPPED_VS_BEST, "uncapped"),
    ]:
        name = fastest(adapters)
        ratio = None if name is None else ratios.get(f"{OURS}_vs_{name}")
        if name is not None and ratio is not None:
            out.append(_goal("read", name, theirs, ratio, goal, where, "x"))
    thrifty = min(theirs, key=lambda n: theirs[n]["cpu_s_per_gb"])
    extra = ours["cpu_s_per_gb"] - theirs[thrifty]["cpu_s_per_gb"]
    out.append(_goal("read CPU", thrifty, theirs, extra, checksum, "uncapped", "+"))
    writers = [n for n in theirs if theirs[n]["write_gbps"]]
    if writers and ours["write_gbps"]:
        best = max(writers, key=lambda n: theirs[n]["write_gbps"])
        ratio = ours["write_gbps"] / theirs[best]["write_gbps"]
        out.append(_goal("write", best, theirs, ratio, WRITE_VS_BEST, "both", "x"))
    for each in out:
        each["judged"] = each["on"] == "both" or (each["on"] != "uncapped") == capped
        if each["what"] == "write" and {OURS, each["against"]} & set(unsteady):
            each["judged"], each["unsteady"] = False, True
    return out


def _goal(
    what: str,
    name: str,
    theirs: dict[str, dict[str, Any]],
    value: float,
    goal: float,
    where: str,
    kind: str,
) -> dict[str, Any]:
    met = value <= goal if kind == "+" else value >= goal
    return {
        "what": what,
        "against": name,
        "label": theirs[name]["label"],
        "value": value,
        "goal": goal,
        "kind": kind,
        "on": where,
        "met": met,
    }


def table(result: dict[str, Any]) -> str:
    """The table of every contender, then the paired ratios and goals."""
    ceiling_gbps = result["device_ceiling_gbps"]
    out = report.numbers_table(
        "path", "read GB/s", "x ceiling", "read CPU s/GB", "write GB/s", "restart"
    )
    in_memory = result["in_memory_filesystems"]
    ceiling = f"memory ({', '.join(in_memory)}: no device)" if in_memory else "device"
    out.add_row(
        f"{ceiling} ceiling ({result['device_ceiling_method']})",
        f"{ceiling_gbps:.2f}",
        "1.00",
        "",
        "",
        "",
    )

    def cell(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    def row(label: str, info: dict[str, Any], restart: str = "") -> None:
        gbps = info["read_gbps"]
        out.add_row(
            label,
            cell(gbps),
            "" if gbps is None else f"{gbps / ceiling_gbps:.2f}",
            cell(info["cpu_s_per_gb"], 3),
            cell(info["write_gbps"]),
            restart,
        )

    for name, label in CONTENDERS.items():
        if name == "tiered":
            label += f" ({result['io_engine']})"
        fields = ("read_gbps", "cpu_s_per_gb", "write_gbps")
        row(label, {f: result[f"{name}_{f}"] for f in fields})
    for info in result.get("mp", {}).values():
        row(info["label"], info, info["restart"])
    lines = [
        f"{result['chunks']} chunks of {result['chunk_mb']} MiB on "
        f"{', '.join(result['paths'])}; median of {result['rounds']} cold rounds "
        f"on each of {result['placements']} placements (fresh files)",
        report.render(out),
    ]
    if in_memory:
        lines.append(
            f"note: the paths are on {', '.join(in_memory)}, in memory: O_DIRECT "
            "reaches no device there, so every figure is memory's speed, not a "
            "drive's; give --paths on the drives to measure"
        )
    for name, (low, high) in result["unsteady_writes"].items():
        lines.append(
            f"note: {name} wrote {low:.2f} to {high:.2f} GB/s in different placements: "
            "not its drives' pace; on drives in a VM's RAM, write each drive through "
            "once before measuring (docs/diskbench.md)"
        )
    for info in result.get("mp", {}).values():
        if info.get("store"):
            lines.append(
                f"note: {info['label']}: the figures of a store on this host, reached "
                "over loopback and held in memory: no drive, no NIC, no RDMA; a "
                "remote store adds its network's"
            )
    cached = {n: share for n, share in result["disk_share"].items() if share < 0.95}
    for name, share in cached.items():
        lines.append(
            f"note: {name} read {share:.0%} of the bytes it served from storage "
            "(the rest came from a cache): its figure is not the drives'"
        )
    for name, label in [
        ("rust_raw_block", "RustRawBlockBackend"),
        ("mp_raw_block", "LMCache raw_block adapter"),
    ]:
        why = result.get(f"{name}_unavailable")
        if why:
            lines.append(f"{label} n/a: {why}")
    names = {
        "tiered_vs_ceiling": "ceiling",
        "tiered_vs_local_disk": "LocalDiskBackend",
        "tiered_vs_rust_raw_block": "RustRawBlockBackend",
    }
    ratios = result["paired_ratios"]
    lines.append(
        "TieredBackend / "
        + ", / ".join(
            f"{label} {ratios[k]:.2f}x"
            for k, label in names.items()
            if ratios[k] is not None
        )
        + " (medians of per-round ratios: the two read in the same round, on "
        "the same drives' state; they can differ from the ratio of the table's "
        "medians, which come from different rounds, when rounds vary more than "
        "the two differ)"
    )
    if "mp" in result:
        lines += mp_lines(result)
    return "\n".join(lines)


def mp_lines(result: dict[str, Any]) -> list[str]:
    """The multi-process comparison: paired ratios, then the goals."""
    labels = {name: info["label"] for name, info in result["mp"].items()}
    labels["tiered"] = "TieredBackend"
    shown = [
        f"{labels[name]} {value:.2f}x"
        for name in labels
        if (value := result["mp_paired_ratios"].get(f"{OURS}_vs_{name}")) is not None
    ]
    lines = [
        "TieredL2Adapter / each, read (median of per-round ratios): " + ", ".join(shown)
    ]
    if result["mp_goals"]:
        lines.append(
            "goals vs LMCache's multi-process adapters (the best a release offers "
            "of each kind):"
        )
    for goal in result["mp_goals"]:
        figure = (
            f"{goal['value']:+.3f} s/GB (goal <= {goal['goal']:+.3f}: one CRC32C pass)"
            if goal["kind"] == "+"
            else f"{goal['value']:.2f}x (goal >= {goal['goal']:g}x)"
        )
        verdict = "met" if goal["met"] else "NOT met"
        if goal.get("unsteady"):
            verdict = "not judged: writes unsteady between placements (see the notes)"
        elif not goal["judged"]:
            rig = "capped" if result["reads_capped"] else "uncapped"
            verdict = f"not judged here (this run read {rig})"
        lines.append(
            f"  {goal['what']} vs {goal['label']}: {figure}, on {goal['on']}: {verdict}"
        )
    return lines
