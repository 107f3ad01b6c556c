// The CPU's routed experts and paged attention as native ops: the same ATen kernels, in the same order, as the
// Python paths of runtime/experts.py (`RoutedExperts._per_expert`, `RoutedExperts._padded`), so
// the results are bit for bit theirs; the sorting of choices by expert and the bookkeeping run on
// plain host vectors instead of ~30 small tensor ops a layer (each 5-30 us of host time here).
// Built and loaded by runtime/cpu_ops.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

at::Tensor long_tensor(const std::vector<int64_t>& values) {
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), out.mutable_data_ptr<int64_t>());
  return out;
}

// x [T, H], weights/ids [T, k] (global expert ids), gate_up [E, 2I, H], down [E, H, I] ->
// the weighted sum over this shard's experts [T, H]; choices routed elsewhere contribute zero.
// `padded_min_experts` > 0: from that many touched local experts, every expert's rows are padded
// to the busiest count and each projection is one batched matmul (`_padded`); else one GEMM pair
// per touched expert (`_per_expert`).
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                          const at::Tensor& gate_up, const at::Tensor& down, int64_t expert_offset,
                          int64_t padded_min_experts) {
  TORCH_CHECK(x.device().is_cpu(), "metrale_cpu::routed_experts runs on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "x must be [T, H], got ", x.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0), "ids must be [T, k] for x ", x.sizes(), ", got ", ids.sizes());
  TORCH_CHECK(weights.sizes() == ids.sizes(), "weights ", weights.sizes(), " and ids ", ids.sizes(), " differ");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0),
              "gate_up [E, 2I, H] and down [E, H, I] expected, got ", gate_up.sizes(), " and ", down.sizes());
  const int64_t t = ids.size(0), k = ids.size(1), h = x.size(1), e_local = gate_up.size(0);
  const int64_t n = t * k;
  if (t == 0) {
    return at::zeros({0, h}, x.options());
  }
  const at::Tensor id = ids.to(at::kLong).contiguous();
  const int64_t* idp = id.const_data_ptr<int64_t>();
  std::vector<int64_t> key(n), counts(e_local + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = idp[i] - expert_offset;
    key[i] = (local >= 0 && local < e_local) ? local : e_local;   // non-local: a last group
    ++counts[key[i]];
  }
  int64_t touched = 0, busiest = 0, mine = 0;
  std::vector<int64_t> first(e_local + 1, 0);   // first place of each expert's run in choice order
  for (int64_t e = 0; e < e_local; ++e) {
    touched += counts[e] > 0;
    busiest = std::max(busiest, counts[e]);
    first[e + 1] = first[e] + counts[e];
    mine += counts[e];
  }
  // Choices of local experts, stably sorted by expert (argsort(key, stable=True) minus the last group).
  std::vector<int64_t> order(mine), fill(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (key[i] < e_local) {
      order[fill[key[i]]++] = i;
    }
  }
  at::Tensor per_choice = at::zeros({n, h}, x.options());                         // [T*k, H]
  if (mine > 0) {
    std::vector<int64_t> rows(mine);
    for (int64_t j = 0; j < mine; ++j) {
      rows[j] = order[j] / k;
    }
    const at::Tensor xs = x.index_select(0, long_tensor(rows));                    // [L, H], expert-major
    const at::Tensor choice = long_tensor(order);
    const bool padded = padded_min_experts > 0 && n >= padded_min_experts && touched >= padded_min_experts;
    if (padded) {
      const int64_t p = busiest;
      std::vector<int64_t> slot(mine);   // place of each choice in [E * p]
      for (int64_t e = 0; e < e_local; ++e) {
        for (int64_t r = 0; r < counts[e]; ++r) {
          slot[first[e] + r] = e * p + r;
        }
      }
      const at::Tensor slots = long_tensor(slot);
      const at::Tensor xp = at::zeros({e_local * p, h}, x.options()).index_copy_(0, slots, xs);
      const auto gu = at::bmm(xp.view({e_local, p, h}), gate_up.transpose(1, 2)).chunk(2, -1);
      const at::Tensor ys = at::bmm(at::silu(gu[0]) * gu[1], down.transpose(1, 2)).view({e_local * p, h});
      per_choice.index_copy_(0, choice, ys.index_select(0, slots));
    } else {
      std::vector<at::Tensor> outs;
      for (int64_t e = 0; e < e_local; ++e) {
        if (counts[e] == 0) {
          continue;
        }
        const auto gu = at::linear(xs.narrow(0, first[e], counts[e]), gate_up.select(0, e)).chunk(2, -1);
        outs.push_back(at::linear(at::silu(gu[0]) * gu[1], down.select(0, e)));
      }
      per_choice.index_copy_(0, choice, outs.size() == 1 ? outs[0] : at::cat(outs));
    }
  }
  // Sum over the k choices in a fixed order, as the Python paths do.
  return (per_choice.view({t, k, h}) * weights.to(x.scalar_type()).unsqueeze(-1)).sum(1);
}

