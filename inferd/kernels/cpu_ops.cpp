// inferd's fused CPU operators, registered as torch.ops.inferd.* (built by inferd/kernels/build.py with the host's
// compiler for the host's CPU; loaded with torch.ops.load_library).
//
// Each op has a plain torch reference in inferd/kernels/reference.py that tests compare it against. The pointwise
// ops round to the activation dtype at the same points as their reference does (x*cos, rotate(x)*sin and their sum
// each rounded, as three torch ops would), so in bf16 they are bit-for-bit their reference; only reductions (the
// RMSNorm's sum of squares, attention) add in another order. Attention computes in float32 throughout.
//
// Parallelism: at::parallel_for, i.e. torch's own OpenMP pool (torch.set_num_threads applies).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Conversions written so that the compiler vectorizes them (no branches, no library calls): bf16 <-> float by bit
// shifts with round-to-nearest-even (NaN stays NaN), exactly as c10::BFloat16 converts.
inline float bf16_bits_to_f(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t f_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  uint16_t r = static_cast<uint16_t>((u + (((u >> 16) & 1) + 0x7FFFu)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : r;
}

// exp(x) for float32, branch-free so that loops over it vectorize (glibc's expf is a scalar call unless built with
// -ffast-math): Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial for e^r (the
// Cephes expf coefficients), about 1 ulp from the exact value. Inputs are clamped to [-87.3, 88.7] (e^x stays a
// normal float; below that softmax weights and SiLU's tail are zero to float32 anyway).
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// tanh(x) for float32, branch-free (vectorizes) from exp_f32: Cephes' tanhf, an odd polynomial below |x| = 0.625
// (where 1 - 2 / (e^2x + 1) would cancel) and 1 - 2 / (e^2|x| + 1) above, a few ulp from the exact value. The
// attention soft-cap (softcap * tanh(s / softcap)) needs it once per score.
inline float tanh_f32(float x) {
  const float a = std::fabs(x);
  const float z = x * x;
  const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                        1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  const float big = 1.f - 2.f / (exp_f32(2.f * a) + 1.f);
  return a < 0.625f ? small : std::copysign(big, x);
}

template <typename T>
struct Cvt {  // c10::Half
  static inline float load(T x) { return static_cast<float>(x); }
  static inline T store(float x) { return static_cast<T>(x); }
};
template <>
struct Cvt<float> {
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};
template <>
struct Cvt<uint16_t> {  // bf16 as its raw bits: loads of a plain integer type vectorize, of c10::BFloat16 do not
  static inline float load(uint16_t x) { return bf16_bits_to_f(x); }
  static inline uint16_t store(float x) { return f_to_bf16_bits(x); }
};

// the type a kernel computes on: bf16 tensors as uint16_t bits
template <typename T>
struct Raw {
  using type = T;
};
template <>
struct Raw<c10::BFloat16> {
  using type = uint16_t;
};
template <typename T>
inline typename Raw<T>::type* raw(const at::Tensor& t) {
  return reinterpret_cast<typename Raw<T>::type*>(t.data_ptr<T>());
}

template <typename T>
inline float to_f(T x) { return Cvt<T>::load(x); }
template <typename T>
inline T from_f(float x) { return Cvt<T>::store(x); }
// float -> scalar_t -> float: the rounding a torch op in scalar_t applies to its result
template <typename T>
inline float rnd(float x) { return Cvt<T>::load(Cvt<T>::store(x)); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ---- add + RMSNorm ---------------------------------------------------------------------------------------------
// residual (in/out) <- residual + x (rounded to the dtype), out <- weight * round(r * rsqrt(mean(r^2) + eps)).
// With has_x false: no add (the first layer), residual is only read.
template <typename T>
void add_rms_norm_kernel(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps,
                         bool has_x) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    for (int64_t i = begin; i < end; ++i) {
      T* res = residual + i * n;
      float ss = 0.f;
      if (has_x) {
        const T* xi = x + i * n;
        for (int64_t j = 0; j < n; ++j) {
          T s = from_f<T>(to_f(xi[j]) + to_f(res[j]));
          res[j] = s;
          r[j] = to_f(s);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) r[j] = to_f(res[j]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < n; ++j) ss += r[j] * r[j];
      float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + i * n;
      for (int64_t j = 0; j < n; ++j) o[j] = from_f<T>(to_f(weight[j]) * rnd<T>(r[j] * inv));
    }
  });
}

at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_cpu(residual, "residual");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous [rows, n] tensor");
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == residual.scalar_type() &&
                  weight.is_contiguous(),
              "weight must be a contiguous [n] tensor of the residual's dtype");
  at::Tensor xc;
  if (x.has_value()) {
    xc = x->contiguous();
    TORCH_CHECK(xc.sizes() == residual.sizes() && xc.scalar_type() == residual.scalar_type(),
                "x must match the residual");
  }
  at::Tensor out = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    using R = typename Raw<scalar_t>::type;
    add_rms_norm_kernel<R>(x.has_value() ? raw<scalar_t>(xc) : nullptr, raw<scalar_t>(residual),
                           raw<scalar_t>(weight), raw<scalar_t>(out), rows, n,
                                  static_cast<float>(eps), x.has_value());
  });
  return out;
}

