"""Loading a scenario (TOML file or dict, contract v1) into a `Scenario`."""

from __future__ import annotations

import math
import os
import tomllib
import warnings
from pathlib import Path
from typing import Any, Mapping

from ._cards import load_card
from ._errors import CapoptError
from ._hardware import get_hardware
from ._io import check_depth, parse_toml, path_exists, read_text
from ._runtime import get_profile
from ._specs import (KNOBS, LORA_TARGETS, LOSSES, REMAT_POLICIES, STAGE_KNOBS, Budget,
                     Config, KnobDomain, LoRA, Scenario, Workload, data_replicas)
from ._units import GiB

DEFAULT_SCENARIO = "llama3-8b-8xh100"

SCHEMA: dict[str, set[str]] = {
    "": {"name", "model", "hardware", "training", "budget", "config", "objective"},
    "model": {"card"},
    "hardware": {"gpu", "count", "per_node", "price_per_gpu_hour"},
    "training": {"seq_len", "global_batch", "precision", "optimizer", "grad_clip", "runtime",
                 "lora", "loss", "compile", "optimizer_in_backward", "async_tp",
                 "activation_offload", "paged_optimizer",
                 "input_samples_per_s",
                 "train_tokens"},
    "budget": {"vram_gib", "headroom"},
    "config": set(KNOBS) | set(STAGE_KNOBS),
    "objective": {"maximize", "deadline_hours"},
}


def repo_dir(name: str, env: str) -> Path:
    """A data folder of the package (``scenarios/``; the repository's top-level folder of the
    same name links to it, and a wheel ships it), or ``$env``."""
    if os.environ.get(env):
        return Path(os.environ[env])
    return Path(__file__).resolve().parent / name


def scenarios_dir() -> Path:
    return repo_dir("scenarios", "CAPOPT_SCENARIOS_DIR")


def list_scenarios() -> list[str]:
    d = scenarios_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def describe_scenario(name: str) -> str:
    """One line about a scenario of `list_scenarios`: its ``name`` field, or its file's first
    comment line where it has none."""
    text = read_text(scenarios_dir() / f"{name}.toml")
    try:
        title = tomllib.loads(text).get("name")
    except tomllib.TOMLDecodeError:
        title = None
    if isinstance(title, str) and title.strip():
        return title.strip()
    first = next((ln for ln in text.splitlines() if ln.startswith("#")), "")
    return first.lstrip("#").strip()


def resolve_scenario_path(name_or_path: str | os.PathLike) -> Path:
    p = Path(name_or_path)
    if path_exists(p):
        return p
    cand = scenarios_dir() / f"{name_or_path}.toml"
    if path_exists(cand):
        return cand
    raise CapoptError(f"no scenario file {str(name_or_path)!r}", field="scenario",
                      allowed=", ".join(list_scenarios()) + ", or a path to a .toml file")


# --------------------------------------------------------------------------------------------
def _check_keys(table: Mapping, section: str, file: str | None):
    allowed = SCHEMA[section]
    for key in table:
        if key not in allowed:
            where = f"{section}.{key}" if section else key
            raise CapoptError(f"unknown key {key!r}", file=file, field=where,
                              allowed=", ".join(sorted(allowed)))


# The ranges numbers may take: (lowest, highest, whether the lowest is allowed). Beyond them
# no training run exists (a trillion GPUs, a sequence of 2^53 tokens) and the arithmetic
# would overflow or enumerate forever; the bounds are generous by orders of magnitude.
BOUNDS: dict[str, tuple[float, float, bool]] = {
    "training.seq_len": (1, 2 ** 22, True),
    "training.global_batch": (1, 2 ** 24, True),
    "training.input_samples_per_s": (0, 1e12, False),
    "training.train_tokens": (0, 1e16, False),
    "hardware.count": (1, 2 ** 20, True),
    "hardware.per_node": (1, 1024, True),
    "hardware.price_per_gpu_hour": (0, 1e6, True),
    "budget.vram_gib": (0, 1e6, False),
    "budget.headroom": (0, 1, True),
    "objective.deadline_hours": (0, 1e7, False),
}


