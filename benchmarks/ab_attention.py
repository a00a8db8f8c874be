"""Same-machine A/B of the paged attention kernels: builds of the extension (the working tree, a
reference tree from benchmarks/ab_prepare.sh, variant environments), each timed in its own
process by bench_attention.bench_case (CUDA-graph replays, the engine's max_kv_len grid; the
gather path left out; --append: kv_append + attention, the engine's step), the configurations
taking turns for --rounds rounds. Prints µs per call and % of the copy bandwidth over the KV
bytes (median over rounds), each configuration's ratio to the first, and verify / decode
where both row counts are timed.

On the device, in one call (the builds share the 16 cores):
    bash benchmarks/ab_prepare.sh main ref          # here, before the call; carry build/ab
    (cd build/ab/ref && python3 setup.py build_ext --inplace -j 8) &
    python3 setup.py build_ext --inplace -j 8; wait
    python3 benchmarks/ab_attention.py --rounds 2 --out ab_attn.json
Environment variants of one build (DS_ATTN_BLOCKS_PER_SM: the split grid's blocks per SM;
DS_PDL=0: no programmatic dependent launch):
    python3 benchmarks/ab_attention.py --config ref=build/ab/ref/python --config new=python \\
        --config b2=python,DS_ATTN_BLOCKS_PER_SM=2 --config nopdl=python,DS_PDL=0
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

from ab_gdn import parse_config  # LABEL=PYTHON_DIR[,NAME=VALUE...], as for the GDN kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import json, sys, torch
sys.path.insert(0, {bench!r})
import bench_attention as ba
from bench_kernels import copy_bandwidth
from deltaserve.ops._ext import extension_loaded
assert extension_loaded(), "extension not built in " + {path!r}
gen = torch.Generator(device="cuda").manual_seed(0)
copy = copy_bandwidth()
out = []
for b, ctx, rows, ps in {cases!r}:
    r = ba.bench_case(b, ctx, rows, ps, {chain}, copy, 0.0, gen, {append})
    out.append([b, ctx, rows, ps, r["kernel_us"], r["frac_of_copy"]])
    torch.cuda.empty_cache()
print(json.dumps(out))
"""


def run(python_dir: str, cases: list[tuple], chain: int, env: dict[str, str],
        append: bool = False) -> dict:
    """{(batch, ctx, rows, page size): (µs, fraction of copy bandwidth)} from one process
    importing deltaserve from `python_dir`. Exits (SystemExit) with the child's last stderr
    lines when it fails (no CUDA device, an unbuilt tree)."""
    code = CHILD.format(bench=os.path.join(ROOT, "benchmarks"), path=python_dir, cases=cases,
                        chain=chain, append=append)
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [python_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise SystemExit(f"ab_attention: timing {python_dir} failed (exit {done.returncode}):"
                         f"\n{tail}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    return {tuple(r[:4]): (r[4], r[5]) for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=os.path.join(ROOT, "build/ab/ref/python"))
    ap.add_argument("--new", default=os.path.join(ROOT, "python"))
    ap.add_argument("--config", action="append", default=[],
                    help="LABEL=PYTHON_DIR[,NAME=VALUE...] (repeatable; replaces --ref/--new)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="128,2048,8192,32768")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--append", action="store_true", help="time kv_append + attention")
    ap.add_argument("--env", action="append", default=[],
                    help="NAME=VALUE for every configuration (repeatable)")
    ap.add_argument("--out", default="ab_attention.json")
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.config:
        configs = [parse_config(spec, env) for spec in args.config]
    else:
        ref_id = os.path.join(os.path.dirname(args.ref), "REF")
        ref = open(ref_id).read().strip() if os.path.exists(ref_id) else "ref"
        configs = [(ref, args.ref, env), ("new", args.new, env)]
    ints = [[int(x) for x in a.split(",") if x]
            for a in (args.batches, args.contexts, args.rows, args.page_sizes)]
    cases = [(b, c, r, ps) for ps, b, c, r in itertools.product(ints[3], ints[0], ints[1],
                                                                 ints[2])]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    for k in range(args.rounds):
        for label, path, cfg_env in configs:
            t0 = time.perf_counter()
            runs[label].append(run(path, cases, args.chain, cfg_env, args.append))
            print(f"round {k + 1} {label} ({time.perf_counter() - t0:.0f} s)", flush=True)
    med = {label: {c: (statistics.median(r[c][0] for r in rs),
                       statistics.median(r[c][1] for r in rs)) for c in cases}
           for label, rs in runs.items()}
    first = configs[0][0]
    print(f"{args.rounds} rounds; µs per call, % of copy bandwidth (ratio to {first}; "
          f"verify / decode)")
    for c in cases:
        b, ctx, rows, ps = c
        cells = []
        for label, _, _ in configs:
            us, frac = med[label][c]
            cell = f"{label} {us:8.2f} {100 * frac:5.1f}%"
            if label != first:
                cell += f" ({us / med[first][c][0]:.3f})"
            decode = med[label].get((b, ctx, 1, ps))
            if rows != 1 and decode:
                cell += f" v/d {us / decode[0]:.2f}"
            cells.append(cell)
        print(f"ps {ps:<3} B={b:<4} ctx {ctx:<6} R={rows}  " + "  ".join(cells), flush=True)
    with open(args.out, "w") as f:
        json.dump({"configs": [{"label": lb, "python": p, "env": e} for lb, p, e in configs],
                   "median": {label: [[*c, *v] for c, v in m.items()] for label, m in med.items()}},
                  f, indent=1)


if __name__ == "__main__":
    main()
