"""What ``AccordionState(net)`` compresses with when given no compressor and no levels.

The default must keep the quality of uncompressed training on every workload measured,
CNNs trained with SGD and transformers trained with AdamW alike (``docs/dense-quality.md``):
integer quantisation, 8 bits in the critical regimes and 4 bits elsewhere. PowerSGD's low
ranks, the default before, lost 8.6 points of next-character accuracy on the character
transformer. The ladder is the same at every world size: from three workers on the
integers travel in two phases (``compress/two_phase.py``), so each worker sends about
``2 (W - 1) / W`` of its quantised bytes, ``(b / 8 + 2 / 64) / 4`` of a dense fp32 ring
all-reduce's at ``b`` bits, at any ``W``. The all-gather it replaced grew with ``W``; half
precision stood in for a rung past about 8 workers then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

#: The default ladder's integer bit widths, mildest first.
DEFAULT_BITS = (8, 4)
#: The compressor of the default ladder (its levels name their compressor: ``"int/8"``).
DEFAULT_COMPRESSOR = "mixed"
#: The compressor that levels given without one are read with, as before the int default.
LEGACY_COMPRESSOR = "powersgd"


def default_levels() -> tuple[str, ...]:
    """The default ladder's levels (``"mixed"`` compressor names): ``int/8`` then
    ``int/4``, at every world size and gradient width."""
    return tuple(f"int/{bits}" for bits in DEFAULT_BITS)


def resolve(compressor: str | None, model: nn.Module | None, process_group: Any,
            levels: Any, mild: Any = None, aggressive: Any = None) -> tuple[str, Any]:  # fmt: skip
    """The compressor name and the ladder's ``levels`` of a state given ``compressor``,
    ``levels``, ``mild`` and ``aggressive``: ``compressor`` and ``levels`` as given, unless
    ``compressor`` is ``None``. Then: ``"mixed"`` for ``levels`` that all name their
    compressor (``"int/8"``), PowerSGD for other levels or ``mild``/``aggressive`` (what
    such levels meant before), and with none of them the default ladder,
    :func:`default_levels`. ``model`` and ``process_group`` no longer change the default
    (it is the same at every world size and gradient width); they are taken so that the
    callers need not change."""
    if compressor is not None:
        return compressor, levels
    if (
        isinstance(levels, Sequence)
        and levels
        and all(isinstance(level, str) and "/" in level for level in levels)
    ):
        return DEFAULT_COMPRESSOR, levels
    if levels is not None or mild is not None or aggressive is not None:
        return LEGACY_COMPRESSOR, levels
    return DEFAULT_COMPRESSOR, default_levels()


__all__ = ["DEFAULT_BITS", "DEFAULT_COMPRESSOR", "default_levels", "resolve"]
