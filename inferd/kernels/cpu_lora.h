// LoRA deltas of a step's rows, each through its own adapter slot (Punica's SGMV): torch.ops.inferd.lora_add, the
// fused CPU version of inferd/kernels/reference.py lora_add (the buffer layout: inferd/models/lora.py).
//
// Not a standalone header: cpu_ops.cpp includes it inside its anonymous namespace, after its conversion helpers
// (Cvt, to_f, rnd, raw, check_cpu) and dot_bf16.
//
// A decode step has few rows per slot (e.g. 32 rows over 8 adapters) and runs ~120 of these calls: at::mm per slot
// would cost ~4 + 2 P dispatches each (index_select, mm, per-part mm, index_add), more than the arithmetic (and
// oneDNN's rank-16-thin matmuls are slow anyway). So a segment of up to kLoraLoopMaxRows rows runs hand-written
// loops, two passes over all such segments in one parallel region, no allocation but small buffers: the shrink
// (xa = x A^T, one task per (segment, A row): dot products over `in`, four rows per pass over the A row) and the
// expand (y += xa B^T, one task per (segment, part, 64 columns): four rows' accumulators in registers over the
// rows of bt). The adapters' weights come from memory at every call (8 slots of rank 16 are ~0.3x a SmolLM2 step's
// weight bytes), so both passes prefetch ahead. A longer segment (a long prefill chunk) goes through at::mm.
// Both compute as the reference does: float32 accumulation, xa and the delta rounded to y's dtype, then added.

// a segment of more rows goes through at::mm: measured (bench/lora_op.py --slots 1, one thread, bf16, SmolLM2's
// projections) the loops take 1/4 of at::mm's time at 17 rows, as much at 128-256, 1.1x at 512
constexpr int64_t kLoraLoopMaxRows = 256;
constexpr int64_t kLoraColBlock = 64;      // columns of one expand task (lora_expand_block computes 64)
constexpr int64_t kLoraParallelWork = 65536;  // multiply-adds (a few us) below which one thread does it all
constexpr int64_t kLoraPrefetch = 1024;   // elements of A ahead of the shrink's loads (the rows follow each other)

