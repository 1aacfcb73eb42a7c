"""The GPU-training checklist: `doctor` (probes of this machine, judged against what training
on a GPU needs), `monitor` (NVML sampling and JAX allocator statistics, explained) and `smi`
(nvidia-smi's output, parsed once for both)."""
