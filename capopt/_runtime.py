"""Runtime profiles: how a framework lays out memory and how fast its kernels run.

A profile is data (``profiles/<name>.toml``): byte widths per precision, which buffers are live
together, bytes saved per op, logits copies, allocator and context overhead, kernel
efficiencies. The cost model reads only numbers from here; ``calibrate`` rewrites them.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ._errors import CapoptError

# --------------------------------------------------------------------------------------------
# Optimizer-state and quantised-weight layouts: the cost model (`capopt.cost`) counts these
# bytes and the validation step (`capopt.validation`) allocates them, from the constants below.
# --------------------------------------------------------------------------------------------
ADAM8BIT_BLOCK = 2048          # weights per float32 absmax in blockwise 8-bit Adam (bitsandbytes)
ADAM8BIT_MIN_SIZE = 4096       # smaller tensors keep float32 moments (bitsandbytes min_8bit_size)
ADAM8BIT_ABSMAX_BYTES = 4      # one float32 absmax per block
ADAFACTOR_MIN_DIM = 128        # optax.adafactor's min_dim_size_to_factor (its default)
INT8_SCALE_BYTES = 4           # 8-bit frozen base: one float32 scale per output column


def adam8bit_moment_bytes(size: int) -> int:
    """Bytes of one 8-bit Adam moment of a tensor with ``size`` elements: int8/uint8 codes
    padded to whole blocks plus a float32 absmax per block, or float32 below the threshold."""
    if size < ADAM8BIT_MIN_SIZE:
        return 4 * size
    blocks = -(-size // ADAM8BIT_BLOCK)
    return blocks * (ADAM8BIT_BLOCK + ADAM8BIT_ABSMAX_BYTES)


def adafactor_state_elems(shape: tuple[int, ...]) -> int:
    """Elements optax.adafactor keeps for one parameter (``scale_by_factored_rms``): a tensor
    whose second-largest dimension is >= ``ADAFACTOR_MIN_DIM`` keeps a row and a column
    accumulator (the shape without its largest, and without its second-largest, dimension)
    plus a 1-element placeholder for the full moment; any other tensor a full second moment
    plus two 1-element placeholders (row and column). The shared step counter is not counted."""
    size = 1
    for d in shape:
        size *= d
    if len(shape) >= 2:
        order = sorted(range(len(shape)), key=lambda i: shape[i])
        d1, d0 = order[-2], order[-1]
        if shape[d1] >= ADAFACTOR_MIN_DIM:
            return size // shape[d0] + size // shape[d1] + 1
    return size + 2


# Bytes per element of: working weights, gradients, fp32 master copy, saved activations,
# transient low-precision weight copy, optimizer-state elements; and the dtype matmuls run in.
PRECISION_FIELDS = ("param_bytes", "grad_bytes", "master_bytes", "act_bytes",
                    "weight_copy_bytes", "state_bytes", "matmul_dtype")


@dataclass(frozen=True)
class RuntimeProfile:
    name: str
    source: str
    coeffs: tuple[tuple[str, float], ...]                 # flat name -> value
    precisions: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]
    notes: tuple[tuple[str, str], ...] = ()               # coefficient -> where it came from

    def coeff(self, key: str) -> float:
        d = dict(self.coeffs)
        if key not in d:
            raise CapoptError(f"runtime profile {self.name!r} lacks coefficient {key!r}",
                              field=f"runtime.{key}")
        return float(d[key])

    def coeff_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.coeffs}

    def precision(self, name: str) -> dict:
        d = dict(self.precisions)
        if name not in d:
            raise CapoptError(f"runtime profile {self.name!r} has no precision {name!r}",
                              field="training.precision", allowed=", ".join(d))
        return dict(d[name])

    def with_coeffs(self, **updates: float) -> "RuntimeProfile":
        d = self.coeff_dict()
        unknown = set(updates) - set(d)
        if unknown:
            raise CapoptError(f"unknown coefficients {sorted(unknown)}", field="runtime")
        d.update({k: float(v) for k, v in updates.items()})
        return RuntimeProfile(self.name, self.source, tuple(sorted(d.items())),
                              self.precisions, self.notes)

    def to_toml(self) -> str:
        """Serialise to the same TOML the loader reads."""
        lines = [f"name = {self.name!r}".replace("'", '"'),
                 f"source = {self.source!r}".replace("'", '"'), "", "[coeffs]"]
        notes = dict(self.notes)
        for k, v in self.coeffs:
            note = notes.get(k)
            lines.append(f"{k} = {v!r}" + (f"   # {note}" if note else ""))
        for pname, fields in self.precisions:
            lines += ["", f'[precision."{pname}"]']
            for k, v in fields:
                lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}")
        return "\n".join(lines) + "\n"


def _parse(data: dict, file: str) -> RuntimeProfile:
    allowed = {"name", "source", "coeffs", "precision", "notes"}
    unknown = set(data) - allowed
    if unknown:
        raise CapoptError(f"unknown key {sorted(unknown)[0]!r}", file=file, field="profile",
                          allowed=", ".join(sorted(allowed)))
    try:
        coeffs = {k: float(v) for k, v in data["coeffs"].items()}
        precisions = []
        for pname, fields in data["precision"].items():
            missing = set(PRECISION_FIELDS) - set(fields)
            if missing:
                raise CapoptError(f"missing {sorted(missing)}", file=file,
                                  field=f"precision.{pname}")
            precisions.append((pname, tuple((k, fields[k]) for k in PRECISION_FIELDS)))
    except KeyError as e:
        raise CapoptError(f"missing table {e.args[0]!r}", file=file, field=str(e.args[0]))
    except (TypeError, ValueError) as e:
        raise CapoptError(f"bad value: {e}", file=file, field="coeffs")
    return RuntimeProfile(
        name=str(data.get("name", Path(file).stem)), source=str(data.get("source", "")),
        coeffs=tuple(sorted(coeffs.items())), precisions=tuple(precisions),
        notes=tuple(sorted((k, str(v)) for k, v in data.get("notes", {}).items())))


def list_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("capopt.profiles").iterdir()
                  if p.name.endswith(".toml"))


@functools.lru_cache(maxsize=None)
def _load_builtin(name: str) -> RuntimeProfile:
    text = resources.files("capopt.profiles").joinpath(f"{name}.toml").read_text()
    return _parse(tomllib.loads(text), f"capopt/profiles/{name}.toml")


def get_profile(name_or_path: str) -> RuntimeProfile:
    """A built-in profile by name, or a profile TOML file by path."""
    if name_or_path in list_profiles():
        return _load_builtin(name_or_path)
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.exists():
        try:
            return _parse(tomllib.loads(p.read_text()), str(p))
        except tomllib.TOMLDecodeError as e:
            raise CapoptError(f"malformed TOML: {e}", file=str(p))
    raise CapoptError(f"unknown runtime profile {name_or_path!r}", field="training.runtime",
                      allowed=", ".join(list_profiles()) + ", or a path to a profile .toml")
