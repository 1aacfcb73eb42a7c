"""What the kernel-table benchmarks (`gemm_table.py`, `attention_table.py`) share: the cost
model's numbers for a one-block probe on a card, and the ``--profile`` argument."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from capopt._errors import CapoptError  # noqa: E402
from capopt._hardware import Hardware  # noqa: E402
from capopt._model import ModelSpec  # noqa: E402
from capopt._runtime import get_profile  # noqa: E402
from capopt._specs import Budget, Scenario, Workload  # noqa: E402


def probe_numbers(hw: Hardware, precision: str, profile: str, *, seq: int = 256,
                  head_dim: int | None = None) -> dict:
    """`capopt.cost.scenario_numbers` of one decoder block (hidden 2048 with ``head_dim``-wide
    heads, or hidden 256) at ``seq`` tokens on ``hw``: its rates (peaks, GEMM and attention
    efficiencies) are the card's and the profile's, which is all a kernel table is priced by."""
    from capopt.cost import scenario_numbers
    if head_dim is None:
        shape = dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024)
    else:
        shape = dict(hidden_size=2048, num_attention_heads=max(1, 2048 // head_dim),
                     intermediate_size=8192, head_dim=head_dim)
    model = ModelSpec(name="probe", family="decoder", num_hidden_layers=1, vocab_size=1024,
                      max_position_embeddings=seq, **shape)
    sc = Scenario(name="kernel-probe", model=model, hardware=hw, count=1, per_node=1,
                  workload=Workload(seq_len=seq, global_batch=1, precision=precision),
                  budget=Budget(vram_bytes=hw.memory_bytes), runtime=get_profile(profile))
    return scenario_numbers(sc)


def profile_args(doc: str, default: str, argv=None):
    """The script's arguments (``--profile``), or None after one error line naming a profile
    that does not exist (the caller exits with status 2)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--profile", default=default)
    args = ap.parse_args(argv)
    try:
        get_profile(args.profile)
    except CapoptError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return args


def write_results(path: Path, out: dict) -> int:
    """Write a script's JSON to ``path`` and say so; the script's exit status (0)."""
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path} in {out['total_s']:.0f} s")
    return 0
