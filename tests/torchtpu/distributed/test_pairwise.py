"""The gloo groups that all-to-all messages travel on, in one process (world size 1): both
directions share one gloo device, made from the same settings as gloo's own groups."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _dist_workers import threads
from torchtpu.distributed.pairwise import Pairwise

_TIMEOUT = timedelta(seconds=30)


def test_both_directions_cost_the_threads_of_one_gloo_group():
    before = threads()
    pairwise = Pairwise(dist.HashStore(), 0, 1, _TIMEOUT)
    ours = threads() - before
    before = threads()
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, _TIMEOUT)
    one_group = threads() - before
    # A gloo group has a transport thread and two workers; the pairwise groups share the
    # transport thread and have a worker each (a group of two devices would have had six threads).
    assert ours == one_group, f"the pairwise groups add {ours} threads, one gloo group {one_group}"
    del pairwise, gloo


def test_the_groups_take_the_interfaces_gloo_is_told_to_use(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(RuntimeError, match="nosuchif0"):
        dist.ProcessGroupGloo(dist.HashStore(), 0, 1, _TIMEOUT)  # gloo's own groups
    with pytest.raises(RuntimeError, match="nosuchif0"):
        Pairwise(dist.HashStore(), 0, 1, _TIMEOUT)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    pairwise = Pairwise(dist.HashStore(), 0, 1, _TIMEOUT)
    source, received = torch.arange(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    pairwise.exchange([received], [source]).wait()
    assert torch.equal(received, source)
