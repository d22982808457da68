"""AccordionCallback in real PyTorch Lightning DDP fits: 2 gloo processes on CPU.

The distributed scenarios run one after another in one pair of worker processes (one
spawn: importing Lightning takes seconds per process), each saving its results per rank;
each test below checks one scenario's results.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import traceback
import types
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (  # noqa: E402
    allreduce_hook,
)

from accordion.ddp import AccordionState, accordion_hook  # noqa: E402
from accordion.integrations import lightning as integration  # noqa: E402
from accordion.integrations.lightning import AccordionCallback  # noqa: E402
from accordion.policy import PaperRule  # noqa: E402
from distributed import run_processes  # noqa: E402

WORLD = 2
WEIGHTS = ("net.0.weight", "net.2.weight")  # the compressed (2-d) parameters
# ReduceLROnPlateau(mode="min", patience=0) on this signal decays once, after epoch 2
PLATEAU_SIGNAL = (0.0, -1.0, 5.0, -10.0)
# StepLR(step_size=3) and the plateau signal both lower the lr from epoch 3 on: the end
# of epoch 2 (the third check) must see the decay
DECAY_AT_CHECK = [False, False, True, False]


class Net(pl.LightningModule):
    """A small MLP on 64 fixed samples: 4 batches of 8 per rank and epoch."""

    def __init__(self, scheduler: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.scheduler = scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_epoch_end(self):
        if self.scheduler == "plateau":
            self.log("signal", PLATEAU_SIGNAL[self.current_epoch], sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.scheduler == "steplr":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}
        if self.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, "min", patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "signal"}}
        return opt

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 16, generator=g)
        return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8)


class Recorder(pl.Callback):
    """After AccordionCallback in the list: what the state holds at each epoch's first
    batch, when the fit starts, and at each checkpoint save."""

    def __init__(self, state: AccordionState):
        self.state = state
        self.epochs: list[dict] = []
        self.at_start = None
        self.saved: dict[int, dict] = {}

    def on_train_start(self, trainer, pl_module):
        self.at_start = self.state.state_dict()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self.epochs.append({"rungs": self.state.rungs(), "lr": lr})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved[trainer.current_epoch] = self.state.state_dict()


def _trainer(max_epochs: int, callbacks: list, strategy=None, **options) -> pl.Trainer:
    options = {"enable_checkpointing": False, **options}
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy or DDPStrategy(process_group_backend="gloo"),
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _fit(state: AccordionState, max_epochs: int, scheduler=None, *, before=(), after=(),
         ckpt_path=None, **options):  # fmt: skip
    """Fit a fresh Net under AccordionCallback(state), with the callbacks ``before`` and
    ``after`` it; returns (net, recorder)."""
    recorder = Recorder(state)
    callbacks = [*before, AccordionCallback(state), recorder, *after]
    net = Net(scheduler)
    _trainer(max_epochs, callbacks, **options).fit(net, ckpt_path=ckpt_path)
    return net, recorder


def _params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


# --- the scenarios, run in each worker -----------------------------------------------------


def _plain_fit(out: str) -> dict:
    state = AccordionState(None, "powersgd", levels=(4, 2, 1), interval=1)
    net, recorder = _fit(state, 3)
    return {"total": state.ledger.total_floats, "dense": state.dense_floats(),
            "epochs": recorder.epochs, "rungs": state.rungs(), "levels": state.levels(),
            "epoch": state.epoch, "params": _params(net)}  # fmt: skip


def _lightning_alone(out: str) -> dict:
    # Lightning's own way: DDPStrategy registers the comm hook only on CUDA
    state = AccordionState(None, "powersgd", levels=(4, 2, 1), interval=1)
    strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                           ddp_comm_hook=accordion_hook)  # fmt: skip
    _trainer(1, [], strategy=strategy).fit(Net())
    return {"total": state.ledger.total_floats, "hooked": _ddp_hooks_seen(state)}


def _ddp_hooks_seen(state: AccordionState) -> int:
    return sum(t.steps for t in state.ledger.layers.values())


def _decay(scheduler: str) -> dict:
    state = AccordionState(None, "powersgd", levels=(4, 2, 1), interval=1, rule=PaperRule(0.5))
    _, recorder = _fit(state, 4, scheduler)
    return {"decays": [h["lr_will_decay"] for h in state.rule.history],
            "epochs": recorder.epochs}  # fmt: skip


def _steplr(out: str) -> dict:
    return _decay("steplr")


def _plateau(out: str) -> dict:
    return _decay("plateau")


def _steps_under_accumulation(out: str) -> dict:
    state = AccordionState(None, "powersgd", levels=(4, 2, 1), interval=2, interval_unit="step")
    recorder = Recorder(state)
    trainer = _trainer(2, [AccordionCallback(state), recorder], accumulate_grad_batches=2)
    trainer.fit(Net())
    return {"step": state.step, "global_step": trainer.global_step,
            "checks": len(state.rule.history), "total": state.ledger.total_floats}  # fmt: skip


class _OtherHook(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.model.register_comm_hook(None, allreduce_hook)


def _other_hook(out: str) -> dict:
    state = AccordionState(None, "powersgd", levels=(4, 2, 1))
    try:
        _fit(state, 1, before=[_OtherHook()])
    except ValueError as exc:
        return {"error_message": str(exc)}
    return {"error_message": None}


def _checkpoint(out: str) -> dict:
    folder = os.path.join(out, "checkpoints")
    saver = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    state = AccordionState(None, "powersgd", levels=(4, 2, 1), interval=1)
    net, recorder = _fit(state, 5, "steplr", after=[saver], enable_checkpointing=True)
    resumed_state = AccordionState(None, "powersgd", levels=(4, 2, 1), interval=1)
    resume = os.path.join(folder, "epoch=2.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        resumed, after = _fit(resumed_state, 5, "steplr", ckpt_path=resume)
    return {"saved": recorder.saved[2], "loaded": after.at_start,
            "full": (state.state_dict(), _params(net)),
            "resumed": (resumed_state.state_dict(), _params(resumed)),
            "resume_warnings": [str(w.message) for w in caught
                                if issubclass(w.category, RuntimeWarning)]}  # fmt: skip


class AdamNet(Net):
    """Net on AdamW with the transformers' recipe on ``accordion``: 2-bit ``nq`` with the
    noise correction, then from step 3 the momenta at 1 bit; Lightning clips at every step
    (``gradient_clip_val``), which the exchange undoes past the freeze (``loop_clip``)."""

    def __init__(self, accordion: AccordionState):
        super().__init__()
        self.accordion = accordion
        self.exchange = None

    def configure_optimizers(self):
        from accordion import AdamNoiseCorrection, MomentumExchange

        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        AdamNoiseCorrection(opt, self.accordion)
        self.exchange = MomentumExchange(opt, self.accordion, 3, 1, clip=0.05, loop_clip=0.05)
        return opt


def _momentum_checkpoint(out: str) -> dict:
    folder = os.path.join(out, "momentum")
    saver = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    runs = {}
    for name, resume in (("full", None), ("resumed", os.path.join(folder, "epoch=1.ckpt"))):
        state = AccordionState(None, "nq", levels=(2, 2))
        net = AdamNet(state)
        options = {"after": [saver], "enable_checkpointing": True} if resume is None else {}
        _trainer(4, [AccordionCallback(state), *options.pop("after", [])],
                 gradient_clip_val=0.05, **options).fit(net, ckpt_path=resume)  # fmt: skip
        exchange = net.exchange
        runs[name] = {"params": _params(net), "bytes": state.ledger.total_bytes,
                      "steps": exchange.steps, "frozen_at": exchange.frozen_at,
                      "undone": exchange.undone_clips}  # fmt: skip
    runs["shapes"] = [tuple(p.shape) for p in Net().parameters()]
    return runs


SCENARIOS = {
    "plain_fit": _plain_fit,
    "momentum": _momentum_checkpoint,
    "lightning_alone": _lightning_alone,
    "steplr": _steplr,
    "plateau": _plateau,
    "steps": _steps_under_accumulation,
    "checkpoint": _checkpoint,
    "other_hook": _other_hook,  # last: a fit that fails leaves Lightning's state behind
}


def _scenarios(rank: int, world_size: int, out: str) -> None:
    # the process group exists (tests/distributed.py): LOCAL_RANK tells Lightning that
    # the processes are launched already, and it uses the group instead of creating one
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    for name, scenario in SCENARIOS.items():
        try:
            result = scenario(out)
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, os.path.join(out, f"{name}-{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    run_processes(_scenarios, WORLD, str(out), timeout=120)

    def of(name: str) -> list[dict]:
        ranks = [torch.load(out / f"{name}-{r}.pt", weights_only=False) for r in range(WORLD)]
        for r, result in enumerate(ranks):
            assert "error" not in result, f"rank {r}: {result['error']}"
        return ranks

    return of


def _assert_same(a, b, where="state"):
    """Nested dicts, lists and tensors equal (tensors bitwise)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} {b.keys()}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# --- distributed behaviour -----------------------------------------------------------------


