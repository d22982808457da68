"""The two-phase compressed all-reduce over real gloo processes: through a lossless codec it
is a dense all-reduce's average, every rank gets bitwise the same average, and the bytes
that the transport hands to its collectives are :func:`two_phase_bytes`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from accordion.compress import IntQuantizer, TorchTransport
from accordion.compress.normalquant import NormalQuantizer
from accordion.compress.quantize import SCALE_BYTES
from accordion.compress.two_phase import two_phase_bytes, two_phase_exchange
from distributed import run_processes
from two_phase_parts import IdentityCodec

WORLD_SIZES = [2, 3, 4, 5, 8]
SIZES = [0, 1, 17, 4099, 2**20 + 3]
#: name: (codec, bits)
CODECS = {"identity": (IdentityCodec, 32), "int8": (IntQuantizer, 8), "nq2": (NormalQuantizer, 2)}


def rank_input(rank: int, numel: int) -> torch.Tensor:
    """This rank's values: random, of a scale of its own."""
    gen = torch.Generator().manual_seed(1000 * rank + numel)
    return (rank + 1) * torch.randn(numel, generator=gen)


def _exchange_every_size(rank: int, world_size: int, out: str) -> None:
    """Per size and codec, one two-phase exchange over gloo: whether every rank's average
    is bitwise rank 0's, the bytes counted, and on rank 0 the lossless average beside
    ``all_reduce(sum) / W``."""
    transport = TorchTransport()
    same, sent, dense = {}, {}, {}
    for numel in SIZES:
        for name, (codec, bits) in CODECS.items():
            values = rank_input(rank, numel)
            before = transport.bytes_sent
            result = transport.run(two_phase_exchange(codec, [values.clone()], bits, world_size))
            sent[name, numel] = transport.bytes_sent - before
            everyone = [torch.empty_like(result.average) for _ in range(world_size)]
            dist.all_gather(everyone, result.average)
            same[name, numel] = all(torch.equal(a, result.average) for a in everyone)
            if name == "identity":
                reference = values.clone()
                dist.all_reduce(reference)
                dense[numel] = (result.average, reference / world_size)
    torch.save({"same": same, "sent": sent}, f"{out}/rank{rank}.pt")
    if rank == 0:
        torch.save(dense, f"{out}/dense.pt")


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
def gloo_run(request, tmp_path_factory):
    """One launch of ``W`` gloo processes running every size and codec: what they saved."""
    world_size = request.param
    out = tmp_path_factory.mktemp(f"two_phase_w{world_size}")
    run_processes(_exchange_every_size, world_size, str(out), timeout=60)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    return world_size, ranks, torch.load(out / "dense.pt", weights_only=True)


def test_a_lossless_two_phase_exchange_is_a_dense_all_reduce_average(gloo_run):
    _, _, dense = gloo_run
    assert sorted(dense) == SIZES
    for numel, (average, reference) in dense.items():
        assert average.shape == (numel,)
        # only the order of the fp32 additions differs
        torch.testing.assert_close(average, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["identity", "int8", "nq2"])
def test_every_rank_gets_bitwise_the_same_average(gloo_run, name):
    _, ranks, _ = gloo_run
    for rank, saved in enumerate(ranks):
        for numel in SIZES:
            assert saved["same"][name, numel], (rank, numel)


@pytest.mark.parametrize("name", ["identity", "int8", "nq2"])
def test_the_bytes_handed_to_the_collectives_are_two_phase_bytes(gloo_run, name):
    world_size, ranks, _ = gloo_run
    _, bits = CODECS[name]
    for saved in ranks:
        for numel in SIZES:
            expected = two_phase_bytes(numel, bits, world_size, 64, SCALE_BYTES)
            assert saved["sent"][name, numel] == pytest.approx(expected, rel=1e-12), numel
