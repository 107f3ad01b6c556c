"""The routed experts' paths give the same rows: the grouped one (no host synchronisation, float32
and bfloat16 on an accelerator), the per-expert one (the CPU's) and the reference loop over experts
(float64), also on an EP shard."""
from __future__ import annotations

import pytest
import torch

from runtime.ops import cpu_ops
from runtime.model.experts import PADDED_MIN_EXPERTS, RoutedExperts, _native_experts
from runtime.model.layers import pack_for_inference


@pytest.fixture
def python_paths(monkeypatch):
    """The routed experts without the native op: the Python paths it mirrors run."""
    monkeypatch.setattr(cpu_ops, "_state", {"loaded": False})
    monkeypatch.setattr(cpu_ops, "LOADED", False)
    monkeypatch.setattr(cpu_ops, "FEW_ROWS", {})


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


def test_float64_takes_the_reference_loop(monkeypatch, python_paths):
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
    (torch.bfloat16, [[0, 1], [2, 3]] * 80, True),      # 160 rows spread evenly: no padding
    (torch.bfloat16, [[0, 1]] * 150 + [[2, 3]] * 10, False),   # skewed: 280 padded rows > 64 per expert
    (torch.bfloat16, [[0, 1]] * 130 + [[2, 3]] * 10, True),    # 240 padded rows <= 4 x 64 (`PADDED_WASTE_ROWS`)
])
def test_the_cpu_picks_padded_matmuls_for_many_touched_experts(monkeypatch, python_paths, dtype, ids, padded):
    experts = RoutedExperts(4, 16, 8).to(dtype)
    calls = []
    monkeypatch.setattr(RoutedExperts, "_padded", lambda self, *a: calls.append("padded") or a[0])
    monkeypatch.setattr(RoutedExperts, "_per_expert", lambda self, *a: calls.append("per expert") or a[0])
    rows = len(ids)
    experts(torch.zeros(rows, 16, dtype=dtype), torch.ones(rows, 2), torch.tensor(ids))
    assert calls == ["padded" if padded else "per expert"]


def test_the_native_op_builds_here():
    """This machine has a C++ compiler (the contract's set-up), so the native op must load."""
    assert cpu_ops.load(), cpu_ops.error()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset, num_local, num_experts", [(0, 8, 8), (4, 4, 12), (8, 4, 12)])
def test_the_native_op_equals_the_python_paths_bit_for_bit(dtype, offset, num_local, num_experts):
    """Without the few-row kernel: per expert and padded (16-bit types from `PADDED_MIN_EXPERTS`
    touched experts), on a shard whose experts some rows never choose, from no rows to 64. With it
    (the served call): within rounding of them, and each row's result its own."""
    assert cpu_ops.load(), cpu_ops.error()
    torch.manual_seed(offset + num_local)
    experts = RoutedExperts(num_local, 256, 128, expert_offset=offset)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    experts = experts.to(dtype)
    pack_for_inference(experts)                     # column-major, as served: the few-row kernel's layout
    assert experts.gate_up_proj.transpose(1, 2).is_contiguous()
    args = (experts.gate_up_proj, experts.down_proj, offset)
    paths = set()
    for t in (0, 1, 2, 3, 4, 16, 64):
        x = torch.randn(t, 256).to(dtype)
        ids = (torch.stack([torch.randperm(num_experts)[:2] for _ in range(t)]) if t
               else torch.zeros(0, 2, dtype=torch.long))
        weights = torch.rand(t, 2)
        local = ((ids >= offset) & (ids < offset + num_local))
        least = PADDED_MIN_EXPERTS.get(dtype)
        padded = least is not None and ids.numel() >= least and len(set(ids[local].tolist())) >= least
        paths.add(padded)
        want = experts._padded(x, weights, ids) if padded else experts._per_expert(x, weights, ids)
        got = torch.ops.metrale_cpu.routed_experts(x, weights, ids, *args, least or 0, 0)
        assert got.dtype == dtype and got.shape == (t, 256)
        assert torch.equal(got, want), (t, padded)
        assert not got[~local.any(dim=1)].any()                                  # no local choice: zero
        served = _native_experts(x, weights, ids, *args)                         # the few-row kernel
        assert served.dtype == dtype and served.shape == (t, 256)
        # bfloat16: the kernel keeps float between the projections, the Python path rounds each op
        tol = 1e-5 if dtype == torch.float32 else 2e-2 * max([1.0, *want.abs().flatten().tolist()])
        assert torch.allclose(served.float(), want.float(), atol=tol, rtol=0), (t, (served.float() - want.float()).abs().max())
        assert not served[~local.any(dim=1)].any()
        for r in range(min(t, 4)):                                               # a row alone: the same bits
            alone = torch.ops.metrale_cpu.routed_experts(x[r:r + 1], weights[r:r + 1], ids[r:r + 1], *args,
                                                         least or 0, 1 << 30)
            assert torch.equal(alone[0], served[r]) or t > cpu_ops.few_rows_max(dtype), (t, r)
    assert paths == ({False, True} if dtype == torch.bfloat16 else {False})


def test_the_native_op_refuses_bad_shapes():
    assert cpu_ops.load(), cpu_ops.error()
    gate_up, down = torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)
    with pytest.raises(RuntimeError, match="ids must be"):
        torch.ops.metrale_cpu.routed_experts(torch.zeros(3, 4), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long),
                                             gate_up, down, 0, 0, 0)
    with pytest.raises(RuntimeError, match="weights"):
        torch.ops.metrale_cpu.routed_experts(torch.zeros(2, 4), torch.ones(2, 1), torch.zeros(2, 2, dtype=torch.long),
                                             gate_up, down, 0, 0, 0)


def test_a_failed_build_falls_back_to_the_python_paths(monkeypatch, tmp_path, caplog):
    """No working compiler (`false`) and an empty cache: `load` says why, once, and the experts
    still give the Python path's rows."""
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr(cpu_ops, "LOADED", None)
    monkeypatch.setattr(cpu_ops, "FEW_ROWS", {})
    with caplog.at_level("WARNING", logger="metrale.cpu_ops"):
        assert not cpu_ops.load(tmp_path, ("false",))
        assert not cpu_ops.load(tmp_path, ("false",))
    assert "false failed" in cpu_ops.error()
    assert len([r for r in caplog.records if "native CPU ops unavailable" in r.message]) == 1
    assert not list(tmp_path.rglob("*.so"))                                     # no half-written library
    experts = RoutedExperts(4, 16, 8)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x, w, ids = torch.randn(3, 16), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])
    assert torch.equal(experts(x, w, ids), experts._per_expert(x, w, ids))
    assert cpu_ops.LOADED is False and cpu_ops.few_rows_max(torch.float32) == 0   # linears take F.linear
