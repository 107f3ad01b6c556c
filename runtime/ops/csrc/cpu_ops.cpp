// The CPU's routed experts, paged attention and few-row linears as native ops. The routed experts
// sort choices by expert and keep their books on plain host vectors instead of ~30 small tensor
// ops a layer (their host cost: docs/design.md §3.4); their GEMMs run the few-row kernel below up to
// `few_rows_max` rows an expert, else the same ATen kernels, in the same order, as the Python
// paths of runtime/model/experts.py (`RoutedExperts._per_expert`, `RoutedExperts._padded`), bit for bit.
// Built and loaded by runtime/ops/cpu_ops.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

// The kernel clock: wall time the calling threads spend inside the compute ops (linears, routed
// experts, paged attention) while it runs, for a step split without a profiler (whose recording
// changed these ops' times by up to 60% between runs: tools/eager_split.py). An op nested in
// another counts once. Off (the default), an op pays one relaxed load.
std::atomic<bool> g_clock_on{false};
std::atomic<int64_t> g_clock_ns{0};
thread_local int t_clock_depth = 0;

struct KernelClock {
  bool on;
  std::chrono::steady_clock::time_point t0;
  KernelClock() : on(t_clock_depth++ == 0 && g_clock_on.load(std::memory_order_relaxed)) {
    if (on) t0 = std::chrono::steady_clock::now();
  }
  ~KernelClock() {
    --t_clock_depth;
    if (on) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
      g_clock_ns.fetch_add(ns.count(), std::memory_order_relaxed);
    }
  }
};

// Starts (`on`) or stops the kernel clock; returns the nanoseconds it counted since the last call
// and starts the count again from 0.
int64_t kernel_clock(bool on) {
  g_clock_on.store(on, std::memory_order_relaxed);
  return g_clock_ns.exchange(0, std::memory_order_relaxed);
}

at::Tensor long_tensor(const std::vector<int64_t>& values) {
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), out.mutable_data_ptr<int64_t>());
  return out;
}

// ---- Few-row GEMMs: y[M, N] = x[M, K] . W^T, W [N, K] stored column-major (W^T [K, N] rows of
// stride ldw, as runtime.model.layers.pack_for_inference lays linears and experts out on the CPU).
// Why: at the few rows of a decode or verify step a GEMM is a stream of its weights, which MKL's
// GEMM reads far below the memory's bandwidth, and oneDNN's bfloat16 GEMM on a CPU without native
// bfloat16 (AVX2) is slower still (the figures: docs/design.md §3.4). This
// kernel streams W^T once per 4 rows, 16 columns at a time, with float accumulators (double for
// float64 weights).
// Each output is sum_k x[m, k] * w[k, n] in k order, one rounding per multiply and per add (no
// contraction, -ffp-contract=off), whatever the ISA clone, the number of rows, the thread split or
// the column's place in W: a row's result is its own (row-invariant), bit for bit across batch
// sizes, and a column's is its own in any slice of W's columns (an EP rank's heads or vocabulary
// rows: MKL's float64 GEMM on AVX2 rounds a column by where it sits in the matrix).
// A 32-byte vector of the accumulator type A: 8 floats (float32, bfloat16 weights) or 4 doubles.
template <typename A> struct Vector;
template <> struct Vector<float> { typedef float type __attribute__((vector_size(32))); };
template <> struct Vector<double> { typedef double type __attribute__((vector_size(32))); };
template <typename A> using vec_t = typename Vector<A>::type;
template <typename A> constexpr int kLanes = 32 / sizeof(A);

template <typename A, typename W>
inline vec_t<A> load_vec(const W* p) { vec_t<A> v; std::memcpy(&v, p, sizeof v); return v; }
template <>
inline vec_t<float> load_vec<float, c10::BFloat16>(const c10::BFloat16* p) {   // bfloat16 -> float: the 16 bits shifted up
  typedef uint16_t raw_t __attribute__((vector_size(16)));
  typedef uint32_t wide_t __attribute__((vector_size(32)));
  raw_t raw;
  std::memcpy(&raw, p, sizeof raw);
  const wide_t wide = __builtin_convertvector(raw, wide_t) << 16;   // one widening move and a shift
  vec_t<float> v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
template <typename A, typename W>
inline A widen(W v) { return static_cast<A>(v); }

constexpr int64_t kColumns = 16;   // output columns of one register tile (two float or four double vectors)
constexpr int64_t kRows = 4;       // rows of one register tile
constexpr int64_t kSpan = 16;      // tiles of one task: 256 columns, 1 KB of a float32 weight row
constexpr int64_t kDepth = 16;     // weight rows a tile reads before the next tile of the span
constexpr int64_t kPrefetch = 16;  // weight rows ahead (measured 4, 8, 16: 16 fastest here)

// Rows [0, MR) of x against columns [0, 16) of wt over `depth` weight rows: y[m, 0:16] (+)= ...
// `accumulate`: y holds the sums of the earlier rows, which continue in order.
template <typename A, typename W, int MR>
__attribute__((target_clones("avx2", "default")))
void tile16(const A* x, int64_t ldx, const W* wt, int64_t ldw, A* y, int64_t ldy, int64_t depth,
            bool accumulate) {
  constexpr int V = kColumns / kLanes<A>;   // vectors across the tile's columns
  vec_t<A> acc[MR][V] = {};
  if (accumulate) {
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) std::memcpy(&acc[m][j], y + m * ldy + j * kLanes<A>, sizeof(vec_t<A>));
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    __builtin_prefetch(wt + (k + kPrefetch) * ldw);
    vec_t<A> w[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) w[j] = load_vec<A, W>(wt + k * ldw + j * kLanes<A>);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const A xv = x[m * ldx + k];
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[m][j] = acc[m][j] + xv * w[j];
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) std::memcpy(y + m * ldy + j * kLanes<A>, &acc[m][j], sizeof(vec_t<A>));
  }
}

template <typename A, typename W>
void tile(int64_t mr, const A* x, int64_t ldx, const W* wt, int64_t ldw, A* y, int64_t ldy, int64_t depth,
          bool accumulate) {
  switch (mr) {
    case 1: tile16<A, W, 1>(x, ldx, wt, ldw, y, ldy, depth, accumulate); break;
    case 2: tile16<A, W, 2>(x, ldx, wt, ldw, y, ldy, depth, accumulate); break;
    case 3: tile16<A, W, 3>(x, ldx, wt, ldw, y, ldy, depth, accumulate); break;
    default: tile16<A, W, 4>(x, ldx, wt, ldw, y, ldy, depth, accumulate); break;
  }
}

// The float tile on AVX-512: 16 columns (one 64-byte vector) x MR rows over the whole depth, the
// same multiplies and adds in the same order as tile16 (so the same bits), 8 rows at a time in its
// 32 registers. Faster than tile16's AVX2 clone with the weights in L3 (12 or 16 rows at a time
// were no faster); from DRAM, as the embedded float32 model's 16-sequence step reads them, it gains
// nothing measurable (docs/design.md §3.4).
template <int MR>
__attribute__((target("avx512f")))
void tile16_avx512(const float* x, int64_t ldx, const float* wt, int64_t ldw, float* y, int64_t ldy, int64_t depth) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    __builtin_prefetch(wt + (k + kPrefetch) * ldw);
    const __m512 w = _mm512_loadu_ps(wt + k * ldw);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_set1_ps(x[m * ldx + k]), w));
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

// __builtin_cpu_init first: these run among the library's constructors, perhaps before libgcc's.
const bool g_avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));

void tile_avx512(int64_t mr, const float* x, int64_t ldx, const float* wt, int64_t ldw, float* y, int64_t ldy, int64_t depth) {
  switch (mr) {
    case 1: tile16_avx512<1>(x, ldx, wt, ldw, y, ldy, depth); break;
    case 2: tile16_avx512<2>(x, ldx, wt, ldw, y, ldy, depth); break;
    case 3: tile16_avx512<3>(x, ldx, wt, ldw, y, ldy, depth); break;
    case 4: tile16_avx512<4>(x, ldx, wt, ldw, y, ldy, depth); break;
    case 5: tile16_avx512<5>(x, ldx, wt, ldw, y, ldy, depth); break;
    case 6: tile16_avx512<6>(x, ldx, wt, ldw, y, ldy, depth); break;
    case 7: tile16_avx512<7>(x, ldx, wt, ldw, y, ldy, depth); break;
    default: tile16_avx512<8>(x, ldx, wt, ldw, y, ldy, depth); break;
  }
}

// Span `span` (kSpan tiles of 16 columns, fewer at the end) of y[M, N] = x[M, K] . wt[K, N].
// Up to 4 rows: the span's tiles take turns over kDepth weight rows at a time, a stream of whole
// spans of the weight rows. More rows: each tile's 16-column strip is read down the whole depth
// by every 4 (AVX-512: 8) rows in turn. With the weights in L3 the strip was faster from 2 rows,
// but a float32 model's weights come from DRAM (the embedded model's 50 MB against 32 MB of L3),
// and there the stream was faster in the model (docs/design.md §3.4).
template <typename A, typename W>
void gemm_span(const A* x, int64_t m_rows, int64_t kdim, const W* wt, int64_t ldw, int64_t n_cols,
               A* y, int64_t ldy, int64_t span, int64_t span_tiles) {
  const int64_t n0 = span * span_tiles * kColumns;
  const int64_t n1 = std::min(n_cols, n0 + span_tiles * kColumns);
  const int64_t full_end = n0 + (n1 - n0) / kColumns * kColumns;
  if (m_rows <= kRows) {   // a stream of the weights
    for (int64_t k0 = 0; k0 < kdim; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, kdim - k0);
      for (int64_t c = n0; c < full_end; c += kColumns) {
        tile<A, W>(m_rows, x + k0, kdim, wt + k0 * ldw + c, ldw, y + c, ldy, depth, k0 > 0);
      }
    }
  } else if (std::is_same_v<A, float> && std::is_same_v<W, float> && g_avx512) {   // the same, 8 rows in turn
    for (int64_t c = n0; c < full_end; c += kColumns) {
      for (int64_t m0 = 0; m0 < m_rows; m0 += 8) {
        tile_avx512(std::min<int64_t>(8, m_rows - m0), reinterpret_cast<const float*>(x) + m0 * kdim, kdim,
                    reinterpret_cast<const float*>(wt) + c, ldw, reinterpret_cast<float*>(y) + m0 * ldy + c, ldy, kdim);
      }
    }
  } else {   // each tile's 16-column strip down the depth, every 4 rows in turn
    for (int64_t c = n0; c < full_end; c += kColumns) {
      for (int64_t m0 = 0; m0 < m_rows; m0 += kRows) {
        tile<A, W>(std::min(kRows, m_rows - m0), x + m0 * kdim, kdim, wt + c, ldw, y + m0 * ldy + c, ldy, kdim, false);
      }
    }
  }
  for (int64_t m = 0; m < m_rows; ++m) {   // the last, narrow columns: the same sums one at a time
    for (int64_t n = full_end; n < n1; ++n) {
      A acc = 0;
      for (int64_t k = 0; k < kdim; ++k) acc = acc + x[m * kdim + k] * widen<A>(wt[k * ldw + n]);
      y[m * ldy + n] = acc;
    }
  }
}

// ---- bfloat16 GEMMs on bfloat16 dot products. With bfloat16 weights the rows stay bfloat16 and
// each output is summed a pair of k at a time, as AVX512-BF16's VDPBF16PS sums:
//   for each pair (2p, 2p + 1): acc = (acc + x[2p + 1] * w[2p + 1]) + x[2p] * w[2p]
// from acc = 0, the pairs in k order (an odd K's last k pairs with a zero). A product of two
// bfloat16 values is exact in float (8-bit significands) and each add rounds to nearest even.
// On a CPU with AVX512-BF16 the tile runs the instruction (twice the rate of float multiplies and
// adds here, docs/design.md §3.4); elsewhere, or after `use_bf16_dot_products(false)`,
// the same sums run as float multiplies and adds, with the same bits (checked against the
// instruction on this host: 20,000 random 4-pair sums, and the GEMMs in
// tests/runtime/ops/test_native_linear.py). Only sums below float's smallest normal (1.2e-38) differ:
// the instruction keeps such products exact and flushes such sums to zero.
// A row's result is its own in any batch, and a column's in any slice of the weight, as above.
constexpr int64_t kPairColumns = 32;   // output columns of one bfloat16 tile: two 16-float vectors
constexpr int64_t kPairSpan = 8;       // tiles of one task: 256 columns, 512 B of a weight row
constexpr int64_t kPairRows = 8;       // rows of one register tile (16 accumulators)

bool g_bf16_dot = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));

