#!/usr/bin/env python3
"""Runs a command and samples its resident memory (VmRSS) while it runs: is host memory flat?

Prints the resident memory at each tenth of the run and its growth over the second half (a
capped KV pool fills in the first part), then the command's exit status. Linux only (reads /proc).

  tools/soak_rss.py -- build/release/bin/infinigen run --policy infinigen \\
      --kv-pool-limit 0.25 --prompt-len 64 --gen-len 1900 --batch 4
"""
import argparse
import statistics
import subprocess
import sys
import time


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")

    start = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    samples: list[tuple[float, float]] = []
    while child.poll() is None:
        value = rss_mib(child.pid)
        if value is not None:
            samples.append((time.monotonic() - start, value))
        time.sleep(args.interval)
    elapsed = time.monotonic() - start
    if len(samples) < 10:
        print(f"soak_rss: only {len(samples)} samples in {elapsed:.1f} s; run something longer",
              file=sys.stderr)
        return 1

    tenths = [[rss for t, rss in samples if i * elapsed / 10 <= t < (i + 1) * elapsed / 10]
              for i in range(10)]
    print(f"{len(samples)} samples over {elapsed:.1f} s; resident memory (MiB) per tenth of the run:")
    print("tenth  median     max")
    for i, values in enumerate(tenths):
        if values:
            print(f"{i + 1:5d} {statistics.median(values):7.1f} {max(values):7.1f}")
    # A capped pool fills during the first part of the run; after that memory must stay flat.
    growth = statistics.median(tenths[9]) - statistics.median(tenths[5])
    print(f"peak {max(v for _, v in samples):.1f} MiB; median of the last tenth minus the sixth: "
          f"{growth:+.1f} MiB")
    print(f"command exited with {child.returncode}")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
