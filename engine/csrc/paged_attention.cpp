// Paged attention on CPU, reading K/V blocks in place (no per-layer gather).
//
// FlashAttention varlen semantics: request b owns query rows cu_seqlens_q[b]..cu_seqlens_q[b+1]
// and attends causally (aligned bottom-right) to its first seqlens_k[b] cached tokens, which
// live in the blocks block_table[b, :]. Layouts: K [num_blocks, kv_heads, head_dim, block_size]
// (keys transposed, so one vector holds a dimension of W consecutive keys and a score needs no
// horizontal sum), V [num_blocks, kv_heads, block_size, head_dim]; one head's block is one
// contiguous run that the hardware prefetcher streams. One work item is (query row, KV head):
// the G query heads sharing that KV head read each key and value once. The softmax is in fp32
// whatever the cache dtype. An int8 cache (kv_layout.h) holds about half the bytes of a bfloat16
// one: its keys are scored by int8 dot products (score_int8.h), its per-token scales multiply each
// score and each probability, and its values are summed under int16 weights (values_int8.h).
//
// Built on first use by engine/cpu_kernels.py with -O3 -march=native. Scores and values use
// GCC vector types of W floats (vec.h, the widest the build's target has), so no loop depends on
// the auto-vectorizer.

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

#include "checks.h"
#include "kv_layout.h"
#include "score_int8.h"
#include "values_int8.h"
#include "vec.h"