def check_number(v, field: str, file=None, kind=float):
    """``v`` as a finite number of ``kind`` inside `BOUNDS` (when ``field`` is bounded)."""
    ok = (isinstance(v, int) and not isinstance(v, bool)) if kind is int else (
        isinstance(v, (int, float)) and not isinstance(v, bool))
    if not ok:
        raise CapoptError(f"must be {'an integer' if kind is int else 'a number'}, got {v!r}",
                          file=file, field=field)
    if not math.isfinite(float(v)):
        raise CapoptError(f"must be a finite number, got {v!r}", file=file, field=field)
    if field in BOUNDS:
        lo, hi, lo_ok = BOUNDS[field]
        if v > hi or v < lo or (v == lo and not lo_ok) or (field == "budget.headroom"
                                                             and v >= hi):
            fmt = lambda x: f"{int(x):,}" if float(x).is_integer() and x >= 1 else f"{x:g}"  # noqa: E731
            low = f">= {fmt(lo)}" if lo_ok else f"> {fmt(lo)}"
            high = f"< {fmt(hi)}" if field == "budget.headroom" else f"<= {fmt(hi)}"
            allowed = (f"a positive integer up to {fmt(hi)}" if kind is int and lo == 1
                       else f"{low} and {high}")
            raise CapoptError(f"got {v!r}", file=file, field=field, allowed=allowed)
    return float(v) if kind is float else v


def _get(table: Mapping, key: str, kind, section: str, file, default=...):
    if key not in table:
        if default is ...:
            raise CapoptError("missing required field", file=file, field=f"{section}.{key}")
        return default
    v = table[key]
    field = f"{section}.{key}" if section else key
    if kind in (int, float):
        return check_number(v, field, file, kind)
    ok = {str: isinstance(v, str), bool: isinstance(v, bool)}[kind]
    if not ok:
        raise CapoptError(f"must be {kind.__name__}, got {v!r}", file=file, field=field)
    if kind is str and len(v) > 4096:
        raise CapoptError(f"a string of {len(v)} characters", file=file, field=field,
                          allowed="at most 4096")
    return v


def parse_knob(name: str, raw: Any, file: str | None = None) -> KnobDomain:
    """A `[config]` entry: a value (pinned), a list of allowed values, or ``"auto"``."""
    spec = KNOBS.get(name)
    if spec is None:
        raise CapoptError(f"unknown knob {name!r}", file=file, field=f"config.{name}",
                          allowed=", ".join(KNOBS))
    if raw == "auto":
        return KnobDomain(name, None)
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        raise CapoptError("empty list", file=file, field=f"config.{name}")
    if len(values) > 4096:
        raise CapoptError(f"a list of {len(values)} values", file=file, field=f"config.{name}",
                          allowed="at most 4096")
    out = []
    for v in values:
        if spec.kind == "int":
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 2 ** 20:
                raise CapoptError(f"got {v!r}", file=file, field=f"config.{name}",
                                  allowed='a positive integer up to 2^20, a list of them, '
                                          'or "auto"')
        elif spec.kind == "choice":
            if not isinstance(v, int) or isinstance(v, bool) or v not in spec.choices:
                raise CapoptError(f"got {v!r}", file=file, field=f"config.{name}",
                                  allowed=", ".join(map(str, spec.choices)) + ', a list, or "auto"')
        elif spec.kind == "bool":
            if not isinstance(v, bool):
                raise CapoptError(f"got {v!r}", file=file, field=f"config.{name}",
                                  allowed='true, false, [true, false], or "auto"')
        elif spec.kind == "remat":
            ok = v in REMAT_POLICIES or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                         and 0.0 <= v <= 1.0)
            if not ok:
                raise CapoptError(f"got {v!r}", file=file, field=f"config.{name}",
                                  allowed='none, selective, full, a fraction in [0, 1], a list, '
                                          'or "auto"')
        out.append(v)
    return KnobDomain(name, tuple(dict.fromkeys(out)))


