"""Same-machine A/B of the GDN kernels: the working tree's extension against a reference tree
(benchmarks/ab_prepare.sh), each timed by bench_kernels.bench_gdn in its own process, the two
alternating for --rounds rounds. Prints µs per op and batch (median over rounds) and new / ref.

On the device, in one call (both builds share the 16 cores):
    (cd build/ab/ref && python3 setup.py build_ext --inplace -j 8) &
    python3 setup.py build_ext --inplace -j 8; wait
    python3 benchmarks/ab_gdn.py --batches 1,8,64,256 --rounds 2 [--env DS_PDL=0] --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("gdn_decode", "gdn_verify", "gdn_replay_verify", "gdn_replay")
CHILD = """
import json, sys, torch
sys.path.insert(0, {bench!r})
import bench_kernels as bk
from deltaserve.ops._ext import extension_loaded
assert extension_loaded(), "extension not built in " + {path!r}
out = {{}}
for n in {batches!r}:
    r = bk.bench_gdn(n, {rows})
    out[n] = {{op: r[op] for op in {ops!r}}}
    torch.cuda.empty_cache()
print(json.dumps(out))
"""


def run(python_dir: str, batches: list[int], rows: int, env: dict[str, str]) -> dict:
    """µs per op and batch from one process importing deltaserve from `python_dir`."""
    code = CHILD.format(bench=os.path.join(ROOT, "benchmarks"), path=python_dir, batches=batches,
                        rows=rows, ops=OPS)
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [python_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True, check=True)
    return {int(n): v for n, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=os.path.join(ROOT, "build/ab/ref/python"))
    parser.add_argument("--new", default=os.path.join(ROOT, "python"))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--rows", type=int, default=4, help="verify rows (k + 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for both builds (repeatable), e.g. DS_PDL=0")
    parser.add_argument("--out", default="ab_gdn.json")
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]
    env = dict(kv.split("=", 1) for kv in args.env)
    runs: dict[str, list[dict]] = {"ref": [], "new": []}
    for _ in range(args.rounds):
        for side, path in (("ref", args.ref), ("new", args.new)):
            runs[side].append(run(path, batches, args.rows, env))
    table = {side: {n: {op: statistics.median(r[n][op] for r in rs) for op in OPS}
                    for n in batches} for side, rs in runs.items()}
    ref_id = os.path.join(os.path.dirname(args.ref), "REF")
    print(f"ref {open(ref_id).read().strip() if os.path.exists(ref_id) else args.ref} vs "
          f"working tree, {args.rounds} rounds, env {env or '-'}; µs ref -> new (new/ref)")
    for op in OPS:
        cells = [f"B={n} {table['ref'][n][op]:.2f} -> {table['new'][n][op]:.2f} "
                 f"({table['new'][n][op] / table['ref'][n][op]:.3f})" for n in batches]
        print(f"{op:<18}" + "; ".join(cells))
    with open(args.out, "w") as f:
        json.dump({"env": env, "rounds": runs, "median": table}, f, indent=1)


if __name__ == "__main__":
    main()
