"""The bench's picture (matplotlib, drawn to a PNG file only): for one
concurrency the run's TTFT CDFs and bars, for several the seed's table as
grouped bars.

May touch: the PNG file it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_tiered.bench.common.report import delta


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def draw_run(
    path: str,
    ttft_values: Mapping[str, Sequence[float]],
    summaries: Mapping[str, Mapping[str, Any]],
    title: str,
    reference: str,
    stock: str,
) -> None:
    """The run as a PNG: TTFT CDF per variant (``ttft_values``: every
    request's TTFT, all its runs pooled); TTFT p50
    and token throughput bars, each labelled with its change against
    ``reference`` (drawn grey and dashed) where it ran, or "not valid" for a
    variant whose run measured this machine (``valid`` false)."""
    plt = _pyplot()
    names = list(summaries)
    notes = {reference: " (vLLM alone)", stock: " (stock)"}
    shown = {n: n + notes.get(n, "") for n in names}
    palette = plt.get_cmap("tab10")
    colors = {
        name: "0.45" if name == reference else palette(i % 10)
        for i, name in enumerate(names)
    }
    figure, (cdf, ttft_bars, tps_bars) = plt.subplots(
        1, 3, figsize=(16, 5.5), gridspec_kw={"width_ratios": [1.5, 1, 1]}
    )
    for name in names:
        values = sorted(ttft_values[name])
        shares = [(i + 1) / len(values) for i in range(len(values))]
        cdf.step(
            values,
            shares,
            where="post",
            label=shown[name],
            color=colors[name],
            linestyle="--" if name == reference else "-",
            linewidth=2.2 if name == reference else 1.6,
        )
    cdf.set_xscale("log")
    cdf.axhline(0.5, color="0.7", linewidth=0.8, linestyle=":")
    cdf.set_xlabel("TTFT, production seconds (log scale)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF (left and up is better)")
    cdf.grid(alpha=0.3, which="both")
    cdf.legend(fontsize=9)
    base = summaries.get(reference)
    if base is not None and not base["valid"]:
        base = None
    for axes, key, unit, better in (
        (ttft_bars, "ttft_p50_s", "s", "lower"),
        (tps_bars, "throughput_tps", "tok/s", "higher"),
    ):
        values = [summaries[n][key] for n in names]
        bars = axes.barh(
            [shown[n] for n in names], values, color=[colors[n] for n in names]
        )
        labels = [f"{v:.2f}" if unit == "s" else f"{v:.0f}" for v in values]
        labels = [
            f"{text} (not valid)"
            if not summaries[name]["valid"]
            else text
            if name == reference or base is None
            else f"{text} ({delta(v, base[key])})"
            for text, name, v in zip(labels, names, values, strict=True)
        ]
        axes.bar_label(bars, labels, padding=3, fontsize=9)
        axes.invert_yaxis()  # first variant on top, as in the table
        axes.set_xlim(0, max(values) * 1.35)
        axes.set_xlabel(unit)
        axes.set_title(
            f"{'TTFT p50' if unit == 's' else 'Throughput'} ({better} is better)"
            + (f"\n% against {reference}" if base is not None else "")
        )
        axes.grid(alpha=0.3, axis="x")
    figure.suptitle(title, fontsize=10, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def draw_concurrencies(
    path: str,
    rows: Sequence[Mapping[str, Any]],
    title: str,
    stock: str,
    reference: str,
) -> None:
    """The seed's table (:func:`lmcache_tiered.bench.common.report.seed_rows`) as a
    PNG: TTFT p50 and token throughput per variant, one bar per concurrency
    side by side, the runs' lowest..highest as error bars (none for a single
    run), each bar labelled with its change against ``reference`` (the seed's
    baseline, also drawn as a dashed line per concurrency); ``stock`` and
    ``reference`` are hatched and named so on the axis."""
    plt = _pyplot()
    names = list(dict.fromkeys(row["variant"] for row in rows))
    levels = sorted({row["concurrency"] for row in rows})
    at = {(row["variant"], row["concurrency"]): row for row in rows}
    marks = {stock: ("//", "stock"), reference: ("xx", "seed's baseline")}
    palette = plt.get_cmap("tab10")
    width = 0.8 / len(levels)
    figure, panels = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(names) + 4), 6))
    for axes, key, unit, heading in (
        (panels[0], "ttft_p50_s", "production seconds", "TTFT p50 (lower is better)"),
        (
            panels[1],
            "throughput_tps",
            "generated tok/s",
            "Throughput (higher is better)",
        ),
    ):
        for j, level in enumerate(levels):
            color = palette(j % 10)
            ran = [(i, at[n, level]) for i, n in enumerate(names) if (n, level) in at]
            xs = [i + (j - (len(levels) - 1) / 2) * width for i, _ in ran]
            axes.bar(
                xs,
                [row[key]["median"] for _, row in ran],
                width,
                color=color,
                label=f"concurrency {level}",
                hatch=[marks.get(row["variant"], ("", ""))[0] for _, row in ran],
                edgecolor="black",
                linewidth=0.5,
            )
            for x, (_, row) in zip(xs, ran, strict=True):
                spread = row[key]
                ranged = row["runs"] > 1
                if ranged:
                    axes.errorbar(
                        x,
                        spread["median"],
                        yerr=[
                            [spread["median"] - spread["min"]],
                            [spread["max"] - spread["median"]],
                        ],
                        fmt="none",
                        ecolor="black",
                        capsize=3,
                    )
                axes.annotate(
                    _change_label(row, reference, key),
                    (x, spread["max"] if ranged else spread["median"]),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
            base = at.get((reference, level))
            if base is not None:
                axes.axhline(
                    base[key]["median"], color=color, linestyle="--", linewidth=1
                )
        axes.set_ylim(0, 1.12 * max(row[key]["max"] for row in rows))
        axes.set_xticks(
            range(len(names)),
            [f"{n}\n({marks[n][1]})" if n in marks else n for n in names],
            rotation=30,
            ha="right",
            fontsize=9,
        )
        axes.set_ylabel(unit)
        axes.set_title(heading)
        axes.grid(alpha=0.3, axis="y")
    handles, labels = panels[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(levels), fontsize=9)
    figure.suptitle(
        f"{title}\nbars: median over the runs, error bars: lowest..highest run; "
        f"% above a bar: its change against {reference} (dashed line), run by run",
        fontsize=10,
        wrap=True,
    )
    figure.tight_layout(rect=(0, 0.05, 1, 1))  # the legend below the panels
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _change_label(row: Mapping[str, Any], reference: str, key: str) -> str:
    """A bar's change against ``reference``, as the seed's table gives it
    (the median of the paired changes); empty where there is none, "not
    valid" for a run that measured this machine."""
    if not row["valid"]:
        return "not valid"
    change = (row["change_vs"].get(reference) or {}).get(key)
    return "" if change is None else f"{100 * change['median']:+.0f}%"