namespace {

using namespace slotserve;

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

// Scores of G query heads of one row over its first `len` keys (one KV head), in token order:
// scores[g * ld + t]. Full key vectors go V at a time, whichever blocks they come from.
template <int G, typename T>
void score_row(const float* qf, const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t kv_head,
               int64_t len, const Shapes& s, float* scores, int64_t ld) {
  constexpr int V = G <= 4 ? 4 : 2;  // G * V accumulators + V keys stay within 32 vector registers
  const int64_t D = s.head_dim, bs = s.block_size, nblocks = (len + bs - 1) / bs;
  const T* keys[V];
  float* outs[V];
  int ready = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* key = k_cache + blocks[b] * s.block + kv_head * s.head;
    if (b + 1 < nblocks) prefetch_block(k_cache + blocks[b + 1] * s.block + kv_head * s.head, s);
    // Its values too, read once every score is known: fetched beside the keys, they wait in L2 (alone, 30
    // layers' 118 MB at 16 rows: 5.4-5.9 ms against 6.1-6.4; memory waits for one block at a time otherwise).
    prefetch_block(v_cache + blocks[b] * s.block + kv_head * s.head, s);
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

// score_row for the row's group size, 8 query heads at a time.
template <typename T>
void score_row_any(const float* qf, const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t kv_head,
                   int64_t len, const Shapes& s, float* scores, int64_t ld) {
  for (int64_t g0 = 0; g0 < s.group; g0 += 8) {
    with_group(std::min<int64_t>(s.group - g0, 8), [&](auto G) {
      score_row<decltype(G)::value>(qf + g0 * s.head_dim, k_cache, v_cache, blocks, kv_head, len, s, scores + g0 * ld,
                                    ld);
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

// An int8 cache: multiplies the G rows of per-token numbers (scores or probabilities, token order,
// ld apart) by their tokens' scales, block by block.
inline void apply_token_scales(const int8_t* cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                               const Shapes& s, float* rows, int64_t ld) {
  const int64_t bs = s.block_size;
  for (int64_t b = 0; b * bs < len; ++b) {
    const float* scale = slotserve::token_scales(cache + blocks[b] * s.block + kv_head * s.head, s.head_dim, bs);
    const int64_t n = std::min(bs, len - b * bs);
    for (int64_t g = 0; g < s.group; ++g) {
      float* row = rows + g * ld + b * bs;
      for (int64_t i = 0; i < n; ++i) row[i] *= scale[i];
    }
  }
}

// An int8 cache: fetches the value scales of a row's blocks while the softmax runs. They are the last
// lines of each V block, read (by apply_token_scales) before the values: fetched on demand, each one
// was a miss in a short loop, ~20 % of the kernel's own time outside the scoring and value loops.
inline void prefetch_value_scales(const int8_t* v_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                                  const Shapes& s) {
  const int64_t bs = s.block_size;
  for (int64_t b = 0; b * bs < len; ++b) {
    const char* scales = reinterpret_cast<const char*>(
        slotserve::token_scales(v_cache + blocks[b] * s.block + kv_head * s.head, s.head_dim, bs));
    for (int64_t byte = 0; byte < bs * kScaleBytes; byte += 64) __builtin_prefetch(scales + byte, 0, 3);
  }
  prefetch_block(v_cache + blocks[0] * s.block + kv_head * s.head, s);
}

// One thread's working memory for attend_row, sized once a call for the step's longest row.
struct Scratch {
  std::vector<float> scores, qf, inv, q_scale;  // scores [G, longest rounded up to W], qf [G, D]
  std::vector<vfloat> acc;                      // [G, D / W]
  std::vector<int32_t> q_packed, q_offset;      // an int8 cache's quantized query (score_int8.h)
  std::vector<int16_t> weights;                 // and its probabilities as int16 (values_int8.h), as scores

  Scratch(int64_t G, int64_t D, int64_t longest)
      : scores(G * ((longest + W - 1) / W * W)), qf(G * D), inv(G), q_scale(G), acc(G * D / W),
        q_packed(G * D / kKeyGroup), q_offset(G), weights(scores.size()) {}
  QuantizedQuery query() { return {q_packed.data(), q_offset.data(), q_scale.data()}; }
};

// G query heads of one row over the first `len` tokens of one request, one KV head; the cache holds
// T (as q and out do) or int8.
template <typename T, typename C>
void attend_row(const T* q, const C* k_cache, const C* v_cache, const int32_t* blocks, int64_t kv_head,
                int64_t len, float scale, const Shapes& s, Scratch& w, T* out) {
  constexpr bool quantized = std::is_same_v<C, int8_t>;
  const int64_t G = s.group, D = s.head_dim, padded = (len + W - 1) / W * W;
  float *qf = w.qf.data(), *scores = w.scores.data(), *inv = w.inv.data();
  vfloat* acc = w.acc.data();
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  if constexpr (quantized) {
#if defined(__AVX512VNNI__)
    quantize_query(qf, G, D, w.query());
    score_row_int8_any(w.query(), k_cache, v_cache, blocks, kv_head, len, s, scores, padded);
    prefetch_value_scales(v_cache, blocks, kv_head, len, s);
    apply_token_scales(k_cache, blocks, kv_head, len, s, scores, padded);
#endif
  } else {
    score_row_any(qf, k_cache, v_cache, blocks, kv_head, len, s, scores, padded);
  }
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
  if constexpr (quantized) {
#if defined(__AVX512VNNI__)
    apply_token_scales(v_cache, blocks, kv_head, len, s, scores, padded);
    int16_t* weights = w.weights.data();
    for (int64_t g = 0; g < G; ++g) {
      const float peak = abs_max(scores + g * padded, padded);
      round_to_int16(scores + g * padded, padded, peak > 0.f ? 32767.f / peak : 0.f, weights + g * padded);
      std::fill(weights + g * padded + len, weights + (g + 1) * padded, int16_t{0});
      inv[g] *= peak / 32767.f;
    }
    values_row_int8_any(weights, v_cache, blocks, kv_head, len, s, padded, acc);
#endif
  } else {
    values_row_any(scores, v_cache, blocks, kv_head, len, s, padded, acc);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = reinterpret_cast<float*>(acc + g * (D / W));
    for (int64_t i = 0; i < D; ++i) row[i] *= inv[g];
    store_row(row, out + g * D, D);
  }
}

template <typename T, typename C>
void paged_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q, const at::Tensor& seqlens_k,
                          const at::Tensor& block_table, int64_t block_size, double scale) {
  const int64_t rows = q.size(0), batch = seqlens_k.size(0);
  Shapes s{q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2), block_size,
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
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int64_t items = rows * s.kv_heads, G = s.group, D = s.head_dim;
  const float fscale = static_cast<float>(scale);
  // Dynamic schedule: rows differ in length (decodes come sorted longest first). Decodes row-major (a block holds
  // a request's heads side by side); chunks head-major: next rows reread a head's K/V from L2 (2048 rows: -40 %).
  const bool by_head = rows > batch;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch work(G, D, longest);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t row = by_head ? item % rows : item / s.kv_heads, h = by_head ? item / rows : item % s.kv_heads;
      const int64_t len = row_len[row];
      if (len <= 0) continue;
      const int32_t* blocks = table + row_request[row] * s.table_width;
      attend_row(qp + row * s.q_row + h * G * D, kp, vp, blocks, h, len, fscale, s, work,
                 op + row * s.heads * D + h * G * D);
    }
  }
}

// The cache's block size, after checking its layout against q: T caches K [blocks, kv_heads, head_dim,
// block_size] and V [blocks, kv_heads, block_size, head_dim]; int8 caches [blocks, kv_heads,
// block_size * (head_dim + 4)] both (kv_layout.h).
int64_t checked_block_size(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t D = q.size(2);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1), "paged_attention: contiguous caches of one pool and head count");
  TORCH_CHECK(q.size(1) % v_cache.size(1) == 0, "paged_attention: heads must be a multiple of kv_heads");
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
                "paged_attention: int8 caches are [blocks, kv_heads, block_size * (head_dim + 4)], K and V alike");
    TORCH_CHECK(k_cache.size(2) % (D + slotserve::kScaleBytes) == 0,
                "paged_attention: head_dim must match (an int8 cache's last dimension is block_size * (head_dim + 4))");
    const int64_t block_size = k_cache.size(2) / (D + slotserve::kScaleBytes);
    TORCH_CHECK(block_size % 16 == 0 && D % kKeyGroup == 0,
                "paged_attention: an int8 cache's block_size must be a multiple of 16, got ", block_size);
    return block_size;
  }
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention: k_cache [blocks, kv_heads, head_dim, block_size], "
              "v_cache [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q, out and the caches must share one dtype (or the caches be int8)");
  TORCH_CHECK(k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "paged_attention: K as V with its last two dimensions swapped");
  TORCH_CHECK(D == v_cache.size(3), "paged_attention: head_dim must match");
  return k_cache.size(3);
}

