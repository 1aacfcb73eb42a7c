"""What XLA holds at a compiled step's peak: its own live ranges, read block by block.

XLA writes, with ``--xla_dump_to=DIR``, the schedule of a compiled module and the live range
of every buffer value (``*after_optimizations-live-range.txt``), ending with the values live at
the peak. The validation models name their scopes (``block3/attn``, ``head``, ``loss``,
``optimizer``), and JAX's transposition wraps them (``transpose(jvp(block3))``), so every
value's metadata says which block it belongs to and whether it is part of the forward pass,
the backward pass, a recomputation (``rematted_computation``) or the update.

`read_peak(dump_dir)` returns the peak's values; `summarize` groups their bytes. This is how
the memory model's phase rules are read off named configs (`capopt.cost.memory`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

_VALUE = re.compile(r"^\s+(?P<name>[^\s{]+)\{(?P<index>[^}]*)\}: (?P<bytes>\d+) bytes")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_OPNAME = re.compile(r'op_name="(?P<op>[^"]*)"')
_BLOCK = re.compile(r"block(\d+)")
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):")
_ALLOC = re.compile(r"^allocation (\d+): size (\d+)")
_ASSIGNED = re.compile(r"^ value: <\d+ (?P<name>[^\s{@]+)(?:\{(?P<index>[^}]*)\})? @\d+> "
                       r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\)")
_TEMP = re.compile(r"^allocation (\d+): size (\d+), preallocated-temp")
_RANGE = re.compile(r"^\s+(?P<name>[^\s{]+)\{(?P<index>[^}]*)\}:(?P<start>\d+)-(?P<end>\d+)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_PARAMETER = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .* parameter\(\d+\)")
_WHILE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .* while\(.*condition=%([\w.\-]+), "
                    r"body=%([\w.\-]+)")


@dataclass(frozen=True)
class LiveValue:
    """One buffer value live at the peak."""

    name: str
    index: str
    bytes: int
    shape: str
    op_name: str
    parameter: bool            # an argument of the step (parameters, optimizer state, batch)
    slot: tuple = ()           # (allocation, offset, size): values in one slot share memory

    @property
    def block(self) -> int | None:
        m = _BLOCK.findall(self.op_name)
        return int(m[-1]) if m else None

    @property
    def phase(self) -> str:
        """argument | forward | backward | rebuild | loss | optimizer | other."""
        op = self.op_name
        if self.parameter:
            return "argument"
        if "optimizer" in op:
            return "optimizer"
        if "rematted_computation" in op:
            return "rebuild"
        if "transpose(" in op:
            return "backward"
        if "jvp(" in op:
            return "forward"
        return "other"

    @property
    def module(self) -> str:
        """The named scope inside a block (attn, mlp, norm1, ...), or head / loss / embed."""
        op = self.op_name
        for part in ("attn", "mlp", "norm1", "norm2", "norm3", "norm4"):
            if f"/{part}/" in op or op.endswith(f"/{part}"):
                return part
        for part in ("loss", "head"):
            if part in op:
                return part
        return "-"


@dataclass(frozen=True)
class Peak:
    index: int                 # position in the schedule
    length: int                # instructions in the schedule
    at: str                    # the instruction scheduled at the peak
    at_op_name: str
    values: tuple[LiveValue, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes at the peak, each memory slot once (in-place updates share their operand's)."""
        return sum(v.bytes for v in self.unique())

    def unique(self) -> tuple[LiveValue, ...]:
        """The values with a slot of their own (the first value of each shared slot)."""
        seen, out = set(), []
        for v in self.values:
            if v.slot and v.slot in seen:
                continue
            seen.add(v.slot)
            out.append(v)
        return tuple(out)


def _dump_file(dump_dir: Path, suffix: str) -> Path:
    hits = sorted(p for p in dump_dir.iterdir() if p.name.endswith(suffix)
                  and "gpu_after_optimizations" in p.name)
    if not hits:
        raise FileNotFoundError(f"no *{suffix} in {dump_dir} (compile with --xla_dump_to)")
    return hits[-1]


def _instructions(hlo_text: str) -> dict[str, tuple[str, str, bool]]:
    """name -> (shape text, op_name, is an entry parameter)."""
    out: dict[str, tuple[str, str, bool]] = {}
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        if line.startswith("}"):
            in_entry = False
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group("rest")
        op = _OPNAME.search(rest)
        shape = rest.split(" ", 1)[0] if not rest.startswith("(") else rest[:rest.find(")") + 1]
        out[m.group("name")] = (shape, op.group("op") if op else "",
                                in_entry and " parameter(" in rest)
    return out


