"""Turn a run's figures into ratios, PASS/FAIL bars, a table, JSON and a chart.

Every figure is also given as a ratio against a baseline measured in the same run
(`vs_*` keys), so results from different machines compare by shape, not by speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._paired import headline_limits
from ._peers import PEER_TITLES

__all__ = ["BARS", "add_ratios", "evaluate_bars", "format_table", "write_chart", "write_json"]

MiB = 1 << 20

MEMORY_SLACK = 0.10
"""Memory bar: num_buffers × bucket_bytes plus this share..."""
MEMORY_FIXED_BYTES = 8 * MiB
"""...plus this many bytes ("a few MiB": allocator, threads, control plane)."""

BARS = {
    "vs_raw_loopback": 0.9,
    "vs_memcpy": 0.8,
    "vs_every_peer": 1.0,
    "overlap_vs_slowest": 1.15,
}
"""The bars' thresholds (the first two, the headline against its limit, are set for
the 1 GiB model)."""
LIMIT_TITLES = {
    "raw_loopback": "one raw loopback TCP stream",
    "memcpy": "one core's memcpy",
    "memcpy_2cores": "two cores' memcpy",
}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def add_ratios(report: dict[str, Any]) -> None:
    """Add `vs` dicts (throughput ratios) to every transfer figure, in place."""
    limits = report["limits"]
    bases: dict[str, float] = {
        "raw_loopback": limits["raw_loopback"]["gbps"],
        "memcpy": limits["memcpy"]["gbps"],
    }
    if "memcpy_2cores" in limits:
        bases["memcpy_2cores"] = limits["memcpy_2cores"]["gbps"]
        limits["memcpy_2cores"]["vs"] = {"memcpy": _ratio(bases["memcpy_2cores"], bases["memcpy"])}
    for name, record in report["peers"].items():
        bases[name] = record["gbps"]
    limits["memcpy"]["vs"] = {
        "raw_loopback": _ratio(limits["memcpy"]["gbps"], bases["raw_loopback"])
    }
    limits["raw_loopback"]["vs"] = {
        "memcpy": _ratio(limits["raw_loopback"]["gbps"], bases["memcpy"])
    }
    for name, record in report["peers"].items():
        record["vs"] = {k: _ratio(record["gbps"], v) for k, v in bases.items() if k != name}
    for paths in report["asyncwt"].values():
        for record in paths.values():
            record["vs"] = {k: _ratio(record["gbps"], v) for k, v in bases.items()}
    for sweep in report["sweep"].values():
        for row in sweep["rows"]:
            row["vs"] = {k: _ratio(row["gbps"], bases[k]) for k in ("raw_loopback", "memcpy")}


def _bar(
    name: str, value: float | None, threshold: float, ok: bool | None, detail: str, **extra: Any
) -> dict[str, Any]:
    status = "N/A" if ok is None else "PASS" if ok else "FAIL"
    return {
        "bar": name,
        "value": value,
        "threshold": threshold,
        "status": status,
        "detail": detail,
        **extra,
    }


def evaluate_bars(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The bars, one line each, for every backend measured (thresholds in `BARS`)."""
    bars: list[dict[str, Any]] = []
    model = report["meta"]["model"]["bytes"]
    gib_note = (
        ""
        if 0.9 * 2**30 <= model <= 1.1 * 2**30
        else f" [bar set for the 1 GiB model; this run: {model / MiB:.0f} MiB]"
    )
    for name, paths in report["asyncwt"].items():
        tag = f"asyncwt {name}"
        overlap = report["overlap"].get(name)
        bars.append(_headline_bar(name, paths["direct"], report, gib_note))
        if report["peers"]:
            bars.append(_every_peer_bar(tag, paths["direct"], report["peers"]))
        for pair_name, pair in (overlap or {}).get("pairs", {}).items():
            bars.append(_overlap_bar(tag, pair_name, pair))
        memory = report["memory"].get(name)
        if memory:
            bars += [_memory_bar(tag, memory, side) for side in ("trainer", "worker")]
        bars.append(_bit_exact_bar(tag, paths, overlap))
    for name, error in report["meta"].get("backend_errors", {}).items():
        bars.append(_bar(f"asyncwt {name} completes the benchmark", None, 1.0, False, error))
    if gib_note:
        bars = [_informational(bar) for bar in bars]
    return bars


