"""The replicas of a cluster peer (p2p_diloco/pipeline/replicas.py), the pure parts: the batches' slices and AdamW's
state handed over (the processes themselves: tests/integration/test_replicas.py)."""

from __future__ import annotations

import torch

from p2p_diloco.pipeline.replicas import ReplicaBatches, optimizer_steps, optimizer_tensors


class CountingSampler:
    """Batches of ``batch_size`` rows numbered on from where the last one stopped."""

    def __init__(self, batch_size: int, seq_len: int = 3):
        self.batch_size, self.seq_len, self.drawn = batch_size, seq_len, 0

    def next_batch(self):
        rows = torch.arange(self.drawn, self.drawn + self.batch_size).unsqueeze(1).expand(-1, self.seq_len)
        self.drawn += self.batch_size
        return rows, rows + 1000

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


def test_the_replicas_train_on_the_slices_of_one_batch_of_d_times_b():
    replicas = [ReplicaBatches(CountingSampler(3 * 4), 3, d) for d in range(3)]
    whole = CountingSampler(3 * 4)
    for _ in range(2):
        parts = [r.next_batch() for r in replicas]
        inputs, targets = whole.next_batch()
        assert all(p[0].shape == (4, 3) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)
    # a follower that takes replica 0's position draws what replica 0 draws next
    follower = ReplicaBatches(CountingSampler(12), 3, 1)
    follower.load_state_dict(replicas[0].state_dict())
    assert torch.equal(follower.next_batch()[0], replicas[1].next_batch()[0])


def test_adamw_state_is_handed_over_in_one_order_and_created_where_missing():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    leader = torch.optim.AdamW(params, lr=0.1)
    assert optimizer_steps(leader, params) is None  # before its first step: nothing to hand over
    sum(p.sum() for p in params).backward()
    leader.step()
    leader.zero_grad(set_to_none=True)
    assert optimizer_steps(leader, params) == [1.0, 1.0]
    moments = optimizer_tensors(leader, params, create=False)
    assert [m.shape for m in moments] == [(4, 3), (3,), (4, 3), (3,)]  # exp_avg of each, then exp_avg_sq of each
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    follower = torch.optim.AdamW(copies, lr=0.1)
    received = optimizer_tensors(follower, copies, create=True)
    for mine, theirs in zip(received, moments):
        mine.copy_(theirs)
    for p, step in zip(copies, optimizer_steps(leader, params)):
        follower.state[p]["step"] = torch.tensor(step)
    for group in (params, copies):
        sum((x * x).sum() for x in group).backward()
    leader.step()
    follower.step()
    assert all(torch.equal(a, b) for a, b in zip(params, copies))  # the same step, to the bit
