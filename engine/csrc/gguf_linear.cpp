// Linear layers over GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), read in
// place.
//
// A decode step reads every weight once: its floor is the weights' bytes over the memory
// bandwidth. Q4_1 is 5 bits a weight against float32's 32, so these kernels keep the file's
// blocks as they are (rows of 32-weight blocks: a float16 scale, for Q4_1 a float16 minimum, then
// the quants) and widen each block to float32 in registers, next to the multiply-adds that use it.
// The products are float32 FMAs over exactly the de-quantized weights, so the results are those of
// the de-quantized model up to summation order.
//
// Threads take chunks of output columns (weight rows); within a chunk, the input rows go through
// in tiles of kTile, each weight block widened once per tile. Inputs of many rows (prefill chunks)
// are better served by de-quantizing the weight once (engine/model/quant.py picks by row count), then
// either the GEMM library or, where a row must get the same bits at any row count, dense tiles that
// sum as the block kernel does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "vec.h"


namespace {

using slotserve::vfloat;
using slotserve::vint;
using slotserve::W;

using namespace slotserve::gguf;

constexpr int kTile = 8;  // input rows sharing each widened block (8 accumulators + the block fit the registers)

// Bytes widened to int32 lanes. Spelled with intrinsics: GCC scalarizes __builtin_convertvector from
// bytes (one insert a lane), which made the widening cost more than the multiply-adds it feeds.
inline vint widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vint>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef uint8_t vbyte __attribute__((vector_size(W)));
  vbyte b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vint);
#endif
}

inline vint widen_s8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vint>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vint>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t vsbyte __attribute__((vector_size(W)));
  vsbyte b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vint);
#endif
}

