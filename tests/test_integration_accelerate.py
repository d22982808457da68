"""accordion.integrations.accelerate: the hook on the model that Accelerate prepared.

Real 2-process gloo runs: ``tests/distributed.py`` initialises the process group, and the
torchrun-like environment variables make ``Accelerator(cpu=True)`` take the MULTI_CPU
path, which keeps the existing group instead of creating one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from accordion.ddp import AccordionState  # noqa: E402
from accordion.integrations import accelerate as acc  # noqa: E402
from accordion.policy import GuardedRule  # noqa: E402
from distributed import run_processes, set_torchrun_environment  # noqa: E402

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"

MICRO_BATCHES = 16  # per rank: 2 epochs of 8 batches of 16 samples out of 256 / 2 ranks
ACCUMULATION = 2


def _accelerator(rank: int, world_size: int, **kwargs):
    set_torchrun_environment(rank, world_size)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, **kwargs)
    assert accelerator.num_processes == world_size
    return accelerator


def _setup(accelerator):
    torch.manual_seed(0)  # the same model and data on every rank
    net = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    state = AccordionState(
        net,
        "powersgd",
        levels=(4, 2, 1),
        interval=2,
        interval_unit="step",
        rule=GuardedRule(wait_for_decay=False),
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    return acc.register(accelerator, model, state), optimizer, loader, state


def _train(accelerator, model, optimizer, loader, state, epochs: int) -> list[dict]:
    history = []
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            acc.end_step(accelerator, state, optimizer)
            history.append(state.rungs())
    return history


def _agreement(model, state) -> dict:
    """Collective: whether parameters (bitwise) and rungs are equal on every rank."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    rungs = [None] * dist.get_world_size()
    dist.all_gather_object(rungs, state.rungs())
    return {
        "params_equal": all(torch.equal(g, flat) for g in gathered),
        "rungs_equal": all(r == rungs[0] for r in rungs),
    }


def _report(state, history, agreement) -> dict:
    return {
        "total": state.ledger.total_floats,
        "dense": state.dense_floats(),
        "steps": state.step,
        "history": history,
        **agreement,
    }


def _run_training(rank, world_size, out, dynamo_backend):
    accelerator = _accelerator(
        rank, world_size, gradient_accumulation_steps=ACCUMULATION, dynamo_backend=dynamo_backend
    )
    model, optimizer, loader, state = _setup(accelerator)
    history = _train(accelerator, model, optimizer, loader, state, epochs=2)
    result = _report(state, history, _agreement(model, state))
    result["compiled"] = type(model).__name__
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _check_run(results: list[dict]) -> None:
    for r in results:
        assert 0 < r["total"] < r["dense"]  # the hook ran, and sent less than dense
        assert r["params_equal"] and r["rungs_equal"]
        # one check per 2 optimizer steps; only synchronised micro-batches are steps
        assert r["steps"] == MICRO_BATCHES // ACCUMULATION
        seen = [max(h.values()) for h in r["history"] if h]
        assert 0 in seen and max(seen) >= 1, seen  # from rank 4 to a lower rank
    assert results[0]["history"] == results[1]["history"]


def _results(path) -> list[dict]:
    return [json.loads((path / f"rank{r}.json").read_text()) for r in range(2)]


def test_prepared_ddp_model_compresses_switches_levels_and_ranks_agree(tmp_path):
    run_processes(_run_training, 2, str(tmp_path), "no", timeout=60)
    results = _results(tmp_path)
    _check_run(results)
    assert results[0]["compiled"] == "DistributedDataParallel"


def test_register_finds_the_hook_through_accelerates_torch_compile(tmp_path):
    # backend "eager": dynamo traces the model (and DDP's graph splits) without inductor's
    # C++ compilation, which would take minutes on 2 cores
    run_processes(_run_training, 2, str(tmp_path), "eager", timeout=90)
    results = _results(tmp_path)
    _check_run(results)
    assert results[0]["compiled"] == "OptimizedModule"


