"""``capopt``: the command line. Parses, calls the library, prints; no numerics here."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from typing import Any

from ._errors import CapoptError
from ._format import config_line, gib, si, table
from ._units import GiB
from .report.text import (calibration_table, optimize_table, plan_table, training_label,
                          margin_line, trust_lines, validation_table)

# --------------------------------------------------------------------------------------------
# A question on one line: scenario fields given as flags (over a file's, or without one)
QUESTION_FLAGS = {
    "--model": "model.card", "--gpu": "hardware.gpu", "--count": "hardware.count",
    "--per-node": "hardware.per_node", "--seq-len": "training.seq_len",
    "--global-batch": "training.global_batch", "--precision": "training.precision",
    "--optimizer": "training.optimizer", "--runtime": "training.runtime",
    "--lora": "training.lora", "--loss": "training.loss", "--compile": "training.compile",
    "--optimizer-in-backward": "training.optimizer_in_backward",
    "--async-tp": "training.async_tp",
    "--activation-offload": "training.activation_offload",
    "--paged-optimizer": "training.paged_optimizer",
    "--no-clip": "training.grad_clip",
    "--vram-gib": "budget.vram_gib",
}
_FLAG_OF = {field: flag for flag, field in QUESTION_FLAGS.items()}


def _overrides(items: list[str] | None) -> dict[str, Any]:
    from ._scenario import parse_override
    out = dict(parse_override(s) for s in items or [])
    for key in out:
        flag = next((f for f, field in QUESTION_FLAGS.items()
                     if field.split(".")[1] in (key, key.replace("-", "_"))), None)
        if flag:
            # (the flags that switch a field on or off take no value)
            switch = flag in ("--compile", "--optimizer-in-backward", "--async-tp",
                              "--activation-offload", "--paged-optimizer", "--no-clip")
            raise CapoptError(f"{key!r} is a scenario field, not a knob", field="--set",
                              allowed=flag if switch else f"{flag} VALUE")
    return out


def _scenario(args):
    """The scenario a command is about: its file (or the default one) with the flags'
    values over it, or, with ``--model`` and no file, the flags alone."""
    from ._scenario import load_scenario, one_line_scenario
    given = {flag: getattr(args, flag[2:].replace("-", "_"), None) for flag in QUESTION_FLAGS}
    values = {QUESTION_FLAGS[flag]: (v, flag) for flag, v in given.items() if v is not None}
    from ._scenario import WORKLOAD_CHOICES
    chosen = getattr(args, "choose", None)
    if chosen is not None and not chosen:
        raise CapoptError("no field named", field="--choose",
                          allowed=", ".join(WORKLOAD_CHOICES))
    for name in chosen or ():
        if name not in WORKLOAD_CHOICES:
            raise CapoptError(f"{name!r} is not a [training] field the optimiser chooses",
                              field="--choose", allowed=", ".join(WORKLOAD_CHOICES))
        if f"training.{name}" in values:
            flag = values[f"training.{name}"][1]
            raise CapoptError(f"{name} is given by {flag} too", field="--choose",
                              allowed=f"either {flag} (a value, or for --loss a list or "
                                      f"auto) or --choose {name}")
        values[f"training.{name}"] = ("auto", "--choose")
    overrides = _overrides(args.set)
    if args.scenario is not None or "model.card" not in values:
        return load_scenario(args.scenario, overrides=overrides, values=values)
    try:
        return one_line_scenario(values, overrides)
    except CapoptError as e:
        if e.file is None and e.field in _FLAG_OF:      # a field no flag gave: name the flag
            raise CapoptError(e.message, field=_FLAG_OF[e.field], allowed=e.allowed) from None
        raise


def _emit(args, config, sc) -> bool:
    """``--emit FORMAT``: the config as the framework's launch file, to ``--out`` (then the
    table is printed as usual: returns False) or to stdout in place of the table (True)."""
    from .report.launch import emit
    text = emit(args.emit, config, sc)
    if not args.out:
        print(text, end="" if text.endswith("\n") else "\n")
        return True
    from pathlib import Path
    try:
        Path(args.out).write_text(text)
    except OSError as e:
        raise CapoptError(f"cannot write: {e.strerror}", file=args.out, field="--out") from None
    print(f"wrote {args.out} ({args.emit})", file=sys.stderr)
    return False


# fitting configs scored for the best one a launch format writes, where it cannot write the
# optimum (``optimize --emit``)
EMIT_POOL = 200


def _emit_writable(args, res, more) -> bool:
    """``optimize --emit FORMAT``: the best config, or where the format cannot write it (a
    knob its file has no field for: DeepSpeed's JSON and recomputation, say) the best config
    it can write, among the candidates and then among the up to `EMIT_POOL` fitting configs
    of a second search, ``more()`` (scored whole where the space allows), with one line on
    stderr saying which and how much slower; with ``--margin``, among those that pass it
    too. None writable: the optimum's error. As `_emit`."""
    from .report.launch import emit, expresses
    best = res.best
    try:
        emit(args.emit, best.config, best.scenario)
    except CapoptError as err:
        def writes(plan) -> bool:
            if args.margin:                          # (and fits with the margin asked for)
                from .search.margin import passes
                if not passes(plan, args.margin):
                    return False
            return expresses(args.emit, plan.config, plan.scenario)
        pool = [c for c in res.candidates[1:] if writes(c)]
        if not pool:
            pool = [c for c in more().candidates if writes(c)]
        if not pool:
            raise
        alt = pool[0]
        change = alt.throughput["tokens_per_s"] / best.throughput["tokens_per_s"] - 1.0
        print(f"capopt: note: the best config ({_describe(best)}) cannot be written: "
              f"{str(err).removeprefix('--emit: ')}; writing the best one {args.emit} can: "
              f"{_describe(alt)}, {100.0 * change:+.1f}% throughput", file=sys.stderr)
        best = alt
    return _emit(args, best.config, best.scenario)


def _describe(plan) -> str:
    tok = plan.throughput["tokens_per_s"]
    return f"{config_line(plan.config.to_dict())}, {tok / 1e3:.2f} ktok/s"


def cmd_plan(args) -> int:
    from ._scenario import pinned_config
    from ._validity import config_problems
    sc = _scenario(args)
    cfg = pinned_config(sc)
    for field, why in config_problems(cfg, sc)[:1]:
        raise CapoptError(why, file=sc.path, field=field)
    from ._plan import plan                 # JAX loads only once the input is known good
    p = plan(sc, cfg)
    d = p.to_dict()
    if args.emit and _emit(args, cfg, sc):
        pass                                # the launch file took the table's place
    elif args.json:
        print(json.dumps(d, indent=2))
    else:
        print(plan_table(d, f"{sc.name}: {sc.model.name}{training_label(sc, chosen=False)} "
                            f"on {sc.count}x {sc.hardware.name}"))
        print(trust_lines(d["trust"]))
    _first_values_note(sc, "plan")
    if args.plot:
        from .report.figures import memory_breakdown, save
        print(f"saved {save(memory_breakdown([p]), args.plot)}", file=sys.stderr)
    return 0


def _first_values_note(sc, command: str) -> None:
    """One line on stderr where ``command`` prices one config of a scenario whose [training]
    fields are left to the optimiser: the first values, which it takes."""
    if sc.choices:
        from ._specs import training_choices
        print(f"capopt: note: {command} prices the first value of each [training] field left "
              "to the optimiser (" + ", ".join(f"{c} = {v}" for c, v in
                                               training_choices(sc).items())
              + "); optimize searches them", file=sys.stderr)


def cmd_optimize(args) -> int:
    sc = _scenario(args)
    from .search._space import knob_refusal, no_layout_reason, pinned_layout_refusal
    refused = knob_refusal(sc)
    if refused:
        raise CapoptError(refused[1], file=sc.path, field=refused[0])
    pinned = pinned_layout_refusal(sc)
    if pinned:
        raise CapoptError(pinned[1], file=sc.path, field=pinned[0], allowed=pinned[2])
    reason = no_layout_reason(sc)
    if reason:
        raise CapoptError(reason, file=sc.path, field="config",
                          allowed="a hardware.count and training.global_batch with a common "
                                  "data-parallel degree")
    from .search import optimize
    res = optimize(sc, top_k=args.top, method=args.method, seed=args.seed)

    @functools.cache
    def more():
        """The second search, for --margin and --emit's fallbacks (run once, when needed)."""
        return optimize(sc, top_k=EMIT_POOL, seed=args.seed,
                        method="exhaustive" if args.method == "exhaustive" else "auto")

    margin = None
    if args.margin and res.best:
        from .search.margin import with_margin
        res, margin = with_margin(res, args.margin, args.top, more)
        if not res.best:
            n = margin["pool"]
            raise CapoptError(f"nothing fits in {gib(sc.budget.usable_bytes)} GiB usable per "
                              f"device with the {args.margin} margin ({margin['meaning']}): "
                              f"none of the {n} fastest configs that fit passes it",
                              file=sc.path, field="budget",
                              allowed="more memory, more devices, or no --margin")
    d = res.to_dict()
    if margin:
        d["margin"] = margin
    if args.emit and res.best and _emit_writable(args, res, more):
        pass                                # the launch file took the table's place
    elif args.json:
        print(json.dumps(d, indent=2))
    else:
        if margin:
            print(margin_line(margin, res))
        print(optimize_table(res))
        if res.best:
            print(trust_lines(d["best"]["trust"]))
        if margin and 0 < len(res.candidates) < args.top:
            print(f"only {len(res.candidates)} configs pass the {args.margin} margin"
                  + (f" among the {margin['pool']} best that fit" if margin["pool"] else ""))
        elif 0 < len(res.candidates) < args.top:
            hint = ("" if res.method == "exhaustive" else
                    "; --method exhaustive scores every config")
            print(f"only {len(res.candidates)} of the {res.evaluated:,} configs evaluated fit "
                  f"(--top {args.top} asked{hint})")
    if args.plot and res.best:
        from .report.figures import pareto, save
        from .search.explore import landscape
        print(f"saved {save(pareto(res, landscape(sc)), args.plot)}", file=sys.stderr)
    if d["status"] != "ok":
        need = d.get("smallest_requirement_bytes")
        print(f"capopt: error: {sc.path or sc.name}: budget: nothing fits in "
              f"{gib(sc.budget.usable_bytes)} GiB usable per device"
              + (f"; the smallest config found needs {gib(need)} GiB" if need else "")
              + " (see the changes listed above)", file=sys.stderr)
        return 2
    return 0


def cmd_explain(args) -> int:
    from ._scenario import pinned_config
    from .search.remedies import explain
    sc = _scenario(args)
    cfg = pinned_config(sc)
    rep = explain(sc, cfg)
    _first_values_note(sc, "explain")
    if args.json:
        print(json.dumps({k: v if k != "remedies" else [
            {kk: vv for kk, vv in r.items() if not kk.startswith("_")} for r in v]
            for k, v in rep.items()}, indent=2))
        return 0
    print(f"{sc.name}: {config_line(cfg.to_dict())}")
    print(f"needs {gib(rep['total_bytes'])} GiB per device of {gib(rep['budget_bytes'])} GiB "
          f"usable: {'FITS' if rep['fits'] else 'DOES NOT FIT'}")
    rows = [(r["change"], "yes" if r["fits"] else "no", gib(r["saves_bytes"]),
             gib(r["total_bytes"]), f"{100 * r['throughput_change']:+.1f}%")
            for r in rep["remedies"]]
    print(table(rows, ["change", "fits", "saves GiB", "GiB/device", "throughput"]))
    if rep["combination"]:
        print(("fits with: " if rep["combination_fits"] else "still short after: ")
              + " + ".join(rep["combination"]))
    return 0


def cmd_catalog(args) -> int:
    if args.what == "gpus":
        from ._hardware import load_catalog
        cat = load_catalog()
        rows = [(h.name, f"{h.memory_bytes / GiB:.0f}", si(h.peak('bf16'), 'FLOP/s')
                 if 'bf16' in dict(h.peak_flops) else "-", si(h.mem_bw, "B/s"),
                 si(h.intra_node_bw, "B/s"), h.per_node) for h in cat.values()]
        if args.json:
            print(json.dumps({h.name: {"memory_bytes": h.memory_bytes,
                                       "peak_flops": dict(h.peak_flops), "mem_bw": h.mem_bw,
                                       "source": h.source} for h in cat.values()}, indent=2))
        else:
            print(table(rows, ["gpu", "GiB", "bf16 dense", "HBM", "intra-node", "per node"]))
    elif args.what == "models":
        from ._cards import list_cards, load_card
        cards = [load_card(n) for n in list_cards()]
        if args.json:
            print(json.dumps({c.name: {"family": c.family, "params": c.num_params(),
                                       "published_params": c.published_params}
                              for c in cards}, indent=2))
        else:
            rows = [(c.name, c.family, si(c.num_params()), c.num_hidden_layers, c.hidden_size,
                     c.num_attention_heads, c.kv_heads,
                     f"{c.num_local_experts}x top{c.num_experts_per_tok}" if c.is_moe else "")
                    for c in cards]
            print(table(rows, ["card", "family", "params", "layers", "hidden", "heads", "kv",
                               "experts"]))
    elif args.what == "scenarios":
        from ._scenario import describe_scenario, list_scenarios
        rows = [(name, describe_scenario(name)) for name in list_scenarios()]
        if args.json:
            print(json.dumps(dict(rows), indent=2))
        else:
            print(table(rows, ["scenario", "name"], "ll"))
    else:
        from ._runtime import list_profiles
        print("\n".join(list_profiles()))
    return 0


def cmd_validate(args) -> int:
    from ._scenario import pinned_config
    from .validation import validate
    sc = _scenario(args)
    configs = [pinned_config(sc)] if args.pinned else None
    options = {}
    if args.no_latency_hiding:
        if args.tier != "xla-gpu":
            raise CapoptError(f"applies to the xla-gpu tier only, not {args.tier}",
                              field="--no-latency-hiding", allowed="--tier xla-gpu")
        options["latency_hiding"] = False
    rep = validate(sc, top_k=args.top, tier=args.tier, configs=configs, out=args.out,
                   timeout_s=args.timeout, progress=not args.json, jobs=args.jobs,
                   ray=args.ray, options=options)
    print(json.dumps(rep.to_dict(), indent=2) if args.json else validation_table(rep))
    return 0


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from ._scenario import load_scenario
    from .validation.calibrate import FIT_COEFFS, calibrate, samples_from_results
    from .validation.runner import load_results, tier_scenario
    if not args.scenario or not args.measurements:
        raise CapoptError("calibrate needs a SCENARIO and --measurements FILE.jsonl (written "
                          "by `capopt validate SCENARIO --tier xla-gpu|device --out "
                          "FILE.jsonl`; benchmarks/calibration_grid.py measures and fits a "
                          "documented grid)",
                          field="--measurements")
    sc = load_scenario(args.scenario, overrides=_overrides(args.set))
    path = Path(args.measurements)
    if not path.is_file():
        raise CapoptError("no such file", file=str(path), field="--measurements")
    records = [r for r in load_results(path)
               if r.get("scenario") == sc.name and r.get("tier") == args.tier]
    tsc = tier_scenario(sc, args.tier, args.profile)
    samples = samples_from_results(records, tsc, target=args.target)
    if len(samples) < 2:
        raise CapoptError(f"{len(samples)} usable {args.tier} measurement(s) of {args.target} "
                          f"for scenario {sc.name!r}; a fit needs at least 2 (status ok)",
                          file=str(path), field="--measurements")
    coeffs = tuple(c for c in (args.coeffs or ",".join(FIT_COEFFS)).split(",") if c)
    known = tsc.runtime.coeff_dict()
    unknown = [c for c in coeffs if c not in known]
    if unknown:
        raise CapoptError(f"unknown coefficient(s) {', '.join(unknown)}", field="--coeffs",
                          allowed=", ".join(sorted(known)))
    try:
        res = calibrate(samples, coeffs=coeffs, target=args.target, holdout=args.holdout,
                        name=f"{tsc.runtime.name}-calibrated",
                        source=f"{tsc.runtime.source}; fitted by capopt calibrate to "
                               f"{len(samples)} {args.tier} measurements of {sc.name}")
    except ValueError as e:
        raise CapoptError(str(e), field="--coeffs") from None
    print(json.dumps(res.to_dict(), indent=2) if args.json else calibration_table(res))
    if args.profile_out:
        Path(args.profile_out).write_text(res.to_toml())
        print(f"wrote {args.profile_out}", file=sys.stderr)
    return 0


def cmd_setup(args) -> int:
    if args.what == "maxtext":
        from .validation import maxtext_tier
        if args.target:
            raise CapoptError("the MaxText environment is built beside capopt's "
                              f"({maxtext_tier.venv_dir()})", field="--target",
                              allowed=f"none with maxtext (set {maxtext_tier.PYTHON_ENV} to "
                                      "use one elsewhere)")
        if not args.quiet:
            print(f"building {maxtext_tier.venv_dir()} (Python 3.12+, maxtext 0.2.5, JAX 0.12 "
                  "and its CUDA compiler plugin: about 2 GB) for the maxtext tier ...",
                  file=sys.stderr)
        folder = maxtext_tier.install(quiet=args.quiet)
        print(f"maxtext tier ready: MaxText is in {folder}")
        return 0
    from .validation.plugin import PACKAGES, install, jax_version
    if not args.quiet:
        print(f"installing {' and '.join(PACKAGES)} {jax_version()} for the xla-gpu tier ...",
              file=sys.stderr)
    folder = install(args.target, quiet=args.quiet)
    print(f"xla-gpu tier ready: the CUDA plugin is in {folder}")
    return 0


def cmd_doctor(args) -> int:
    from .gpu.doctor import run_doctor
    rep = run_doctor(run_step=not args.no_step)
    print(json.dumps(rep.to_dict(), indent=2) if args.json else rep.render())
    return rep.exit_code


PLOT_FORMATS = (".png", ".svg", ".pdf")


def _number(kind: type, what: str, ok, allowed: str):
    """An argparse type: the text read as ``kind`` (int or float) and kept where ``ok``; any
    other value is refused in one line that says what is allowed (NaN fails every ``ok``)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r}: allowed: {allowed}")
        return v
    return parse


_positive_int = _number(int, "an integer", lambda v: 1 <= v <= 10_000, "1 to 10000")
_seed = _number(int, "an integer", lambda v: 0 <= v < 2 ** 32, "0 to 2^32 - 1")
_seconds = _number(float, "a number of seconds", lambda v: math.isfinite(v) and v > 0,
                   "a number of seconds > 0")
_share = _number(float, "a number", lambda v: 0.0 <= v < 1.0, "a share from 0 to below 1")


_whole = _number(int, "an integer", lambda v: v >= 1, "a positive integer")
_gib = _number(float, "a number of GiB", lambda v: math.isfinite(v) and v > 0,
               "a number of GiB > 0")


def _choose(text: str) -> list[str]:
    """``FIELD[,FIELD]``: [training] fields the optimiser chooses (checked in `_scenario`)."""
    return [f.strip().replace("-", "_") for f in text.split(",") if f.strip()]


def _loss(text: str):
    """``KIND``, ``KIND,KIND`` (the optimiser chooses among them) or ``auto`` (checked with the
    scenario)."""
    kinds = [k.strip() for k in text.split(",")]
    return kinds if len(kinds) > 1 else kinds[0]


def _lora(text: str) -> dict:
    """``RANK``, ``RANK:BITS``, ``RANK:BITS:TARGETS`` (comma-separated, e.g. ``q,v``) or
    ``RANK:BITS:TARGETS:DROPOUT`` as the scenario's ``training.lora`` table (the targets and
    the dropout are checked with the scenario)."""
    parts = text.split(":")
    rank, bits, targets = (parts + ["", ""])[:3]
    dropout = ":".join(parts[3:])
    try:
        out = {"rank": int(rank)}
        if bits:
            out["base_bits"] = int(bits)
        if dropout:
            out["dropout"] = float(dropout)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: RANK, RANK:BITS, "
                                         "RANK:BITS:TARGETS or RANK:BITS:TARGETS:DROPOUT, e.g. "
                                         "16, 64:4, 16:16:q,v or 16:4:q,v:0.05") from None
    if len(parts) > 4 or "" in parts[2:]:         # a field named but empty, or a fifth
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: RANK:BITS:TARGETS:DROPOUT with "
                                         "TARGETS comma-separated, e.g. 16:4:q,v:0.05")
    if targets:
        out["targets"] = [t.strip() for t in targets.split(",")]
    return out


def _plot_path(text: str) -> str:
    if not text.lower().endswith(PLOT_FORMATS):
        raise argparse.ArgumentTypeError(f"{text!r}: the file's suffix says the format; "
                                         f"allowed: {', '.join(PLOT_FORMATS)}")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line and exit status 2 (as for every bad input)."""

    def error(self, message):
        self.exit(2, f"capopt: error: {self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="capopt", description="The fastest training config that fits your GPU memory.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def scenario_args(p, optional=False):
        p.add_argument("scenario", nargs="?" if optional else None, default=None,
                       help="scenario .toml path or a name in scenarios/ "
                            + ("(default: the default scenario)" if optional else ""))
        p.add_argument("--set", action="append", metavar="KNOB=VALUE",
                       help="pin a knob, e.g. --set micro_batch=2 --set remat=full")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--plot", metavar="FILE", type=_plot_path,
                       help="also save a figure (.png, .svg or .pdf)")
        q = p.add_argument_group(
            "the question on one line (over the scenario's values, or with --model and no "
            "scenario, in place of a file)")
        q.add_argument("--model", metavar="CARD", help="a card name, a card .toml or "
                       "config.json path, or a Hugging Face repo id (owner/name[@revision])")
        q.add_argument("--gpu", metavar="NAME", help="a GPU of `capopt catalog gpus`")
        q.add_argument("--count", type=_positive_int, metavar="N", help="GPUs (default 1)")
        q.add_argument("--per-node", type=_positive_int, metavar="N", help="GPUs per node")
        q.add_argument("--seq-len", type=_whole, metavar="TOKENS")
        q.add_argument("--global-batch", type=_whole, metavar="SEQUENCES",
                       help="sequences per optimizer step")
        q.add_argument("--precision", metavar="NAME",
                       help="fp32, bf16, bf16-mixed (default), fp16-mixed, fp8-mixed")
        q.add_argument("--optimizer", metavar="NAME", help="adamw (default), adam, "
                       "adamw-8bit, adafactor, lion, sgd, sgd-momentum")
        q.add_argument("--runtime", metavar="PROFILE", help="a profile of `capopt catalog "
                       "profiles` (default xla-gpu)")
        q.add_argument("--loss", metavar="KIND", type=_loss,
                       help="float32 (default: logits upcast for the cross-entropy), fused "
                       "(one kernel on the compute-dtype logits) or fused-linear (Liger's head "
                       "and loss over chunks of tokens: the logits never whole; tp 1); "
                       "several, comma-separated, or auto: the optimiser chooses")
        q.add_argument("--compile", action="store_const", const=True, default=None,
                       help="the step under torch.compile: element-wise ops fused (runtimes "
                            "that run them eagerly: pytorch-eager and the profiles built on "
                            "it, hf, torchtitan, deepspeed, llm-foundry)")
        q.add_argument("--no-clip", action="store_const", const=False, default=None,
                       help="no clipping by the global gradient norm (default: the "
                            "scenario's training.grad_clip, true without a file)")
        q.add_argument("--optimizer-in-backward", action="store_const", const=True,
                       default=None, help="each parameter stepped as its gradient is "
                       "accumulated, the gradient freed at once (torchtitan's "
                       "early_step_in_backward; needs no clipping, no accumulation)")
        q.add_argument("--activation-offload", action="store_const", const=True, default=None,
                       help="activations offloaded to host memory in the forward pass and "
                            "brought back in the backward pass (TRL's activation_offloading; "
                            "runtimes pytorch-eager and hf)")
        q.add_argument("--paged-optimizer", action="store_const", const=True, default=None,
                       help="bitsandbytes' paged optimizer (the Trainer's optim=\"paged_...\"): "
                            "its state in CUDA managed memory, moved to the host when the "
                            "device is short (adamw, adam, lion, adamw-8bit; ZeRO 0, tp 1; "
                            "runtimes pytorch-eager, hf and torchtune)")
        q.add_argument("--choose", type=_choose, metavar="FIELD[,FIELD]",
                       help="leave [training] fields to the optimiser, each \"auto\": loss, "
                            "compile, optimizer_in_backward, activation_offload, "
                            "paged_optimizer (every value the runtime and the model allow is "
                            "searched)")
        q.add_argument("--async-tp", action="store_const", const=True, default=None,
                       help="asynchronous tensor parallelism: each tensor-parallel collective "
                       "pipelined with the matmul beside it (torchtitan's "
                       "enable_async_tensor_parallel; needs --compile)")
        q.add_argument("--lora", type=_lora, metavar="RANK[:BITS[:TARGETS[:DROPOUT]]]",
                       help="LoRA adapters of RANK; BITS 4 (QLoRA), 8 or 16 (default) for "
                            "the frozen base; TARGETS the wrapped matrices, comma-separated: "
                            "attn, mlp (default: both) or single ones (q, k, v, o, gate, up, "
                            "down; q,v is PEFT's default for Llama); DROPOUT PEFT's "
                            "lora_dropout (default 0)")
        q.add_argument("--vram-gib", type=_gib, metavar="GIB",
                       help="memory per GPU to plan for (default: the GPU's)")

    def emit_args(p, which):
        from .report.launch import FORMATS
        p.add_argument("--emit", choices=FORMATS, metavar="FORMAT",
                       help=f"write {which} as a launch config: {', '.join(FORMATS)} "
                            "(to stdout in place of the table, or to --out)")
        p.add_argument("--out", metavar="FILE", help="where --emit writes")

    p = sub.add_parser("plan", help="memory and time of one config")
    scenario_args(p, optional=True)
    emit_args(p, "the config")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("optimize", help="find the fastest config that fits")
    scenario_args(p, optional=True)
    emit_args(p, "the best config")
    p.add_argument("--top", type=_positive_int, default=5, help="candidates to show")
    p.add_argument("--method", choices=["gradient", "auto", "exhaustive"], default="gradient",
                   help="gradient (default): solve the continuous relaxation with optax, round "
                        "and polish; auto: score spaces of up to 500k configs whole, solve "
                        "above that; exhaustive: score every config (the reference)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the starting points")
    p.add_argument("--margin", choices=["p90", "worst"], default=None,
                   help="keep the configs that fit even were their predicted peak short by "
                        "the held-out error of their runtime and layout: its 90th percentile "
                        "(p90) or the largest under-prediction measured (worst)")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser("validate", help="compile (and on a GPU run) candidates as Flax steps, "
                                        "or meter them as PyTorch steps")
    scenario_args(p, optional=True)
    p.add_argument("--top", type=_positive_int, default=3,
                   help="optimiser candidates to validate")
    p.add_argument("--tier", choices=["exact", "xla-gpu", "torch", "deepspeed", "maxtext",
                                      "device"],
                   default="exact",
                   help="exact: compile for CPU devices; xla-gpu: XLA's GPU buffer assignment "
                        "(no GPU); torch: the step in PyTorch on fake tensors (no GPU); "
                        "deepspeed: DeepSpeed's own step on CPU tensors (small models; no "
                        "GPU); maxtext: MaxText's own step compiled for the GPU (no GPU; "
                        "capopt setup maxtext); device: run on this machine's accelerator")
    p.add_argument("--pinned", action="store_true", help="validate the pinned config only")
    p.add_argument("--no-latency-hiding", action="store_true",
                   help="xla-gpu tier: compile without XLA's latency-hiding scheduler, which "
                        "on Hopper and Blackwell targets spends the card's spare memory on "
                        "overlapping collectives (near the budget XLA's peak comes back to "
                        "within about 15%% of this one)")
    p.add_argument("--out", metavar="FILE.jsonl", help="stream results here (resumable)")
    p.add_argument("--timeout", type=_seconds, default=600.0, help="seconds per candidate")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="candidates measured at once, each in its own process (the device "
                        "tier: one at a time on the one device)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run each candidate as a task on a Ray cluster: auto (the one this "
                        "machine is in), local (start one here) or ray://HOST:PORT; one CPU "
                        "per compile-only candidate, one GPU per device-tier one")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("explain", help="why a pinned config does not fit, and what would fix it")
    scenario_args(p, optional=True)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("catalog", help="list GPUs, model cards, scenarios, runtime profiles")
    p.add_argument("what", choices=["gpus", "models", "scenarios", "profiles"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_catalog)

    p = sub.add_parser("calibrate", help="fit a runtime profile's coefficients to measurements")
    p.add_argument("scenario", nargs="?", default=None,
                   help="the scenario the measurements are of")
    p.add_argument("--measurements", metavar="FILE.jsonl",
                   help="results of `capopt validate SCENARIO --out FILE.jsonl`")
    p.add_argument("--tier", choices=["xla-gpu", "device"], default="xla-gpu")
    p.add_argument("--target", choices=["peak_bytes", "temp_bytes"], default="peak_bytes")
    p.add_argument("--coeffs", metavar="A,B,..", help="profile coefficients to fit")
    p.add_argument("--profile", metavar="NAME|FILE", help="profile to start from")
    p.add_argument("--holdout", type=_share, default=0.25, help="share kept out of the fit")
    p.add_argument("--profile-out", metavar="FILE.toml", help="write the fitted profile here")
    p.add_argument("--set", action="append", metavar="KNOB=VALUE", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("setup", help="install optional parts: the CUDA plugin (xla-gpu tier), "
                                     "MaxText's environment (maxtext tier)")
    p.add_argument("what", choices=["xla-gpu", "maxtext"])
    p.add_argument("--target", metavar="DIR", help="install here instead of beside Python")
    p.add_argument("-q", "--quiet", action="store_true", help="no pip output")
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("doctor", help="check the GPU-training setup of this machine")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-step", action="store_true", help="skip the tiny training step")
    p.set_defaults(func=cmd_doctor)
    return ap


def _warn_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"capopt: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import warnings
    warnings.showwarning = _warn_one_line
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:             # --help (0) or a bad argument (2, one line printed)
        return e.code if isinstance(e.code, int) else 2
    if args.command not in ("doctor", "validate"):
        # The cost model is a few scalars: keep it off the accelerator (and its memory) so
        # planning never disturbs a training job running beside it.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        return args.func(args)
    except CapoptError as e:
        print(f"capopt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader (e.g. `| head`) left: stop quietly, and keep Python from complaining
        # about the closed stdout at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