_SIZE_BOUND = ("end-to-end", "faster than every peer", "overlap of two equal stages")
"""The bars on speed, set for the 1 GiB model: a smaller one spends a larger share of
its round on fixed costs, so below it they are figures, not verdicts."""


def _informational(bar: dict[str, Any]) -> dict[str, Any]:
    """A speed bar of a run on another model size: status INFO, whatever its value."""
    if bar["status"] not in ("PASS", "FAIL") or not any(k in bar["bar"] for k in _SIZE_BOUND):
        return bar
    return {**bar, "status": "INFO", "would_be": bar["status"]}


def _headline_bar(
    backend: str, direct: dict[str, Any], report: dict[str, Any], gib_note: str
) -> dict[str, Any]:
    """The headline against its limit (`headline_limits`), paired round by round if
    it was; the other limits it was paired with are given in the detail."""
    paired = direct.get("paired", {})
    limit = next(iter(paired.get("vs", {})), headline_limits(backend)[0])
    threshold = BARS["vs_memcpy" if limit.startswith("memcpy") else "vs_raw_loopback"]
    limits = report["limits"]
    base_gbps = limits[limit]["gbps"] if limit in limits else None
    separate = direct["vs"].get(limit)
    detail = (
        f"{direct['gbps']:.2f} vs {base_gbps:.2f} GB/s measured apart ({separate:.2f}x)"
        if base_gbps and separate is not None
        else "not measured apart"
    )
    v = separate
    if limit in paired.get("vs", {}):
        # Round for round beside asyncwt's rounds: the figure that counts.
        v = paired["vs"][limit]
        beside = "; ".join(
            f"{LIMIT_TITLES.get(k, k)} beside them {paired['baselines'][k]['gbps']:.2f} GB/s, "
            f"{paired['vs'][k]:.2f}x paired"
            for k in paired["vs"]
        )
        detail = (
            f"paired round by round {v:.2f}x (per round "
            + ", ".join(f"{r:.2f}" for r in paired["ratios"][limit])
            + f"; {beside}); "
            + detail
        )
    return _bar(
        f"asyncwt {backend} end-to-end >= {threshold}x {LIMIT_TITLES.get(limit, limit)}",
        v, threshold, v is not None and v >= threshold, detail + gib_note,
    )  # fmt: skip


def _every_peer_bar(tag: str, direct: dict[str, Any], peers: dict[str, Any]) -> dict[str, Any]:
    """The headline against the closest peer approach."""
    ratios = {p: direct["vs"][p] for p in peers}
    worst = min(ratios, key=lambda p: ratios[p] or 0.0)
    v = ratios[worst]
    return _bar(
        f"{tag} faster than every peer approach",
        v, BARS["vs_every_peer"], v is not None and v > BARS["vs_every_peer"],
        "; ".join(f"{p} {r:.2f}x" for p, r in ratios.items() if r is not None)
        + f" (closest: {worst})",
    )  # fmt: skip


def _overlap_bar(tag: str, pair_name: str, pair: dict[str, Any]) -> dict[str, Any]:
    """Two equal stages together against the slower one alone."""
    v = pair["total_vs_slowest"]
    more = pair["more_buffers"]
    return _bar(
        f"{tag} overlap of two equal stages ({pair_name}): total <= "
        f"{BARS['overlap_vs_slowest']}x the slower alone",
        v, BARS["overlap_vs_slowest"], v <= BARS["overlap_vs_slowest"],
        f"total {pair['overlapped']['median_s']:.3f} s vs {pair['slowest_stage']} alone "
        f"{pair['slowest_alone_s']:.3f} s (default buffers; with {more['num_buffers']}: "
        f"{more['total_vs_slowest']:.2f}x)"
        + (f"; stages alone {pair['balance']:.2f}:1" if "balance" in pair else "")
        + (
            f"; paired by round {pair['paired_vs_slowest']:.2f}x"
            if pair.get("paired_vs_slowest") is not None
            else ""
        )
        + "".join(
            f"; ideal-pipeline floor {m} {f['vs_slowest']:.3f}x"
            for m, f in pair.get("floor", {}).items()
        ),
    )  # fmt: skip


