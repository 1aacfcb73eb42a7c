"""Units: the byte and rate multiples capopt reads and prints, defined once.

Memory is counted in binary multiples (a "GiB" is 2^30 bytes: what `nvidia-smi`, PyTorch's
allocator and XLA's buffer assignment report); datasheet capacities and bandwidths are in
decimal ones (a "GB" is 10^9 bytes, a "TB/s" 10^12 bytes a second).
"""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30
GB = 10**9
TB = 10**12
TERA = 1e12

__all__ = ["GB", "GiB", "KiB", "MiB", "TB", "TERA"]
