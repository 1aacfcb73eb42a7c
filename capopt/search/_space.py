"""The lattice of real configs a scenario allows, built as arrays (no per-config objects).

Every row satisfies `capopt._validity`'s rules by construction: each knob's values are
filtered with the rules that read it and the knobs chosen before it; the tests check that on
samples. Rows convert to `Knobs` batches for the vectorised cost model and back to `Config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from .._specs import REMAT_POLICIES, Config, KnobDomain, Scenario, remat_weights
from .._validity import broken
from ..cost._inputs import DTYPE, Knobs

COLUMNS = ("micro_batch", "grad_accum", "dp", "tp", "pp", "ep", "zero_stage",
           "sequence_parallel", "remat", "offload_optimizer", "flash_attention", "cp", "vpp",
           "dp_replicate", "offload_params")
# the virtual pipeline stages "auto" tries: up to 8 a rank (Narayanan et al. 2021 ran 2-4;
# the bubble falls as 1 / vpp while every chunk adds sends and warmup activations)
AUTO_VPP = tuple(range(1, 9))
REMAT_CODES = {"none": 0, "selective": 1, "full": 2}


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def domain(sc: Scenario, name: str, auto: list) -> list:
    """Allowed values of a knob: the scenario's list, or ``auto`` when it says "auto"."""
    dom = sc.knob(name)
    if dom.values is None:
        return list(auto)
    return [v for v in dom.values]


def remat_values(sc: Scenario) -> list:
    vals = domain(sc, "remat", list(REMAT_POLICIES))
    return vals


def _allowed(sc: Scenario, cols: dict[str, np.ndarray]) -> np.ndarray:
    """Rows of ``cols`` that break none of the rules reading only these knobs."""
    return ~broken(cols, sc, known=set(cols))