inline uint32_t bf16_pair(const c10::BFloat16* p, bool single) {   // (p[0], p[1]) or (p[0], 0)
  uint16_t lo, hi = 0;
  std::memcpy(&lo, p, 2);
  if (!single) std::memcpy(&hi, p + 1, 2);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// Rows [0, MR) of x (bfloat16, row stride ldx) against T tiles side by side, columns [0, 32 T) of
// wt, over its kdim rows: y[m, 0:32 T] = ... in float. Each k-pair reads T x 64 contiguous bytes of
// two weight rows; with one 64-byte strip a tile at a time down the whole depth, the 8 KB steps of
// a wide matrix's rows left too few reads in flight (docs/design.md §3.4).
template <int MR, int T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void pair_tile_native(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wt, int64_t ldw, float* y,
                      int64_t ldy, int64_t kdim) {
  // unpacklo/hi_epi16 interleave rows k and k + 1 within 128-bit lanes: lo's float lane l holds
  // column 8 (l / 4) + l % 4, hi's column 8 (l / 4) + 4 + l % 4, put back in order at the end.
  const __m512i from_0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i from_1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 lo[MR][T], hi[MR][T];
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < T; ++t) {
      lo[m][t] = _mm512_setzero_ps();
      hi[m][t] = _mm512_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + 1 < kdim; k += 2) {
    const c10::BFloat16* even_row = wt + k * ldw;
    const c10::BFloat16* odd_row = even_row + ldw;
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      __builtin_prefetch(even_row + kPrefetch * ldw + t * kPairColumns);
      __builtin_prefetch(odd_row + kPrefetch * ldw + t * kPairColumns);
    }
    __m512bh wlo[T], whi[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512i even = _mm512_loadu_si512(even_row + t * kPairColumns);
      const __m512i odd = _mm512_loadu_si512(odd_row + t * kPairColumns);
      wlo[t] = (__m512bh)_mm512_unpacklo_epi16(even, odd);
      whi[t] = (__m512bh)_mm512_unpackhi_epi16(even, odd);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(bf16_pair(x + m * ldx + k, false)));
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        lo[m][t] = _mm512_dpbf16_ps(lo[m][t], xv, wlo[t]);
        hi[m][t] = _mm512_dpbf16_ps(hi[m][t], xv, whi[t]);
      }
    }
  }
  if (k < kdim) {   // K odd: its last k with a zero partner
    const __m512i zero = _mm512_setzero_si512();
    for (int t = 0; t < T; ++t) {
      const __m512i even = _mm512_loadu_si512(wt + k * ldw + t * kPairColumns);
      const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(even, zero), wh = (__m512bh)_mm512_unpackhi_epi16(even, zero);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(bf16_pair(x + m * ldx + k, true)));
        lo[m][t] = _mm512_dpbf16_ps(lo[m][t], xv, wl);
        hi[m][t] = _mm512_dpbf16_ps(hi[m][t], xv, wh);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < T; ++t) {
      _mm512_storeu_ps(y + m * ldy + t * kPairColumns, _mm512_permutex2var_ps(lo[m][t], from_0, hi[m][t]));
      _mm512_storeu_ps(y + m * ldy + t * kPairColumns + 16, _mm512_permutex2var_ps(lo[m][t], from_1, hi[m][t]));
    }
  }
}

// One k-pair of the emulated bfloat16 sums for MR rows (x at the pair's first k): acc = (acc +
// x[k + 1] * odd) + x[k] * even, the odd one 0 for an odd K's last k (`single`).
template <int MR, int V>
__attribute__((always_inline)) inline void emulated_pair_step(vec_t<float> (&acc)[MR][V], const c10::BFloat16* x,
                                                              int64_t ldx, bool single, const vec_t<float>* even,
                                                              const vec_t<float>* odd) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    const float xe = static_cast<float>(x[m * ldx]);
    const float xo = single ? 0.0f : static_cast<float>(x[m * ldx + 1]);
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[m][j] = (acc[m][j] + xo * odd[j]) + xe * even[j];
  }
}

template <int MR, int V>
__attribute__((always_inline)) inline void store_sums(const vec_t<float> (&acc)[MR][V], float* y, int64_t ldy) {
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < V; ++j) std::memcpy(y + m * ldy + j * kLanes<float>, &acc[m][j], sizeof(vec_t<float>));
  }
}

// The same sums with float multiplies and adds.
template <int MR>
__attribute__((target_clones("avx2", "default")))
void pair_tile_emulated(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wt, int64_t ldw, float* y,
                        int64_t ldy, int64_t kdim) {
  constexpr int V = kPairColumns / kLanes<float>;
  vec_t<float> acc[MR][V] = {};
  for (int64_t k = 0; k < kdim; k += 2) {
    const bool single = k + 1 == kdim;
    __builtin_prefetch(wt + (k + kPrefetch) * ldw);
    vec_t<float> even[V], odd[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {
      even[j] = load_vec<float, c10::BFloat16>(wt + k * ldw + j * kLanes<float>);
      odd[j] = single ? vec_t<float>{} : load_vec<float, c10::BFloat16>(wt + (k + 1) * ldw + j * kLanes<float>);
    }
    emulated_pair_step<MR, V>(acc, x + k, ldx, single, even, odd);
  }
  store_sums<MR, V>(acc, y, ldy);
}

// T tiles (of 32 columns) side by side for MR rows: MR x T <= 8 (16 accumulators).
template <int MR, int T>
void pair_tile_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wt, int64_t ldw, float* y,
                    int64_t ldy, int64_t kdim) {
  if (g_bf16_dot) {
    pair_tile_native<MR, T>(x, ldx, wt, ldw, y, ldy, kdim);
    return;
  }
  for (int t = 0; t < T; ++t) {
    if constexpr (MR > 4) {   // 16 vector registers without AVX-512: four rows at a time
      pair_tile_emulated<4>(x, ldx, wt + t * kPairColumns, ldw, y + t * kPairColumns, ldy, kdim);
      pair_tile_emulated<MR - 4>(x + 4 * ldx, ldx, wt + t * kPairColumns, ldw, y + 4 * ldy + t * kPairColumns, ldy, kdim);
    } else {
      pair_tile_emulated<MR>(x, ldx, wt + t * kPairColumns, ldw, y + t * kPairColumns, ldy, kdim);
    }
  }
}

// Rows [0, mr) (mr <= kPairRows) of y[:, 0:32 tiles] = x . wt[:, 0:32 tiles] over all kdim rows of
// wt: one tile, or 8 / mr side by side for one or two rows.
void pair_tile(int64_t mr, int64_t tiles, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wt, int64_t ldw,
               float* y, int64_t ldy, int64_t kdim) {
  switch (mr * 16 + tiles) {
    case 16 + 1: pair_tile_rows<1, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 16 + 4: pair_tile_rows<1, 4>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 16 + 8: pair_tile_rows<1, 8>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 32 + 1: pair_tile_rows<2, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 32 + 4: pair_tile_rows<2, 4>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 48 + 1: pair_tile_rows<3, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 64 + 1: pair_tile_rows<4, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 80 + 1: pair_tile_rows<5, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 96 + 1: pair_tile_rows<6, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 112 + 1: pair_tile_rows<7, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    case 128 + 1: pair_tile_rows<8, 1>(x, ldx, wt, ldw, y, ldy, kdim); break;
    default: TORCH_CHECK(false, "pair_tile: ", mr, " rows x ", tiles, " tiles");
  }
}

// One column of the pair sums, for the columns past the last full tile.
float pair_column(const c10::BFloat16* x, const c10::BFloat16* w, int64_t ldw, int64_t kdim) {
  float acc = 0.0f;
  for (int64_t k = 0; k < kdim; k += 2) {
    const bool single = k + 1 == kdim;
    const float po = single ? 0.0f : static_cast<float>(x[k + 1]) * static_cast<float>(w[(k + 1) * ldw]);
    acc = (acc + po) + static_cast<float>(x[k]) * static_cast<float>(w[k * ldw]);
  }
  return acc;
}

// Span `span` (kPairSpan tiles of 32 columns, fewer at the end) of y[M, N] = x[M, K] . wt[K, N],
// x and wt bfloat16, y float: each tile's column strip read down the whole depth by every
// kPairRows rows of x in turn before the next tile's. (Reading it 16 to 256 rows at a time, with
// the sums kept in y in between, was slower at every depth, and a stream of 16-row slices over the
// span's tiles, as the float kernel's few rows take, slower at 2-4 rows: docs/design.md §3.4.)
void pair_gemm_span(const c10::BFloat16* x, int64_t m_rows, int64_t kdim, const c10::BFloat16* wt, int64_t ldw,
                    int64_t n_cols, float* y, int64_t ldy, int64_t span, int64_t span_tiles) {
  const int64_t n0 = span * span_tiles * kPairColumns;
  const int64_t n1 = std::min(n_cols, n0 + span_tiles * kPairColumns);
  const int64_t full_end = n0 + (n1 - n0) / kPairColumns * kPairColumns;
  // One row: 8 tiles side by side (4 where the span has 4-7 left), two rows: 4; more: one tile, 8
  // rows at a time. (3-4 rows with 2 tiles side by side were slower: docs/design.md §3.4.)
  const int64_t side = m_rows <= 2 ? kPairRows / m_rows : 1;
  for (int64_t c = n0; c < full_end;) {
    const int64_t left = (full_end - c) / kPairColumns;
    const int64_t tiles = left >= side ? side : (side == 8 && left >= 4 ? 4 : 1);
    for (int64_t m0 = 0; m0 < m_rows; m0 += kPairRows) {
      pair_tile(std::min(kPairRows, m_rows - m0), tiles, x + m0 * kdim, kdim, wt + c, ldw, y + m0 * ldy + c, ldy, kdim);
    }
    c += tiles * kPairColumns;
  }
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t n = full_end; n < n1; ++n) y[m * ldy + n] = pair_column(x + m * kdim, wt + n, ldw, kdim);
  }
}

// ---- Packed bfloat16 weights: one stream per panel ----
// A bfloat16 weight w [N, K] (N a multiple of 32) packed for the few-row kernel, stored as a
// [N, ceil(K/2), 2] tensor whose storage is in panel order: panels of kPanel columns (the last one
// 32 wide when N mod kPanel is 32), each panel its ceil(K/2) pair rows one after another, a pair
// row its columns' (w[n, k], w[n, k + 1]) in column order (0 for the partner of an odd K's last
// k). A panel is two tiles, so each step down the depth reads the next bytes of one stream per
// panel instead of two weight rows N x 2 bytes apart, the pairs interleaved as the dot-product
// instruction takes them, and a panel's whole depth (K = 256: 16 KB) stays in L1 while every
// 4 rows of x pass over it. Same sums in the same order as the unpacked tiles above, so the same
// bits (tests/runtime/ops/test_native_linear.py). (Panels of 256 columns, one row's 8 tiles a single
// stream, were faster still for a wide matrix's few rows but no faster at 16 rows: at a 1 KB
// pair-row stride the 4-row passes over a 2-tile strip missed L1. Timings in and out of the model:
// docs/design.md §3 and §3.4.)
constexpr int64_t kPanel = 64;

// The first element of tile `tile` (of 32 columns) of a packed weight with `pairs` pair rows, and
// the elements from one of its pair rows to the next.
inline const c10::BFloat16* packed_tile_at(const c10::BFloat16* packed, int64_t pairs, int64_t tile) {
  return packed + (tile / 2) * kPanel * pairs * 2 + (tile % 2) * 2 * kPairColumns;
}
inline int64_t packed_row_stride(int64_t n_cols, int64_t tile) {
  return 2 * std::min(kPanel, n_cols - (tile / 2) * kPanel);
}

// MR rows of x against T tiles side by side from T / 2 panels (T = 1: one tile of any panel):
// tile t's first pair row at `wp` + (t / 2) * `ps` + (t % 2) * 64, pair rows `rs` apart.
template <int MR, int T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void packed_tile_native(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wp, int64_t rs, int64_t ps,
                        float* y, int64_t ldy, int64_t kdim) {
  __m512 acc[MR][2 * T];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < 2 * T; ++v) acc[m][v] = _mm512_setzero_ps();
  }
  const int64_t pairs = (kdim + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const c10::BFloat16* row = wp + p * rs;
    __m512bh w[2 * T];
#pragma GCC unroll 16
    for (int v = 0; v < 2 * T; ++v) w[v] = (__m512bh)_mm512_loadu_si512(row + (v / 4) * ps + (v % 4) * 32);
    const bool single = 2 * p + 1 == kdim;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(bf16_pair(x + m * ldx + 2 * p, single)));