def test_fit_sends_less_than_dense(results):
    for r in results("plain_fit"):
        assert r["total"] > 0, "the hook never ran"
        assert r["total"] < r["dense"]


def test_fit_switches_levels_at_epoch_ends(results):
    for r in results("plain_fit"):
        # no decision in epoch 0; rank 4 after the first check, rank 2 after a calm one
        assert [e["rungs"] for e in r["epochs"]] == [{}, dict.fromkeys(WEIGHTS, 0),
                                                     dict.fromkeys(WEIGHTS, 1)]  # fmt: skip
        assert r["levels"] == dict.fromkeys(WEIGHTS, 2)
        assert r["epoch"] == 3  # the last epoch ended in on_train_end


def test_fit_ranks_agree(results):
    first, second = results("plain_fit")
    _assert_same(first["params"], second["params"], "params")
    assert first["rungs"] == second["rungs"] and first["levels"] == second["levels"]


def test_lightning_alone_skips_the_hook_on_cpu(results):
    # why the callback exists: DDPStrategy(ddp_comm_hook=...) trains dense on CPU
    for r in results("lightning_alone"):
        assert r["total"] == 0 and r["hooked"] == 0


@pytest.mark.parametrize("scheduler", ["steplr", "plateau"])
def test_decay_is_seen_at_the_epoch_it_takes_effect(results, scheduler):
    for r in results(scheduler):
        assert r["decays"] == DECAY_AT_CHECK
        lrs = [e["lr"] for e in r["epochs"]]
        assert lrs[:3] == [0.05] * 3 and lrs[3] == pytest.approx(0.005)
        # the paper's rule: calm layers at the last rung, every layer back at rung 0 for
        # the first epoch at the decayed lr
        assert [e["rungs"] for e in r["epochs"][2:]] == [dict.fromkeys(WEIGHTS, 2),
                                                         dict.fromkeys(WEIGHTS, 0)]  # fmt: skip