def parse_override(text: str) -> tuple[str, Any]:
    """``knob=value`` from the command line; the value is read as TOML (bare words as strings)."""
    if "=" not in text:
        raise CapoptError(f"expected knob=value, got {text!r}", field="--set",
                          allowed=", ".join(KNOBS))
    key, value = text.split("=", 1)
    key, value = key.strip(), value.strip()
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    except RecursionError:
        raise CapoptError("nested too deeply", field=f"--set {key}") from None
    check_depth(parsed, None, f"--set {key}", limit=1)
    return key, parsed


def _lora(raw, file) -> LoRA | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CapoptError("must be a table like { rank = 16, targets = [...], base_bits = 4 }",
                          file=file, field="training.lora")
    keys = ("rank", "targets", "base_bits", "dropout", "double_quant")
    unknown = set(raw) - set(keys)
    if unknown:
        raise CapoptError(f"unknown key {sorted(unknown)[0]!r}", file=file,
                          field="training.lora", allowed=", ".join(keys))
    targets = raw.get("targets", ("attn", "mlp"))
    if isinstance(targets, str):                    # one name: a list of one
        targets = (targets,)
    if not isinstance(targets, (list, tuple)):
        raise CapoptError(f"must be a list of names, got {targets!r}", file=file,
                          field="training.lora.targets", allowed=", ".join(LORA_TARGETS))
    try:
        return LoRA(rank=raw.get("rank", 16), targets=tuple(targets),
                    base_bits=raw.get("base_bits", 16), dropout=raw.get("dropout", 0.0),
                    double_quant=raw.get("double_quant", True))
    except CapoptError as e:
        raise e.in_file(file) from None


def scenario_from_dict(data: Mapping, *, file: str | None = None,
                       overrides: Mapping[str, Any] | None = None,
                       values: Mapping[str, tuple[Any, str]] | None = None) -> Scenario:
    """A `Scenario` from a scenario's tables; see `load_scenario` for ``overrides`` and
    ``values``."""
    values = dict(values or {})
    data = with_values(data, values)
    given = {field: label for field, (_, label) in values.items()}
    try:
        return _from_dict(data, file, overrides or {})
    except CapoptError as e:
        # a bad value given on the command line is named as it was given, not as the file's
        label = given.get(e.field or "")
        if label is None and (e.field or "").startswith("training.lora"):
            label = given.get("training.lora")
        if label is not None:
            raise CapoptError(e.message, field=label, allowed=e.allowed) from None
        raise e.in_file(file) if file else e from None


