"""Adam's noise correction: the quantisers' residual variances, the reducer's noise of an
average, the corrected second moment, its checks and state, gloo ranks, the harness."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion import AccordionState, AdamNoiseCorrection
from accordion.adam_noise import noise_of
from accordion.compress import (
    ErrorFeedback,
    IntQuantizer,
    Mixed,
    NormalQuantizer,
    Reducer,
    SimulatedTransport,
    make_compressor,
)
from accordion.compress.normalquant import MSE
from distributed import run_processes

SHAPE = (16, 128)


def gaussian(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def noise(reducer: Reducer):
    """The reducer's noise variance of the key ``"w"``."""
    feedback = isinstance(reducer.memory, ErrorFeedback)
    return reducer.noise.variance("w", reducer.compressor, feedback)


def exchange(reducers, grads) -> None:
    """One exchange of simulated workers' reducers; ``grads`` become the averages."""
    world = SimulatedTransport(len(reducers))
    world.run([r.exchange(["w"], [g], len(reducers)) for r, g in zip(reducers, grads)])


# --- the residual variance of the quantisers ----------------------------------------------


@pytest.mark.parametrize("cls,bits,factor", [(NormalQuantizer, 2, MSE[2]),
                                             (IntQuantizer, 4, 1 / 12)])  # fmt: skip
def test_the_residual_variance_is_the_error_factor_times_each_workers_scale_squared(
    cls, bits, factor
):
    compressors = [cls(bits) for _ in range(2)]
    inputs = [gaussian(w) for w in range(2)]
    world = SimulatedTransport(2)
    world.run([c.exchange(["w"], [x.clone()], 2) for c, x in zip(compressors, inputs)])
    scales = [c.encode(x.clone(), bits)[1].float() for c, x in zip(compressors, inputs)]
    per_block = factor * (scales[0] ** 2 + scales[1] ** 2)
    expected = per_block.view(16, 2, 1).expand(16, 2, 64).reshape(SHAPE)
    for c in compressors:  # every rank the same, from the gathered scales
        torch.testing.assert_close(c.residual_variance("w"), expected)
    assert compressors[0].residual_variance("w", previous=True) is None
    assert compressors[0].residual_variance("other") is None


# at 1 bit successive residuals correlate and the model over-predicts (measured/predicted
# 0.62 on Gaussian gradients): the floor bounds what that over-correction can do
@pytest.mark.parametrize("name,bits", [("nq", 3), ("nq", 2), ("int", 4)])
def test_the_predicted_noise_of_an_error_fed_average_is_the_measured_one(name, bits):
    reducers = [Reducer(make_compressor(name, bits), ErrorFeedback()) for _ in range(2)]
    for r in reducers:
        r.noise.on = True
    measured = predicted = 0.0
    for step in range(40):
        local = [gaussian(100 * step + w) for w in range(2)]
        true = (local[0] + local[1]) / 2
        grads = [x.clone() for x in local]
        exchange(reducers, grads)
        if step >= 5:  # past the first steps, when the memory fills
            measured += float((grads[0] - true).square().mean())
            predicted += float(noise(reducers[0]).mean())
    assert 0.75 < measured / predicted < 1.33


@pytest.mark.parametrize("feedback", [True, False])
def test_the_noise_is_this_exchanges_residuals_and_with_error_feedback_the_last_ones(feedback):
    from accordion.compress import NoMemory

    memory = ErrorFeedback if feedback else NoMemory
    reducers = [Reducer(NormalQuantizer(2), memory()) for _ in range(2)]
    for r in reducers:
        r.noise.on = True
    for step in range(2):
        exchange(reducers, [gaussian(10 * step + w) for w in range(2)])
    c = reducers[0].compressor
    expected = c.residual_variance("w")
    if feedback:
        expected = expected + c.residual_variance("w", previous=True)
    torch.testing.assert_close(noise(reducers[0]), expected / 4)


