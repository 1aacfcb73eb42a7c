"""Collectives in an alpha-beta model: ring and hierarchical algorithms over a two-level network.

A device has two links: ``intra_bw`` (NVLink or the node's fabric) and ``inter_bw`` (its share of
the scale-out network, one NIC per device on DGX-class nodes), each derated by the bus-bandwidth
efficiency NCCL reaches on it (``rt_nvlink_eff``, ``rt_net_eff``).

Placement (Megatron-LM's order): tensor-parallel ranks are innermost (adjacent devices), then
data-parallel, then pipeline stages. A group of ``size`` ranks spaced ``stride`` devices apart
has ``per = clip(per_node / stride, 1, size)`` members in each node and spans
``nodes = size / per`` nodes: a tensor-parallel group up to the node size stays on NVLink; a
data-parallel group behind tp = 8 has one member per node and uses one NIC per device.

Bandwidth (``S`` = the gathered / reduced buffer in bytes):

- ring: ``S (N-1)/N / B`` where ``B`` is NVLink inside one node and ``min(NVLink, per x NIC)``
  across nodes (NCCL runs one ring per NIC, so a node's NICs share the crossing traffic);
- hierarchical: within the node ``S (per-1)/per / NVLink``, then across nodes on each device's
  shard ``S (nodes-1)/(nodes per) / NIC``;

and the faster of the two is used, as NCCL's tuner does. An all-reduce is a reduce-scatter plus
an all-gather (twice the traffic); an all-to-all sends ``S (per-1)/N`` over NVLink and
``S (N-per)/N`` over the NIC.

Latency follows NCCL's ring model (``src/graph/tuning.cc``): a base latency plus one step per
rank, ``(N - nodes)`` of them over NVLink at ``alpha_intra`` and ``(nodes - 1)`` over the
network at ``alpha_inter`` (twice as many for an all-reduce). Every term vanishes for a group of
one. All functions are smooth in relaxed sizes and exact at integers.
"""

from __future__ import annotations

import jax.numpy as jnp


def group_layout(size, stride, per_node):
    """(members per node, nodes spanned) of ``size`` ranks spaced ``stride`` devices apart."""
    per = jnp.clip(per_node / stride, 1.0, jnp.maximum(size, 1.0))
    return per, size / per


def links(n: dict):
    """Bus bandwidth NCCL reaches (bytes/s) inside a node and across nodes."""
    return (n["intra_bw"] * n["rt_nvlink_eff"], n["inter_bw"] * n["rt_net_eff"])


def _active(size):
    """1 for a group of two or more, 0 for a group of one (linear between)."""
    return jnp.clip(size - 1.0, 0.0, 1.0)


def _ring_steps_latency(size, nodes, n: dict):
    return (size - nodes) * n["rt_alpha_intra_s"] + (nodes - 1.0) * n["rt_alpha_inter_s"]


def _one_pass_bandwidth_s(nbytes, size, per, nodes, n: dict):
    """Seconds to move ``nbytes`` through one reduce-scatter or all-gather pass."""
    bw_intra, bw_inter = links(n)
    spans = jnp.clip(nodes - 1.0, 0.0, 1.0)             # 0 inside one node, 1 across nodes
    ring_bw = (1.0 - spans) * bw_intra + spans * jnp.minimum(bw_intra, per * bw_inter)
    ring = nbytes * (size - 1.0) / jnp.maximum(size, 1.0) / ring_bw
    hier = (nbytes * (per - 1.0) / per / bw_intra
            + nbytes * (nodes - 1.0) / (nodes * per) / bw_inter)
    return jnp.minimum(ring, hier)


def all_gather_s(nbytes, size, per, nodes, n: dict, count=1.0):
    """``count`` all-gathers producing ``nbytes`` in total on each rank."""
    bw = _one_pass_bandwidth_s(nbytes, size, per, nodes, n)
    lat = count * (n["rt_alpha_base_s"] + _ring_steps_latency(size, nodes, n))
    return bw + _active(size) * lat


reduce_scatter_s = all_gather_s
"""``count`` reduce-scatters of ``nbytes`` in total per rank (same cost as an all-gather)."""


def all_reduce_s(nbytes, size, per, nodes, n: dict, count=1.0):
    """``count`` all-reduces of ``nbytes`` in total per rank: reduce-scatter + all-gather."""
    bw = 2.0 * _one_pass_bandwidth_s(nbytes, size, per, nodes, n)
    lat = count * (n["rt_alpha_base_s"] + 2.0 * _ring_steps_latency(size, nodes, n))
    return bw + _active(size) * lat


def ring_collectives_s(nbytes, size, per, nodes, n: dict, count=1.0, passes=1.0):
    """All-gathers and reduce-scatters (``passes`` = 1) and all-reduces (``passes`` = 2) in one
    evaluation, elementwise over arrays of their arguments: the same numbers as
    `all_gather_s` / `reduce_scatter_s` / `all_reduce_s` one by one."""
    bw = passes * _one_pass_bandwidth_s(nbytes, size, per, nodes, n)
    lat = count * (n["rt_alpha_base_s"] + passes * _ring_steps_latency(size, nodes, n))
    return bw + _active(size) * lat


def all_to_all_s(nbytes, size, per, nodes, n: dict, count=1.0):
    """``count`` all-to-alls, each rank sending ``nbytes`` in total (its share to every rank)."""
    bw_intra, bw_inter = links(n)
    size_ = jnp.maximum(size, 1.0)
    bw = (nbytes * (per - 1.0) / size_ / bw_intra
          + nbytes * (size - per) / size_ / bw_inter)
    lat = count * (n["rt_alpha_base_s"] + _ring_steps_latency(size, nodes, n))
    return bw + _active(size) * lat


def p2p_s(nbytes, cross_node, n: dict, count=1.0):
    """``count`` point-to-point sends of ``nbytes`` each; ``cross_node`` of them leave the node."""
    bw_intra, bw_inter = links(n)
    inter = nbytes / bw_inter + n["rt_alpha_inter_s"]
    intra = nbytes / bw_intra + n["rt_alpha_intra_s"]
    return count * (cross_node * inter + (1.0 - cross_node) * intra)


def overlap(comm_s, window_s, fraction):
    """(exposed, hidden) seconds when ``fraction`` of ``comm_s`` can hide behind ``window_s``.

    ``fraction`` is the part of the communication that can be issued ahead of the compute that
    needs it (prefetched, bucketed, on its own stream); compute hides it up to its own length.
    So a collective far longer than its window hides the whole window (the step tends to
    max(compute, communication)), and one far shorter hides ``fraction`` of itself.
    """
    hidden = jnp.minimum(fraction * comm_s, jnp.maximum(window_s, 0.0))
    return comm_s - hidden, hidden


def overlap_shared(comms, window_s, fractions):
    """`overlap` for several kinds of communication hiding behind the same compute: together
    they hide no more than the window, each in proportion to the part it can issue ahead.
    Returns a list of (exposed, hidden), one per kind."""
    ahead = [f * c for c, f in zip(comms, fractions)]
    total = sum(ahead)
    hidden = jnp.minimum(total, jnp.maximum(window_s, 0.0))
    some = total > 0.0
    share = jnp.where(some, hidden / jnp.where(some, total, 1.0), 0.0)   # no 0/0 in grads
    return [(c - a * share, a * share) for c, a in zip(comms, ahead)]


__all__ = ["all_gather_s", "all_reduce_s", "all_to_all_s", "group_layout", "links", "overlap",
           "overlap_shared", "p2p_s",
           "reduce_scatter_s", "ring_collectives_s"]
