"""The cluster bench's outputs: a markdown table, the JSON, and the scaling chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .mn_report import format_layouts, plot_layouts
from .settings import format_ratio, format_seconds

__all__ = ["format_table", "write_chart", "write_json", "write_table"]

MiB = 1 << 20


def _cores(row: dict[str, Any]) -> str:
    busy = row["busiest"]
    short = busy["process"].replace("trainer rank ", "r").replace("worker ", "w")
    machine = row.get("machine_cores")
    return f"{row['cores_sum']:.2f} ({short} {busy['cores']:.2f}) / " + (
        "-" if machine is None else f"{machine:.2f}"
    )


def format_table(report: dict[str, Any]) -> str:
    """Markdown: one table per scenario kind, a row per (rate, N or M)."""
    meta = report["meta"]
    model = meta["model"]
    settings = meta["settings"]
    lines = [
        (
            f"Cluster bench: synthetic Llama, {model['bytes'] / MiB:.1f} MiB bf16 "
            f"({model['tensors']} tensors), tcp backend, {settings['bucket_bytes'] / MiB:g} MiB "
            f"buckets x {settings['num_buffers']}; median of {settings['rounds']['rounds']} rounds "
            f"after {settings['rounds']['warmup']} warm-up; {meta['cpus']} CPUs."
        ),
        (
            "Every host is a network namespace behind one bridge; its link is capped both ways "
            "by a token bucket (tc tbf)."
        ),
        (
            "ideal = model bytes / one link's rate (each worker must receive the model through "
            "its own link); star = N x ideal (today: the trainer's link carries a copy per "
            "worker); a chain's bound is the ideal (the trainer sends one copy, each worker "
            "forwards it). trainer link MiB = bytes the trainer host's interface sent per round "
            "(headers included). Headers of a 1500-byte MTU alone cost ~4.6% of a capped link."
        ),
        (
            "cores = CPU cores the run's processes kept busy, summed (busiest process: r = "
            "trainer rank, w = worker) / the whole machine's busy cores (other users' "
            f"processes included); CPU-bound: the run's processes >= "
            f"{settings['cpu_bound_cores']:.2f}, one process >= "
            f"{settings['cpu_bound_process']:.2f}, the machine >= "
            f"{settings['cpu_bound_cores']:.2f}, or no cap at all; link: within 1.2x of the "
            "star bound (a chain's: of the ideal); other: neither (latency, protocol, the FSDP gathers)."
        ),
        "",
    ]
    header = (
        "| rate | {k} | s/round | ideal s | x ideal | star s | x star | Gbit/s per worker "
        "| cores: run (busiest) / machine | bound | bit-exact | trainer link MiB |"
    )
    for kind, title, key in (
        ("workers", "One trainer to N workers", "N"),
        (
            "ranks",
            (
                "M FSDP2 trainer ranks (gloo) to N = M workers; senders: rank0 gathers and "
                "sends everything, owners = every rank sends its own shards (star = 1 x ideal)"
            ),
            "M",
        ),
    ):
        rows = [r for r in report["rows"] if r["kind"] == kind]
        if not rows:
            continue
        lines += [f"### {title}", "", header.format(k=key), "|" + " --- |" * 12]
        for r in rows:
            count = r["workers"] if kind == "workers" else r["ranks"]
            note = " (= N 1)" if r.get("same_as") else ""
            if r.get("senders") == "owners":
                note += " owners"
            if r.get("topology", "star") != "star":
                note += f" {r['topology']}"
            link = r.get("trainer_link_bytes")
            link_mib = "-" if not link else f"{link / MiB:.1f}"
            bound = {"CPU": "**CPU**", "other": "*other*"}.get(r["bound"], r["bound"])
            lines.append(
                f"| {r['rate']} | {count}{note} | {r['median_s']:.3f} | {format_seconds(r['ideal_s'])} | "
                f"{format_ratio(r['ratio_to_ideal'])} | {format_seconds(r['star_bound_s'])} | {format_ratio(r['ratio_to_star'])} "
                f"| {r['gbit_per_worker']:.2f} | {_cores(r)} | {bound} | "
                f"{'yes' if r['bit_exact'] else 'NO'} | {link_mib} |"
            )
        lines.append("")
        lines += owners_ratios(rows)
        flagged = [r for r in rows if r["bound"] != "link" and not r.get("same_as")]
        for r in flagged:
            count = r["workers"] if kind == "workers" else r["ranks"]
            lines.append(f"- {r['bound']}, {r['rate']} {key} = {count}: {r['bound_why']}")
        if flagged:
            lines.append("")
    lines += format_layouts(report["rows"])
    cleanup = meta.get("cleanup", {})
    if cleanup:
        left = cleanup.get("left_behind") or []
        lines.append(
            "cleanup: "
            + ("every namespace, link and queue removed" if not left else f"LEFT {left}")
        )
    if "runtime_s" in meta:
        lines.append(f"wall time: {meta['runtime_s']:.0f} s; command: `{meta.get('command', '?')}`")
    return "\n".join(lines)


def owners_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """One line per owners row: its time over the gathered row's at the same rate and
    M, next to the bar (1.15 / M)."""
    lines = []
    for r in rows:
        if r.get("senders") != "owners":
            continue
        gathered = next(
            (
                g
                for g in rows
                if g.get("senders", "rank0") == "rank0"
                and g["rate_bps"] == r["rate_bps"]
                and g["ranks"] == r["ranks"]
                and not g.get("same_as")
            ),
            None,
        )
        if gathered is None:
            continue
        ratio = r["median_s"] / gathered["median_s"]
        bar = 1.15 / r["ranks"]
        lines.append(
            f"- owners / gathered, {r['rate']} M = {r['ranks']}: {r['median_s']:.3f} / "
            f"{gathered['median_s']:.3f} s = {ratio:.3f} (bar 1.15/M = {bar:.3f}: "
            f"{'met' if ratio <= bar else 'NOT met'})"
        )
    return [*lines, ""] if lines else []


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cluster.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def write_table(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cluster.md"
    path.write_text(format_table(report) + "\n")
    return path


def _plot_line(
    ax: Any,
    rows: list[dict[str, Any]],
    kind: str,
    key: str,
    rate_bps: int | None,
    rate: str,
    variant: tuple[str, str, Any],
    color: str,
) -> None:
    """One rate's (and variant's: senders, topology) seconds per round against N or M,
    with its ideal and star bound drawn once, on the gathered star's line."""
    senders, topology, style = variant
    points = sorted(
        (
            (r[key], r)
            for r in rows
            if r["kind"] == kind
            and r["rate_bps"] == rate_bps
            and r.get("senders", "rank0") == senders
            and r.get("topology", "star") == topology
        ),
        key=lambda point: point[0],
    )
    if not points:
        return
    xs = [x for x, _ in points]
    ys = [r["median_s"] for _, r in points]
    plain = senders == "rank0" and topology == "star"
    label = rate if plain else f"{rate}, {'owners' if senders == 'owners' else topology}"
    ax.plot(xs, ys, linestyle=style, color=color, label=label, linewidth=1.8)
    for x, (_, r) in zip(xs, points):
        ax.plot(
            [x], [r["median_s"]], linestyle="none", color=color, markersize=6,
            markerfacecolor=color if r["bound"] == "link" else "white",
            marker="o" if r["bound"] != "other" else "s",
        )  # fmt: skip
    ideal = points[0][1]["ideal_s"]
    if ideal is not None:
        ax.axhline(ideal, linestyle="--", color=color, linewidth=1)
        if plain:
            ax.plot(xs, [ideal * r["workers"] for _, r in points], ":", color=color)


