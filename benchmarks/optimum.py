"""Reading an optimum map: the best configuration per (model, condition), every configuration's ratio
to it, and the headroom of switching per phase over the best static configuration.

An optimum map (`benchmarks/calibration/optimum-map.json`, written by `benchmarks.bench_conditions`)
holds blocks; a block is one (model, condition) measured on the testbed: for every configuration
of the grid the median step time of every interleaved round (`per_round`) and the median over rounds
(`rows`). Nothing here runs anything; the simulator's calibration reads the same functions.

Headroom of a mixed trace (phases of conditions A, B, ... with equal numbers of steps each): the
best static configuration minimises the summed step time over the phases; the per-phase best takes
the fastest configuration of every phase. headroom = static time / per-phase time - 1 (≥ 0). Taking
a minimum over noisy medians favours whichever configuration was lucky, so `headroom` also reports a
cross-validated value: choose both on all rounds but one, evaluate them on the round left out, and
take the median over the rounds left out (an honest, if noisy, estimate; it can be negative).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def is_probe(label: str) -> bool:
    """compute, comm, lat[:SIZE]: the probes measured beside the grid (not configurations)."""
    return label in ("compute", "comm") or label.split(":")[0] in ("lat", "latc")


def configs_of(block: dict[str, Any]) -> list[str]:
    """The block's grid (DDP and scheduler configurations), without the probes."""
    return [label for label in block["rows"] if not is_probe(label)]


def step_times(block: dict[str, Any], rounds: Iterable[int] | None = None) -> dict[str, float]:
    """Median step time per configuration, over all rounds or over the given round indices."""
    if rounds is None:
        return {c: block["rows"][c]["median_step_s"] for c in configs_of(block)}
    chosen = list(rounds)
    out = {}
    for label in configs_of(block):
        values = [
            block["per_round"][label][r] for r in chosen if r < len(block["per_round"][label])
        ]
        if values:
            out[label] = statistics.median(values)
    return out


def best(times: dict[str, float]) -> str:
    return min(times, key=times.__getitem__)


def ratios_to_best(times: dict[str, float]) -> dict[str, float]:
    """Step time of every configuration over the best one's (1.0 = the best; 1.10 = 10% slower)."""
    fastest = min(times.values())
    return {label: value / fastest for label, value in times.items()}


def _headroom(phases: Sequence[dict[str, float]]) -> tuple[float, str, list[str]]:
    common = [c for c in phases[0] if all(c in p for p in phases)]  # ties: the grid's order
    static = min(common, key=lambda c: sum(p[c] for p in phases))
    per_phase = [best({c: p[c] for c in common}) for p in phases]
    static_s = sum(p[static] for p in phases)
    per_phase_s = sum(p[c] for p, c in zip(phases, per_phase))
    return static_s / per_phase_s - 1.0, static, per_phase