// ---- RoPE on q and k (in place in the fused qkv rows) + the KV cache write ---------------------------------------
// qkv: [T, (H + 2 KV) * D], rows contiguous. The q and k heads are rotated in place (rotate_half convention:
// x * cos + cat(-x2, x1) * sin, each product and the sum rounded as torch would), then k and v are copied to their
// cache slots (cast to the cache's dtype when it is float32/bf16/fp16; other caches are written by the caller).
// Tables R < D wide (partial rotary, Phi) rotate each head's first R dims (halves of R / 2) and leave the rest.
template <typename T>
void rope_kernel(T* qkv, int64_t row_stride, const int64_t* pos, const T* cos, const T* sin, int64_t T_, int64_t H,
                 int64_t KV, int64_t D, int64_t R) {
  const int64_t half = R / 2;
  at::parallel_for(0, T_, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(R);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + pos[t] * R;
      const T* s = sin + pos[t] * R;
      T* row = qkv + t * row_stride;
      for (int64_t h = 0; h < H + KV; ++h) {
        T* x = row + h * D;
        for (int64_t j = 0; j < R; ++j) {
          float rot = j < half ? -to_f(x[j + half]) : to_f(x[j - half]);
          // -x rounds exactly; rotate_half(x) * sin rounded, x * cos rounded, their sum rounded
          tmp[j] = rnd<T>(rnd<T>(to_f(x[j]) * to_f(c[j])) + rnd<T>(rot * to_f(s[j])));
        }
        for (int64_t j = 0; j < R; ++j) x[j] = from_f<T>(tmp[j]);
      }
    }
  });
}

template <typename T, typename C>
void write_kv_rows(const T* qkv, int64_t row_stride, int64_t T_, int64_t H, int64_t KV, int64_t D, C* kc, C* vc,
                   int64_t head_stride, const int64_t* slots) {
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* k = qkv + t * row_stride + H * D;
      const T* v = k + KV * D;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < KV; ++h) {
        C* kd = kc + h * head_stride + slot * D;
        C* vd = vc + h * head_stride + slot * D;
        for (int64_t j = 0; j < D; ++j) {
          kd[j] = from_f<C>(to_f(k[h * D + j]));
          vd[j] = from_f<C>(to_f(v[h * D + j]));
        }
      }
    }
  });
}

