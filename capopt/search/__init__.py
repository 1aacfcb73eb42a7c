"""Search: the relaxed optax solve, discretisation and ranking, and the exhaustive reference."""

from ._space import Lattice, Space, build_lattice
from .optimize import OptimizeResult, optimize
from .remedies import remedies

__all__ = ["Lattice", "OptimizeResult", "Space", "build_lattice", "optimize", "remedies"]
