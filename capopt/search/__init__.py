"""Search: the relaxed optax solve, discretisation and ranking, and the exhaustive reference."""

from ._space import Lattice, Space, build_lattice
from .optimize import OptimizeResult, optimize
from .remedies import Remedy
from .remedies import remedies as _remedies


def remedies(sc, *, starts: int = 32) -> list[Remedy]:
    """Each change that could make ``sc`` fit, with whether it does, solved by `optimize`
    (`capopt.search.remedies.remedies`, which takes the solve as an argument)."""
    return _remedies(sc, optimize, starts=starts)


__all__ = ["Lattice", "OptimizeResult", "Space", "build_lattice", "optimize", "remedies"]