void rope_kv_write(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                   int64_t num_kv_heads) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, width] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [KV, blocks, block_size, D] tensors alike");
  const int64_t T_ = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(k_cache.size(0) == num_kv_heads, "the cache's head count differs from num_kv_heads");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width != (H + 2 KV) * D");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == T_ && slot_mapping.numel() == T_ && positions.is_contiguous() &&
                  slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos/sin must be contiguous [positions, R] tables of qkv's dtype");
  const int64_t R = cos.size(1);  // the rotated dims of each head: D, or fewer with partial rotary
  TORCH_CHECK(R > 0 && R <= D && R % 2 == 0, "the rope tables' width must be even and at most head_dim");
  const int64_t max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of the rope table");
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_kv_write", [&] {
    using T = typename Raw<scalar_t>::type;
    T* qkv_p = raw<scalar_t>(qkv);
    rope_kernel<T>(qkv_p, qkv.stride(0), pos, raw<scalar_t>(cos), raw<scalar_t>(sin), T_, num_heads,
                   num_kv_heads, D, R);
    const int64_t head_stride = num_slots * D;
    auto ct = k_cache.scalar_type();
    if (ct == at::kFloat) {
      write_kv_rows<T, float>(qkv_p, qkv.stride(0), T_, num_heads, num_kv_heads, D,
                              k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), head_stride, slots);
    } else if (ct == at::kBFloat16) {
      write_kv_rows<T, uint16_t>(qkv_p, qkv.stride(0), T_, num_heads, num_kv_heads, D,
                                 raw<c10::BFloat16>(k_cache), raw<c10::BFloat16>(v_cache),
                                      head_stride, slots);
    } else if (ct == at::kHalf) {
      write_kv_rows<T, c10::Half>(qkv_p, qkv.stride(0), T_, num_heads, num_kv_heads, D,
                                  k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>(), head_stride, slots);
    } else {
      TORCH_CHECK(false, "rope_kv_write: unsupported cache dtype ", ct);
    }
  });
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------------------------------
template <typename T>
void silu_mul_kernel(const T* gu, int64_t row_stride, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gu + i * row_stride;
      const T* u = g + n;
      T* o = out + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        float x = to_f(g[j]);
        float s = rnd<T>(x / (1.f + exp_f32(-x)));
        o[j] = from_f<T>(s * to_f(u[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2n] with contiguous rows");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_kernel<typename Raw<scalar_t>::type>(raw<scalar_t>(gate_up), gate_up.stride(0), raw<scalar_t>(out), rows,
                                                  n);
  });
  return out;
}

// ---- decode attention over the paged cache, in place --------------------------------------------------------------
// q: [B, H, D] (any row stride, heads contiguous); caches [KV, blocks, block_size, D]; block_tables int32
// [B, max_blocks]; context_lens int32 [B]. Each (sequence, KV head) is one task: the G = H / KV query heads that
// share the KV head score every key of the context (read where it lies: no gathered copy, no padding, no mask),
// softmax in float32, and the weighted sum of the values.
// A layer's attention options (paged.attend's semantics): window > 0 keeps the last `window` positions of the
// context (the query's own included), and the blocks wholly before them are never read; softcap > 0 soft-caps each
// scaled score (softcap * tanh(s / softcap)); sinks (one float32 logit per query head) join each softmax's
// denominator and take no value.
struct AttnOptions {
  int64_t window = 0;
  const float* sinks = nullptr;  // [H], float32
  float softcap = 0.f;
};

// softmax in place over each of G rows of L scores (float32), soft-capped first when softcap > 0; sink (nullable):
// the G rows' sink logits
inline void softmax_rows(float* scores, int64_t G, int64_t L, float softcap = 0.f, const float* sink = nullptr) {
  if (softcap > 0.f) {
#pragma omp simd
    for (int64_t t = 0; t < G * L; ++t) scores[t] = softcap * tanh_f32(scores[t] / softcap);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float m = sink ? sink[g] : -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = sink ? exp_f32(sink[g] - m) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = exp_f32(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
}

template <typename C>
inline float dot_qk(const float* qf, const C* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < D; ++j) s += qf[j] * to_f(k[j]);
  return s;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bf16 query . bf16 key with AVX-512 BF16's pair dot products accumulating in float32 (exact products)
inline float dot_bf16(const uint16_t* q, const uint16_t* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 32) {
    __m512i vq = _mm512_loadu_si512(reinterpret_cast<const void*>(q + j));
    __m512i vk = _mm512_loadu_si512(reinterpret_cast<const void*>(k + j));
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(vq), reinterpret_cast<__m512bh&>(vk));
  }
  return _mm512_reduce_add_ps(acc);
}
#define INFERD_HAVE_DPBF16 1