// Q4_K's 6-bit scale and minimum of sub-block j, packed in 12 bytes: j < 4 in the low 6 bits of
// bytes j and j + 4; j >= 4 in the nibbles of byte j + 4, with their top 2 bits above bytes j - 4 and j.
inline void q4k_scale_min(const uint8_t* s, int64_t j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Weights [32b, 32b + 32) of a row as kBlock / W float vectors, in order.
template <int64_t QT>
inline void widen_block(const uint8_t* row, int64_t b, vfloat* out) {
  constexpr int64_t kVecs = kBlock / W;
  if constexpr (QT == kQ4_K) {
    // Super-block: float16 d and dmin, 12 bytes of scales, 128 bytes of quants; bytes [32c, 32c + 32)
    // hold sub-block 2c in their low nibbles and 2c + 1 in their high ones. w = d sc q - dmin m.
    const uint8_t* sb = row + (b >> 3) * kBytes<QT>;
    const int64_t j = b & 7;
    int sc, m;
    q4k_scale_min(sb + 4, j, sc, m);
    const float ds = half_at(sb) * sc, dm = half_at(sb + 2) * m;
    const uint8_t* qs = sb + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    for (int64_t v = 0; v < kVecs; ++v)
      out[v] = __builtin_convertvector((widen_u8(qs + v * W) >> shift) & 15, vfloat) * ds - dm;
  } else if constexpr (QT == kQ6_K) {
    // Super-block: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
    // weights), float16 d. Sub-block j = 4h + 2n + p: low nibbles in ql[64h + 32p, +32) (the high
    // nibble when n is 1), high bits in qh[32h, +32) at bit 2(2n + p). w = d sc (q - 32).
    const uint8_t* sb = row + (b >> 3) * kBytes<QT>;
    const int64_t j = b & 7, h = j >> 2, n = (j >> 1) & 1, p = j & 1;
    const uint8_t* ql = sb + 64 * h + 32 * p;
    const uint8_t* qh = sb + 128 + 32 * h;
    const int8_t* scales = reinterpret_cast<const int8_t*>(sb + 192) + 2 * j;
    const float d = half_at(sb + 208);
    const int lo = 4 * n, hi = 2 * (j & 3);
    for (int64_t v = 0; v < kVecs; ++v) {
      const vint q = (((widen_u8(ql + v * W) >> lo) & 15) | (((widen_u8(qh + v * W) >> hi) & 3) << 4)) - 32;
      out[v] = __builtin_convertvector(q, vfloat) * (d * scales[v * W / 16]);
    }
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    // Like Q4_0 / Q4_1, with each weight's fifth bit in a 32-bit word before the nibbles: bit j for
    // weight j. Q5_0 is centred on 16: w = d (q - 16); Q5_1: w = d q + m.
    const uint8_t* block = row + b * kBytes<QT>;
    const float d = half_at(block);
    const float m = QT == kQ5_1 ? half_at(block + 2) : -16.0f * d;
    const uint8_t* hp = block + (QT == kQ5_1 ? 4 : 2);
    uint32_t bits;
    std::memcpy(&bits, hp, 4);
    vint lane;
    for (int64_t i = 0; i < W; ++i) lane[i] = static_cast<int32_t>(i);
    const vint high = vint{} + static_cast<int32_t>(bits);
    for (int64_t h = 0; h < kVecs / 2; ++h) {
      const vint q = widen_u8(hp + 4 + h * W);
      const vint at = lane + static_cast<int32_t>(h * W);
      out[h] = __builtin_convertvector((q & 15) | (((high >> at) & 1) << 4), vfloat) * d + m;
      out[h + kVecs / 2] = __builtin_convertvector((q >> 4) | (((high >> (at + 16)) & 1) << 4), vfloat) * d + m;
    }
  } else if constexpr (QT == kQ8_0) {
    const uint8_t* block = row + b * kBytes<QT>;
    const float d = half_at(block);
    for (int64_t v = 0; v < kVecs; ++v) out[v] = __builtin_convertvector(widen_s8(block + 2 + v * W), vfloat) * d;
  } else {
    // Byte j of the quants holds weight j in its low nibble and weight j + 16 in its high one.
    const uint8_t* block = row + b * kBytes<QT>;
    const float d = half_at(block);
    const float m = QT == kQ4_1 ? half_at(block + 2) : -8.0f * d;
    const uint8_t* qs = block + (QT == kQ4_1 ? 4 : 2);
    for (int64_t h = 0; h < kVecs / 2; ++h) {
      const vint q = widen_u8(qs + h * W);
      out[h] = __builtin_convertvector(q & 15, vfloat) * d + m;
      out[h + kVecs / 2] = __builtin_convertvector(q >> 4, vfloat) * d + m;
    }
  }
}

// acc + a b in one rounding, as an intrinsic that GCC does not re-associate: under -ffast-math it
// rewrote `acc += a * b` chains differently per tile size (Q8_0's one-row tile was ulps off the others).
inline vfloat fmadd(vfloat a, vfloat b, vfloat acc) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                  reinterpret_cast<__m512>(acc)));
#elif defined(__FMA__)
  return reinterpret_cast<vfloat>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                  reinterpret_cast<__m256>(acc)));
#else
  return acc + a * b;
#endif
}

// Not inlined: one compiled reduction for every tile, whatever fast-math would make of it in each.
__attribute__((noinline)) float sum(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));  // a shuffle tree, not 16 scalar adds
#else
  const __m256 h = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#endif
}

