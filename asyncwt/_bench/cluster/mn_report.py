"""The M:N rows' table and chart panel (rows made by `cluster.mn`)."""

from __future__ import annotations

from typing import Any

from .settings import MiB, format_ratio, format_seconds

__all__ = ["MN_BAR", "format_layouts", "plot_layouts"]

MN_BAR = 1.25
"""A sliced row's time over its ideal should be at most this."""


def _whole_of(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The whole-receivers row run beside `row` (same rate, M and receiver count)."""
    return next(
        (
            r
            for r in rows
            if r["layout"] == "whole"
            and r["rate_bps"] == row["rate_bps"]
            and r["ranks"] == row["ranks"]
            and r["workers"] == row["workers"]
        ),
        None,
    )


def _busiest(row: dict[str, Any], prefix: str) -> float:
    counted = [v for k, v in row["link_bytes"].items() if k.startswith(prefix)]
    return max(counted, default=0.0)


def format_layouts(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the M:N table (sliced rows, each beside its whole row) and
    whether each met the bar."""
    layouts = [r for r in rows if r["kind"] == "layouts"]
    sliced = [r for r in layouts if r["sliced"]]
    if not sliced:
        return []
    lines = [
        "### M trainer ranks to tensor-parallel engines (M:N), every rank a host",
        "",
        (
            "Layouts: tp2 = one engine of 2 ranks, tp4 = one of 4, 2xtp2 = two engines of 2. "
            "M = 1: rank 0 sends everything; M > 1: FSDP2 owner senders (every rank its own "
            "rows, no gather). sliced: every rank receives exactly its slices "
            "(`fanout=Star(slices=True)`); whole: as many receivers, each taking the whole model "
            "(before this issue). ideal = max(payload through the busiest trainer link, payload "
            "through the busiest receiver link) / rate, counted from the boxes. Busiest links: "
            "payload the plan puts there / bytes the interfaces counted per round (GSO: "
            "headers once per 64 KiB)."
        ),
        "",
        (
            "| rate | layout | M | sliced s | ideal s | x ideal | whole s | whole ideal s "
            "| sliced / whole | busiest trainer link MiB | busiest receiver link MiB "
            "| cores: run (busiest) / machine | bound | bit-exact |"
        ),
        "|" + " --- |" * 14,
    ]
    verdicts = []
    for r in sliced:
        whole = _whole_of(layouts, r)
        cores = f"{r['cores_sum']:.2f} ({r['busiest']['process']} {r['busiest']['cores']:.2f})"
        machine = r.get("machine_cores")
        cores += " / " + ("-" if machine is None else f"{machine:.2f}")
        trainer = f"{max(r['plan_sent']) / MiB:.1f} / {_busiest(r, 'trainer') / MiB:.1f}"
        receiver = f"{max(r['plan_received']) / MiB:.1f} / {_busiest(r, 'worker') / MiB:.1f}"
        exact = r["bit_exact"] and (whole is None or whole["bit_exact"])
        if whole is None:
            beside = "- | - | -"
        else:
            ratio = r["median_s"] / whole["median_s"]
            beside = f"{whole['median_s']:.3f} | {format_seconds(whole['ideal_s'])} | {ratio:.2f}"
        lines.append(
            f"| {r['rate']} | {r['layout']} | {r['ranks']} | {r['median_s']:.3f} | "
            f"{format_seconds(r['ideal_s'])} | {format_ratio(r['ratio_to_ideal'])} | {beside} | "
            f"{trainer} | {receiver} | {cores} | {r['bound']} | {'yes' if exact else 'NO'} |"
        )
        if r["ratio_to_ideal"] is not None:
            verdicts.append(r["ratio_to_ideal"] <= MN_BAR)
    lines.append("")
    if verdicts:
        lines.append(
            f"- sliced rows within {MN_BAR}x of their ideal: {sum(verdicts)} of {len(verdicts)}"
        )
        lines += [
            f"- {r['bound']}, {r['rate']} {r['layout']} M = {r['ranks']}: {r['bound_why']}"
            for r in sliced
            if r["ratio_to_ideal"] is not None and r["ratio_to_ideal"] > MN_BAR
        ]
        lines.append("")
    return lines


_COLORS = {"tp2": "#3b7dd8", "tp4": "#6aa84f", "2xtp2": "#8e63b8"}


def plot_layouts(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Seconds per round against M: a solid line per layout (sliced), its ideal
    (dashed) and its whole receivers (dotted), in the layout's colour; hollow points
    missed the bar. One rate: the first of the M:N rows'."""
    layouts = [r for r in rows if r["kind"] == "layouts"]
    if not layouts:
        return
    rate = layouts[0]["rate_bps"]
    layouts = [r for r in layouts if r["rate_bps"] == rate]
    names = list(dict.fromkeys(r["layout"] for r in layouts if r["sliced"]))
    drawn: set[int] = set()  # whole receivers run once per count, shared by layouts
    for index, name in enumerate(names):
        color = _COLORS.get(name, ["#d98c5f", "#999999", "#cc0000"][index % 3])
        points = sorted((r for r in layouts if r["layout"] == name), key=lambda r: r["ranks"])
        xs = [r["ranks"] for r in points]
        ax.plot(xs, [r["median_s"] for r in points], "-", color=color, label=f"{name} sliced")
        for r in points:
            met = r["ratio_to_ideal"] is not None and r["ratio_to_ideal"] <= MN_BAR
            ax.plot(
                [r["ranks"]], [r["median_s"]], "o", color=color, markersize=6,
                markerfacecolor=color if met else "white",
            )  # fmt: skip
        if points[0]["ideal_s"] is not None:
            ax.plot(xs, [r["ideal_s"] for r in points], "--", color=color, linewidth=1)
        wholes = [_whole_of(layouts, r) for r in points]
        if points[0]["workers"] not in drawn and all(w is not None for w in wholes):
            drawn.add(points[0]["workers"])
            ax.plot(
                xs, [w["median_s"] for w in wholes if w is not None], ":", color=color,
                linewidth=1.4, label=f"{len(points[0]['plan_received'])} whole receivers",
            )  # fmt: skip
    counts = sorted({r["ranks"] for r in layouts})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("trainer ranks M (M = 1: rank 0; more: owner senders)")
    ax.set_ylabel("seconds per round (median)")
    ax.set_title(f"M:N at {layouts[0]['rate']}: sliced (solid), ideal (dashed), whole (dotted)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
