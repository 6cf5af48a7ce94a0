#!/usr/bin/env python3
"""Draws one `infinigen bench` result (NAME.json) as a PNG, with the paper's numbers beside ours.

Usage: plot_bench.py RESULT.json OUT.png

`infinigen bench` runs this itself after writing its JSON; run it by hand to redraw. Needs
matplotlib (Debian: python3-matplotlib). One subplot per side the result has: measured on the
machine named in the JSON, and predicted by the cost model for a hardware profile. The paper's
numbers are drawn where they compare: ratios (speedups, shares) always, absolute latencies only
when the points ran at the paper's sizes (scale 1); otherwise they get their own subplot.
"""

import json
import sys

from plot_common import POLICY_COLORS, plt

# The paper's numbers: hollow diamonds, as points beside ours and as lines in their own subplot.
PAPER_STYLE = dict(marker="D", facecolors="none", edgecolors="black", s=60, zorder=5)
PAPER_LINE = dict(marker="D", markerfacecolor="none", linestyle="--")


def sides(result):
    """(key, label) for measured and predicted, when the result has them."""
    settings = result["settings"]
    machine = result["machine"]
    out = []
    if any("measured" in p for p in result["points"]):
        where = machine["device"]
        if settings["device"] == "cpu":
            where = "%s, CPU backend, link %g GB/s emulated" % (
                machine["cpu"], settings["emulated_link_gbps"])
        out.append(("measured", "measured: %s, scale %g" % (where, settings["scale"])))
    if any("predicted" in p for p in result["points"]):
        out.append(("predicted", "predicted: %s, scale %g" % (
            settings["predicted_hardware"], settings["scale"])))
    return out


def ordered(values):
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def numeric(text):
    try:
        return float(text)
    except ValueError:
        return None


def paper_latency(point):
    """Total latency the paper's throughput implies for this point (B * gen / throughput)."""
    tput = point["paper"].get("throughput_tok_s")
    if not tput:
        return None
    s = point["settings"]
    return s["batch"] * s["gen_len"] / tput


def plot_latency(result, axes_for):
    points = result["points"]
    x_key = result["experiment"]["x"]
    xs = ordered(p["x"] for p in points)
    policies = ordered(p["policy"] for p in points)
    comparable = result["settings"]["scale"] == 1
    for side, ax in axes_for:
        if side == "paper" and x_key == "policy":
            for i, p in enumerate(points):
                if paper_latency(p):
                    ax.bar(i, paper_latency(p), color=POLICY_COLORS.get(p["policy"]),
                           hatch="//", fill=False, edgecolor=POLICY_COLORS.get(p["policy"]))
            ax.set_xticks(range(len(points)), [p["policy"] for p in points])
            ax.set_ylabel("total latency (s), from the paper's throughput")
            continue
        if side == "paper":
            for policy in policies:
                pts = [(p["x"], paper_latency(p)) for p in points
                       if p["policy"] == policy and paper_latency(p)]
                if pts:
                    ax.plot([xs.index(x) for x, _ in pts], [v for _, v in pts], **PAPER_LINE,
                            color=POLICY_COLORS.get(policy), label=policy)
            ax.set_xticks(range(len(xs)), xs)
            ax.set_ylabel("total latency (s)")
            continue
        if x_key == "policy":
            for i, p in enumerate(points):
                m = p.get(side)
                if not m:
                    ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                color = POLICY_COLORS.get(p["policy"])
                ax.bar(i, m["prefill_s"], color=color, alpha=0.45)
                ax.bar(i, m["decode_s"], bottom=m["prefill_s"], color=color)
                if comparable and paper_latency(p):
                    ax.scatter([i], [paper_latency(p)], **PAPER_STYLE)
            ax.set_xticks(range(len(points)), [p["policy"] for p in points])
            ax.set_ylabel("latency (s): prefill (light) + decode")
        else:
            for policy in policies:
                pts = [p for p in points if p["policy"] == policy and p.get(side)]
                ax.plot([xs.index(p["x"]) for p in pts], [p[side]["total_s"] for p in pts], "o-",
                        color=POLICY_COLORS.get(policy), label=policy)
                if comparable:
                    paper = [(xs.index(p["x"]), paper_latency(p)) for p in points
                             if p["policy"] == policy and paper_latency(p)]
                    if paper:
                        ax.scatter([x for x, _ in paper], [v for _, v in paper], **PAPER_STYLE)
            ax.set_xticks(range(len(xs)), xs)
            ax.set_ylabel("total latency (s)")
            ax.legend(fontsize=8)
        ax.set_xlabel(x_key)