// out[r, n] = x[r, :] . W[n, :] for R rows of x and columns [n0, n1).
template <int64_t QT, int R>
void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t k_blocks, int64_t n0,
          int64_t n1, float* out, int64_t ldo) {
  constexpr int64_t kVecs = kBlock / W;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    vfloat acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vfloat{};
    // A k-quant's eight sub-blocks unrolled: each copy knows its sub-block, so the scale unpacking
    // and the nibble choice fold to constants.
    constexpr int64_t kSub = kWeights<QT> / kBlock;
    for (int64_t s = 0; s < k_blocks; s += kSub) {
#pragma GCC unroll 8
      for (int64_t j = 0; j < kSub; ++j) {
        vfloat wv[kVecs];
        widen_block<QT>(row, s + j, wv);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * ldx + (s + j) * kBlock;
          for (int64_t v = 0; v < kVecs; ++v) acc[r] = fmadd(wv[v], slotserve::load(xr + v * W), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo + n] = sum(acc[r]);
  }
}

// Rows [0, m) of x: tiles of kTile, then one tile of the remainder.
template <int64_t QT, int R = kTile>
void rows(const float* x, int64_t ldx, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t k_blocks,
          int64_t n0, int64_t n1, float* out, int64_t ldo) {
  if constexpr (R == kTile) {
    for (; m >= kTile; m -= kTile, x += kTile * ldx, out += kTile * ldo)
      tile<QT, kTile>(x, ldx, w, row_bytes, k_blocks, n0, n1, out, ldo);
  }
  if constexpr (R > 1) {
    if (m < R) return rows<QT, R - 1>(x, ldx, m, w, row_bytes, k_blocks, n0, n1, out, ldo);
  }
  if (m == R) tile<QT, R>(x, ldx, w, row_bytes, k_blocks, n0, n1, out, ldo);
}

template <int64_t QT>
void widen_rows(const uint8_t* w, int64_t row_bytes, int64_t k_blocks, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < k_blocks; ++b) {
      vfloat wv[kBlock / W];
      widen_block<QT>(w + n * row_bytes, b, wv);
      std::memcpy(out + (n * k_blocks + b) * kBlock, wv, sizeof(wv));
    }
  }
}

// Steps of many rows: the weight de-quantized once (widen_rows), then R x C output tiles. Each output
// is summed as tile() sums it, one W-lane accumulator over K in order, then sum(), so a row gets the
// same bits at any row count (a GEMM library's order would differ by ulps, which a later int8 layer's
// rounding turns into whole steps). kRows x kCols accumulators let each load feed several FMAs.
#if defined(__AVX512F__)
constexpr int kRows = 4, kCols = 6;  // 24 accumulators, 6 weight vectors and one input in 32 registers
#else
constexpr int kRows = 2, kCols = 4;  // 8 + 4 + 1 of 16
#endif

template <int R, int C>
void dense_tile(const float* x, int64_t ldx, const float* wf, int64_t k, int64_t n, float* out, int64_t ldo) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vfloat{};
  for (int64_t i = 0; i < k; i += W) {
    vfloat w[C];
    for (int c = 0; c < C; ++c) w[c] = slotserve::load(wf + (n + c) * k + i);
    for (int r = 0; r < R; ++r) {
      const vfloat xv = slotserve::load(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(w[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + n + c] = sum(acc[r][c]);
}

// Columns [n0, n1) of R rows: groups of kCols, then one column at a time.
template <int R>
void dense_columns(const float* x, int64_t ldx, const float* wf, int64_t k, int64_t n0, int64_t n1, float* out,
                   int64_t ldo) {
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) dense_tile<R, kCols>(x, ldx, wf, k, n, out, ldo);
  for (; n < n1; ++n) dense_tile<R, 1>(x, ldx, wf, k, n, out, ldo);
}

// Rows [0, m): tiles of kRows, then one tile of the remainder.
template <int R = kRows>
void dense_rows(const float* x, int64_t ldx, int64_t m, const float* wf, int64_t k, int64_t n0, int64_t n1,
                float* out, int64_t ldo) {
  if constexpr (R == kRows) {
    for (; m >= kRows; m -= kRows, x += kRows * ldx, out += kRows * ldo)
      dense_columns<kRows>(x, ldx, wf, k, n0, n1, out, ldo);
  }
  if constexpr (R > 1) {
    if (m < R) return dense_rows<R - 1>(x, ldx, m, wf, k, n0, n1, out, ldo);
  }
  if (m == R) dense_columns<R>(x, ldx, wf, k, n0, n1, out, ldo);
}

// float32 [N, K]: the weight de-quantized (large inputs' GEMMs, rows the embedding looks up).
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t qtype, int64_t k) {
  check_weight(blocks, qtype, k);
  const int64_t n = blocks.size(0), k_blocks = k / kBlock, row_bytes = blocks.size(1);
  at::Tensor out = at::empty({n, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case kQ4_0: widen_rows<kQ4_0>(wp, row_bytes, k_blocks, n0, n1, op); break;
      case kQ4_1: widen_rows<kQ4_1>(wp, row_bytes, k_blocks, n0, n1, op); break;
      case kQ5_0: widen_rows<kQ5_0>(wp, row_bytes, k_blocks, n0, n1, op); break;
      case kQ5_1: widen_rows<kQ5_1>(wp, row_bytes, k_blocks, n0, n1, op); break;
      case kQ4_K: widen_rows<kQ4_K>(wp, row_bytes, k_blocks, n0, n1, op); break;
      case kQ6_K: widen_rows<kQ6_K>(wp, row_bytes, k_blocks, n0, n1, op); break;
      default: widen_rows<kQ8_0>(wp, row_bytes, k_blocks, n0, n1, op); break;
    }
  });
  return out;
}

}  // namespace

