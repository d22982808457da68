"""Network infrastructure for runs across hosts: an emulated cluster and a link probe.

* ``namespaces.py``: what the machine must offer (root, iproute2), the network namespaces
  it has, and killing the processes inside them.
* ``network.py``: :class:`EmulatedNetwork`, N hosts as network namespaces behind a bridge,
  each link shaped with ``tc``; the ``ip``/``tc`` command lines come from pure functions
  (:func:`~accordion.cluster.network.shaping_commands` and its siblings).
* ``runner.py``: :class:`TorchrunRunner`, one torchrun node per host of a network, with
  log files, echo, first-failure stop and timeouts; :class:`ClusterRun` is its result.
* ``emulated.py``: :class:`EmulatedCluster`, the public class that joins a network and a
  runner and tears both down on exceptions, Ctrl-C and SIGTERM; it runs any ``accordion``
  command (or module) on every host. Needs root and iproute2.
* ``netprobe.py``: the all-reduce bandwidth probe that
  :meth:`EmulatedCluster.measure_bandwidth` runs on every host
  (``python -m accordion.cluster.netprobe`` under torchrun), and :func:`bus_bandwidth`,
  its ring all-reduce model.

Imports go one way: namespaces <- network <- runner <- emulated. Nothing here trains:
the training harness is :mod:`accordion.harness`.
"""

from .emulated import EmulatedCluster
from .namespaces import NAMESPACE_PREFIX, ClusterError, check_requirements, list_namespaces
from .netprobe import bus_bandwidth
from .network import EmulatedNetwork, remove_leftovers, tbf_parameters
from .runner import ClusterRun, ClusterRunError, TorchrunRunner

__all__ = [
    "NAMESPACE_PREFIX",
    "ClusterError",
    "ClusterRun",
    "ClusterRunError",
    "EmulatedCluster",
    "EmulatedNetwork",
    "TorchrunRunner",
    "bus_bandwidth",
    "check_requirements",
    "list_namespaces",
    "remove_leftovers",
    "tbf_parameters",
]
