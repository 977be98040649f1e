// Paged attention on CPU, reading K/V blocks in place (no per-layer gather).
//
// FlashAttention varlen semantics: request b owns query rows cu_seqlens_q[b]..cu_seqlens_q[b+1]
// and attends causally (aligned bottom-right) to its first seqlens_k[b] cached tokens, which
// live in the blocks block_table[b, :]. Layouts: K [num_blocks, kv_heads, head_dim, block_size]
// (keys transposed, so one vector holds a dimension of W consecutive keys and a score needs no
// horizontal sum), V [num_blocks, kv_heads, block_size, head_dim]; one head's block is one
// contiguous run that the hardware prefetcher streams. One work item is (query row, KV head):
// the G query heads sharing that KV head read each key and value once. Scores stay in fp32
// whatever the cache dtype.
//
// Built on first use by engine/cpu_kernels.py with -O3 -march=native. Scores and values use
// GCC vector types of W floats (the widest the build's target has), so no loop depends on the
// auto-vectorizer.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// GCC/Clang vector extensions: one source for AVX2 (8 lanes) and AVX-512 (16 lanes).
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(W * sizeof(uint16_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vfloat load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
#if defined(__AVX512F__)
  // One 512-bit widening. GCC lowers __builtin_convertvector of 16 lanes to two 256-bit widenings and
  // a lane insert (with or without -mprefer-vector-width=512): 6 instructions for every key and value
  // vector loaded instead of 2.
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vfloat>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#else
  vhalf bits;
  std::memcpy(&bits, p, sizeof(bits));
  vuint wide = __builtin_convertvector(bits, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}

inline vfloat load(const c10::Half* p) {
  float tmp[W];
  for (int64_t i = 0; i < W; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
}

inline float hsum(vfloat v) {
  float total = 0.f;
  for (int64_t i = 0; i < W; ++i) total += v[i];
  return total;
}

// exp(x) for x <= 0 (softmax after subtracting the row maximum): 2^n * p(r), r = x - n ln 2.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat lo = vfloat{} - 87.f;
  x = x < lo ? lo : x;
  vint n = __builtin_convertvector(x * 1.44269504f - 0.5f, vint);  // round to nearest (x <= 0)
  vfloat nf = __builtin_convertvector(n, vfloat);
  vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  vint bits = (n + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

struct Shapes {
  int64_t heads, kv_heads, group, head_dim, block_size, table_width;
  int64_t q_row, block, head;  // strides, in elements (the same for K and V)
};

// The first n < W lanes of p, zeros after: a partial vector never reads past its block.
template <typename T>
inline vfloat load_partial(const T* p, int64_t n) {
  float tmp[W] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
}

// Scores of G query heads (qf [G, D], pre-scaled) against V vectors of W keys each, from one
// block or several (keys[v]: W consecutive keys of a transposed block, key[d * bs + i]). Each key
// vector is loaded once for all G heads, and the G * V accumulators are independent FMA chains:
// a 16-token block is one vector, so the vectors come from several blocks for the chains to hide
// the FMA latency. Scores go to outs[v][g * ld + i].
template <int G, int V, typename T>
inline void score_vectors(const float* qf, const T* const* keys, int64_t D, int64_t bs, float* const* outs,
                          int64_t ld) {
  vfloat acc[G][V] = {};
  for (int64_t d = 0; d < D; ++d) {
    vfloat k[V];
    for (int v = 0; v < V; ++v) k[v] = load(keys[v] + d * bs);
    for (int g = 0; g < G; ++g) {
      const float qd = qf[g * D + d];
      for (int v = 0; v < V; ++v) acc[g][v] += qd * k[v];
    }
  }
  for (int v = 0; v < V; ++v)
    for (int g = 0; g < G; ++g) std::memcpy(outs[v] + g * ld, &acc[g][v], sizeof(vfloat));
}

// The first n < W keys of a transposed block: a partial vector never reads past its block.
template <typename T>
inline void score_partial(const float* qf, const T* key, int64_t n, int64_t G, int64_t D, int64_t bs, float* out,
                          int64_t ld) {
  for (int64_t g = 0; g < G; ++g) {
    vfloat acc{};
    for (int64_t d = 0; d < D; ++d) acc += qf[g * D + d] * load_partial(key + d * bs, n);
    std::memcpy(out + g * ld, &acc, n * sizeof(float));
  }
}

// The next block lives anywhere in the pool: the hardware prefetcher cannot guess the jump.
template <typename T>
inline void prefetch_block(const T* first, const Shapes& s) {
  const char* p = reinterpret_cast<const char*>(first);
  const int64_t bytes = s.head * static_cast<int64_t>(sizeof(T));
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + byte, 0, 1);
}

// Scores of G query heads of one row over its first `len` keys (one KV head), in token order:
// scores[g * ld + t]. Full key vectors go V at a time, whichever blocks they come from.
template <int G, typename T>
void score_row(const float* qf, const T* k_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
               const Shapes& s, float* scores, int64_t ld) {
  constexpr int V = G <= 4 ? 4 : 2;  // G * V accumulators + V keys stay within 32 vector registers
  const int64_t D = s.head_dim, bs = s.block_size, nblocks = (len + bs - 1) / bs;
  const T* keys[V];
  float* outs[V];
  int ready = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* key = k_cache + blocks[b] * s.block + kv_head * s.head;
    if (b + 1 < nblocks) prefetch_block(k_cache + blocks[b + 1] * s.block + kv_head * s.head, s);
    const int64_t n = std::min(bs, len - b * bs);
    // Whole vectors, the request's last keys included when the block has room: the lanes past n read
    // slots of its own block (whatever they hold), whose scores attend_row overwrites before the softmax.
    const int64_t whole = std::min(bs, (n + W - 1) / W * W) / W * W;
    int64_t o = 0;
    for (; o < whole; o += W) {
      keys[ready] = key + o;
      outs[ready] = scores + b * bs + o;
      if (++ready == V) {
        score_vectors<G, V>(qf, keys, D, bs, outs, ld);
        ready = 0;
      }
    }
    if (o < n) score_partial(qf, key + o, n - o, G, D, bs, scores + b * bs + o, ld);
  }
  for (int v = 0; v < ready; ++v) score_vectors<G, 1>(qf, keys + v, D, bs, outs + v, ld);
}

// Calls f(std::integral_constant<int, G>{}) for G = g, with the code compiled for every G from 1
// to 8 (register-resident accumulators need G at compile time); g is at most 8.
template <typename F>
inline void with_group(int64_t g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// score_row for the row's group size, 8 query heads at a time.
template <typename T>
void score_row_any(const float* qf, const T* k_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                   const Shapes& s, float* scores, int64_t ld) {
  for (int64_t g0 = 0; g0 < s.group; g0 += 8) {
    with_group(std::min<int64_t>(s.group - g0, 8), [&](auto G) {
      score_row<decltype(G)::value>(qf + g0 * s.head_dim, k_cache, blocks, kv_head, len, s, scores + g0 * ld, ld);
    });
  }
}

// acc[g][c] = sum over the row's first `len` values of p[g * ld + t] * value_t[(c0 + c) * W ..], for G
// query heads and C vectors of the head dimension: each value vector is loaded once for all G heads,
// and the G * C accumulators are independent FMA chains.
template <int G, int C, typename T>
void values_row(const float* p, const T* v_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                const Shapes& s, int64_t ld, int64_t c0, vfloat* out) {
  const int64_t D = s.head_dim, bs = s.block_size, nblocks = (len + bs - 1) / bs;
  vfloat acc[G][C] = {};
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* value = v_cache + blocks[b] * s.block + kv_head * s.head + c0 * W;
    if (b + 1 < nblocks) prefetch_block(v_cache + blocks[b + 1] * s.block + kv_head * s.head, s);
    const float* pb = p + b * bs;
    const int64_t n = std::min(bs, len - b * bs);
    for (int64_t o = 0; o < n; ++o) {
      vfloat x[C];
      for (int c = 0; c < C; ++c) x[c] = load(value + o * D + c * W);
      for (int g = 0; g < G; ++g) {
        const float pg = pb[g * ld + o];
        for (int c = 0; c < C; ++c) acc[g][c] += pg * x[c];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) out[g * (D / W) + c0 + c] = acc[g][c];
}

// values_row over the whole head dimension, for G query heads: out[g * (D / W) + c].
template <int G, typename T>
void values_row_all(const float* p, const T* v_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                    const Shapes& s, int64_t ld, vfloat* out) {
  constexpr int C = G <= 4 ? 4 : 2;  // G * C accumulators + C values stay within 32 vector registers
  const int64_t chunks = s.head_dim / W;
  int64_t c0 = 0;
  for (; c0 + C <= chunks; c0 += C) values_row<G, C>(p, v_cache, blocks, kv_head, len, s, ld, c0, out);
  for (; c0 < chunks; ++c0) values_row<G, 1>(p, v_cache, blocks, kv_head, len, s, ld, c0, out);
}

// values_row_all for the row's group size, 8 query heads at a time.
template <typename T>
void values_row_any(const float* p, const T* v_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                    const Shapes& s, int64_t ld, vfloat* out) {
  for (int64_t g0 = 0; g0 < s.group; g0 += 8) {
    with_group(std::min<int64_t>(s.group - g0, 8), [&](auto G) {
      values_row_all<decltype(G)::value>(p + g0 * ld, v_cache, blocks, kv_head, len, s, ld,
                                         out + g0 * (s.head_dim / W));
    });
  }
}

// G query heads of one row over the first `len` tokens of one request, one KV head.
// Scratch: qf [G, head_dim], scores [G, len rounded up to W], acc [G, head_dim / W], inv [G].
template <typename T>
void attend_row(const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t kv_head,
                int64_t len, float scale, const Shapes& s, float* qf, float* scores, vfloat* acc, float* inv,
                T* out) {
  const int64_t G = s.group, D = s.head_dim, padded = (len + W - 1) / W * W;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  score_row_any(qf, k_cache, blocks, kv_head, len, s, scores, padded);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * padded;
    for (int64_t t = len; t < padded; ++t) sg[t] = -1e30f;  // exp clamps it to ~0; never read after
    vfloat peaks = load(sg);
    for (int64_t t = W; t < padded; t += W) {
      const vfloat x = load(sg + t);
      peaks = x > peaks ? x : peaks;
    }
    float peak = peaks[0];  // a vector maximum, then its lanes: a scalar chain of len steps was ~20 % of a layer
    for (int64_t i = 1; i < W; ++i) peak = std::max(peak, peaks[i]);
    vfloat total{};
    for (int64_t t = 0; t < padded; t += W) {
      vfloat e = exp_nonpositive(load(sg + t) - peak);
      std::memcpy(sg + t, &e, sizeof(e));
      total += e;
    }
    inv[g] = 1.f / hsum(total);  // applied to the G x head_dim outputs, not to len probabilities
  }
  values_row_any(scores, v_cache, blocks, kv_head, len, s, padded, acc);
  for (int64_t g = 0; g < G; ++g) {
    float* row = reinterpret_cast<float*>(acc + g * (D / W));
    for (int64_t i = 0; i < D; ++i) row[i] *= inv[g];
    store_row(row, out + g * D, D);
  }
}

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seqlens_k,
                          const at::Tensor& block_table, double scale) {
  const int64_t rows = q.size(0), batch = seqlens_k.size(0);
  Shapes s{q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2), k_cache.size(3),
           block_table.size(1), q.stride(0), k_cache.stride(0), k_cache.stride(1)};
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* kv_lens = seqlens_k.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  // Per query row: its request and how many keys it sees (causal, aligned bottom-right).
  std::vector<int32_t> row_request(rows), row_len(rows);
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t n = cu[b + 1] - cu[b];
    for (int32_t j = 0; j < n; ++j) {
      row_request[cu[b] + j] = static_cast<int32_t>(b);
      row_len[cu[b] + j] = kv_lens[b] - n + j + 1;
    }
    longest = std::max<int64_t>(longest, kv_lens[b]);
  }
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t items = rows * s.kv_heads, G = s.group, D = s.head_dim;
  const float fscale = static_cast<float>(scale);
  // Dynamic schedule: rows differ in length (decodes come sorted longest first).
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scratch(G * ((longest + W - 1) / W * W) + G * D + G);
    std::vector<vfloat> acc(G * D / W);
    float* scores = scratch.data();
    float* qf = scores + G * ((longest + W - 1) / W * W);
    float* inv = qf + G * D;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t row = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t len = row_len[row];
      if (len <= 0) continue;
      const int32_t* blocks = table + row_request[row] * s.table_width;
      attend_row(qp + row * s.q_row + h * G * D, kp, vp, blocks, h, len, fscale, s, qf, scores, acc.data(), inv,
                 op + row * s.heads * D + h * G * D);
    }
  }
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& seqlens_k, const at::Tensor& block_table,
                     double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention: q/out [rows, heads, head_dim], k_cache [blocks, kv_heads, head_dim, block_size], "
              "v_cache [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "paged_attention: q, out and the caches must share one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k_cache.size(2) == v_cache.size(3) &&
                  k_cache.size(3) == v_cache.size(2),
              "paged_attention: contiguous caches, K as V with its last two dimensions swapped");
  TORCH_CHECK(q.size(2) == v_cache.size(3) && q.size(1) % v_cache.size(1) == 0,
              "paged_attention: head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) % W == 0, "paged_attention: head_dim must be a multiple of ", W, ", got ", q.size(2));
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q rows must be contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "paged_attention: out must be contiguous, q's shape");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seqlens_k.scalar_type() == at::kInt &&
                  block_table.scalar_type() == at::kInt,
              "paged_attention: cu_seqlens_q, seqlens_k and block_table must be int32");
  TORCH_CHECK(cu_seqlens_q.is_contiguous() && seqlens_k.is_contiguous() && block_table.is_contiguous(),
              "paged_attention: index tensors must be contiguous");
  TORCH_CHECK(cu_seqlens_q.numel() == seqlens_k.numel() + 1 && block_table.size(0) == seqlens_k.numel(),
              "paged_attention: cu_seqlens_q has one entry more than seqlens_k, block_table a row per request");
  switch (q.scalar_type()) {
    case at::kFloat:
      paged_attention_impl<float>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, scale);
      break;
    case at::kBFloat16:
      paged_attention_impl<c10::BFloat16>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, scale);
      break;
    case at::kHalf:
      paged_attention_impl<c10::Half>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16, got ", q.scalar_type());
  }
}