def plot_speedup(result, axes_for):
    points = result["points"]
    xs = ordered(p["x"] for p in points)
    policies = [q for q in ordered(p["policy"] for p in points) if q != "full"]
    width = 0.8 / max(1, len(policies))
    for side, ax in axes_for:
        for j, policy in enumerate(policies):
            for p in points:
                if p["policy"] != policy:
                    continue
                x = xs.index(p["x"]) + (j - (len(policies) - 1) / 2) * width
                m = p.get(side)
                if m and m.get("speedup_vs_full"):
                    ax.bar(x, m["speedup_vs_full"], width, color=POLICY_COLORS.get(policy),
                           label=policy if p["x"] == xs[0] else None)
                if "speedup_vs_full" in p["paper"]:
                    ax.scatter([x], [p["paper"]["speedup_vs_full"]], **PAPER_STYLE)
        ax.axhline(1.0, color=POLICY_COLORS["full"], linewidth=1, linestyle=":")
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(result["experiment"]["x"])
        ax.set_ylabel("speedup over full")
        ax.legend(fontsize=8)


def plot_fetched(result, side_axes):
    points = result["points"]
    panels = ordered(p["panel"] for p in points)
    for side, row in side_axes:
        for ax, panel in zip(row, panels):
            pts = [p for p in points if p["panel"] == panel and p.get(side)]
            xs = [numeric(p["x"]) for p in pts]
            ax.plot(xs, [1e3 * p[side]["decode_step_s"] for p in pts], "o-",
                    color=POLICY_COLORS["infinigen"], label="decode step (ms)")
            ax.set_xlabel(panel)
            ax.set_ylabel("decode step (ms)")
            twin = ax.twinx()
            if side == "measured":
                twin.plot(xs, [p[side]["fetched_fraction"] for p in pts], "s--", color="#9467bd",
                          label="fetched KV share")
                twin.set_ylabel("fetched share of KV")
                twin.set_ylim(bottom=0)
            ax.set_ylim(bottom=0)


def plot_ttft(result, axes_for):
    """Prefill latency (the time to first token) per panel, x value and policy, as bars."""
    resumed = result["experiment"]["x"] == "history_len"
    plot_bars(result, axes_for, lambda m: m["prefill_s"], "time to first token (s)",
              lambda x: ("recomputed" if x == "0" else "resumed") if resumed else x)


def plot_transfer(result, axes_for):
    """Host-to-device MiB per decode step per panel, x value and policy, as bars."""
    x_key = result["experiment"]["x"]

    def label(x):
        if x_key == "shared_prefix_len":
            return "not shared" if x == "0" else "shared %s" % x
        if x_key == "shared_prefix_groups":
            return "1 group" if x == "1" else "%s groups" % x
        return x

    plot_bars(result, axes_for, lambda m: m["h2d_bytes_per_step"] / 2**20,
              "host->device per decode step (MiB)", label)


def plot_bars(result, axes_for, value, ylabel, label_of):
    """value(metrics) per panel, x value and policy, as bars labelled label_of(x)."""
    points = result["points"]
    panels = ordered(p["panel"] for p in points)
    xs = ordered(p["x"] for p in points)
    policies = ordered(p["policy"] for p in points)
    label = {x: label_of(x) for x in xs}
    slots = [(panel, x) for panel in panels for x in xs]
    width = 0.8 / max(1, len(policies))
    for side, ax in axes_for:
        for j, policy in enumerate(policies):
            for i, (panel, x) in enumerate(slots):
                m = next((p.get(side) for p in points
                          if p["panel"] == panel and p["x"] == x and p["policy"] == policy), None)
                if not m:
                    continue
                pos = i + (j - (len(policies) - 1) / 2) * width
                ax.bar(pos, value(m), width, color=POLICY_COLORS.get(policy),
                       label=policy if i == 0 else None)
                ax.text(pos, value(m), "%.3g" % value(m), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(slots)), ["%s\n%s" % (panel, label[x]) for panel, x in slots],
                      fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)


