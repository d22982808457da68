"""accordion.integrations.transformers: the Trainer callback in real 2-process runs.

``tests/distributed.py`` initialises a gloo group; the torchrun-like environment
variables make ``TrainingArguments(use_cpu=True)`` take Accelerate's MULTI_CPU path, which
keeps that group, and the Trainer then wraps the model in DDP.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from accordion.ddp import AccordionState  # noqa: E402
from accordion.policy import GuardedRule  # noqa: E402
from distributed import run_processes, set_torchrun_environment  # noqa: E402

STEPS = 8
EPOCHS = 3


class _Tokens(Dataset):
    """Random sequences of 16 tokens, the same on every rank, as a causal LM's batch."""

    def __init__(self, size: int = 64):
        self.ids = torch.randint(0, 64, (size, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _trainer(rank, world_size, output_dir, unit="step", data=64, **kwargs):
    """A Trainer of a tiny GPT-2 with the callback attached, and its Accordion state
    checking every 2 steps or every epoch (``unit``)."""
    set_torchrun_environment(rank, world_size)
    from transformers import Trainer, TrainingArguments

    from accordion.integrations.transformers import AccordionTrainerCallback

    model = _model()
    state = AccordionState(
        model,
        "powersgd",
        levels=(4, 2, 1),
        interval=2 if unit == "step" else 1,
        interval_unit=unit,
        rule=GuardedRule(wait_for_decay=False),
    )
    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        **kwargs,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(data))
    AccordionTrainerCallback(state).attach(trainer)
    return trainer, state


def _recorder(state, history: list, event: str = "on_step_end"):
    """A callback appending ``state.rungs()`` to ``history`` at ``event``; added after
    Accordion's callback, it runs after it."""
    from transformers import TrainerCallback

    recorder = TrainerCallback()
    setattr(recorder, event, lambda *args, **kwargs: history.append(state.rungs()))
    return recorder


def _summary(trainer, state) -> dict:
    """Collective: this rank's Accordion totals and whether the ranks agree."""
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    rungs = [None] * dist.get_world_size()
    dist.all_gather_object(rungs, state.rungs())
    return {
        "total": state.ledger.total_floats,
        "dense": state.dense_floats(),
        "steps": state.step,
        "global_step": trainer.state.global_step,
        "rungs": state.rungs(),
        "params": flat.tolist(),
        "params_equal": all(torch.equal(g, flat) for g in gathered),
        "rungs_equal": all(r == rungs[0] for r in rungs),
    }


def _steps(rank, world_size, out) -> dict:
    trainer, state = _trainer(
        rank, world_size, os.path.join(out, "steps"), save_strategy="no", max_steps=STEPS
    )
    history = []
    trainer.add_callback(_recorder(state, history))
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    return {**_summary(trainer, state), "history": history, "wrapped": wrapped}


def _epochs(rank, world_size, out) -> dict:
    # 16 sequences: 2 steps of 2 x 4 per epoch; a check at the end of every epoch
    trainer, state = _trainer(
        rank,
        world_size,
        os.path.join(out, "epochs"),
        unit="epoch",
        data=16,
        save_strategy="no",
        num_train_epochs=EPOCHS,
    )
    history = []
    trainer.add_callback(_recorder(state, history, "on_epoch_end"))
    trainer.train()
    return {**_summary(trainer, state), "epochs": state.epoch, "history": history}


def _save_resume(rank, world_size, out) -> dict:
    output_dir = os.path.join(out, "resume")
    trainer, state = _trainer(
        rank, world_size, output_dir, save_strategy="steps", save_steps=4, max_steps=STEPS
    )
    trainer.train()  # saves checkpoint-4 and checkpoint-8
    straight = _summary(trainer, state)
    files = sorted(os.listdir(os.path.join(output_dir, "checkpoint-4")))
    # new model, state and Trainer: only the checkpoint carries anything over
    trainer, state = _trainer(rank, world_size, output_dir, save_strategy="no", max_steps=STEPS)
    trainer.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-4"))
    return {"straight": straight, "resumed": _summary(trainer, state), "files": files}


def _momentum_trainer(rank, world_size, output_dir, **kwargs):
    """A Trainer of the tiny GPT-2 on the transformers' recipe: 2-bit ``nq`` with the noise
    correction, then from step 3 the momenta at 1 bit; the Trainer clips at every step
    (``max_grad_norm``), which the exchange undoes past the freeze (``loop_clip``)."""
    set_torchrun_environment(rank, world_size)
    from transformers import Trainer, TrainingArguments

    from accordion import AdamNoiseCorrection, MomentumExchange
    from accordion.integrations.transformers import AccordionTrainerCallback

    model = _model()
    state = AccordionState(model, "nq", levels=(2, 2), interval=2, interval_unit="step")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    AdamNoiseCorrection(optimizer, state)
    exchange = MomentumExchange(optimizer, state, 3, 1, clip=0.05, loop_clip=0.05)
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=4,
        max_grad_norm=0.05, report_to="none", logging_strategy="no", disable_tqdm=True,
        seed=0, max_steps=STEPS, **kwargs,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(),
                      optimizers=(optimizer, None))  # fmt: skip
    AccordionTrainerCallback(state).attach(trainer)
    return trainer, state, exchange