namespace slotserve::gguf {

// out [M, N] float32 = x [M, K] float32 @ dequantize(blocks [N, K/32 * block bytes])^T
void linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 [M, K], rows contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  check_weight(blocks, qtype, k);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == m && out.size(1) == n &&
                  out.stride(1) == 1, "out must be float32 [M, N], rows contiguous");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), k_blocks = k / kBlock, ldx = x.stride(0), ldo = out.stride(0);
  // Chunks of 16 weight rows: a few KB that stay in L1 while every tile of x passes over them.
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case kQ4_0: rows<kQ4_0>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
      case kQ4_1: rows<kQ4_1>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
      case kQ5_0: rows<kQ5_0>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
      case kQ5_1: rows<kQ5_1>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
      case kQ4_K: rows<kQ4_K>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
      case kQ6_K: rows<kQ6_K>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
      default: rows<kQ8_0>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
    }
  });
}

}  // namespace slotserve::gguf

namespace {

// x [M, K] @ W^T over the de-quantized weight, each output summed as the block kernel sums it.
at::Tensor dense_mm(const at::Tensor& x32, const at::Tensor& blocks, int64_t qtype) {
  const int64_t m = x32.size(0), k = x32.size(1), n = blocks.size(0);
  at::Tensor out = at::empty({m, n}, x32.options());
  const at::Tensor wf = gguf_dequantize(blocks, qtype, k);
  const float *xp = x32.data_ptr<float>(), *wp = wf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Chunks of 48 columns (8 tiles): their weights stay in L2 while every row tile passes.
  at::parallel_for(0, n, 8 * kCols, [&](int64_t n0, int64_t n1) { dense_rows(xp, k, m, wp, k, n0, n1, op, n); });
  return out;
}

}  // namespace

namespace slotserve::gguf {

// x [M, K] @ W^T for a compiled graph or an eager step, in x's dtype: steps of up to max_rows rows
// through the block kernel, larger ones de-quantize the weight once; ``exact`` sums them as the block
// kernel does (batch-invariant, for models with int8 layers; engine.model.quant), else one GEMM
// (~2x faster at 256 rows on the 2-core AVX-512 host, ulps apart). One C++ op: a layer call is one dispatch.
at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t max_rows, bool exact) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out;
  if (x32.size(0) <= max_rows) {
    out = at::empty({x32.size(0), blocks.size(0)}, x32.options());
    linear_f32(out, x32, blocks, qtype);
  } else if (exact) {
    out = dense_mm(x32, blocks, qtype);
  } else {
    out = at::mm(x32, gguf_dequantize(blocks, qtype, x32.size(1)).t());
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace slotserve::gguf

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor blocks, int qtype) -> ()");
  m.def("gguf_dequantize(Tensor blocks, int qtype, int k) -> Tensor");
  m.def("gguf_mm(Tensor x, Tensor blocks, int qtype, int max_rows, bool exact=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("gguf_linear", slotserve::gguf::linear_f32);
  m.impl("gguf_dequantize", gguf_dequantize);
  m.impl("gguf_mm", slotserve::gguf::mm);
}
