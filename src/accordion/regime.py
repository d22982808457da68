"""Critical-regime detection: Accordion's rule for when to compress mildly.

Agarwal et al. (MLSys 2021) call a tensor *critical* while its gradient norm changes fast.
Per tensor ``t`` the statistic of epoch ``e`` is ``D_e[t]``, the L2 norm of the gradient
of ``t`` summed over the optimizer steps of epoch ``e`` (local, before compression, error
feedback, momentum and weight decay). Every ``interval`` epochs the detector compares:

* epoch 0: every tensor is critical (there is nothing to compare yet);
* epoch ``e > 0`` with ``e % interval == 0``: ``r = |D_old[t] - D_e[t]| / D_old[t]`` where
  ``D_old`` is the norm remembered at the previous check; ``r >= eta`` means critical
  (use the mild compression level), else aggressive. ``r`` is infinite (critical) when the
  old norm is 0 or the tensor has no remembered norm;
* the decision holds for epochs ``e + 1 ... e + interval``;
* learning-rate decay override: when the next epoch's learning rate is lower than this
  one's, every tensor is critical at once, until the next check.

The comparison is always with the norms of the *last check that ran*: if a caller skips a
check epoch (say epochs 0, 5, 15, 20 with ``interval=10``), the check at epoch 20 compares
with epoch 0, not with the missing epoch 10.

:class:`StepRegimeDetector` applies the same rule to windows of optimizer steps, for
training without epochs. Pure logic: plain floats, no tensors, no ``torch.distributed``.

These two classes are the rule and its schedule in one object, for callers that want
decisions from norms they computed themselves (``accordion.batch`` does). The hook's
controller uses the parts separately: ``accordion.policy.PaperRule`` (the same test, via
:func:`accordion.policy.paper_check`) and ``accordion.policy.Schedule``.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from typing import Any

from ._validate import check_bool as _check_bool
from ._validate import check_int, check_state_keys
from .policy.rules import check_eta as _check_eta
from .policy.rules import paper_check

__all__ = ["RegimeDetector", "StepRegimeDetector"]

_STATE_KEYS = frozenset(
    {"interval", "eta", "last_epoch", "norms", "critical", "decay_override", "history"}
)
_STEP_STATE_KEYS = frozenset({"interval_steps", "windows", "detector"})


def _to_norm(name: str, value: Any) -> float:
    """Convert one gradient norm (float, int, numpy scalar or 0-d tensor) to a float >= 0."""
    what = f"norms[{name!r}] must be a finite float >= 0 (an L2 norm)"
    # float("1.5") would succeed, and True would pass as 1.0: both are caller mistakes
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{what}, got {value!r}")
    if isinstance(value, numbers.Real):
        norm = float(value)
    elif getattr(value, "ndim", None) == 0:
        # 0-d torch tensors and numpy arrays: float() reads the single value
        try:
            norm = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what}, got {value!r}") from exc
    else:
        raise TypeError(f"{what} or a 0-d tensor, got {value!r}")
    if not (math.isfinite(norm) and norm >= 0):
        raise ValueError(f"{what}, got {norm!r}")
    return norm


def _check_norms(norms: Any) -> dict[str, float]:
    if not isinstance(norms, Mapping):
        raise TypeError(
            f"norms must be a Mapping from tensor name (str) to gradient norm (float), "
            f"got {type(norms).__name__}"
        )
    checked: dict[str, float] = {}
    for name, value in norms.items():
        if not isinstance(name, str):
            raise TypeError(f"norms keys must be tensor names (str), got {name!r}")
        checked[name] = _to_norm(name, value)
    return checked


class RegimeDetector:
    """Accordion's per-tensor critical-regime detector, checked every ``interval`` epochs.

    Call :meth:`end_epoch` once at the end of every epoch, in increasing epoch order, with
    the gradient norm of each tensor; it returns the decision for the epochs that follow:
    ``True`` (critical: mild compression) or ``False`` (not critical: aggressive).

    Args:
        interval: epochs between two checks (the paper uses 10 for CNNs, 5 for the LSTM).
        eta: threshold on the relative change of a norm (dimensionless, paper: 0.5); a
            change ``r >= eta`` is critical.

    Attributes:
        history: one record per check epoch (epoch 0 included), oldest first::

            {"epoch": int, "lr_will_decay": bool,
             "layers": {name: {"old_norm": float | None, "new_norm": float,
                               "ratio": float | None, "critical": bool}}}

            ``old_norm`` is None when the tensor had no remembered norm; ``ratio`` is None
            when the ratio is infinite (no remembered norm, or an old norm of 0), so that
            every record is plain JSON. ``critical`` is the final decision, after the
            learning-rate decay override.

    Example:
        >>> detector = RegimeDetector(interval=2, eta=0.5)
        >>> detector.end_epoch(0, {"fc.weight": 4.0})
        {'fc.weight': True}
        >>> detector.end_epoch(1, {})  # not a check epoch: the decision stands
        {'fc.weight': True}
        >>> detector.end_epoch(2, {"fc.weight": 3.0})  # |4 - 3| / 4 = 0.25 < 0.5
        {'fc.weight': False}
    """

    def __init__(self, interval: int = 10, eta: float = 0.5) -> None:
        self._interval = check_int("interval", interval, 1)
        self._eta = _check_eta(eta)
        self._last_epoch: int | None = None
        # norms remembered at the last check, compared at the next one
        self._norms: dict[str, float] = {}
        self._critical: dict[str, bool] = {}
        self._decay_override = False
        self.history: list[dict[str, Any]] = []

    @property
    def interval(self) -> int:
        """Epochs between two checks."""
        return self._interval

    @property
    def eta(self) -> float:
        """Threshold on the relative change of a gradient norm (dimensionless)."""
        return self._eta

    @property
    def last_epoch(self) -> int | None:
        """The last epoch given to :meth:`end_epoch`, or None before the first call."""
        return self._last_epoch

    @property
    def decay_override(self) -> bool:
        """Whether a learning-rate decay has made every tensor critical until the next check."""
        return self._decay_override

    @property
    def critical(self) -> dict[str, bool]:
        """The decision in force now, tensor name -> critical (a copy; empty before any call)."""
        return dict(self._critical)

    def needs_statistic(self, epoch: int) -> bool:
        """Whether :meth:`end_epoch` of ``epoch`` will use the norms: ``epoch % interval == 0``.

        In other epochs the norms are ignored, so a caller may skip accumulating the
        epoch-summed gradients and pass ``{}``.
        """
        epoch = check_int("epoch", epoch, 0)
        return epoch % self._interval == 0

    def end_epoch(
        self, epoch: int, norms: Mapping[str, float], lr_will_decay: bool = False
    ) -> dict[str, bool]:
        """Record the end of ``epoch`` and return the decision for the epochs that follow.

        Args:
            epoch: the epoch that just ended (0-based); strictly greater than the last one
                given. Epochs may be skipped: a skipped check epoch is simply not checked.
            norms: tensor name -> L2 norm of that tensor's local gradient summed over the
                steps of ``epoch`` (a float >= 0; numpy scalars and 0-d tensors are
                converted with ``float()``). Used only when :meth:`needs_statistic` is True;
                otherwise it is still validated, then ignored, and may be ``{}``.
            lr_will_decay: True when the next epoch's learning rate is lower than this
                epoch's: every tensor is then critical until the next check, whatever a
                check at this epoch said.

        Returns:
            Tensor name -> True (critical: mild compression) or False (aggressive). At a
            check epoch: exactly the names in ``norms`` (tensors absent from ``norms`` are
            forgotten). Otherwise: the decision in force, plus the names in ``norms`` never
            seen before, which are critical until the next check.

        Raises:
            TypeError: an argument of the wrong type.
            ValueError: ``epoch`` not after the last one, a norm that is negative, NaN or
                infinite, or empty ``norms`` at a check epoch.
        """
        epoch = check_int("epoch", epoch, 0)
        checked = _check_norms(norms)
        lr_will_decay = _check_bool("lr_will_decay", lr_will_decay)
        if self._last_epoch is not None and epoch <= self._last_epoch:
            raise ValueError(
                f"epoch must be greater than the last epoch given ({self._last_epoch}): "
                f"epochs are given in increasing order, got {epoch}"
            )
        is_check = epoch % self._interval == 0
        if is_check and not checked:
            # an empty check would forget every tensor: almost surely a skipped accumulation
            raise ValueError(
                f"norms must name at least one tensor at a check epoch "
                f"(epoch % interval == 0, interval={self._interval}), got {{}} at epoch {epoch}"
            )
        self._last_epoch = epoch
        if is_check:
            self._check(epoch, checked, lr_will_decay)
        else:
            for name in checked:
                # a tensor never seen has no history to judge it by: be careful with it
                self._critical.setdefault(name, True)
            if lr_will_decay:
                self._critical = dict.fromkeys(self._critical, True)
                self._decay_override = True
        return dict(self._critical)

    def _check(self, epoch: int, norms: dict[str, float], lr_will_decay: bool) -> None:
        decision, layers = paper_check(norms, self._norms, self._eta, lr_will_decay)
        self._norms = dict(norms)
        self._critical = decision
        self._decay_override = lr_will_decay
        self.history.append({"epoch": epoch, "lr_will_decay": lr_will_decay, "layers": layers})

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain Python values (``weights_only``-loadable).

        Keys: ``interval`` (epochs), ``eta``, ``last_epoch`` (int or None), ``norms`` (tensor
        name -> norm remembered at the last check), ``critical`` (the decision in force),
        ``decay_override`` (bool) and ``history`` (see the class docstring). A deep copy.
        """
        return {
            "interval": self._interval,
            "eta": self._eta,
            "last_epoch": self._last_epoch,
            "norms": dict(self._norms),
            "critical": dict(self._critical),
            "decay_override": self._decay_override,
            "history": copy.deepcopy(self.history),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; its ``interval`` and ``eta`` must equal this one's.

        Raises:
            TypeError: ``state`` is not a Mapping, or a value has the wrong type.
            ValueError: missing or unexpected keys, a different ``interval`` or ``eta``, or
                invalid values.
        """
        check_state_keys(state, _STATE_KEYS, "RegimeDetector")
        if state["interval"] != self._interval:
            raise ValueError(
                f"state['interval'] is {state['interval']!r} epochs but this detector's "
                f"interval is {self._interval}: build the detector with the same interval"
            )
        if state["eta"] != self._eta:
            raise ValueError(
                f"state['eta'] is {state['eta']!r} but this detector's eta is {self._eta}: "
                f"build the detector with the same eta"
            )
        last_epoch = state["last_epoch"]
        if last_epoch is not None:
            last_epoch = check_int("state['last_epoch']", last_epoch, 0)
        norms = _check_norms(state["norms"])
        critical = state["critical"]
        if not isinstance(critical, Mapping) or not all(
            isinstance(k, str) and isinstance(v, bool) for k, v in critical.items()
        ):
            raise TypeError(
                f"state['critical'] must be a Mapping from tensor name (str) to bool, "
                f"got {critical!r}"
            )
        decay_override = _check_bool("state['decay_override']", state["decay_override"])
        history = state["history"]
        if not isinstance(history, list):
            raise TypeError(f"state['history'] must be a list of check records, got {history!r}")
        self._last_epoch = last_epoch
        self._norms = norms
        self._critical = dict(critical)
        self._decay_override = decay_override
        self.history = copy.deepcopy(history)


class StepRegimeDetector:
    """Accordion's rule on windows of ``interval_steps`` optimizer steps, for epoch-less training.

    Each window plays the role of a check epoch with ``interval=1``: the first window makes
    every tensor critical; every later window compares the norm of the gradient summed over
    its steps with the previous window's. Call :meth:`end_window` at the end of each window
    (:meth:`window_ends` says when). Built on :class:`RegimeDetector`, so the rule is the same.

    Args:
        interval_steps: optimizer steps per window (>= 1).
        eta: threshold on the relative change of a norm (dimensionless, paper: 0.5).

    In :attr:`history` the ``"epoch"`` of a record is the 0-based window index.
    """

    def __init__(self, interval_steps: int, eta: float = 0.5) -> None:
        self._interval_steps = check_int("interval_steps", interval_steps, 1)
        self._detector = RegimeDetector(interval=1, eta=eta)
        # windows ended so far, i.e. the index of the next window
        self._windows = 0

    @property
    def interval_steps(self) -> int:
        """Optimizer steps per window."""
        return self._interval_steps

    @property
    def eta(self) -> float:
        """Threshold on the relative change of a gradient norm (dimensionless)."""
        return self._detector.eta

    @property
    def windows(self) -> int:
        """Number of windows ended so far (calls to :meth:`end_window`)."""
        return self._windows

    @property
    def critical(self) -> dict[str, bool]:
        """The decision in force now, tensor name -> critical (a copy; empty before any call)."""
        return self._detector.critical

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per window, as :attr:`RegimeDetector.history` (``"epoch"`` = window)."""
        return self._detector.history

    def needs_statistic(self, step: int) -> bool:
        """Always True (``step`` >= 0 is validated): every window is compared with the last."""
        check_int("step", step, 0)
        return True

    def window_ends(self, step: int) -> bool:
        """Whether 0-based optimizer step ``step`` is the last of its window."""
        step = check_int("step", step, 0)
        return (step + 1) % self._interval_steps == 0

    def end_window(
        self, norms: Mapping[str, float], lr_will_decay: bool = False
    ) -> dict[str, bool]:
        """End the current window and return the decision for the next one.

        Args:
            norms: tensor name -> L2 norm of that tensor's local gradient summed over the
                steps of this window (a float >= 0); must name at least one tensor.
            lr_will_decay: True when the learning rate of the next window is lower than this
                one's: every tensor is critical until the next window ends.

        Returns:
            Tensor name -> True (critical: mild compression) or False (aggressive), for
            exactly the names in ``norms``.
        """
        decision = self._detector.end_epoch(self._windows, norms, lr_will_decay)
        self._windows += 1
        return decision

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values: ``interval_steps``, ``windows`` and the inner ``detector``'s."""
        return {
            "interval_steps": self._interval_steps,
            "windows": self._windows,
            "detector": self._detector.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; its ``interval_steps`` and ``eta`` must equal this one's.

        Raises:
            TypeError: ``state`` is not a Mapping, or a value has the wrong type.
            ValueError: missing or unexpected keys, a different ``interval_steps`` or ``eta``.
        """
        check_state_keys(state, _STEP_STATE_KEYS, "StepRegimeDetector")
        if state["interval_steps"] != self._interval_steps:
            raise ValueError(
                f"state['interval_steps'] is {state['interval_steps']!r} steps but this "
                f"detector's interval_steps is {self._interval_steps}: build the detector "
                f"with the same interval_steps"
            )
        windows = check_int("state['windows']", state["windows"], 0)
        # load into a fresh detector first, so that a bad state leaves this one untouched
        detector = RegimeDetector(interval=1, eta=self._detector.eta)
        detector.load_state_dict(state["detector"])
        # window w is the inner detector's epoch w, so the two counters must agree
        last = detector.last_epoch
        if windows != (0 if last is None else last + 1):
            raise ValueError(
                f"state['windows'] is {windows} but state['detector']['last_epoch'] is "
                f"{last!r}: expected windows == last_epoch + 1 (0 when None)"
            )
        self._detector = detector
        self._windows = windows
