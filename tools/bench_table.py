#!/usr/bin/env python3
"""Prints `infinigen bench` results as Markdown tables (the ones in docs/reproduction.md).

Usage: bench_table.py PREDICTED.json [MEASURED.json]

PREDICTED.json: a run with --predict for the paper's hardware at scale 1 (e.g. --no-measure
--predict rtx-a6000-pcie3). MEASURED.json (optional): a run on this machine with --predict for
its own profile, whose decode latencies validate the cost model. Standard library only.
"""

import json
import sys


def fmt(value, digits=3):
    if value is None or value == "":
        return "-"
    if isinstance(value, str):
        return value
    if value == 0:
        return "-"
    if abs(value) >= 100:
        return "%.0f" % value
    return "%.*g" % (digits, value)


def paper_columns(points):
    keys = []
    for p in points:
        for k in p["paper"]:
            if k not in keys:
                keys.append(k)
    return keys


def derived(side, metric):
    """A metric of one side (measured or predicted), including the shares the plots derive."""
    if side is None:
        return None
    if metric == "transfer_share":
        return side["block_transfer_s"] / side["block_s"] if side["block_s"] else None
    return side.get(metric)


def predicted_table(result):
    points = result["points"]
    paper = paper_columns(points)
    head = ["point", "policy", "prefill s", "decode s", "tok/s", "H2D MiB/step",
            "speedup vs full", "block transfer share"]
    for k in paper:
        head += ["paper " + k, "predicted " + k, "ratio"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        m = p.get("predicted")
        label = ("%s %s" % (p["panel"], p["x"])).strip()
        if m is None:
            rows.append("| %s | %s | %s |" % (label, p["policy"], p["prediction_status"]) +
                        " |" * (len(head) - 3))
            continue
        cells = [label, p["policy"], fmt(m["prefill_s"]), fmt(m["decode_s"]),
                 fmt(m["throughput_tok_s"]), fmt(m["h2d_bytes_per_step"] / 2**20),
                 fmt(m.get("speedup_vs_full")), fmt(derived(m, "transfer_share"))]
        for k in paper:
            ours = derived(m, k)
            theirs = p["paper"].get(k)
            cells += [fmt(theirs), fmt(ours) if theirs is not None else "-",
                      fmt(ours / theirs) if theirs and ours else "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def validation_table(result):
    head = ["point", "policy", "ran (B, prompt+gen, layers x heads)", "measured decode s",
            "predicted decode s", "error", "measured tok/s", "fetched share"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    worst = 0.0
    for p in result["points"]:
        m, q = p.get("measured"), p.get("predicted")
        label = ("%s %s" % (p["panel"], p["x"])).strip()
        ran = p["ran"]
        shape = "%d, %d+%d, %dx%d" % (ran["batch"], ran["prompt_len"], ran["gen_len"],
                                      p["ran_model"]["layers"], p["ran_model"]["heads"])
        if m is None or q is None:
            rows.append("| %s | %s | %s | %s | | | | |" % (label, p["policy"], shape, p["status"]))
            continue
        err = p.get("decode_error", q["decode_s"] / m["decode_s"] - 1)
        worst = max(worst, abs(err))
        rows.append("| " + " | ".join([label, p["policy"], shape, fmt(m["decode_s"]),
                                       fmt(q["decode_s"]), "%+.1f%%" % (100 * err),
                                       fmt(m["throughput_tok_s"]),
                                       fmt(m["fetched_fraction"])]) + " |")
    rows.append("")
    rows.append("Largest decode-latency error: %.1f%%." % (100 * worst))
    return "\n".join(rows)


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: bench_table.py PREDICTED.json [MEASURED.json]")
    with open(sys.argv[1]) as f:
        predicted = json.load(f)
    exp = predicted["experiment"]
    print("%s: %s (commit %s; %s)\n" % (exp["figure"], exp["title"], predicted["commit"],
                                       predicted["command"]))
    print(predicted_table(predicted))
    if len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            measured = json.load(f)
        machine = measured["machine"]
        print("\nMeasured on %s (%d threads, %s), scale %g, commit %s (%s):\n" % (
            machine["cpu"], machine["cpu_threads"], machine["device"],
            measured["settings"]["scale"], measured["commit"], measured["command"]))
        print(validation_table(measured))


if __name__ == "__main__":
    main()
