"""Turns the per-rank numbers of bench_stages.py into per-config summaries, markdown tables
and correctness checks."""

import math
import statistics

MB = 1e6


def summarize(name, rounds, fresh_processes):
    """One config's numbers. `rounds`: one list of per-rank results per run of the config.

    A step lasts as long as its slowest rank; the median is over every timed step of every
    round. Memory and losses come from the first round (every round computes the same)."""
    wall, cpu = [], []
    for ranks in rounds:
        steps = range(len(ranks[0]["step_seconds"]))
        wall += [max(r["step_seconds"][i] for r in ranks) for i in steps]
        cpu += [max(r["step_cpu_seconds"][i] for r in ranks) for i in steps]
    ranks = rounds[0]
    return dict(
        config=name, optimizer=ranks[0]["optimizer"], world_size=len(ranks), rounds=len(rounds),
        step_ms_median=1000 * statistics.median(wall), step_ms_min=1000 * min(wall),
        step_ms_max=1000 * max(wall), step_ms_per_step=[1000 * t for t in wall],
        cpu_ms_median=1000 * statistics.median(cpu), cpu_ms_per_step=[1000 * t for t in cpu],
        # The rank that holds the most: ZeroRedundancyOptimizer's whole-tensor partition is uneven
        # (None: not measured, DeepSpeed's rows).
        memory=max((r["memory"] for r in ranks), key=lambda m: m["total"] or 0),
        memory_by_rank=[r["memory"] for r in ranks],
        # Every rank's loss is its own batch's; their mean is the global batch's loss.
        first_loss=statistics.fmean(r["losses"][0] for r in ranks),
        final_loss=statistics.fmean(r["losses"][-1] for r in ranks),
        eval_loss=ranks[0]["eval_loss"], eval_loss_by_rank=[r["eval_loss"] for r in ranks],
        threads=max(r["threads"] for rs in rounds for r in rs),
        peak_rss_bytes=max(r["peak_rss_bytes"] for rs in rounds for r in rs) if fresh_processes else None,
        rss_before_bytes=max(r["rss_before_bytes"] for rs in rounds for r in rs),
        load_average=[rs[0]["load_average"] for rs in rounds],
        extras=[r["extras"] for r in ranks],
        # The warm-up's first step, with torch.compile's compilation in compiled configs.
        first_step_ms=1000 * max(r["warmup_step_seconds"][0] for rs in rounds for r in rs)
        if ranks[0].get("warmup_step_seconds") else None,
        # Graphs dynamo compiled during the timed steps (compiled configs; should be 0).
        graphs_in_timed_steps=max(r["graphs_in_timed_steps"] for rs in rounds for r in rs)
        if ranks[0].get("graphs_in_timed_steps") is not None else None,
    )


def _ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "–"


def _mb(x):
    return f"{x / MB:.1f}" if x is not None else "n/a"


def render(results, baselines, configs):
    """One row per config; every ratio column once per baseline (a name or a list of names)."""
    baselines = [baselines] if isinstance(baselines, str) else list(baselines)
    per_base = "".join(f" × {b} |" for b in baselines)
    ratio_cols = "---:|" * len(baselines)

    def ratios(value_of, r):
        return "".join(f" {_ratio(value_of(r), value_of(results[b]))} |" for b in baselines)

    lines = [f"| config | step ms (median) |{per_base} model-state MB / rank |{per_base} peak RSS MB "
             f"| CPU ms / step (median) |{per_base}",
             f"|---|---:|{ratio_cols}---:|{ratio_cols}---:|---:|{ratio_cols}"]
    for name in configs:
        r = results[name]
        lines.append(f"| {name} | {r['step_ms_median']:.1f} |{ratios(lambda x: x['step_ms_median'], r)}"
                     f" {_mb(r['memory']['total'])} |{ratios(lambda x: x['memory']['total'], r)}"
                     f" {_mb(r['peak_rss_bytes'])} "
                     f"| {r['cpu_ms_median']:.1f} |{ratios(lambda x: x['cpu_ms_median'], r)}")
    return "\n".join(lines)


