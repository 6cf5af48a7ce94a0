#!/usr/bin/env python3
"""The engine's check on a GPU machine: tests, sanitizers, CUDA == CPU runs, the link, the
gathers, the ops and the throughput points, written as results.json and summary.md.

Run through tools/gpu_check.sh (which says how); this file holds the steps.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["env", "tests", "sanitize", "cli", "bench", "runs"]


class Stopped(Exception):
    """SIGTERM (a lease's or `timeout`'s end): the running command is killed, results are kept."""


def stop(signum, frame):
    raise Stopped()


def log(message):
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command, timeout, env=None, log_file=None):
    """Runs `command`; returns (exit code or 'timeout', seconds, output)."""
    start = time.monotonic()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout, env=env, text=True, errors="replace")
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        code = "timeout"
        output = expired.stdout.decode(errors="replace") if expired.stdout else ""
    seconds = round(time.monotonic() - start, 2)
    if log_file:
        with open(log_file, "a") as out:
            out.write(f"$ {' '.join(map(str, command))}\n{output}\n[exit {code}, {seconds} s]\n\n")
    return code, seconds, output


class Check:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.results = {"quick": args.quick, "steps": {}}
        self.failures = []
        self.build = self.prepare_build()
        self.bin = self.build / "bin"
        self.env = dict(os.environ, INFINIGEN_REQUIRE_GPU="1")
        self.env["LD_LIBRARY_PATH"] = ":".join(
            p for p in [str(self.build / "lib")] + cuda_library_dirs() +
            [os.environ.get("LD_LIBRARY_PATH", "")] if p)
        self.sanitizer = shutil.which("compute-sanitizer") or next(
            (str(p) for p in Path("/usr/local/cuda/bin").glob("compute-sanitizer")), None)

    # A bundle (tools/gpu_bundle.sh) is unpacked, and the paths its tests were compiled with are
    # linked to this checkout and to the bundle where they do not exist here.
    def prepare_build(self):
        if self.args.build:
            build = Path(self.args.build).resolve()
            if not (build / "bin" / "infinigen").exists():
                sys.exit(f"gpu_check: {build}/bin/infinigen is missing: build it first")
            self.results["build"] = {"dir": str(build)}
            return build
        bundle = Path(self.args.bundle).resolve()
        if not bundle.exists():
            sys.exit(f"gpu_check: no bundle {bundle} (make one with tools/gpu_bundle.sh)")
        build = Path(tempfile.mkdtemp(prefix="infinigen-gpu-"))
        with tarfile.open(bundle) as archive:
            archive.extractall(build, filter="tar") if hasattr(tarfile, "data_filter") \
                else archive.extractall(build)
        info = dict(line.split("=", 1) for line in
                    (build / "build.env").read_text().splitlines() if "=" in line)
        self.results["build"] = info
        source, binary = Path(info["BUILD_SOURCE_DIR"]), Path(info["BUILD_BINARY_DIR"])
        for path, target in ((source, ROOT), (binary, build)):
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.symlink_to(target, target_is_directory=True)
                log(f"linked {path} -> {target} (the tests' compiled-in path)")
        return build

    def step(self, name, result, ok):
        result["ok"] = ok
        self.results["steps"][name] = result
        if not ok:
            self.failures.append(name)
        log(f"{name}: {'ok' if ok else 'FAILED'}")

    # ---- steps ----

    def env_step(self):
        result = {}
        code, _, out = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "pcie.link.gen.max,pcie.link.width.max,clocks.max.sm",
                            "--format=csv,noheader"], 30) if shutil.which("nvidia-smi") \
            else ("missing", 0, "")
        result["gpu"] = out.strip() if code == 0 else f"nvidia-smi: {code}"
        code, _, out = run(["nvidia-smi"], 30) if shutil.which("nvidia-smi") else (1, 0, "")
        match = re.search(r"CUDA Version: *([\d.]+)", out)
        result["driver_cuda"] = match.group(1) if match else None
        code, _, out = run([str(self.bin / "infinigen"), "run", "--device", "cuda", "--gen-len",
                            "1", "--batch", "1", "--policy", "gpu"], 120, self.env,
                           self.logs / "env.log")
        result["device_description_ok"] = code == 0
        missing = []
        for program in sorted(self.bin.iterdir()):
            _, _, out = run(["ldd", str(program)], 30, self.env)
            missing += [f"{program.name}: {line.split()[0]}" for line in out.splitlines()
                        if "not found" in line]
        result["missing_libraries"] = missing
        result["compute_sanitizer"] = self.sanitizer
        self.step("env", result, not missing and code == 0)

    def gpu_tests(self):
        """The gpu-labelled tests: binary -> [test names]."""
        listing = self.build / "gpu-tests.json"
        if listing.exists():
            tests = json.loads(listing.read_text())["tests"]
        else:
            code, _, out = run(["ctest", "--test-dir", str(self.build), "-L", "gpu",
                                "--show-only=json-v1"], 120)
            tests = json.loads(out)["tests"]
        suites = {}
        for test in tests:
            command = test.get("command") or []
            name = next((a.split("=", 1)[1] for a in command if a.startswith("--gtest_filter=")),
                        None)
            if command and name:
                suites.setdefault(Path(command[0]).name, []).append(name)
        return suites

    def tests_step(self):
        result, ok = {"suites": {}}, True
        for suite, names in sorted(self.gpu_tests().items()):
            report = self.logs / f"{suite}.json"
            code, seconds, _ = run([str(self.bin / suite), "--gtest_filter=" + ":".join(names),
                                    f"--gtest_output=json:{report}"],
                                   self.args.test_timeout, self.env, self.logs / "tests.log")
            counts = {"passed": 0, "failed": [], "skipped": [], "not_run": []}
            ran = set()
            if report.exists():
                for group in json.loads(report.read_text()).get("testsuites", []):
                    for case in group.get("testsuite", []):
                        full = f"{group['name']}.{case['name']}"
                        ran.add(full)
                        if case.get("failures"):
                            counts["failed"].append(full)
                        elif case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                            counts["skipped"].append(full)
                        else:
                            counts["passed"] += 1
            counts["not_run"] = sorted(set(names) - ran)
            counts.update(exit=code, seconds=seconds)
            suite_ok = code == 0 and not counts["failed"] and not counts["skipped"] \
                and not counts["not_run"]
            ok = ok and suite_ok
            result["suites"][suite] = counts
            log(f"  {suite}: {counts['passed']} passed, {len(counts['failed'])} failed, "
                f"{len(counts['skipped'])} skipped, {len(counts['not_run'])} not run ({seconds} s)")
        self.step("tests", result, ok)

    def sanitize_step(self):
        if not self.sanitizer:
            self.step("sanitize", {"skipped": "no compute-sanitizer here"}, self.args.quick)
            return
        result, ok = {}, True
        suites = self.gpu_tests()
        # The CLI cases (the engine as a child process) run under memcheck in the `cli` step;
        # here the in-process cases, and for the slower racecheck and synccheck not the whole
        # models either.
        for tool in self.args.sanitizers.split(","):
            for suite, names in sorted(suites.items()):
                names = [n for n in names if not re.search(r"CudaCli|CudaSession", n)]
                if tool != "memcheck":
                    names = [n for n in names if not re.search(r"CudaModel|DecodeAllocation", n)]
                if not names:
                    continue
                code, seconds, out = run(
                    [self.sanitizer, "--tool", tool, "--error-exitcode", "97",
                     "--target-processes", "all", str(self.bin / suite),
                     "--gtest_filter=" + ":".join(names)],
                    self.args.sanitizer_timeout, self.env, self.logs / f"sanitize-{tool}.log")
                summary = re.findall(r"========= (?:ERROR SUMMARY|RACECHECK SUMMARY).*", out)
                result[f"{tool}/{suite}"] = {"exit": code, "seconds": seconds,
                                             "summary": summary[-3:]}
                ok = ok and code == 0
                log(f"  {tool} {suite}: exit {code} ({seconds} s) {summary[-1:] }")
        self.step("sanitize", result, ok)

    def cli_step(self):
        """--device cuda gives the tokens of --device cpu on the checked-in models.

        The exact policies (gpu, full) must give the same tokens. The lossy ones (int4, h2o,
        infinigen) make discrete choices (a 4-bit code, a victim, a top-n') from values the two
        backends round differently (cuBLAS against the CPU's GEMM: about 1e-4 relative), so over
        24 tokens a choice at a near-tie can flip and the text then differs: for them the first
        differing token is recorded, not failed. Their equality is the gpu tests' (CudaCli, on
        prompts without near-ties, and the kernels against the CPU on the same inputs).
        """
        models = [("builtin", []), ("builtin-llama", ["--model", "builtin-llama"]),
                  ("opt-tiny", ["--model", str(ROOT / "tests/fixtures/opt-tiny")])]
        if not self.args.quick:
            # Loads far longer than the layer's compute: a missing wait would read stale rows.
            models.append(("opt-125m b8 512", ["--model", "opt-125m", "--batch", "8",
                                                "--prompt-len", "512"]))
        result, ok = {}, True
        for name, model in models:
            for policy, exact in [("full", True), ("gpu", True), ("int4", False),
                                  ("h2o", False), ("infinigen", False)]:
                outputs = {}
                for device in ["cpu", "cuda"]:
                    command = [str(self.bin / "infinigen"), "run", *model, "--policy", policy,
                               "--device", device, "--temperature", "0", "--gen-len", "24", "--json"]
                    if device == "cuda" and self.sanitizer and not self.args.quick and \
                            "sanitize" in self.args.steps.split(","):
                        command = [self.sanitizer, "--tool", "memcheck", "--error-exitcode",
                                   "97", *command]
                    code, seconds, out = run(command, self.args.test_timeout, self.env,
                                             self.logs / "cli.log")
                    outputs[device] = parse_json_tail(out) if code == 0 else None
                    outputs[device + "_exit"] = code
                ran = all(outputs[d] is not None for d in ("cpu", "cuda"))
                same = ran and tokens_of(outputs["cpu"]) == tokens_of(outputs["cuda"])
                entry = {"same_tokens": same, "exact_policy": exact,
                         "cpu_exit": outputs["cpu_exit"], "cuda_exit": outputs["cuda_exit"]}
                if ran and not same:
                    cpu, cuda = tokens_of(outputs["cpu"]), tokens_of(outputs["cuda"])
                    entry["tokens"] = {"cpu": cpu, "cuda": cuda}
                    entry["first_difference"] = first_difference(cpu, cuda)
                result[f"{name}/{policy}"] = entry
                ok = ok and ran and (same or not exact)
                note = "" if same or exact else \
                    f" (lossy: first differs at token {entry['first_difference']}, recorded)"
                log(f"  {name} {policy}: cuda {'==' if same else '!='} cpu{note}")
        self.step("cli", result, ok)

    def bench_step(self):
        bench = self.bin / "gpu_bench"
        if not bench.exists():
            self.step("bench", {"error": "gpu_bench was not built (libbenchmark-dev missing?)"},
                      False)
            return
        report = self.out / "gpu_bench.json"
        command = [str(bench), f"--benchmark_out={report}", "--benchmark_out_format=json",
                   "--benchmark_counters_tabular=true"]
        command += ["--quick", "--benchmark_min_time=0.01"] if self.args.quick else \
            [f"--benchmark_repetitions={self.args.bench_repetitions}",
             "--benchmark_report_aggregates_only=true", "--benchmark_min_time=0.2"]
        if self.args.bench_filter:
            command.append(f"--benchmark_filter={self.args.bench_filter}")
        code, seconds, out = run(command, self.args.bench_timeout, self.env,
                                 self.logs / "gpu_bench.log")
        rows = []
        if report.exists():
            data = json.loads(report.read_text())
            if "executable" in data.get("context", {}):  # this machine's path, not the repo's
                data["context"]["executable"] = \
                    ("<bundle>" if self.args.bundle else "<build>") + "/bin/gpu_bench"
                report.write_text(json.dumps(data, indent=2))
            for b in data.get("benchmarks", []):
                if b.get("aggregate_name", "median") != "median":
                    continue
                rows.append({"name": b["run_name"], "error": b.get("error_message"),
                             "time": b.get("real_time"), "unit": b.get("time_unit"),
                             "GB/s": (b.get("bytes_per_second") or b.get("GB/s", 0) * 1e9) / 1e9,
                             "TFLOP/s": b.get("TFLOP/s"), "rows": b.get("rows"),
                             "host_ms": b.get("host_ms")})
        errors = [r["name"] for r in rows if r["error"]]
        self.step("bench", {"exit": code, "seconds": seconds, "rows": rows, "errors": errors},
                  code == 0 and rows and not errors)

    def runs_step(self):
        """Throughput at the Fig. 14 point and at batch 8 x 2048 tokens, per policy."""
        if self.args.quick:
            points = [("opt-tiny b4 60+8", ["--model", "opt-tiny", "--batch", "4",
                                           "--prompt-len", "60", "--gen-len", "8"])]
        else:
            gen = str(self.args.gen_len)
            batches = {"fig14": "20", "fig16a": "8"}
            unknown = [p for p in self.args.points.split(",") if p not in batches]
            if unknown:
                sys.exit(f"gpu_check: unknown point {unknown[0]} (points: fig14, fig16a)")
            points = [(f"{name} opt-13b b{batches[name]} 1920+{gen}",
                       ["--model", "opt-13b", "--batch", batches[name], "--prompt-len", "1920",
                        "--gen-len", gen])
                      for name in self.args.points.split(",")]
        result, ok = [], True
        if self.args.model_cache and not self.args.quick:
            points = [(label, self.cached_model(point)) for label, point in points]
        for label, point in points:
            for policy in self.args.policies.split(","):
                command = [str(self.bin / "infinigen"), "run", *point, "--policy", policy,
                           "--device", "cuda", "--json"]
                if self.args.profile_ops:
                    command.append("--profile-ops")
                code, seconds, out = run(command, self.args.run_timeout, self.env,
                                         self.logs / "runs.log")
                row = {"point": label, "policy": policy, "exit": code, "seconds": seconds}
                report = parse_json_tail(out) if code == 0 else None
                if report:
                    steps = max(1, report["gen_len"] - 1)
                    row.update({k: report.get(k) for k in
                                ["prefill_latency_s", "decode_latency_s", "throughput_tok_s",
                                 "decode_throughput_tok_s", "weights_gpu_percent", "transfer",
                                 "op_profile"] if k in report})
                    row["decode_step_ms"] = 1e3 * report["decode_latency_s"] / steps
                else:
                    row["error"] = out.strip().splitlines()[-1] if out.strip() else "no output"
                result.append(row)
                log(f"  {label} {policy}: " + (f"{row['decode_step_ms']:.1f} ms/step"
                                                if report else f"error: {row['error']}"))
                # Each run's row reaches results.json at once: a lease that ends mid-step keeps it.
                self.results["steps"]["runs"] = {"points": result, "ok": False,
                                                 "unfinished": True}
                self.write()
                # A policy the CUDA backend refuses is recorded, not a failure of the check.
                ok = ok and (report is not None or "--device cuda" in row.get("error", ""))
        predicted = {} if self.args.quick or self.args.no_predict else self.predict()
        for row in result:
            batch = re.search(r" b(\d+) ", row["point"]).group(1)
            row.update(predicted.get((batch, row["policy"]), {}))
        self.add_floors(result)
        self.step("runs", {"points": result, "profile": self.profile()}, ok)

    def cached_model(self, point):
        """The point with its preset's synthetic weights written once under --model-cache
        (`infinigen make-model`) and read from there, instead of generated by every run."""
        preset = point[point.index("--model") + 1]
        directory = Path(self.args.model_cache).resolve() / preset
        if not (directory / "config.json").exists():
            code, seconds, out = run([str(self.bin / "infinigen"), "make-model", "--preset", preset,
                                      "--out", str(directory)], self.args.run_timeout, self.env,
                                     self.logs / "runs.log")
            log(f"  wrote {preset}'s synthetic checkpoint to {directory}: exit {code} ({seconds} s)")
            if code != 0:
                return point
        point = list(point)
        point[point.index("--model") + 1] = str(directory)
        return point

    def add_floors(self, rows):
        """Each offloading step's floor: its KV bytes per step over the pinned H2D rate that
        gpu_bench measured in this check, or the `gpu` policy's step at the same point (the
        compute), whichever is larger; where either is missing, the other alone."""
        bench = self.results["steps"].get("bench", {}).get("rows", [])
        rate = next((r["GB/s"] * 1e9 for r in bench
                     if r["name"].startswith("Link/pinned/h2d") and r.get("GB/s")), None)
        compute = {r["point"]: r["decode_step_ms"] for r in rows
                   if r["policy"] == "gpu" and "decode_step_ms" in r}
        for row in rows:
            if row["policy"] == "gpu" or "decode_step_ms" not in row:
                continue
            link = (1e3 * row["transfer"]["h2d_bytes_per_decode_step"] / rate) if rate else None
            parts = [x for x in (link, compute.get(row["point"])) if x is not None]
            if parts:
                row["floor_ms"] = max(parts)
                row["step_over_floor"] = row["decode_step_ms"] / row["floor_ms"]

    def profile(self):
        if self.args.profile != "auto":
            return self.args.profile
        gpu = self.results["steps"].get("env", {}).get("gpu", "")
        for name, profile in (("H200", "h200-pcie5"), ("H100 80GB HBM3", "h100-sxm-pcie5"),
                              ("H100 SXM", "h100-sxm-pcie5"), ("H100", "h100-pcie5"),
                              ("A6000", "rtx-a6000-pcie3")):
            if name in gpu:
                return profile
        return "h100-pcie5"

    def predict(self):
        """The cost model's decode step and prefill for configs/experiments/gpu-check.yaml."""
        out = self.out / "predicted"
        code, _, _ = run([str(self.bin / "infinigen"), "bench", "-e", "gpu-check", "--predict",
                          self.profile(), "--no-measure", "--no-plot", "-o", str(out)],
                         self.args.run_timeout, self.env, self.logs / "predict.log")
        if code != 0 or not (out / "gpu-check.csv").exists():
            return {}
        import csv
        predicted = {}
        with open(out / "gpu-check.csv") as table:
            for r in csv.DictReader(table):
                predicted[(r["batch"], r["policy"])] = {
                    "predicted_prefill_s": float(r["predicted_prefill_s"] or "nan"),
                    "predicted_decode_step_ms": float(r["predicted_decode_step_ms"] or "nan")}
        return predicted

    def write(self):
        # The development machine's paths stay out of results meant for the repository.
        paths = {"BUILD_SOURCE_DIR": "<source>", "BUILD_BINARY_DIR": "<build>", "dir": "<build>"}
        results = dict(self.results,
                       build={k: paths.get(k, v) for k, v in self.results.get("build", {}).items()})
        (self.out / "results.json").write_text(json.dumps(results, indent=1))
        (self.out / "summary.md").write_text(summary_markdown(results))
        log(f"wrote {self.out}/results.json and summary.md")