def _memory_bar(tag: str, memory: dict[str, Any], side: str) -> dict[str, Any]:
    """One side's peak extra memory against its staging budget.

    The trainer's worst path counts. On the worker the staged path runs a
    per-tensor transform, which needs each parameter larger than a bucket whole (one
    parameter-sized buffer): a cost of the transform, shown in the detail, not of
    the transfer.
    """
    counted = ("direct", "staged") if side == "trainer" else ("direct",)
    worst_path = max(counted, key=lambda p: memory[p][side]["extra_bytes"])
    entry = memory[worst_path]
    extra = entry[side]["extra_bytes"]
    limit = entry["budget_bytes"] * (1 + MEMORY_SLACK) + MEMORY_FIXED_BYTES
    return _bar(
        f"{tag} peak extra memory, {side} <= num_buffers x bucket_bytes + 10% + 8 MiB",
        extra / entry["budget_bytes"], limit / entry["budget_bytes"], extra <= limit,
        f"{extra / MiB:.1f} MiB ({worst_path} path; direct "
        f"{memory['direct'][side]['extra_bytes'] / MiB:.1f}, staged "
        f"{memory['staged'][side]['extra_bytes'] / MiB:.1f}"
        f"{' with a transform' if side == 'worker' else ''}) vs limit {limit / MiB:.1f} MiB; "
        f"{extra / memory['model_bytes']:.1%} of the model",
        unit="x budget",
    )  # fmt: skip


def _bit_exact_bar(
    tag: str, paths: dict[str, Any], overlap: dict[str, Any] | None
) -> dict[str, Any]:
    """Every round of the backend, overlap runs included, arrived bit-exact."""
    bit_exact = all(paths[p].get("bit_exact") for p in paths)
    bit_exact = bit_exact and bool(overlap is None or overlap["overlapped"].get("bit_exact"))
    for pair in (overlap or {}).get("pairs", {}).values():
        bit_exact = bit_exact and bool(pair["overlapped"].get("bit_exact"))
        bit_exact = bit_exact and bool(pair["more_buffers"].get("bit_exact"))
    return _bar(
        f"{tag} rounds arrive bit-exact (worker checksum == trainer's)",
        None, 1.0, bit_exact,
        ", ".join(f"{p}: {paths[p].get('bit_exact')}" for p in paths),
    )  # fmt: skip


# -- table ----------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MiB:8.1f}"


def _cores(record: dict[str, Any]) -> str:
    """`cores busy: trainer 0.91, worker 0.55`: each process's CPU seconds per wall
    second in a median round (see `asyncwt._bench._cpu`)."""
    return "cores busy: " + ", ".join(f"{k} {v:.2f}" for k, v in record["cores_busy"].items())


def _x(v: float | None) -> str:
    return "     -" if v is None else f"{v:6.2f}"


def format_table(report: dict[str, Any]) -> str:
    """The run as the table `asyncwt bench` prints: one block per section, then the bars."""
    lines = _header_lines(report["meta"])
    lines += _transfer_lines(report)
    for backend, overlap in report["overlap"].items():
        lines += _overlap_lines(backend, overlap)
    for backend, memory in report["memory"].items():
        lines += _memory_lines(backend, memory)
    for backend, sweep in report["sweep"].items():
        if sweep["rows"]:
            lines += _sweep_lines(backend, sweep)
    lines += ["", "BARS"]
    if any(bar["status"] == "INFO" for bar in report["bars"]):
        lines.append(
            "  (INFO: a speed bar set for the 1 GiB model, shown as a figure at this size; "
            "run without --quick/--tiny/--model-mib for the verdict)"
        )
    for bar in report["bars"]:
        lines.append(f"  {bar['status']:4}  {bar['bar']}: {_fmt_value(bar)} — {bar['detail']}")
    lines.append("")
    return "\n".join(lines)


def _header_lines(meta: dict[str, Any]) -> list[str]:
    """The run's model, rounds and machine, then the TRANSFER table's column titles."""
    model = meta["model"]
    rounds = meta["settings"]["rounds"]
    return [
        "",
        (
            f"asyncwt bench: synthetic Llama, {model['bytes'] / MiB:.1f} MiB bf16 in {model['tensors']} tensors; "
            f"median of {rounds['rounds']} rounds after {rounds['warmup']} warm-up; {meta['cpus']} CPUs; "
            f"{meta.get('runtime_s', 0):.1f} s; load average {meta['loadavg_at_start'][0]:.2f} at start"
        ),
        "",
        "TRANSFER (trainer -> worker, separate processes; ratios are throughput ratios)",
        (
            f"  {'approach':34} {'median s':>9} {'GB/s':>6} {'xraw':>6} {'xmemcpy':>7} {'xnaive':>6} "
            f"{'trainer+MiB':>11} {'worker+MiB':>10} exact"
        ),
    ]


