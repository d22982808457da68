"""Accordion across FSDP2 replicas: 4 gloo processes as 2 replicas x 2 shards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accordion.fsdp import FSDPState
from distributed import run_processes

fsdp = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

REPLICAS, SHARDS = 2, 2


def _mesh():
    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))


def _model(mesh_dims) -> nn.Module:
    torch.manual_seed(0)
    # 33 rows: the last shard of fc1 is padded, as FSDP pads uneven row blocks
    net = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 32), nn.ReLU(),
                        nn.Linear(32, 4))  # fmt: skip
    for layer in (net[0], net[2]):
        fsdp.fully_shard(layer, mesh=mesh_dims)
    fsdp.fully_shard(net, mesh=mesh_dims)
    return net


def _batch(step: int):
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    x = torch.randn(8, 16, generator=gen)
    return x, x[:, :4].sin()


def _train(net, optimizer, steps, start=0, state=None, epoch_every=None):
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if state is not None and epoch_every and (step + 1) % epoch_every == 0:
            state.end_epoch(optimizer)
    return losses


def _full_params(net) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def _state(net, mesh, **options) -> FSDPState:
    options = {"compressor": "powersgd", "levels": (4, 2, 1), **options}
    return FSDPState(net, mesh, **options)


def _hsdp_run(rank, world_size, out):
    mesh = _mesh()
    net = _model(mesh["shard"])
    state = _state(net, mesh)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    rungs = []
    losses = []
    for _ in range(6):  # 6 "epochs" of 4 steps
        losses += _train(net, optimizer, 4, start=len(losses))
        state.end_epoch(optimizer)
        rungs.append(state.rungs())
    reference = _model(mesh)  # native HSDP, uncompressed
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05), 24)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (_full_params(net), rungs))
    torch.save({"gathered": gathered, "losses": losses, "ref_losses": ref_losses,
                "floats": state.ledger.total_floats, "dense": state.dense_floats()},
               f"{out}/rank{rank}.pt")  # fmt: skip


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp")
    run_processes(_hsdp_run, REPLICAS * SHARDS, str(out), timeout=180)
    return [torch.load(out / f"rank{r}.pt") for r in range(REPLICAS * SHARDS)]


def test_hsdp_replicas_hold_identical_parameters(hsdp):
    params = [p for p, _ in hsdp[0]["gathered"]]
    for other in params[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params[0], other))


def test_hsdp_traffic_across_replicas_is_below_dense(hsdp):
    for result in hsdp:
        assert 0 < result["floats"] < 0.6 * result["dense"]


def test_hsdp_layers_switch_levels_and_every_rank_takes_the_same_decisions(hsdp):
    rungs = [r for _, r in hsdp[0]["gathered"]]
    assert all(r == rungs[0] for r in rungs[1:])  # a layer's norm is its whole gradient's
    assert {r["0.weight"] for r in rungs[0]} == {0, 1}  # 4 -> 2 without an lr decay


def test_hsdp_loss_stays_close_to_uncompressed_native_hsdp(hsdp):
    for result in hsdp:
        compressed, dense = result["losses"][-4:], result["ref_losses"][-4:]
        assert sum(compressed) / 4 == pytest.approx(sum(dense) / 4, rel=0.05)


def _dense_run(rank, world_size, out):
    mesh = _mesh()
    net = _model(mesh["shard"])
    FSDPState(net, mesh, compressor="dense")
    reference = _model(mesh)
    for model in (net, reference):
        _train(model, torch.optim.SGD(model.parameters(), lr=0.05), 5)
    torch.save((_full_params(net), _full_params(reference)), f"{out}/rank{rank}.pt")


def test_hsdp_dense_level_matches_native_hsdp_so_gradients_are_averaged_once(tmp_path):
    run_processes(_dense_run, REPLICAS * SHARDS, str(tmp_path), timeout=120)
    ours, native = torch.load(tmp_path / "rank0.pt")
    for a, b in zip(ours, native):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _default_run(rank, world_size, out):
    mesh = _mesh()
    net = _model(mesh["shard"])
    state = FSDPState(net, mesh)  # the default ladder, int8 -> int4
    losses = _train(net, torch.optim.SGD(net.parameters(), lr=0.05), 8)
    reference = _model(mesh)
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05), 8)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, _full_params(net))
    torch.save({"gathered": gathered, "losses": losses, "ref_losses": ref_losses,
                "levels": state.ladder.levels, "floats": state.ledger.total_floats,
                "dense": state.dense_floats()}, f"{out}/rank{rank}.pt")  # fmt: skip


def test_hsdp_with_the_default_ladder_quantises_across_replicas_like_native_hsdp(tmp_path):
    run_processes(_default_run, REPLICAS * SHARDS, str(tmp_path), timeout=120)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(REPLICAS * SHARDS)]
    first = results[0]
    assert first["levels"] == ("int/8", "int/4")
    assert 0 < first["floats"] < 0.5 * first["dense"]  # int8 sends about a quarter
    for other in first["gathered"][1:]:
        assert all(torch.equal(a, b) for a, b in zip(first["gathered"][0], other))
    for result in results:
        compressed, dense = result["losses"][-4:], result["ref_losses"][-4:]
        assert sum(compressed) / 4 == pytest.approx(sum(dense) / 4, rel=0.02)


def _resume_run(rank, world_size, out):
    mesh = _mesh()
    net = _model(mesh["shard"])
    state = _state(net, mesh)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    _train(net, optimizer, 8, state=state, epoch_every=2)
    saved = ({k: v.to_local().clone() for k, v in net.state_dict().items()}, state.state_dict())
    _train(net, optimizer, 6, start=8, state=state, epoch_every=2)
    fresh = _model(mesh["shard"])
    resumed = _state(fresh, mesh)
    weights, accordion = saved
    for name, param in fresh.state_dict().items():
        param.to_local().copy_(weights[name])
    resumed.load_state_dict(accordion)
    _train(fresh, torch.optim.SGD(fresh.parameters(), lr=0.05), 6, start=8, state=resumed,
           epoch_every=2)  # fmt: skip
    torch.save((_full_params(net), _full_params(fresh), state.stats(), resumed.stats()),
               f"{out}/rank{rank}.pt")  # fmt: skip


def test_hsdp_state_survives_a_save_and_resume_bitwise(tmp_path):
    run_processes(_resume_run, REPLICAS * SHARDS, str(tmp_path), timeout=120)
    for rank in range(REPLICAS * SHARDS):
        straight, resumed, stats, resumed_stats = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
        assert stats == resumed_stats


def _wrong_shard_run(rank, world_size, out):
    mesh = _mesh()
    state = _state(_model(mesh["shard"]), mesh)
    saved = state.state_dict()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, saved)
    other = gathered[rank ^ 1]  # the other shard of this replica: same replicate rank
    with pytest.raises(ValueError, match="shard"):
        state.load_state_dict(other)
    state.load_state_dict(saved)


def test_hsdp_state_refuses_the_file_of_another_shard(tmp_path):
    run_processes(_wrong_shard_run, REPLICAS * SHARDS, str(tmp_path), timeout=60)


def test_fsdp_state_raises_type_error_for_a_mesh_that_is_no_device_mesh():
    with pytest.raises(TypeError, match="mesh must be a torch DeviceMesh, got NoneType"):
        FSDPState(nn.Linear(2, 2), mesh=None)


def _bad_arguments_run(rank, world_size):
    mesh = _mesh()
    with pytest.raises(ValueError, match="no FSDP module"):
        FSDPState(nn.Linear(2, 2), mesh)
    with pytest.raises(ValueError, match="native HSDP"):
        FSDPState(_model(mesh), mesh)
    with pytest.raises(ValueError, match="dims must name"):
        FSDPState(_model(mesh["shard"]), mesh, dims=("dp", "shard"))
    with pytest.raises(ValueError, match="process_group"):
        FSDPState(_model(mesh["shard"]), mesh, process_group=None)


def test_fsdp_state_refuses_unsharded_natively_hsdp_and_misnamed_setups():
    run_processes(_bad_arguments_run, REPLICAS * SHARDS, timeout=60)
