"""The line style of each strategy: one hue per family, lighter for more aggressive levels."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
from matplotlib import colors as mcolors

from ...compress import Compressor, compressing_names, compressor_class
from .common import parsed

# Base colour of each strategy family; the level then lightens it (milder = darker), so
# that a family reads as one hue and the static mild/aggressive pair as two shades of it.
_FAMILY_COLOURS = {"dense": "#000000", "torch-powersgd": "#9467bd"}
# (static, accordion) hues of the registry's compressing compressors, in registry order:
# by position rather than by name, so that no module here names a compressor
_COMPRESSOR_HUES = (("#1f77b4", "#d62728"), ("#2ca02c", "#ff7f0e"))
# families we do not know get one of these, chosen by a stable hash of the family name
_FALLBACK_COLOURS = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")
_FAMILY_LINESTYLES = {"static": "--", "torch-powersgd": "-."}
# batch-size strategies: (colour, line style) per kind
_BATCH_STYLES = {
    "static-batch": ("#7f7f7f", "--"),
    "batch": ("#17becf", "-"),
    "batch-fixed": ("#8c564b", "-."),
}
# A large square matrix, fp32: what a level sends for it against dense says how much the
# level compresses, in the compressor's own cost description (for matrices this large
# the ratio between two levels hardly depends on the size).
_REFERENCE_SHAPE = (4096, 4096)
_REFERENCE_ELEMENT_SIZE = 4
_MAX_SHADE = 0.5
# the logistic's slope: the default mild level gets 0.16, the default aggressive 0.34
_SHADE_SLOPE = 1.5


def _compression(cls: type[Compressor], level: Any) -> float:
    """log2 of dense's bytes over ``level``'s for the reference matrix (0: as dense)."""
    shape, size = _REFERENCE_SHAPE, _REFERENCE_ELEMENT_SIZE
    sent = sum(m.nbytes for m in cls.messages(shape, level, size))
    if not sent > 0:
        raise ValueError(f"level {level!r} sends nothing for a {shape} matrix")
    return math.log2(math.prod(shape) * size / sent)


def _position(compressor: str, level: Any) -> float | None:
    """Where ``level`` lies from the compressor's default mild level (0) to its default
    aggressive one (1), by how much each compresses the reference matrix or, where the
    defaults compress alike, by their aggressiveness; ``None`` where neither orders them."""
    cls = compressor_class(compressor)
    for measure in (lambda v: _compression(cls, v), cls.aggressiveness):
        mild, aggressive = (measure(v) for v in cls.default_levels)
        if aggressive > mild:
            return (measure(level) - mild) / (aggressive - mild)
    return None


def _lightening(compressor: str, level: Any) -> float:
    """How much of white to mix into a family colour, in ``[0, _MAX_SHADE)``: more for a
    level that compresses more, from the compressor's own cost description and order
    (no table per compressor); levels it does not order get a shade from a stable hash
    of their text, so that two such levels still look apart."""
    if level is None:
        return 0.0
    try:
        position = _position(compressor, level)
        text = compressor_class(compressor).level_text(level)
    except (TypeError, ValueError):
        return 0.0
    if position is None:
        return 0.15 * (zlib.crc32(text.encode()) % 4)
    # a logistic: every level its own shade, the defaults well apart, none white
    return _MAX_SHADE / (1.0 + math.exp(-_SHADE_SLOPE * (position - 0.5)))


def _family_key(strategy: str) -> tuple[str, str, str, Any]:
    """(family, colour key, compressor, first level) of a compression strategy; the key of
    a string the harness cannot parse is its first two fields, and it has no level."""
    strat = parsed(strategy)
    if strat is None:
        parts = strategy.split(":")
        return parts[0], ":".join(parts[:2]) if len(parts) >= 3 else parts[0], "", None
    family = strat.family
    key = family if family in ("dense", "torch-powersgd") else f"{family}:{strat.compressor}"
    return family, key, strat.compressor, strat.mild


def _compressor_hue(family: str, compressor: str) -> str | None:
    """The registry position's hue of a static or Accordion family, if it has one."""
    names = compressing_names()
    if family not in ("static", "accordion") or compressor not in names:
        return None
    position = names.index(compressor)
    if position >= len(_COMPRESSOR_HUES):
        return None
    return _COMPRESSOR_HUES[position][family == "accordion"]


def strategy_style(strategy: str) -> dict[str, Any]:
    """Line style of a strategy, a fixed function of its string: same in every plot.

    Each family has one hue (dense black, PyTorch's PowerSGD purple; the registry's first
    compressor static blue and Accordion red, today PowerSGD; the second static green and
    Accordion orange, today top-k; any other compressor's families a hue of their own);
    more aggressive levels (the mildest rung of an Accordion ladder) are lighter shades of it.
    Static strategies are dashed, PyTorch's dash-dotted, Accordion and dense solid.
    Returns ``{"color", "linestyle", "linewidth"}``.
    """
    batch_kind, comm = strategy.partition(":")[0], strategy.partition("+")[2]
    if batch_kind in _BATCH_STYLES:
        colour, linestyle = _BATCH_STYLES[batch_kind]
        # a batch strategy combined with compression: the same hue, dotted
        return {"color": colour, "linestyle": ":" if comm else linestyle, "linewidth": 2.0}
    family, key, compressor, level = _family_key(strategy)
    base = _FAMILY_COLOURS.get(key) or _compressor_hue(family, compressor)
    if base is None:
        base = _FALLBACK_COLOURS[zlib.crc32(key.encode()) % len(_FALLBACK_COLOURS)]
    mix = _lightening(compressor, level)
    if family == "accordion":  # the strategy under study: keep it close to full colour
        mix /= 2.0
    rgb = np.array(mcolors.to_rgb(base))
    colour = mcolors.to_hex(rgb + (1.0 - rgb) * mix)
    return {
        "color": colour,
        "linestyle": _FAMILY_LINESTYLES.get(family, "-"),
        "linewidth": 2.0 if family == "accordion" else 1.5,
    }