def _momentum(rank, world_size, out) -> dict:
    output_dir = os.path.join(out, "momentum")
    trainer, state, exchange = _momentum_trainer(
        rank, world_size, output_dir, save_strategy="steps", save_steps=4
    )
    trainer.train()  # saves checkpoint-4, after the freeze at step 3
    straight = {**_summary(trainer, state), "frozen_at": exchange.frozen_at,
                "undone": exchange.undone_clips, "bytes": state.ledger.total_bytes}  # fmt: skip
    files = sorted(os.listdir(os.path.join(output_dir, "checkpoint-4")))
    trainer, state, exchange = _momentum_trainer(rank, world_size, output_dir, save_strategy="no")
    trainer.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-4"))
    resumed = {**_summary(trainer, state), "frozen_at": exchange.frozen_at}
    shapes = [tuple(p.shape) for p in trainer.model.parameters()]
    return {"straight": straight, "resumed": resumed, "files": files, "shapes": shapes}


def _run_all(rank, world_size, out):
    # one pair of processes for the four runs: importing transformers twice per run
    # would cost more than the training
    result = {
        run.__name__[1:]: run(rank, world_size, out)
        for run in (_steps, _epochs, _save_resume, _momentum)
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per run, both ranks' results of real 2-process Trainer runs with the callback."""
    out = tmp_path_factory.mktemp("trainer")
    run_processes(_run_all, 2, str(out), timeout=150)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {run: [rank[run] for rank in ranks] for run in ranks[0]}


def test_trainer_with_callback_compresses_switches_levels_and_ranks_agree(runs):
    for r in runs["steps"]:
        assert r["wrapped"] == "DistributedDataParallel"
        assert 0 < r["total"] < r["dense"]  # the hook ran, and sent less than dense
        assert r["params_equal"] and r["rungs_equal"]
        assert r["steps"] == r["global_step"] == STEPS  # one end_step per optimizer step
        seen = [max(h.values()) for h in r["history"] if h]
        assert 0 in seen and max(seen) >= 1, seen  # from rank 4 to a lower rank
    assert runs["steps"][0]["history"] == runs["steps"][1]["history"]


def test_trainer_with_callback_ends_epochs_when_the_state_counts_epochs(runs):
    for r in runs["epochs"]:
        assert 0 < r["total"] < r["dense"] and r["params_equal"] and r["rungs_equal"]
        assert r["epochs"] == EPOCHS and r["global_step"] == 2 * EPOCHS
        seen = [max(h.values()) for h in r["history"]]
        assert len(seen) == EPOCHS and seen[0] == 0 and max(seen) >= 1, seen
    assert runs["epochs"][0]["history"] == runs["epochs"][1]["history"]


def test_resume_from_a_checkpoint_restores_each_ranks_state_as_if_uninterrupted(runs):
    for r in runs["save_resume"]:
        assert {"accordion-rank0.pt", "accordion-rank1.pt"} <= set(r["files"])
        straight, resumed = r["straight"], r["resumed"]
        assert resumed["params_equal"] and resumed["rungs_equal"]
        # a fresh state after the resume would have counted 4 steps, not 8
        for key in ("total", "dense", "steps", "rungs"):
            assert resumed[key] == straight[key], key
        assert resumed["params"] == straight["params"]  # bitwise: the run resumed exactly


def test_the_trainer_runs_the_momentum_exchange_through_the_hook_and_resumes_it(runs):
    from accordion.accounting import wire_bytes

    for r in runs["momentum"]:
        straight, resumed = r["straight"], r["resumed"]
        assert straight["frozen_at"] == resumed["frozen_at"] == 3
        assert straight["undone"] > 0  # the Trainer's clip bound past the freeze, undone
        assert {"accordion-momentum-rank0.pt", "accordion-momentum-rank1.pt"} <= set(r["files"])
        # 3 steps of 2-bit gradients, then 5 of 1-bit momenta: the hook sent them
        per_step = {bits: sum(wire_bytes(tuple(s), "nq", bits, 2, 4) for s in r["shapes"])
                    for bits in (2, 1)}  # fmt: skip
        assert straight["bytes"] == 3 * per_step[2] + 5 * per_step[1]
        assert straight["params_equal"] and resumed["params_equal"]
        assert resumed["params"] == straight["params"]  # bitwise: the exchange resumed too


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    """One process in this process; Accelerate's shared state reset afterwards."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_one_process_warns_and_leaves_the_state_unused(tmp_path, fresh_accelerate_state):
    from transformers import Trainer, TrainingArguments

    from accordion.integrations.transformers import AccordionTrainerCallback

    model = _model()
    state = AccordionState(model, "powersgd", levels=(2, 1), interval=1, interval_unit="step")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=4,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    AccordionTrainerCallback(state, trainer)
    with pytest.warns(UserWarning, match="one process"):
        trainer.train()
    assert state.step == 0 and state.ledger.total_floats == 0


def test_bad_arguments_raise_naming_them():
    from transformers import TrainerControl, TrainerState

    from accordion.integrations.transformers import AccordionTrainerCallback

    state = AccordionState(_model(), "powersgd", levels=(2, 1))
    with pytest.raises(TypeError, match="state must be an accordion.ddp.AccordionState"):
        AccordionTrainerCallback({"powersgd": 2})
    with pytest.raises(TypeError, match="checkpoint must be a bool"):
        AccordionTrainerCallback(state, checkpoint=1)
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer"):
        AccordionTrainerCallback(state, trainer="trainer")
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer"):
        AccordionTrainerCallback(state).attach(object())
    args = SimpleNamespace(world_size=2)
    with pytest.raises(RuntimeError, match="attach"):
        AccordionTrainerCallback(state).on_train_begin(args, TrainerState(), TrainerControl())


def test_import_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    monkeypatch.delitem(sys.modules, "accordion.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install torch-accordion\[integrations\]"):
        import accordion.integrations.transformers  # noqa: F401