#pragma GCC unroll 16
      for (int v = 0; v < 2 * T; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < 2 * T; ++v) _mm512_storeu_ps(y + m * ldy + v * 16, acc[m][v]);
  }
}

// One tile's sums with float multiplies and adds, as pair_tile_emulated: each 32-bit lane of a
// pair row holds a column's (even, odd) bfloat16 pair, widened by shifting.
template <int MR>
__attribute__((target_clones("avx2", "default")))
void packed_tile_emulated(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wp, int64_t rs, float* y,
                          int64_t ldy, int64_t kdim) {
  typedef uint32_t bits_t __attribute__((vector_size(32)));
  constexpr int V = kPairColumns / kLanes<float>;
  vec_t<float> acc[MR][V] = {};
  const int64_t pairs = (kdim + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const bool single = 2 * p + 1 == kdim;
    vec_t<float> even[V], odd[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {
      bits_t u, lo, hi;
      std::memcpy(&u, wp + p * rs + j * 2 * kLanes<float>, sizeof u);
      lo = u << 16;
      hi = u & 0xffff0000u;
      std::memcpy(&even[j], &lo, sizeof lo);
      std::memcpy(&odd[j], &hi, sizeof hi);
    }
    emulated_pair_step<MR, V>(acc, x + 2 * p, ldx, single, even, odd);
  }
  store_sums<MR, V>(acc, y, ldy);
}

template <int MR, int T>
void packed_tile_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wp, int64_t rs, int64_t ps,
                      float* y, int64_t ldy, int64_t kdim) {
  if (g_bf16_dot) {
    packed_tile_native<MR, T>(x, ldx, wp, rs, ps, y, ldy, kdim);
    return;
  }
  for (int t = 0; t < T; ++t) {
    packed_tile_emulated<MR>(x, ldx, wp + (t / 2) * ps + (t % 2) * 2 * kPairColumns, rs, y + t * kPairColumns, ldy, kdim);
  }
}

// mr (1-4) rows against `tiles` (1, 2, 4 or 8; mr x tiles <= 8) tiles side by side.
void packed_tile(int64_t mr, int64_t tiles, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wp, int64_t rs,
                 int64_t ps, float* y, int64_t ldy, int64_t kdim) {
  switch (mr * 16 + tiles) {
    case 16 + 1: packed_tile_rows<1, 1>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 16 + 2: packed_tile_rows<1, 2>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 16 + 4: packed_tile_rows<1, 4>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 16 + 8: packed_tile_rows<1, 8>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 32 + 1: packed_tile_rows<2, 1>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 32 + 2: packed_tile_rows<2, 2>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 32 + 4: packed_tile_rows<2, 4>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 48 + 1: packed_tile_rows<3, 1>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 48 + 2: packed_tile_rows<3, 2>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 64 + 1: packed_tile_rows<4, 1>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    case 64 + 2: packed_tile_rows<4, 2>(x, ldx, wp, rs, ps, y, ldy, kdim); break;
    default: TORCH_CHECK(false, "packed_tile: ", mr, " rows x ", tiles, " tiles");
  }
}

// Span `span` (span_tiles tiles of 32 columns) of y[M, N] = x[M, K] . w^T from the packed w: one
// row 8 tiles side by side (4 panels, 4 streams), two 4, more 2 (one panel) for every 4 rows
// (no slower than 8 rows of one tile at 8 and 16 rows: docs/design.md §3.4). A tile
// that starts a group off a panel's first tile, or lies in a 32-wide last panel, goes alone.
void packed_gemm_span(const c10::BFloat16* x, int64_t m_rows, int64_t kdim, const c10::BFloat16* packed,
                      int64_t n_cols, float* y, int64_t ldy, int64_t span, int64_t span_tiles) {
  const int64_t pairs = (kdim + 1) / 2, full_tiles = n_cols / kPanel * 2;   // tiles in 64-wide panels
  const int64_t t0 = span * span_tiles, t1 = std::min(n_cols / kPairColumns, t0 + span_tiles);
  const int64_t side = m_rows == 1 ? 8 : m_rows == 2 ? 4 : 2, group = m_rows <= 2 ? m_rows : 4;
  for (int64_t t = t0; t < t1;) {
    const int64_t left = std::min(t1, full_tiles) - t;
    const int64_t tiles = t % 2 != 0 || left < 2 ? 1 : left >= side ? side : left >= 4 ? 4 : 2;
    const c10::BFloat16* wp = packed_tile_at(packed, pairs, t);
    const int64_t rs = packed_row_stride(n_cols, t), ps = kPanel * pairs * 2;
    for (int64_t m0 = 0; m0 < m_rows; m0 += group) {
      packed_tile(std::min(group, m_rows - m0), tiles, x + m0 * kdim, kdim, wp, rs, ps, y + m0 * ldy + t * kPairColumns,
                  ldy, kdim);
    }
    t += tiles;
  }
}

// ---- Packed float32 weights: one stream per 16 columns ----
// A float32 weight w [N, K] (N a multiple of 16) packed for the few-row kernel: a [N, K] tensor
// whose storage holds panels of kColumns (16) columns one after another, a panel its K rows of 16
// floats, so a tile reads one contiguous stream down the depth (its 16 KB at K = 256 stay in L1
// while every group of rows passes over it) and several tiles side by side are several streams.
// The unpacked column-major weight's tile reads 64 bytes a row N x 4 bytes apart. Same sums in
// the same order (each column: its products added in k order from zero), so the same bits
// (tests/runtime/ops/test_native_linear.py).

// MR rows of x against T panels side by side (T streams): MR x T accumulators of 16 floats. From
// 5 rows (one panel a pass) the panel's rows are prefetched 32 ahead, which paid at 16 sequences of
// the float32 model (weights from DRAM); for 1-4 rows, several panels a pass, it cost time at one
// sequence (docs/design.md §3.4).
template <int MR, int T>
__attribute__((target("avx512f")))
void packed_f32_native(const float* x, int64_t ldx, const float* wp, int64_t ps, float* y, int64_t ldy,
                       int64_t kdim) {
  __m512 acc[MR][T];
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < T; ++t) acc[m][t] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kdim; ++k) {
    __m512 w[T];
    if constexpr (MR > 4) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 32) * kColumns), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) w[t] = _mm512_loadu_ps(wp + t * ps + k * kColumns);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[m][t] = _mm512_add_ps(acc[m][t], _mm512_mul_ps(xv, w[t]));
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + m * ldy + t * kColumns, acc[m][t]);
  }
}

// mr (1-8) rows against `tiles` panels as packed_f32_span groups them; without AVX-512, the
// float tile (tile16: the same bits) on each panel, its rows kColumns floats apart.
void packed_f32_tile(int64_t mr, int64_t tiles, const float* x, int64_t ldx, const float* wp, int64_t ps, float* y,
                     int64_t ldy, int64_t kdim) {
  if (!g_avx512) {
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t m0 = 0; m0 < mr; m0 += kRows) {
        tile<float, float>(std::min(kRows, mr - m0), x + m0 * ldx, ldx, wp + t * ps, kColumns,
                           y + m0 * ldy + t * kColumns, ldy, kdim, false);
      }
    }
    return;
  }
  switch (mr * 16 + tiles) {
    case 16 + 1: packed_f32_native<1, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 16 + 2: packed_f32_native<1, 2>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 16 + 4: packed_f32_native<1, 4>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 16 + 8: packed_f32_native<1, 8>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 32 + 1: packed_f32_native<2, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 32 + 2: packed_f32_native<2, 2>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 32 + 4: packed_f32_native<2, 4>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 48 + 1: packed_f32_native<3, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 48 + 2: packed_f32_native<3, 2>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 64 + 1: packed_f32_native<4, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 64 + 2: packed_f32_native<4, 2>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 80 + 1: packed_f32_native<5, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 96 + 1: packed_f32_native<6, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 112 + 1: packed_f32_native<7, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    case 128 + 1: packed_f32_native<8, 1>(x, ldx, wp, ps, y, ldy, kdim); break;
    default: TORCH_CHECK(false, "packed_f32_tile: ", mr, " rows x ", tiles, " tiles");
  }
}

// Span `span` (span_tiles tiles of 16 columns) of y[M, N] = x[M, K] . w^T from the packed float32
// w: one row 8 panels side by side, two 4, 3-4 rows 2, more one panel for every 8 rows (as the
// unpacked AVX-512 tile; 4 rows x 4 panels and 8 x 2 were slower than the unpacked tile). Timings
// in and out of the model: docs/design.md §3 and §3.4.
void packed_f32_span(const float* x, int64_t m_rows, int64_t kdim, const float* packed, int64_t n_cols, float* y,
                     int64_t ldy, int64_t span, int64_t span_tiles) {
  const int64_t t0 = span * span_tiles, t1 = std::min(n_cols / kColumns, t0 + span_tiles);
  const int64_t side = m_rows == 1 ? 8 : m_rows == 2 ? 4 : m_rows <= 4 ? 2 : 1, group = m_rows <= 4 ? m_rows : 8;
  const int64_t ps = kColumns * kdim;   // floats of one panel
  for (int64_t t = t0; t < t1;) {
    const int64_t left = t1 - t;
    const int64_t tiles = left >= side ? side : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    for (int64_t m0 = 0; m0 < m_rows; m0 += group) {
      packed_f32_tile(std::min(group, m_rows - m0), tiles, x + m0 * kdim, kdim, packed + t * ps, ps,
                      y + m0 * ldy + t * kColumns, ldy, kdim);
    }
    t += tiles;
  }
}

// w [N, K] or [E, N, K] float32 (any strides), N a multiple of 16 -> its packed form, the same
// shape (each matrix packed on its own, one after another).
at::Tensor pack_f32(const at::Tensor& w) {
  const at::Tensor w3 = w.dim() == 2 ? w.unsqueeze(0) : w;
  const int64_t e_count = w3.size(0), n_cols = w3.size(1), kdim = w3.size(2);
  TORCH_CHECK(n_cols % kColumns == 0 && kdim > 0, "pack: a float32 weight's N must be a multiple of ", kColumns,
              " and K positive, got ", w.sizes());
  at::Tensor out = at::empty({e_count, n_cols, kdim}, w.options());
  const auto src = w3.accessor<float, 3>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, e_count * n_cols, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / n_cols, n = i % n_cols;
      float* base = dst + e * n_cols * kdim + (n / kColumns) * kColumns * kdim + n % kColumns;
      for (int64_t k = 0; k < kdim; ++k) base[k * kColumns] = src[e][n][k];
    }
  });
  return w.dim() == 2 ? out.squeeze(0) : out;
}

// w [N, K] or [E, N, K] bfloat16 (any strides), N a multiple of 32 -> its packed form, [N,
// ceil(K/2), 2] or [E, N, ceil(K/2), 2] (each matrix packed on its own, one after another);
// float32 (N a multiple of 16): pack_f32.
at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK((w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat) && w.device().is_cpu() &&
              (w.dim() == 2 || w.dim() == 3),
              "pack: a CPU bfloat16 or float32 [N, K] or [E, N, K] weight expected, got ", w.scalar_type(), " ", w.sizes());
  if (w.scalar_type() == at::kFloat) {
    return pack_f32(w);
  }
  const at::Tensor w3 = w.dim() == 2 ? w.unsqueeze(0) : w;
  const int64_t e_count = w3.size(0), n_cols = w3.size(1), kdim = w3.size(2), pairs = (kdim + 1) / 2;
  TORCH_CHECK(n_cols % kPairColumns == 0 && kdim > 0, "pack: a bfloat16 weight's N must be a multiple of ", kPairColumns,
              " and K positive, got ", w.sizes());
  at::Tensor out = at::zeros({e_count, n_cols, pairs, 2}, w.options());
  const auto src = w3.accessor<c10::BFloat16, 3>();
  c10::BFloat16* dst = out.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(0, e_count * n_cols, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / n_cols, n = i % n_cols, panel = n / kPanel, pw = std::min(kPanel, n_cols - panel * kPanel);
      c10::BFloat16* base = dst + e * n_cols * pairs * 2 + panel * kPanel * pairs * 2 + (n - panel * kPanel) * 2;
      for (int64_t k = 0; k < kdim; ++k) base[(k / 2) * 2 * pw + k % 2] = src[e][n][k];
    }
  });
  return w.dim() == 2 ? out.squeeze(0) : out;
}

void check_packed(const at::Tensor& packed, int64_t dims, int64_t kdim, const char* what) {
  if (packed.scalar_type() == at::kFloat) {
    TORCH_CHECK(packed.dim() == dims - 1 && packed.size(-1) == kdim && packed.size(-2) % kColumns == 0 &&
                packed.is_contiguous(), what, ": a packed float32 weight (pack) for K = ", kdim, " expected, got ",
                packed.sizes());
    return;
  }
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == dims && packed.size(-1) == 2 &&
              packed.size(-2) == (kdim + 1) / 2 && packed.size(-3) % kPairColumns == 0 && packed.is_contiguous(),
              what, ": a packed bfloat16 weight (pack) for K = ", kdim, " expected, got ", packed.scalar_type(),
              " ", packed.sizes());
}