template <typename acc_t, typename T>
inline acc_t to_acc(T x) { return static_cast<acc_t>(x); }

// Attention of a few rows per sequence straight from the paged cache, without the gathered copy
// of every sequence's keys and values that SDPA needs (two copies of B x K cache rows a layer).
// Each (sequence, kv head) task reads a key once for its query heads; one row's scores, softmax
// and sum are its own (no other row changes them). q [T, nh, D], planes [N, nkv, D] / [N, nkv, Dv],
// gather [B, K] cells, rows [B, Q] the step row of each (sequence, query) or -1 (none), mask
// [B, Q, K] bool or undefined (every key visible). out [T, nh, Dv]: every row named in `rows`.
// Accumulates in float (double for double).
template <typename scalar_t>
void paged_rows(const at::Tensor& q, const at::Tensor& k_plane, const at::Tensor& v_plane, const at::Tensor& gather,
                const at::Tensor& rows, const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t b = gather.size(0), kk = gather.size(1), nq = rows.size(1);
  const int64_t nh = q.size(1), d = q.size(2), nkv = k_plane.size(1), dv = v_plane.size(2);
  const int64_t group = nh / nkv;
  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const scalar_t* kp = k_plane.const_data_ptr<scalar_t>();
  const scalar_t* vp = v_plane.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const int64_t* gp = gather.const_data_ptr<int64_t>();
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const bool* mp = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k_plane.stride(0), ks1 = k_plane.stride(1);
  const int64_t vs0 = v_plane.stride(0), vs1 = v_plane.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t sc = static_cast<acc_t>(scale);
  constexpr acc_t kNeg = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, b * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> s(group * kk), qf(group * d), acc(group * dv), inv(group);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bi = i / nkv, g = i % nkv;
      const int64_t* cells = gp + bi * kk;
      for (int64_t r = 0; r < nq; ++r) {
        const int64_t row = rp[bi * nq + r];
        if (row < 0) continue;
        const bool* vis = mp ? mp + (bi * nq + r) * kk : nullptr;
        for (int64_t hh = 0; hh < group; ++hh) {
          const scalar_t* qrow = qp + row * qs0 + (g * group + hh) * qs1;
          for (int64_t x = 0; x < d; ++x) qf[hh * d + x] = to_acc<acc_t>(qrow[x]) * sc;
        }
        for (int64_t j = 0; j < kk; ++j) {
          if (vis && !vis[j]) {
            for (int64_t hh = 0; hh < group; ++hh) s[hh * kk + j] = kNeg;
            continue;
          }
          const scalar_t* key = kp + cells[j] * ks0 + g * ks1;
          for (int64_t hh = 0; hh < group; ++hh) {
            const acc_t* qh = qf.data() + hh * d;
            acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < d; ++x) dot += qh[x] * to_acc<acc_t>(key[x]);
            s[hh * kk + j] = dot;
          }
        }
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t hh = 0; hh < group; ++hh) {
          acc_t* sh = s.data() + hh * kk;
          acc_t m = kNeg;
          for (int64_t j = 0; j < kk; ++j) m = std::max(m, sh[j]);
          acc_t sum = 0;
          for (int64_t j = 0; j < kk; ++j) {
            const acc_t p = sh[j] == kNeg ? acc_t(0) : std::exp(sh[j] - m);
            sh[j] = p;
            sum += p;
          }
          inv[hh] = acc_t(1) / sum;
        }
        for (int64_t j = 0; j < kk; ++j) {
          if (vis && !vis[j]) continue;
          const scalar_t* val = vp + cells[j] * vs0 + g * vs1;
          for (int64_t hh = 0; hh < group; ++hh) {
            const acc_t p = s[hh * kk + j];
            acc_t* ah = acc.data() + hh * dv;
#pragma omp simd
            for (int64_t x = 0; x < dv; ++x) ah[x] += p * to_acc<acc_t>(val[x]);
          }
        }
        for (int64_t hh = 0; hh < group; ++hh) {
          scalar_t* orow = op + row * os0 + (g * group + hh) * os1;
          for (int64_t x = 0; x < dv; ++x) orow[x] = static_cast<scalar_t>(acc[hh * dv + x] * inv[hh]);
        }
      }
    }
  });
}

