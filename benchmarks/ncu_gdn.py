"""Eager GDN calls at the TARGETS.md shapes for Nsight Compute (no CUDA graph, so ncu sees each
launch), and a summary of the SASS source page ncu exports.

On the device (ncu replays the chosen launch once per metric pass):
    ncu -k regex:verify_kernel --launch-skip 2 --launch-count 1 \\
        --section InstructionStats --section WarpStateStats --section SourceCounters \\
        -o /tmp/v64 python3 benchmarks/ncu_gdn.py run verify 64
    ncu -i /tmp/v64.ncu-rep --page source --csv --print-source sass > $OUT/v64.csv
Here:
    python benchmarks/ncu_gdn.py summary v64.csv
The summary groups instructions by how often they ran: in gdn_verify at B=64 one count is the
row loop (once per warp per tile per row), others the per-tile and per-block work, which is
how session 9 found the integer divisions (RESULTS.md); with each group its main stall reasons
(how session 12 found the per-block staging's share).
"""

from __future__ import annotations

import collections
import csv
import sys


def run(op: str, n: int, reps: int = 4, rows: int = 4) -> None:
    """`reps` eager calls of gdn_decode / gdn_verify / gdn_verify with `rows` rows pending."""
    import os

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import HV, H, K, V, gdn_inputs

    from deltaserve import ops

    pool = torch.randn(n + 1, HV, V, K, device="cuda").mul_(0.1)
    slots = (torch.randperm(n, device="cuda") + 1).int()
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(1, n, None if op == "decode" else rows)
    stash = ops.GDNStash.allocate(1, n, rows, H, HV, K, V, "cuda")
    prev = ops.GDNStash.allocate(1, n, rows, H, HV, K, V, "cuda")
    accepted = torch.full((n,), rows, dtype=torch.int32, device="cuda")
    args = (q[0], k[0], v[0], a[0], b[0], A_log, dt_bias, pool, slots, K ** -0.5)
    for _ in range(reps):
        if op == "decode":
            ops.gdn_decode(*args)
        elif op == "verify":
            ops.gdn_verify(*args, stash, 0)
        elif op == "replay_verify":
            ops.gdn_verify(*args, stash, 0, pending=(prev, accepted))
        else:
            raise SystemExit(f"op must be decode, verify or replay_verify, not {op!r}")
    torch.cuda.synchronize()


def opcode(sass: str) -> str:
    """'@!P0 LDG.E.128 R4, [R2.64]' -> 'LDG' (the predicate and the modifiers dropped)."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def summary(path: str) -> None:
    """Instructions and stall samples of an ncu SASS source page, grouped by execution count."""
    with open(path) as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    ix = {h: i for i, h in enumerate(rows[header])}
    body = [r for r in rows[header + 1:] if len(r) == len(rows[header])]
    count = lambda r, col: int(r[ix[col]] or 0)  # noqa: E731
    reasons = [c for c in rows[header] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(count(r, "Instructions Executed") for r in body)
    samples = sum(count(r, "# Samples") for r in body) or 1
    groups: dict[int, list] = collections.defaultdict(list)
    for r in body:
        groups[count(r, "Instructions Executed")].append(r)
    print(f"{total:,} warp instructions, {samples:,} stall samples")
    print(f"{'runs':>10} {'instrs':>7} {'% instr':>8} {'% samples':>10}  top opcodes")
    for runs in sorted(groups, reverse=True):
        if runs == 0:
            continue
        g = groups[runs]
        ops = collections.Counter(opcode(r[ix["Source"]]) for r in g)
        share = 100 * runs * len(g) / total
        samp = 100 * sum(count(r, "# Samples") for r in g) / samples
        top = ", ".join(f"{o} {c}" for o, c in ops.most_common(6))
        print(f"{runs:>10,} {len(g):>7} {share:>7.1f}% {samp:>9.1f}%  {top}")
        if reasons:  # the page has per-reason columns (ncu 2023+ with SourceCounters)
            why = collections.Counter({c: sum(count(r, c) for r in g) for c in reasons})
            n = sum(why.values()) or 1
            print(" " * 40 + "stalls: " + ", ".join(
                f"{c.removeprefix('stall_')} {100 * v / n:.0f}%" for c, v in why.most_common(4)))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), *(int(x) for x in sys.argv[4:5]))
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
    else:
        raise SystemExit(__doc__)