// Tiles of a span: kSpan, fewer when `parts` matrices of `n_cols` columns would then give fewer
// spans than threads.
int64_t span_tiles(int64_t n_cols, int64_t parts, int64_t columns = kColumns, int64_t most = kSpan) {
  const int64_t tiles = (n_cols + columns - 1) / columns;
  const int64_t threads = at::get_num_threads();
  return std::clamp<int64_t>(tiles * parts / threads, 1, most);
}
int64_t column_spans(int64_t n_cols, int64_t tiles, int64_t columns = kColumns) {
  return (n_cols + tiles * columns - 1) / (tiles * columns);
}

// Whether `w` [N, K] (or each matrix of [E, N, K]) is column-major: its transpose's rows contiguous.
bool column_major(const at::Tensor& w) {
  const int64_t d = w.dim();
  return w.stride(d - 2) == 1 && w.stride(d - 1) == w.size(d - 2);
}

bool few_row_kernel(const at::Tensor& x, const at::Tensor& w, int64_t rows, int64_t max_rows) {
  const auto type = x.scalar_type();
  return (type == at::kFloat || type == at::kBFloat16 || type == at::kDouble) && w.scalar_type() == type &&
         rows <= max_rows && column_major(w);
}

// float -> bfloat16, rounded to nearest even as c10::BFloat16 (and at::to) round; NaN -> 0x7fc0.
// Sixteen at a time in vectors (the same integer steps), the tail one by one.
__attribute__((target_clones("avx512f", "avx2", "default")))
void round_to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    u32x16 u;
    std::memcpy(&u, src + i, sizeof u);
    const u32x16 nan = (u & 0x7fffffffu) > 0x7f800000u;   // all ones where NaN
    const u32x16 r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | (nan & 0x7fc0u);
    const u16x16 h = __builtin_convertvector(r, u16x16);
    std::memcpy(dst + i, &h, sizeof h);
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    const uint16_t r = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    std::memcpy(dst + i, &r, 2);
  }
}

// A float buffer of the calling thread for a GEMM's sums before they are rounded to bfloat16:
// reused from call to call, so a GEMM allocates only its output. (Faster than a float output rounded
// by at::to in the embedded bfloat16 model: docs/design.md §3.4.)
float* scratch_floats(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// x [..., K] (rows of it) . w^T (+ bias) -> bfloat16 [..., N] (`shape`): each task runs
// `span_sums(x, sums, span, tiles)` for its span of the columns into a reused float buffer of the
// calling thread, then rounds its columns' sums (bias added first, in float) into the output.
template <typename F>
at::Tensor bf16_linear(const at::Tensor& x, int64_t rows, int64_t kdim, int64_t n_cols,
                       const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& shape, F&& span_sums) {
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor xb = x.reshape({rows, kdim}).contiguous();
  const at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!has_bias || bf.numel() == n_cols, "linear: bias of ", bf.numel(), " for ", n_cols, " columns");
  at::Tensor y = at::empty({rows, n_cols}, x.options());
  const c10::BFloat16* xp = xb.const_data_ptr<c10::BFloat16>();
  const float* bp = has_bias ? bf.const_data_ptr<float>() : nullptr;
  c10::BFloat16* out = y.mutable_data_ptr<c10::BFloat16>();
  float* sums = scratch_floats(rows * n_cols);
  const int64_t tiles = span_tiles(n_cols, 1, kPairColumns, kPairSpan);
  at::parallel_for(0, column_spans(n_cols, tiles, kPairColumns), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      span_sums(xp, sums, b, tiles);
      const int64_t n0 = b * tiles * kPairColumns, n1 = std::min(n_cols, n0 + tiles * kPairColumns);
      for (int64_t m = 0; m < rows; ++m) {
        float* row = sums + m * n_cols;
        if (bp != nullptr) {
          for (int64_t n = n0; n < n1; ++n) row[n] = row[n] + bp[n];
        }
        round_to_bf16(row + n0, out + m * n_cols + n0, n1 - n0);
      }
    }
  });
  return y.view(shape);
}

// x [..., K] . w^T (+ bias) through the few-row kernel when x has at most `max_rows` rows, its
// type is float32 or bfloat16 and w is column-major; at::linear otherwise. `packed` (bfloat16:
// pack_weight of w, or none) is read instead of w by that kernel, the same bits: the choice stays
// in here, so a compiled step's graph holds for every row count (no guard on the rows). With bfloat16 weights
// each task rounds its own columns' float sums to the bfloat16 output (bias added first, in float).
// Measured and not kept: GEMMs of up to 256 KB of bfloat16 weights on the calling thread alone,
// faster alone, made the embedded model faster without speculation but slower with drafts
// (docs/design.md §3.4).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t max_rows,
                  const c10::optional<at::Tensor>& packed) {
  const KernelClock clock;
  TORCH_CHECK(x.device().is_cpu(), "metrale_cpu::linear runs on the CPU, got ", x.device());
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1),
              "linear: x [..., K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t kdim = w.size(1), n_cols = w.size(0);
  const int64_t rows = kdim == 0 ? 0 : x.numel() / kdim;
  const bool from_packed = packed.has_value() && packed->defined();
  if (from_packed) {
    check_packed(*packed, 3, kdim, "metrale_cpu::linear");
    TORCH_CHECK(packed->size(0) == n_cols && packed->scalar_type() == w.scalar_type(), "linear: packed weight ",
                packed->scalar_type(), " ", packed->sizes(), " for w ", w.scalar_type(), " ", w.sizes());
  }
  if (!few_row_kernel(x, w, rows, max_rows) || rows == 0 || kdim == 0) {
    return at::linear(x, w, bias);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_cols;
  const bool has_bias = bias.has_value() && bias->defined();
  const int64_t ldw = w.stride(1);
  if (w.scalar_type() == at::kBFloat16 && from_packed) {   // the same sums from the packed copy
    const c10::BFloat16* pp = packed->const_data_ptr<c10::BFloat16>();
    return bf16_linear(x, rows, kdim, n_cols, bias, shape, [&](const c10::BFloat16* xp, float* sums, int64_t b, int64_t tiles) {
      packed_gemm_span(xp, rows, kdim, pp, n_cols, sums, n_cols, b, tiles);
    });
  }
  if (w.scalar_type() == at::kBFloat16) {   // bfloat16 rows on bfloat16 dot products
    const c10::BFloat16* wp = w.const_data_ptr<c10::BFloat16>();
    return bf16_linear(x, rows, kdim, n_cols, bias, shape, [&](const c10::BFloat16* xp, float* sums, int64_t b, int64_t tiles) {
      pair_gemm_span(xp, rows, kdim, wp, ldw, n_cols, sums, n_cols, b, tiles);
    });
  }
  const at::ScalarType acc_type = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor yf = at::empty({rows, n_cols}, x.options().dtype(acc_type));
  const at::Tensor xf = x.reshape({rows, kdim}).to(acc_type).contiguous();
  const int64_t tiles = span_tiles(n_cols, 1);
  if (w.scalar_type() == at::kFloat && from_packed && packed->scalar_type() == at::kFloat) {   // the same sums
    const float* pp = packed->const_data_ptr<float>();
    const float* xp = xf.const_data_ptr<float>();
    float* yp = yf.mutable_data_ptr<float>();
    at::parallel_for(0, column_spans(n_cols, tiles), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) packed_f32_span(xp, rows, kdim, pp, n_cols, yp, n_cols, b, tiles);
    });
    if (has_bias) {
      yf.add_(*bias);
    }
    return yf.view(shape);
  }
  const auto run = [&](const auto* xp, auto* yp, const auto* wp) {
    at::parallel_for(0, column_spans(n_cols, tiles), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) gemm_span(xp, rows, kdim, wp, ldw, n_cols, yp, n_cols, b, tiles);
    });
  };
  if (acc_type == at::kDouble) {
    run(xf.const_data_ptr<double>(), yf.mutable_data_ptr<double>(), w.const_data_ptr<double>());
  } else {
    run(xf.const_data_ptr<float>(), yf.mutable_data_ptr<float>(), w.const_data_ptr<float>());
  }
  if (has_bias) {
    yf.add_(*bias);
  }
  return (x.scalar_type() == acc_type ? yf : yf.to(x.scalar_type())).view(shape);
}

// exp of eight floats as Cephes' expf computes it: the argument clamped to [-87, 88], reduced by
// ln 2 in two parts, a degree-5 polynomial, scaled by 2^n through the exponent bits; within 2 ulp
// of exp. The same operations in every lane and on every ISA clone (no contraction).
inline vec_t<float> exp_lanes(vec_t<float> x) {
  typedef int32_t ivec_t __attribute__((vector_size(32)));
  using V = vec_t<float>;
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round to nearest
  V r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const ivec_t bits = (__builtin_convertvector(fx, ivec_t) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// f(lanes) over n floats eight at a time, the tail in a zero-padded vector: every value takes the
// same operations wherever it sits, so a row's result does not depend on the batch.
template <typename F>
inline void map_lanes(int64_t n, F&& f) {
  constexpr int L = kLanes<float>;
  int64_t j = 0;
  for (; j + L <= n; j += L) f(j, L);
  if (j < n) f(j, n - j);
}

inline vec_t<float> load_lanes(const float* p, int64_t count) {
  vec_t<float> v = {};
  std::memcpy(&v, p, count * sizeof(float));
  return v;
}

inline void store_lanes(float* p, const vec_t<float>& v, int64_t count) { std::memcpy(p, &v, count * sizeof(float)); }

// silu(gate) * up for n values: gate / (1 + exp(-gate)) * up with exp_lanes (within 2.4 ulp of the
// double result; std::exp's version 2.3), several times faster than std::exp (docs/design.md §3.4).
__attribute__((target_clones("avx2", "default")))
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  map_lanes(n, [&](int64_t j, int64_t count) {
    const vec_t<float> g = load_lanes(gate + j, count), u = load_lanes(up + j, count);
    store_lanes(out + j, g / (exp_lanes(-g) + 1.0f) * u, count);
  });
}

// Tasks [0, n) of estimated costs `cost` shared among the pool's threads, each (the costliest
// first, ties by index) given to the thread with the least work so far: the tasks of each thread,
// in index order. With experts of unequal row counts, or sequences of unequal lengths, a
// contiguous split of the tasks leaves one thread waiting for the other. Which thread runs a task
// does not change what it computes.
std::vector<std::vector<int64_t>> balanced_tasks(const std::vector<int64_t>& cost) {
  const int64_t n = static_cast<int64_t>(cost.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> order(n), load(threads, 0), owner(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  for (int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    owner[i] = t;
    load[t] += cost[i];
  }
  std::vector<std::vector<int64_t>> lists(threads);
  for (int64_t i = 0; i < n; ++i) lists[owner[i]].push_back(i);
  return lists;
}

template <typename F>
void run_balanced(const std::vector<int64_t>& cost, F&& task) {
  const auto lists = balanced_tasks(cost);
  at::parallel_for(0, static_cast<int64_t>(lists.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i : lists[t]) task(i);
    }
  });
}

// The routed experts through the few-row kernel, every touched expert's column blocks of one
// projection spread over the threads together: xs [L, H] rows in expert-major order (float; the
// weights' type for bfloat16, whose GEMMs run on pair sums), expert e's rows at first[e] for
// counts[e]. silu(gate) * up in float, rounded to bfloat16 before the down projection only when the
// weights are bfloat16 -> ys [L, H] float. `gate_up_packed` / `down_packed` (nullptr: none): the
// same matrices packed (pack_weight), read instead of gate_up / down, the same bits.
template <typename W>
at::Tensor few_row_experts(const at::Tensor& xs, const at::Tensor& gate_up, const at::Tensor& down,
                           const std::vector<int64_t>& first, const std::vector<int64_t>& counts,
                           const W* gate_up_packed = nullptr, const W* down_packed = nullptr) {
  constexpr bool pairs = std::is_same_v<W, c10::BFloat16>;
  using X = std::conditional_t<pairs, c10::BFloat16, float>;   // the GEMMs' row type
  const int64_t rows = xs.size(0), h = xs.size(1), two_i = gate_up.size(1), inter = two_i / 2;
  std::vector<int64_t> touched;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] > 0) touched.push_back(e);
  }
  const int64_t nt = static_cast<int64_t>(touched.size());
  const at::TensorOptions as_float = xs.options().dtype(at::kFloat);
  at::Tensor gu = at::empty({rows, two_i}, as_float);
  at::Tensor act = at::empty({rows, inter}, xs.options());
  at::Tensor ys = at::empty({rows, h}, as_float);
  const X* xp = xs.const_data_ptr<X>();
  float* gp = gu.mutable_data_ptr<float>();
  X* ap = act.mutable_data_ptr<X>();
  float* yp = ys.mutable_data_ptr<float>();
  const W* gw = gate_up.const_data_ptr<W>();
  const W* dw = down.const_data_ptr<W>();
  const int64_t gs = gate_up.stride(0), ds = down.stride(0);
  // From packed matrices, each expert's columns in at least two spans (more where there are fewer
  // experts than threads), so the balanced tasks below can split every expert's work between
  // threads: a span of panels is still whole streams. Unpacked column-major ones keep spans of
  // whole rows where they can (from DRAM, float32 at 16 sequences, half rows a task were slower:
  // docs/design.md §3.4).
  const int64_t columns = pairs ? kPairColumns : kColumns, most = pairs ? kPairSpan : kSpan;
  const int64_t want = std::max<int64_t>(2, (at::get_num_threads() + nt - 1) / std::max<int64_t>(nt, 1));
  const auto tiles_of = [&](int64_t n_cols) {
    return gate_up_packed != nullptr ? std::clamp<int64_t>((n_cols + columns - 1) / columns / want, 1, most)
                                     : span_tiles(n_cols, nt, columns, most);
  };
  const int64_t gt = tiles_of(two_i), dt = tiles_of(h);
  const int64_t gb = column_spans(two_i, gt, columns), db = column_spans(h, dt, columns);
  const auto costs = [&](int64_t spans, int64_t tiles) {   // rows (+1: the weights' stream) x columns
    std::vector<int64_t> c(nt * spans);
    for (int64_t i = 0; i < nt * spans; ++i) c[i] = (counts[touched[i / spans]] + 1) * tiles;
    return c;
  };
  const auto span_gemm = [&](const X* x, int64_t m, int64_t kdim, const W* w, int64_t n, float* y, int64_t span,
                             int64_t tiles, const W* packed) {
    if constexpr (pairs) {
      if (packed != nullptr) {
        packed_gemm_span(x, m, kdim, packed, n, y, n, span, tiles);
      } else {
        pair_gemm_span(x, m, kdim, w, n, n, y, n, span, tiles);
      }
    } else if (packed != nullptr) {
      packed_f32_span(x, m, kdim, packed, n, y, n, span, tiles);
    } else {
      gemm_span(x, m, kdim, w, n, n, y, n, span, tiles);
    }
  };
  // Elements of one expert's packed matrix of `n` x `kdim`.
  const auto packed_size = [&](int64_t n, int64_t kdim) { return pairs ? n * ((kdim + 1) / 2) * 2 : n * kdim; };
  // Always on the pool: each expert's GEMMs on a thread of their own beat one thread
  // (docs/design.md §3.4).
  run_balanced(costs(gb, gt), [&](int64_t i) {
    const int64_t e = touched[i / gb];
    span_gemm(xp + first[e] * h, counts[e], h, gw + e * gs, two_i, gp + first[e] * two_i, i % gb, gt,
              gate_up_packed == nullptr ? nullptr : gate_up_packed + e * packed_size(two_i, h));
  });
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(pairs ? inter : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * two_i;
      if constexpr (pairs) {   // rounded as static_cast<c10::BFloat16> rounds
        silu_mul(g, g + inter, row.data(), inter);
        round_to_bf16(row.data(), ap + r * inter, inter);
      } else {
        silu_mul(g, g + inter, ap + r * inter, inter);
      }
    }
  });
  run_balanced(costs(db, dt), [&](int64_t i) {
    const int64_t e = touched[i / db];
    span_gemm(ap + first[e] * inter, counts[e], inter, dw + e * ds, h, yp + first[e] * h, i % db, dt,
              down_packed == nullptr ? nullptr : down_packed + e * packed_size(h, inter));
  });
  return ys;
}