// One (sequence, KV head) task for bf16 q and cache with head_dim 64 and G <= 4 query heads per KV head (SmolLM2,
// Llama 3): q, the accumulators and a value row stay in registers; scores by bf16 pair dot products. Positions
// [lo, L) (lo > 0: a sliding window), scores[g * (L - lo) + t - lo].
template <int G>
void attn_task_bf16_d64(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int32_t* table, int64_t lo,
                        int64_t L, int64_t bs, float scale, float softcap, const float* sink, float* scores,
                        uint16_t* out, int64_t out_head_stride) {
  __m512i qv[G][2];
  for (int g = 0; g < G; ++g) {
    qv[g][0] = _mm512_loadu_si512(reinterpret_cast<const void*>(q + g * 64));
    qv[g][1] = _mm512_loadu_si512(reinterpret_cast<const void*>(q + g * 64 + 32));
  }
  const int64_t nblk = (L + bs - 1) / bs, W = L - lo;
  for (int64_t blk = lo / bs; blk < nblk; ++blk) {
    const uint16_t* kb = kh + static_cast<int64_t>(table[blk]) * bs * 64;
    const int64_t n = std::min(bs, L - blk * bs);
    for (int64_t o = std::max<int64_t>(0, lo - blk * bs); o < n; ++o) {
      const __m512i k0 = _mm512_loadu_si512(reinterpret_cast<const void*>(kb + o * 64));
      const __m512i k1 = _mm512_loadu_si512(reinterpret_cast<const void*>(kb + o * 64 + 32));
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qv[g][0], (__m512bh)k0);
        a = _mm512_dpbf16_ps(a, (__m512bh)qv[g][1], (__m512bh)k1);
        scores[g * W + blk * bs + o - lo] = _mm512_reduce_add_ps(a) * scale;
      }
    }
  }
  softmax_rows(scores, G, W, softcap, sink);
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t blk = lo / bs; blk < nblk; ++blk) {
    const uint16_t* vb = vh + static_cast<int64_t>(table[blk]) * bs * 64;
    const int64_t n = std::min(bs, L - blk * bs);
    for (int64_t o = std::max<int64_t>(0, lo - blk * bs); o < n; ++o) {
      __m512 vf[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i raw16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + o * 64 + 16 * i));
        vf[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw16), 16));
      }
      const int64_t t = blk * bs + o - lo;
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * W + t]);
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(p, vf[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) {  // round to nearest even, as the generic path's f_to_bf16_bits
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, acc[g][i]);
      for (int j = 0; j < 16; ++j) out[g * out_head_stride + 16 * i + j] = f_to_bf16_bits(tmp[j]);
    }
}
#endif

