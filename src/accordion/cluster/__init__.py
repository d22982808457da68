"""Network infrastructure for runs across hosts: an emulated cluster and a link probe.

* :class:`EmulatedCluster` (``emulated.py``): N hosts on one Linux machine as network
  namespaces behind a bridge, each link shaped with ``tc``, that run any ``accordion``
  command (or module) as one torchrun node per host; needs root and iproute2.
* ``netprobe.py``: the all-reduce bandwidth probe that
  :meth:`EmulatedCluster.measure_bandwidth` runs on every host
  (``python -m accordion.cluster.netprobe`` under torchrun), and :func:`bus_bandwidth`,
  its ring all-reduce model.

Nothing here trains: the training harness is :mod:`accordion.harness`.
"""

from .emulated import (
    NAMESPACE_PREFIX,
    ClusterError,
    ClusterRun,
    ClusterRunError,
    EmulatedCluster,
    check_requirements,
    list_namespaces,
    remove_leftovers,
    tbf_parameters,
)
from .netprobe import bus_bandwidth

__all__ = [
    "NAMESPACE_PREFIX",
    "ClusterError",
    "ClusterRun",
    "ClusterRunError",
    "EmulatedCluster",
    "bus_bandwidth",
    "check_requirements",
    "list_namespaces",
    "remove_leftovers",
    "tbf_parameters",
]
