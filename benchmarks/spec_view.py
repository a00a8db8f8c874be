"""bench_spec.py's view of the adaptive policy (spec/policy.py): what it was told in the timed
runs and what it believed after them, per benchmark row."""

from __future__ import annotations

from deltaserve.spec.policy import batch_bucket


def policy_state(policy) -> dict | None:
    """The adaptive policy's beliefs now (None for another policy): its kept cost medians per
    (batch bucket, k) and round-trip switch costs per bucket (seconds), its running mean
    acceptance length. Taken after each timed round: the untimed runs after the rounds (token
    check, step costs synchronised around the proposer) would otherwise move them."""
    if getattr(policy, "_medians", None) is None:
        return None
    return {"medians": dict(policy._medians),
            "trips": {b: policy.switch_cost(b) for b, _ in sorted(policy._medians)},
            "mean_acceptance": policy._global}


def policy_view(state: dict | None, kinds: list[int], seconds: list[float]) -> dict:
    """What the adaptive policy saw in the timed runs: the median cost it was told of a verify
    and of a plain step (ms; a step right after the other kind included), the same over the
    steps that continued a run of their kind (what its medians keep) with their 90th
    percentile, the mean length of each kind's runs, the switches (steps of the other kind than
    the one before) and what the first step of a run cost (median ms, a switch's price), and
    from `state` (policy_state after the last timed round) its kept medians per (batch
    bucket, k) (ms), its round-trip switch cost per bucket (ms) and its running mean
    acceptance length; else {}."""
    if state is None:
        return {}

    def pick(verify: bool, continuing: bool) -> list[float]:
        return sorted(s for i, (k, s) in enumerate(zip(kinds, seconds)) if bool(k) == verify
                      and (not continuing or (i > 0 and bool(kinds[i - 1]) == verify)))

    def ms(v: list[float], q: float = 0.5) -> float | None:
        return round(v[min(int(len(v) * q), len(v) - 1)] * 1e3, 4) if v else None

    runs: dict[bool, list[int]] = {True: [], False: []}
    for i, k in enumerate(kinds):
        if i and bool(kinds[i - 1]) == bool(k):
            runs[bool(k)][-1] += 1
        else:
            runs[bool(k)].append(1)
    kinds_named = (("verify", True), ("plain", False))
    first = {n: sorted(s for i, (k, s) in enumerate(zip(kinds, seconds))
                       if i and bool(k) == v and bool(kinds[i - 1]) != v)
             for n, v in kinds_named}
    trips = state["trips"]
    return {"switches": sum(len(v) for v in first.values()),
            "first_step_ms": {n: ms(v) for n, v in first.items()},
            "policy_switch_cost_ms": {f"b{b}": round(t * 1e3, 4) for b, t in trips.items()
                                      if t is not None},
            "policy_told_ms": {n: ms(pick(v, False)) for n, v in kinds_named},
            "policy_told_continuing_ms": {n: [ms(pick(v, True)), ms(pick(v, True), 0.9)]
                                          for n, v in kinds_named},
            "mean_run_length": {n: round(sum(runs[v]) / len(runs[v]), 2) if runs[v] else None
                                for n, v in kinds_named},
            "policy_medians_ms": {f"b{b}/k{k}": round(v * 1e3, 4)
                                  for (b, k), v in sorted(state["medians"].items())},
            "policy_mean_acceptance": round(state["mean_acceptance"], 3)}


def kept_medians(row: dict) -> dict[str, float]:
    """The policy's kept medians (ms) of the row's own batch bucket, both kinds."""
    head = f"b{batch_bucket(row['batch'])}/"
    return {key: v for key, v in row.get("policy_medians_ms", {}).items() if key.startswith(head)}
