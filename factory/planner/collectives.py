"""Ideal time of one collective over a group of ranks, on NVLink or the scale-out network.

Ranks are placed as Megatron-Core orders them (TP fastest, then CP, then EP or DP,
PP slowest), so a group of ``size`` ranks ``stride`` apart spans ``size * stride``
consecutive ranks; the part of it inside one NVLink domain talks over NVLink and the
rest over the network. Times are bandwidth terms at the data sheet's per-direction
rate (ring algorithms: each rank sends ``(n - 1) / n`` of the buffer); latency and
achieved bandwidth are in the fitted ``comm`` coefficient (``docs/performance.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Links"]


@dataclass(frozen=True)
class Links:
    """The interconnect of one GPU type."""

    nvlink_domain: int
    nvlink_bytes_per_s: float
    network_bytes_per_s: float

    def peers_in_domain(self, size: int, stride: int) -> int:
        """Ranks of a ``size``-rank group (``stride`` apart) that share a rank's NVLink domain."""
        return max(1, min(size, self.nvlink_domain // max(1, stride)))

    def ring_seconds(self, nbytes: float, size: int, stride: int) -> float:
        """All-gather or reduce-scatter of a ``nbytes`` buffer (the gathered size): a ring
        that leaves the NVLink domain runs at the network's rate."""
        if size <= 1:
            return 0.0
        inside = self.peers_in_domain(size, stride) == size
        bandwidth = self.nvlink_bytes_per_s if inside else self.network_bytes_per_s
        return nbytes * (size - 1) / size / bandwidth

    def all_to_all_seconds(self, nbytes: float, size: int, stride: int) -> float:
        """All-to-all of ``nbytes`` a rank sends: the share for peers in its domain over
        NVLink, the rest over the network, the two at once."""
        if size <= 1:
            return 0.0
        inside = self.peers_in_domain(size, stride)
        over_nvlink = nbytes * (inside - 1) / size / self.nvlink_bytes_per_s
        over_network = nbytes * (size - inside) / size / self.network_bytes_per_s
        return max(over_nvlink, over_network)

    def p2p_seconds(self, nbytes: float, crosses_domain: bool) -> float:
        """One point-to-point send (pipeline stages)."""
        bandwidth = self.network_bytes_per_s if crosses_domain else self.nvlink_bytes_per_s
        return nbytes / bandwidth
