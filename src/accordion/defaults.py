"""What ``AccordionState(net)`` compresses with when given no compressor and no levels.

The default must keep the quality of uncompressed training on every workload measured,
CNNs trained with SGD and transformers trained with AdamW alike (``docs/dense-quality.md``):
integer quantisation, 8 bits in the critical regimes and 4 bits elsewhere. PowerSGD's low
ranks, the default before, lost 8.6 points of next-character accuracy on the character
transformer. Integers are all-gathered, so each worker's bytes grow with the workers; a
rung that would put more bytes on the wire than a dense ring all-reduce at the run's world
size is replaced by half precision, which is all-reduced and halves fp32 at any size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from .compress.quantize import BLOCK, IntQuantizer
from .compress.transport import world_and_rank

#: The default ladder's integer bit widths, mildest first.
DEFAULT_BITS = (8, 4)
#: The rung that replaces an integer rung past its break-even.
FALLBACK = "half/bf16"
#: The compressor of the default ladder (its rungs come from two compressors).
DEFAULT_COMPRESSOR = "mixed"
#: The compressor that levels given without one are read with, as before the int default.
LEGACY_COMPRESSOR = "powersgd"


def default_levels(world_size: int, element_size: int = 4) -> tuple[str, ...]:
    """The default ladder's levels (``"mixed"`` compressor names) at ``world_size``
    workers averaging gradients of ``element_size`` bytes per value: ``int/8`` then
    ``int/4``, each replaced by ``half/bf16`` from the worker count at which its
    all-gathers send as many bytes as a dense ring all-reduce (for fp32 gradients, 7.8
    workers at 8 bits and 15 at 4: :meth:`IntQuantizer.break_even`, full blocks)."""
    even = IntQuantizer.break_even([(BLOCK * 1024,)], world_size, element_size)
    assert even.max_workers is not None  # a non-empty tensor always has a break-even
    paying = dict(zip(even.bits, even.max_workers))
    return tuple(f"int/{bits}" if world_size < paying[bits] else FALLBACK
                 for bits in DEFAULT_BITS)  # fmt: skip


def resolve(compressor: str | None, model: nn.Module | None, process_group: Any,
            levels: Any, mild: Any = None, aggressive: Any = None) -> tuple[str, Any]:  # fmt: skip
    """The compressor name and the ladder's ``levels`` of a state given ``compressor``,
    ``levels``, ``mild`` and ``aggressive``: ``compressor`` and ``levels`` as given, unless
    ``compressor`` is ``None``. Then: ``"mixed"`` for ``levels`` that all name their
    compressor (``"int/8"``), PowerSGD for other levels or ``mild``/``aggressive`` (what
    such levels meant before), and with none of them the default ladder,
    :func:`default_levels` at ``process_group``'s size for ``model``'s gradient width
    (fp32 without a model)."""
    if compressor is not None:
        return compressor, levels
    if isinstance(levels, Sequence) and levels and all(
        isinstance(level, str) and "/" in level for level in levels
    ):
        return DEFAULT_COMPRESSOR, levels
    if levels is not None or mild is not None or aggressive is not None:
        return LEGACY_COMPRESSOR, levels
    world_size = world_and_rank(process_group)[0]
    first = next(iter(model.parameters()), None) if model is not None else None
    element_size = 4 if first is None else first.element_size()
    return DEFAULT_COMPRESSOR, default_levels(world_size, element_size)


__all__ = ["DEFAULT_BITS", "DEFAULT_COMPRESSOR", "FALLBACK", "default_levels", "resolve"]