def test_noise_is_unknown_for_powersgd_for_dense_keys_and_when_not_tracked():
    powersgd = [Reducer(make_compressor("powersgd", 2)) for _ in range(2)]
    for r in powersgd:
        r.noise.on = True
    exchange(powersgd, [gaussian(w) for w in range(2)])
    assert noise(powersgd[0]) is None
    assert powersgd[0].noise.square("w") is not None
    dense_key = [Reducer(NormalQuantizer(2)) for _ in range(2)]
    for r in dense_key:
        r.noise.on = True
        r.set_dense(["w"])
    exchange(dense_key, [gaussian(w) for w in range(2)])
    assert noise(dense_key[0]) is None
    untracked = [Reducer(NormalQuantizer(2)) for _ in range(2)]
    exchange(untracked, [gaussian(w) for w in range(2)])
    assert noise(untracked[0]) is None


def test_a_mixed_ladder_reports_the_part_that_sent_now_and_the_one_that_sent_before():
    ladders = [Mixed("int/4") for _ in range(2)]
    reducers = [Reducer(m) for m in ladders]
    for r in reducers:
        r.noise.on = True
    exchange(reducers, [gaussian(w) for w in range(2)])
    for m in ladders:
        m.set_level("nq/2")
    exchange(reducers, [gaussian(5 + w) for w in range(2)])
    mixed = ladders[0]
    torch.testing.assert_close(mixed.residual_variance("w"),
                               mixed.part("nq").residual_variance("w"))  # fmt: skip
    torch.testing.assert_close(mixed.residual_variance("w", previous=True),
                               mixed.part("int").residual_variance("w"))  # fmt: skip


# --- the correction, in one process -------------------------------------------------------


def fixed_grads(step: int) -> list[torch.Tensor]:
    return [gaussian(1000 + step, (8, 64)), gaussian(2000 + step, (8,))]


def run_steps(compressor: str, level, correct: bool, steps: int = 3, clip: float | None = None,
              closure: bool = False):  # fmt: skip
    """A one-layer model stepped by AdamW on fixed raw gradients averaged by the state;
    with ``closure``, set and averaged inside the closure given to ``opt.step`` (as
    Lightning's automatic optimization does)."""
    torch.manual_seed(0)
    net = nn.Linear(64, 8)
    state = AccordionState(net, compressor, levels=(level, level), interval_unit="step")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    fix = AdamNoiseCorrection(opt, state) if correct else None
    for step in range(steps):
        def gradients(step=step):
            for p, g in zip(net.parameters(), fixed_grads(step)):
                p.grad = g.clone()
            state.reduce_gradients()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)

        if closure:
            opt.step(gradients)
        else:
            gradients()
            opt.step()
    return net, opt, state, fix


def test_a_step_given_a_closure_is_corrected_after_the_closure_ran():
    net, _, _, fix = run_steps("nq", 2, correct=True, clip=1.0)
    closed, _, _, closed_fix = run_steps("nq", 2, correct=True, clip=1.0, closure=True)
    for a, b in zip(net.parameters(), closed.parameters()):
        assert torch.equal(a, b)  # the same code on the same machine, in the same order
    assert closed_fix.corrected_steps == fix.corrected_steps > 0


def test_without_a_compressed_tensor_the_optimizer_steps_exactly_as_plain_adamw():
    plain, _, _, _ = run_steps("half", "bf16", correct=False)
    corrected, _, _, fix = run_steps("half", "bf16", correct=True)
    for a, b in zip(plain.parameters(), corrected.parameters()):
        assert torch.equal(a, b)  # the same code on the same machine
    assert fix.corrected_steps == 0