def _run_save_load(rank, world_size, out):
    accelerator = _accelerator(rank, world_size)
    model, optimizer, loader, state = _setup(accelerator)
    _train(accelerator, model, optimizer, loader, state, epochs=1)
    saved = {"total": state.ledger.total_floats, "steps": state.step, "rungs": state.rungs()}
    checkpoint = os.path.join(out, "checkpoint")
    accelerator.save_state(checkpoint)
    _train(accelerator, model, optimizer, loader, state, epochs=1)  # moves the state on
    moved = state.step
    accelerator.load_state(checkpoint)
    loaded = {"total": state.ledger.total_floats, "steps": state.step, "rungs": state.rungs()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "saved": saved,
                "loaded": loaded,
                "moved": moved,
                "files": sorted(os.listdir(checkpoint)),
            },
            f,
        )


def test_save_state_writes_and_load_state_restores_each_ranks_accordion_state(tmp_path):
    run_processes(_run_save_load, 2, str(tmp_path), timeout=60)
    for r in _results(tmp_path):
        assert {"accordion-rank0.pt", "accordion-rank1.pt"} <= set(r["files"])
        assert r["moved"] > r["saved"]["steps"] > 0
        assert r["loaded"] == r["saved"]


def _exchange_record(exchange) -> dict:
    """The exchange's step counts and its error-feedback memories, as plain values."""
    memory = exchange.reducer.state_dict()["memory"]["memory"]
    return {"steps": exchange.steps, "frozen_at": exchange.frozen_at,
            "memory": [memory[key].tolist() for key in sorted(memory)]}  # fmt: skip


def _run_momentum_save_load(rank, world_size, out):
    """The transformers' recipe under Accelerate: 2-bit ``nq`` with the noise correction,
    then from step 3 the momenta at 1 bit through the hook; saved at step 8 (past the
    freeze), moved on one epoch, loaded back."""
    from accordion import AdamNoiseCorrection, MomentumExchange

    accelerator = _accelerator(rank, world_size)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    state = AccordionState(net, "nq", levels=(2, 2), interval=2, interval_unit="step")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    AdamNoiseCorrection(optimizer, state)
    exchange = MomentumExchange(optimizer, state, 3, 1, clip=1.0)
    data = TensorDataset(torch.randn(128, 16), torch.randint(0, 4, (128,)))
    model, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(data, batch_size=16))
    model = acc.register(accelerator, model, state)
    _train(accelerator, model, optimizer, loader, state, epochs=1)  # 4 steps a rank
    _train(accelerator, model, optimizer, loader, state, epochs=1)
    checkpoint = os.path.join(out, "checkpoint")
    accelerator.save_state(checkpoint)
    saved = _exchange_record(exchange)
    _train(accelerator, model, optimizer, loader, state, epochs=1)  # moves the exchange on
    moved = exchange.steps
    accelerator.load_state(checkpoint)
    loaded = _exchange_record(exchange)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"saved": saved, "loaded": loaded, "moved": moved,
                   "files": sorted(os.listdir(checkpoint))}, f)  # fmt: skip


def test_save_state_writes_and_load_state_restores_the_states_momentum_exchange(tmp_path):
    run_processes(_run_momentum_save_load, 2, str(tmp_path), timeout=60)
    for r in _results(tmp_path):
        assert {"accordion-momentum-rank0.pt", "accordion-momentum-rank1.pt"} <= set(r["files"])
        assert r["saved"]["frozen_at"] == 3 and r["moved"] > r["saved"]["steps"] == 8
        assert r["saved"]["memory"]  # the momenta's error feedback, past the freeze
        assert r["loaded"] == r["saved"]


