"""Same-machine A/B of the recurrent-state kernels: builds of the extension (the working tree, a
reference tree from benchmarks/ab_prepare.sh, variant trees made the same way), each timed in its
own process by bench_kernels.bench_gdn (and bench_conv with --conv), the configurations taking
turns for --rounds rounds. Prints µs per op and batch (median over rounds) and each
configuration's ratio to the first.

On the device, in one call (the builds share the 16 cores):
    (cd build/ab/ref && python3 setup.py build_ext --inplace -j 8) &
    python3 setup.py build_ext --inplace -j 8; wait
    python3 benchmarks/ab_gdn.py --batches 1,8,64,256 --rounds 2 [--env DS_PDL=0] --out ab.json
Several builds or environments (session 10 compared six variant trees this way):
    python3 benchmarks/ab_gdn.py --config ref=build/ab/ref/python --config new=python \\
        --config nopdl=python,DS_PDL=0 --conv
Some ops only (--ops; gdn_decode alone is timed alone, conv ops always all three, the other
GDN ops together; session 18 compared seven decode configurations so):
    python3 benchmarks/ab_gdn.py --ops gdn_decode --config ref=build/ab/ref/python \\
        --config new=python --config t4=python,DS_GDN_TILES=4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GDN_OPS = ("gdn_decode", "gdn_verify", "gdn_replay_verify", "gdn_replay")
CONV_OPS = ("conv_update", "conv_verify", "conv_commit")
CHILD = """
import json, sys, torch
sys.path.insert(0, {bench!r})
import bench_kernels as bk
from deltaserve.ops._ext import extension_loaded
assert extension_loaded(), "extension not built in " + {path!r}
out = {{}}
ops = {ops!r}
for n in {batches!r}:
    r = bk.bench_gdn(n, {rows}, ops) if set(ops) & set({gdn_ops!r}) else {{}}
    if set(ops) & set({conv_ops!r}):
        r.update(bk.bench_conv(n, {rows}))
    out[n] = {{op: r[op] for op in ops}}
    torch.cuda.empty_cache()
print(json.dumps(out))
"""


def run(python_dir: str, batches: list[int], rows: int, env: dict[str, str],
        ops: tuple[str, ...] = GDN_OPS) -> dict:
    """µs per op (of `ops`) and batch from one process importing deltaserve from `python_dir`.

    Exits (SystemExit) with the child's last stderr lines when it fails (say, no CUDA device or
    an unbuilt tree)."""
    code = CHILD.format(bench=os.path.join(ROOT, "benchmarks"), path=python_dir, batches=batches,
                        rows=rows, ops=tuple(ops), gdn_ops=GDN_OPS, conv_ops=CONV_OPS)
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [python_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True)
    if done.returncode != 0:  # say why (no GPU, an unbuilt tree, a missing build/ab/ref)
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise SystemExit(f"ab_gdn: timing {python_dir} failed (exit {done.returncode}):\n{tail}")
    return {int(n): v for n, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def parse_config(spec: str, common: dict[str, str]) -> tuple[str, str, dict[str, str]]:
    """LABEL=PYTHON_DIR[,NAME=VALUE...] -> (label, python dir, environment)."""
    label, _, rest = spec.partition("=")
    path, *pairs = rest.split(",")
    if not label or not path or any("=" not in kv for kv in pairs):
        raise SystemExit(f"--config {spec!r}: expected LABEL=PYTHON_DIR[,NAME=VALUE...]")
    return label, path, dict(common, **dict(kv.split("=", 1) for kv in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=os.path.join(ROOT, "build/ab/ref/python"))
    parser.add_argument("--new", default=os.path.join(ROOT, "python"))
    parser.add_argument("--config", action="append", default=[],
                        help="LABEL=PYTHON_DIR[,NAME=VALUE...] (repeatable; replaces --ref/--new)")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--rows", type=int, default=4, help="verify rows (k + 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conv", action="store_true", help="also time the conv1d ops")
    parser.add_argument("--ops", default="",
                        help="time only these ops, comma-separated, of "
                             + ", ".join(GDN_OPS + CONV_OPS) + " (replaces --conv)")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for every configuration (repeatable), e.g. DS_PDL=0")
    parser.add_argument("--out", default="ab_gdn.json")
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.config:
        configs = [parse_config(spec, env) for spec in args.config]
    else:
        ref_id = os.path.join(os.path.dirname(args.ref), "REF")
        ref = open(ref_id).read().strip() if os.path.exists(ref_id) else "ref"
        configs = [(ref, args.ref, env), ("new", args.new, env)]
    ops = GDN_OPS + (CONV_OPS if args.conv else ())
    if args.ops:
        ops = tuple(op for op in args.ops.split(",") if op)
        unknown = set(ops) - set(GDN_OPS + CONV_OPS)
        if not ops:
            raise SystemExit("--ops: no op named")
        if unknown:
            raise SystemExit(f"--ops: unknown {sorted(unknown)}; known {GDN_OPS + CONV_OPS}")
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    for k in range(args.rounds):
        for label, path, cfg_env in configs:
            t0 = time.perf_counter()
            runs[label].append(run(path, batches, args.rows, cfg_env, ops))
            # each run as it ends, so a call cut short by its time limit still reports
            print(f"round {k + 1} {label} ({time.perf_counter() - t0:.0f} s): "
                  + json.dumps(runs[label][-1]), flush=True)
    table = {label: {n: {op: statistics.median(r[n][op] for r in rs) for op in ops}
                     for n in batches} for label, rs in runs.items()}
    first = configs[0][0]
    print(f"{args.rounds} rounds; µs per call (ratio to {first})")
    for op in ops:
        for n in batches:
            base = table[first][n][op]
            cells = [f"{label} {table[label][n][op]:.2f}"
                     + ("" if label == first else f" ({table[label][n][op] / base:.3f})")
                     for label, _, _ in configs]
            print(f"{op:<18} B={n:<4} " + "  ".join(cells))
    with open(args.out, "w") as f:
        json.dump({"configs": [{"label": lb, "python": p, "env": e} for lb, p, e in configs],
                   "rounds": runs, "median": table}, f, indent=1)


if __name__ == "__main__":
    main()