def test_the_step_uses_v_less_the_noise_average_floored_and_keeps_adams_own_v():
    plain, plain_opt, _, _ = run_steps("nq", 2, correct=False, steps=2)
    net, opt, state, fix = run_steps("nq", 2, correct=True, steps=2)
    weight = net.weight
    assert fix.corrected_steps == 1  # Adam's first step creates v: nothing to correct then
    # Adam's own v is the plain moving average: the same raw gradients, the same averages
    torch.testing.assert_close(opt.state[weight]["exp_avg_sq"],
                               plain_opt.state[plain.weight]["exp_avg_sq"])  # fmt: skip
    # the second step, by hand, from the first step's parameters
    first, _, _, _ = run_steps("nq", 2, correct=False, steps=1)
    g = weight.grad
    v = opt.state[weight]["exp_avg_sq"]
    s = fix._noise[weight]
    m = opt.state[weight]["exp_avg"]
    used = torch.maximum(v - s, 0.25 * v)
    update = (m / (1 - 0.9**2)) / ((used / (1 - 0.95**2)).sqrt() + 1e-8)
    expected = first.weight.detach() * (1 - 1e-2 * 0.1) - 1e-2 * update
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-5, atol=1e-7)
    assert g is not None and not torch.allclose(weight, plain.weight)  # it changed the step


def test_a_step_without_an_exchange_since_the_last_is_not_corrected():
    net, opt, state, fix = run_steps("nq", 2, correct=True, steps=2)
    assert fix.corrected_steps == 1
    for p, g in zip(net.parameters(), fixed_grads(5)):
        p.grad = g.clone()  # no reduce_gradients: no exchange, no noise to correct for
    opt.step()
    assert fix.corrected_steps == 1
    assert noise_of(state, net.weight) == (None, None)


def test_clipping_after_the_average_scales_the_noise_by_the_clip_factor_squared():
    torch.manual_seed(0)
    net = nn.Linear(64, 8)
    state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95))
    fix = AdamNoiseCorrection(opt, state)
    for p, g in zip(net.parameters(), fixed_grads(0)):
        p.grad = g.clone()
    state.reduce_gradients()
    noise = [noise_of(state, p) for p in net.parameters()]
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    clipped = sum(float(p.grad.square().sum()) for p in net.parameters())
    factor = clipped / sum(float(square) for _, square in noise)
    assert factor < 0.1  # the clip really scaled the gradients down
    opt.step()
    for p, (variance, _) in zip(net.parameters(), noise):
        torch.testing.assert_close(fix._noise[p], 0.05 * variance * factor)


def test_only_adam_and_adamw_without_amsgrad_or_l2_decay_are_accepted():
    net = nn.Linear(4, 2)
    state = AccordionState(net, "nq", levels=(2, 2))
    with pytest.raises(TypeError, match="torch.optim.Adam or AdamW, got SGD"):
        AdamNoiseCorrection(torch.optim.SGD(net.parameters(), lr=0.1), state)
    with pytest.raises(ValueError, match="amsgrad=True"):
        AdamNoiseCorrection(torch.optim.AdamW(net.parameters(), amsgrad=True), state)
    with pytest.raises(ValueError, match="weight_decay=0.1 to the gradient"):
        AdamNoiseCorrection(torch.optim.Adam(net.parameters(), weight_decay=0.1), state)
    with pytest.raises(TypeError, match="state must be an accordion Controller"):
        AdamNoiseCorrection(torch.optim.AdamW(net.parameters()), object())
    for floor in (0, 1.5, True, float("nan")):
        with pytest.raises(ValueError, match="floor must be a number in"):
            AdamNoiseCorrection(torch.optim.AdamW(net.parameters()), state, floor=floor)
    AdamNoiseCorrection(torch.optim.Adam(net.parameters()), state)  # no decay: fine


def test_a_state_dict_round_trips_and_a_wrong_one_is_refused_unchanged():
    net, opt, state, fix = run_steps("nq", 2, correct=True, steps=2)
    saved = fix.state_dict()
    with pytest.raises(ValueError, match="has an AdamNoiseCorrection already"):
        AdamNoiseCorrection(opt, state)  # a second would subtract the noise twice
    fix.remove()
    fresh = AdamNoiseCorrection(opt, state)
    fresh.load_state_dict(saved)
    for a, b in zip(fresh.state_dict()["noise"], saved["noise"]):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match="noise must be a list of 2 entries"):
        fresh.load_state_dict({"noise": [None]})
    with pytest.raises(ValueError, match=r"noise\[0\] must be None or a tensor of shape"):
        fresh.load_state_dict({"noise": [torch.zeros(3), None]})
    assert torch.equal(fresh.state_dict()["noise"][0], saved["noise"][0])