def _transfer_lines(report: dict[str, Any]) -> list[str]:
    """The TRANSFER rows: the limits, every peer and asyncwt path, then their notes."""
    lines = _limit_lines(report["limits"])
    for name, record in report["peers"].items():
        lines.append(_transfer_row(PEER_TITLES.get(name, name), record))
    for backend, paths in report["asyncwt"].items():
        for path, record in paths.items():
            lines.append(_transfer_row(f"asyncwt {backend} ({path})", record))
    for backend, paths in report["asyncwt"].items():
        paired = paths["direct"].get("paired")
        if paired:
            lines.append(_paired_line(backend, paired))
    for backend, paths in report["asyncwt"].items():
        for path, record in paths.items():
            lines.append(_stage_busy_line(backend, path, record))
    return lines


def _limit_lines(limits: dict[str, Any]) -> list[str]:
    """The raw loopback and memcpy rows, and what the raw loopback's rounds did."""
    raw = limits["raw_loopback"]
    mem = limits["memcpy"]
    lines = [
        (
            f"  {'raw loopback TCP (' + raw['variant'] + ', ' + raw.get('taken', '') + ')':34} "
            f"{raw['median_s']:9.3f} {raw['gbps']:6.2f} "
            f"{_x(1.0)} {_x(raw['vs']['memcpy']):>7} {'':6} {'':11} {'':10}"
        ),
        (
            f"  {'memcpy, 1 thread':34} {mem['median_s']:9.3f} {mem['gbps']:6.2f} {_x(mem['vs']['raw_loopback'])} "
            f"{_x(1.0):>7}"
        ),
    ]
    two = limits.get("memcpy_2cores")
    if two is not None:
        lines.append(
            f"  {'memcpy, 2 threads':34} {two['median_s']:9.3f} {two['gbps']:6.2f} "
            f"{'':6} {_x(two['vs']['memcpy']):>7}"
        )
    if raw.get("cores_busy"):
        lines.append(f"  (raw loopback TCP, {_cores(raw)})")
    if "start" in raw:
        lines.append(
            f"  (raw loopback at the start {raw['start']['gbps']:.2f} GB/s, at the end "
            f"{raw['end']['gbps']:.2f} GB/s, drift {raw['drift']:+.0%}: the better one counts)"
        )
    return lines


def _transfer_row(title: str, r: dict[str, Any]) -> str:
    """One approach's TRANSFER row: time, throughput, ratios, extra memory, exactness."""
    vs = r["vs"]
    return (
        f"  {title:34} {r['median_s']:9.3f} {r['gbps']:6.2f} {_x(vs.get('raw_loopback'))} "
        f"{_x(vs.get('memcpy')):>7} {_x(vs.get('naive', 1.0 if title.startswith('naive') else None))} "
        f"{_mib(r['memory']['trainer']['extra_bytes']):>11} {_mib(r['memory']['worker']['extra_bytes']):>10} "
        f"{'yes' if r.get('bit_exact') else 'NO'}"
    )


def _paired_line(backend: str, paired: dict[str, Any]) -> str:
    """A backend's headline against the baselines run right before each of its rounds."""
    return (
        f"  asyncwt {backend} (direct), paired with the baselines run right before it "
        f"(blocks of {paired.get('block', 1)} rounds, the last counts): "
        + "; ".join(
            f"{k.replace('_', ' ')} {paired['baselines'][k]['gbps']:.2f} GB/s, "
            f"{v:.2f}x (rounds " + " ".join(f"{r:.2f}" for r in paired["ratios"][k]) + ")"
            for k, v in paired["vs"].items()
        )
    )


def _stage_busy_line(backend: str, path: str, record: dict[str, Any]) -> str:
    """A path's bucket configuration and how long each pipeline stage was busy."""
    busy = " ".join(
        f"{k} {v:.3f} s ({record['stage_busy_share'][k]:.0%})"
        for k, v in record["stage_busy_s"].items()
    )
    cfg = record["config"]
    return (
        f"  asyncwt {backend} ({path}) bucket {cfg['bucket_bytes'] / MiB:g} MiB x {cfg['num_buffers']}, "
        f"{record['buckets']} buckets; stage busy: {busy}"
        + (f"; {_cores(record)}" if record.get("cores_busy") else "")
    )