def render_memory(results, configs, formulas):
    """formulas: {config: (bytes per parameter as text, bytes), or None where the config's
    model state is not measured}, from steps.state_formula."""
    lines = ["| config | params MB | grads MB | optimizer MB | DDP buckets MB | total MB "
             "| gathered peak MB | formula (B/param) | formula MB | total / formula |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name in configs:
        m = results[name]["memory"]
        if formulas[name] is None or m["total"] is None:
            lines.append(f"| {name} | not measured (peak RSS in the tables above) | | | | | | | | |")
            continue
        text, formula_bytes = formulas[name]
        buckets = _mb(m["comm_buffers"]) if name.startswith("ddp") else "–"
        gathered = _mb(m["gathered_peak"]) if m.get("gathered_peak") is not None else "–"
        lines.append(f"| {name} | {_mb(m['params'])} | {_mb(m['grads'])} | {_mb(m['optimizer'])} | {buckets} "
                     f"| {_mb(m['total'])} | {gathered} | {text} | {formula_bytes / MB:.1f} "
                     f"| {m['total'] / formula_bytes:.4f} |")
    return "\n".join(lines)


def loss_reference(results, preferred):
    """The config every held-out loss is compared with: `preferred`, or the first one run without it."""
    return preferred if preferred in results else next(iter(results))


def render_losses(results, configs, preferred):
    ref_name = loss_reference(results, preferred)
    ref = results[ref_name]["eval_loss"]
    lines = ["| config | optimizer | loss step 1 | loss last step | held-out loss after "
             f"| rel. diff to {ref_name} |",
             "|---|---|---:|---:|---:|---:|"]
    for name in configs:
        r = results[name]
        diff = f"{abs(r['eval_loss'] - ref) / abs(ref):.1e}" if ref else "–"
        lines.append(f"| {name} | {r['optimizer']} | {r['first_loss']:.4f} | {r['final_loss']:.4f} "
                     f"| {r['eval_loss']:.6f} | {diff} |")
    return "\n".join(lines)


def check_memory(results, formulas, rel_tol):
    """Problems where a config's model-state total is off its formula by more than rel_tol
    (zeroshard pads each flat buffer to a multiple of 16 x world-size elements; torch's AdamW
    keeps a 4-byte step per tensor: a few KB here)."""
    problems = []
    for name, r in results.items():
        if formulas[name] is None:
            continue
        text, expected = formulas[name]
        total = r["memory"]["total"]
        if abs(total - expected) > rel_tol * expected:
            problems.append(f"{name}: model state {total:,} B is {total / expected:.5f} x its formula "
                            f"({text} B/param = {expected:,.0f} B), beyond {rel_tol:g}")
    return problems


def check(results, world, cpus, preferred, rel_tol):
    """(problems, warnings): non-finite or disagreeing losses are problems; a machine too busy
    for the wall-clock times to mean much is a warning."""
    problems, warnings = [], []
    for name, r in results.items():
        if not all(math.isfinite(x) for x in (r["final_loss"], r["eval_loss"])):
            problems.append(f"{name}: non-finite loss (last step {r['final_loss']}, held-out {r['eval_loss']})")
        if len(set(r["eval_loss_by_rank"])) > 1:
            problems.append(f"{name}: ranks disagree on the held-out loss {r['eval_loss_by_rank']} "
                            "(their parameters differ)")
    ref_name = loss_reference(results, preferred)
    ref = results[ref_name]["eval_loss"]
    for name, r in results.items():
        # fp32: the same math, sums in possibly different orders: ~1e-5 after a few dozen steps.
        if abs(r["eval_loss"] - ref) > rel_tol * abs(ref):
            problems.append(f"{name}: held-out loss {r['eval_loss']:.6f} differs from {ref_name}'s {ref:.6f} "
                            f"by more than {rel_tol:g} relative")
    # The 1-minute load average after a config counts this benchmark's own ranks (about
    # `world`, since each runs one busy thread); more than the cores means competition.
    load = max(la[1] for r in results.values() for la in r["load_average"])
    if load > max(cpus or 1, world) + 0.75:
        warnings.append(f"the machine was busy (1-minute load average up to {load:.1f} on {cpus} CPUs, "
                        f"{world} of it this benchmark): wall-clock step times are unreliable; compare the "
                        "CPU-time columns, or rerun on a quiet machine")
    return problems, warnings


def render_pairs(results, pairs):
    """One row per (ours, theirs) pair both run: each one's CPU and wall ms per step (medians)
    and ours / theirs of each."""
    lines = ["| ours | theirs | CPU ms ours | CPU ms theirs | CPU ours / theirs | step ms ours "
             "| step ms theirs | step ours / theirs |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for ours, theirs in pairs:
        a, b = results[ours], results[theirs]
        lines.append(f"| {ours} | {theirs} | {a['cpu_ms_median']:.1f} | {b['cpu_ms_median']:.1f} "
                     f"| {_ratio(a['cpu_ms_median'], b['cpu_ms_median'])} | {a['step_ms_median']:.1f} "
                     f"| {b['step_ms_median']:.1f} | {_ratio(a['step_ms_median'], b['step_ms_median'])} |")
    return "\n".join(lines)


def render_compiled(results, pairs):
    """(eager, compiled) pairs both run: the compiled one's first step (with the compilation),
    graphs compiled in its timed steps, and its CPU and wall ms against the eager one's."""
    lines = ["| compiled | first step ms (compiles) | graphs in timed steps | CPU ms | × eager "
             "| step ms | × eager |", "|---|---:|---:|---:|---:|---:|---:|"]
    for eager, compiled in pairs:
        a, b = results[compiled], results[eager]
        first = f"{a['first_step_ms']:.0f}" if a.get("first_step_ms") is not None else "–"
        graphs = a.get("graphs_in_timed_steps")
        lines.append(f"| {compiled} | {first} | {'–' if graphs is None else graphs} | {a['cpu_ms_median']:.1f} "
                     f"| {_ratio(a['cpu_ms_median'], b['cpu_ms_median'])} | {a['step_ms_median']:.1f} "
                     f"| {_ratio(a['step_ms_median'], b['step_ms_median'])} |")
    return "\n".join(lines)