template <typename T, typename C>
void decode_attention_kernel(const T* q, int64_t q_row_stride, const C* kc, const C* vc, const int32_t* tables,
                             int64_t max_blocks, const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KV,
                             int64_t D, int64_t num_blocks, int64_t bs, float scale, const AttnOptions& opt) {
  const int64_t G = H / KV;
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<uint16_t> qb(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, h = task % KV;
      const int64_t L = lens[b];
      const int64_t nblk = (L + bs - 1) / bs;
      const int64_t lo = opt.window > 0 ? std::max<int64_t>(0, L - opt.window) : 0;  // the first position seen
      const int64_t W = L - lo, blk0 = lo / bs;
      const float* sink = opt.sinks ? opt.sinks + h * G : nullptr;
      const int32_t* table = tables + b * max_blocks;
#ifdef INFERD_HAVE_DPBF16
      if constexpr (std::is_same<T, uint16_t>::value && std::is_same<C, uint16_t>::value) {
        if (D == 64 && G <= 4) {
          scores.resize(G * W);
          const T* qrow = q + b * q_row_stride + h * G * D;
          const C* kh = kc + h * num_blocks * bs * D;
          const C* vh = vc + h * num_blocks * bs * D;
          T* o = out + (b * H + h * G) * D;
          float* sp = scores.data();
          const float cap = opt.softcap;
          switch (G) {
            case 1: attn_task_bf16_d64<1>(qrow, kh, vh, table, lo, L, bs, scale, cap, sink, sp, o, D); break;
            case 2: attn_task_bf16_d64<2>(qrow, kh, vh, table, lo, L, bs, scale, cap, sink, sp, o, D); break;
            case 3: attn_task_bf16_d64<3>(qrow, kh, vh, table, lo, L, bs, scale, cap, sink, sp, o, D); break;
            default: attn_task_bf16_d64<4>(qrow, kh, vh, table, lo, L, bs, scale, cap, sink, sp, o, D); break;
          }
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < D; ++j) qf[g * D + j] = to_f(q[b * q_row_stride + (h * G + g) * D + j]);
#ifdef INFERD_HAVE_DPBF16
      constexpr bool use_dp = std::is_same<T, uint16_t>::value && std::is_same<C, uint16_t>::value;
      if (use_dp && D % 32 == 0)
        for (int64_t j = 0; j < G * D; ++j) qb[j] = f_to_bf16_bits(qf[j]);  // exact: q is bf16
#endif
      scores.resize(G * W);
      const C* kh = kc + h * num_blocks * bs * D;
      const C* vh = vc + h * num_blocks * bs * D;
      for (int64_t blk = blk0; blk < nblk; ++blk) {
        const C* kb = kh + static_cast<int64_t>(table[blk]) * bs * D;
        const int64_t n = std::min(bs, L - blk * bs);
        for (int64_t o = std::max<int64_t>(0, lo - blk * bs); o < n; ++o) {
          const int64_t t = blk * bs + o - lo;
          const C* k = kb + o * D;
#ifdef INFERD_HAVE_DPBF16
          if constexpr (use_dp) {
            if (D % 32 == 0) {
              for (int64_t g = 0; g < G; ++g) scores[g * W + t] = dot_bf16(qb.data() + g * D, k, D) * scale;
              continue;
            }
          }
#endif
          for (int64_t g = 0; g < G; ++g) scores[g * W + t] = dot_qk(qf.data() + g * D, k, D) * scale;
        }
      }
      softmax_rows(scores.data(), G, W, opt.softcap, sink);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = blk0; blk < nblk; ++blk) {
        const C* vb = vh + static_cast<int64_t>(table[blk]) * bs * D;
        const int64_t n = std::min(bs, L - blk * bs);
        for (int64_t o = std::max<int64_t>(0, lo - blk * bs); o < n; ++o) {
          const C* v = vb + o * D;
          const int64_t t = blk * bs + o - lo;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * W + t];
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t j = 0; j < D; ++j) a[j] += p * to_f(v[j]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < D; ++j) out[(b * H + h * G + g) * D + j] = from_f<T>(acc[g * D + j]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const c10::optional<at::Tensor>& sinks, double softcap) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [B, H, D], heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [KV, blocks, block_size, D] tensors alike");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && D <= 256, "head_dim must match the cache's and be <= 256");
  TORCH_CHECK(H % KV == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.numel() == B && context_lens.is_contiguous(),
              "context_lens must be contiguous int32 [B]");
  const int64_t num_blocks = k_cache.size(1), bs = k_cache.size(2), max_blocks = block_tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * bs, "context length out of its block table");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks, "block id out of the cache");
  }
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: the whole context)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: no soft-cap)");
  AttnOptions opt;
  opt.window = window;
  opt.softcap = static_cast<float>(softcap);
  at::Tensor sinks_f;  // float32 copy (a [H] vector: free), alive for the call
  if (sinks.has_value()) {
    check_cpu(*sinks, "sinks");
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && at::isFloatingType(sinks->scalar_type()),
                "sinks must be a floating [num_heads] tensor");
    sinks_f = sinks->to(at::kFloat).contiguous();
    opt.sinks = sinks_f.data_ptr<float>();
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    using T = typename Raw<scalar_t>::type;
    auto ct = k_cache.scalar_type();
    auto run = [&](auto cache_type) {
      using C = decltype(cache_type);
      using RC = typename Raw<C>::type;
      decode_attention_kernel<T, RC>(raw<scalar_t>(q), q.stride(0), raw<C>(k_cache), raw<C>(v_cache), tables,
                                     max_blocks, lens, raw<scalar_t>(out), B, H, KV, D, num_blocks, bs, sc, opt);
    };
    if (ct == at::kFloat) {
      run(float{});
    } else if (ct == at::kBFloat16) {
      run(c10::BFloat16{});
    } else if (ct == at::kHalf) {
      run(c10::Half{});
    } else {
      TORCH_CHECK(false, "paged_decode_attention: unsupported cache dtype ", ct);
    }
  });
  return out;
}

// ---- LoRA deltas per adapter slot (lora_add) ----------------------------------------------------------------------
#include "cpu_lora.h"

