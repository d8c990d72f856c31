"""A toy network and its data, the plain-AdamW reference and one distributed-optimizer iteration:
the shared pieces of the DDP and optimizer tests."""

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import collectives
from tests.helpers.groups import current_groups


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.fc(self.norm(self.inp(x))))
        # self.inp.weight used a second time: a tied weight must be accumulated once per backward.
        return self.out(h) + (x @ self.inp.weight.t()).sum(-1, keepdim=True)

    def set_input_tensor(self, t):
        self.input_tensor = t


def toy_data(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


LR, WD, CLIP, STEPS = 1e-2, 0.1, 0.05, 4


def reference_adamw(steps, batch):
    """Plain torch AdamW on the whole batch ``batch(step) -> (x, y)`` in one process, torch's
    clip_grad_norm_. Returns ``({name: param}, [grad norm], [loss])``."""
    torch.manual_seed(0)
    ref = Net()
    decay = [p for n, p in ref.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in ref.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    norms, losses = [], []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x), y)
        losses.append(loss.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item())
        opt.step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}, norms, losses


GLOBAL = 16  # samples per distributed-optimizer test iteration

BUCKET = 20  # Net's four layers -> four buckets (68, 272, 32, 144 elements)


def distrib_batch(step):
    x, y = toy_data(GLOBAL * (step + 1))
    return x[-GLOBAL:], y[-GLOBAL:]


def distrib_iteration(ddp, opt, step, num_mb, poison=None):
    """One training iteration on this rank's part of the global batch; returns the global loss
    (mean over ranks) and the collectives issued. ``poison = (rank, factor)`` multiplies that
    data-parallel rank's last micro-batch loss by ``factor`` (inf, NaN): its gradients turn
    non-finite and the step must be skipped, which is asserted on every rank."""
    from megatron.core.distributed import finalize_model_grads

    rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    x, y = distrib_batch(step)
    x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
    dtype = ddp.module.fc.weight.dtype
    ddp.zero_grad_buffer()
    opt.zero_grad()
    total = torch.zeros(())
    with collectives.recording() as events:
        for i, (xm, ym) in enumerate(zip(x.chunk(num_mb), y.chunk(num_mb))):
            last = i == num_mb - 1
            ctx = ddp.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = torch.nn.functional.mse_loss(ddp(xm.to(dtype)).float(), ym) / num_mb
                if last and poison is not None and poison[0] == rank:
                    loss = loss * poison[1]
                loss.backward()
            total += loss.detach()
        finalize_model_grads([ddp], pg_collection=current_groups())
        ok, _, _ = opt.step()
    assert ok == (poison is None), (rank, ok, poison)
    torch.distributed.all_reduce(total)
    return total.item() / dp, events