def plot_block(result, axes_for):
    points = result["points"]
    for side, ax in axes_for:
        for i, p in enumerate(points):
            m = p.get(side)
            if not m:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
                continue
            ax.bar(i, 1e3 * m["block_compute_s"], color="#7f7f7f",
                   label="compute" if i == 0 else None)
            ax.bar(i, 1e3 * m["block_transfer_s"], bottom=1e3 * m["block_compute_s"],
                   color="#d62728", label="waiting for transfer" if i == 0 else None)
            share = m["block_transfer_s"] / m["block_s"] if m["block_s"] > 0 else 0
            note = "%.0f%% transfer" % (100 * share)
            if m.get("slowdown_vs_gpu"):
                note += "\n%.2fx gpu" % m["slowdown_vs_gpu"]
            paper = p["paper"]
            if paper:
                note += "\npaper: " + ", ".join(
                    ("%.1f%% transfer" % (100 * v)) if k == "transfer_share" else
                    ("%.2fx ideal" % v) if k == "slowdown_vs_gpu" else "%s %g" % (k, v)
                    for k, v in sorted(paper.items()))
            ax.text(i, 1e3 * m["block_s"], note, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(points)), [p["policy"] for p in points])
        ax.set_ylabel("one block of a decode step (ms)")
        ax.legend(fontsize=8, loc="upper left")
        ax.margins(y=0.25)


def paper_note(kind, x_key, extra_paper):
    """How the figure draws the paper's numbers, for its title (None: it draws none)."""
    if kind == "block":
        return "paper's numbers: in each bar's label"
    if kind not in ("latency", "speedup"):
        return None
    if extra_paper and x_key == "policy":
        return "paper's numbers: hollow diamonds; hatched bars in the paper's subplot"
    return "paper's numbers: hollow diamonds"


def draw(result):
    """The figure of one result."""
    exp = result["experiment"]
    panels = sides(result)
    kind = exp["plot"]
    extra_paper = (kind == "latency" and result["settings"]["scale"] != 1 and
                   any(paper_latency(p) for p in result["points"]))
    if kind == "fetched":
        cols = len(ordered(p["panel"] for p in result["points"]))
        fig, grid = plt.subplots(len(panels), cols, figsize=(5.5 * cols, 4 * len(panels)),
                                 squeeze=False)
        for (side, label), row in zip(panels, grid):
            for ax in row:
                ax.set_title(label, fontsize=8)
        plot_fetched(result, [(side, row) for (side, _), row in zip(panels, grid)])
    else:
        count = len(panels) + (1 if extra_paper else 0)
        fig, grid = plt.subplots(1, count, figsize=(6 * count, 4.5), squeeze=False)
        axes = list(grid[0])
        axes_for = [(side, ax) for (side, _), ax in zip(panels, axes)]
        for (_, label), ax in zip(panels, axes):
            ax.set_title(label, fontsize=8)
        if extra_paper:
            axes[-1].set_title("paper (RTX A6000, PCIe 3.0), %s" % exp["paper_source"],
                               fontsize=7)
            axes_for.append(("paper", axes[-1]))
        {"latency": plot_latency, "speedup": plot_speedup, "block": plot_block,
         "ttft": plot_ttft, "transfer": plot_transfer}[kind](
            result, axes_for)
    has_paper = any(p["paper"] for p in result["points"])
    note = paper_note(kind, exp["x"], extra_paper) if has_paper else None
    fig.suptitle("%s: %s\n(%scommit %s)" % (
        exp["figure"], exp["title"], note + "; " if note else "", result["commit"]), fontsize=10)
    fig.tight_layout()
    return fig


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench.py RESULT.json OUT.png")
    with open(sys.argv[1]) as f:
        result = json.load(f)
    if not sides(result):
        sys.exit("plot_bench.py: %s has no measured or predicted point" % sys.argv[1])
    draw(result).savefig(sys.argv[2], dpi=110, format="png")


if __name__ == "__main__":
    main()
