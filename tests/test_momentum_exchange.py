"""The momentum exchange: Adam's momentum averaged compressed with ``v`` frozen after a
step; the run it equals at a lossless level, its checks and state, gloo ranks, resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion import AccordionState, AdamNoiseCorrection, MomentumExchange
from accordion.accounting import wire_bytes
from distributed import run_processes

LR, BETAS, WD, EPS, CLIP = 1e-2, (0.9, 0.95), 0.1, 1e-8, 0.5


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)


def backward(net: nn.Module, step: int, rank: int = 0) -> None:
    x, y = batch(step, rank)
    nn.functional.mse_loss(net(x), y).backward()


def adamw(net: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)


def exchanged_run(steps: int, freeze_at: int, clip: float | None) -> nn.Module:
    """One worker with the exchange at the lossless ``dense`` level of ``mixed``."""
    net = make_net()
    state = AccordionState(net, "mixed", levels=("dense", "dense"), interval_unit="step")
    opt = adamw(net)
    exchange = MomentumExchange(opt, state, freeze_at, "dense", clip=clip)
    for step in range(steps):
        opt.zero_grad()
        backward(net, step)
        if exchange.active:
            exchange.reduce()
        else:
            state.reduce_gradients()
            if clip is not None:
                nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return net


def frozen_adamw_run(steps: int, freeze_at: int, clip: float | None) -> nn.Module:
    """AdamW written out, ``v`` held (bias-corrected) from step ``freeze_at`` on."""
    net = make_net()
    opt = adamw(net)
    held: dict[nn.Parameter, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad()
        backward(net, step)
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        if step < freeze_at:
            opt.step()
            continue
        with torch.no_grad():
            for p in net.parameters():
                s = opt.state[p]
                if p not in held:
                    held[p] = s["exp_avg_sq"] / (1 - BETAS[1] ** int(s["step"]))
                s["step"] += 1
                t = int(s["step"])
                s["exp_avg"].mul_(BETAS[0]).add_(p.grad, alpha=1 - BETAS[0])
                p.mul_(1 - LR * WD)
                p.sub_(LR / (1 - BETAS[0] ** t) * s["exp_avg"] / (held[p].sqrt() + EPS))
    return net


@pytest.mark.parametrize("clip", [None, CLIP])
def test_at_a_lossless_level_the_run_is_adamw_with_its_second_moment_frozen(clip):
    got = exchanged_run(10, 4, clip)
    want = frozen_adamw_run(10, 4, clip)
    for a, b in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    plain = exchanged_run(10, 100, clip)  # never frozen: the frozen moment must matter
    assert any(not torch.allclose(a, b) for a, b in zip(got.parameters(), plain.parameters()))


def test_after_the_freeze_the_second_moment_stays_held_and_the_correction_is_removed():
    net = make_net()
    state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
    opt = adamw(net)
    correction = AdamNoiseCorrection(opt, state)
    exchange = MomentumExchange(opt, state, 3, 1)
    for step in range(3):
        opt.zero_grad()
        backward(net, step)
        state.reduce_gradients()
        opt.step()
    assert exchange.active and correction._handles == []
    held = {p: correction.used(p, opt.state[p]["exp_avg_sq"]) / (1 - BETAS[1] ** 3)
            for p in net.parameters()}  # fmt: skip
    for step in range(3, 6):
        opt.zero_grad()
        backward(net, step)
        exchange.reduce()
        opt.step()
        for p in net.parameters():
            bias = 1 - BETAS[1] ** (step + 1)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], held[p] * bias)


def test_rows_never_looked_up_before_the_freeze_keep_a_zero_momentum_also_after_a_load():
    def lookups(exchange, opt, net, state, steps, rows):
        for _ in range(steps):
            opt.zero_grad()
            net(torch.tensor(rows)).square().sum().backward()
            exchange.reduce() if exchange.active else state.reduce_gradients()
            opt.step()

    def embedding():
        torch.manual_seed(0)
        net = nn.Embedding(6, 4)
        state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
        opt = adamw(net)
        return net, state, opt, MomentumExchange(opt, state, 3, 1)

    net, state, opt, exchange = embedding()
    lookups(exchange, opt, net, state, 3, [0, 1, 2])  # rows 3-5 unseen at the freeze
    lookups(exchange, opt, net, state, 2, [0, 1, 2, 3, 4, 5])
    m = opt.state[net.weight]["exp_avg"]
    assert m[3:].eq(0).all() and m[:3].ne(0).any()
    again, state2, opt2, resumed = embedding()
    again.load_state_dict(net.state_dict())
    opt2.load_state_dict(opt.state_dict())
    resumed.load_state_dict(exchange.state_dict())
    lookups(resumed, opt2, again, state2, 2, [0, 1, 2, 3, 4, 5])
    assert opt2.state[again.weight]["exp_avg"][3:].eq(0).all()


def one_worker_run(steps: int, freeze_at: int, lr=lambda step: LR, **kwargs) -> MomentumExchange:
    """One worker at 2 bits, then the momentum at 1 bit; ``kwargs`` go to the exchange."""
    net = make_net()
    state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
    opt = adamw(net)
    exchange = MomentumExchange(opt, state, freeze_at, 1, **kwargs)
    for step in range(steps):
        opt.param_groups[0]["lr"] = lr(step)
        opt.zero_grad()
        backward(net, step)
        exchange.reduce() if exchange.active else state.reduce_gradients()
        opt.step()
    return exchange


def test_the_norm_test_freezes_at_the_first_calm_window_before_freeze_at():
    calm = one_worker_run(12, 50, freeze_eta=1e9, window=3)  # every window with a ratio
    assert calm.frozen_at == 6 and calm.active  # the first window has none to compare
    never = one_worker_run(12, 10, freeze_eta=1e-12, window=3)
    assert never.frozen_at == 10
    plain = one_worker_run(12, 10)
    assert plain.frozen_at == 10


def test_a_window_whose_learning_rate_rose_is_never_calm():
    rising = one_worker_run(12, 10, lr=lambda step: LR * (step + 1), freeze_eta=1e9, window=3)
    assert rising.frozen_at == 10


def test_a_step_after_the_freeze_without_the_momenta_exchanged_raises():
    net = make_net()
    state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
    opt = adamw(net)
    exchange = MomentumExchange(opt, state, 1, 1)
    with pytest.raises(ValueError, match="reduce\\(\\) exchanges momenta from step freeze_at=1"):
        exchange.reduce()
    backward(net, 0)
    opt.step()
    opt.zero_grad()
    backward(net, 1)
    with pytest.raises(RuntimeError, match="needs the momenta exchanged: by the state's DDP hook"):
        opt.step()


def test_past_the_freeze_an_amp_grad_scalers_unscale_is_refused():
    net = make_net()
    state = AccordionState(net, "nq", levels=(2, 2), interval_unit="step")
    opt = adamw(net)
    exchange = MomentumExchange(opt, state, 1, 1, clip=CLIP)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(2):
        opt.zero_grad()
        x, y = batch(step)
        scaler.scale(nn.functional.mse_loss(net(x), y)).backward()
        if step == 0:
            state.reduce_gradients()
            scaler.step(opt)  # before the freeze the scaler works as without the exchange
            scaler.update()
    exchange.reduce()
    with pytest.raises(RuntimeError, match="GradScaler's unscale_ is such a scaling"):
        scaler.step(opt)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"freeze_at": 0}, ValueError, "freeze_at must be an int >= 1, got 0"),
    ({"freeze_at": True}, TypeError, "freeze_at must be an int >= 1, got True"),
    ({"freeze_at": 2.0}, TypeError, "freeze_at must be an int >= 1, got 2.0"),
    ({"level": 9}, ValueError, "level: .* got 9"),
    ({"level": "1"}, TypeError, "level: .* got '1'"),
    ({"clip": -1.0}, ValueError, "clip must be > 0 and finite, got -1.0"),
    ({"clip": math.inf}, ValueError, "clip must be > 0 and finite, got inf"),
    ({"clip": "1"}, TypeError, "clip must be a number, got '1'"),
    ({"window": 0}, ValueError, "window must be an int >= 1, got 0"),
    ({"loop_clip": 0.0}, ValueError, "loop_clip must be > 0 and finite, got 0.0"),
    ({"loop_clip": 1.0}, ValueError, "loop_clip=1.0 undoes the loop's clip .* give clip too"),
    ({"freeze_eta": 0.0}, ValueError, "freeze_eta must be > 0 and finite, got 0.0"),
    ({"state": "nq"}, TypeError, "state must be an accordion Controller"),
])  # fmt: skip
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    net = make_net()
    args = {"optimizer": adamw(net), "freeze_at": 2, "level": 1, "clip": None,
            "state": AccordionState(net, "nq", levels=(2, 2))}  # fmt: skip
    with pytest.raises(error, match=match):
        MomentumExchange(**{**args, **kwargs})


def test_it_refuses_sgd_a_second_exchange_and_a_correction_created_after_it():
    net = make_net()
    state = AccordionState(net, "nq", levels=(2, 2))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Adam or AdamW"):
        MomentumExchange(torch.optim.SGD(net.parameters(), lr=0.1), state, 2, 1)
    opt = adamw(net)
    MomentumExchange(opt, state, 2, 1)
    with pytest.raises(ValueError, match="has a MomentumExchange already"):
        MomentumExchange(opt, state, 2, 1)
    with pytest.raises(ValueError, match="create the AdamNoiseCorrection first"):
        AdamNoiseCorrection(opt, state)


def test_one_state_takes_one_exchange_until_it_is_removed():
    net = make_net()
    state = AccordionState(net, "nq", levels=(2, 2))
    exchange = MomentumExchange(adamw(net), state, 2, 1)
    assert state.momentum_exchange is exchange  # its hook hands the buckets on past the freeze
    with pytest.raises(ValueError, match="state has a MomentumExchange already"):
        MomentumExchange(adamw(net), state, 2, 1)
    exchange.remove()
    assert state.momentum_exchange is None
    assert MomentumExchange(adamw(net), state, 2, 1).state is state


def test_a_bad_state_dict_raises_and_changes_nothing():
    net = make_net()
    exchange = MomentumExchange(adamw(net), AccordionState(net, "nq", levels=(2, 2)), 2, 1)
    saved = exchange.state_dict()
    with pytest.raises(ValueError, match="frozen must be a list of 4 entries"):
        exchange.load_state_dict({**saved, "steps": 5, "frozen": [None]})
    with pytest.raises(ValueError, match=r"frozen\[0\] must be None or a tensor of shape"):
        exchange.load_state_dict({**saved, "steps": 5, "frozen": [torch.zeros(3)] + [None] * 3})
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        exchange.load_state_dict({**saved, "steps": -1})
    with pytest.raises(ValueError, match=r"frozen_at must be None or an int in \[1, steps=3\]"):
        exchange.load_state_dict({**saved, "steps": 3, "frozen_at": 4})
    with pytest.raises(ValueError, match="test must be a norm test's state exactly when"):
        exchange.load_state_dict({**saved, "test": {"sums": []}})
    assert exchange.steps == 0 and not exchange.active


# --- gloo ranks -------------------------------------------------------------------------------


def _steps(rank, net, ddp, state, opt, exchange, steps, start=0, record=None,
           hooked=False) -> None:  # fmt: skip
    """Steps ``start`` to ``steps``: DDP's averages before the freeze, the exchange after
    (by ``reduce()`` under ``no_sync()``, or ``hooked``: by the DDP hook, the loop as before
    the freeze but without the clip, or with it if the exchange has a ``loop_clip``)."""
    for step in range(start, steps):
        opt.zero_grad()
        before = state.ledger.total_bytes
        if exchange.active and hooked:
            backward(ddp, step, rank)
            if exchange.loop_clip is not None:  # a framework's clip, at every step
                nn.utils.clip_grad_norm_(ddp.parameters(), exchange.loop_clip)
        elif exchange.active:
            with ddp.no_sync():
                backward(ddp, step, rank)
            if record is not None and step == steps - 1:  # the rank's own momentum, c = 1
                record["local"] = [BETAS[0] * opt.state[p]["exp_avg"] + (1 - BETAS[0]) * p.grad
                                   for p in net.parameters()]  # fmt: skip
            exchange.reduce()
        else:
            backward(ddp, step, rank)
            if exchange.clip is not None:
                nn.utils.clip_grad_norm_(ddp.parameters(), exchange.clip)
        opt.step()
        state.end_step()
        if record is not None:
            record.setdefault("sent", []).append(state.ledger.total_bytes - before)


def _build(level, levels, compressor, clip, freeze_at=3, **kwargs):
    net = make_net()
    state = AccordionState(net, compressor, levels=levels, interval_unit="step")
    ddp = state.register(DDP(net))
    opt = adamw(net)
    correction = AdamNoiseCorrection(opt, state) if compressor == "nq" else None
    exchange = MomentumExchange(opt, state, freeze_at, level, clip=clip, **kwargs)
    return net, ddp, state, opt, correction, exchange


def _gloo_job(rank: int, world_size: int, out: str) -> None:
    result = {}
    net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP)
    sent: dict = {}
    _steps(rank, net, ddp, state, opt, exchange, 8, record=sent)
    result["straight"] = [p.detach().clone() for p in net.parameters()]
    result["sent"] = sent["sent"]
    result["clipped"] = exchange.clipped_steps
    net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP)
    sent = {}
    _steps(rank, net, ddp, state, opt, exchange, 8, record=sent, hooked=True)
    result["hooked"] = [p.detach().clone() for p in net.parameters()]
    result["hooked_sent"], result["hooked_clipped"] = sent["sent"], exchange.clipped_steps
    result["misuse"] = _misuse(rank, net, ddp, state, opt, exchange)
    net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP, loop_clip=CLIP)
    _steps(rank, net, ddp, state, opt, exchange, 8, hooked=True)
    result["loop_clipped"] = [p.detach().clone() for p in net.parameters()]
    result["undone"] = exchange.undone_clips
    opt.zero_grad()
    backward(ddp, 9, rank)
    nn.utils.clip_grad_norm_(ddp.parameters(), CLIP / 2)  # not the loop_clip given
    try:
        opt.step()
    except RuntimeError as error:
        result["misuse"].append(str(error))
    # resumed: 5 steps, the state saved, new objects loaded, 3 more steps
    net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP)
    _steps(rank, net, ddp, state, opt, exchange, 5)
    saved = [s.state_dict() for s in (net, opt, state, correction, exchange)]
    net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP)
    for part, s in zip((net, opt, state, correction, exchange), saved):
        part.load_state_dict(s)
    _steps(rank, net, ddp, state, opt, exchange, 8, start=5)
    result["resumed"] = [p.detach().clone() for p in net.parameters()]
    # the norm test's freeze (at step 4), straight and resumed inside its second window
    eta = dict(freeze_at=50, freeze_eta=1e9, window=2)
    for stop in (8, 3):
        net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP, **eta)
        _steps(rank, net, ddp, state, opt, exchange, stop)
        if stop == 3:
            saved = [s.state_dict() for s in (net, opt, state, correction, exchange)]
            net, ddp, state, opt, correction, exchange = _build(1, (2, 2), "nq", CLIP, **eta)
            for part, s in zip((net, opt, state, correction, exchange), saved):
                part.load_state_dict(s)
            _steps(rank, net, ddp, state, opt, exchange, 8, start=3)
        result[f"eta{stop}"] = ([p.detach().clone() for p in net.parameters()],
                                exchange.frozen_at)  # fmt: skip
    # lossless: the momentum after a step is the ranks' mean momentum
    net, ddp, state, opt, _, exchange = _build("dense", ("dense", "dense"), "mixed", None)
    record: dict = {}
    _steps(rank, net, ddp, state, opt, exchange, 5, record=record)
    result["local"] = record["local"]
    result["momentum"] = [opt.state[p]["exp_avg"].clone() for p in net.parameters()]
    torch.save(result, f"{out}/rank{rank}.pt")
    assert dist.get_world_size() == world_size


def _misuse(rank, net, ddp, state, opt, exchange) -> list[str]:
    """The errors of a loop that clips after the hook's exchange, and of ``reduce()``
    called after it (the hook has exchanged already)."""
    errors = []
    for misuse in ("clip", "reduce"):
        opt.zero_grad()
        backward(ddp, 9, rank)
        try:
            if misuse == "clip":
                nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)  # binds: the norms are larger
            else:
                exchange.reduce()
            opt.step()
        except RuntimeError as error:
            errors.append(str(error))
        exchange._sent = None  # the refused step's exchange, so the next misuse is its own
    return errors


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("momentum")
    run_processes(_gloo_job, 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_gloo_ranks_stay_bitwise_identical_through_the_freeze(gloo_runs):
    for a, b in zip(gloo_runs[0]["straight"], gloo_runs[1]["straight"]):
        assert torch.equal(a, b)
    assert gloo_runs[0]["clipped"] == gloo_runs[1]["clipped"]


def test_past_the_freeze_the_ddp_hook_exchanges_the_momenta_as_reduce_does(gloo_runs):
    for rank in (0, 1):
        run = gloo_runs[rank]
        for a, b in zip(run["straight"], run["hooked"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert run["hooked_sent"] == run["sent"]  # 1-bit momenta from step 3, not 2-bit grads
        assert run["hooked_clipped"] == run["clipped"] > 0  # the hook clipped, over the model
    for a, b in zip(gloo_runs[0]["hooked"], gloo_runs[1]["hooked"]):
        assert torch.equal(a, b)


def test_a_loop_that_clips_after_the_hooks_exchange_or_reduces_again_is_refused(gloo_runs):
    clipped, reduced, otherwise = gloo_runs[0]["misuse"]
    assert "must not clip or scale them" in clipped and "give its norm as loop_clip" in clipped
    assert "exchanged already" in reduced
    assert "must not clip or scale them" in otherwise  # a clip to another norm than loop_clip


def test_with_loop_clip_the_loops_clip_after_the_freeze_is_undone(gloo_runs):
    for rank in (0, 1):
        run = gloo_runs[rank]
        for a, b in zip(run["straight"], run["loop_clipped"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert run["undone"] > 0  # the loop's clip bound after the freeze, and was undone


def test_a_resumed_run_continues_bitwise(gloo_runs):
    for a, b in zip(gloo_runs[0]["straight"], gloo_runs[0]["resumed"]):
        assert torch.equal(a, b)


def test_the_momenta_are_counted_in_the_states_ledger_at_the_exchanges_level(gloo_runs):
    sent = gloo_runs[0]["sent"]  # bytes per step: 3 at 2 bits, then 5 at 1 bit
    assert len(set(sent[:3])) == 1 and len(set(sent[3:])) == 1
    shapes = [tuple(p.shape) for p in make_net().parameters()]
    for step, bits in ((0, 2), (3, 1)):
        assert sent[step] == sum(wire_bytes(shape, "nq", bits, 2, 4) for shape in shapes)


def test_a_run_resumed_before_the_norm_tests_freeze_continues_bitwise(gloo_runs):
    (straight, at), (resumed, resumed_at) = gloo_runs[0]["eta8"], gloo_runs[0]["eta3"]
    assert at == resumed_at == 4
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_at_a_lossless_level_the_momentum_is_the_ranks_mean_momentum(gloo_runs):
    for i, m in enumerate(gloo_runs[0]["momentum"]):
        mean = (gloo_runs[0]["local"][i] + gloo_runs[1]["local"][i]) / 2
        torch.testing.assert_close(m, mean, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(gloo_runs[0]["local"][0], gloo_runs[1]["local"][0])


# --- the harness ----------------------------------------------------------------------------


def test_the_momentum_suffix_parses_on_static_strategies_only():
    from accordion.harness.strategies import parse_strategy

    strategy = parse_strategy("static:nq:2:adam-noise:momentum=22/1")
    assert (strategy.momentum_freeze, strategy.momentum_level) == (22, 1)
    assert parse_strategy("static:nq:2").momentum_freeze is None
    assert parse_strategy("static:nq:2:momentum=22/1/0.5").momentum_eta == 0.5
    assert strategy.momentum_eta is None
    for text, match in (("accordion:nq:2,1:momentum=22/1", "needs a static strategy"),
                        ("diloco:10+static:nq:2:momentum=22/1", "without :auto, :adam-noise"),
                        ("batch:32,64+static:nq:2:momentum=22/1", "does not combine with a batch"),
                        ("static:nq:2:momentum=0/1", "is not a suffix"),
                        ("static:nq:2:momentum=100/1", "is not a suffix"),
                        ("static:nq:2:momentum=22", "is not a suffix"),
                        ("static:nq:2:momentum=22/1/0", "is not a suffix"),
                        ("static:nq:2:momentum=22/1/x", "is not a suffix"),
                        ("static:nq:2:momentum=22/1/0.5/2", "is not a suffix"),
                        ("static:nq:2:momentum=22/9", "9")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_strategy(text)


TINY_LM = dict(task="charlm", model="transformer-tiny", train_samples=128, test_samples=32,
               batch_size=32, bptt=32, optimizer="adamw", lr=3e-3, clip=1.0, threads=1,
               progress=False, schedule="step", decay_epochs=())  # fmt: skip


def _harness_runs(rank, world, local_rank, configs):
    from accordion.harness.train import run_many

    return [result.as_dict() for result in run_many(configs, rank, world, local_rank)]


def test_a_harness_run_exchanges_the_momentum_from_its_freeze_on_and_resumes(tmp_path):
    from accordion.harness.launch import run_distributed
    from accordion.harness.train import TrainConfig

    common = dict(TINY_LM, strategy="static:nq:2:momentum=50/1")
    saved = dict(common, checkpoint_dir=str(tmp_path / "ckpt"))
    configs = [TrainConfig(**TINY_LM, epochs=2, strategy="static:nq:2"),
               TrainConfig(**common, epochs=2), TrainConfig(**saved, epochs=1)]  # fmt: skip
    static, exchanged, first = run_distributed(_harness_runs, 2, configs)
    # the freeze (step 2 of 4) and the exchange's memory come back from the checkpoint
    (resumed,) = run_distributed(_harness_runs, 2, [TrainConfig(**saved, epochs=2)])
    sent = [[e["bytes"] for e in run["epochs"]] for run in (static, exchanged, resumed)]
    assert sent[0][0] == sent[1][0]  # the first half at 2 bits, as the static run
    one_bit = sent[1][1] - sent[1][0]  # the second half's 4 steps at 1 bit
    assert one_bit < 0.7 * (sent[0][1] - sent[0][0])
    assert resumed["epochs"][0] == first["epochs"][0]
    assert sent[2][1] - sent[2][0] == one_bit  # past the freeze on resume: 1 bit at once
    assert math.isfinite(resumed["epochs"][1]["val_loss"])
    assert static["momentum"] is None  # the record names the freeze's step: 50% of 8
    assert exchanged["momentum"]["frozen_at"] == 4 and exchanged["momentum"]["steps"] == 8
    assert 0 <= exchanged["momentum"]["clipped_steps"] <= 4  # of the 4 steps after it
    assert resumed["momentum"]["frozen_at"] == 2  # the 1-epoch run's, from its checkpoint


def test_the_harness_refuses_the_momentum_exchange_without_adamw():
    from accordion.harness.build import _exchange_momentum
    from accordion.harness.strategies import parse_strategy
    from accordion.harness.train import TrainConfig

    net = nn.Linear(4, 2)
    text = "static:nq:2:momentum=22/1"
    config = TrainConfig(strategy=text, optimizer="sgd")
    with pytest.raises(ValueError, match="needs --optimizer adamw, got 'sgd'"):
        _exchange_momentum(config, parse_strategy(text), torch.optim.SGD(net.parameters(), lr=0.1),
                           AccordionState(net, "nq", levels=(2, 2)), 10)  # fmt: skip


def test_the_harness_freezes_at_p_percent_and_runs_the_norm_test_over_its_interval():
    from accordion.harness.build import _exchange_momentum
    from accordion.harness.strategies import parse_strategy
    from accordion.harness.train import TrainConfig

    net = make_net()
    text = "static:nq:2:momentum=22/1/0.5"
    config = TrainConfig(strategy=text, optimizer="adamw", epochs=2, interval_unit="step",
                         interval=25)  # fmt: skip
    exchange = _exchange_momentum(config, parse_strategy(text), adamw(net),
                                  AccordionState(net, "nq", levels=(2, 2)), 448)  # fmt: skip
    assert exchange.freeze_at == 197 and exchange.level == 1
    assert exchange._test is not None
    assert (exchange._test.eta, exchange._test.window) == (0.5, 25)
