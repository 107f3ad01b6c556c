"""The routed experts' paths give the same rows: the grouped one (no host synchronisation, float32
and bfloat16 on an accelerator), the per-expert one (the CPU's) and the reference loop over experts
(float64), also on an EP shard."""
from __future__ import annotations

import pytest
import torch

from runtime.experts import RoutedExperts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset, num_local", [(0, 8), (3, 3), (6, 2)])
def test_grouped_equals_the_loop(dtype, offset, num_local):
    torch.manual_seed(offset)
    experts = RoutedExperts(num_local, 64, 32, expert_offset=offset)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    experts = experts.to(dtype)
    for t in (0, 1, 3, 17, 64):
        x = torch.randn(t, 64).to(dtype)
        ids = torch.stack([torch.randperm(8)[:2] for _ in range(t)]) if t else torch.zeros(0, 2, dtype=torch.long)
        weights = torch.rand(t, 2)
        got, want = experts._grouped(x, weights, ids), experts._looped(x, weights, ids)
        assert torch.equal(got, want)
        assert torch.equal(experts._per_expert(x, weights, ids), want)
        off_shard = ((ids < offset) | (ids >= offset + num_local)).all(dim=1)
        assert not got[off_shard].any()                                   # rows with no local expert: zero
        padded = experts._padded(x, weights, ids)             # batched matmuls round otherwise
        assert torch.allclose(padded.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
        assert not padded[off_shard].any() if t else padded.shape == (0, 64)


def test_float64_takes_the_reference_loop(monkeypatch):
    experts = RoutedExperts(4, 16, 8).to(torch.float64)
    calls = []
    monkeypatch.setattr(RoutedExperts, "_looped", lambda self, *a: calls.append("loop") or a[0])
    monkeypatch.setattr(RoutedExperts, "_grouped", lambda self, *a: calls.append("grouped") or a[0])
    monkeypatch.setattr(RoutedExperts, "_per_expert", lambda self, *a: calls.append("per expert") or a[0])
    x, w, ids = torch.zeros(2, 16, dtype=torch.float64), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)
    experts(x, w, ids)
    experts.float()(x.float(), w, ids)
    assert calls == ["loop", "per expert"]      # float32 on the CPU: per expert (grouped on an accelerator)


@pytest.mark.parametrize("dtype, ids, padded", [
    (torch.float32, [[0, 1], [2, 3]] * 32, False),     # float32: never
    (torch.bfloat16, [[0, 1]], False),                  # 2 experts
    (torch.bfloat16, [[0, 1], [0, 1]], False),          # a row's two copies: still 2 experts
    (torch.bfloat16, [[0, 1], [1, 2]], True),           # 3 experts (`PADDED_MIN_EXPERTS`)
    (torch.bfloat16, [[4, 5], [6, 1]], False),          # 1 local expert: the others are another shard's
])
def test_the_cpu_picks_padded_matmuls_for_many_touched_experts(monkeypatch, dtype, ids, padded):
    experts = RoutedExperts(4, 16, 8).to(dtype)
    calls = []
    monkeypatch.setattr(RoutedExperts, "_padded", lambda self, *a: calls.append("padded") or a[0])
    monkeypatch.setattr(RoutedExperts, "_per_expert", lambda self, *a: calls.append("per expert") or a[0])
    rows = len(ids)
    experts(torch.zeros(rows, 16, dtype=dtype), torch.ones(rows, 2), torch.tensor(ids))
    assert calls == ["padded" if padded else "per expert"]
