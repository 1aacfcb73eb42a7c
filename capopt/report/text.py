"""Text tables of the results: what `capopt` prints and the notebooks show.

The results themselves (`OptimizeResult`, `ValidationReport`, `CalibrationResult`, a plan's
``to_dict()``) are plain data; these functions turn them into text and compute nothing the
results do not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._format import bar, config_line, format_bytes, gib, seconds, si, table
from .._terms import MEMORY_LABELS, STEP_TERMS, TIME_LABELS
from .._units import GiB

if TYPE_CHECKING:
    from .._plan import Plan


def time_rows(tm: dict) -> list[tuple]:
    """The step's time terms as rows: what adds up to the step, its named parts indented, then
    what is not in the sum (hidden communication, kernel launches spread over the terms, a
    slower input pipeline)."""
    step = tm["step_s"]
    rows = []
    for key, label, indent in TIME_LABELS:
        v = tm.get(key, 0.0)
        if v > 0:
            rows.append(("  " * indent + label, seconds(v),
                         f"{100 * v / step:5.1f}%" if indent == 0 else ""))
    rows.append(("step", seconds(step), "100.0%"))
    if tm.get("launch_s", 0.0) > 0:
        rows.append(("kernel launch overhead (in the terms above)", seconds(tm["launch_s"]),
                     ""))
    if tm.get("comm_hidden_s", 0.0) > 0:
        rows.append(("communication hidden behind compute", seconds(tm["comm_hidden_s"]), ""))
    if tm.get("input_s", 0.0) > 0:
        bound = " (data-bound: the step waits for it)" if tm["input_s"] >= step else ""
        rows.append((f"input pipeline{bound}", seconds(tm["input_s"]), ""))
    return rows


def plan_table(p: dict, title: str | None = None) -> str:
    """A plan (`Plan.to_dict()`): the memory terms against the budget, the step's time terms
    and the throughput."""
    mem, tm, thr = p["memory"], p["time"], p["throughput"]
    total = mem["total_bytes"]
    lines = []
    if title:
        lines.append(title)
    lines.append(f"config: {config_line(p['config'])}")
    rows = [(label, gib(mem[key]), f"{100 * mem[key] / total:5.1f}%", bar(mem[key] / total))
            for key, label in MEMORY_LABELS]
    rows.append(("total", gib(total), "100.0%", ""))
    lines.append(table(rows, ["per device (GiB)", "GiB", "share", ""], "lrrl"))
    if "allocated_bytes" in mem and mem["allocated_bytes"] < total:
        lines.append(f"of the total: live tensors {gib(mem['allocated_bytes'])} GiB "
                     "(allocated); the total adds the fragmentation\nthe allocator cannot give "
                     "back, the CUDA context and library workspaces\n(what nvidia-smi shows "
                     "when memory is short)")
        lines.append(f"held by the allocator: {gib(mem['reserved_bytes'])} GiB (reserved: the "
                     "live tensors, fragmentation and,\nwhile memory is not short, the free "
                     "blocks it keeps cached and frees before an OOM)")
    budget = mem["budget_bytes"]
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines.append(f"budget {gib(budget)} GiB usable of {gib(mem['vram_bytes'])} GiB: {verdict} "
                 f"({gib(abs(budget - total))} GiB {'free' if p['fits'] else 'over'})")
    paged = mem.get("paged_optimizer_bytes", 0.0)
    if paged > 0:
        left = max(mem["vram_bytes"] - mem.get("device_used_bytes", total), 0.0)
        where = ("on the device beside the total" if paged <= left else
                 f"{gib(paged - left)} GiB of it on the host, paged in and out every step")
        lines.append(f"paged optimizer state: {gib(paged)} GiB in CUDA managed memory, outside "
                     f"the total ({where})")
    held = [(label, mem.get(key, 0.0)) for key, label in (
        ("offloaded_param_bytes", "parameters"), ("offloaded_grad_bytes", "gradients"),
        ("host_optimizer_bytes", "optimizer state"))]
    if any(v > 0 for _, v in held):
        lines.append("in host memory, outside the total: " + ", ".join(
            f"{label} {gib(v)} GiB" for label, v in held if v > 0) + " per device"
            + (" (parameter offload: each shard copied in for its all-gather, the optimizer "
               "step on the CPU; no tier measures it)" if mem.get("offloaded_param_bytes", 0.0)
               > 0 else ""))
    if tm:
        lines.append("")
        lines.append(table(time_rows(tm), ["step time", "", "share"], "lrr"))
        bits = [f"{si(thr['tokens_per_s'], 'tok/s')}"]
        if "tokens_per_s_per_device" in thr:
            bits.append(f"{si(thr['tokens_per_s_per_device'], 'tok/s')} per device")
        if "mfu" in thr:
            bits.append(f"MFU {100 * thr['mfu']:.1f}%")
        if thr.get("hfu"):
            bits.append(f"HFU {100 * thr['hfu']:.1f}%")
        if thr.get("time_to_train_s"):
            bits.append(f"time to train {seconds(thr['time_to_train_s'])}")
        if thr.get("cost_per_million_tokens"):
            bits.append(f"${thr['cost_per_million_tokens']:.3f} per M tokens")
        lines.append("throughput: " + ", ".join(bits))
        if "gemm_tflops" in thr:
            lines.append(assumed_rates_line(thr))
    return "\n".join(lines)


def assumed_rates_line(thr: dict) -> str:
    """The kernel and link rates the step time assumes (`capopt.cost.time.assumed_rates`)."""
    return (f"assumed rates: GEMMs {thr['gemm_tflops']:.0f} TFLOP/s "
            f"({100 * thr['gemm_peak_share']:.0f}% of peak), attention "
            f"{thr['attention_tflops']:.0f} TFLOP/s ({100 * thr['attention_peak_share']:.0f}%), "
            f"element-wise {thr['hbm_tb_s']:.2f} TB/s, collectives "
            f"{thr['nccl_intra_gb_s']:.0f} GB/s in a node and "
            f"{thr['nccl_inter_gb_s']:.0f} GB/s across")


def training_label(sc, chosen: bool = True) -> str:
    """What the scenario trains, when not the whole model, and how when compiled or stepped
    in the backward pass: `` (QLoRA r16 on q+v)``, `` (torch.compile)``; the [training]
    fields left to the optimiser as ``choosing ...`` (``chosen``), or else their first values
    (what `plan` prices)."""
    lora, parts = sc.workload.lora, []
    if lora is not None:
        kind = {4: "QLoRA", 8: "LoRA (8-bit base)", 16: "LoRA"}[lora.base_bits]
        if not lora.double_quant:
            kind += " (NF4 without double quantisation)"
        parts.append(f"{kind} r{lora.rank} on {'+'.join(lora.targets)}"
                     + (f", dropout {lora.dropout:g}" if lora.dropout else ""))
    searched = sc.choices if chosen else ()
    fixed = [n for n in ("loss", "compile", "optimizer_in_backward", "activation_offload",
                         "paged_optimizer")
             if n not in searched]
    if "loss" in fixed and sc.workload.loss != "float32":
        parts.append(f"{sc.workload.loss} loss")
    parts += [_CHOICE_WORDS[n] for n in fixed if n != "loss" and getattr(sc.workload, n)]
    if sc.workload.async_tp:
        parts.append("async TP")
    if searched:
        parts.append("choosing " + ", ".join(searched))
    return f" ({', '.join(parts)})" if parts else ""


_CHOICE_WORDS = {"compile": "torch.compile", "optimizer_in_backward":
                 "optimizer in the backward pass", "activation_offload": "activations offloaded",
                 "paged_optimizer": "paged optimizer"}


def choice_label(sc, values: dict | None = None) -> str:
    """The values a search chose of the [training] fields left to it (``values``, or the
    scenario's own): ``fused-linear, activations offloaded``; ``-`` for none switched on."""
    from .._specs import training_choices
    values = values if values is not None else training_choices(sc)
    parts = [v if n == "loss" else _CHOICE_WORDS[n] for n, v in values.items()
             if n == "loss" or v]
    return ", ".join(parts) or "-"


def optimize_table(res) -> str:
    """An `OptimizeResult` as the CLI prints it: the ranked candidates, the runner-up's
    loss, the stage layout, the shadow price of memory; or, when nothing fits, the smallest
    requirement and the changes that would make one fit."""
    sc = res.scenario
    head = (f"{sc.name}: {sc.model.name}{training_label(sc)} on {sc.count}x "
            f"{sc.hardware.name}, budget "
            f"{gib(sc.budget.usable_bytes)} GiB usable per device")
    lines = [head]
    if res.status == "infeasible":
        lines.append("INFEASIBLE: no config fits."
                     if not (res.layout and res.layout.fits) else
                     "INFEASIBLE with even pipeline stages; the uneven layout below fits.")
        if res.smallest:
            m = res.smallest.memory
            lines.append(f"smallest requirement found: {gib(m['total_bytes'])} GiB per "
                         f"device with {config_line(res.smallest.config.to_dict())}")
        if res.remedies:
            rows = [(r.change + (f" ({choice_label(r.scenario, r.training)})"
                                 if r.training else ""), "yes" if r.fits else "no",
                     gib(r.total_bytes) if r.total_bytes else "-",
                     si(r.tokens_per_s, "tok/s") if r.tokens_per_s else "-")
                    for r in res.remedies]
            lines.append(table(rows, ["change", "fits", "GiB/device", "throughput"]))
        if res.layout is not None:
            lines.append(layout_line(res))
        return "\n".join(lines)
    rows = []
    fleet = len({(v["gpu"], v["count"]) for v in res.per_variant or ()}) > 1
    chosen = bool(sc.choices)
    for i, c in enumerate(res.candidates, 1):
        m, t, th = c.memory, c.time, c.throughput
        stages = getattr(c, "layout", None)
        name = config_line(c.config.to_dict()) + (
            f" layers={stages.layers} recompute={stages.recompute}" if stages else "")
        row = [i, name, gib(m["total_bytes"]), seconds(t["step_s"]),
               si(th["tokens_per_s"], "tok/s"), f"{100 * th.get('mfu', 0):.1f}%"]
        if chosen:
            row.insert(1, choice_label(c.scenario))
        if fleet:
            row.insert(1, f"{c.scenario.count}x {c.scenario.hardware.name}")
        if th.get("cost_per_million_tokens"):
            row.append(f"${th['cost_per_million_tokens']:.3f}")
        rows.append(row)
    headers = ["#", "config", "GiB/dev", "step", "throughput", "MFU"]
    if chosen:
        headers.insert(1, "training")
    if fleet:
        headers.insert(1, "gpus")
    if rows and len(rows[0]) > len(headers):
        headers.append("$/M tok")
    left = 1 + fleet + chosen
    lines.append(table(rows, headers, "r" + "l" * left + "r" * (len(headers) - 1 - left)))
    if len(res.candidates) > 1:
        lines.append("runner-up: " + why_lost(res.candidates[0], res.candidates[1]))
    if res.layout is not None:
        lines.append(layout_line(res))
    sp = res.shadow_price
    if sp.get("tokens_per_s_per_gib") is not None:
        line = (f"shadow price of memory: {sp['tokens_per_s_per_gib']:+,.0f} tok/s "
                f"per extra GiB per device ({sp['basis']})")
        if sp.get("next_faster_bytes"):
            line += (f"; the next faster config evaluated needs "
                     f"{sp['next_faster_bytes'] / GiB:.2f} GiB per device "
                     f"(+{100 * sp['next_faster_gain']:.1f}%)")
        elif sp.get("unused_bytes") is not None and sp["tokens_per_s_per_gib"] == 0:
            line += "; no faster config was found at any memory size"
        lines.append(line)
        # the relaxation's price, where memory holds it back (it rounds to +0 elsewhere)
        if (sp.get("relaxed_tokens_per_s_per_gib") or 0.0) >= 0.5:
            lines.append(
                f"  in the relaxation (continuous knobs, at "
                f"{100 * sp['relaxed_memory_fraction']:.0f}% of the budget): "
                f"{sp['relaxed_tokens_per_s_per_gib']:+,.0f} tok/s per GiB; the configs "
                f"are steps apart, so the two differ where no step fits in one GiB")
    lines.append(f"{res.method} search: {res.evaluated:,} configs evaluated exactly"
                 + (f" of {res.space_size:,}" if res.space_size else "")
                 + f" in {res.solve_s:.2f} s")
    return "\n".join(lines)


def margin_line(margin: dict, res) -> str:
    """What ``optimize --margin`` kept (`capopt.search.margin.with_margin`), above its table."""
    nom = margin["nominal_best"]
    text = (f"with the {margin['kind']} margin ({margin['meaning']} for each config's runtime "
            f"and layout): the configs whose peak, short by it, still fits "
            f"{gib(margin['budget_bytes'])} GiB")
    if res.best and nom and nom["config"] != res.best.config.to_dict():
        text += (f"; the best is {100 * -margin['throughput_change']:.1f}% slower than the best "
                 f"without it, {config_line(nom['config'])}")
    elif res.best:
        text += "; the best without it passes"
    if res.best:
        text += f" (the best's peak with the margin: {gib(margin['best_margin_bytes'])} GiB)"
    if margin.get("all_layouts"):
        many = len(margin["all_layouts"]) > 1
        text += ("; #" + ", #".join(str(i + 1) for i in margin["all_layouts"])
                 + (" use" if many else " uses") + " pipeline or context parallelism, which no "
                 "held-out draw has: " + ("their" if many else "its") + " margin is the "
                 "runtime's over every layout")
    return _wrapped("", text)


def _wrapped(first: str, text: str, width: int = 100) -> str:
    """``text`` after ``first``, its further lines indented as far."""
    import textwrap
    return textwrap.fill(text, width, initial_indent=first,
                         subsequent_indent=" " * len(first), break_on_hyphens=False)


def _pct(x: float, signed: bool = False) -> str:
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def trust_lines(trust: dict) -> str:
    """`capopt._trust.answer_trust` as the lines printed under an answer: the held-out
    errors of the runtime's memory prediction against its oracle for the answer's layout, what
    the answer would need were it short by their 90th percentile or by their largest
    under-prediction, the errors of the points that share each of the answer's features (its
    optimizer, clipping, accumulation, precision, recomputation, attention kernel, LoRA) with
    the shortfall of the weakest, and the published runs' throughput errors."""
    lines = ["how far to trust it (held-out measurements, README \"How far to trust it\"):"]
    mem = trust.get("memory")
    pad = " " * 14
    if mem is None:
        lines.append(f"  memory      no held-out measurement of the {trust['runtime']} runtime "
                     "against its own oracle is committed")
    else:
        s, where = mem["stats"], f"with layout \"{mem['group']}\""
        if s is None:
            s = mem["all"]
            where = ("over every layout (no held-out config "
                     + ("has pipeline or context parallelism)" if mem["group"] is None else
                        f"of layout \"{mem['group']}\")"))
        lines.append(_wrapped("  memory      ", f"{mem['runtime']} against {mem['oracle']}, "
                              f"{s['n']} held-out points {where}: median |error| "
                              f"{_pct(s['median_abs'])}, 90th percentile {_pct(s['p90_abs'])}; "
                              "in 9 of 10 the prediction fell short of the measured peak by at "
                              f"most {_pct(s.get('p90_under', 0.0))}, the largest "
                              "under-prediction "
                              f"{_pct(s.get('worst_under', 0.0), signed=True)}"))
        if "predicted_bytes" in mem:
            cap = [(mem["device_bytes"], "the device's memory"),
                   (mem["budget_bytes"], "the usable budget")]

            def over(b: float | None) -> str:
                if b is None:
                    return "unbounded (an error of 100% or more)"
                lim = next((f" (above {name}, {gib(x)} GiB)" for x, name in cap if b > x), "")
                return f"{gib(b)} GiB{lim}"
            lines.append(_wrapped(pad, f"short by {_pct(s.get('p90_under', 0.0))}, "
                                  f"{gib(mem['predicted_bytes'])} GiB would be "
                                  f"{over(mem['at_p90_under_bytes'])}; by "
                                  f"{_pct(-s.get('worst_under', 0.0))}, "
                                  f"{over(mem['at_worst_under_bytes'])}"))
            at_p90 = mem["at_p90_under_bytes"]
            if (at_p90 is None or at_p90 > mem["budget_bytes"]) and mem["validate_tier"]:
                lines.append(_wrapped(pad, "before launching, measure it on its oracle: capopt "
                                      f"validate --tier {mem['validate_tier']} with the same "
                                      "arguments"))
    feats = (mem or {}).get("features") or []
    if feats:
        listed = ", ".join(f"{f['feature']} {f['label']} {_pct(f['stats']['median_abs'])} "
                           f"({f['stats']['n']})" for f in feats)
        w = feats[0]
        lines.append(_wrapped("  by feature  ", "held-out points that share the answer's "
                              f"features, median |error| (points): {listed}; the weakest, "
                              f"{w['feature']} {w['label']}: in 9 of 10 short by at most "
                              f"{_pct(w['stats'].get('p90_under', 0.0))}, the largest "
                              "under-prediction "
                              f"{_pct(w['stats'].get('worst_under', 0.0), signed=True)}"))
    ans = trust.get("answers")
    if ans:
        lines.append(_wrapped(pad, f"its own answers, full size near their budgets: the top "
                              f"candidates of {ans['scenarios']} shipped {trust['runtime']} "
                              f"scenarios compiled ({ans['n']}): median |error| "
                              f"{_pct(ans['median_abs'])}, worst "
                              f"{_pct(ans['worst_signed'], signed=True)}, the largest "
                              f"under-prediction {_pct(ans.get('worst_under', 0.0), True)}"))
    thr = trust.get("throughput")
    if not thr:
        lines.append(f"  throughput  no published runs of the {trust['runtime']} runtime, or on "
                     "this GPU or its generation")
    else:
        parts = []
        if thr["framework"]:
            f = thr["framework_stats"]
            parts.append(f"published {thr['framework']} runs: median |error| "
                         f"{_pct(f['median_abs'])}, worst {_pct(f['worst_signed'], True)} "
                         f"({f['n']} runs; + is predicted faster than published)")
        if thr["stats"]:
            g = thr["stats"]
            parts.append(f"published runs {thr['where']} ({', '.join(g.get('sources', []))}): "
                         f"median |error| {_pct(g['median_abs'])}, worst "
                         f"{_pct(g['worst_signed'], True)} ({g['n']} runs)")
        lines += [_wrapped("  throughput  " if i == 0 else pad, x) for i, x in enumerate(parts)]
    return "\n".join(lines)


def layout_line(res) -> str:
    """The best uneven stage layout against the best even split."""
    lay = res.layout
    even = next((c for c in res.candidates if getattr(c, "layout", None) is None), None)
    gain = (f", {100 * (lay.tokens_per_s / even.throughput['tokens_per_s'] - 1):+.1f}%"
            " vs the best even split" if even else "")
    return (f"pipeline stages ({config_line(lay.config.to_dict())}): layers {lay.layers}, "
            f"recomputed {lay.recompute}, max {gib(max(lay.stage_bytes))} GiB/dev"
            f"{'' if lay.fits else ' (does not fit)'}, "
            f"{si(lay.tokens_per_s, 'tok/s')}{gain} (even split: "
            f"{si(lay.even_tokens_per_s, 'tok/s')}{'' if lay.even_fits else ', does not fit'})")


def why_lost(best: Plan, other: Plan) -> str:
    """The knobs that differ, and the time terms that grew most."""
    a, b = best.config.to_dict(), other.config.to_dict()
    diff = ", ".join(f"{k} {a[k]}->{b[k]}" for k in a if a[k] != b[k])
    # (and the [training] values a search chose, where they differ)
    wa, wb = best.scenario.workload, other.scenario.workload
    chose = ", ".join(f"{n} {getattr(wa, n)}->{getattr(wb, n)}"
                      for n in best.scenario.choices if getattr(wa, n) != getattr(wb, n))
    diff = ", ".join(filter(None, (chose, diff)))
    ta, tb = best.time, other.time
    deltas = sorted(((tb[k] - ta[k], k) for k in STEP_TERMS), reverse=True)
    grew = [f"{k[:-2].replace('_', ' ')} +{seconds(d)}" for d, k in deltas[:2] if d > 0]
    slower = 100 * (1 - other.throughput["tokens_per_s"] / best.throughput["tokens_per_s"])
    return (f"{diff or 'same knobs'}: {slower:.1f}% slower"
            + (f" ({'; '.join(grew)})" if grew else ""))


def validation_table(rep) -> str:
    """A `ValidationReport`: per candidate, each term predicted against measured."""
    from ..validation.predict import tier_terms     # loads JAX: only where a report exists
    lines = [f"{rep.scenario}: {len(rep.results)} candidate(s), tier {rep.tier}"]
    if rep.tier == "exact":
        lines.append("(the exact tier compiles for the CPU: argument, output and alias bytes "
                     "compare; the CPU's temp is no GPU's, so no peak is compared)")
    for i, r in enumerate(rep.results, 1):
        head = (f"#{i} {r['tier']} {r['status'].upper()}  {config_line(r['config'])}"
                + (f"  ({', '.join(f'{k} {v}' for k, v in r['training'].items())})"
                   if r.get("training") else "")
                + f"  [predicted by profile {r.get('runtime', '?')}]")
        if r.get("details", {}).get("compile_s") is not None:
            head += f"  (compile {r['details']['compile_s']:.1f} s)"
        lines += ["", head]
        if r["status"] != "ok":
            lines.append(f"   {r.get('error', '')}")
            continue
        rows = []
        skip = ("temp_bytes", "peak_bytes") if r["tier"] == "exact" else ()
        terms, parts = tier_terms(r["tier"])
        for k in terms + parts + ("step_s",):
            if k in skip:
                continue
            p, m = r["predicted"].get(k), r["measured"].get(k)
            if m is None and p is None:
                continue
            e = r["error"].get(k) if isinstance(r.get("error"), dict) else None
            unit = _seconds if k == "step_s" else format_bytes
            rows.append((k, unit(p), unit(m), "-" if e is None else f"{100 * e:+.3f}%"))
        lines.append(table(rows, ["term", "predicted", "measured", "error"], "lrrr"))
        lhs = (r.get("details", {}).get("xla_schedule") or {})
        if lhs.get("lhs_bytes") is not None:
            lines.append(
                f"   XLA's latency-hiding scheduler reordered this step to overlap its "
                f"collectives: its schedule holds {format_bytes(lhs['lhs_bytes'])} at its "
                f"peak, within its limit of {format_bytes(lhs['lhs_limit_bytes'])} (80% of "
                f"the card less arguments and outputs, x 95%); with memory to spare the "
                f"compiled peak includes what it spent (--no-latency-hiding compiles without "
                f"it)")
    for n in rep.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _seconds(x) -> str:
    return "-" if x is None else seconds(x)


def calibration_table(fit) -> str:
    """A `CalibrationResult`: each coefficient's start and fitted value, and the errors."""
    lines = [f"calibrated {fit.profile.name} on {fit.n_train} measurement(s) of "
             f"{fit.target} ({fit.n_holdout} held out)"]
    for k, v in fit.coeffs.items():
        lines.append(f"  {k:<24} {fit.initial[k]:>12.4g} -> {v:.4g}")
    te, he = fit.train_error, fit.holdout_error
    lines.append(f"  mean |error| train {100 * te['before']:.1f}% -> {100 * te['after']:.1f}%"
                 + (f"; held out {100 * he['before']:.1f}% -> {100 * he['after']:.1f}%"
                    if fit.n_holdout else ""))
    return "\n".join(lines)
