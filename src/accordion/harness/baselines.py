"""PyTorch's own DDP hooks as baselines (``torch-fp16``, ``torch-bf16``,
``torch-powersgd:R``), and the per-worker traffic count of every strategy: the baselines'
counted here as PyTorch's hooks send it, Accordion's read from its state's ledger."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from .._validate import check_state_keys
from ..accounting import paper_floats, wire_bytes
from ..compress import compressor_class
from ..compress.powersgd import matrix_shape, powersgd_rank
from .strategies import TORCH_POWERSGD, Strategy

#: PyTorch's powerSGD_hook settings used for the ``torch-powersgd:R`` baseline.
TORCH_POWERSGD_START_ITER = 2  # the smallest DDP allows with error feedback
TORCH_POWERSGD_MIN_COMPRESSION_RATE = 2.0  # PyTorch's default

_TRAFFIC_KEYS = frozenset({"steps", "floats", "bytes"})


def attach_torch_hook(strategy: Strategy, ddp: DDP, seed: int) -> None:
    """Register PyTorch's hook of a ``torch-half`` or ``torch-powersgd`` strategy on
    ``ddp`` (``seed``: PowerSGD's random seed); any other strategy keeps DDP's all-reduce."""
    if strategy.family == "torch-half":
        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[strategy.mild]  # fmt: skip
        ddp.register_comm_hook(None, hook)
        return
    if strategy.family == "torch-powersgd":
        torch_state = torch_psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=strategy.mild,
            start_powerSGD_iter=TORCH_POWERSGD_START_ITER,
            min_compression_rate=TORCH_POWERSGD_MIN_COMPRESSION_RATE,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )
        ddp.register_comm_hook(torch_state, torch_psgd.powerSGD_hook)


class Traffic:
    """Per-worker floats (paper convention) and wire bytes, for any strategy."""

    def __init__(self, strategy: Strategy, model: nn.Module, state, world: int):
        self.strategy, self.state, self.world = strategy, state, world
        params = [p for p in model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in params]
        self.element_size = params[0].element_size() if params else 4
        self.steps = 0
        self.floats = 0
        self.bytes = 0.0
        #: A DiLoCo run's rounds, whose :meth:`~accordion.DiLoCo.sent` counts for it.
        self.diloco: Any = None

    def step(self) -> None:
        """Count one optimizer step's communication (the Accordion state counts its own)."""
        self.steps += 1
        if self.state is not None:
            return  # the Accordion state keeps its own ledger
        if self.strategy.family == "torch-half":  # every tensor of the bucket, halved
            kinds = [("half", self.strategy.mild)] * len(self.shapes)
        elif self.strategy.family == "dense" or self.steps < TORCH_POWERSGD_START_ITER:
            kinds = [("dense", None)] * len(self.shapes)
        else:
            kinds = [self._torch_kind(s) for s in self.shapes]
        for shape, (kind, level) in zip(self.shapes, kinds):
            self.floats += paper_floats(shape, kind, level, self.world)
            self.bytes += wire_bytes(shape, kind, level, self.world, self.element_size)

    def _torch_kind(self, shape) -> tuple[str, Any]:
        # PyTorch's hook only compresses matrices whose compression rate beats its minimum
        if not compressor_class(TORCH_POWERSGD).applies_to(shape):
            return "dense", None
        n, m = matrix_shape(shape)
        r = powersgd_rank(shape, self.strategy.mild)
        if n * m > (n + m) * r * TORCH_POWERSGD_MIN_COMPRESSION_RATE:
            return TORCH_POWERSGD, r
        return "dense", None

    def state_dict(self) -> dict[str, Any]:
        """The counts so far (plain values), for checkpoints."""
        return {"steps": self.steps, "floats": self.floats, "bytes": self.bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counts of :meth:`state_dict`; ``ValueError`` for another mapping."""
        check_state_keys(state, _TRAFFIC_KEYS, "Traffic")
        self.steps, self.floats, self.bytes = state["steps"], state["floats"], state["bytes"]

    def totals(self) -> tuple[int, float]:
        """Floats (paper convention) and wire bytes sent per worker so far."""
        if self.diloco is not None:
            return self.diloco.sent()
        if self.state is not None:
            stats = self.state.ledger
            return stats.total_floats, stats.total_bytes
        return self.floats, self.bytes