def _slots(text: str) -> dict[tuple[str, str], tuple[int, int, int]]:
    """(value name, tuple index) -> (allocation, offset, size) from a buffer assignment."""
    out: dict[tuple[str, str], tuple[int, int, int]] = {}
    alloc = -1
    for line in text.splitlines():
        m = _ALLOC.match(line)
        if m:
            alloc = int(m.group(1))
            continue
        m = _ASSIGNED.match(line)
        if m:
            out[(m.group("name"), m.group("index") or "")] = (
                alloc, int(m.group("offset")), int(m.group("size")))
    return out


def _sequence(live: list[str]) -> list[str]:
    """The instructions of a live-range dump's flattened schedule, by position."""
    seq, in_seq = [], False
    for line in live:
        s = line.strip()
        if s == "InstructionSequence:":
            in_seq = True
        elif s.startswith("BufferLiveRange:"):
            break
        elif in_seq:
            seq.append(s.split(":", 1)[-1])
    return seq


def read_peak(dump_dir: str | Path) -> Peak:
    """The values live at the peak of the compiled step dumped in ``dump_dir``."""
    d = Path(dump_dir)
    live = _dump_file(d, "live-range.txt").read_text().splitlines()
    instrs = _instructions(_dump_file(d, "after_optimizations.txt").read_text())
    slots = _slots(_dump_file(d, "buffer-assignment.txt").read_text())
    seq = _sequence(live)
    peak_at, values = -1, []
    in_peak = False
    for line in live:
        m = _PEAK.search(line)
        if m:
            peak_at, in_peak = int(m.group(1)), True
            continue
        if in_peak:
            v = _VALUE.match(line)
            if v:
                name = v.group("name")
                shape, op, param = instrs.get(name, ("?", "", False))
                values.append(LiveValue(name=name, index=v.group("index"),
                                        bytes=int(v.group("bytes")), shape=shape, op_name=op,
                                        parameter=param,
                                        slot=slots.get((name, v.group("index")), ())))
    at = seq[peak_at] if 0 <= peak_at < len(seq) else "?"
    return Peak(index=peak_at, length=len(seq), at=at, at_op_name=instrs.get(at, ("", "", 0))[1],
                values=tuple(values))


@dataclass(frozen=True)
class TempHeap:
    """XLA's temporary allocation of a compiled step against the live bytes of its buffers.

    ``flat_live_bytes`` is the most bytes live at once over the live ranges as the dump lists
    them: one flattened sequence, each while loop's condition and body placed just before
    the while instruction. That undercounts a loop: the values the caller holds across it
    are not live at the body's positions there. ``nested_live_bytes`` counts each loop as
    XLA's heap simulator does, the largest called computation's own peak held at the while
    instruction beside what is live across it (``NoFragmentationStatsHeap::
    AccountForSubcomputationMemory``, heap_simulator.cc), innermost loops first. What
    ``temp_bytes`` holds beyond it is the heap's packing. ``peak_at`` and ``peak_values`` are
    where that nested peak is (the instruction inside the innermost loop body at its own
    peak) and the temporary values live there (arguments are not in the allocation)."""

    temp_bytes: int
    flat_live_bytes: int
    nested_live_bytes: int
    loops: int
    peak_index: int = -1
    peak_at: str = "?"
    peak_op_name: str = ""
    peak_values: tuple[LiveValue, ...] = ()

    @property
    def packing_bytes(self) -> int:
        return self.temp_bytes - self.nested_live_bytes


@dataclass(frozen=True)
class _Span:
    """Bytes live over positions [start, end]: a buffer's values, or a loop held at its while
    (``inner``: the loop's own peak, its position and the spans live there)."""

    size: int
    start: int
    end: int
    values: tuple = ()
    inner: tuple | None = None


def _max_live(spans) -> tuple[int, int]:
    """(the most bytes live at once over the spans, the first position where they are)."""
    events: dict[int, int] = defaultdict(int)
    for sp in spans:
        events[sp.start] += sp.size
        events[sp.end + 1] -= sp.size
    now, best, at = 0, 0, -1
    for t in sorted(events):
        now += events[t]
        if now > best:
            best, at = now, t
    return best, at


