"""Runs fla-core's Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

The GPU path of ops/chunk_prefill.py calls fla-core stage by stage; this harness lets CPU tests
run that exact Python code over fla's real kernels, interpreted. Run it in a fresh process
started with TRITON_INTERPRET=1 (`python tests/ops/fla_interp.py`, as the test module does):
Triton reads the variable when the kernels are decorated, at fla's import. Two shims make
fla-core 0.6.0 run there, neither touching what a kernel computes:
- the autotuner times its configs on a GPU driver, absent here: every config is timed equal,
  so the first one runs;
- a kernel loop `for i in range(n)` gets Python ints from the interpreter, and fla calls
  `i.to(tl.int64)` on them: the modules' `range` yields ints that accept `.to`.

`main()` checks the pipeline against the torch reference (unchained and chained batches) and,
unchained, bit for bit against fla's public `chunk_gated_delta_rule`; it prints one line per
case and exits non-zero on a mismatch.
"""

from __future__ import annotations

import builtins
import os
import sys


class _Int(int):
    def to(self, *args, **kwargs):
        return self


def _range(*args):
    for i in builtins.range(*(int(a) for a in args)):
        yield _Int(i)


def load():
    """Import fla-core's GDN modules under the interpreter with the two shims applied."""
    import triton.runtime.autotuner as autotuner

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("start this process with TRITON_INTERPRET=1")
    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [1.0, 1.0, 1.0]
    import fla.modules.norm.l2norm  # noqa: F401
    import fla.ops.gated_delta_rule.chunk  # noqa: F401  (imports every stage it calls)

    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            module.__dict__["range"] = _range


def main() -> int:
    import torch

    load()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from deltaserve.ops.chunk_prefill import PrefillIndex, _fla_pipeline, gdn_chunk_prefill_ref
    from deltaserve.ops.gdn import _l2norm

    gen = torch.Generator().manual_seed(7)
    h, hv, kd, vd = 1, 2, 32, 32
    bounds = [0, 70, 100, 150]
    t = bounds[-1]
    q, k = torch.randn(t, h, kd, generator=gen), torch.randn(t, h, kd, generator=gen)
    v = torch.randn(t, hv, vd, generator=gen)
    a, b = torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen)
    A_log = torch.log(torch.rand(hv, generator=gen) * 15 + 1)
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    h0 = torch.randn(len(bounds) - 1, hv, vd, kd, generator=gen) * 0.1
    scale = kd ** -0.5
    qn, kn = _l2norm(q).contiguous(), _l2norm(k).contiguous()
    failures = 0
    outs = {}
    for chained in ([False, False, False], [False, True, False], [False, False, True]):
        index = PrefillIndex.build(bounds, chained)
        o, final = _fla_pipeline(qn, kn, v, torch.sigmoid(b), scale, h0, index,
                                 gate=(a, A_log, dt_bias))
        o_ref, final_ref = gdn_chunk_prefill_ref(q, k, v, a, b, A_log, dt_bias, h0, index,
                                                 scale)
        err = max((o - o_ref).abs().max().item(), (final - final_ref).abs().max().item())
        ok = err < 2e-5
        failures += not ok
        outs[tuple(chained)] = (o, final)
        print(f"pipeline vs reference, chained={chained}: max error {err:.2e}",
              "ok" if ok else "MISMATCH")
    plain = outs[(False, False, False)]
    for chained, (o, _) in outs.items():
        if any(chained) and torch.equal(o, plain[0]):  # a chain must change what follows it
            failures += 1
            print(f"chained={list(chained)}: same outputs as unchained", "MISMATCH")
    # chained=[F, T, F]: sequence 1 (rows 70..100) continues sequence 0; alone, the same bits
    o, final = outs[(False, True, False)]
    beta = torch.sigmoid(b)

    def alone(lo, hi, state):
        return _fla_pipeline(qn[lo:hi], kn[lo:hi], v[lo:hi], beta[lo:hi], scale, state[None],
                             PrefillIndex.build([0, hi - lo]), gate=(a[lo:hi], A_log, dt_bias))

    o0, s0 = alone(0, 70, h0[0])
    o1, s1 = alone(70, 100, s0[0])
    o2, s2 = alone(100, 150, h0[2])
    same = torch.equal(o, torch.cat([o0, o1, o2])) and torch.equal(final,
                                                                   torch.cat([s0, s1, s2]))
    failures += not same
    print("chained vs separate calls, bitwise:", "ok" if same else "MISMATCH")
    o_api, final_api = chunk_gated_delta_rule(
        q[None], k[None], v[None], a[None], torch.sigmoid(b)[None], scale=scale,
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, state_v_first=True,
        cu_seqlens=torch.tensor(bounds))
    from fla.modules.norm.l2norm import l2norm_fwd

    o, final = _fla_pipeline(l2norm_fwd(q)[0], l2norm_fwd(k)[0], v, torch.sigmoid(b), scale, h0,
                             PrefillIndex.build(bounds), gate=(a, A_log, dt_bias))
    same = torch.equal(o, o_api[0]) and torch.equal(final, final_api)
    failures += not same
    print("pipeline vs fla's chunk_gated_delta_rule, unchained:", "ok" if same else "MISMATCH")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