def _overlap_lines(backend: str, overlap: dict[str, Any]) -> list[str]:
    """The OVERLAP block: the three stages alone and together, then each pair."""
    st = overlap["stage_alone_s"]
    lines = [
        "",
        (
            f"OVERLAP (asyncwt {backend}: gather {overlap['gather_s_per_tensor'] * 1e3:.2f} ms/tensor, "
            f"transform {overlap['transform_s_per_bucket'] * 1e3:.2f} ms/bucket on {overlap['apply_threads']} threads, "
            f"{'elementwise' if overlap.get('transform_elementwise') else 'on whole tensors'})"
        ),
        (
            f"  alone: gather {st['gather']:.3f} s | wire {st['wire']:.3f} s | transform {st['transform']:.3f} s "
            f"| sum {overlap['sum_of_stages_s']:.3f} s"
        ),
        (
            f"  together: {overlap['overlapped']['median_s']:.3f} s = {overlap['total_vs_slowest']:.2f}x the slowest "
            f"({overlap['slowest_stage']}), {overlap['total_vs_sum']:.2f}x the sum"
        ),
        (
            f"  with {overlap['more_buffers']['num_buffers']} buffers instead: "
            f"{overlap['more_buffers']['median_s']:.3f} s = "
            f"{overlap['more_buffers']['total_vs_slowest']:.2f}x the slowest"
        ),
    ]
    for pair_name, pair in overlap.get("pairs", {}).items():
        lines += _pair_lines(pair_name, pair)
    return lines


def _pair_lines(pair_name: str, pair: dict[str, Any]) -> list[str]:
    """One overlap pair: alone and together, its calibration attempts, its floor."""
    alone = " | ".join(f"{k} {v:.3f} s" for k, v in pair["stage_alone_s"].items())
    more = pair["more_buffers"]
    lines = [
        f"  two stages, {pair_name}: alone {alone}; together "
        f"{pair['overlapped']['median_s']:.3f} s = {pair['total_vs_slowest']:.2f}x the slower "
        f"({pair['slowest_stage']}); with {more['num_buffers']} buffers "
        f"{more['median_s']:.3f} s = {more['total_vs_slowest']:.2f}x"
        + (
            f"; the slower stage alone is {pair['balance']:.2f}x the faster"
            if "balance" in pair
            else ""
        )
        + (
            f"; round by round against the wire alone next to it: "
            f"{pair['paired_vs_slowest']:.2f}x (with {more['num_buffers']} buffers "
            f"{more['paired_vs_slowest']:.2f}x)"
            if pair.get("paired_vs_slowest") is not None
            else ""
        )
    ]
    attempts = pair.get("attempts", [])
    if len(attempts) > 1:
        lines.append(
            f"    calibrated {len(attempts)} times to balance the stages; kept the closest: "
            + ", ".join(
                f"{'[' if a['kept'] else ''}{a['off_balance']:.2f}:1 -> "
                f"{a['total_vs_slower']:.2f}x{']' if a['kept'] else ''}"
                for a in attempts
            )
        )
    if "floor" in pair:
        lines.append(
            "    floor (an ideal pipeline of the same work, no overhead): "
            + ", ".join(f"{m} {f['vs_slowest']:.3f}x" for m, f in pair["floor"].items())
        )
    return lines


def _memory_lines(backend: str, memory: dict[str, Any]) -> list[str]:
    """The MEMORY block: each path's and side's peak extra RSS against the budget."""
    lines = [
        "",
        f"MEMORY (asyncwt {backend}: peak extra RSS over warm-up + rounds, vs budget num_buffers x bucket_bytes)",
    ]
    for path in ("direct", "staged"):
        entry = memory[path]
        for side in ("trainer", "worker"):
            s = entry[side]
            lines.append(
                f"  {path:7} {side:8} {s['extra_bytes'] / MiB:8.1f} MiB = {s['vs_budget']:5.2f}x budget "
                f"({entry['budget_bytes'] / MiB:g} MiB), {s['vs_model']:6.1%} of model [{s['method']}]"
            )
    return lines