def headroom(blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Headroom of the per-phase best over the best static configuration for a trace that spends
    equal numbers of steps in each block's condition (see the module docstring)."""
    value, static, per_phase = _headroom([step_times(b) for b in blocks])
    rounds = min(len(next(iter(b["per_round"].values()))) for b in blocks)
    held_out = []
    if rounds >= 2:
        for left in range(rounds):
            train = [r for r in range(rounds) if r != left]
            phases_train = [step_times(b, train) for b in blocks]
            _, s, pp = _headroom(phases_train)
            phases_test = [step_times(b, [left]) for b in blocks]
            static_s = sum(p[s] for p in phases_test)
            per_phase_s = sum(p[c] for p, c in zip(phases_test, pp))
            held_out.append(static_s / per_phase_s - 1.0)
    return {
        "conditions": [b["condition"] for b in blocks],
        "headroom": value,
        "headroom_cv": statistics.median(held_out) if held_out else None,
        "headroom_cv_rounds": held_out,
        "static": static,
        "per_phase": per_phase,
    }


def block_key(block: dict[str, Any]) -> tuple[str, str]:
    return block["model"], block["condition"]


def latest_blocks(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One block per (model, condition): the last one measured (a rerun replaces an earlier one)."""
    chosen: dict[tuple[str, str], dict[str, Any]] = {}
    for block in data["blocks"]:
        chosen[block_key(block)] = block
    return list(chosen.values())


def all_headrooms(blocks: Sequence[dict[str, Any]], max_phases: int = 2) -> list[dict[str, Any]]:
    """Headroom of every combination of 2..max_phases conditions of the same model, ranks and
    pinning (what one testbed run can switch between)."""
    groups: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for block in blocks:
        pinned = bool(block.get("condition_spec", {}).get("pin"))
        groups.setdefault((block["model"], block["world_size"], pinned), []).append(block)
    out = []
    for (model, world, _), group in groups.items():
        for size in range(2, max_phases + 1):
            for combo in itertools.combinations(group, size):
                item = headroom(combo)
                item.update(model=model, world_size=world)
                out.append(item)
    return out


def one_for_all(blocks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: how far one fixed configuration stays from every condition's best (the ratio
    of its step time to the condition's best, worst case and geometric mean over the model's
    conditions), for the minimax configuration, DDP and the worst configuration: what choosing
    well once is worth, beside what re-tuning adds (the headrooms)."""
    out = []
    for model in dict.fromkeys(b["model"] for b in blocks):
        ratios = [ratios_to_best(step_times(b)) for b in blocks if b["model"] == model]
        common = [c for c in ratios[0] if all(c in r for r in ratios)]
        worst = {c: max(r[c] for r in ratios) for c in common}
        mean = {c: statistics.geometric_mean([r[c] for r in ratios]) for c in common}
        minimax = min(common, key=lambda c: (worst[c], mean[c]))
        loser = max(common, key=mean.__getitem__)
        out.append(
            {
                "model": model,
                "conditions": len(ratios),
                "minimax": minimax,
                "minimax_worst": worst[minimax],
                "minimax_mean": mean[minimax],
                "ddp_worst": worst.get("ddp"),
                "ddp_mean": mean.get("ddp"),
                "worst_config": loser,
                "worst_config_mean": mean[loser],
            }
        )
    return out


def format_one_for_all(items: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'model':<12} {'conds':>5} {'one configuration':<20} {'worst':>6} {'mean':>6} "
        f"{'ddp worst':>9} {'ddp mean':>8}  {'worst configuration':<20} {'mean':>6}"
    )
    lines = [header, "-" * len(header)]
    for item in items:
        ddp_worst = f"{item['ddp_worst']:9.3f}" if item["ddp_worst"] else f"{'-':>9}"
        ddp_mean = f"{item['ddp_mean']:8.3f}" if item["ddp_mean"] else f"{'-':>8}"
        lines.append(
            f"{item['model']:<12} {item['conditions']:>5} {item['minimax']:<20} "
            f"{item['minimax_worst']:6.3f} {item['minimax_mean']:6.3f} {ddp_worst} "
            f"{ddp_mean}  {item['worst_config']:<20} {item['worst_config_mean']:6.3f}"
        )
    return "\n".join(lines)


def format_summary(blocks: Sequence[dict[str, Any]]) -> str:
    """Per (model, condition): DDP step time, the best configuration, the best static ratio to
    DDP, the runner-up's distance, and where the default compromise stands."""
    header = (
        f"{'model':<12} {'condition':<22} {'ranks':>5} {'ddp ms':>8} {'best':<20} "
        f"{'best ms':>8} {'x DDP':>6} {'2nd':<20} {'2nd/best':>8} {'load':>5} commit"
    )
    lines = [header, "-" * len(header)]
    for block in blocks:
        times = step_times(block)
        order = sorted(times, key=times.__getitem__)
        first, second = order[0], order[1]
        ddp = times.get("ddp")
        lines.append(
            f"{block['model']:<12} {block['condition']:<22} {block['world_size']:>5} "
            f"{(ddp or 0) * 1e3:8.1f} {first:<20} {times[first] * 1e3:8.1f} "
            f"{(ddp / times[first] if ddp else 0):6.2f} {second:<20} "
            f"{times[second] / times[first]:8.3f} {block['load'].split()[0]:>5} "
            f"{block.get('commit', '-')}"
        )
    return "\n".join(lines)


def format_ratio_matrix(blocks: Sequence[dict[str, Any]]) -> str:
    """For every model: configurations x conditions, step time over the condition's best
    (1.000 = the best there)."""
    lines = []
    models = list(dict.fromkeys(b["model"] for b in blocks))
    for model in models:
        mine = [b for b in blocks if b["model"] == model]
        labels = list(dict.fromkeys(c for b in mine for c in configs_of(b)))
        names = [b["condition"] for b in mine]
        bests = [best(step_times(b)).removeprefix("sched:") for b in mine]
        width = max(9, *(len(n) + 1 for n in names + bests))
        lines.append(f"{model}: step time / best step time of the condition")
        lines.append(f"  {'configuration':<20}" + "".join(f"{n:>{width}}" for n in names))
        ratio = [ratios_to_best(step_times(b)) for b in mine]
        for label in labels:
            cells = "".join(
                f"{r[label]:>{width}.3f}" if label in r else f"{'-':>{width}}" for r in ratio
            )
            lines.append(f"  {label:<20}{cells}")
        lines.append(f"  {'best':<20}" + "".join(f"{label:>{width}}" for label in bests))
        lines.append("")
    return "\n".join(lines)


def format_headrooms(items: Sequence[dict[str, Any]], limit: int | None = None) -> str:
    header = (
        f"{'model':<12} {'ranks':>5} {'mixed trace (equal steps)':<44} {'headroom':>9} "
        f"{'cv':>7}  best static -> per phase"
    )
    lines = [header, "-" * len(header)]
    ranked = sorted(items, key=lambda i: -i["headroom"])
    for item in ranked[:limit] if limit else ranked:
        cv = item["headroom_cv"]
        lines.append(
            f"{item['model']:<12} {item['world_size']:>5} "
            f"{' | '.join(item['conditions']):<44} {item['headroom'] * 100:8.1f}% "
            f"{(f'{cv * 100:6.1f}%' if cv is not None else '      -')}  "
            f"{item['static']} -> {' / '.join(item['per_phase'])}"
        )
    return "\n".join(lines)


BUSY_CONDITIONS = ("quiet", "cpu1=0.5", "cpu=0.5", "busy1=1", "pin=1", "pin=1+busy1=1")


def format_busy_worker(blocks: Sequence[dict[str, Any]]) -> str:
    """Quota or busy process, which takes CPU from one rank only? Per model and busy-worker
    condition: each rank's compute probe, the collectives' cost, what the condition's processes
    used, and the best configuration."""
    header = (
        f"{'model':<12} {'condition':<16} {'compute r0/r1 ms':>17} {'r1/r0':>6} "
        f"{'4KiB ms':>8} {'2MiB ms':>8} {'busy cores':>10}  best"
    )
    lines = [header, "-" * len(header)]
    for block in blocks:
        if block["condition"] not in BUSY_CONDITIONS or block["world_size"] != 2:
            continue
        probes = block["probes"]
        r0, r1 = probes["compute_s_per_rank"][:2]
        collective = probes.get("collective_s", {})
        small, large = collective.get("4096"), collective.get("2097152")
        cores = block.get("condition_cores", {}).get("busy", 0.0)
        lines.append(
            f"{block['model']:<12} {block['condition']:<16} "
            f"{r0 * 1e3:8.0f}/{r1 * 1e3:<8.0f} {r1 / r0:6.2f} "
            f"{(small or 0) * 1e3:8.2f} {(large or 0) * 1e3:8.2f} {cores:10.2f}  "
            f"{best(step_times(block))}"
        )
    return "\n".join(lines)