// Rows per sequence up to which attention reads the cache in place (`paged_rows`): decode and
// verify steps. Longer chunks (prefills) gather and run SDPA, whose tiled kernel suits them.
constexpr int64_t kInPlaceMaxRows = 8;

// One layer of `runtime.attention.PagedAttention.attend` over a padded batch (not the
// batch-invariant tiles): this step's keys and values written to their cells (as the Python
// method), then up to `kInPlaceMaxRows` rows a sequence attend in place (`paged_rows`), longer
// chunks gather every sequence's context and make one SDPA call, the Python method's calls in
// its order.
// k_plane, v_plane: the layer's cache planes [N, nkv, D] / [N, nkv, Dv] (v_plane a view of
// k_plane's first channels in a latent cache, then `write_v` is false); mode: "none" (one sequence
// of one row or more, unmasked), "causal", "explicit" (mask [B, 1, Q, K]) or "padded" (B*Q rows).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_plane,
                           at::Tensor& v_plane, bool write_v, const at::Tensor& cell_mapping,
                           const at::Tensor& gather, const std::optional<at::Tensor>& q_index,
                           const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& mask,
                           c10::string_view mode, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, dim]");
  TORCH_CHECK(gather.dim() == 2, "gather must be [B, K], got ", gather.sizes());
  const bool padded = mode == "padded", causal = mode == "causal", explicit_mask = mode == "explicit";
  TORCH_CHECK(padded || causal || explicit_mask || mode == "none", "unknown mask mode ", mode);
  k_plane.index_copy_(0, cell_mapping, k.to(k_plane.scalar_type()));
  if (write_v) {
    v_plane.index_copy_(0, cell_mapping, v.to(v_plane.scalar_type()));
  }
  const int64_t b = gather.size(0), kk = gather.size(1);
  const bool single = !padded && b == 1;
  TORCH_CHECK(single || (q_index.has_value() && valid.has_value()), "a batch of ", b, " sequences needs q_index and valid");
  TORCH_CHECK(!(padded || explicit_mask) || mask.has_value(), "mask mode ", mode, " needs a mask");
  const int64_t rows_per_seq = single ? q.size(0) : q_index->size(1);
  if (!causal && rows_per_seq <= kInPlaceMaxRows && k_plane.stride(2) == 1 && v_plane.stride(2) == 1) {
    const at::Tensor rows = single ? at::arange(q.size(0), gather.options()).view({1, -1})
                                   : (padded ? *q_index : at::where(*valid, *q_index, -1));
    const at::Tensor m = (padded || explicit_mask) ? mask->reshape({b, rows_per_seq, kk}).contiguous() : at::Tensor();
    const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
    at::Tensor out = at::empty({q.size(0), q.size(1), v_plane.size(2)}, q.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_rows", [&] {
      paged_rows<scalar_t>(qc, k_plane, v_plane, gather.contiguous(), rows.contiguous(), m, scale, out);
    });
    return out;
  }
  const at::Tensor cells = gather.reshape(-1);
  const at::Tensor keys = k_plane.index_select(0, cells).view({b, kk, k_plane.size(1), k_plane.size(2)}).transpose(1, 2);
  const at::Tensor values = v_plane.index_select(0, cells).view({b, kk, v_plane.size(1), v_plane.size(2)}).transpose(1, 2);
  const at::Tensor queries = single ? q.transpose(0, 1).unsqueeze(0) : q.index({*q_index}).transpose(1, 2);
  const bool gqa = keys.size(1) != queries.size(1);
  std::optional<at::Tensor> attn_mask;
  if (padded || explicit_mask) {
    attn_mask = mask;
  }
  const at::Tensor out = at::scaled_dot_product_attention(queries, keys.to(q.scalar_type()), values.to(q.scalar_type()),
                                                          attn_mask, 0.0, causal, scale, gqa);
  if (padded) {
    return out.transpose(1, 2).reshape({q.size(0), q.size(1), out.size(-1)}).contiguous();
  }
  if (single) {
    return out.select(0, 0).transpose(0, 1).contiguous();
  }
  return out.transpose(1, 2).index({*valid}).contiguous();
}

}  // namespace

TORCH_LIBRARY(metrale_cpu, m) {
  m.def("routed_experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, "
        "int expert_offset, int padded_min_experts) -> Tensor");
  m.impl("routed_experts", c10::DispatchKey::CPU, TORCH_FN(routed_experts));
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_plane, Tensor(b!) v_plane, bool write_v, "
        "Tensor cell_mapping, Tensor gather, Tensor? q_index, Tensor? valid, Tensor? mask, str mode, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
