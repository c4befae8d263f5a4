"""The planner's output: a table per card count and memory (or a grid over several), and one
JSON document with every number."""

import textwrap

from zeroshard.planner import activations as act
from zeroshard.planner.setups import ORDER, STATES, TIGHT

GB = 1e9


def gb(nbytes):
    return f"{nbytes / GB:.1f}"


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def _state_columns(model):
    """The model-state columns: the trained parameters' as "params", or, where some are frozen,
    the frozen parameters' and the trained ones' apart."""
    if model.frozen:
        return ["frozen", "trained", "grads", "optimizer"], STATES
    return ["params", "grads", "optimizer"], STATES[1:]


def _preamble(model, precision, args):
    lines = [f"zeroshard plan: {model.numel:,} parameters ({model.description}), {precision}"]
    if model.frozen:
        lines.append(f"  {model.trained:,} trained ({model.trained / model.numel:.2%}), {model.frozen:,} frozen")
    lines += [f"  {note}" for note in model.notes]
    if model.shape is not None:
        s = model.shape
        lines.append(f"  activations: seq {args.seq}, micro-batch {args.micro_batch}, h {s.hidden}, L {s.layers}, "
                     f"a {s.heads}, V {s.vocab}{', full activation checkpointing' if args.activation_checkpointing else ''}:"
                     f" {act.formula(args.activation_checkpointing)}")
    return lines


def _footer(model, plans, link):
    cards = plans[0]["cards"]
    lines = ["GB = 1e9 bytes, per card. model states: parameters + gradients + optimizer state (with the fp32 "
             "master), exactly memory_stats()'s for a known layout; transient: stage 3's gathered units, "
             "gradient staging, the fp32 copy of one gradient shard; total = model states + transient + activations.",
             *(["frozen: the frozen parameters, in their own dtype, whole on every card below stage 3 and "
                "sharded with their unit at stage 3, where each step also gathers them for each micro-batch's "
                "forward and backward (never reduced); trained: the trained parameters in the compute dtype (their "
                "fp32 master is optimizer state)."] if model.frozen else []),
             f"fits: headroom of at least {TIGHT:.0%} of the card (CUDA context, allocator fragmentation and NCCL "
             "buffers are not counted); tight: under that; no: over the card.",
             f"Order: {ORDER}."]
    missing = sorted({m for c in cards for m in c.not_counted})
    if missing:
        lines.append("Not counted: " + "; ".join(missing) + ".")
    if link:
        lines.append(f"comm s/step: traffic x (n-1)/n / bandwidth, a ring over the n ranks of each collective, at "
                     f"{link[1]}; with offload plus 8Ψ/N bytes of host copies at PCIe 4.0 x16. Compute overlaps "
                     "part of it.")
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, 110, subsequent_indent="  ")]


def text_report(model, precision, args, plans, link):
    """One table with every column for one card count and memory; a grid of fits over several."""
    lines = _preamble(model, precision, args) + [""]
    memories = sorted({p["gpu_memory"] for p in plans})
    if len(plans) == 1:
        plan = plans[0]
        memory = plan["gpu_memory"]
        lines.append(f"{plan['gpus']} cards of {memory / GB:g} GB:")
        names, states = _state_columns(model)
        header = ["setup", *names, "model states", "activations", "transient", "total",
                  "headroom", "fit", "host", "traffic GB/step"] + (["comm s/step"] if link else [])
        rows = []
        for c in plan["cards"]:
            rows.append([c.name, *(gb(c.device[k]) for k in states), gb(c.model_states),
                         "-" if c.activations is None else gb(c.activations), gb(sum(c.transient.values())),
                         gb(c.total), gb(c.headroom(memory)), c.fit(memory), gb(sum(c.host.values())),
                         gb(c.traffic["intra"] + c.traffic["inter"])] + ([f"{c.comm_seconds:.2f}"] if link else []))
        lines.append(_table(header, rows))
        fitting = [c for c in plan["cards"] if c.fit(memory) != "no"]
        lines.append("")
        lines.append(f"Cheapest that fits: {fitting[0].name} ({gb(fitting[0].total)} of {memory / GB:g} GB, "
                     f"{gb(fitting[0].headroom(memory))} GB free)." if fitting else
                     "Nothing fits: more cards, larger cards, --offload, or --activation-checkpointing.")
    else:
        offload = any(sum(c.host.values()) for p in plans for c in p["cards"])
        # Where some parameters are frozen, what each state costs decides more than the sum does.
        names, states = _state_columns(model) if model.frozen else ([], ())
        header = (["setup", "cards", *names, "model states", "total"] + (["host, all cards"] if offload else [])
                  + [f"{m / GB:g} GB" for m in memories])
        rows = []
        for gpus in sorted({p["gpus"] for p in plans}):
            by_memory = {p["gpu_memory"]: p for p in plans if p["gpus"] == gpus}
            for c in by_memory[memories[0]]["cards"]:
                host = [gb(gpus * sum(c.host.values()))] if offload else []
                rows.append([c.name, gpus, *(gb(c.device[k]) for k in states), gb(c.model_states), gb(c.total)]
                            + host + [c.fit(m) for m in memories])
        lines.append(_table(header, rows))
    return "\n".join(lines + [""] + _footer(model, plans, link))


def _card_json(c, memory):
    return {"setup": c.name, "stage": c.setup.stage, "shard_group": c.setup.shard_group,
            "offload_optimizer": c.setup.offload_optimizer, "offload_params": c.setup.offload_params,
            "device": {**c.device, "model_states": c.model_states}, "host": c.host,
            "activations": c.activations, "transient": c.transient, "total": c.total,
            "headroom": c.headroom(memory), "fit": c.fit(memory), "traffic_bytes_per_step": c.traffic,
            "comm_seconds_per_step": c.comm_seconds, "not_counted": c.not_counted}


def json_report(model, precision, args, plans, link):
    return {
        "model": {"description": model.description, "parameters": model.numel, "trained": model.trained,
                  "frozen": model.frozen, "notes": list(model.notes),
                  "shape": None if model.shape is None else vars(model.shape)},
        "precision": precision, "seq": args.seq, "micro_batch": args.micro_batch,
        "activation_checkpointing": args.activation_checkpointing,
        "link": None if link is None else {"bytes_per_second": link[0], "description": link[1]},
        "order": ORDER,
        "plans": [{"gpus": p["gpus"], "gpu_memory": p["gpu_memory"],
                   "setups": [_card_json(c, p["gpu_memory"]) for c in p["cards"]]} for p in plans],
    }
