"""Which cheap per-window signal tells a harmful level switch from a harmless one?

Four simulated MNIST-1D workers (the setup of ``benchmarks/switch_transient``: 4,000
samples, global batch 128, lr 0.1 warmed up over 2 epochs, momentum 0.9) train at one
level, optionally switching at the start of an epoch. After every epoch it prints, over
the compressed tensors, with ``G`` the sum of rank 0's local gradients over the epoch
and ``U`` the sum of the averaged updates the optimizer received:

* ``s1`` = ``|U - G| / |G|``, ``s2`` = ``|U| / |G|`` (a windowed compression gain);
* ``s3`` = the mean over steps of cos(update, rank 0's local gradient);
* ``s4`` = rank 0's error-feedback memory norm over the mean per-step ``|G|``;
* ``mem0`` = rank 0's memory norm, ``s5`` = the norm of the workers' average memory
  (not observable by one rank without a tensor-sized collective);
* ``g`` = ``|G|`` per step (the paper's statistic, per step), the train loss, test acc.

    PYTHONPATH=src .venv/bin/python benchmarks/rule_signals/probe.py powersgd 4 1 10 0 16

Arguments: compressor (powersgd or topk), level before, level after, switch epoch (or
``none``), seed, epochs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "switch_transient"))
import switch_transient as st  # noqa: E402  (the same data, schedule and constants)

from accordion.compress import PowerSGD, TopK  # noqa: E402
from accordion.compress.reducer import Reducer  # noqa: E402
from accordion.compress.transport import SimulatedTransport  # noqa: E402
from accordion.models import get_model  # noqa: E402


def _cat(tensors, keys):
    return torch.cat([tensors[k].reshape(-1) for k in keys])


def _epoch(model, params, names, keys, reducers, transport, opt, data, perm, step):
    """One epoch; returns the window sums, the step cosines, the mean loss, the step."""
    x, y = data
    workers, spe = len(reducers), len(x) // st.GLOBAL_BATCH
    shard, index = st.GLOBAL_BATCH // workers, [names.index(k) for k in keys]
    sums_g, sums_u, cosines, loss_sum = dict.fromkeys(keys, 0), dict.fromkeys(keys, 0), [], 0.0
    for b in range(spe):
        for group in opt.param_groups:
            group["lr"] = st.lr_at(step, spe, 0.1)
        idx, grads = perm[b * st.GLOBAL_BATCH : (b + 1) * st.GLOBAL_BATCH], []
        for w in range(workers):
            part = idx[w * shard : (w + 1) * shard]
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[part]), y[part])
            loss.backward()
            loss_sum += float(loss) / workers
            grads.append([p.grad.detach().clone() for p in params])
        local = [g.clone() for g in grads[0]]
        transport.run([reducers[w].exchange(names, grads[w], workers) for w in range(workers)])
        for i, k in zip(index, keys):
            sums_g[k] = sums_g[k] + local[i]
            sums_u[k] = sums_u[k] + grads[0][i]
        out = torch.cat([grads[0][i].reshape(-1) for i in index])
        cosines.append(float(F.cosine_similarity(out, torch.cat([local[i].reshape(-1)
                                                                 for i in index]), dim=0)))
        for p, g in zip(params, grads[0]):
            p.grad = g
        opt.step()
        step += 1
    return sums_g, sums_u, cosines, loss_sum / spe, step


def run(compressor: str, before, after, switch_epoch: int | None, seed: int, epochs: int):
    torch.set_num_threads(1)
    x, y, xt, yt = (torch.tensor(a) for a in st.load_data())
    x, xt, y, yt = x.float(), xt.float(), y.long(), yt.long()
    torch.manual_seed(seed)
    model = get_model("mnist1d-cnn")
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    keys = [n for n, p in zip(names, params) if p.dim() >= 2]
    make = (lambda lv: PowerSGD(lv, seed=seed)) if compressor == "powersgd" else TopK
    reducers = [Reducer(make(before)) for _ in range(st.WORKERS)]
    transport = SimulatedTransport(st.WORKERS)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    rng, step, spe = np.random.RandomState(seed), 0, len(x) // st.GLOBAL_BATCH
    for epoch in range(epochs):
        if epoch == switch_epoch:
            for reducer in reducers:
                reducer.compressor.set_level(after)
        perm = torch.from_numpy(rng.permutation(len(x)))
        sums_g, sums_u, cosines, loss, step = _epoch(
            model, params, names, keys, reducers, transport, opt, (x, y), perm, step
        )
        g, u = _cat(sums_g, keys), _cat(sums_u, keys)
        memories = [_cat({k: r.memory.get(k) for k in keys}, keys) for r in reducers]
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean()) * 100
        print(f"epoch {epoch:2d} acc {acc:5.1f} loss {loss:.3f} "
              f"s1 {float((u - g).norm() / g.norm()):.2f} s2 {float(u.norm() / g.norm()):.2f} "
              f"s3 {np.mean(cosines):.2f} s4 {float(memories[0].norm() / (g.norm() / spe)):6.1f} "
              f"mem0 {float(memories[0].norm()):5.2f} "
              f"s5 {float(torch.stack(memories).mean(0).norm()):.2f} "
              f"g {float(g.norm()) / spe:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    comp, a, b, sw, seed, epochs = sys.argv[1:7]
    level = int if comp == "powersgd" else float
    run(comp, level(a), level(b), None if sw == "none" else int(sw), int(seed), int(epochs))