# --- gloo ranks -------------------------------------------------------------------------------


def _train_ranks(rank: int, world_size: int, correct: bool, out: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
    ddp = state.register(DDP(net))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    fix = AdamNoiseCorrection(opt, state) if correct else None
    for step in range(6):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        opt.step()
    steps = 0 if fix is None else fix.corrected_steps
    torch.save({"params": [p.detach() for p in net.parameters()], "corrected": steps},
               f"{out}/rank{rank}-{correct}.pt")  # fmt: skip
    assert dist.get_world_size() == world_size


def test_gloo_ranks_stay_identical_under_the_correction_and_it_changes_the_steps(tmp_path):
    for correct in (True, False):
        run_processes(_train_ranks, 2, correct, str(tmp_path))
    runs = {(r, c): torch.load(tmp_path / f"rank{r}-{c}.pt", weights_only=True)
            for r in range(2) for c in (True, False)}  # fmt: skip
    for a, b in zip(runs[0, True]["params"], runs[1, True]["params"]):
        assert torch.equal(a, b)
    assert runs[0, True]["corrected"] == 5  # every step but Adam's first
    assert any(not torch.equal(a, b) for a, b in
               zip(runs[0, True]["params"], runs[0, False]["params"]))  # fmt: skip


# --- the harness ----------------------------------------------------------------------------


def test_the_adam_noise_suffix_parses_on_static_and_accordion_strategies_not_on_diloco():
    from accordion.harness.strategies import parse_strategy

    assert parse_strategy("static:nq:2:adam-noise").adam_noise
    assert parse_strategy("accordion:mixed:nq/2,nq/1:adam-noise").adam_noise
    assert not parse_strategy("static:nq:2").adam_noise
    with pytest.raises(ValueError, match="without :auto, :adam-noise"):
        parse_strategy("diloco:10+static:nq:2:adam-noise")
    with pytest.raises(ValueError, match="repeats a suffix"):
        parse_strategy("static:nq:2:adam-noise:adam-noise")


def _harness_runs(rank, world, local_rank, configs):
    from accordion.harness.train import run_many

    return [result.as_dict() for result in run_many(configs, rank, world, local_rank)]


def test_a_harness_run_with_adam_noise_trains_otherwise_than_without():
    from accordion.harness.launch import run_distributed
    from accordion.harness.train import TrainConfig

    tiny = dict(task="charlm", model="transformer-tiny", train_samples=128, test_samples=32,
                epochs=1, batch_size=32, bptt=32, optimizer="adamw", lr=3e-3, clip=1.0,
                threads=1, progress=False)  # fmt: skip
    configs = [TrainConfig(**tiny, strategy=s) for s in ("static:nq:2", "static:nq:2:adam-noise")]
    plain, corrected = run_distributed(_harness_runs, 2, configs)
    assert plain["epochs"][0]["bytes"] == corrected["epochs"][0]["bytes"]
    assert plain["epochs"][0]["train_loss"] != corrected["epochs"][0]["train_loss"]


def test_the_harness_refuses_adam_noise_without_adamw():
    from accordion.harness.build import _correct_adam
    from accordion.harness.train import TrainConfig

    net = nn.Linear(4, 2)
    state = AccordionState(net, "nq", levels=(2, 2))
    sgd = TrainConfig(strategy="static:nq:2:adam-noise", optimizer="sgd")
    with pytest.raises(ValueError, match="needs --optimizer adamw, got 'sgd'"):
        _correct_adam(sgd, torch.optim.SGD(net.parameters(), lr=0.1), state)