_VARIANTS: tuple[tuple[str, str, Any], ...] = (
    ("rank0", "star", "-"),
    ("rank0", "chain", "-."),
    ("owners", "star", (0, (6, 2, 1, 2, 1, 2))),
)
"""The lines a rate can have: (senders, topology, matplotlib line style)."""

_COLORS = ["#d98c5f", "#3b7dd8", "#6aa84f", "#8e63b8", "#999999", "#cc0000"]


def write_chart(report: dict[str, Any], out: Path) -> tuple[Path | None, str]:
    """Seconds per round against N (left) and M (right), a line per rate, each next
    to its ideal (dashed) and today's star bound (dotted); CPU-bound points hollow."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return None, "chart skipped: matplotlib is not installed (pip install 'asyncwt[bench]')"

    rows = report["rows"]
    rates: list[tuple[int | None, str]] = []
    for r in rows:
        if (r["rate_bps"], r["rate"]) not in rates:
            rates.append((r["rate_bps"], r["rate"]))
    kinds = [k for k in ("workers", "ranks", "layouts") if any(r["kind"] == k for r in rows)]
    if not kinds:
        return None, "chart skipped: no rows"
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 5.2), squeeze=False)
    model_mib = report["meta"]["model"]["bytes"] / MiB
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax, kind in zip(axes[0], kinds):
        if kind == "layouts":
            plot_layouts(ax, rows)
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.tick_params(axis="y", which="minor", labelsize=7)
            continue
        key = "workers" if kind == "workers" else "ranks"
        for index, (rate_bps, rate) in enumerate(rates):
            color = _COLORS[index % len(_COLORS)]
            for variant in _VARIANTS:
                _plot_line(ax, rows, kind, key, rate_bps, rate, variant, color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        counts = sorted({r[key] for r in rows if r["kind"] == kind})
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel(
            "workers N (one trainer)" if kind == "workers" else "FSDP2 trainer ranks M (N = M)"
        )
        ax.set_ylabel("seconds per round (median)")
        ax.set_title(
            f"{model_mib:.1f} MiB model, one trainer to N workers"
            if kind == "workers"
            else f"{model_mib:.1f} MiB model, M trainer ranks to M workers"
        )
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(title="link rate", fontsize=8)
    if kinds == ["layouts"]:  # the footer below explains the other panels' lines
        fig.tight_layout()
        return _save(fig, plt, out)
    fig.text(
        0.5, 0.005,
        "solid: star; dash-dot: chain; dash-dot-dot: owner senders; dashed: ideal (model bytes / one link's rate); "
        "dotted: star bound (N copies through the trainer's link);\nhollow: not held by its links (circle: this machine's CPU; square: other)",
        ha="center", fontsize=8,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, plt, out)


def _save(fig: Any, plt: Any, out: Path) -> tuple[Path, str]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cluster.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, f"chart written to {path}"