// The vector loops, in AVX-512 (16 floats a vector, 4 vectors a register tile's row) or AVX2 + FMA + F16C (8, 2):
// loads convert to float32 (bf16 by a 16-bit shift), sums are float32 fused multiply-adds. Without either, plain
// loops (the compiler's vectors).
#if defined(__AVX512F__)
#define INFERD_LORA_VEC 1
using LVec = __m512;
constexpr int kLW = 16, kLQ = 4;
inline LVec lv_zero() { return _mm512_setzero_ps(); }
inline LVec lv_set1(float v) { return _mm512_set1_ps(v); }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return _mm512_fmadd_ps(a, b, c); }
inline void lv_store(float* p, LVec v) { _mm512_storeu_ps(p, v); }
inline float lv_sum(LVec v) { return _mm512_reduce_add_ps(v); }
inline LVec lv_load(const float* p) { return _mm512_loadu_ps(p); }
inline LVec lv_load(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline LVec lv_load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INFERD_LORA_VEC 1
using LVec = __m256;
constexpr int kLW = 8, kLQ = 2;
inline LVec lv_zero() { return _mm256_setzero_ps(); }
inline LVec lv_set1(float v) { return _mm256_set1_ps(v); }
inline LVec lv_fma(LVec a, LVec b, LVec c) { return _mm256_fmadd_ps(a, b, c); }
inline void lv_store(float* p, LVec v) { _mm256_storeu_ps(p, v); }
inline float lv_sum(LVec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
inline LVec lv_load(const float* p) { return _mm256_loadu_ps(p); }
inline LVec lv_load(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline LVec lv_load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// out[i] = dot(a, xs[i]) over n, for NR rows at once (the A row loaded once, one accumulator per row)
template <typename T, int NR>
inline void lora_dots(const T* a, const T* const* xs, int64_t n, float* out) {
  int64_t k = 0;
#ifdef INFERD_HAVE_DPBF16
  if constexpr (std::is_same<T, uint16_t>::value) {  // bf16 pair dot products, exact products, float32 sums
    __m512 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
    for (; k + 32 <= n; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(a + k + kLoraPrefetch), _MM_HINT_T0);
      const __m512i va = _mm512_loadu_si512(reinterpret_cast<const void*>(a + k));
      for (int i = 0; i < NR; ++i) {
        const __m512i vx = _mm512_loadu_si512(reinterpret_cast<const void*>(xs[i] + k));
        acc[i] = _mm512_dpbf16_ps(acc[i], reinterpret_cast<const __m512bh&>(va), reinterpret_cast<const __m512bh&>(vx));
      }
    }
    for (int i = 0; i < NR; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
  } else
#endif
  {
#ifdef INFERD_LORA_VEC
    LVec acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = lv_zero();
    for (; k + kLW <= n; k += kLW) {
      if (k % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(a + k + kLoraPrefetch), _MM_HINT_T0);
      const LVec va = lv_load(a + k);
      for (int i = 0; i < NR; ++i) acc[i] = lv_fma(va, lv_load(xs[i] + k), acc[i]);
    }
    for (int i = 0; i < NR; ++i) out[i] = lv_sum(acc[i]);
#else
    for (int i = 0; i < NR; ++i) out[i] = 0.f;
#endif
  }
  for (int i = 0; i < NR; ++i) {  // the tail (all of it without vector loops)
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = k; j < n; ++j) s += to_f(a[j]) * to_f(xs[i][j]);
    out[i] += s;
  }
}

#ifdef INFERD_LORA_VEC
// acc[i, :64] = sum_j xa[i * xa_stride + j] * b[j * b_stride + :64] for NR rows: a full block of columns, kLQ
// vectors of it at a time with their accumulators in registers (each row of b loaded and converted once for the NR
// rows)
template <typename T, int NR>
inline void lora_expand_block(const T* b, int64_t b_stride, int64_t r, const float* xa, int64_t xa_stride,
                              float* acc) {
  constexpr int kCols = kLW * kLQ;
  for (int c0 = 0; c0 < 64; c0 += kCols) {
    LVec c[NR][kLQ];
    for (int i = 0; i < NR; ++i)
      for (int q = 0; q < kLQ; ++q) c[i][q] = lv_zero();
    for (int64_t j = 0; j < r; ++j) {
      const T* bj = b + j * b_stride;
      if (c0 == 0) {
        for (size_t o = 0; o < 64 * sizeof(T); o += 64)  // this row's columns of the task after next
          _mm_prefetch(reinterpret_cast<const char*>(bj + 128) + o, _MM_HINT_T0);
      }
      LVec bv[kLQ];
      for (int q = 0; q < kLQ; ++q) bv[q] = lv_load(bj + c0 + q * kLW);
      for (int i = 0; i < NR; ++i) {
        const LVec v = lv_set1(xa[i * xa_stride + j]);
        for (int q = 0; q < kLQ; ++q) c[i][q] = lv_fma(v, bv[q], c[i][q]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int q = 0; q < kLQ; ++q) lv_store(acc + i * 64 + c0 + q * kLW, c[i][q]);
  }
}
#endif

template <typename T>
inline void lora_dots_n(const T* a, const T* const* xs, int64_t rows, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) lora_dots<T, 4>(a, xs + i, n, out + i);
  switch (rows - i) {
    case 3: lora_dots<T, 3>(a, xs + i, n, out + i); break;
    case 2: lora_dots<T, 2>(a, xs + i, n, out + i); break;
    case 1: lora_dots<T, 1>(a, xs + i, n, out + i); break;
    default: break;
  }
}

struct LoraSeg {
  int64_t slot, lo, hi, rank;  // rows perm[lo:hi] through slot `slot` of rank `rank`
};

// The loops over the short segments. x rows: x + perm[i] * x_stride; y rows: y + perm[i] * y_stride.
template <typename T>
void lora_loops(T* y, int64_t y_stride, const T* x, int64_t x_stride, const int64_t* perm, const T* a, const T* bt,
                const std::vector<LoraSeg>& segs, int64_t in, int64_t out, int64_t max_rank, at::IntArrayRef parts) {
  const int64_t P = static_cast<int64_t>(parts.size());
  const int64_t a_slot = P * max_rank * in, bt_slot = max_rank * out, xa_width = P * max_rank;
  int64_t n = 0;
  for (const auto& s : segs) n = std::max(n, s.hi);
  std::vector<float> xa(n * xa_width);  // xa[i, p r + j]: row perm[i]'s shrink, rounded to T
  // the shrink: one task per (segment, A row)
  std::vector<int64_t> first(segs.size() + 1, 0);  // the first task of each segment
  for (size_t g = 0; g < segs.size(); ++g) first[g + 1] = first[g] + P * segs[g].rank;
  auto shrink = [&](int64_t task) {
    const size_t g = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
    const LoraSeg& s = segs[g];
    const int64_t row = task - first[g];
    const T* arow = a + s.slot * a_slot + row * in;
    for (int64_t i0 = s.lo; i0 < s.hi; i0 += 4) {  // four x rows per pass over the A row
      const int64_t nr = std::min<int64_t>(4, s.hi - i0);
      const T* xs[4];
      float dots[4];
      for (int64_t i = 0; i < nr; ++i) xs[i] = x + perm[i0 + i] * x_stride;
      lora_dots_n<T>(arow, xs, nr, in, dots);
      for (int64_t i = 0; i < nr; ++i) xa[(i0 + i) * xa_width + row] = rnd<T>(dots[i]);
    }
  };
  // the expand: one task per (segment, part, block of kLoraColBlock columns)
  struct Task {
    int64_t seg, part, off, size, c0, c1;  // columns [c0, c1) of part `part` (at column off, size wide)
  };
  std::vector<Task> tasks;
  int64_t work = 0;  // multiply-adds
  for (size_t g = 0; g < segs.size(); ++g) {
    int64_t off = 0;
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t c = 0; c < parts[p]; c += kLoraColBlock)
        tasks.push_back({static_cast<int64_t>(g), p, off, parts[p], c, std::min(parts[p], c + kLoraColBlock)});
      off += parts[p];
    }
    work += (segs[g].hi - segs[g].lo) * segs[g].rank * (P * in + out);
  }
  auto expand = [&](int64_t t) {
    alignas(64) float acc[4][kLoraColBlock];
    const Task& k = tasks[t];
    const LoraSeg& s = segs[k.seg];
    const int64_t r = s.rank, w = k.c1 - k.c0;
    // part p's block of scale * B^T: row-major [r, size] at element r * off of the slot
    const T* b = bt + s.slot * bt_slot + r * k.off + k.c0;
    for (int64_t i0 = s.lo; i0 < s.hi; i0 += 4) {  // four rows at a time, their accumulators in registers
      const int64_t nr = std::min<int64_t>(4, s.hi - i0);
      const float* xs = xa.data() + i0 * xa_width + k.part * r;  // row i0 + i's j-th: xs[i * xa_width + j]
#ifdef INFERD_LORA_VEC
      static_assert(kLoraColBlock == 64, "lora_expand_block computes 64 columns");
      if (w == kLoraColBlock) {
        switch (nr) {
          case 4: lora_expand_block<T, 4>(b, k.size, r, xs, xa_width, acc[0]); break;
          case 3: lora_expand_block<T, 3>(b, k.size, r, xs, xa_width, acc[0]); break;
          case 2: lora_expand_block<T, 2>(b, k.size, r, xs, xa_width, acc[0]); break;
          default: lora_expand_block<T, 1>(b, k.size, r, xs, xa_width, acc[0]); break;
        }
      } else
#endif
      {
        for (int64_t i = 0; i < nr; ++i) std::fill(acc[i], acc[i] + w, 0.f);
        for (int64_t j = 0; j < r; ++j) {
          const T* bj = b + j * k.size;
          for (int64_t i = 0; i < nr; ++i) {
            const float v = xs[i * xa_width + j];
            float* ai = acc[i];
#pragma omp simd
            for (int64_t c = 0; c < w; ++c) ai[c] = std::fma(v, to_f(bj[c]), ai[c]);
          }
        }
      }
      for (int64_t i = 0; i < nr; ++i) {  // y += delta, the delta rounded first (the reference's index_add)
        T* yi = y + perm[i0 + i] * y_stride + k.off + k.c0;
        const float* ai = acc[i];
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) yi[c] = from_f<T>(to_f(yi[c]) + rnd<T>(ai[c]));
      }
    }
  };
  // One parallel region for both passes (torch's OpenMP pool, as at::parallel_for's; a barrier between them):
  // a region costs microseconds, as much as a small call's arithmetic. Static chunks: a thread's shrink tasks are
  // consecutive A rows, one stream for the prefetcher.
  const int64_t n_shrink = first.back(), n_expand = static_cast<int64_t>(tasks.size());
  const int threads = at::in_parallel_region() || work < kLoraParallelWork ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < n_shrink; ++task) shrink(task);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_expand; ++t) expand(t);
  }
}