// The step's new K/V rows into their slots: V rows are copied whole, K rows scattered into
// their block's transposed layout. Advanced indexing (index_put_) did the same at ~10x the cost.
template <typename T>
void write_kv_impl(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping) {
  const int64_t tokens = k.size(0), heads = k.size(1), D = k.size(2), bs = k_cache.size(3);
  const int64_t block = k_cache.stride(0), head = k_cache.stride(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  // Decodes write a few rows: threads would cost more than the copies.
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = slots[t] / bs, offset = slots[t] % bs;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = kp + t * k.stride(0) + h * k.stride(1);
        T* dst = kc + b * block + h * head + offset;
        for (int64_t d = 0; d < D; ++d) dst[d * bs] = src[d];
        std::memcpy(vc + b * block + h * head + offset * D, vp + t * v.stride(0) + h * v.stride(1), D * sizeof(T));
      }
    }
  });
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && k_cache.device().is_cpu(), "write_kv: tensors must be on the CPU");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: k/v [tokens, kv_heads, head_dim], contiguous k_cache [blocks, kv_heads, head_dim, "
              "block_size] and v_cache [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k.size(1) && v_cache.size(2) == k_cache.size(3) && v_cache.size(3) == k.size(2),
              "write_kv: kv_heads, head_dim and block_size must match between k/v and the caches");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "write_kv: k, v and the caches must share one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv: head_dim of k and v must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "write_kv: slot_mapping must be contiguous int64, one slot per token");
  switch (k.scalar_type()) {
    case at::kFloat: write_kv_impl<float>(k_cache, v_cache, k, v, slot_mapping); break;
    case at::kBFloat16: write_kv_impl<c10::BFloat16>(k_cache, v_cache, k, v, slot_mapping); break;
    case at::kHalf: write_kv_impl<c10::Half>(k_cache, v_cache, k, v, slot_mapping); break;
    default: TORCH_CHECK(false, "write_kv: dtype must be float32, bfloat16 or float16, got ", k.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(slotserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor seqlens_k, Tensor block_table, float scale) -> ()");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