template <typename T>
void dispatch_cache(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& seqlens_k, const at::Tensor& block_table,
                    int64_t block_size, double scale) {
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(kInt8Scores, "paged_attention: int8 caches need a CPU with AVX-512 VNNI");
    paged_attention_impl<T, int8_t>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, block_size, scale);
  } else {
    paged_attention_impl<T, T>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, block_size, scale);
  }
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& seqlens_k, const at::Tensor& block_table,
                     double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "paged_attention: q and out are [rows, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "paged_attention: q, out and the caches must share one dtype");
  const int64_t block_size = checked_block_size(q, k_cache, v_cache);
  TORCH_CHECK(q.size(2) % W == 0, "paged_attention: head_dim must be a multiple of ", W, ", got ", q.size(2));
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q rows must be contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "paged_attention: out must be contiguous, q's shape");
  for (const at::Tensor* index : {&cu_seqlens_q, &seqlens_k, &block_table})
    TORCH_CHECK(index->scalar_type() == at::kInt && index->is_contiguous(),
                "paged_attention: cu_seqlens_q, seqlens_k and block_table must be int32, contiguous");
  TORCH_CHECK(cu_seqlens_q.numel() == seqlens_k.numel() + 1 && block_table.dim() == 2 &&
                  block_table.size(0) == seqlens_k.numel(),
              "paged_attention: cu_seqlens_q has one entry more than seqlens_k, block_table a row per request");
  check_paged_indices(q, k_cache, cu_seqlens_q, seqlens_k, block_table, block_size);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, block_size, scale);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, block_size, scale);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(out, q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_table, block_size, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(slotserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor seqlens_k, Tensor block_table, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