// A long segment (a prefill chunk) through at::mm: the reference's ops for it.
void lora_mm(at::Tensor& y, const at::Tensor& x, const at::Tensor& perm, const LoraSeg& s, const at::Tensor& a,
             const at::Tensor& bt, at::IntArrayRef parts) {
  const int64_t P = static_cast<int64_t>(parts.size()), r = s.rank;
  const at::Tensor rows = perm.slice(0, s.lo, s.hi);
  const at::Tensor xa = at::mm(x.index_select(0, rows), a[s.slot].slice(0, 0, P * r).t());  // [rows, P r]
  at::Tensor delta = at::empty({s.hi - s.lo, y.size(1)}, y.options());
  const at::Tensor b = bt[s.slot];
  int64_t off = 0;
  for (int64_t p = 0; p < P; ++p) {
    at::Tensor cols = delta.slice(1, off, off + parts[p]);
    at::mm_out(cols, xa.slice(1, p * r, (p + 1) * r), b.slice(0, r * off, r * (off + parts[p])).view({r, parts[p]}));
    off += parts[p];
  }
  y.index_add_(0, rows, delta);
}

// y += the deltas (reference.lora_add without row_slots: the per-row form a Triton kernel reads)
void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& perm, at::IntArrayRef seg_slots,
                at::IntArrayRef seg_starts, const at::Tensor& a, const at::Tensor& bt, at::IntArrayRef ranks,
                at::IntArrayRef parts) {
  check_cpu(y, "y");
  check_cpu(x, "x");
  TORCH_CHECK(perm.device().is_cpu() && perm.scalar_type() == at::kLong && perm.dim() == 1 && perm.is_contiguous(),
              "lora_add: perm must be a contiguous int64 [N] CPU tensor");
  const int64_t N = perm.size(0);
  if (N == 0) return;
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && x.dim() == 2 && x.stride(1) == 1 && x.size(0) == y.size(0),
              "lora_add: y [T, out] and x [T, in] must have contiguous rows");
  const int64_t T_ = y.size(0), out = y.size(1), in = x.size(1), P = static_cast<int64_t>(parts.size());
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf,
              "lora_add: y must be float32, bfloat16 or float16");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  bt.scalar_type() == y.scalar_type(),
              "lora_add: x, a and bt must have y's dtype");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && bt.dim() == 2 && bt.is_contiguous() && a.size(0) == bt.size(0) &&
                  P > 0 && a.size(1) % P == 0 && a.size(2) == in,
              "lora_add: a must be a contiguous [slots, parts * max_rank, in], bt a contiguous [slots, max_rank * out]");
  const int64_t S = a.size(0), R = a.size(1) / P;
  TORCH_CHECK(bt.size(1) == R * out, "lora_add: bt must be [slots, max_rank * out]");
  int64_t total = 0;
  for (int64_t p : parts) {
    TORCH_CHECK(p > 0, "lora_add: part sizes must be positive");
    total += p;
  }
  TORCH_CHECK(total == out, "lora_add: the parts must sum to y's width");
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == S, "lora_add: one rank per slot");
  const int64_t G = static_cast<int64_t>(seg_slots.size());
  TORCH_CHECK(static_cast<int64_t>(seg_starts.size()) == G + 1 && seg_starts[0] == 0 && seg_starts[G] == N,
              "lora_add: seg_starts must be [0, ..., N], one more than seg_slots");
  const int64_t* pp = perm.data_ptr<int64_t>();
  std::vector<char> seen(T_, 0);  // a row twice would be two tasks writing it at once
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < T_ && !seen[pp[i]], "lora_add: perm rows must be distinct rows of y");
    seen[pp[i]] = 1;
  }
  std::vector<LoraSeg> loops, mms;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t s = seg_slots[g], lo = seg_starts[g], hi = seg_starts[g + 1];
    TORCH_CHECK(s >= 0 && s < S, "lora_add: segment slot out of range");
    TORCH_CHECK(lo <= hi, "lora_add: seg_starts must not decrease");
    TORCH_CHECK(ranks[s] >= 0 && ranks[s] <= R, "lora_add: a slot's rank exceeds max_rank");
    if (hi == lo || ranks[s] == 0) continue;  // nothing to add
    (hi - lo <= kLoraLoopMaxRows ? loops : mms).push_back({s, lo, hi, ranks[s]});
  }
  for (const auto& s : mms) lora_mm(y, x, perm, s, a, bt, parts);
  if (loops.empty()) return;
  auto run = [&](auto type) {
    using S_ = decltype(type);
    lora_loops(raw<S_>(y), y.stride(0), raw<S_>(x), x.stride(0), pp, raw<S_>(a), raw<S_>(bt), loops, in, out, R,
               parts);
  };
  if (y.scalar_type() == at::kFloat) {
    run(float{});
  } else if (y.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(c10::Half{});
  }
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& perm, at::IntArrayRef seg_slots,
              at::IntArrayRef seg_starts, const at::Tensor& row_slots, const at::Tensor& a, const at::Tensor& bt,
              at::IntArrayRef ranks, at::IntArrayRef parts) {
  (void)row_slots;
  lora_apply(y, x, perm, seg_slots, seg_starts, a, bt, ranks, parts);
}