// ---- the decoder stack of a pure decode step, in one call -----------------------------------------------------
// The same operations as the Python layers (inferd/models/llama.py: DecoderLayer.forward over the fused ops above,
// in the same order, so the same bits), looped here instead of in Python: a decode step of a small model at batch 1
// is ~300 small calls whose Python and dispatcher overhead (~2-3 ms of a ~10 ms int4 step) is most of what is not
// arithmetic. Each layer's four matmuls are given as (kind, weight, aux, bias): kind 0 oneDNN's packed Linear
// (mkldnn::_linear_pointwise), 1 torch's int4 kernel (weight = the int4pack, aux = scales and zeros, group 32),
// 2 a plain at::linear. Norm weights: two per layer, then the final norm. Returns the final norm's output.
// LoRA (lora_a non-empty: one a and one bt per linear, in the weights' order): after each matmul, its rows' adapter
// deltas by lora_apply, as Linear.forward adds them; lora_parts gives each of a layer's four linears its part count,
// then the part sizes (e.g. [3, q, kv, kv, 1, h, 2, i, i, 1, h]).

enum LinearKind : int64_t { kMkldnn = 0, kInt4 = 1, kDense = 2 };

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

at::Tensor stack_linear(int64_t kind, const at::Tensor& x, const at::Tensor& w, const at::Tensor& aux,
                        const c10::optional<at::Tensor>& bias) {
  switch (kind) {
    case kMkldnn:
      return packed_linear(x, w, bias);
    case kInt4: {  // Int4Linear._forward: the rows contiguous, the int4 kernel, then the bias
      at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), w, 32, aux);
      return bias.has_value() ? y + *bias : y;
    }
    case kDense:
      return at::linear(x, w, bias);
    default:
      TORCH_CHECK(false, "decode_layers: unknown linear kind ", kind);
  }
}

at::Tensor decode_layers(at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, at::TensorList k_caches, at::TensorList v_caches,
                         at::TensorList norms, double eps, at::TensorList weights, at::TensorList aux,
                         const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef kinds, int64_t num_heads,
                         int64_t num_kv_heads, double scale, const c10::optional<at::Tensor>& lora_perm,
                         at::IntArrayRef lora_seg_slots, at::IntArrayRef lora_seg_starts,
                         const c10::optional<at::Tensor>& lora_row_slots, at::TensorList lora_a, at::TensorList lora_bt,
                         at::IntArrayRef lora_ranks, at::IntArrayRef lora_parts) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(norms.size()) == 2 * L + 1 &&
                  static_cast<int64_t>(weights.size()) == 4 * L && static_cast<int64_t>(aux.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L && static_cast<int64_t>(kinds.size()) == 4 * L,
              "decode_layers: per layer two caches, two norms, four linears (and a final norm)");
  (void)lora_row_slots;  // the per-row form of the segments, for a per-row (GPU) kernel
  const bool lora = !lora_a.empty();
  at::IntArrayRef parts[4];
  if (lora) {
    TORCH_CHECK(static_cast<int64_t>(lora_a.size()) == 4 * L && static_cast<int64_t>(lora_bt.size()) == 4 * L &&
                    lora_perm.has_value(),
                "decode_layers: LoRA takes the step's perm and one a and one bt per linear");
    size_t at = 0;
    for (int j = 0; j < 4; ++j) {
      TORCH_CHECK(at < lora_parts.size() && lora_parts[at] > 0 && at + 1 + lora_parts[at] <= lora_parts.size(),
                  "decode_layers: lora_parts must hold four (count, sizes...) groups");
      parts[j] = lora_parts.slice(at + 1, lora_parts[at]);
      at += 1 + lora_parts[at];
    }
    TORCH_CHECK(at == lora_parts.size(), "decode_layers: lora_parts must hold four (count, sizes...) groups");
  }
  const int64_t T = residual.size(0), D = k_caches[0].size(3), q_size = num_heads * D;
  c10::optional<at::Tensor> x;
  for (int64_t l = 0; l < L; ++l) {
    auto lin = [&](int64_t j, const at::Tensor& in) {
      const int64_t i = 4 * l + j;
      at::Tensor y = stack_linear(kinds[i], in, weights[i], aux[i], biases.get(i));
      if (lora)
        lora_apply(y, in, *lora_perm, lora_seg_slots, lora_seg_starts, lora_a[i], lora_bt[i], lora_ranks, parts[j]);
      return y;
    };
    at::Tensor h = add_rms_norm(x, residual, norms[2 * l], eps);
    at::Tensor qkv = lin(0, h);
    rope_kv_write(qkv, positions, cos, sin, k_caches[l], v_caches[l], slot_mapping, num_heads, num_kv_heads);
    at::Tensor q = qkv.slice(1, 0, q_size).view({T, num_heads, D});
    // plain layers only (the model checks Attention.plain): no window, sinks or soft-cap
    at::Tensor attn = paged_decode_attention(q, k_caches[l], v_caches[l], block_tables, context_lens, scale, 0,
                                             c10::nullopt, 0.0);
    h = add_rms_norm(lin(1, attn.reshape({T, q_size})), residual, norms[2 * l + 1], eps);
    x = lin(3, silu_mul(lin(2, h)));
  }
  return add_rms_norm(x, residual, norms[2 * L], eps);
}

