"""Argument checks shared by the library's public entries.

Every checker raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a
value out of range, and names the argument, the value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any


def check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; else raise
    ``TypeError`` (not an integer) or ``ValueError`` (too small), naming ``name``."""
    # bool is an int subclass, but True as a count or size is always a caller's mistake
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    strict: bool = False,
    maximum: float | None = None,
    unit: str = "",
) -> float:
    """Return ``value`` as a finite float within the bounds; else ``TypeError`` (not a real
    number) or ``ValueError`` (NaN, infinite or out of range). ``strict`` makes the
    minimum exclusive; ``unit`` (e.g. ``"seconds"``) is named in the messages."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = f"a number of {unit}" if unit else "a number"
        raise TypeError(f"{name} must be {what}, got {value!r}")
    number = float(value)
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if strict else '>='} {minimum:g}")
    if maximum is not None:
        bounds.append(f"<= {maximum:g}")
    too_small = minimum is not None and (number <= minimum if strict else number < minimum)
    if not math.isfinite(number) or too_small or (maximum is not None and number > maximum):
        allowed = " and ".join([*bounds, "finite"]) + (f" {unit}" if unit else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool; else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    """Return ``value`` if it is one of ``allowed``; else raise ``TypeError`` (a str was
    expected and something else came) or ``ValueError`` naming ``name`` and the choices."""
    choices = tuple(allowed)
    if all(isinstance(c, str) for c in choices) and not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_state_keys(
    state: Any,
    required: frozenset[str],
    owner: str,
    optional: frozenset[str] = frozenset(),
) -> None:
    """The one check of a ``load_state_dict``'s keys: raise ``ValueError`` unless
    ``state`` is a Mapping holding every key of ``required`` and no key outside
    ``required | optional`` (``optional``: keys older files lack), naming the missing and
    unknown keys and ``owner``, whose ``state_dict()`` it should be. A checkpoint is a
    value, so every malformed one, a non-Mapping included, is a ``ValueError``."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"state must be a Mapping from {owner}.state_dict(), got {type(state).__name__}"
            f" {state!r:.80}"
        )
    missing = sorted(required - set(state), key=repr)
    unknown = sorted(set(state) - required - optional, key=repr)
    if missing or unknown:
        raise ValueError(
            f"state is not a {owner} state_dict: missing keys {missing}, unknown keys {unknown}"
        )


def check_tensor_shapes(what: str, tensors, shapes, owner: str = "tensor") -> None:
    """Raise ``ValueError`` unless every ``tensors[key]`` belongs to a key of ``shapes``
    and has its shape (``what`` names the mapping, ``owner`` what ``shapes`` describes)."""
    for key, tensor in tensors.items():
        if key not in shapes:
            raise ValueError(f"{what}[{key!r}] belongs to no {owner} of shapes")
        if tuple(tensor.shape) != tuple(shapes[key]):
            raise ValueError(
                f"{what}[{key!r}] has shape {tuple(tensor.shape)}, its {owner} "
                f"{tuple(shapes[key])}"
            )