def factorizations(sc: Scenario) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp*tp*pp = devices that the model and the scenario allow."""
    N = sc.count
    tps = domain(sc, "tp", divisors(N))
    pps = domain(sc, "pp", divisors(N))
    dps = set(domain(sc, "dp", divisors(N)))
    cand = [(N // (tp * pp), tp, pp) for tp in tps for pp in pps
            if tp * pp <= N and N % (tp * pp) == 0 and N // (tp * pp) in dps]
    if not cand:
        return []
    arr = np.asarray(cand, np.int64)
    ok = _allowed(sc, {"dp": arr[:, 0], "tp": arr[:, 1], "pp": arr[:, 2]})
    return [c for c, keep in zip(cand, ok) if keep]


def no_layout_reason(sc: Scenario) -> str | None:
    """Why no config of ``sc`` is real, whatever the memory (None when one is): the parallel
    layouts the devices and the model allow, and what rules each of them out."""
    facts = factorizations(sc)
    if not facts:
        m = sc.model
        return (f"no dp x tp x pp = {sc.count} devices suits the model and the scenario "
                f"(tp must divide {m.num_attention_heads} heads and fit {sc.per_node} per node, "
                f"pp must divide {m.num_hidden_layers} layers)")
    space = Space(sc)
    why = []
    for dp, tp, pp in facts:
        if any(space.micro_batches(dp, cp, pp, vpp) for cp, vpp in space.outer((dp, tp, pp))):
            return None
        b = sc.workload.global_batch
        vpps = space.virtual_degrees(pp)
        if vpps and 1 not in vpps and any(space.micro_batches(dp, cp)
                                          for cp in space.context_degrees(dp)):
            why.append(f"dp {dp} (tp {tp}, pp {pp}): vpp {vpps} needs micro-batches a step in "
                       f"a multiple of pp {pp}, which no micro_batch the scenario allows gives")
            continue
        why.append(f"dp {dp} (tp {tp}, pp {pp}): " + (
            f"global_batch {b} is not divisible by dp {dp}" if b % dp else
            "no micro_batch x grad_accum the scenario allows makes the per-replica batch "
            f"{b // dp}" + (" (training.optimizer_in_backward takes one micro-batch a step)"
                            if sc.workload.optimizer_in_backward else "")))
    return "no valid layout: " + "; ".join(why[:4]) + ("; ..." if len(why) > 4 else "")


def pinned_layout_refusal(sc: Scenario) -> tuple[str, str, str] | None:
    """(field, why, allowed) where the dp, tp or pp values the scenario pins leave no
    dp x tp x pp layout of its devices that the same scenario, with that degree left free,
    has: the first such degree and the values of it those layouts use; None otherwise."""
    if factorizations(sc):
        return None
    degrees = ("dp", "tp", "pp")                    # the order of a factorization's entries
    pins = [k for k in degrees if sc.knob(k).values is not None]
    for name in pins:
        free = sc.replace(knobs=tuple(k for k in sc.knobs if k.name != name)
                          + (KnobDomain(name, None),))
        usable = sorted({f[degrees.index(name)] for f in factorizations(free)})
        if usable:
            beside = [f"{o} {_listed(sc.knob(o).values)}" for o in pins if o != name]
            return (f"config.{name}",
                    f"{name} {_listed(sc.knob(name).values)} leaves no dp x tp x pp = "
                    f"{sc.count} devices that the model and the scenario allow"
                    + (f" (beside {', '.join(beside)})" if beside else ""),
                    ", ".join(map(str, usable)))
    return None


def _listed(values) -> str:
    return str(values[0]) if len(values) == 1 else str(list(values))


def knob_refusal(sc: Scenario) -> tuple[str, str] | None:
    """(field, why) where every value the scenario allows for the context-parallel degree, the
    virtual pipeline stages or the hybrid-sharding replicas is refused beside every layout
    (the runtime does not run it, the model's blocks do not split): the words of the first
    rule the first value breaks beside the first layout (replicas beside a ZeRO stage, the
    one rule of theirs a row applies); None otherwise."""
    from .._validity import config_problems
    facts = factorizations(sc)
    if not facts:
        return None
    space = Space(sc)
    for knob, values, allowed in (("cp", space._cp, lambda f: space.context_degrees(f[0])),
                                  ("vpp", space._vpp, lambda f: space.virtual_degrees(f[2])),
                                  ("dp_replicate", space._dpr,
                                   lambda f: space.replica_degrees(f[0]))):
        if values is None or any(allowed(f) for f in facts):
            continue
        # beside a pipeline where there is one: vpp's own rules, not "needs pp > 1"
        dp, tp, pp = max(facts, key=lambda f: knob == "vpp" and f[2] > 1)
        probe = Config(dp=dp, tp=tp, pp=pp, zero_stage=3 if knob == "dp_replicate" else 0,
                       **{knob: values[0]})
        mine = [why for field, why in config_problems(probe, sc) if field == f"config.{knob}"]
        return f"config.{knob}", (mine[0] if mine else
                                  f"no layout of {sc.count} devices allows {list(values)}")
    return None


@dataclass
class Lattice:
    """Columns of equal length, one row per config (see `COLUMNS`)."""

    cols: dict[str, np.ndarray]
    remat_table: list            # code -> remat value (policy name or fraction)
    layers: float | None = None  # the model's blocks: a fraction recomputes whole ones

    def __len__(self) -> int:
        return len(self.cols["dp"])

    def knobs(self, rows: np.ndarray | slice | None = None) -> Knobs:
        c = {k: (v if rows is None else v[rows]) for k, v in self.cols.items()}
        f = lambda x: jnp.asarray(x, DTYPE)  # noqa: E731
        zero = np.eye(4, dtype=np.float32)[c["zero_stage"]]
        # (per row: a fraction rounds to whole blocks of the row's pipeline stage)
        pps = np.asarray(c["pp"], int)
        codes = np.asarray(c["remat"], int)
        rw = np.zeros((len(pps), 3), np.float32)
        for p in np.unique(pps):
            per = None if self.layers is None else self.layers / p
            table = np.asarray([remat_weights(v, per) for v in self.remat_table], np.float32)
            rw[pps == p] = table[codes[pps == p]]
        return Knobs(micro_batch=f(c["micro_batch"]), grad_accum=f(c["grad_accum"]),
                     dp=f(c["dp"]), tp=f(c["tp"]), pp=f(c["pp"]), ep=f(c["ep"]),
                     zero=jnp.asarray(zero), remat=jnp.asarray(rw),
                     sp=f(c["sequence_parallel"]), offload=f(c["offload_optimizer"]),
                     flash=f(c["flash_attention"]), cp=f(c["cp"]), vpp=f(c["vpp"]),
                     dpr=f(c["dp_replicate"]), offload_params=f(c["offload_params"]))

    def config(self, row: int) -> Config:
        c = {k: v[row] for k, v in self.cols.items()}
        return Config(micro_batch=int(c["micro_batch"]), grad_accum=int(c["grad_accum"]),
                      dp=int(c["dp"]), tp=int(c["tp"]), pp=int(c["pp"]), ep=int(c["ep"]),
                      zero_stage=int(c["zero_stage"]),
                      sequence_parallel=bool(c["sequence_parallel"]),
                      remat=self.remat_table[int(c["remat"])],
                      offload_optimizer=bool(c["offload_optimizer"]),
                      flash_attention=bool(c["flash_attention"]), cp=int(c["cp"]),
                      vpp=int(c["vpp"]), dp_replicate=int(c["dp_replicate"]),
                      offload_params=bool(c["offload_params"]))

    def key(self, row: int) -> tuple:
        return tuple(int(self.cols[k][row]) for k in COLUMNS)

    def keys(self) -> list[tuple]:
        """`key` of every row."""
        if not len(self):
            return []
        return [tuple(r) for r in np.stack([self.cols[k] for k in COLUMNS], 1).tolist()]


def _bools(sc: Scenario, name: str) -> list[bool]:
    """A boolean knob's values: ``"auto"`` is both; a knob left out has its default
    (`Scenario.knob`)."""
    return domain(sc, name, [False, True])


class Space:
    """The allowed values of every knob, and which combinations are real."""

    def __init__(self, sc: Scenario):
        m = sc.model
        self.sc = sc
        self.batch = sc.workload.global_batch
        self.facts = factorizations(sc)
        self.remat_table = remat_values(sc)
        self.zeros = domain(sc, "zero_stage", [0, 1, 2, 3])
        self.sps = _bools(sc, "sequence_parallel")
        self.offloads = _bools(sc, "offload_optimizer")
        self.param_offloads = _bools(sc, "offload_params")
        self.flashes = _bools(sc, "flash_attention")
        self._mb = sc.knob("micro_batch").values
        self._ga = sc.knob("grad_accum").values
        self._ep = sc.knob("ep").values
        self._cp = sc.knob("cp").values
        self._vpp = sc.knob("vpp").values
        self._dpr = sc.knob("dp_replicate").values
        self._experts = m.num_local_experts if m.is_moe else 1

    def per_replica(self, dp: int, cp: int = 1) -> int | None:
        """Sequences per data-parallel replica and step, ``global_batch / (dp / cp)`` (None
        where they do not divide)."""
        if dp % cp or self.batch % (dp // cp):
            return None
        return self.batch // (dp // cp)

    def micro_batches(self, dp: int, cp: int = 1, pp: int = 1, vpp: int = 1) -> list[int]:
        """Micro-batch sizes next to ``dp`` / ``cp``; interleaved (``vpp`` > 1), those whose
        micro-batch count is a multiple of ``pp`` (`capopt._validity`)."""
        per = self.per_replica(dp, cp)
        if per is None:
            return []
        mbs = [d for d in divisors(per) if (self._mb is None or d in self._mb)
               and (self._ga is None or per // d in self._ga)
               and (vpp == 1 or (per // d) % pp == 0)]
        if not mbs:
            return []
        # (and the rules on the micro-batches a step: an optimizer stepped in the backward
        # pass takes one)
        mb = np.asarray(mbs, np.int64)
        full = lambda v: np.full(len(mb), v, np.int64)  # noqa: E731
        ok = _allowed(self.sc, {"micro_batch": mb, "grad_accum": per // mb, "dp": full(dp),
                                "cp": full(cp), "pp": full(pp), "vpp": full(vpp)})
        return [d for d, keep in zip(mbs, ok) if keep]

    def virtual_degrees(self, pp: int) -> list[int]:
        """Virtual pipeline stages a rank next to ``pp``: the scenario's (or `AUTO_VPP`),
        that the runtime and the model's blocks allow (`capopt._validity`)."""
        return self._keep(list(self._vpp if self._vpp is not None else AUTO_VPP), "vpp", pp=pp)

    def context_degrees(self, dp: int) -> list[int]:
        """Context-parallel degrees next to ``dp``: the scenario's, that divide dp and that
        the runtime and the model allow (`capopt._validity`)."""
        cand = [c for c in divisors(dp) if self._cp is None or c in self._cp]
        return self._keep(cand, "cp", dp=dp)

    def replica_degrees(self, dp: int, cp: int = 1) -> list[int]:
        """Hybrid-sharding replicas next to ``dp`` / ``cp``: the scenario's (every divisor of
        dp / cp under "auto"), that leave a shard group and that the runtime runs
        (`capopt._validity`); whether the ZeRO stage and ep allow them is the row's rule."""
        cand = [r for r in divisors(max(dp // cp, 1)) if self._dpr is None or r in self._dpr]
        return self._keep(cand, "dp_replicate", dp=dp, cp=cp)

    def expert_degrees(self, dp: int) -> list[int]:
        if self._experts == 1:
            return [1] if (self._ep is None or 1 in self._ep) else []
        cand = [e for e in divisors(math.gcd(self._experts, dp))
                if self._ep is None or e in self._ep]
        return self._keep(cand, "ep", dp=dp)

    def zero_stages(self, dp: int, pp: int) -> list[int]:
        return self._keep(self.zeros, "zero_stage", dp=dp, pp=pp)

    def seq_parallel(self, tp: int) -> list[bool]:
        return self._keep(self.sps, "sequence_parallel", tp=tp)

    def _keep(self, values: list, knob: str, **fixed: int) -> list:
        """The ``values`` of ``knob`` that the rules allow next to the ``fixed`` knobs."""
        if not values:
            return []
        col = np.asarray([int(v) for v in values], np.int64)
        cols = {knob: col, **{k: np.full(len(col), v, np.int64) for k, v in fixed.items()}}
        return [v for v, ok in zip(values, _allowed(self.sc, cols)) if ok]

    def choices(self, fact, mbs=None, eps=None, zeros=None, sps=None, remats=None,
                offloads=None, flashes=None, cp: int = 1, vpp: int = 1, dprs=None,
                opps=None) -> list[list]:
        """Allowed values of the inner knobs for one (dp, tp, pp), context-parallel degree
        ``cp`` and virtual stages ``vpp``, in `COLUMNS` order less grad_accum / dp / tp / pp
        / cp / vpp, each restricted to the given subset (None: all); dp_replicate and
        offload_params (``opps``) last."""
        dp, tp, pp = fact
        pick = lambda allowed, want: [v for v in allowed if want is None or v in want]  # noqa
        return [pick(self.micro_batches(dp, cp, pp, vpp), mbs),
                pick(self.expert_degrees(dp), eps),
                pick(self.zero_stages(dp, pp), zeros),
                [int(v) for v in pick(self.seq_parallel(tp), sps)],
                pick(range(len(self.remat_table)), remats),
                [int(v) for v in pick(self.offloads, offloads)],
                [int(v) for v in pick(self.flashes, flashes)],
                pick(self.replica_degrees(dp, cp), dprs),
                [int(v) for v in pick(self.param_offloads, opps)]]

    def outer(self, fact, cps=None, vpps=None) -> list[tuple[int, int]]:
        """The (cp, vpp) pairs allowed next to one (dp, tp, pp), restricted to ``cps`` /
        ``vpps`` (None: all)."""
        dp, _, pp = fact
        return [(cp, v) for cp in self.context_degrees(dp) if cps is None or cp in cps
                for v in self.virtual_degrees(pp) if vpps is None or v in vpps]

    def block(self, fact, *subsets, cps=None, vpps=None, **named) -> np.ndarray:
        """Rows for one (dp, tp, pp) as an int array (rows x `COLUMNS`): every combination
        of the allowed inner values, for each allowed context-parallel degree and number of
        virtual stages (restricted to ``cps`` / ``vpps``). The one enumeration `rows_for`
        and `build_lattice` share."""
        dp, tp, pp = fact
        out = []
        for cp, vpp in self.outer(fact, cps, vpps):
            ch = self.choices(fact, *subsets, cp=cp, vpp=vpp, **named)
            if not all(ch):
                continue
            grid = np.array(np.meshgrid(*ch, indexing="ij")).reshape(len(ch), -1)
            k = grid.shape[1]
            per = self.per_replica(dp, cp)
            full = lambda v: np.full(k, v)  # noqa: E731
            rows = np.stack([grid[0], per // grid[0], full(dp), full(tp), full(pp),
                             grid[1], grid[2], grid[3], grid[4], grid[5], grid[6],
                             full(cp), full(vpp), grid[7], grid[8]], 1).astype(np.int64)
            # (hybrid sharding's rules and parameter offload's read inner knobs: zero, ep)
            if (grid[7] > 1).any() or (grid[8] > 0).any():
                rows = rows[_allowed(self.sc, {c: rows[:, i] for i, c in enumerate(COLUMNS)
                                               if c != "remat"})]
            out.append(rows)
        return np.concatenate(out) if out else np.zeros((0, len(COLUMNS)), np.int64)

    def rows_for(self, fact, mbs=None, eps=None, zeros=None, sps=None, remats=None,
                 offloads=None, flashes=None, cps=None, vpps=None, dprs=None, opps=None
                 ) -> list[tuple]:
        """Real rows for one (dp, tp, pp), restricted to the given subsets of values."""
        arr = self.block(fact, mbs, eps, zeros, sps, remats, offloads, flashes, cps=cps,
                         vpps=vpps, dprs=dprs, opps=opps)
        return [tuple(r) for r in arr.tolist()]

    def size(self) -> int:
        """How many real configs the scenario allows (without building them)."""
        total = 0
        for (dp, tp, pp) in self.facts:
            for cp, v in self.outer((dp, tp, pp)):
                ch = self.choices((dp, tp, pp), cp=cp, vpp=v)
                # the inner knobs a rule reads together (ep, zero_stage, dp_replicate: hybrid
                # sharding's; offload_params beside zero_stage) counted as `block` filters
                # them, the others multiplied in
                joint = np.array(np.meshgrid(ch[1], ch[2], ch[7], ch[8],
                                             indexing="ij")).reshape(4, -1)
                full = lambda x: np.full(joint.shape[1], x, np.int64)  # noqa: E731
                ok = _allowed(self.sc, {"ep": joint[0], "zero_stage": joint[1],
                                        "dp_replicate": joint[2], "offload_params": joint[3],
                                        "dp": full(dp),
                                        "tp": full(tp), "pp": full(pp), "cp": full(cp),
                                        "vpp": full(v)})
                total += int(ok.sum()) * math.prod(len(c) for c in ch[:1] + ch[3:7])
        return total

    def lattice(self, rows: list[tuple] | np.ndarray) -> "Lattice":
        arr = np.asarray(rows, np.int64).reshape(-1, len(COLUMNS))
        return Lattice({c: arr[:, i] for i, c in enumerate(COLUMNS)}, self.remat_table,
                       float(self.sc.model.num_hidden_layers))


def build_lattice(sc: Scenario) -> Lattice:
    """All real configs of a scenario as columns (vectorised over the inner knobs)."""
    sp = Space(sc)
    blocks = [sp.block(f) for f in sp.facts]
    arr = (np.concatenate(blocks) if blocks else np.zeros((0, len(COLUMNS)), np.int64))
    return sp.lattice(arr)
