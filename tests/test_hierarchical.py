"""The hierarchical two-phase exchange, for workers that share hosts: a full-precision
average inside each host, two compressed phases across hosts, a compressed all-gather
inside the host. On simulated workers: its arithmetic, its bytes inside and across hosts,
its error feedback (the shard and the server errors), the integer quantiser's choice of
it and its checkpoint; on real gloo processes: the transport's host and peers groups and
``AccordionState(workers_per_host=...)`` under DDP; and the arguments' validation."""

from __future__ import annotations

import functools
import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from accordion.compress import AllToAll, IntQuantizer, SimulatedTransport, TorchTransport
from accordion.compress.quantize import SCALE_BYTES, padded_numel
from accordion.compress.transport import workers_per_host
from accordion.compress.two_phase import (
    ChunkLayout,
    hierarchical_bytes,
    two_phase_bytes,
    two_phase_exchange,
)
from accordion.ddp import AccordionState, accordion_hook
from distributed import run_processes
from two_phase_parts import IdentityCodec, int8_bound

BLOCK = 64
#: (workers, workers a host): two hosts or more, every host alike.
HOSTS = [(4, 2), (8, 2), (8, 4), (6, 3)]
SIZES = [0, 1, 17, 4099, 65539]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread, as each gloo worker has: the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def worker_inputs(world_size: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    """Per worker, ``numel`` random values of a scale of its own."""
    gen = torch.Generator().manual_seed(seed + numel)
    return [(w + 1) * torch.randn(numel, generator=gen) for w in range(world_size)]


def true_mean(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(inputs).double().mean(0)


def hierarchical(codec, inputs, bits, local_size, server_errors=None, shard_errors=None):
    """One hierarchical two-phase exchange of ``len(inputs)`` simulated workers,
    ``local_size`` a host, on copies of ``inputs``: the results, the inputs after it and
    the transport."""
    world_size = len(inputs)
    world = SimulatedTransport(world_size, local_size)
    copies = [x.clone() for x in inputs]
    servers = server_errors or [None] * world_size
    shards = shard_errors or [None] * world_size
    results = world.run([two_phase_exchange(codec, [x], bits, world_size, s, local_size=local_size,
                                            shard_error=e)
                         for x, s, e in zip(copies, servers, shards)])  # fmt: skip
    return results, copies, world


def host_ids(params):
    return [f"W{w}xL{n}" for w, n in params]


# --- the arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world_size,local_size", HOSTS, ids=host_ids(HOSTS))
def test_a_lossless_hierarchical_exchange_gives_the_true_mean(world_size, local_size, numel):
    inputs = worker_inputs(world_size, numel)
    results, _, _ = hierarchical(IdentityCodec, inputs, 32, local_size)
    mean = true_mean(inputs)
    scale = torch.stack(inputs).abs().amax().item() if numel else 0.0
    for result in results:
        assert result.average.shape == (numel,)
        # fp32 rounding only: the host's sum, then the hosts' sum, each of a few terms
        torch.testing.assert_close(result.average.double(), mean, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world_size,local_size", HOSTS, ids=host_ids(HOSTS))
def test_every_simulated_worker_gets_bitwise_the_same_hierarchical_int8_average(
    world_size, local_size, numel
):
    results, _, _ = hierarchical(IntQuantizer, worker_inputs(world_size, numel), 8, local_size)
    assert all(torch.equal(r.average, results[0].average) for r in results)


@pytest.mark.parametrize("numel", [n for n in SIZES if n])
@pytest.mark.parametrize("world_size,local_size", HOSTS, ids=host_ids(HOSTS))
def test_a_hierarchical_int8_average_is_within_half_a_step_of_each_phase_of_the_true_mean(
    world_size, local_size, numel
):
    """The host's full-precision average has no larger block than its workers' largest, so
    the bound of the flat exchange (half a step of each quantisation, from the workers'
    largest magnitude of the block, :func:`int8_bound`) holds too."""
    inputs = worker_inputs(world_size, numel)
    results, _, _ = hierarchical(IntQuantizer, inputs, 8, local_size)
    error = (results[0].average.double() - true_mean(inputs)).abs()
    bound = int8_bound(inputs).double()
    assert (error <= bound).all(), (error / bound).max()
    if numel > 1000:
        assert (error > bound / 20).any()  # the bound is not slack by orders of magnitude


@pytest.mark.parametrize("numel", [n for n in SIZES if n])
@pytest.mark.parametrize("world_size,local_size", HOSTS, ids=host_ids(HOSTS))
def test_the_inputs_become_zero_and_the_shard_keeps_the_worker_error_in_one_chunk_a_host(
    world_size, local_size, numel
):
    inputs = worker_inputs(world_size, numel)
    results, after, _ = hierarchical(IntQuantizer, inputs, 8, local_size)
    chunk = ChunkLayout(numel, world_size, BLOCK).chunk
    hosts = world_size // local_size
    assert all(x.shape == (numel,) and not x.any() for x in after)
    for result in results:
        assert result.shard_error is not None
        assert result.shard_error.shape == (hosts * chunk,)
        assert result.server_error.shape == (chunk,)
    assert any(r.shard_error.any() for r in results)  # int8 is lossy: the shards kept some


def test_no_elements_send_nothing_and_give_an_empty_average_and_no_shard_error():
    results, _, world = hierarchical(IntQuantizer, worker_inputs(4, 0), 8, 2)
    assert world.bytes_sent == 0
    assert all(r.average.shape == (0,) and r.shard_error is None for r in results)


# --- the bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [n for n in SIZES if n])
@pytest.mark.parametrize("world_size,local_size", HOSTS, ids=host_ids(HOSTS))
@pytest.mark.parametrize("bits", [8, 2])
def test_the_bytes_inside_and_across_hosts_are_hierarchical_bytes(
    world_size, local_size, numel, bits
):
    _, _, world = hierarchical(IntQuantizer, worker_inputs(world_size, numel), bits, local_size)
    inside, across = hierarchical_bytes(numel, bits, world_size, local_size, BLOCK, SCALE_BYTES)
    assert world.bytes_by_scope["host"] == pytest.approx(inside, rel=1e-12)
    assert world.bytes_by_scope["peers"] == pytest.approx(across, rel=1e-12)
    assert world.bytes_by_scope["world"] == 0
    assert world.bytes_sent == pytest.approx(inside + across, rel=1e-12)


def test_a_hosts_bytes_across_hosts_are_one_workers_flat_two_phase_bytes_among_the_hosts():
    """Each of a host's ``L`` workers sends its ``1 / L`` shard of the host's average
    through two compressed phases among the ``H`` hosts: the host as a whole sends what
    one worker holding the whole buffer sends in the flat two-phase exchange among ``H``
    workers, ``2 (H - 1) / H`` of the compressed buffer; so each worker sends ``1 / L`` of
    that across hosts (8 workers as 2 hosts x 4: a quarter of ``two_phase_bytes`` at 2
    workers), and ``(H - 1) / (W - 1)`` of what it sends in the flat exchange among all
    ``W`` (a seventh). Exact for a buffer of whole blocks a worker (no padding)."""
    world_size, local_size, bits = 8, 4, 8
    hosts = world_size // local_size
    numel = world_size * BLOCK * 128
    _, _, world = hierarchical(IntQuantizer, worker_inputs(world_size, numel), bits, local_size)
    across = world.bytes_by_scope["peers"]
    among_hosts = two_phase_bytes(numel, bits, hosts, BLOCK, SCALE_BYTES)
    assert local_size * across == pytest.approx(among_hosts, rel=1e-12)
    assert across == pytest.approx(among_hosts / 4, rel=1e-12)
    flat = two_phase_bytes(numel, bits, world_size, BLOCK, SCALE_BYTES)
    assert across == pytest.approx(flat * (hosts - 1) / (world_size - 1), rel=1e-12)


# --- error feedback: the shard error and the server error -------------------------------


@functools.cache  # each run is shared by the tests that read it
def time_averaged_errors(with_shard_error: bool, steps=(10, 50, 200)) -> dict:
    """Four simulated workers as two hosts of two, each with a constant gradient of its
    own, exchanged at 2 bits with the server errors and (optionally) the shard errors
    passed back: per number of steps, the largest error of the averages' time-average
    against the true mean."""
    world_size, local_size, numel = 4, 2, 256
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    mean = true_mean(grads)
    world = SimulatedTransport(world_size, local_size)
    servers, shards = [None] * world_size, [None] * world_size
    total = torch.zeros(numel, dtype=torch.float64)
    errors = {}
    for step in range(1, max(steps) + 1):
        inputs = [g.clone() for g in grads]  # the inputs are left 0: the shard keeps the error
        results = world.run([two_phase_exchange(IntQuantizer, [x], 2, world_size, s,
                                                local_size=local_size, shard_error=e)
                             for x, s, e in zip(inputs, servers, shards)])  # fmt: skip
        servers = [r.server_error for r in results]
        if with_shard_error:
            shards = [r.shard_error for r in results]
        total += results[0].average.double()
        if step in steps:
            errors[step] = (total / step - mean).abs().max().item()
    errors["scale"] = max(g.abs().max().item() for g in grads)
    return errors


def test_with_the_shard_and_server_errors_the_time_average_converges_to_the_true_mean():
    errors = time_averaged_errors(with_shard_error=True)
    # the sum telescopes: T times the time-average's error is the last shard errors' mean
    # and the last server error, each at most a couple of gradients' magnitude
    assert errors[200] <= 3 * errors["scale"] / 200
    assert errors[200] < errors[10] / 10
    assert errors[200] < errors[50] / 2


def test_without_the_shard_error_a_bias_remains_that_more_steps_do_not_remove():
    errors = time_averaged_errors(with_shard_error=False)
    assert errors[200] > 10 * time_averaged_errors(with_shard_error=True)[200]
    assert errors[200] > 0.8 * errors[50]  # 1/T would have shrunk it 4x


# --- the integer quantiser --------------------------------------------------------------

KEYS = ["a", "b"]
SHAPES = [(40, 50), (300,)]


def step_inputs(world_size: int, step: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + step)
    return [[(w + 1) * torch.randn(s, generator=gen) for s in SHAPES] for w in range(world_size)]


def quantizers(world_size: int, local_size: int, bits: int = 8) -> list[IntQuantizer]:
    made = [IntQuantizer(bits) for _ in range(world_size)]
    for q in made:
        q.set_local_size(local_size)
    return made


def quantizer_step(qs, world, step):
    """One exchange of ``qs`` on ``world`` of :func:`step_inputs`: each worker's averages."""
    inputs = step_inputs(len(qs), step)
    results = world.run([q.exchange(KEYS, ts, len(qs)) for q, ts in zip(qs, inputs)])
    return [[average for average, _ in r] for r in results]


def reloaded(states, world_size: int, local_size: int) -> list[IntQuantizer]:
    """Fresh quantisers, ``local_size`` a host, loading ``states`` through a file."""
    fresh = quantizers(world_size, local_size)
    for q, state in zip(fresh, states):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        q.load_state_dict(torch.load(buffer, weights_only=True))
    return fresh


def test_an_int_quantizer_with_two_workers_a_host_on_four_workers_starts_inside_the_host():
    q = quantizers(4, 2)[0]
    phase = next(q.exchange(KEYS, [torch.randn(s) for s in SHAPES], 4))
    assert [(type(op), op.scope) for op in phase] == [(AllToAll, "host")]


def test_an_int_quantizer_with_two_workers_a_host_on_four_workers_sends_inside_and_across():
    world = SimulatedTransport(4, 2)
    quantizer_step(quantizers(4, 2), world, 0)
    numel = sum(padded_numel(s) for s in SHAPES)  # each row in whole blocks
    inside, across = hierarchical_bytes(numel, 8, 4, 2, BLOCK, SCALE_BYTES)
    assert world.bytes_by_scope["host"] == pytest.approx(inside, rel=1e-12)
    assert world.bytes_by_scope["peers"] == pytest.approx(across, rel=1e-12)
    assert world.bytes_by_scope["world"] == 0


def test_an_int_quantizer_with_one_host_of_two_workers_exchanges_flat():
    world = SimulatedTransport(2, 2)
    averages = quantizer_step(quantizers(2, 2), world, 0)
    assert world.bytes_by_scope["peers"] == 0 and world.bytes_by_scope["host"] == 0
    assert world.bytes_by_scope["world"] > 0
    assert all(torch.equal(a, b) for a, b in zip(averages[0], averages[1]))


def test_an_int_quantizers_state_holds_its_shard_error_after_a_hierarchical_exchange():
    qs = quantizers(4, 2)
    assert qs[0].state_dict()["shard_error"] == []
    quantizer_step(qs, SimulatedTransport(4, 2), 0)
    numel = sum(padded_numel(s) for s in SHAPES)  # each row in whole blocks
    chunk = ChunkLayout(numel, 4, BLOCK).chunk
    for q in qs:
        (entry,) = q.state_dict()["shard_error"]
        assert entry["keys"] == KEYS and entry["numels"] == [padded_numel(s) for s in SHAPES]
        assert (entry["world_size"], entry["local_size"]) == (4, 2)
        assert entry["error"].shape == (2 * chunk,) and entry["error"].any()


def test_a_resumed_int_quantizer_continues_bitwise_as_the_one_it_was_saved_from():
    qs = quantizers(4, 2)
    quantizer_step(qs, SimulatedTransport(4, 2), 0)
    resumed = reloaded([q.state_dict() for q in qs], 4, 2)
    went_on = quantizer_step(qs, SimulatedTransport(4, 2), 1)
    came_back = quantizer_step(resumed, SimulatedTransport(4, 2), 1)
    for a, b in zip(went_on, came_back):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for q, r in zip(qs, resumed):
        assert torch.equal(q.state_dict()["shard_error"][0]["error"],
                           r.state_dict()["shard_error"][0]["error"])  # fmt: skip
    # the loaded errors mattered: a fresh start averages otherwise
    fresh = quantizer_step(quantizers(4, 2), SimulatedTransport(4, 2), 1)
    assert not all(torch.equal(x, y) for x, y in zip(fresh[0], went_on[0]))


def test_resuming_with_another_workers_a_host_drops_the_server_and_shard_errors_with_a_warning():
    qs = quantizers(8, 2)
    quantizer_step(qs, SimulatedTransport(8, 2), 0)
    resumed = reloaded([q.state_dict() for q in qs], 8, 4)
    with pytest.warns(RuntimeWarning, match=r"8 workers \(2 a host\), now 8 workers \(4 a host"):
        quantizer_step(resumed, SimulatedTransport(8, 4), 1)
    for q in resumed:
        state = q.state_dict()
        assert [e["local_size"] for e in state["server_error"]] == [4]
        assert [e["local_size"] for e in state["shard_error"]] == [4]


def test_resuming_flat_drops_the_server_and_shard_errors_with_a_warning():
    qs = quantizers(4, 2)
    quantizer_step(qs, SimulatedTransport(4, 2), 0)
    resumed = reloaded([q.state_dict() for q in qs], 4, 1)
    with pytest.warns(RuntimeWarning, match=r"4 workers \(2 a host\), now 4 workers \(1 a host"):
        quantizer_step(resumed, SimulatedTransport(4), 1)
    for q in resumed:
        state = q.state_dict()
        assert [e["local_size"] for e in state["server_error"]] == [1]
        assert state["shard_error"] == []  # a flat exchange keeps none, nor a stale one


# --- real gloo processes ----------------------------------------------------------------

GLOO_SIZES = [1, 17, 4099, 65539]
GLOO_CODECS = {"identity": (IdentityCodec, 32), "int8": (IntQuantizer, 8)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _gathered_equal(tensor: torch.Tensor) -> bool:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.contiguous())
    return all(torch.equal(t, tensor) for t in everyone)


def _section(saved: dict, name: str, work) -> None:
    """Run ``work(saved)``; a failure is saved as ``saved["errors"][name]`` (every rank
    fails alike at a collective's issue), so that each behaviour's test reports it."""
    try:
        work(saved)
    except Exception as exc:  # noqa: BLE001 - reported by the tests that read it
        saved["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:400]


def _exchanges(saved: dict) -> None:
    """Per size and codec, the hierarchical exchange through ``TorchTransport(local_size=2)``:
    whether every rank's average is bitwise this one's, the bytes per scope, and the
    lossless average beside ``all_reduce(sum) / W``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    transport = TorchTransport(local_size=2)
    for numel in GLOO_SIZES:
        for name, (codec, bits) in GLOO_CODECS.items():
            gen = torch.Generator().manual_seed(1000 * rank + numel)
            values = (rank + 1) * torch.randn(numel, generator=gen)
            before = dict(transport.bytes_by_scope)
            result = transport.run(two_phase_exchange(codec, [values.clone()], bits, world_size,
                                                      local_size=2))  # fmt: skip
            saved["by_scope"][name, numel] = {s: transport.bytes_by_scope[s] - before[s]
                                              for s in before}  # fmt: skip
            saved["same"][name, numel] = _gathered_equal(result.average)
            if name == "identity":
                dist.all_reduce(values)
                saved["dense"][numel] = (result.average, values / world_size)


def _auto(saved: dict) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun sets for 2 processes a host
    saved["auto"] = workers_per_host("auto")


def _ddp(saved: dict) -> None:
    """Two DDP steps with ``AccordionState(workers_per_host=2)`` and its hook: whether every
    rank's gradients are this one's after each backward, and the int part's shard errors."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    state = AccordionState(net, workers_per_host=2)
    model.register_comm_hook(state, accordion_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved["same_grads"] = []
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(16, 20, generator=gen), torch.randn(16, 4, generator=gen)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        saved["same_grads"].append(all(_gathered_equal(p.grad) for p in net.parameters()))
        optimizer.step()
    saved["local_size"] = state.transport().local_size
    saved["shard_error"] = state.compressor.state_dict()["parts"]["int"]["shard_error"]


def _two_hosts_of_two(rank: int, world_size: int, out: str) -> None:
    """Four gloo processes as two hosts of two: the exchanges, ``workers_per_host("auto")``
    and DDP, each section's failure saved rather than raised."""
    saved: dict = {"errors": {}, "same": {}, "by_scope": {}, "dense": {}}
    for name, work in (("exchanges", _exchanges), ("auto", _auto), ("ddp", _ddp)):
        _section(saved, name, work)
    torch.save(saved, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    """One launch of four gloo processes as two hosts of two: what each rank saved."""
    out = tmp_path_factory.mktemp("hierarchical")
    run_processes(_two_hosts_of_two, 4, str(out), timeout=90)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)]


def ran(gloo_run, section: str) -> list[dict]:
    """Every rank's saved values, once no rank's ``section`` failed."""
    for rank, saved in enumerate(gloo_run):
        assert section not in saved["errors"], (rank, saved["errors"][section])
    return gloo_run


@pytest.mark.parametrize("name", list(GLOO_CODECS))
def test_every_gloo_rank_gets_bitwise_the_same_hierarchical_average(gloo_run, name):
    for rank, saved in enumerate(ran(gloo_run, "exchanges")):
        for numel in GLOO_SIZES:
            assert saved["same"][name, numel], (rank, numel)


def test_a_lossless_hierarchical_exchange_over_gloo_is_a_dense_all_reduce_average(gloo_run):
    for saved in ran(gloo_run, "exchanges"):
        assert sorted(saved["dense"]) == GLOO_SIZES
        for numel, (average, reference) in saved["dense"].items():
            assert average.shape == (numel,)
            torch.testing.assert_close(average, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(GLOO_CODECS))
def test_the_gloo_bytes_inside_and_across_hosts_are_hierarchical_bytes(gloo_run, name):
    _, bits = GLOO_CODECS[name]
    for saved in ran(gloo_run, "exchanges"):
        for numel in GLOO_SIZES:
            inside, across = hierarchical_bytes(numel, bits, 4, 2, BLOCK, SCALE_BYTES)
            sent = saved["by_scope"][name, numel]
            assert sent["host"] == pytest.approx(inside, rel=1e-12), numel
            assert sent["peers"] == pytest.approx(across, rel=1e-12), numel
            assert sent["world"] == 0, numel


def test_workers_per_host_auto_reads_local_world_size_in_the_processes(gloo_run):
    assert [saved["auto"] for saved in ran(gloo_run, "auto")] == [2, 2, 2, 2]


def test_accordion_state_with_two_workers_a_host_runs_the_hierarchy_under_ddp(gloo_run):
    for saved in ran(gloo_run, "ddp"):
        assert saved["local_size"] == 2
        assert saved["shard_error"], "the int part kept no shard error: no hierarchy ran"
        assert all(e["world_size"] == 4 and e["local_size"] == 2 for e in saved["shard_error"])


def test_every_rank_has_the_same_gradients_with_two_workers_a_host_under_ddp(gloo_run):
    for rank, saved in enumerate(ran(gloo_run, "ddp")):
        assert saved["same_grads"] == [True, True], rank


# --- validation -------------------------------------------------------------------------


def test_zero_workers_a_host_is_a_value_error_naming_workers_per_host():
    with pytest.raises(ValueError, match="workers_per_host.*0"):
        AccordionState(Net(), workers_per_host=0)


def test_a_fractional_number_of_workers_a_host_is_a_type_error_naming_workers_per_host():
    with pytest.raises(TypeError, match="workers_per_host.*1.5"):
        AccordionState(Net(), workers_per_host=1.5)


def test_a_simulated_local_size_that_does_not_divide_the_world_is_a_value_error():
    with pytest.raises(ValueError, match="local_size.*3"):
        SimulatedTransport(4, 3)


def test_an_all_to_all_whose_rows_are_not_its_scopes_workers_is_a_runtime_error():
    world = SimulatedTransport(4, 2)

    def ask(rows):
        yield [AllToAll(torch.zeros(rows, 8), scope="host")]

    with pytest.raises(RuntimeError, match="leading dimension of 2"):
        world.run([ask(4) for _ in range(4)])
    world.run([ask(2) for _ in range(4)])  # the host's 2 rows: fine


def test_a_local_size_that_does_not_divide_the_world_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="local_size must be >= 1 and divide the world size 4"):
        next(two_phase_exchange(IntQuantizer, [torch.zeros(10)], 8, 4, local_size=3))
