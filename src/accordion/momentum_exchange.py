"""Adam's momentum exchanged compressed instead of the gradient, with ``v`` frozen: the
exchange of 1-bit Adam (Tang et al., 2021), after a compressed start.

Until ``freeze_at`` optimizer steps nothing changes: the state averages the gradients at
its own level (on the character transformer, 2-bit ``nq`` with
:class:`~accordion.AdamNoiseCorrection`). Then Adam's second moment is held where it is
(as the correction used it), and each rank sends, instead of its gradient ``g``,

    x = c * g + b1 / (1 - b1) * m

at ``level`` with its own error feedback: its own momentum ``b1 * m + (1 - b1) * c * g``
over ``1 - b1``, the momentum ``m`` being the same on every rank. Adam receives
``x_hat - b1 / (1 - b1) * m``, so that its own update makes ``m = (1 - b1) * x_hat``: the
compressed average of the ranks' momenta. ``c`` clips the root mean square of the ranks'
gradient norms to ``clip`` (one scalar all-reduce); the loop must not clip after the
freeze, because no averaged gradient exists to clip (a step whose gradients changed after
the exchange is refused). Under DDP the state's hook does the exchange past the freeze,
holding the buckets until the last one (the clip's norm is the whole model's); a loop
without DDP calls :meth:`MomentumExchange.reduce` after ``backward()``. A coordinate
whose held moment is zero never had a gradient (an embedding row not yet looked up): its
momentum stays zero, as Adam would keep it, since a 1-bit code has no zero and ``eps``
alone would divide.

In the harness (2 gloo workers, the freeze at 22% of the run, 1-bit ``nq`` after a 2-bit
start) it kept dense quality, better than dense, at 21.77x fewer bytes than dense, 1.53x
fewer than static 2-bit: on charlm-tiny +0.72 points and -1.43% of validation loss, on the
held-out charlm-heldout +1.57 and -1.96% (8 seeds each). With ``freeze_eta=0.5`` the norm
test froze charlm-tiny at step 100 of 896: +1.03 points, -1.96%, at 23.50x; the wider
charlm-small at step 75 of 640: +0.29 points, -0.60%, at 23.41x. In a probe the
gradient at 1 bit after the same freeze lost 4.4% of loss (``docs/dense-quality.md``).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ._validate import check_int, check_number
from .adam_noise import (
    _EXCHANGED,
    _HOOKED,
    AdamNoiseCorrection,
    StepHooks,
    _check_optimizer,
    _check_state,
)
from .compress import ErrorFeedback, Reducer, compressor_class
from .controller import Controller
from .diloco_warmup import WarmupEnd
from .report import Costs


class MomentumExchange(StepHooks):
    """From optimizer step ``freeze_at`` on, average Adam's momentum compressed at
    ``level`` instead of the gradient, with ``v`` frozen (see the module).

    The loop, after the freeze (:attr:`active`): under DDP with ``state``'s hook
    registered, only stop clipping, since the hook exchanges the momenta (and clips)
    instead of averaging the gradients. Without the hook, run ``backward()`` without
    averaging (DDP's ``no_sync()``), call :meth:`reduce` on every rank, then
    ``optimizer.step()``. Before the freeze the loop averages and clips as usual. A step
    after the freeze with no exchange, or whose gradients changed after it (a clip),
    raises ``RuntimeError`` rather than train wrong; with ``loop_clip`` the exchange undoes
    a clip of the loop's instead (a framework that clips every step). The bytes go to
    ``state``'s ledger at ``level``.

    Args:
        optimizer: a ``torch.optim.AdamW`` (or ``Adam`` without L2 decay), not AMSGrad.
            An :class:`~accordion.AdamNoiseCorrection` on it must be created first; at the
            freeze its corrected second moment is the one held, and it is removed.
        state: the :class:`~accordion.controller.Controller` (``AccordionState``) that
            averages the gradients; its compressor, at ``level``, sends the momenta.
        freeze_at: optimizer steps before the freeze, an int >= 1 (with ``freeze_eta``,
            the most).
        level: the level of ``state``'s compressor after the freeze (e.g. 1 for ``nq``).
        clip: the largest gradient norm after the freeze (the RMS of the ranks' norms),
            or ``None`` for no clipping.
        freeze_eta: with a number > 0, Accordion's norm test may freeze sooner: at the end
            of the first window of ``window`` steps whose averaged gradient's norm changed
            by less than ``freeze_eta`` (relative) from the window before, and whose
            learning rate did not rise (:class:`~accordion.diloco_warmup.WarmupEnd`, as
            it ends DiLoCo's warm-up). ``None`` (default): the freeze at ``freeze_at``.
        window: the norm test's steps per window, an int >= 1 (default 25).
        loop_clip: the norm to which the loop clips the gradients at every step, after the
            freeze too (a framework's clipping: the Trainer's ``max_grad_norm``,
            Lightning's ``gradient_clip_val``), or ``None`` (default: the loop stops
            clipping at the freeze). Past the freeze the exchange undoes that clip where it
            bound (the exchange clipped already, with ``clip``, which it then needs); any
            other change of the gradients still raises.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: Controller, freeze_at: int,
                 level: Any, clip: float | None = None, freeze_eta: float | None = None,
                 window: int = 25, loop_clip: float | None = None):  # fmt: skip
        _check_optimizer(optimizer)
        _check_state(state)
        freeze_at = check_int("freeze_at", freeze_at, 1)
        clip = None if clip is None else check_number("clip", clip, minimum=0, strict=True)
        window = check_int("window", window, 1)
        if loop_clip is not None:
            loop_clip = check_number("loop_clip", loop_clip, minimum=0, strict=True)
            if clip is None:
                raise ValueError(f"loop_clip={loop_clip} undoes the loop's clip past the "
                                 "freeze, where the exchange must clip instead: give clip "
                                 "too (e.g. the same norm)")  # fmt: skip
        if freeze_eta is not None:
            freeze_eta = check_number("freeze_eta", freeze_eta, minimum=0, strict=True)
        cls = compressor_class(state.compressor_name)
        try:
            level = cls.check_level(level)
        except (TypeError, ValueError) as error:  # the compressor's message, the argument named
            raise type(error)(f"level: {error}") from None
        if getattr(optimizer, _EXCHANGED, None) is not None:
            raise ValueError("optimizer has a MomentumExchange already: remove() it first")
        if getattr(state, "momentum_exchange", None) is not None:
            raise ValueError("state has a MomentumExchange already (another optimizer's): "
                             "remove() it first")  # fmt: skip
        self.optimizer: torch.optim.Optimizer = optimizer
        self.state: Controller = state
        self.freeze_at: int = freeze_at
        self.level: Any = level
        self.clip: float | None = clip
        self.loop_clip: float | None = loop_clip
        #: The momenta's reducer: ``state``'s compressor at ``level`` (and its collective),
        #: its own memory.
        self.reducer: Reducer = Reducer(cls.build(level, seed=state.seed,
                                                  collective=state.collective), ErrorFeedback())
        self._costs = Costs()
        self._correction: AdamNoiseCorrection | None = getattr(optimizer, _HOOKED, None)
        self._frozen: dict[torch.Tensor, torch.Tensor] = {}  # per parameter: v / (1 - b2**t)
        self._unseen: dict[torch.Tensor, torch.Tensor] = {}  # where a held moment is zero
        # this step's exchanged parameters and their gradients' norms, checked at the step;
        # None until the step's exchange
        self._sent: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self._pending: list = []  # the DDP buckets of this step, held until the last one
        self._test = None if freeze_eta is None else WarmupEnd(self._params(), freeze_eta, window)
        #: Optimizer steps taken since this exchange was created (or as loaded).
        self.steps: int = 0
        #: The step count at which the freeze came, ``None`` before it.
        self.frozen_at: int | None = None
        #: Steps after the freeze on which the clip bound.
        self.clipped_steps: int = 0
        #: Steps after the freeze on which the loop's clip (``loop_clip``) was undone.
        self.undone_clips: int = 0
        self._hook(_EXCHANGED)
        state.momentum_exchange = self  # type: ignore[attr-defined]  # its hook hands on buckets

    @property
    def correction(self) -> AdamNoiseCorrection | None:
        """The :class:`~accordion.AdamNoiseCorrection` on the optimizer when this exchange
        was built (removed at the freeze), or ``None``."""
        return self._correction

    @property
    def active(self) -> bool:
        """Whether the freeze has come: the momenta, not the gradients, are exchanged."""
        return self.frozen_at is not None

    def _with_grads(self) -> list[tuple[torch.Tensor, dict]]:
        """``(parameter, group)`` of every parameter with a gradient, in the optimizer's order."""
        return [(p, g) for g in self.optimizer.param_groups for p in g["params"]
                if p.grad is not None]  # fmt: skip

    def reduce(self) -> None:
        """Average the ranks' momenta into the gradients Adam will take (collective; after
        ``backward()`` under ``no_sync()`` and before ``optimizer.step()``, only while
        :attr:`active`). Under DDP without ``no_sync()`` the state's hook does it instead."""
        if not self.active:
            raise ValueError(f"reduce() exchanges momenta from step freeze_at={self.freeze_at} "
                             f"on; this is step {self.steps}: average the gradients as "
                             "usual until then")  # fmt: skip
        if self._sent is not None:
            raise RuntimeError("the momenta of this step were exchanged already (by the DDP "
                               "hook, in backward()): call reduce() only after a backward() "
                               "under no_sync(), or leave the exchange to the hook")  # fmt: skip
        params = self._with_grads()
        self._exchange(params, [p.grad for p, _ in params])  # type: ignore[misc]

    def reduce_bucket(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The DDP hook's work past the freeze (:meth:`AccordionState.reduce_bucket
        <accordion.ddp.AccordionState.reduce_bucket>` hands each bucket here): hold the
        bucket until DDP's last one, then exchange the momenta of all of them as
        :meth:`reduce` would, the clip's norm taken over the whole model. Returns a future
        of the bucket's buffer."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append((bucket.buffer(), bucket.parameters(), bucket.gradients(), future))
        if not bucket.is_last():
            return future
        pending, self._pending = self._pending, []
        try:
            params, grads = _in_optimizer_order(self.optimizer, pending)
            self._exchange(params, grads)
        except Exception as error:  # DDP re-raises it from backward(), on every bucket's wait
            for *_, waiting in pending:
                waiting.set_exception(error)
        else:
            for buffer, *_, waiting in pending:
                waiting.set_result(buffer)
        return future

    def _exchange(self, params: list[tuple[torch.Tensor, dict]],
                  grads: list[torch.Tensor]) -> None:  # fmt: skip
        """Clip ``grads`` (``params``' local gradients), add ``b1 / (1 - b1) * m``, send
        them at ``level`` and take the offset off again, all in place."""
        if not params:  # nothing to send: the step may go on
            self._sent = ([], torch.zeros(0))
            return
        transport = self.state.transport()
        world = transport.world_size
        coef = self._clip_factor(grads, transport)
        offsets = []
        with torch.no_grad():
            for (p, group), grad in zip(params, grads):
                b1 = group["betas"][0]
                m = self.optimizer.state.get(p, {}).get("exp_avg")  # None: Adam's first step
                offset = torch.zeros_like(grad) if m is None else m * (b1 / (1 - b1))
                grad.mul_(coef).add_(offset.to(grad.dtype))
                offsets.append(offset)
            keys = self.state.params.keys([p for p, _ in params])
            self._costs.record(self.state.ledger, keys, grads, world, self.reducer,
                               self.state.compressor_name)  # fmt: skip
            transport.run(self.reducer.exchange(keys, grads, world,
                                                getattr(transport, "local_size", 1)))
            for (p, _), grad, offset in zip(params, grads, offsets):
                grad.sub_(offset.to(grad.dtype))
                unseen = self._unseen.get(p)
                if unseen is not None:  # never a gradient before: Adam would not move it
                    grad.masked_fill_(unseen, 0.0)
        self.state.decider.observed = True  # the state's gradients went through this exchange
        if self.state.interval_unit == "epoch":  # the state's own exchange would count it
            self.state.step += 1
        self._sent = ([p for p, _ in params], _norms(grads))

    def _clip_factor(self, grads: list[torch.Tensor], transport: Any) -> float:
        """``min(1, clip / RMS of the ranks' gradient norms)``, the same on every rank."""
        if self.clip is None:
            return 1.0
        square = torch.tensor([_square_sum(grads)], dtype=torch.float64)
        mean = float(transport.all_reduce(square)[0]) / transport.world_size
        coef = min(1.0, self.clip / (math.sqrt(mean) + 1e-6))
        self.clipped_steps += coef < 1.0
        return coef

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active:
            if self._test is not None:  # the averaged (and clipped) gradient Adam will take
                self._test.add(self._params())
            return
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("a step after the freeze needs the momenta exchanged: by the "
                               "state's DDP hook in backward(), or by "
                               "MomentumExchange.reduce() after a backward() under no_sync(); "
                               "else each rank would step on its own gradient")  # fmt: skip
        self._check_unchanged(*sent)
        for p, group in self._with_grads():
            held, state = self._frozen.get(p), optimizer.state.get(p, {})
            if held is None or "exp_avg_sq" not in state:
                continue
            beta2 = group["betas"][1]
            target = held * (1 - beta2 ** (_steps(state) + 1))  # Adam's bias correction undone
            g2 = p.grad.detach().square().to(target.dtype)  # type: ignore[union-attr]
            state["exp_avg_sq"].copy_((target - g2 * (1 - beta2)) / beta2)  # so Adam makes target

    def _check_unchanged(self, params: list[torch.Tensor], sent: torch.Tensor) -> None:
        """Past the freeze, before the step: the gradients of ``params`` as the exchange
        left them (their norms ``sent``), or the loop's clip to ``loop_clip`` undone; else
        ``RuntimeError``."""
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            raise RuntimeError("a gradient the exchange averaged was set to None before "
                               "optimizer.step()")  # fmt: skip
        scale = _loop_scale(sent, grads, self.clip, self.loop_clip)  # type: ignore[arg-type]
        if scale is None:
            return
        with torch.no_grad():
            for grad in grads:
                grad.div_(scale)  # type: ignore[union-attr]  # the loop's clip undone
        self.undone_clips += 1

    def remove(self) -> None:
        """Unhook from the optimizer and the state: plain Adam, and the state's hook
        averaging gradients, from now on."""
        super().remove()
        if getattr(self.state, "momentum_exchange", None) is self:
            self.state.momentum_exchange = None

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.active:
            return
        test, lr = self._test, optimizer.param_groups[0]["lr"]
        calm = test is not None and test.calm_after(self.steps, self.state.transport(), lr)
        if calm or self.steps >= self.freeze_at:
            self._freeze()

    def _freeze(self) -> None:
        """Hold each parameter's second moment (bias-corrected; the noise correction's
        value when there is one, which is then removed)."""
        correction = self._correction
        for group in self.optimizer.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                v = state.get("exp_avg_sq")
                if v is None:
                    continue
                used = v if correction is None else correction.used(p, v)
                self._frozen[p] = used / (1 - beta2 ** _steps(state))
        if correction is not None:
            correction.remove()
        self._unseen = _zeros(self._frozen)
        self.frozen_at = self.steps

    def state_dict(self) -> dict[str, Any]:
        """The steps, the step of the freeze, the held second moments in the optimizer's
        parameter order (``None`` where a parameter has none), the momenta's reducer, the
        counts of clips and undone clips and the norm test's windows (``None`` without
        one)."""
        return {"steps": self.steps, "frozen_at": self.frozen_at,
                "frozen": [self._frozen.get(p) for p in self._params()],
                "reducer": self.reducer.state_dict(), "clipped_steps": self.clipped_steps,
                "undone_clips": self.undone_clips,
                "test": None if self._test is None else self._test.state_dict()}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same optimizer's parameters (after the
        optimizer's and the correction's); anything else is a ``ValueError`` naming it,
        and changes nothing. A restored freeze removes the correction again."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a MomentumExchange.state_dict(), got {state!r:.80}")
        steps, frozen_at = state.get("steps"), state.get("frozen_at")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if frozen_at is not None and (isinstance(frozen_at, bool) or not isinstance(
                frozen_at, int) or not 1 <= frozen_at <= steps):  # fmt: skip
            raise ValueError(f"frozen_at must be None or an int in [1, steps={steps}], "
                             f"got {frozen_at!r}")  # fmt: skip
        frozen = self._per_param("frozen", state.get("frozen"))
        if (self._test is None) != (state.get("test") is None):
            raise ValueError("test must be a norm test's state exactly when freeze_eta is given")
        test = copy.deepcopy(self._test)  # loaded beside, kept only if all of it loads
        if test is not None:
            test.load_state_dict(state["test"])
        self.reducer.load_state_dict(state.get("reducer", {}))
        self.steps, self.frozen_at, self._test = steps, frozen_at, test
        self._frozen, self._unseen = frozen, _zeros(frozen)
        self.clipped_steps = int(state.get("clipped_steps", 0))
        self.undone_clips = int(state.get("undone_clips", 0))
        if self.active and self._correction is not None:
            self._correction.remove()


def checkpoint_state(exchange: MomentumExchange) -> dict[str, Any]:
    """What a checkpoint needs of ``exchange`` beyond the optimizer's and the state's:
    its :meth:`~MomentumExchange.state_dict` and its noise correction's (``None``
    without one), for :func:`load_checkpoint_state` (the integrations' checkpoints)."""
    correction = exchange.correction
    return {"exchange": exchange.state_dict(),
            "correction": None if correction is None else correction.state_dict()}  # fmt: skip


def load_checkpoint_state(exchange: MomentumExchange, saved: Mapping[str, Any] | None,
                          source: str = "the checkpoint") -> None:  # fmt: skip
    """Restore a :func:`checkpoint_state` into ``exchange``: the correction first, then the
    exchange (which removes the correction again past the freeze). ``None`` (``source``
    holds none) is a ``RuntimeWarning``: the exchange then starts afresh."""
    if saved is None:
        warnings.warn(f"{source} holds no MomentumExchange state: the exchange starts "
                      "afresh, before its freeze", RuntimeWarning, stacklevel=3)  # fmt: skip
        return
    if not isinstance(saved, Mapping) or "exchange" not in saved:
        raise ValueError(f"not a MomentumExchange checkpoint state: {saved!r:.80}")
    if exchange.correction is not None and saved.get("correction") is not None:
        exchange.correction.load_state_dict(saved["correction"])
    exchange.load_state_dict(saved["exchange"])


def _in_optimizer_order(optimizer: torch.optim.Optimizer, pending: list) -> tuple[
        list[tuple[torch.Tensor, dict]], list[torch.Tensor]]:  # fmt: skip
    """The held buckets' ``(parameter, group)`` pairs and gradients, in ``optimizer``'s
    order (so the hook sends what :meth:`MomentumExchange.reduce` would); ``ValueError``
    for a parameter DDP averages that the optimizer does not hold."""
    held = {p: grad for _, params, grads, _ in pending for p, grad in zip(params, grads)}
    pairs = [(p, g) for g in optimizer.param_groups for p in g["params"] if p in held]
    if len(pairs) != len(held):
        known = {p for p, _ in pairs}
        foreign = next(p for p in held if p not in known)
        raise ValueError(f"DDP averages a parameter of shape {tuple(foreign.shape)} that the "
                         "exchange's optimizer does not hold: its momentum is unknown. Give "
                         "the optimizer every parameter the DDP module trains")  # fmt: skip
    return pairs, [held[p] for p, _ in pairs]


def _zeros(frozen: Mapping[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """Per parameter whose held second moment has a zero, where it is zero (once, at the
    freeze or the load, rather than at every step)."""
    masks = {p: held == 0 for p, held in frozen.items()}
    return {p: mask for p, mask in masks.items() if bool(mask.any())}


def _square_sum(grads: list[torch.Tensor]) -> float:
    """The sum of squares of ``grads``, in double precision."""
    if not grads:
        return 0.0
    return float(torch.stack([g.detach().double().square().sum() for g in grads]).sum())


def _norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each gradient's norm in single precision (no copy of fp32 gradients), to see
    whether the loop changed them between the exchange and the step."""
    if not grads:
        return torch.zeros(0)
    return torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads])


def _loop_scale(sent: torch.Tensor, grads: list[torch.Tensor], clip: float | None,
                loop_clip: float | None) -> float | None:  # fmt: skip
    """``None`` when ``grads`` have the norms ``sent`` (as exchanged); the factor of the
    loop's clip to ``loop_clip`` when that is what changed them; else ``RuntimeError``:
    past the freeze the gradients carry the averaged momentum."""
    now = _norms(grads)
    scale = _common_scale(sent, now)
    if scale is not None and abs(scale - 1) <= 1e-5:
        return None
    total = float(now.double().square().sum().sqrt())
    if scale is None or scale > 1 or loop_clip is None or abs(total - loop_clip) > (
            1e-4 * loop_clip):  # fmt: skip
        raise RuntimeError(
            "the gradients changed between the momenta's exchange and optimizer.step() "
            f"(their norm {float(sent.double().square().sum().sqrt()):.6g} -> {total:.6g}): "
            "past the freeze they carry the averaged momentum, so the loop must not clip "
            f"or scale them (the exchange clips, clip={clip}); a loop that clips every "
            "step: give its norm as loop_clip; an AMP GradScaler's unscale_ is such a "
            "scaling: use bf16 autocast, which needs no scaler")
    return scale


def _common_scale(before: torch.Tensor, after: torch.Tensor) -> float | None:
    """The one factor by which every norm of ``before`` became ``after``'s (1.0 for
    none), or ``None`` when they changed by different factors (a clip by the global
    norm scales them all alike)."""
    moved = before > 0
    if before.shape != after.shape or bool((after[~moved] != 0).any()):
        return None
    if not bool(moved.any()):
        return 1.0
    ratios = after[moved].double() / before[moved].double()
    scale = float(ratios.median())
    return scale if float((ratios - scale).abs().max()) <= 1e-5 * scale else None


def _steps(state: Mapping[str, Any]) -> int:
    """Adam's step count of one parameter (a tensor or a number, by torch's version)."""
    return int(state["step"])