def test_step_unit_ends_each_optimizer_step_once_under_accumulation(results):
    for r in results("steps"):
        assert r["global_step"] == 4  # 2 epochs x 4 batches / accumulate 2
        assert r["step"] == 4 and r["checks"] == 2  # interval 2
        assert r["total"] > 0


def test_resume_restores_each_ranks_state(results):
    ranks = results("checkpoint")
    for r in ranks:
        _assert_same(r["saved"], r["loaded"])
        assert r["loaded"]["epoch"] == 2 and r["loaded"]["ledger"]["layers"]
        assert set(r["loaded"]["rungs"].values()) == {1}
    # per-rank memories differ, so each rank must have got its own
    first, second = (r["loaded"]["reducer"]["memory"]["memory"] for r in ranks)
    assert any(not torch.equal(first[k], second[k]) for k in first)


def test_resumed_fit_matches_an_uninterrupted_one(results):
    for r in results("checkpoint"):
        _assert_same(r["full"], r["resumed"], "full vs resumed")


def test_a_resumed_fit_does_not_warn_that_no_gradient_passed_through_the_state(results):
    # the checkpoint is written before the callback ends its epoch, at the next batch
    for r in results("checkpoint"):
        idle = [m for m in r["resume_warnings"] if "no gradient passed" in m]
        assert idle == [], idle


def test_another_comm_hook_is_refused(results):
    for r in results("other_hook"):
        assert r["error_message"] and "already has a comm hook" in r["error_message"]


# --- in one process ------------------------------------------------------------------------


def _state() -> AccordionState:
    return AccordionState(None, "powersgd", levels=(4, 2, 1))


def test_state_must_be_an_accordion_state():
    with pytest.raises(TypeError, match="state must be an accordion.ddp.AccordionState"):
        AccordionCallback(nn.Linear(2, 2))


def test_unit_must_be_the_states_unit():
    with pytest.raises(ValueError, match="unit"):
        AccordionCallback(_state(), unit="weekly")
    with pytest.raises(ValueError, match="interval_unit='step'"):
        AccordionCallback(_state(), unit="step")
    assert AccordionCallback(_state(), unit="epoch").unit == "epoch"


def test_non_ddp_strategy_is_refused():
    trainer = types.SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(TypeError, match="needs Lightning's DDPStrategy"):
        AccordionCallback(_state()).setup(trainer, Net(), "fit")