// Padding rows the padded path may add per touched expert (`routed_experts`).
constexpr int64_t kPaddedWasteRows = 64;

// x [T, H], weights/ids [T, k] (global expert ids), gate_up [E, 2I, H], down [E, H, I] ->
// the weighted sum over this shard's experts [T, H]; choices routed elsewhere contribute zero.
// `padded_min_experts` > 0: from that many touched local experts, every expert's rows are padded
// to the busiest count and each projection is one batched matmul (`_padded`); else one GEMM pair
// per touched expert (`_per_expert`).
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                          const at::Tensor& gate_up, const at::Tensor& down, int64_t expert_offset,
                          int64_t padded_min_experts, int64_t few_rows_max,
                          const c10::optional<at::Tensor>& gate_up_packed, const c10::optional<at::Tensor>& down_packed) {
  const KernelClock clock;
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
  if (mine > 0 && x.scalar_type() != at::kDouble && few_row_kernel(x, gate_up, busiest, few_rows_max) && column_major(down) &&
      down.scalar_type() == x.scalar_type()) {
    // The few-row kernel: every touched expert's GEMMs summed in float, and the weighted sum over a
    // row's choices in float (choice order), rounded once to x's type.
    std::vector<int64_t> rows(mine), place(n, -1);
    for (int64_t j = 0; j < mine; ++j) {
      rows[j] = order[j] / k;
      place[order[j]] = j;
    }
    const at::Tensor picked = x.index_select(0, long_tensor(rows));
    const at::Tensor xs = (x.scalar_type() == at::kBFloat16 ? picked : picked.to(at::kFloat)).contiguous();
    const std::vector<int64_t> expert_counts(counts.begin(), counts.end() - 1);
    at::Tensor ys;
    const bool packed = gate_up_packed.has_value() && gate_up_packed->defined();
    TORCH_CHECK(packed == (down_packed.has_value() && down_packed->defined()),
                "routed_experts: both packed weights or neither");
    if (packed) {
      check_packed(*gate_up_packed, 4, h, "routed_experts: gate_up_packed");
      check_packed(*down_packed, 4, gate_up.size(1) / 2, "routed_experts: down_packed");
      TORCH_CHECK(gate_up_packed->scalar_type() == x.scalar_type() && down_packed->scalar_type() == x.scalar_type() &&
                  gate_up_packed->size(0) == e_local && gate_up_packed->size(1) == gate_up.size(1) &&
                  down_packed->size(0) == e_local && down_packed->size(1) == h,
                  "routed_experts: packed weights ", gate_up_packed->scalar_type(), " ", gate_up_packed->sizes(),
                  " and ", down_packed->sizes(), " do not match gate_up ", gate_up.scalar_type(), " ",
                  gate_up.sizes(), " and down ", down.sizes());
    }
    AT_DISPATCH_SWITCH(x.scalar_type(), "metrale_cpu::routed_experts",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        ys = few_row_experts<float>(xs, gate_up, down, first, expert_counts,
                                    packed ? gate_up_packed->const_data_ptr<float>() : nullptr,
                                    packed ? down_packed->const_data_ptr<float>() : nullptr);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        ys = few_row_experts<c10::BFloat16>(xs, gate_up, down, first, expert_counts,
                                            packed ? gate_up_packed->const_data_ptr<c10::BFloat16>() : nullptr,
                                            packed ? down_packed->const_data_ptr<c10::BFloat16>() : nullptr);
      }));
    const at::Tensor wf = weights.to(at::kFloat).contiguous();
    const float* wp = wf.const_data_ptr<float>();
    const float* yp = ys.const_data_ptr<float>();
    at::Tensor out = at::zeros({t, h}, x.options().dtype(at::kFloat));
    float* op = out.mutable_data_ptr<float>();
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const int64_t j = place[r * k + c];
        if (j < 0) continue;   // routed to another shard: contributes zero
        const float wv = wp[r * k + c];
        const float* y = yp + j * h;
        float* o = op + r * h;
        for (int64_t d = 0; d < h; ++d) o[d] = o[d] + wv * y[d];
      }
    }
    return out.to(x.scalar_type());
  }
  at::Tensor per_choice = at::zeros({n, h}, x.options());                         // [T*k, H]
  if (mine > 0) {
    std::vector<int64_t> rows(mine);
    for (int64_t j = 0; j < mine; ++j) {
      rows[j] = order[j] / k;
    }
    const at::Tensor xs = x.index_select(0, long_tensor(rows));                    // [L, H], expert-major
    const at::Tensor choice = long_tensor(order);
    // Padding saves a GEMM pair's call per touched expert (in bfloat16 about 64 rows of an expert's
    // GEMMs) and costs the rows it adds: with routing skewed to a few experts (a long prefill) the
    // busiest count padded over every expert can triple the rows (docs/design.md §3.4).
    const bool padded = padded_min_experts > 0 && n >= padded_min_experts && touched >= padded_min_experts &&
                        e_local * busiest - mine <= kPaddedWasteRows * touched;
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

// A 32-byte vector of acc_t from kLanes<acc_t> consecutive values of a cache or query row.
template <typename acc_t, typename T>
inline vec_t<acc_t> load_row(const T* p) {
  if constexpr (std::is_same_v<T, acc_t> || (std::is_same_v<acc_t, float> && std::is_same_v<T, c10::BFloat16>)) {
    return load_vec<acc_t, T>(p);
  } else {   // half: each value widened
    acc_t wide[kLanes<acc_t>];
    for (int i = 0; i < kLanes<acc_t>; ++i) wide[i] = static_cast<acc_t>(p[i]);
    vec_t<acc_t> v;
    std::memcpy(&v, wide, sizeof v);
    return v;
  }
}

// q . key over d: lane l of a 32-byte accumulator sums the products at l, l + L, l + 2L, ...
// in order, the lanes are added in a fixed tree, then the products past the last full vector in
// order. The same sums in the same order on every ISA clone (GCC lowers a 32-byte vector to two
// 16-byte halves without AVX), so a score does not depend on the CPU's vector width.
template <typename acc_t, typename T>
inline acc_t lane_dot(const acc_t* q, const T* key, int64_t d) {
  constexpr int L = kLanes<acc_t>;
  vec_t<acc_t> acc = {};
  int64_t x = 0;
  for (; x + L <= d; x += L) acc = acc + load_vec<acc_t, acc_t>(q + x) * load_row<acc_t, T>(key + x);
  acc_t l[L];
  std::memcpy(l, &acc, sizeof acc);
  acc_t sum;
  if constexpr (L == 8) {
    sum = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  } else {
    sum = (l[0] + l[2]) + (l[1] + l[3]);
  }
  for (; x < d; ++x) sum = sum + q[x] * to_acc<acc_t>(key[x]);
  return sum;
}

// lane_dot of one float query row against 8 keys at once, the same bits for each key: the 8
// lane accumulators side by side, then transposed so that the fixed tree adds lane vectors.
template <typename T>
inline void lane_dot8(const float* q, const T* const* keys, int64_t d, float* out) {
  using V = vec_t<float>;
  constexpr int L = kLanes<float>;
  V acc[L] = {};
  int64_t x = 0;
  for (; x + L <= d; x += L) {
    const V qv = load_vec<float, float>(q + x);
#pragma GCC unroll 8
    for (int k = 0; k < L; ++k) acc[k] = acc[k] + qv * load_row<float, T>(keys[k] + x);
  }
  float a[L][L], tt[L][L];
  std::memcpy(a, acc, sizeof a);
  for (int l = 0; l < L; ++l) {
    for (int k = 0; k < L; ++k) tt[l][k] = a[k][l];
  }
  V t[L];
  std::memcpy(t, tt, sizeof t);
  const V sum = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
  std::memcpy(out, &sum, sizeof sum);
  for (int k = 0; k < L; ++k) {
    for (int64_t y = x; y < d; ++y) out[k] = out[k] + q[y] * to_acc<float>(keys[k][y]);
  }
}

// Sixteen floats: two query heads' 8-lane vectors side by side (scores), or 16 elements of one
// head's value sum. Each lane's operations are those of the 8-lane code, so the same bits; a
// 64-byte vector is one AVX-512 register and two or four narrower ones elsewhere.
typedef float v16f __attribute__((vector_size(64)));

template <typename T>
inline v16f load16(const T* p) {
  v16f v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typedef uint16_t raw_t __attribute__((vector_size(32)));
    typedef uint32_t wide_t __attribute__((vector_size(64)));
    raw_t raw;
    std::memcpy(&raw, p, sizeof raw);
    const wide_t wide = __builtin_convertvector(raw, wide_t) << 16;
    std::memcpy(&v, &wide, sizeof v);
  } else {
    float wide[16];
    for (int i = 0; i < 16; ++i) wide[i] = static_cast<float>(p[i]);
    std::memcpy(&v, wide, sizeof v);
  }
  return v;
}