def with_values(data: Mapping, values: Mapping[str, tuple[Any, str]]) -> dict:
    """``data`` with each ``"section.key"`` of ``values`` set to its value (a copy)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for field, (value, label) in values.items():
        section, _, key = field.partition(".")
        if section not in SCHEMA or key not in SCHEMA[section]:
            raise CapoptError(f"not a scenario field {field!r}", field=label)
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            raise CapoptError("must be a table", field=section)
        table[key] = value
    return out


def _nested(load, arg, file, field):
    """``load(arg)`` for a file the scenario points to (a card, a GPU, a profile): its error,
    when the scenario names a file, names both (``scenario: field: the other file's error``)."""
    try:
        return load(arg)
    except CapoptError as e:
        if not file or e.file == file:
            raise
        if e.file is None:       # a name, not a file: the scenario's field, said once
            raise CapoptError(e.message, file=file, field=e.field or field,
                              allowed=e.allowed) from None
        raise CapoptError(str(e), file=file, field=field) from None


def _section(data, name, file) -> Mapping:
    t = data.get(name, {})
    if not isinstance(t, dict):
        raise CapoptError("must be a table", file=file, field=name)
    _check_keys(t, name, file)
    return t


def _from_dict(data: Mapping, file, overrides) -> Scenario:
    _check_keys(data, "", file)
    model_t = _section(data, "model", file)
    hw_t = _section(data, "hardware", file)
    tr_t = _section(data, "training", file)
    bud_t = _section(data, "budget", file)
    cfg_t = dict(_section(data, "config", file))
    obj_t = _section(data, "objective", file)

    card = _get(model_t, "card", str, "model", file)
    base = Path(file).parent if file else Path.cwd()
    card_path = base / card
    model = _nested(load_card, str(card_path) if (card.endswith((".toml", ".json"))
                                                  and path_exists(card_path)) else card,
                    file, "model.card")

    gpus = hw_t.get("gpu")
    gpus = gpus if isinstance(gpus, list) else [gpus]
    if not gpus or gpus == [None]:
        raise CapoptError("missing required field", file=file, field="hardware.gpu")
    if len(gpus) > 64:
        raise CapoptError(f"a list of {len(gpus)} GPUs", file=file, field="hardware.gpu",
                          allowed="at most 64")
    hardwares = []
    for gpu in gpus:
        _get({"gpu": gpu}, "gpu", str, "hardware", file)
        gpu_path = base / gpu
        hardwares.append(_nested(get_hardware, str(gpu_path) if gpu.endswith(".toml")
                                 and path_exists(gpu_path) else gpu, file, "hardware.gpu"))
    counts = hw_t.get("count", 1)
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or len(counts) > 64:
        raise CapoptError(f"a list of {len(counts)} counts", file=file, field="hardware.count",
                          allowed="a positive integer or a list of 1 to 64 of them")
    for c in counts:
        _get({"count": c}, "count", int, "hardware", file)
    hardware, count = hardwares[0], counts[0]
    per_node_given = "per_node" in hw_t
    per_node = _get(hw_t, "per_node", int, "hardware", file, min(hardware.per_node, count))
    price_raw = hw_t.get("price_per_gpu_hour")
    prices = price_raw if isinstance(price_raw, dict) else {}
    price = None if isinstance(price_raw, dict) else _get(
        hw_t, "price_per_gpu_hour", float, "hardware", file, None)
    for key, v in {"": price, **prices}.items():
        if v is not None:
            check_number(v, "hardware.price_per_gpu_hour", file)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e6:
                raise CapoptError(f"must be a number from 0 to 1e6, got {v!r}", file=file,
                                  field="hardware.price_per_gpu_hour" + (f".{key}" if key else ""))

    def price_for(hw) -> float | None:
        if not prices:
            return price
        for name in (hw.name, *hw.aliases):
            if name in prices:
                return float(prices[name])
        raise CapoptError(f"no price for {hw.name!r}", file=file,
                          field="hardware.price_per_gpu_hour", allowed=", ".join(prices))

    seq_default = model.native_seq_len or ...
    runtime = _nested(get_profile, _get(tr_t, "runtime", str, "training", file, "xla-gpu"),
                      file, "training.runtime")
    # (a runtime without mixed precision, torchtune, trains in its first dtype by default)
    names = runtime.precision_names
    precision_default = "bf16-mixed" if "bf16-mixed" in names else names[0]
    choice_values = {name: _choice(tr_t, name, file) for name in WORKLOAD_CHOICES}
    workload = Workload(
        seq_len=_get(tr_t, "seq_len", int, "training", file, seq_default),
        global_batch=_get(tr_t, "global_batch", int, "training", file),
        precision=_get(tr_t, "precision", str, "training", file, precision_default),
        optimizer=_get(tr_t, "optimizer", str, "training", file, "adamw"),
        grad_clip=_get(tr_t, "grad_clip", bool, "training", file, True),
        lora=_lora(tr_t.get("lora"), file),
        async_tp=_get(tr_t, "async_tp", bool, "training", file, False),
        **{name: vals[0] for name, (vals, _) in choice_values.items()},
        input_samples_per_s=_get(tr_t, "input_samples_per_s", float, "training", file, None),
        train_tokens=_get(tr_t, "train_tokens", float, "training", file, None),
    )
    _check_workload_fits_model(model, workload, file)

    vram_given = _get(bud_t, "vram_gib", float, "budget", file, None)
    headroom = _get(bud_t, "headroom", float, "budget", file, 0.10)

    def budget_for(hw) -> Budget:
        vram_gib = vram_given if vram_given is not None else hw.memory_bytes / GiB
        if not vram_gib > 0:
            raise CapoptError(f"must be > 0, got {vram_gib}", file=file, field="budget.vram_gib")
        device_gib = hw.memory_bytes / GiB
        if vram_gib > device_gib * (1 + 1e-9):
            raise CapoptError(f"{vram_gib:g} GiB is more than the {device_gib:.2f} GiB of one "
                              f"{hw.name}", file=file, field="budget.vram_gib",
                              allowed=f"at most {device_gib:.2f} (or leave it out)")
        return Budget(vram_bytes=int(vram_gib * GiB), headroom=headroom)

    budget = budget_for(hardware)
    deadline_h = _get(obj_t, "deadline_hours", float, "objective", file, None)

    for key, value in overrides.items():
        if key not in KNOBS:
            raise CapoptError(f"unknown knob {key!r}", field="--set", allowed=", ".join(KNOBS))
        cfg_t[key] = value
    _rederive_batch_split(cfg_t, overrides, file)
    stage = {}
    for name, allowed in STAGE_KNOBS.items():
        raw = cfg_t.pop(name, allowed[0])
        if raw not in allowed:
            raise CapoptError(f"got {raw!r}", file=file, field=f"config.{name}",
                              allowed=", ".join(map(repr, allowed)))
        stage[name] = raw
    knobs = tuple(parse_knob(name, raw, file) for name, raw in cfg_t.items())

    common = dict(
        name=_get(data, "name", str, "", file, Path(file).stem if file else "scenario"),
        model=model, workload=workload, runtime=runtime, knobs=knobs,
        objective=_get(obj_t, "maximize", str, "objective", file, "throughput"),
        deadline_s=deadline_h * 3600.0 if deadline_h else None, path=file, **stage)
    primary_at = dict(hardware=hardware, count=count, per_node=per_node, budget=budget,
                      price_per_gpu_hour=price_for(hardware))
    workloads, searched = _workload_choices(choice_values, common, primary_at)
    common["choices"] = searched
    variants = [Scenario(hardware=hw, count=c,
                         per_node=per_node if per_node_given else min(hw.per_node, c),
                         budget=budget_for(hw), price_per_gpu_hour=price_for(hw),
                         **{**common, "workload": w})
                for hw in hardwares for c in counts for w in workloads]
    primary = Scenario(**primary_at, **{**common, "workload": workloads[0]})
    if len(variants) > 1:
        primary = primary.replace(variants=tuple(variants))
    return primary


# [training] fields the optimiser chooses where the scenario lets it: a list of values, or
# "auto" (every value of the tuple the runtime, the model and the other fields allow). The
# first value is the field's default; a single value is the field as it always was.
WORKLOAD_CHOICES: dict[str, tuple] = {
    "loss": LOSSES,
    "compile": (False, True),
    "optimizer_in_backward": (False, True),
    "activation_offload": (False, True),
    "paged_optimizer": (False, True),
}


def _choice(tr_t: Mapping, name: str, file) -> tuple[list, bool]:
    """A choosable [training] field's values, and whether they came from "auto"."""
    allowed = WORKLOAD_CHOICES[name]
    field = f"training.{name}"
    raw = tr_t.get(name, allowed[0])
    if raw == "auto":
        return list(allowed), True
    flag = isinstance(allowed[0], bool)
    what = ("true, false, [true, false] or \"auto\"" if flag else
            ", ".join(allowed) + ', a list of them, or "auto"')
    vals = raw if isinstance(raw, list) else [raw]
    if not vals:
        raise CapoptError("empty list", file=file, field=field, allowed=what)
    out: list = []
    for v in vals:
        ok = isinstance(v, bool) if flag else isinstance(v, str) and v in allowed
        if not ok:
            raise CapoptError(f"got {v!r}" if flag or not isinstance(v, str) else
                              f"unknown {name} {v!r}", file=file, field=field, allowed=what)
        if v not in out:
            out.append(v)
    return out, False


def _workload_choices(choice_values: Mapping[str, tuple[list, bool]], common: dict,
                      primary_at: dict) -> tuple[list[Workload], tuple[str, ...]]:
    """The workloads the optimiser chooses among (the first the scenario's default), and the
    fields that vary. Each combination of the choosable fields' values is built as a scenario
    and kept if it is one; a value given by "auto" that no combination takes is left out (the
    runtime or the model does not run it), a value listed by hand must be taken by one, or its
    error is the scenario's."""
    import dataclasses
    import itertools
    searched = tuple(n for n, (vals, _) in choice_values.items() if len(vals) > 1)
    base = common["workload"]
    if not searched:
        return [base], ()
    kept: list[Workload] = []
    first_error: dict[tuple[str, Any], CapoptError] = {}
    for combo in itertools.product(*(choice_values[n][0] for n in searched)):
        try:
            w = dataclasses.replace(base, **dict(zip(searched, combo)))
            Scenario(**primary_at, **{**common, "workload": w})
        except CapoptError as e:
            for item in zip(searched, combo):
                first_error.setdefault(item, e)
            continue
        kept.append(w)
    for name in searched:
        vals, auto = choice_values[name]
        for v in vals:
            if not any(getattr(w, name) == v for w in kept) and (not auto or not kept):
                raise first_error[(name, v)]
    left = tuple(n for n in searched if len({getattr(w, n) for w in kept}) > 1)
    for name in searched:
        if name not in left and choice_values[name][1]:
            value = getattr(kept[0], name)
            value = str(value).lower() if isinstance(value, bool) else f'"{value}"'
            warnings.warn(f"training.{name} = \"auto\": {value} is the only value the "
                          f"{common['runtime'].name} runtime and the scenario allow",
                          CapoptWarning, stacklevel=5)
    return kept, left


class CapoptWarning(UserWarning):
    """Input that is allowed but probably not what was meant (the CLI prints one line)."""


# micro_batch x grad_accum x dp = global_batch: pinning one of the pair on the command line
# frees the other where only the file pinned it
_BATCH_PAIR = {"micro_batch": "grad_accum", "grad_accum": "micro_batch"}


def _rederive_batch_split(cfg_t: dict, overrides: Mapping[str, Any], file) -> None:
    """``--set micro_batch=N`` over a file that pins ``grad_accum`` (or the reverse): the
    file's value is let go (``"auto"``: derived from the global batch, or searched) and a
    warning says so; both set on the command line stay as given."""
    for key, other in _BATCH_PAIR.items():
        if key in overrides and other not in overrides and cfg_t.get(other, "auto") != "auto":
            was = cfg_t[other]
            cfg_t[other] = "auto"
            warnings.warn(f"--set {key}={overrides[key]!r}: {other} (pinned to {was!r} in "
                          f"{file or 'the scenario'}) is derived from the global batch; "
                          f"--set {other}=N to pin both", CapoptWarning, stacklevel=4)


def _check_workload_fits_model(model, workload, file) -> None:
    """A LoRA rank beyond the wrapped matrices' smallest side is an error; a sequence longer
    than the card's position table is a warning (rotary cards extrapolate; a learned table
    would be indexed past its end)."""
    lora = workload.lora
    if lora is not None and model.family != "mlp":
        from ._inventory import inventory
        sides = [min(t.shape[-2:]) for t in inventory(model, lora) if t.lora == "base"]
        if not sides:                     # PEFT: "Target modules ... not found in the base model"
            from ._inventory import LORA_MATRICES
            have = sorted({t.matmul for t in inventory(model) if t.where == "block"
                           and any(t.matmul in g for g in LORA_MATRICES.values())})
            raise CapoptError(f"{', '.join(lora.targets)} wrap no matrix of {model.name}",
                              file=file, field="training.lora.targets",
                              allowed=", ".join([*LORA_MATRICES, *have]))
        if lora.rank > min(sides):
            raise CapoptError(f"rank {lora.rank} exceeds the smallest side ({min(sides)}) of "
                              "the matrices it adapts", file=file, field="training.lora.rank",
                              allowed=f"1 to {min(sides)}")
    limit = model.max_position_embeddings
    if limit and model.family in ("decoder", "encoder") and workload.seq_len > limit:
        warnings.warn(f"{file or 'scenario'}: training.seq_len {workload.seq_len} is longer "
                      f"than {model.name}'s max_position_embeddings {limit}", CapoptWarning,
                      stacklevel=3)


def load_scenario(path_or_dict: str | os.PathLike | Mapping | None = None, *,
                  overrides: Mapping[str, Any] | None = None,
                  values: Mapping[str, tuple[Any, str]] | None = None) -> Scenario:
    """A `Scenario` from a TOML path, a scenario name in ``scenarios/``, or a dict.

    ``None`` loads the default scenario. ``overrides`` pins ``[config]`` knobs (``--set``);
    ``values`` sets scenario fields, ``{"training.seq_len": (4096, "--seq-len")}``, over the
    file's (each with the name it was given by, which a bad value's error names). Bad input
    raises `CapoptError` naming file and field.
    """
    if isinstance(path_or_dict, Mapping):
        check_depth(path_or_dict, None, limit=4)
        return scenario_from_dict(path_or_dict, overrides=overrides, values=values)
    path = resolve_scenario_path(path_or_dict or DEFAULT_SCENARIO)
    data = parse_toml(read_text(path), str(path))
    check_depth(data, str(path), limit=4)
    return scenario_from_dict(data, file=str(path), overrides=overrides, values=values)


def one_line_scenario(values: Mapping[str, tuple[Any, str]],
                      overrides: Mapping[str, Any] | None = None) -> Scenario:
    """A scenario from command-line values alone (no file): ``model.card`` is required, the
    rest defaults as a file's would (one device, every knob searched); named
    ``command line``."""
    return scenario_from_dict({"name": "command line"}, overrides=overrides, values=values)


def pinned_config(sc: Scenario, **knobs) -> Config:
    """The one `Config` a scenario pins (plus ``knobs``), with defaults filling the rest.

    Unpinned parallel degrees default to pure data parallelism over all devices; an unpinned
    micro-batch to the largest that divides the per-replica batch with no accumulation is not
    guessed: `plan` needs every knob pinned or defaulted.
    """
    values: dict[str, Any] = {}
    for name, spec in KNOBS.items():
        if name in knobs:
            values[name] = knobs[name]
            continue
        dom = sc.knob(name)
        if dom.pinned:
            values[name] = dom.values[0]
        elif spec.default != "auto":
            values[name] = spec.default
    tp, pp = values.setdefault("tp", 1), values.setdefault("pp", 1)
    if "dp" not in values:
        values["dp"] = max(sc.count // (tp * pp), 1)
    values.setdefault("zero_stage", 0)
    values.setdefault("sequence_parallel", False)
    values.setdefault("remat", "none")
    dp = values["dp"]
    if dp % values.get("cp", 1):
        raise CapoptError(f"cp {values['cp']} must divide dp {dp} (dp counts the context-"
                          "parallel ranks)", file=sc.path, field="config.cp",
                          allowed=f"a divisor of {dp}")
    replicas = data_replicas(dp, values.get("cp", 1))
    per_replica = (sc.workload.global_batch // replicas
                   if sc.workload.global_batch % replicas == 0 else None)
    if "micro_batch" not in values and "grad_accum" not in values:
        missing = "config.micro_batch"
        raise CapoptError("one config needs micro_batch or grad_accum pinned, and the "
                          "scenario leaves both to the search (optimize searches them; or pin "
                          "one, e.g. --set micro_batch=2)",
                          file=sc.path, field=missing, allowed="a positive integer")
    if per_replica is None:
        raise CapoptError(f"global_batch {sc.workload.global_batch} is not divisible by "
                          f"{replicas} data-parallel replicas (dp {dp}, cp "
                          f"{values.get('cp', 1)})" if replicas != dp else
                          f"global_batch {sc.workload.global_batch} is not divisible by dp {dp}",
                          file=sc.path, field="config.dp")
    if "micro_batch" not in values:
        ga = values["grad_accum"]
        if per_replica % ga:
            raise CapoptError(f"per-replica batch {per_replica} not divisible by grad_accum {ga}",
                              file=sc.path, field="config.grad_accum")
        values["micro_batch"] = per_replica // ga
    if "grad_accum" not in values:
        mb = values["micro_batch"]
        if per_replica % mb:
            raise CapoptError(f"per-replica batch {per_replica} not divisible by micro_batch "
                              f"{mb}", file=sc.path, field="config.micro_batch")
        values["grad_accum"] = per_replica // mb
    try:
        return Config(**values)
    except CapoptError as e:
        raise e.in_file(sc.path) if sc.path else e from None