def cuda_library_dirs():
    """Where cuBLAS may live on a machine with a CUDA toolkit or CUDA's Python wheels."""
    dirs = [str(p) for p in [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/lib")]
            if (p / "libcublas.so.13").exists()]
    for site in sys.path:
        for lib in Path(site).glob("nvidia/cu13/lib") if Path(site).is_dir() else []:
            dirs.append(str(lib))
        for lib in Path(site).glob("nvidia/cublas/lib") if Path(site).is_dir() else []:
            dirs.append(str(lib))
    return dirs


def parse_json_tail(text):
    """The JSON object a command printed (a sanitizer's lines may follow it)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^\{", text, re.M):
        try:
            return decoder.raw_decode(text[match.start():])[0]
        except json.JSONDecodeError:
            continue
    return None


def tokens_of(report):
    return [o.get("tokens", o.get("text")) for o in report.get("outputs", [])]


def first_difference(a, b):
    """The first generated position at which any sequence of two runs differs (None: equal)."""
    positions = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                 for p, q in zip(a, b) if p != q]
    return min(positions) if positions else None


def names(tests, shown=4):
    """A count, and the first few names of a list of tests."""
    if not tests:
        return "0"
    more = f", ... ({len(tests)})" if len(tests) > shown else ""
    return f"{len(tests)}: " + ", ".join(tests[:shown]) + more if more == "" else \
        ", ".join(tests[:shown]) + more


def summary_markdown(results):
    lines = ["# GPU check", ""]
    build = results.get("build", {})
    env = results["steps"].get("env", {})
    lines += [f"- GPU: {env.get('gpu', '?')}; driver's CUDA {env.get('driver_cuda', '?')}",
              f"- build: {build.get('BUILD_COMMIT', build.get('dir', '?'))}, CUDA "
              f"{build.get('BUILD_CUDA', '?')}, sm {build.get('BUILD_ARCHITECTURES', '?')}", ""]
    lines += ["| step | result |", "| --- | --- |"]
    for name, step in results["steps"].items():
        state = "ok" if step["ok"] else "unfinished" if step.get("unfinished") else "FAILED"
        lines.append(f"| {name} | {state} |")
    tests = results["steps"].get("tests")
    if tests:
        lines += ["", "| suite | passed | failed | skipped | not run | s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for suite, c in tests["suites"].items():
            lines.append(f"| {suite} | {c['passed']} | {names(c['failed'])} | "
                         f"{names(c['skipped'])} | {names(c['not_run'])} | {c['seconds']} |")
    cli = results["steps"].get("cli")
    if cli:
        lines += ["", "| --device cuda against --device cpu | same tokens | first difference |",
                  "| --- | --- | --- |"]
        for case, r in cli.items():
            if not isinstance(r, dict) or "same_tokens" not in r:
                continue
            same = "yes" if r["same_tokens"] else ("no" if r["exact_policy"] else "no (lossy)")
            lines.append(f"| {case} | {same} | {r.get('first_difference', '')} |")
    bench = results["steps"].get("bench")
    if bench and bench.get("rows"):
        lines += ["", "| benchmark (median) | time | GB/s | TFLOP/s |", "| --- | --- | --- | --- |"]
        for r in bench["rows"]:
            t = f"{r['time']:.4g} {r['unit']}" if r["time"] is not None else r["error"]
            tf = f"{r['TFLOP/s']:.3g}" if r.get("TFLOP/s") else ""
            lines.append(f"| {r['name']} | {t} | {r['GB/s']:.3g} | {tf} |")
    runs = results["steps"].get("runs")
    if runs:
        lines += ["", f"Predictions: the cost model with profile {runs.get('profile')}. Floor: the "
                  "step's KV bytes over the pinned H2D rate, or `gpu`'s step, the larger.", "",
                  "| point | policy | prefill s | predicted | decode ms/step | predicted | floor ms "
                  "| step / floor | tok/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in runs["points"]:
            pp = r.get("predicted_prefill_s")
            pd = r.get("predicted_decode_step_ms")
            pp = f"{pp:.3f}" if pp is not None else ""
            pd = f"{pd:.2f}" if pd is not None else ""
            floor = f"{r['floor_ms']:.2f} | {r['step_over_floor']:.2f}" if "floor_ms" in r else " | "
            if "decode_step_ms" in r:
                lines.append(f"| {r['point']} | {r['policy']} | {r['prefill_latency_s']:.3f} | {pp} "
                             f"| {r['decode_step_ms']:.2f} | {pd} | {floor} | "
                             f"{r['throughput_tok_s']:.1f} |")
            else:
                lines.append(f"| {r['point']} | {r['policy']} | {r.get('error')} | {pp} | | {pd} "
                             "| | | |")
        for r in runs["points"]:
            decode = (r.get("op_profile") or {}).get("decode")
            if not decode or not decode.get("steps"):
                continue
            per = 1e3 / decode["steps"]
            lines += ["", f"{r['point']} {r['policy']}, a decode step op by op (--profile-ops; "
                      f"{decode['seconds'] * per:.2f} ms a step):", "",
                      "| op | ms a step | calls a step |", "| --- | --- | --- |"]
            lines += [f"| {o['name']} | {o['seconds'] * per:.3f} | {o['calls'] / decode['steps']:.1f} |"
                      for o in decode["ops"][:12]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", help="archive from tools/gpu_bundle.sh")
    where.add_argument("--build", help="a CUDA build directory made on this machine")
    parser.add_argument("--out", default="gpu-check", help="output folder")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, no sanitizers: checks the script (the emulated device)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--policies", default="gpu,full,int4,h2o,infinigen")
    parser.add_argument("--profile", default="auto",
                        help="hardware profile of the predictions (auto: from the GPU's name)")
    parser.add_argument("--points", default="fig14,fig16a",
                        help="throughput points, in this order: fig14 (batch 20), fig16a (batch 8)")
    parser.add_argument("--model-cache",
                        help="folder where the points' synthetic checkpoint is written once and "
                             "read by every run (default: each run generates the weights)")
    parser.add_argument("--bench-repetitions", type=int, default=5,
                        help="gpu_bench repetitions of each benchmark (the median is kept)")
    parser.add_argument("--bench-filter", help="gpu_bench's --benchmark_filter (default: all)")
    parser.add_argument("--sanitizers", default="memcheck,racecheck,synccheck",
                        help="compute-sanitizer tools of the sanitize step")
    parser.add_argument("--profile-ops", action="store_true",
                        help="throughput runs with `infinigen run --profile-ops`: each policy's "
                             "decode step op by op (an event per op: steps a little longer)")
    parser.add_argument("--no-predict", action="store_true",
                        help="no cost-model predictions beside the throughput points")
    parser.add_argument("--gen-len", type=int, default=16,
                        help="generated tokens of the throughput runs (the step time is per token)")
    parser.add_argument("--test-timeout", type=int, default=600)
    parser.add_argument("--sanitizer-timeout", type=int, default=300)
    parser.add_argument("--bench-timeout", type=int, default=400)
    parser.add_argument("--run-timeout", type=int, default=400)
    args = parser.parse_args()
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        sys.exit(f"gpu_check: unknown step {unknown[0]} (steps: {', '.join(STEPS)})")
    check = Check(args)
    signal.signal(signal.SIGTERM, stop)
    for name in steps:
        log(f"step {name}")
        try:
            getattr(check, f"{name}_step")()
        except Stopped:  # subprocess.run killed the step's command on its way out
            log(f"stopped (SIGTERM) during step {name}: the results so far are kept")
            check.results["stopped_during"] = name
            check.write()
            return 124
        except Exception as error:  # one broken step must not lose the others' results
            check.step(name, {"error": repr(error)}, False)
        check.write()
    if check.failures:
        log(f"FAILED: {', '.join(check.failures)}")
        return 1
    log("all steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
