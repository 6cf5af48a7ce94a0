#!/usr/bin/env python3
"""Prints `infinigen eval` results (eval.json) as Markdown tables, as docs/accuracy.md shows them.

Usage: eval_table.py eval.json [--chunks]

One row per setting: policy, settings, perplexity, change against `full`, KV loaded per decode
step (share of the full KV, all layers and speculated layers), mean and worst-layer recall.
With --chunks, a second table: perplexity per chunk of positions, one column per setting.
A passkey result (`--task passkey`) gives instead per setting its score with its 95% interval,
the KV loaded, and its cells under 90% (length/depth: score; the six lowest).
"""

import argparse
import json


def percent(value):
    return "-" if value is None else "%.1f%%" % (100 * value)


def passkey_table(points):
    print("| policy | settings | score | 95% interval | KV loaded | speculated layers | "
          "cells under 90%, the lowest (length/depth: score) |")
    print("|---|---|---|---|---|---|---|")
    for p in points:
        under = sorted((c for c in p["cells"] if c["score"] < 0.9), key=lambda c: c["score"])
        low = ["%d/%g: %d%%" % (c["length"], c["depth"], round(100 * c["score"]))
               for c in under[:6]]
        if len(under) > 6:
            low.append("%d more" % (len(under) - 6))
        print("| %s | %s | %s (%d of %d) | %.1f-%.1f%% | %s | %s | %s |" % (
            p["policy"], p["settings"] or "-", percent(p["score"]), p["correct"], p["trials"],
            100 * p["wilson_low"], 100 * p["wilson_high"], percent(p["kv_fetched"]),
            percent(p["kv_fetched_speculated_layers"]), ", ".join(low) or "none"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result")
    parser.add_argument("--chunks", action="store_true", help="also the per-chunk table")
    args = parser.parse_args()
    with open(args.result, encoding="utf-8") as handle:
        result = json.load(handle)
    points = result["points"]
    if result.get("task") == "passkey":
        passkey_table(points)
        return 0

    print("| policy | settings | perplexity | vs full | KV loaded | speculated layers | recall "
          "(mean / worst layer) |")
    print("|---|---|---|---|---|---|---|")
    for p in points:
        vs_full = "%+.2f%%" % (100 * p["vs_full"]) if "vs_full" in p else "-"
        recall = ("%.3f / %.3f" % (p["mean_recall"], p["min_layer_recall"])
                  if "mean_recall" in p else "-")
        print("| %s | %s | %.3f | %s | %s | %s | %s |" % (
            p["policy"], p["settings"] or "-", p["perplexity"], vs_full,
            percent(p["kv_fetched"]), percent(p["kv_fetched_speculated_layers"]), recall))

    if args.chunks:
        print()
        labels = [p["policy"] + (" " + p["settings"] if p["settings"] else "") for p in points]
        print("| positions | " + " | ".join(labels) + " |")
        print("|---" * (len(points) + 1) + "|")
        chunk = result["chunk"]
        for i, start in enumerate(points[0]["chunk_start"]):
            cells = ["%.2f" % p["chunk_perplexity"][i] for p in points]
            print("| %d-%d | %s |" % (start, start + chunk - 1, " | ".join(cells)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
