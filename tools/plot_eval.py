#!/usr/bin/env python3
"""Draws one `infinigen eval` result (eval.json) as a PNG.

Usage: plot_eval.py eval.json OUT.png

`infinigen eval` runs this itself after writing its JSON; run it by hand to redraw. Needs
matplotlib (Debian: python3-matplotlib).

Perplexity (the default task): left, perplexity against the share of the full KV that the decode
steps loaded, one series per policy (each point one setting, e.g. one alpha), with `full` as a
dashed line; right, perplexity per chunk of positions (the InfiniGen paper's Fig. 12), one curve
per setting.

Passkey (`--task passkey`): one heat map per setting, as needle-in-a-haystack results are drawn:
context length across, the key's depth in the filler down, each cell the share of exact answers.
"""

import json
import math
import sys

from plot_common import POLICY_COLORS, plt


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as handle:
        result = json.load(handle)
    if result.get("task") == "passkey":
        return draw_passkey(result, sys.argv[2])
    points = result["points"]

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    full = [p for p in points if p["policy"] in ("full", "gpu")]
    if full:
        left.axhline(full[0]["perplexity"], color=POLICY_COLORS["full"], linestyle="--",
                     linewidth=1, label="%s (all KV)" % full[0]["policy"])
    for policy in dict.fromkeys(p["policy"] for p in points):
        if policy in ("full", "gpu"):
            continue
        series = sorted((p for p in points if p["policy"] == policy),
                        key=lambda p: p["kv_fetched"])
        xs = [100 * p["kv_fetched"] for p in series]
        ys = [p["perplexity"] for p in series]
        color = POLICY_COLORS.get(policy)
        left.plot(xs, ys, marker="o", color=color, label=policy)
        for p, x, y in zip(series, xs, ys):
            left.annotate(p["settings"], (x, y), fontsize=6, xytext=(3, 3),
                          textcoords="offset points")
    left.set_xlabel("KV loaded per decode step (% of the full KV, all layers)")
    left.set_ylabel("perplexity")
    left.set_title("perplexity against KV loaded")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)

    for p in points:
        label = p["policy"] + (" (" + p["settings"] + ")" if p["settings"] else "")
        right.plot(p["chunk_start"], p["chunk_perplexity"], marker=".",
                   color=POLICY_COLORS.get(p["policy"]) if len(points) <= 5 else None,
                   label=label)
    right.set_xlabel("position of the scored tokens (chunks of %d)" % result["chunk"])
    right.set_ylabel("perplexity of the chunk")
    right.set_title("perplexity along the context")
    right.legend(fontsize=6)
    right.grid(alpha=0.3)

    figure.suptitle("%s: %d windows, %d prefilled + %d decoded tokens (%s)" % (
        result.get("model_name", result["model"]), result["windows"], result["prefill"], result["decode"],
        result["machine"]["device"]), fontsize=9)
    figure.tight_layout()
    figure.savefig(sys.argv[2], dpi=110, format="png")
    return 0


def draw_passkey(result, path) -> int:
    points, lengths, depths = result["points"], result["lengths"], result["depths"]
    columns = min(3, len(points))
    rows = math.ceil(len(points) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(1.2 + 4.4 * columns, 0.8 + 3.4 * rows),
                                squeeze=False, layout="constrained")
    image = None
    for index, point in enumerate(points):
        axis = axes[index // columns][index % columns]
        # scores[d][l]: depth d of the filler (down), length l (across).
        scores = [[math.nan] * len(lengths) for _ in depths]
        for cell in point["cells"]:
            scores[depths.index(cell["depth"])][lengths.index(cell["length"])] = 100 * cell["score"]
        image = axis.imshow(scores, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for d, row in enumerate(scores):
            for l, score in enumerate(row):
                axis.text(l, d, "%.0f" % score, ha="center", va="center", fontsize=7)
        axis.set_xticks(range(len(lengths)), [str(length) for length in lengths], fontsize=7)
        axis.set_yticks(range(len(depths)), ["%g%%" % (100 * depth) for depth in depths],
                        fontsize=7)
        axis.set_xlabel("context length (tokens)", fontsize=8)
        if index % columns == 0:
            axis.set_ylabel("depth of the key in the filler", fontsize=8)
        label = point["policy"] + (" (" + point["settings"] + ")" if point["settings"] else "")
        axis.set_title("%s: %.1f%%, KV loaded %.1f%%" % (label, 100 * point["score"],
                                                          100 * point["kv_fetched"]), fontsize=8)
    for index in range(len(points), rows * columns):
        axes[index // columns][index % columns].axis("off")
    figure.colorbar(image, ax=axes, shrink=0.8, label="exact answers (%)")
    figure.suptitle("%s: passkey retrieval, %d %s keys per cell (%s)" % (
        result.get("model_name", result["model"]), result["trials"], result["key_kind"],
        result["machine"]["device"]), fontsize=9)
    figure.savefig(path, dpi=110, format="png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