def test_another_ddp_comm_hook_in_the_strategy_is_refused():
    trainer = types.SimpleNamespace(strategy=DDPStrategy(ddp_comm_hook=allreduce_hook))
    with pytest.raises(ValueError, match="ddp_comm_hook=allreduce_hook"):
        AccordionCallback(_state()).setup(trainer, Net(), "fit")
    state = _state()  # Accordion's own hook with the callback's state is accepted
    strategy = DDPStrategy(ddp_comm_hook=accordion_hook, ddp_comm_state=state)
    callback = AccordionCallback(state)
    callback.setup(types.SimpleNamespace(strategy=strategy), Net(), "fit")
    assert callback.active


def test_checkpoint_of_another_world_size_is_refused():
    callback = AccordionCallback(_state())
    callback.setup(types.SimpleNamespace(strategy=DDPStrategy()), Net(), "fit")
    entry = {"format": integration.FORMAT, "world_size": 2, "ranks": [{}, {}]}
    with pytest.raises(ValueError, match="cannot be resharded"):
        callback.load_state_dict(entry)


def _exchange_callback():
    """A fitting callback (one process) whose state has a momentum exchange on AdamW."""
    from accordion import AdamNoiseCorrection, MomentumExchange

    net = Net()
    state = AccordionState(net, "nq", levels=(2, 2))
    optimizer = torch.optim.AdamW(net.parameters())
    AdamNoiseCorrection(optimizer, state)
    exchange = MomentumExchange(optimizer, state, 2, 1)
    callback = AccordionCallback(state)
    callback.setup(types.SimpleNamespace(strategy=DDPStrategy()), net, "fit")
    return callback, exchange


_ONE_PROCESS = types.SimpleNamespace(strategy=types.SimpleNamespace(
    root_device=torch.device("cpu"), reduce_boolean_decision=lambda ok, all: ok))  # fmt: skip


def test_a_fit_runs_the_momentum_exchange_through_the_hook_and_resumes_it(results):
    from accordion.accounting import wire_bytes

    for r in results("momentum"):
        full, resumed = r["full"], r["resumed"]
        assert full["frozen_at"] == resumed["frozen_at"] == 3 and full["steps"] == 16
        assert full["undone"] > 0  # Lightning's clip bound past the freeze, and was undone
        per_step = {bits: sum(wire_bytes(s, "nq", bits, WORLD, 4) for s in r["shapes"])
                    for bits in (2, 1)}  # fmt: skip
        assert full["bytes"] == 3 * per_step[2] + 13 * per_step[1]  # the hook sent them
        _assert_same(full["params"], resumed["params"], "params")  # the exchange resumed


def test_a_checkpoint_holds_the_states_momentum_exchange():
    callback, exchange = _exchange_callback()
    params = [p for g in exchange.optimizer.param_groups for p in g["params"]]
    held = [torch.rand(p.shape) + 0.1 for p in params]
    exchange.load_state_dict({**exchange.state_dict(), "steps": 5, "frozen_at": 2,
                              "frozen": held, "clipped_steps": 3})  # past its freeze
    entry = callback.state_dict()
    callback, exchange = _exchange_callback()  # a new run: only the entry carries over
    callback.load_state_dict(entry)
    callback._load(_ONE_PROCESS)  # on_fit_start's load, without its DDP module
    assert (exchange.steps, exchange.frozen_at, exchange.clipped_steps) == (5, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(exchange.state_dict()["frozen"], held))
    assert exchange.correction is not None and exchange.correction._handles == []  # removed


def test_a_checkpoint_without_the_states_momentum_exchange_warns_on_load():
    callback, _ = _exchange_callback()
    entry = callback.state_dict()
    del entry["ranks"][0]["momentum"]  # as written before the exchange was checkpointed
    callback, exchange = _exchange_callback()
    callback.load_state_dict(entry)
    with pytest.warns(RuntimeWarning, match="the exchange starts afresh"):
        callback._load(_ONE_PROCESS)
    assert exchange.steps == 0


def test_single_device_warns_and_trains_without_accordion():
    state = _state()
    callback = AccordionCallback(state)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    with pytest.warns(UserWarning, match="Accordion does nothing"):
        trainer.fit(Net())
    assert trainer.global_step == 8 and state.ledger.total_floats == 0 and state.epoch == 0
    assert callback.state_dict() == {}


def test_missing_lightning_names_the_extra(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # None: "not installed" to import
    spec = importlib.util.spec_from_file_location(
        "accordion.integrations._lightning_probe", integration.__file__
    )
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match=r"pip install torch-accordion\[integrations\]"):
        spec.loader.exec_module(module)
