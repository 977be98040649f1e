// Scores against an int8 cache's keys (kv_layout.h) with AVX-512 VNNI.
//
// The query heads of a row are quantized to int8 (a scale per head), and a key's four consecutive
// dimensions are one 32-bit lane: one vpdpbusd multiplies 16 keys by 4 dimensions of one query head
// and adds the products in int32. The float path spends a widening, a conversion and an FMA on each
// dimension of 16 keys; this one a quarter of an instruction. Keys are stored as int8 + 128 (vpdpbusd
// multiplies unsigned bytes by signed ones), and each score subtracts 128 * sum(query) once.

#pragma once

#include <algorithm>
#include <cstdint>

#include "kv_layout.h"
#include "vec.h"

namespace slotserve {

// A row's G query heads, quantized: q[g][d] ~= scale[g] * q8[g][d], with q8[g][4j..4j+3] the bytes of
// packed[g * D / 4 + j] (in memory order, which is how vpdpbusd reads a broadcast lane).
struct QuantizedQuery {
  int32_t* packed;  // [G, D / 4]
  int32_t* offset;  // [G]: 128 * sum over d of q8[g][d], what the keys' +128 adds to each dot product
  float* scale;     // [G]
};

inline void quantize_query(const float* qf, int64_t G, int64_t D, const QuantizedQuery& q) {
  for (int64_t g = 0; g < G; ++g) {
    const float peak = abs_max(qf + g * D, D);
    const int32_t sum = round_to_int8(qf + g * D, D, peak > 0.f ? 127.f / peak : 0.f,
                                      reinterpret_cast<int8_t*>(q.packed + g * (D / kKeyGroup)));
    q.offset[g] = 128 * sum;
    q.scale[g] = peak / 127.f;
  }
}

#if defined(__AVX512VNNI__)
constexpr bool kInt8Scores = true;

// Scores of query heads g0..g0+G against V vectors of 16 keys each (keys[v]: the first of 16
// consecutive keys of a block, whose dimension group j lies at keys[v] + j * block_size * 4), to
// outs[v][g * ld + i]. As in the float path, V vectors from several blocks keep G * V accumulator
// chains in flight.
template <int G, int V>
inline void score_vectors_int8(const QuantizedQuery& q, int64_t g0, const uint8_t* const* keys, int64_t D,
                               int64_t bs, float* const* outs, int64_t ld) {
  const int64_t groups = D / kKeyGroup;
  __m512i acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_si512();
  const int32_t* packed = q.packed + g0 * groups;
  for (int64_t j = 0; j < groups; ++j) {
    __m512i k[V];
    for (int v = 0; v < V; ++v) k[v] = _mm512_loadu_si512(keys[v] + j * bs * kKeyGroup);
    for (int g = 0; g < G; ++g) {
      const __m512i qg = _mm512_set1_epi32(packed[g * groups + j]);
      for (int v = 0; v < V; ++v) acc[g][v] = _mm512_dpbusd_epi32(acc[g][v], k[v], qg);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512i offset = _mm512_set1_epi32(q.offset[g0 + g]);
    const __m512 scale = _mm512_set1_ps(q.scale[g0 + g]);
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(outs[v] + g * ld, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[g][v], offset)), scale));
  }
}

// Scores of query heads g0..g0+G of one row over its first `len` keys (one KV head), in token order,
// before the keys' scales (apply_token_scales). Whole vectors of 16 keys only: an int8 cache's block
// size is a multiple of 16, so the lanes past the row's last key are slots of its own last block,
// whose scores attend_row overwrites before the softmax.
template <int G>
void score_row_int8(const QuantizedQuery& q, int64_t g0, const int8_t* k_cache, const int8_t* v_cache,
                    const int32_t* blocks, int64_t kv_head, int64_t len, const Shapes& s, float* scores, int64_t ld) {
  constexpr int V = G <= 4 ? 4 : 2;  // G * V accumulators + V keys stay within 32 vector registers
  const int64_t bs = s.block_size, nblocks = (len + bs - 1) / bs;
  const uint8_t* keys[V];
  float* outs[V];
  int ready = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const auto* key = reinterpret_cast<const uint8_t*>(k_cache + blocks[b] * s.block + kv_head * s.head);
    if (b + 1 < nblocks) prefetch_block(k_cache + blocks[b + 1] * s.block + kv_head * s.head, s);
    prefetch_block(v_cache + blocks[b] * s.block + kv_head * s.head, s);  // as paged_attention.cpp's score_row
    const int64_t n = std::min(bs, len - b * bs);
    for (int64_t o = 0; o < n; o += 16) {
      keys[ready] = key + o * kKeyGroup;
      outs[ready] = scores + b * bs + o;
      if (++ready == V) {
        score_vectors_int8<G, V>(q, g0, keys, s.head_dim, bs, outs, ld);
        ready = 0;
      }
    }
  }
  for (int v = 0; v < ready; ++v) score_vectors_int8<G, 1>(q, g0, keys + v, s.head_dim, bs, outs + v, ld);
}

// score_row_int8 for all of a row's query heads, 8 at a time: scores[g * ld + t].
inline void score_row_int8_any(const QuantizedQuery& q, const int8_t* k_cache, const int8_t* v_cache,
                               const int32_t* blocks, int64_t kv_head, int64_t len, const Shapes& s, float* scores,
                               int64_t ld) {
  for (int64_t g0 = 0; g0 < s.group; g0 += 8) {
    with_group(std::min<int64_t>(s.group - g0, 8), [&](auto G) {
      score_row_int8<decltype(G)::value>(q, g0, k_cache, v_cache, blocks, kv_head, len, s, scores + g0 * ld, ld);
    });
  }
}
#else
constexpr bool kInt8Scores = false;  // int8 caches need AVX-512 VNNI: the kernel refuses them
#endif

}  // namespace slotserve
