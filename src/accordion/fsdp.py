"""Accordion across the replicas of FSDP2: hybrid sharding with a compressed all-reduce.

In hybrid sharding (HSDP) every replica holds the whole model sharded over its own
devices; a reduce-scatter inside the replica is followed by an all-reduce of each
shard across the replicas, and that link (between hosts) is the slow one. Here FSDP2
shards over the *shard* dimension of a 2-D ``(replicate, shard)`` device mesh only,
and Accordion does the cross-replica all-reduce, compressed, from FSDP's all-reduce
hook::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from accordion.fsdp import FSDPState

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = FSDPState(model, mesh, compressor="powersgd", levels=(4, 2, 1))
    for epoch in range(epochs):
        ...                                     # forward, backward, optimizer.step()
        scheduler.step()
        state.end_epoch(optimizer)

The hook hands each FSDP parameter group's flat reduce-scatter output; every
parameter's piece of it is a block of rows of that parameter (``Shard(0)``, padded to
equal blocks), a matrix that PowerSGD and top-k apply to. Its state, accounting and
decisions are kept per parameter shard, under the parameter's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # imported where used at run time: FSDP2 exists in newer torch only
    from torch.distributed.fsdp import FSDPModule

from .compress import TorchTransport
from .controller import Controller
from .statistic import ShardCombined, make_statistic


class _Piece:
    """One parameter's block in a group's flat reduce-scatter output."""

    def __init__(self, key: str, offset: int, shape: torch.Size):
        self.key, self.offset, self.shape = key, offset, shape
        self.numel = shape.numel()


class FSDPState(Controller):
    """Accordion for the cross-replica all-reduce of an FSDP2 model sharded over
    ``mesh["shard"]``: registers the all-reduce hook of every FSDP module in ``model``.

    Args:
        model: the root module, already sharded with ``fully_shard(..., mesh=mesh["shard"])``
            (its own parameters and its children's).
        mesh: the 2-D ``DeviceMesh`` with dimensions ``("replicate", "shard")``, or names
            given by ``dims``.
        dims: the names of the replicate and the shard dimension of ``mesh``.
        **options: the :class:`~accordion.controller.Controller` arguments (compressor,
            levels, rule, interval, statistic, seed, ...); ``process_group`` is the mesh's.
            ``statistic`` is ``"rank0"`` (the default here) or ``"mean"``.

    A layer's norm (the rule's statistic) is its whole gradient's: the shards' norms
    are combined over the shard group at each check
    (:class:`~accordion.statistic.ShardCombined`), so that every rank takes the same
    decision for a parameter, as under DDP. Every collective goes through a transport:
    the replicas' (:meth:`transport`) and the shard group's.
    """

    def __init__(self, model: nn.Module, mesh: Any, dims: Sequence[str] = ("replicate", "shard"),
                 **options: Any):  # fmt: skip
        if "process_group" in options or "model" in options or "transport" in options:
            raise ValueError(
                "FSDPState takes its process group from mesh and its parameters from "
                "model, not from process_group=, transport= or model="
            )
        # "rank0" by default: the shards' sums are a fraction of the model already
        statistic = options.pop("statistic", "rank0")
        if statistic == "sharded":
            raise ValueError(
                "FSDPState takes statistic 'rank0' or 'mean', got 'sharded': its sums are "
                "sharded over the shard dimension already"
            )
        replicate, shard = _mesh_groups(mesh, dims)
        shards = TorchTransport(shard)
        super().__init__(None, process_group=replicate, transport=TorchTransport(replicate),
                         statistic=ShardCombined(make_statistic(statistic), shards),
                         **options)  # fmt: skip
        self.shard_size, self.shard_rank = shards.world_size, shards.rank
        self._groups = _hooked_groups(model)
        self._layouts = [self._layout(model, group) for group in self._groups]
        for module, layout in zip(self._groups, self._layouts):
            # FSDP averages over the shard group and this hook over the replicas: the
            # gradient is divided by shards x replicas once (native HSDP's factor would
            # divide twice)
            module.set_gradient_divide_factor(float(self.shard_size))
            module.set_all_reduce_hook(partial(self._reduce, layout))

    def _layout(self, model: nn.Module, module: FSDPModule) -> list[_Piece]:
        """The pieces of ``module``'s parameter group, named after ``model``'s parameters."""
        names = {id(p): n for n, p in model.named_parameters()}
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # _hooked_groups keeps only the modules that own parameters
            raise RuntimeError(f"{type(module).__name__} owns no FSDP parameter group")
        pieces, offset = [], 0
        for fsdp_param in group.fsdp_params:
            if fsdp_param.fsdp_placement.dim != 0:
                raise ValueError(
                    f"FSDPState needs parameters sharded on dim 0 (FSDP's default), got "
                    f"{fsdp_param.fsdp_placement} for {names.get(id(fsdp_param.sharded_param))}"
                )
            key = names[id(fsdp_param.sharded_param)]
            shape = fsdp_param.padded_sharded_param_size
            pieces.append(_Piece(key, offset, shape))
            self.params.add(key, tuple(shape), _reduce_element_size(group, fsdp_param))
            offset += shape.numel()
        return pieces

    def _reduce(self, layout: list[_Piece], output: torch.Tensor) -> None:
        """The all-reduce hook: average ``output`` (a group's flat reduce-scatter
        result) over the replicas, in place, compressed."""
        if output.numel() != sum(p.numel for p in layout):
            raise RuntimeError(
                f"FSDP handed a reduce-scatter output of {output.numel()} elements, the "
                f"layout of its parameter group has {sum(p.numel for p in layout)}"
            )
        keys = [p.key for p in layout]
        grads = [output[p.offset : p.offset + p.numel].view(p.shape) for p in layout]
        # one group counts the backward passes
        self.transport().run(self.reduce(keys, grads, last=layout is self._layouts[0]))

    def config(self) -> dict[str, Any]:
        """The settings a checkpoint must share: the controller's and this rank's shard."""
        return {**super().config(), "shard": [self.shard_rank, self.shard_size]}


def _mesh_groups(mesh: Any, dims: Sequence[str]) -> tuple[Any, Any]:
    """The replicate and the shard process group of ``mesh``."""
    from torch.distributed.device_mesh import DeviceMesh  # lazy: FSDP2's, newer torch only

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if isinstance(dims, str) or len(dims) != 2 or any(d not in names for d in dims):
        raise ValueError(
            f"dims must name the replicate and the shard dimension of mesh, whose "
            f"dimensions are {names}; got {dims!r}"
        )
    if mesh.ndim != 2:
        raise ValueError(f"mesh must be 2-D (replicate, shard), got {mesh.ndim} dimensions")
    return mesh.get_group(dims[0]), mesh.get_group(dims[1])


def _hooked_groups(model: nn.Module) -> list[FSDPModule]:
    """The FSDP modules of ``model`` that own parameters, after checking the sharding."""
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP2 exists in newer torch only

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            "model has no FSDP module: shard it with fully_shard(..., mesh=mesh['shard']) first"
        )
    owning: list[FSDPModule] = []
    for module in modules:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(
                f"{type(module).__name__} has {len(groups)} FSDP parameter groups "
                "(shard_placement_fn per parameter): not supported"
            )
        if groups and groups[0]._is_hsdp:
            raise ValueError(
                "model is sharded with native HSDP (a 2-D mesh given to fully_shard), which "
                "all-reduces across replicas itself: give fully_shard mesh['shard']"
            )
        if groups and groups[0].fsdp_params:
            owning.append(module)
    return owning


def _reduce_element_size(group: Any, fsdp_param: Any) -> int:
    """Bytes per element of the gradient FSDP reduces (its ``reduce_dtype``, if set)."""
    dtype = getattr(group.mp_policy, "reduce_dtype", None) or fsdp_param.sharded_param.dtype
    return torch.empty((), dtype=dtype).element_size()


__all__ = ["FSDPState"]