// ---- grammar masks (structured outputs) ------------------------------------------------------------------------
// logits float32 [N, V] (contiguous rows); bitmask int32 [N, ceil(V / 32)]: bit j of word w allows token 32w + j;
// rows int64: the logits rows to mask (bitmask row r masks logits row r). Every token whose bit is 0 gets -inf, in
// place. A word of all ones (every token allowed) is skipped; 16 logits at a time with an AVX-512 masked store where
// the CPU has it. Pure writes of -inf: the result is exactly xgrammar's apply_token_bitmask_inplace.
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_cpu(logits, "logits");
  check_cpu(bitmask, "bitmask");
  check_cpu(rows, "rows");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [N, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [n]");
  const int64_t V = logits.size(1), words = bitmask.size(1), n = rows.size(0);
  TORCH_CHECK(words * 32 >= V, "the bitmask covers ", words * 32, " tokens, fewer than the logits' ", V);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "row ", row_ids[i], " is outside the logits or the bitmask");
  }
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = row_ids[i];
      float* out = base + r * stride;
      const uint32_t* m = mask + r * words;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t t0 = w * 32;
#if defined(__AVX512F__)
        if (t0 + 32 <= V) {
          const __m512 v = _mm512_set1_ps(ninf);
          _mm512_mask_storeu_ps(out + t0, static_cast<__mmask16>(~bits & 0xFFFFu), v);
          _mm512_mask_storeu_ps(out + t0 + 16, static_cast<__mmask16>((~bits >> 16) & 0xFFFFu), v);
          continue;
        }
#endif
        const int64_t stop = std::min<int64_t>(32, V - t0);
        for (int64_t j = 0; j < stop; ++j) {
          if (!((bits >> j) & 1u)) out[t0 + j] = ninf;
        }
      }
    }
  });
}


}  // namespace

TORCH_LIBRARY(inferd, m) {
  m.def("add_rms_norm(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_kv_write(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, Tensor? sinks=None, float softcap=0.) -> Tensor");
  m.def("decode_layers(Tensor(a!) residual, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] norms, "
        "float eps, Tensor[] weights, Tensor[] aux, Tensor?[] biases, int[] kinds, int num_heads, "
        "int num_kv_heads, float scale, Tensor? lora_perm, int[] lora_seg_slots, int[] lora_seg_starts, "
        "Tensor? lora_row_slots, Tensor[] lora_a, Tensor[] lora_bt, int[] lora_ranks, "
        "int[] lora_parts) -> Tensor");
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor perm, int[] seg_slots, int[] seg_starts, Tensor row_slots, "
        "Tensor a, Tensor bt, int[] ranks, int[] parts) -> ()");
}

TORCH_LIBRARY_IMPL(inferd, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_kv_write", &rope_kv_write);
  m.impl("silu_mul", &silu_mul);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("decode_layers", &decode_layers);
  m.impl("lora_add", &lora_add);
}

// decode_layers' weights include oneDNN's packed ones, whose dispatch key is MkldnnCPU
TORCH_LIBRARY_IMPL(inferd, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
}