@pytest.fixture
def single_accelerator(monkeypatch):
    """A one-process Accelerator in this process, its shared state reset afterwards."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


def test_one_process_returns_the_model_unchanged_with_a_warning(single_accelerator):
    net = nn.Linear(4, 4)
    state = AccordionState(net, "powersgd", levels=(2, 1), interval=2, interval_unit="step")
    model = single_accelerator.prepare(net)
    with pytest.warns(UserWarning, match="one process"):
        assert acc.register(single_accelerator, model, state) is model
    assert acc.end_step(single_accelerator, state) is None
    assert state.step == 0  # the state is not used


def test_bad_arguments_raise_type_errors_naming_them(single_accelerator):
    net = nn.Linear(4, 4)
    state = AccordionState(net, "powersgd", levels=(2, 1))
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        acc.register(object(), net, state)
    with pytest.raises(TypeError, match="state must be an accordion.ddp.AccordionState"):
        acc.register(single_accelerator, net, {"powersgd": 2})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        acc.register(single_accelerator, "net", state)
    with pytest.raises(TypeError, match="checkpoint must be a bool"):
        acc.register(single_accelerator, net, state, checkpoint="yes")
    with pytest.raises(TypeError, match="state must be"):
        acc.end_epoch(single_accelerator, None)


def _register_unprepared(rank, world_size, out):
    accelerator = _accelerator(rank, world_size)
    state = AccordionState(nn.Linear(4, 4), "powersgd", levels=(2, 1))
    try:
        acc.register(accelerator, nn.Linear(4, 4), state)
    except TypeError as exc:
        message = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"message": message}, f)


def test_register_refuses_a_model_that_accelerate_did_not_prepare(tmp_path):
    run_processes(_register_unprepared, 2, str(tmp_path), timeout=60)
    for r in _results(tmp_path):
        assert "what accelerator.prepare returned" in r["message"]


_LAUNCHED = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch.distributed as dist
import test_integration_accelerate as t
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)  # initialises gloo from torchrun's environment
model, optimizer, loader, state = t._setup(accelerator)
history = t._train(accelerator, model, optimizer, loader, state, epochs=1)
result = t._report(state, history, t._agreement(model, state))
with open(os.path.join(sys.argv[1], f"rank{{accelerator.process_index}}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # gloo may abort in static destructors at exit (see tests/distributed.py)
"""


def test_register_works_in_a_job_launched_by_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_LAUNCHED.format(tests=os.path.dirname(__file__))))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path),
    ]
    _run_in_a_session(command, tmp_path, timeout=90)
    results = _results(tmp_path)
    for r in results:
        assert 0 < r["total"] < r["dense"] and r["params_equal"] and r["rungs_equal"]
        assert r["steps"] == MICRO_BATCHES // 2  # one epoch, no accumulation
        assert max(max(h.values()) for h in r["history"] if h) >= 1
    assert results[0]["history"] == results[1]["history"]


def test_missing_accelerate_raises_an_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # makes `import accelerate` fail
    state = AccordionState(nn.Linear(4, 4), "powersgd", levels=(2, 1))
    with pytest.raises(ImportError, match=r"pip install torch-accordion\[integrations\]"):
        acc.register(object(), nn.Linear(4, 4), state)


CPU_SCRIPT = os.path.join(os.path.dirname(__file__), "accelerate_cpu_script.py")
RESULT = "ACCORDION_RESULT "  # the prefix of the script's per-process line
#: The flags of ``accelerate launch`` for 2 CPU processes (docs/integrations.md); the
#: defaults named explicitly keep Accelerate quiet, port 0 picks a free one.
CPU_LAUNCH = (
    "--multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
    "--dynamo_backend no --main_process_port 0".split()
)


def _launch_accelerate(args: list[str], cwd, timeout: float = 120) -> str:
    """Run ``accelerate launch *args`` in a session of its own (a hang kills its workers
    too), offline and with its own config folder; return its output."""
    executable = os.path.join(os.path.dirname(sys.executable), "accelerate")
    if not os.path.isfile(executable):
        pytest.skip(f"no accelerate command next to {sys.executable}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(cwd / "hf")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_CPU"):
        env.pop(name, None)  # set by the in-process tests above: the launcher sets its own
    return _run_in_a_session([executable, "launch", *args], cwd, env, timeout)


def _run_in_a_session(command: list[str], cwd, env=None, timeout: float = 120) -> str:
    """Run a launcher's ``command`` in a session of its own, so that a hang kills its
    workers too; assert it succeeded and return its output."""
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    launch = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True, **out)
    try:
        output, _ = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        raise
    assert launch.returncode == 0, output[-3000:]
    return output


def test_accelerate_launch_multi_gpu_with_a_cpu_accelerator_runs_two_compressing_processes(
    tmp_path,
):
    # the command docs/integrations.md gives for CPU: `--cpu --num_processes 2` starts one
    output = _launch_accelerate([*CPU_LAUNCH, CPU_SCRIPT], tmp_path)
    lines = [json.loads(m) for m in re.findall(RESULT + r"(\{[^}]*\})", output)]
    assert sorted(r["rank"] for r in lines) == [0, 1], output[-3000:]
    for r in lines:
        assert r["processes"] == 2
        assert r["steps"] == 4  # 128 samples / 2 ranks / batches of 16
        assert 0 < r["total_floats"] < r["dense_floats"]  # the hook ran, and compressed
