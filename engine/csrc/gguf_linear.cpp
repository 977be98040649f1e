// Linear layers over GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), read in place.
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
// are better served by de-quantizing the weight once and running the GEMM library on it
// (engine/model/quant.py picks by row count).

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

// The 32 weights of one block as kBlock / W float vectors, in order.
template <int64_t QT>
inline void widen_block(const uint8_t* block, vfloat* out) {
  constexpr int64_t kVecs = kBlock / W;
  const float d = half_at(block);
  if constexpr (QT == kQ8_0) {
    for (int64_t v = 0; v < kVecs; ++v) out[v] = __builtin_convertvector(widen_s8(block + 2 + v * W), vfloat) * d;
  } else {
    // Byte j of the quants holds weight j in its low nibble and weight j + 16 in its high one.
    const float m = QT == kQ4_1 ? half_at(block + 2) : -8.0f * d;
    const uint8_t* qs = block + (QT == kQ4_1 ? 4 : 2);
    for (int64_t h = 0; h < kVecs / 2; ++h) {
      const vint q = widen_u8(qs + h * W);
      out[h] = __builtin_convertvector(q & 15, vfloat) * d + m;
      out[h + kVecs / 2] = __builtin_convertvector(q >> 4, vfloat) * d + m;
    }
  }
}

inline float sum(vfloat v) {
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
    for (int64_t b = 0; b < k_blocks; ++b) {
      vfloat wv[kVecs];
      widen_block<QT>(row + b * kBytes<QT>, wv);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + b * kBlock;
        for (int64_t v = 0; v < kVecs; ++v) acc[r] += wv[v] * slotserve::load(xr + v * W);
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
      widen_block<QT>(w + n * row_bytes + b * kBytes<QT>, wv);
      std::memcpy(out + (n * k_blocks + b) * kBlock, wv, sizeof(wv));
    }
  }
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
      default: rows<kQ8_0>(xp, ldx, m, wp, row_bytes, k_blocks, n0, n1, op, ldo); break;
    }
  });
}

}  // namespace slotserve::gguf

namespace {

// x [M, K] @ W^T for a compiled graph or an eager step, in x's dtype: steps of up to max_rows rows
// through the block kernel, larger ones through one GEMM over the de-quantized weight. One C++ op:
// a layer call is one dispatch, no Python.
at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t max_rows) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out;
  if (x32.size(0) <= max_rows) {
    out = at::empty({x32.size(0), blocks.size(0)}, x32.options());
    slotserve::gguf::linear_f32(out, x32, blocks, qtype);
  } else {
    out = at::mm(x32, gguf_dequantize(blocks, qtype, x32.size(1)).t());
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor blocks, int qtype) -> ()");
  m.def("gguf_dequantize(Tensor blocks, int qtype, int k) -> Tensor");
  m.def("gguf_mm(Tensor x, Tensor blocks, int qtype, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("gguf_linear", slotserve::gguf::linear_f32);
  m.impl("gguf_dequantize", gguf_dequantize);
  m.impl("gguf_mm", gguf_mm);
}
