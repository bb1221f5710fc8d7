"""Failure-free step time of the reference GPT: through the public API vs the executor before it.

The same job runs with this checkout and with a baseline revision of ReCoVer
(default cb516f3, the last commit before `recover.trainer`'s public API and the
per-dtype gradient buckets), alternating which goes first, `--pairs` times, and
the ratio of the median step times (summary.json's `step_time.median_s`) is
reported per pair and overall, with the ratio of the CPU seconds the whole job
used (every process of it, reaped: robust to how the 2 cores were shared).
The baseline is exported with `git archive` and run from a shim package
folder on PYTHONPATH, under the same interpreter and installed dependencies,
so the only difference is ReCoVer's own code.

    python bench/scripts/api_overhead.py --out bench/results/api-overhead
    python bench/scripts/api_overhead.py --size 9.5M --reduce exact --pairs 3 --out ...

Run it on an otherwise idle machine: it measures a few percent.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from recover.bench.env import environment

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("proto", "controller", "agent", "trainer", "cli", "common", "bench")
"""recover.<name> -> <name>/ in the baseline revision (its pyproject's package-dir)."""
SIZES = {
    "demo": ["--replicas", "4", "-M", "16", "-B", "8", "--steps", "40"],
    "9.5M": ["--replicas", "2", "-M", "8", "-B", "8", "--steps", "12",
             "--n-layer", "3", "--n-embd", "512", "--n-head", "8"],
}


def export_baseline(revision: str, into: Path) -> Path:
    """The baseline's source tree plus a shim folder that makes `recover.*` import from it."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision],
                             capture_output=True, check=True).stdout
    tree = into / "tree"
    tree.mkdir()
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(tree, filter="data")
    package = into / "shim" / "recover"
    package.mkdir(parents=True)
    # A regular package found on PYTHONPATH wins over the editable install's finder,
    # which sys.meta_path consults after the path finder.
    (package / "__init__.py").write_text("")
    for name in PACKAGES:
        (package / name).symlink_to(tree / name, target_is_directory=True)
    return into / "shim"


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(out: Path, args: list[str], shim: Path | None) -> tuple[dict[str, object], float]:
    """The run's summary and the CPU seconds its processes used (all reaped by then)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if shim is not None:
        env["PYTHONPATH"] = str(shim)
    cmd = [sys.executable, "-m", "recover.cli.main", "run", "--quiet", "--out", str(out), *args]
    before = children_cpu_s()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    cpu_s = children_cpu_s() - before
    if result.returncode != 0:
        raise SystemExit(f"{'baseline' if shim else 'current'} run failed: {result.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    # Proof of which code ran: only the public-API version reports its workload.
    assert ("workload" in summary) == (shim is None), "ran the wrong revision"
    return summary, cpu_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--baseline", default="cb516f3", help="git revision to compare with")
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--reduce", choices=["fast", "exact"], default="fast")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = [*SIZES[args.size], "--reduce", args.reduce, "--seed", "1"]
    pairs = []
    with tempfile.TemporaryDirectory(prefix="recover-baseline-") as tmp:
        shim = export_baseline(args.baseline, Path(tmp))
        for i in range(args.pairs):
            order = ["current", "baseline"] if i % 2 == 0 else ["baseline", "current"]
            medians, cpu = {}, {}
            for which in order:
                summary, cpu[which] = run(out / f"{which}-{i}", job,
                                          None if which == "current" else shim)
                medians[which] = summary["step_time"]["median_s"]  # type: ignore[index]
            ratio = medians["current"] / medians["baseline"]
            cpu_ratio = cpu["current"] / cpu["baseline"]
            pairs.append({"pair": i, "first": order[0], **medians, "ratio": round(ratio, 4),
                          "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
                          "cpu_ratio": round(cpu_ratio, 4)})
            print(f"pair {i}: current {medians['current'] * 1000:.1f} ms, baseline "
                  f"{medians['baseline'] * 1000:.1f} ms, ratio {ratio:.3f}; CPU "
                  f"{cpu['current']:.1f} s vs {cpu['baseline']:.1f} s, ratio {cpu_ratio:.3f}",
                  flush=True)
    ratios = [p["ratio"] for p in pairs]
    cpu_ratios = [p["cpu_ratio"] for p in pairs]
    result = {
        "benchmark": "api_overhead", "size": args.size, "reduce": args.reduce,
        "baseline": args.baseline, "job_args": job, "pairs": pairs,
        "median_ratio": round(statistics.median(ratios), 4),
        "min_ratio": min(ratios), "max_ratio": max(ratios),
        "median_cpu_ratio": round(statistics.median(cpu_ratios), 4),
        "environment": environment(), "finished_at": time.time(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"median ratio current/baseline {result['median_ratio']:.3f} "
          f"(range {result['min_ratio']:.3f}-{result['max_ratio']:.3f}) over {len(pairs)} pairs; "
          f"CPU seconds ratio {result['median_cpu_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
