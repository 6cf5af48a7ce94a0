#!/usr/bin/env python3
"""Decode step time of the `full` policy under an emulated PCIe link, against its parts.

Runs `infinigen run` three ways on the same request, each --repeats times (medians reported):
  compute   --policy gpu, no link emulation: KV resident, the step is pure compute (C);
  full      --policy full with --emulate-link-gbps G: the step (S) and the time the load stream
            spent transferring (T), both measured by the runtime;
  infinigen --policy infinigen with the same link: its step and bytes, for comparison;
and prints S against max(C, T) (perfect overlap) and C + T (no overlap), as Markdown.

    tools/bench_link_overlap.py --binary build/release/bin/infinigen --gbps 12

Standard library only.
"""

import argparse
import json
import platform
import statistics
import subprocess


def run(binary, args):
    out = subprocess.run([binary, "run", "--json", "--stats", *args], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def decode_medians(report):
    steps = report["steps"][1:]  # steps[0] is the prefill
    return {
        "step_s": statistics.median(s["seconds"] for s in steps),
        "load_busy_s": statistics.median(s["load_busy_s"] for s in steps),
        "load_wait_s": statistics.median(s["load_wait_s"] for s in steps),
        "h2d_bytes": statistics.median(s["h2d_bytes"] for s in steps),
    }


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/release/bin/infinigen")
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=9)
    parser.add_argument("--gbps", type=float, default=12.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    common = ["--model", args.model, "--batch", str(args.batch), "--prompt-len",
              str(args.prompt_len), "--gen-len", str(args.gen_len)]
    compute, full, infinigen = [], [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        compute.append(decode_medians(run(args.binary, common + ["--policy", "gpu"])))
        full.append(decode_medians(run(args.binary, common + [
            "--policy", "full", "--emulate-link-gbps", str(args.gbps)])))
        infinigen.append(decode_medians(run(args.binary, common + [
            "--policy", "infinigen", "--emulate-link-gbps", str(args.gbps)])))

    C = statistics.median(r["step_s"] for r in compute)
    S = statistics.median(r["step_s"] for r in full)
    T = statistics.median(r["load_busy_s"] for r in full)
    W = statistics.median(r["load_wait_s"] for r in full)
    moved = statistics.median(r["h2d_bytes"] for r in full)
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"Machine: {cpu_name()}, {cores} cores, CPU backend; link emulated at {args.gbps} GB/s.")
    print(f"Request: {args.model}, batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.gen_len - 1} decode steps; medians of {args.repeats} interleaved runs.\n")
    print("| quantity | ms per decode step |")
    print("|---|---|")
    print(f"| compute C (`--policy gpu`, no link) | {1e3 * C:.2f} |")
    print(f"| transfer T (load stream busy, `full`) | {1e3 * T:.2f} "
          f"({moved / 2**20:.1f} MiB/step) |")
    print(f"| step S (`--policy full`) | {1e3 * S:.2f} |")
    print(f"| max(C, T): perfect overlap | {1e3 * max(C, T):.2f} |")
    print(f"| C + T: no overlap | {1e3 * (C + T):.2f} |")
    print(f"| compute stalled on loads | {1e3 * W:.2f} |")
    I = statistics.median(r["step_s"] for r in infinigen)
    I_moved = statistics.median(r["h2d_bytes"] for r in infinigen)
    print(f"| step with `--policy infinigen` | {1e3 * I:.2f} ({I_moved / 2**20:.1f} MiB/step) |")
    print(f"\nS / max(C, T) = {S / max(C, T):.2f}; S / (C + T) = {S / (C + T):.2f}")


if __name__ == "__main__":
    main()