def _sweep_lines(backend: str, sweep: dict[str, Any]) -> list[str]:
    """The SWEEP block: every configuration's row, then the fastest and the pick."""
    lines = [
        "",
        f"SWEEP (asyncwt {backend})",
        f"  {'mode':7} {'bucket':>10} {'bufs':>4} {'median s':>9} {'GB/s':>6} {'xraw':>6} {'trainer+MiB':>11} {'worker+MiB':>10}",
    ]
    for r in sweep["rows"]:
        lines.append(
            f"  {r['mode']:7} {_size(r['bucket_bytes']):>10} {r['num_buffers']:4d} {r['median_s']:9.3f} "
            f"{r['gbps']:6.2f} {_x(r['vs']['raw_loopback'])} {_mib(r['trainer_extra_bytes']):>11} "
            f"{_mib(r['worker_extra_bytes']):>10}"
        )
    for mode, pick in sweep["recommended"].items():
        fastest = sweep["fastest"][mode]
        lines.append(
            f"  {mode}: fastest {_size(fastest['bucket_bytes'])} x {fastest['num_buffers']} "
            f"({fastest['gbps']:.2f} GB/s); least memory within 5%: {_size(pick['bucket_bytes'])} x "
            f"{pick['num_buffers']} ({pick['gbps']:.2f} GB/s)"
        )
    return lines


def _fmt_value(bar: dict[str, Any]) -> str:
    if bar["value"] is None:
        return "yes" if bar["status"] == "PASS" else "no"
    unit = bar.get("unit", "x")
    return f"{bar['value']:.2f}{unit if unit == 'x' else ' ' + unit}"


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / 1024:g} KiB"


# -- files ----------------------------------------------------------------------------


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    return path


def write_chart(report: dict[str, Any], out: Path) -> tuple[Path | None, str]:
    """Throughput by approach and the overlap timeline, as a PNG; (path, message).

    matplotlib is optional (the `bench` extra); without it no chart is drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "chart skipped: matplotlib is not installed (pip install 'asyncwt[bench]')"

    labels: list[str] = []
    values: list[float] = []
    colors: list[str] = []
    limits = report["limits"]
    for title, record, color in (
        ("raw loopback TCP", limits["raw_loopback"], "#999999"),
        ("memcpy (1 thread)", limits["memcpy"], "#bbbbbb"),
    ):
        labels.append(title)
        values.append(record["gbps"])
        colors.append(color)
    for name, record in report["peers"].items():
        labels.append(PEER_TITLES.get(name, name))
        values.append(record["gbps"])
        colors.append("#d98c5f")
    for backend, paths in report["asyncwt"].items():
        for path, record in paths.items():
            labels.append(f"asyncwt {backend} ({path})")
            values.append(record["gbps"])
            colors.append("#3b7dd8")

    overlaps = list(report["overlap"].items())
    fig, axes = plt.subplots(
        1 + len(overlaps), 1, figsize=(10, 4 + 3 * len(overlaps)), squeeze=False
    )
    ax = axes[0][0]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    raw = limits["raw_loopback"]["gbps"]
    ax.axvline(raw, color="#555555", linestyle="--", linewidth=1)
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:.2f} ({v / raw:.2f}x raw)", va="center", fontsize=8)
    model = report["meta"]["model"]["bytes"]
    ax.set_xlabel("GB/s (median round, trainer -> worker process, model updated)")
    ax.set_title(f"Throughput by approach, {model / MiB:.0f} MiB bf16 model")
    ax.set_xlim(0, max(values) * 1.35)

    for row, (backend, overlap) in enumerate(overlaps, start=1):
        ax = axes[row][0]
        timeline = overlap["timeline"]
        lanes = [("gather (trainer)", timeline["gather"], "#6aa84f"),
                 ("send (trainer)", timeline["send"], "#3b7dd8"),
                 ("transform (worker)", timeline["transform"], "#d98c5f")]  # fmt: skip
        for y, (title, events, color) in enumerate(lanes):
            spans = [(a, max(b - a, 1e-4)) for _, a, b in events]
            if spans:
                ax.broken_barh(
                    spans, (y - 0.35, 0.7), facecolors=color, edgecolor="white", linewidth=0.4
                )
        ax.set_yticks(range(len(lanes)), [t for t, _, _ in lanes])
        ax.axvline(timeline["wall_s"], color="black", linewidth=1)
        ax.axvline(overlap["slowest_alone_s"], color="#cc0000", linestyle="--", linewidth=1)
        ax.set_xlabel(
            f"seconds since send_weights (black: round end {timeline['wall_s']:.3f} s; "
            f"red dashed: slowest stage alone, {overlap['slowest_stage']} {overlap['slowest_alone_s']:.3f} s)"
        )
        ax.set_title(f"Overlap timeline, asyncwt {backend} (median round)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, f"chart written to {path}"