def _nested_peak(spans: list, loops: list[tuple[int, int]]) -> tuple[int, int, list]:
    """(bytes, position, spans live there) of the most bytes live at once, each loop (its
    condition and body at positions [first, at - 1], run at position ``at``) held at ``at``
    at its own nested peak."""
    outer = [lp for lp in loops
             if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1] for o in loops)]
    rest = list(spans)
    for first, at in outer:
        inside = [sp for sp in rest if sp.start >= first and sp.end < at]
        if not inside:
            continue
        rest = [sp for sp in rest if not (sp.start >= first and sp.end < at)]
        inner = [lp for lp in loops if lp != (first, at) and first <= lp[0] and lp[1] < at]
        size, where, live = _nested_peak(inside, inner)
        rest.append(_Span(size, at, at, inner=(where, live)))
    best, t = _max_live(rest)
    return best, t, [sp for sp in rest if sp.start <= t <= sp.end]


def _innermost(t: int, live: list) -> tuple[int, list]:
    """The position and the buffers' spans of a nested peak, loops opened."""
    out = []
    for sp in live:
        if sp.inner is None:
            out.append(sp)
        else:
            t, inner = _innermost(*sp.inner)
            out.extend(inner)
    return t, out


def read_temp_heap(dump_dir: str | Path) -> TempHeap:
    """`TempHeap` of the compiled step dumped in ``dump_dir``: XLA's own buffers of its
    temporary allocation, each over its live range (values sharing an offset and size over
    touching ranges, a loop's carried state, counted as one buffer)."""
    d = Path(dump_dir)
    assignment = _dump_file(d, "buffer-assignment.txt").read_text()
    temps = {int(m.group(1)): int(m.group(2))
             for m in map(_TEMP.match, assignment.splitlines()) if m}
    temp = list(temps.values())[-1] if temps else 0
    values = [(key, size, offset) for key, (alloc, offset, size) in _slots(assignment).items()
              if alloc in temps]
    live = _dump_file(d, "live-range.txt").read_text().splitlines()
    seq = _sequence(live)
    position = {name: i for i, name in enumerate(seq)}
    ranges, in_ranges = {}, False
    for line in live:
        s = line.strip()
        if s.startswith("BufferLiveRange:"):
            in_ranges = True
        elif s.startswith("Live ranges at"):
            break
        elif in_ranges:
            m = _RANGE.match(line)
            if m:
                ranges[(m.group("name"), m.group("index"))] = (int(m.group("start")),
                                                               int(m.group("end")))
    slots: dict[tuple[int, int], list] = defaultdict(list)
    for key, size, offset in values:
        if key in ranges:
            slots[(offset, size)].append((*ranges[key], key))
    spans = []
    for (_, size), held in slots.items():
        held.sort()
        start, end, keys = held[0][0], held[0][1], [held[0][2]]
        for s0, e0, key in held[1:]:
            if s0 <= end + 1:
                end = max(end, e0)
                keys.append(key)
            else:
                spans.append(_Span(size, start, end, tuple(keys)))
                start, end, keys = s0, e0, [key]
        spans.append(_Span(size, start, end, tuple(keys)))
    hlo = _dump_file(d, "after_optimizations.txt").read_text()
    params, whiles, comp = defaultdict(list), {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            comp = m.group(1)
            continue
        m = _PARAMETER.match(line)
        if m and comp:
            params[comp].append(m.group(1))
        m = _WHILE.match(line)
        if m:
            whiles[m.group(1)] = (m.group(2), m.group(3))
    loops = []
    for name, called in whiles.items():
        firsts = [position[p] for c in called for p in params.get(c, ()) if p in position]
        if name in position and firsts:
            loops.append((min(firsts), position[name]))
    nested, t, live = _nested_peak(spans, loops)
    t, live = _innermost(t, live)
    instrs = _instructions(hlo)
    at = seq[t] if 0 <= t < len(seq) else "?"
    peak_values = []
    for sp in live:
        name, index = sp.values[0]
        shape, op, _ = instrs.get(name, ("?", "", False))
        peak_values.append(LiveValue(name=name, index=index, bytes=sp.size, shape=shape,
                                     op_name=op, parameter=False))
    return TempHeap(temp_bytes=temp, flat_live_bytes=_max_live(spans)[0],
                    nested_live_bytes=nested, loops=len(loops), peak_index=t, peak_at=at,
                    peak_op_name=instrs.get(at, ("", "", False))[1],
                    peak_values=tuple(peak_values))


def summarize(peak: Peak) -> dict[str, int]:
    """Bytes at the peak by (phase, block or '-', module)."""
    out: dict[str, int] = defaultdict(int)
    for v in peak.unique():
        b = "-" if v.block is None else str(v.block)
        out[f"{v.phase} {b} {v.module}"] += v.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


__all__ = ["LiveValue", "Peak", "TempHeap", "read_peak", "read_temp_heap", "summarize"]