// lane_dot8 of two query rows (q0, q1: two heads) against the same 8 keys in one pass: each key's
// 8 lanes widened once and set beside themselves, so lanes 0-7 of an accumulator sum head q0's
// products and lanes 8-15 head q1's, in lane_dot8's order; then both 8 x 8 blocks transposed by
// shuffles and the lane vectors added in lane_dot8's fixed tree. out0 / out1: the 8 scores.
template <typename T>
inline void lane_dot8_pair(const float* q0, const float* q1, const T* const* keys, int64_t d, float* out0,
                           float* out1) {
  using V = vec_t<float>;
  constexpr int L = kLanes<float>;
  static_assert(L == 8, "8 float lanes");
  v16f acc[8] = {};
  int64_t x = 0;
  for (; x + L <= d; x += L) {
    const V a = load_vec<float, float>(q0 + x), b = load_vec<float, float>(q1 + x);
    const v16f qv = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const V kv = load_row<float, T>(keys[k] + x);
      acc[k] = acc[k] + qv * __builtin_shufflevector(kv, kv, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    }
  }
  // 128-bit block b of lo[j] / hi[j]: acc[2j], acc[2j+1] interleaved at lanes 4b, 4b+1 / 4b+2, 4b+3.
  v16f lo[4], hi[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    lo[j] = __builtin_shufflevector(acc[2 * j], acc[2 * j + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
    hi[j] = __builtin_shufflevector(acc[2 * j], acc[2 * j + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  // m[c] / n[c], block b: lane 4b + c of acc[0..3] / acc[4..7].
  const v16f m[4] = {
      __builtin_shufflevector(lo[0], lo[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
      __builtin_shufflevector(lo[0], lo[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31),
      __builtin_shufflevector(hi[0], hi[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
      __builtin_shufflevector(hi[0], hi[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)};
  const v16f n[4] = {
      __builtin_shufflevector(lo[2], lo[3], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
      __builtin_shufflevector(lo[2], lo[3], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31),
      __builtin_shufflevector(hi[2], hi[3], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
      __builtin_shufflevector(hi[2], hi[3], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)};
  // t[l]: lane l of acc[0..7] (head q0), then lane 8 + l of acc[0..7] (head q1).
  v16f t[8];
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    t[c] = __builtin_shufflevector(m[c], n[c], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    t[4 + c] = __builtin_shufflevector(m[c], n[c], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  const v16f sum = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
  std::memcpy(out0, &sum, 8 * sizeof(float));
  std::memcpy(out1, reinterpret_cast<const float*>(&sum) + 8, 8 * sizeof(float));
  for (int k = 0; k < 8; ++k) {
    for (int64_t y = x; y < d; ++y) {
      const float kv = to_acc<float>(keys[k][y]);
      out0[k] = out0[k] + q0[y] * kv;
      out1[k] = out1[k] + q1[y] * kv;
    }
  }
}

// ---- bfloat16 attention scores on bfloat16 dot products. A score is a key's dot product with a
// query head's bfloat16 row, summed as AVX512-BF16's VDPBF16PS sums (the linears' pairs, above):
// lane i of a 16-float accumulator takes the pair (32 c + 2 i, 32 c + 2 i + 1) of each 32-element
// chunk c in order, acc = (acc + q[odd] k[odd]) + q[even] k[even] (a head size that is no multiple
// of 32 pads its last chunk with zeros); then the 16 lanes are added in a fixed tree (lane i with
// i + 8, then i + 4, i + 2, i + 1: `reduce16`) and the sum times the scale is the score. With the
// instruction (two 32-element dot products a cycle) a key's scores for two heads take ~14
// instructions against ~90 for float multiplies and adds 8 lanes at a time; without it, or after
// `use_bf16_dot_products(false)`, the same sums run as float multiplies and adds, the same bits.
// A score depends on its query row and key alone (the 8-key block it sits in, the heads beside it,
// the keys' count), so a row's attention is its own in any step.
constexpr int64_t kScoreChunk = 32;   // bfloat16 elements of one VDPBF16PS

// out lane j: the 16 lanes of a[j] added in the fixed tree above (pairs of lanes 8, 4, 2, 1 apart),
// 16 sums transposed by shuffles as they are added.
inline v16f reduce16(const v16f* a) {
  v16f b[8], c[4], e[2];
#pragma GCC unroll 8
  for (int m = 0; m < 8; ++m) {
    b[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
#pragma GCC unroll 4
  for (int n = 0; n < 4; ++n) {
    c[n] = __builtin_shufflevector(b[2 * n], b[2 * n + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * n], b[2 * n + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {
    e[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Dot products of H (1 or 2) query heads' rows q[h] (bfloat16, zero-padded to whole chunks) with 8
// keys (d elements each; a masked or missing key points at zeros): out[8 h + u], unscaled.
template <int H>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void bf16_scores8_native(const c10::BFloat16* const* q, const c10::BFloat16* const* keys, int64_t d, float* out) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += kScoreChunk) {
    const __mmask32 m = d - c >= kScoreChunk ? ~__mmask32(0) : (__mmask32(1) << (d - c)) - 1;
    __m512bh qv[H];
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(q[h] + c);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(m, keys[u] + c);
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) acc[8 * h + u] = _mm512_dpbf16_ps(acc[8 * h + u], qv[h], kv);
    }
  }
  v16f a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = (v16f)acc[i];
  const v16f r = reduce16(a);
  std::memcpy(out, &r, 8 * H * sizeof(float));
}

// The same sums as float multiplies and adds (no instruction needed): a 32-bit word of a pair
// holds its even element in the low half and its odd one in the high half.
template <int H>
__attribute__((target_clones("avx512f", "avx2", "default")))
void bf16_scores8_emulated(const c10::BFloat16* const* q, const c10::BFloat16* const* keys, int64_t d, float* out) {
  typedef uint32_t w16_t __attribute__((vector_size(64)));
  v16f acc[16] = {};
  for (int64_t c = 0; c < d; c += kScoreChunk) {
    const int64_t n = std::min<int64_t>(kScoreChunk, d - c);
    v16f qe[H], qo[H];
    for (int h = 0; h < H; ++h) {
      w16_t w;
      std::memcpy(&w, q[h] + c, sizeof w);
      const w16_t even = w << 16, odd = w & 0xffff0000u;
      std::memcpy(&qe[h], &even, sizeof even);
      std::memcpy(&qo[h], &odd, sizeof odd);
    }
    for (int u = 0; u < 8; ++u) {
      w16_t w = {};
      std::memcpy(&w, keys[u] + c, n * sizeof(c10::BFloat16));
      const w16_t even_bits = w << 16, odd_bits = w & 0xffff0000u;
      v16f ke, ko;
      std::memcpy(&ke, &even_bits, sizeof ke);
      std::memcpy(&ko, &odd_bits, sizeof ko);
      for (int h = 0; h < H; ++h) acc[8 * h + u] = (acc[8 * h + u] + qo[h] * ko) + qe[h] * ke;
    }
  }
  const v16f r = reduce16(acc);
  std::memcpy(out, &r, 8 * H * sizeof(float));
}

template <int H>
inline void bf16_scores8(const c10::BFloat16* const* q, const c10::BFloat16* const* keys, int64_t d, float* out) {
  if (g_bf16_dot) {
    bf16_scores8_native<H>(q, keys, d, out);
  } else {
    bf16_scores8_emulated<H>(q, keys, d, out);
  }
}

// Unscaled scores of `group` query heads (rows of qb, `dpad` apart, zero-padded to whole chunks)
// against 8 keys: out[8 h + u]. Heads go two at a time, an odd last one alone (`bf16_scores8`), so
// a head's scores are the same whatever heads sit beside it.
inline void bf16_group_scores8(const c10::BFloat16* qb, int64_t dpad, int64_t group, const c10::BFloat16* const* keys,
                               int64_t d, float* out) {
  for (int64_t hh = 0; hh < group; hh += 2) {
    const c10::BFloat16* q2[2] = {qb + hh * dpad, qb + std::min(hh + 1, group - 1) * dpad};
    if (hh + 1 < group) {
      bf16_scores8<2>(q2, keys, d, out + 8 * hh);
    } else {
      bf16_scores8<1>(q2, keys, d, out + 8 * hh);
    }
  }
}

// The pointers, sizes and strides of one `paged_rows` call.
template <typename scalar_t>
struct PagedRows {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t *qp, *kp, *vp;
  scalar_t* op;
  const int64_t *gp, *rp;
  const bool* mp;
  const int64_t* ends;   // [B, Q]: 1 + the last key each (sequence, query) sees
  int64_t kk, nq, nkv, d, dv, group;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, os0, os1;
  acc_t sc;
};

// Tasks `tasks` of `paged_rows` (task i: sequence i / nkv, kv head i % nkv), in a function
// of its own so that it has AVX-512, AVX2 and default clones (the lambda of at::parallel_for has
// none: the library is built without -march; AVX-512's clone keeps the 32-byte vectors, with 32
// registers). The scores are `lane_dot`s; the softmax and the weighted sum of the values are per
// element, so no clone rounds differently. The values are
// summed in registers (64 elements of two heads a pass over the keys, a vector bfloat16 widening)
// and, with float accumulation, two query heads' scores are taken in one pass over the keys in
// 16-float vectors, transposed by shuffles; the same bits (the timings: docs/design.md §3.4).
template <typename scalar_t>
__attribute__((target_clones("avx512f", "avx2", "default")))
void paged_tasks(const PagedRows<scalar_t>& a, const int64_t* tasks, int64_t n_tasks) {
  using acc_t = typename PagedRows<scalar_t>::acc_t;
  constexpr acc_t kNeg = -std::numeric_limits<acc_t>::infinity();
  const int64_t kk = a.kk, group = a.group, d = a.d, dv = a.dv;
  std::vector<acc_t> s(group * kk), qf(group * d), acc(group * dv), inv(group);
  // bfloat16: each query head's row zero-padded to whole dot-product chunks (`bf16_scores8`).
  const int64_t dpad = (d + kScoreChunk - 1) / kScoreChunk * kScoreChunk;
  std::vector<scalar_t> qb(group * dpad, scalar_t(0));
  std::vector<float> block8((group + 1) / 2 * 16);
  const std::vector<scalar_t> zeros(dpad, scalar_t(0));
  for (int64_t t = 0; t < n_tasks; ++t) {
    const int64_t i = tasks[t], bi = i / a.nkv, g = i % a.nkv;
    const int64_t* cells = a.gp + bi * kk;
    for (int64_t r = 0; r < a.nq; ++r) {
      const int64_t row = a.rp[bi * a.nq + r];
      if (row < 0) continue;
      const bool* vis = a.mp ? a.mp + (bi * a.nq + r) * kk : nullptr;
      // Keys past the row's last visible one (a shorter sequence's padding in a batch) are left out:
      // they would add 0 to the softmax's sum and nothing to the values' sum, so the same bits.
      const int64_t kend = a.ends[bi * a.nq + r];
      int64_t j = 0;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {   // dot products, 8 keys at a time
        for (int64_t hh = 0; hh < group; ++hh) {
          const scalar_t* qrow = a.qp + row * a.qs0 + (g * group + hh) * a.qs1;
          std::copy(qrow, qrow + d, qb.begin() + hh * dpad);
        }
        const scalar_t* keys[8];
        for (; j < kend; j += 8) {
          const int64_t n = std::min<int64_t>(8, kend - j);
          for (int u = 0; u < 8; ++u) {   // a masked key, and the block's tail past kend, read zeros
            keys[u] = u >= n || (vis && !vis[j + u]) ? zeros.data() : a.kp + cells[j + u] * a.ks0 + g * a.ks1;
          }
          bf16_group_scores8(qb.data(), dpad, group, keys, d, block8.data());
          for (int64_t h = 0; h < group; ++h) {
            for (int64_t u = 0; u < n; ++u) s[h * kk + j + u] = vis && !vis[j + u] ? kNeg : block8[8 * h + u] * a.sc;
          }
        }
        j = kend;
      } else {
        for (int64_t hh = 0; hh < group; ++hh) {
          const scalar_t* qrow = a.qp + row * a.qs0 + (g * group + hh) * a.qs1;
          for (int64_t x = 0; x < d; ++x) qf[hh * d + x] = to_acc<acc_t>(qrow[x]) * a.sc;
        }
      }
      if constexpr (std::is_same_v<acc_t, float> && !std::is_same_v<scalar_t, c10::BFloat16>) {   // 8 keys at a time (a masked key reads zeros)
        const scalar_t* keys[8];
        float block[16];
        for (; j + 8 <= kend; j += 8) {
          for (int u = 0; u < 8; ++u) {
            keys[u] = vis && !vis[j + u] ? zeros.data() : a.kp + cells[j + u] * a.ks0 + g * a.ks1;
          }
          int64_t hh = 0;
          for (; hh + 2 <= group; hh += 2) {   // two heads a pass over the keys
            lane_dot8_pair<scalar_t>(qf.data() + hh * d, qf.data() + (hh + 1) * d, keys, d, block, block + 8);
            for (int u = 0; u < 8; ++u) {
              s[hh * kk + j + u] = vis && !vis[j + u] ? kNeg : block[u];
              s[(hh + 1) * kk + j + u] = vis && !vis[j + u] ? kNeg : block[8 + u];
            }
          }
          for (; hh < group; ++hh) {
            lane_dot8<scalar_t>(qf.data() + hh * d, keys, d, block);
            for (int u = 0; u < 8; ++u) s[hh * kk + j + u] = vis && !vis[j + u] ? kNeg : block[u];
          }
        }
      }
      for (; j < kend; ++j) {
        if (vis && !vis[j]) {
          for (int64_t hh = 0; hh < group; ++hh) s[hh * kk + j] = kNeg;
          continue;
        }
        const scalar_t* key = a.kp + cells[j] * a.ks0 + g * a.ks1;
        for (int64_t hh = 0; hh < group; ++hh) s[hh * kk + j] = lane_dot<acc_t, scalar_t>(qf.data() + hh * d, key, d);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t hh = 0; hh < group; ++hh) {
        acc_t* sh = s.data() + hh * kk;
        acc_t m = kNeg;
        acc_t sum = 0;
        if constexpr (std::is_same_v<acc_t, float>) {   // eight scores at a time
          // The max in lanes (exact in any order); the exponentials summed in 8 lanes (lane l: the
          // keys l, l + 8, ... in order), then the lanes in a fixed tree.
          constexpr int L = kLanes<float>;
          const vec_t<float> neg = vec_t<float>{} + kNeg, lane = {0, 1, 2, 3, 4, 5, 6, 7};
          vec_t<float> top = neg, total = {};
          map_lanes(kend, [&](int64_t j, int64_t count) {
            const vec_t<float> x = load_lanes(sh + j, count);
            top = lane < static_cast<float>(count) && x > top ? x : top;
          });
          for (int l = 0; l < L; ++l) m = std::max(m, top[l]);
          map_lanes(kend, [&](int64_t j, int64_t count) {
            const vec_t<float> x = load_lanes(sh + j, count);
            const vec_t<float> e = lane < static_cast<float>(count) && x != kNeg ? exp_lanes(x - m) : vec_t<float>{};
            store_lanes(sh + j, e, count);
            total = total + e;
          });
          sum = ((total[0] + total[4]) + (total[2] + total[6])) + ((total[1] + total[5]) + (total[3] + total[7]));
        } else {
          for (int64_t j = 0; j < kend; ++j) m = std::max(m, sh[j]);
          for (int64_t j = 0; j < kend; ++j) {
            const acc_t p = sh[j] == kNeg ? acc_t(0) : std::exp(sh[j] - m);
            sh[j] = p;
            sum += p;
          }
        }
        inv[hh] = acc_t(1) / sum;
      }
      // The weighted sum of the values, per element acc += p * v over the keys in order: 32
      // elements of two heads at a time in registers (8 vectors), the rest one element at a time.
      constexpr int64_t kSumVecs = 4, kSumWidth = kSumVecs * kLanes<acc_t>;
      int64_t wide_end = 0;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        // 64 (then 32) elements of two heads at a time: a value's 32-element chunk is one 64-byte
        // load whose 32-bit words hold an even element (low half) and an odd one (high half), so
        // a shift and a mask widen it (no widening moves); the even and odd sums are interleaved
        // back at the end. The same per-element sums as below.
        typedef uint32_t w16_t __attribute__((vector_size(64)));
        auto pass = [&](auto chunks) {
          constexpr int C = decltype(chunks)::value;
          for (int64_t h0 = 0; h0 < group; h0 += 2) {
            const int64_t heads = std::min<int64_t>(2, group - h0);
            v16f even_sum[2][C] = {}, odd_sum[2][C] = {};
            for (int64_t j = 0; j < kend; ++j) {
              if (vis && !vis[j]) continue;
              const scalar_t* val = a.vp + cells[j] * a.vs0 + g * a.vs1 + wide_end;
              v16f even[C], odd[C];
#pragma GCC unroll 2
              for (int c = 0; c < C; ++c) {
                w16_t w;
                std::memcpy(&w, val + c * kScoreChunk, sizeof w);
                const w16_t lo = w << 16, hi = w & 0xffff0000u;
                std::memcpy(&even[c], &lo, sizeof lo);
                std::memcpy(&odd[c], &hi, sizeof hi);
              }
              for (int64_t h = 0; h < heads; ++h) {
                const float p = s[(h0 + h) * kk + j];
#pragma GCC unroll 2
                for (int c = 0; c < C; ++c) {
                  even_sum[h][c] = even_sum[h][c] + p * even[c];
                  odd_sum[h][c] = odd_sum[h][c] + p * odd[c];
                }
              }
            }
            for (int64_t h = 0; h < heads; ++h) {
              for (int c = 0; c < C; ++c) {
                const v16f first = __builtin_shufflevector(even_sum[h][c], odd_sum[h][c], 0, 16, 1, 17, 2, 18, 3, 19,
                                                           4, 20, 5, 21, 6, 22, 7, 23);
                const v16f second = __builtin_shufflevector(even_sum[h][c], odd_sum[h][c], 8, 24, 9, 25, 10, 26, 11,
                                                            27, 12, 28, 13, 29, 14, 30, 15, 31);
                float* out = acc.data() + (h0 + h) * dv + wide_end + c * kScoreChunk;
                std::memcpy(out, &first, sizeof first);
                std::memcpy(out + 16, &second, sizeof second);
              }
            }
          }
          wide_end += C * kScoreChunk;
        };
        while (wide_end + 2 * kScoreChunk <= dv) pass(std::integral_constant<int, 2>{});
        if (wide_end + kScoreChunk <= dv) pass(std::integral_constant<int, 1>{});
      } else if constexpr (std::is_same_v<acc_t, float>) {   // 64 elements of two heads at a time (8 x 16 floats)
        constexpr int64_t kWide = 4 * 16;
        wide_end = dv / kWide * kWide;
        for (int64_t x0 = 0; x0 < wide_end; x0 += kWide) {
          for (int64_t h0 = 0; h0 < group; h0 += 2) {
            const int64_t heads = std::min<int64_t>(2, group - h0);
            v16f sum[2][4] = {};
            for (int64_t j = 0; j < kend; ++j) {
              if (vis && !vis[j]) continue;
              const scalar_t* val = a.vp + cells[j] * a.vs0 + g * a.vs1 + x0;
              v16f v[4];
#pragma GCC unroll 4
              for (int u = 0; u < 4; ++u) v[u] = load16<scalar_t>(val + u * 16);
              for (int64_t h = 0; h < heads; ++h) {
                const float p = s[(h0 + h) * kk + j];
#pragma GCC unroll 4
                for (int u = 0; u < 4; ++u) sum[h][u] = sum[h][u] + p * v[u];
              }
            }
            for (int64_t h = 0; h < heads; ++h) std::memcpy(acc.data() + (h0 + h) * dv + x0, sum[h], sizeof sum[h]);
          }
        }
      }
      for (int64_t x0 = wide_end; x0 + kSumWidth <= dv; x0 += kSumWidth) {
        for (int64_t h0 = 0; h0 < group; h0 += 2) {
          const int64_t heads = std::min<int64_t>(2, group - h0);
          vec_t<acc_t> sum[2][kSumVecs] = {};
          for (int64_t j = 0; j < kend; ++j) {
            if (vis && !vis[j]) continue;
            const scalar_t* val = a.vp + cells[j] * a.vs0 + g * a.vs1 + x0;
            vec_t<acc_t> v[kSumVecs];
#pragma GCC unroll 4
            for (int u = 0; u < kSumVecs; ++u) v[u] = load_row<acc_t, scalar_t>(val + u * kLanes<acc_t>);
            for (int64_t h = 0; h < heads; ++h) {
              const acc_t p = s[(h0 + h) * kk + j];
#pragma GCC unroll 4
              for (int u = 0; u < kSumVecs; ++u) sum[h][u] = sum[h][u] + p * v[u];
            }
          }
          for (int64_t h = 0; h < heads; ++h) std::memcpy(acc.data() + (h0 + h) * dv + x0, sum[h], sizeof sum[h]);
        }
      }
      wide_end = dv / kSumWidth * kSumWidth;
      for (int64_t j = 0; wide_end < dv && j < kend; ++j) {
        if (vis && !vis[j]) continue;
        const scalar_t* val = a.vp + cells[j] * a.vs0 + g * a.vs1;
        for (int64_t hh = 0; hh < group; ++hh) {
          const acc_t p = s[hh * kk + j];
          acc_t* ah = acc.data() + hh * dv;
          for (int64_t x = wide_end; x < dv; ++x) ah[x] += p * to_acc<acc_t>(val[x]);
        }
      }
      for (int64_t hh = 0; hh < group; ++hh) {
        scalar_t* orow = a.op + row * a.os0 + (g * group + hh) * a.os1;
        for (int64_t x = 0; x < dv; ++x) orow[x] = static_cast<scalar_t>(acc[hh * dv + x] * inv[hh]);
      }
    }
  }
}

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
  const int64_t nh = q.size(1), nkv = k_plane.size(1), b = gather.size(0), nq = rows.size(1), kk = gather.size(1);
  const bool* mp = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  // Each row's keys end after its last visible one; a task (sequence, kv head) costs its rows' keys.
  std::vector<int64_t> ends(b * nq, kk), cost(b * nkv, 0);
  for (int64_t i = 0; i < b * nq; ++i) {
    if (mp != nullptr) {
      while (ends[i] > 0 && !mp[i * kk + ends[i] - 1]) --ends[i];
    }
    if (rp[i] >= 0) {
      for (int64_t g = 0; g < nkv; ++g) cost[(i / nq) * nkv + g] += ends[i] + 8;
    }
  }
  const PagedRows<scalar_t> a{q.const_data_ptr<scalar_t>(), k_plane.const_data_ptr<scalar_t>(),
                              v_plane.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                              gather.const_data_ptr<int64_t>(), rp, mp, ends.data(),
                              kk, nq, nkv, q.size(2), v_plane.size(2), nh / nkv,
                              q.stride(0), q.stride(1), k_plane.stride(0), k_plane.stride(1),
                              v_plane.stride(0), v_plane.stride(1), out.stride(0), out.stride(1),
                              static_cast<typename PagedRows<scalar_t>::acc_t>(scale)};
  const auto lists = balanced_tasks(cost);
  at::parallel_for(0, static_cast<int64_t>(lists.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) paged_tasks<scalar_t>(a, lists[t].data(), static_cast<int64_t>(lists[t].size()));
  });
}

// Rows per sequence up to which attention reads the cache in place (`paged_rows`): decode and
// verify steps. Longer chunks (prefills) gather and run SDPA, whose tiled kernel suits them.
constexpr int64_t kInPlaceMaxRows = 8;

// What the in-place attention derives from a step's plan alone (the rows each sequence's queries
// sit at, the mask and gather laid out contiguous): the same for every layer, so a planned step
// computes it at its first layer and reuses it (~3 tensor ops a layer).
struct PagedPrep {
  at::Tensor rows, mask, gather;
  bool ready = false;
};

// plane[cells[i]] = src[i] for each step row i: the layer's new keys or values to their cache cells
// (index_copy_ without its per-call cost where both are laid out plainly).
void write_cells(at::Tensor& plane, const at::Tensor& cells, const at::Tensor& src) {
  const bool plain = src.scalar_type() == plane.scalar_type() && cells.scalar_type() == at::kLong &&
                     src.dim() == plane.dim() && src.size(0) == cells.numel() && plane.dim() == 3 &&
                     plane.stride(2) == 1 && plane.stride(1) == plane.size(2) &&
                     src.size(1) == plane.size(1) && src.size(2) == plane.size(2);
  if (!plain) {
    plane.index_copy_(0, cells, src.to(plane.scalar_type()));
    return;
  }
  const at::Tensor from = src.contiguous(), at = cells.contiguous();
  const int64_t* cp = at.const_data_ptr<int64_t>();
  const int64_t n = plane.size(0), elems = plane.size(1) * plane.size(2), size = plane.element_size();
  char* dst = static_cast<char*>(plane.mutable_data_ptr());
  const char* srcp = static_cast<const char*>(from.const_data_ptr());
  for (int64_t i = 0; i < at.numel(); ++i) {
    TORCH_CHECK(cp[i] >= 0 && cp[i] < n, "cache cell ", cp[i], " out of range for ", n, " cells");
    std::memcpy(dst + cp[i] * plane.stride(0) * size, srcp + i * elems * size, elems * size);
  }
}

// One layer of `runtime.executor.attention.PagedAttention.attend` over a padded batch (not the
// batch-invariant tiles): this step's keys and values written to their cells (as the Python
// method), then up to `kInPlaceMaxRows` rows a sequence attend in place (`paged_rows`), longer
// chunks gather every sequence's context and make one SDPA call, the Python method's calls in
// its order.
// k_plane, v_plane: the layer's cache planes [N, nkv, D] / [N, nkv, Dv] (v_plane a view of
// k_plane's first channels in a latent cache, then `write_v` is false); mode: "none" (one sequence
// of one row or more, unmasked), "causal", "explicit" (mask [B, 1, Q, K]), "padded" (B*Q rows) or
// "invariant" (explicit, and every row in place whatever the rows a sequence: the batch-invariant
// plan, runtime.attention._invariant_plan, whose rows must not take SDPA's kernels).
at::Tensor paged_attention_prepared(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_plane,
                                    at::Tensor& v_plane, bool write_v, const at::Tensor& cell_mapping,
                                    const at::Tensor& gather, const std::optional<at::Tensor>& q_index,
                                    const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& mask,
                                    c10::string_view mode, double scale, PagedPrep* prep) {
  const KernelClock clock;
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, dim]");
  TORCH_CHECK(gather.dim() == 2, "gather must be [B, K], got ", gather.sizes());
  const bool invariant = mode == "invariant";
  const bool padded = mode == "padded", causal = mode == "causal", explicit_mask = mode == "explicit" || invariant;
  TORCH_CHECK(padded || causal || explicit_mask || mode == "none", "unknown mask mode ", mode);
  write_cells(k_plane, cell_mapping, k);
  if (write_v) {
    write_cells(v_plane, cell_mapping, v);
  }
  const int64_t b = gather.size(0), kk = gather.size(1);
  const bool single = !padded && b == 1;
  TORCH_CHECK(single || (q_index.has_value() && valid.has_value()), "a batch of ", b, " sequences needs q_index and valid");
  // (The invariant mode's one row alone may come without a mask: it sees every key.)
  TORCH_CHECK(!(padded || explicit_mask) || mask.has_value() || (invariant && single && q.size(0) == 1),
              "mask mode ", mode, " needs a mask");
  const int64_t rows_per_seq = single ? q.size(0) : q_index->size(1);
  const bool in_place = k_plane.stride(2) == 1 && v_plane.stride(2) == 1;
  TORCH_CHECK(in_place || !invariant, "the invariant mask mode needs cache planes with contiguous rows");
  if (!causal && (rows_per_seq <= kInPlaceMaxRows || invariant) && in_place) {
    PagedPrep local;
    PagedPrep& pp = prep != nullptr ? *prep : local;
    if (!pp.ready || pp.rows.size(1) != rows_per_seq || !pp.gather.sizes().equals(gather.sizes())) {
      const at::Tensor rows = single ? at::arange(q.size(0), gather.options()).view({1, -1})
                                     : (padded ? *q_index : at::where(*valid, *q_index, -1));
      pp.rows = rows.contiguous();
      pp.mask = (padded || explicit_mask) && mask.has_value() ? mask->reshape({b, rows_per_seq, kk}).contiguous()
                                                              : at::Tensor();
      pp.gather = gather.contiguous();
      pp.ready = true;
    }
    const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
    at::Tensor out = at::empty({q.size(0), q.size(1), v_plane.size(2)}, q.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_rows", [&] {
      paged_rows<scalar_t>(qc, k_plane, v_plane, pp.gather, pp.rows, pp.mask, scale, out);
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

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_plane,
                           at::Tensor& v_plane, bool write_v, const at::Tensor& cell_mapping,
                           const at::Tensor& gather, const std::optional<at::Tensor>& q_index,
                           const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& mask,
                           c10::string_view mode, double scale) {
  return paged_attention_prepared(q, k, v, k_plane, v_plane, write_v, cell_mapping, gather, q_index, valid, mask,
                                  mode, scale, nullptr);
}

// The attention plan of the compiled forward running on this thread: set once a step by
// `runtime.executor.attention.forward_context`, so each layer's attention in the graph is one native call
// with its q, k, v, layer and scale (`planned_attention`) rather than a Python op that looks the
// plan up (the host time saved: docs/design.md §3).
struct AttentionPlan {
  at::Tensor k_planes, v_planes;   // the cache's [L, N, nkv, D] / [L, N, nkv, Dv]
  bool write_v = true;
  at::Tensor cell_mapping, gather;
  std::optional<at::Tensor> q_index, valid, mask;
  std::string mode;
  bool set = false;
  PagedPrep prep;   // filled by the step's first layer
};
thread_local AttentionPlan t_plan;
// The plans of a drafter's later steps run in the same graph as its first (a chain of drafts:
// `runtime.executor.attention.forward_context(chain=...)`): step s >= 1 is t_chain[s - 1], on the same cache.
thread_local std::vector<AttentionPlan> t_chain;


void set_attention_plan(const at::Tensor& k_planes, const at::Tensor& v_planes, bool write_v,
                        const at::Tensor& cell_mapping, const at::Tensor& gather,
                        const std::optional<at::Tensor>& q_index, const std::optional<at::Tensor>& valid,
                        const std::optional<at::Tensor>& mask, c10::string_view mode) {
  TORCH_CHECK(k_planes.dim() == 4 && v_planes.dim() == 4 && k_planes.size(0) == v_planes.size(0),
              "set_attention_plan: cache planes [L, N, heads, dim] expected, got ", k_planes.sizes(), " and ",
              v_planes.sizes());
  t_plan = AttentionPlan{k_planes, v_planes, write_v, cell_mapping, gather, q_index, valid, mask,
                         std::string(mode), true, PagedPrep()};
  t_chain.clear();
}

void clear_attention_plan() {
  t_plan = AttentionPlan();
  t_chain.clear();
}

// Appends the plan of the next chained step to this thread's plan (set first); returns its step.
int64_t add_attention_plan(const at::Tensor& cell_mapping, const at::Tensor& gather,
                           const std::optional<at::Tensor>& q_index, const std::optional<at::Tensor>& valid,
                           const std::optional<at::Tensor>& mask, c10::string_view mode) {
  TORCH_CHECK(t_plan.set, "add_attention_plan: set_attention_plan first");
  t_chain.push_back(AttentionPlan{t_plan.k_planes, t_plan.v_planes, t_plan.write_v, cell_mapping, gather, q_index,
                                  valid, mask, std::string(mode), true, PagedPrep()});
  return static_cast<int64_t>(t_chain.size());
}

// Layer `layer_idx`'s attention of chained step `step` (0: the plan set by set_attention_plan).
at::Tensor planned_attention_at(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                                int64_t step, double scale) {
  TORCH_CHECK(t_plan.set, "planned_attention: no attention plan on this thread (runtime.executor.attention.forward_context "
              "sets it)");
  TORCH_CHECK(step >= 0 && step <= static_cast<int64_t>(t_chain.size()), "planned_attention: step ", step, " of ",
              t_chain.size() + 1, " planned");
  AttentionPlan& plan = step == 0 ? t_plan : t_chain[step - 1];
  TORCH_CHECK(layer_idx >= 0 && layer_idx < plan.k_planes.size(0), "planned_attention: layer ", layer_idx,
              " of a cache with ", plan.k_planes.size(0));
  at::Tensor k_plane = plan.k_planes.select(0, layer_idx);
  at::Tensor v_plane = plan.v_planes.select(0, layer_idx);
  return paged_attention_prepared(q, k, v, k_plane, v_plane, plan.write_v, plan.cell_mapping, plan.gather,
                                  plan.q_index, plan.valid, plan.mask, plan.mode, scale, &plan.prep);
}

at::Tensor planned_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                             double scale) {
  return planned_attention_at(q, k, v, layer_idx, 0, scale);
}

// Whether bfloat16 GEMMs run AVX512-BF16's dot products (`on` and the CPU has them) or their float
// emulation, which gives the same bits; returns the choice made. For tests and measurements.
// The bfloat16 attention scores `paged_tasks` computes, unscaled: q [H, d] query heads against keys
// [n, d] -> float32 [H, n], 8 keys a call of `bf16_group_scores8` as there (a test's view of
// the sums, on the instruction or on its emulation: `use_bf16_dot_products`).
at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& keys) {
  TORCH_CHECK(q.dim() == 2 && keys.dim() == 2 && q.size(1) == keys.size(1), "attention_scores: q [H, d] and keys [n, d]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16, "attention_scores: bfloat16 only");
  const int64_t h = q.size(0), d = q.size(1), n = keys.size(0);
  const int64_t dpad = (d + kScoreChunk - 1) / kScoreChunk * kScoreChunk;
  std::vector<c10::BFloat16> qb(h * dpad, c10::BFloat16(0)), zeros(dpad, c10::BFloat16(0));
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous();
  for (int64_t i = 0; i < h; ++i) std::copy(qc.const_data_ptr<c10::BFloat16>() + i * d, qc.const_data_ptr<c10::BFloat16>() + (i + 1) * d, qb.begin() + i * dpad);
  at::Tensor out = at::empty({h, n}, q.options().dtype(at::kFloat));
  float* op = out.mutable_data_ptr<float>();
  const c10::BFloat16* kp = kc.const_data_ptr<c10::BFloat16>();
  std::vector<float> block((h + 1) / 2 * 16);
  for (int64_t j = 0; j < n; j += 8) {
    const c10::BFloat16* rows[8];
    for (int u = 0; u < 8; ++u) rows[u] = j + u < n ? kp + (j + u) * d : zeros.data();
    bf16_group_scores8(qb.data(), dpad, h, rows, d, block.data());
    for (int64_t x = 0; x < h; ++x) {
      for (int64_t u = 0; u < std::min<int64_t>(8, n - j); ++u) op[x * n + j + u] = block[8 * x + u];
    }
  }
  return out;
}

bool use_bf16_dot_products(bool on) {
  g_bf16_dot = on && __builtin_cpu_supports("avx512bf16");
  return g_bf16_dot;
}

}  // namespace

TORCH_LIBRARY(metrale_cpu, m) {
  m.def("use_bf16_dot_products(bool on) -> bool", &use_bf16_dot_products);
  m.def("kernel_clock(bool on) -> int", &kernel_clock);
  m.def("attention_scores(Tensor q, Tensor keys) -> Tensor");
  m.impl("attention_scores", c10::DispatchKey::CPU, TORCH_FN(attention_scores));
  m.def("routed_experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, "
        "int expert_offset, int padded_min_experts, int few_rows_max, Tensor? gate_up_packed=None, "
        "Tensor? down_packed=None) -> Tensor");
  m.impl("routed_experts", c10::DispatchKey::CPU, TORCH_FN(routed_experts));
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int max_rows, Tensor? packed=None) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.def("pack(Tensor w) -> Tensor");
  m.impl("pack", c10::DispatchKey::CPU, TORCH_FN(pack_weight));
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_plane, Tensor(b!) v_plane, bool write_v, "
        "Tensor cell_mapping, Tensor gather, Tensor? q_index, Tensor? valid, Tensor? mask, str mode, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def("set_attention_plan(Tensor k_planes, Tensor v_planes, bool write_v, Tensor cell_mapping, Tensor gather, "
        "Tensor? q_index, Tensor? valid, Tensor? mask, str mode) -> ()");
  m.impl("set_attention_plan", c10::DispatchKey::CPU, TORCH_FN(set_attention_plan));
  m.def("clear_attention_plan() -> ()", &clear_attention_plan);
  m.def("planned_attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor");
  m.impl("planned_attention", c10::DispatchKey::CPU, TORCH_FN(planned_attention));
  m.def("add_attention_plan(Tensor cell_mapping, Tensor gather, Tensor? q_index, Tensor? valid, Tensor? mask, "
        "str mode) -> int");
  m.impl("add_attention_plan", c10::DispatchKey::CPU, TORCH_FN(add_attention_plan));
  m.def("planned_attention_at(Tensor q, Tensor k, Tensor v, int layer_idx, int step, float scale) -> Tensor");
  m.impl("planned_attention_at", c10::DispatchKey::CPU, TORCH_FN(planned_attention_at));
}
