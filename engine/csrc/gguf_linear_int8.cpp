// Linear layers over GGUF weights with int8 dot products (AVX-512 VNNI; AVX2 in gguf_int8_avx2.h), for
// steps of a few rows.
//
// The float32 kernel (gguf_linear.cpp) widens every weight and does 16 multiply-adds an instruction.
// Here the activations are quantized per 32-block to int8 once a call (a float scale each, as
// llama.cpp's Q8 activations), and one VPDPBUSD does 64 multiply-adds.
//
// The weights are repacked once at load (engine/model/quant.py, pack_int8) for 16 output columns at
// a time: per block, eight 64-byte operands whose int32 lane c holds four consecutive weights of
// column c. Each operand meets the same four activation bytes broadcast to every lane, so one
// block's 512 products land in 16 int32 lanes, one per column, with no horizontal sums; only then
// does the block's scale apply (one conversion, one multiply, one FMA per row and block, against
// eight dot products). Two operand forms:
// - nibbles (Q4_0, Q4_1, Q4_K): low ones for weights 0-15 of the block, high ones for 16-31, one mask
//   or shift apiece;
// - bytes (Q8_0, Q5_0, Q5_1, Q6_K): one operand a load.
// The blocks' offsets (Q4_0's -8 x scale, Q4_1's and Q5_1's minimum) times the activations' block sums
// are one more FMA. Signed weights (Q8_0, Q6_K) are stored with their sign bit flipped (unsigned,
// + 128), and each row's int32 sums start from -128 x the activations' sum, which takes the 128 out
// again. Q6_K has a scale per 16 weights: operands 0-3 and 4-7 sum apart, each with its own scale
// and its half of the activations' sum.
//
// The cost is the activations' rounding (at most half a step of amax/127 per block): the tests bound
// every output by it.
//
// Inputs and outputs are float32 or bfloat16 as the model runs: bfloat16 rows widen per block as they
// are quantized, and outputs round to bfloat16 (to nearest even, as a tensor conversion does) when
// stored, so a bfloat16 model makes no float32 copy of either (with the copies, a decode step's linear
// layers alone took 16.1-16.3 ms at 16 rows; without, 12.6-14.4).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SLOTSERVE_INT8_VNNI 1
#endif
#if defined(SLOTSERVE_INT8_VNNI) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define SLOTSERVE_INT8 1
#endif

namespace {

using namespace slotserve::gguf;

constexpr int64_t kCols = 16;  // output columns per packed group: one int32 lane each

// What each packed type is (the kernel's qtype: Q4_0 and Q4_K pack as Q4_1, Q5_0 as Q8_0).
constexpr bool byte_operands(int64_t qtype) { return qtype == kQ8_0 || qtype == kQ5_1 || qtype == kQ6_K; }
constexpr bool flipped(int64_t qtype) { return qtype == kQ8_0 || qtype == kQ6_K; }  // signed, stored + 128
constexpr bool has_mins(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }
constexpr int64_t halves(int64_t qtype) { return qtype == kQ6_K ? 2 : 1; }  // scales per 32 weights

// Packed bytes of one block of a group of 16 columns.
constexpr int64_t group_bytes(int64_t qtype) { return byte_operands(qtype) ? 512 : 256; }

// Weights [32b, 32b + 32) of column c of the packed group at ``g`` (its bytes, scales and minimums),
// de-quantized to out: exactly what the file's block holds.
inline void unpack_block(const uint8_t* g, const c10::Half* scales, const c10::Half* mins, int64_t qtype, int64_t b,
                         int64_t c, float* out) {
  const uint8_t* q = g + b * group_bytes(qtype) + 4 * c;
  const int64_t h = halves(qtype);
  if (byte_operands(qtype)) {
    const float m = has_mins(qtype) ? static_cast<float>(mins[b * kCols + c]) : 0.0f;
    const int flip = flipped(qtype) ? 0x80 : 0;
    for (int64_t s = 0; s < 8; ++s) {
      const float d = static_cast<float>(scales[(b * h + s * h / 8) * kCols + c]);
      for (int64_t j = 0; j < 4; ++j) {
        const int value = flip ? static_cast<int8_t>(q[64 * s + j] ^ flip) : q[64 * s + j];
        out[4 * s + j] = d * static_cast<float>(value) + m;
      }
    }
    return;
  }
  const float d = static_cast<float>(scales[b * kCols + c]), m = static_cast<float>(mins[b * kCols + c]);
  for (int64_t v = 0; v < 4; ++v) {
    for (int64_t j = 0; j < 4; ++j) {
      const uint8_t byte = q[64 * v + j];
      out[4 * v + j] = d * static_cast<float>(byte & 15) + m;
      out[16 + 4 * v + j] = d * static_cast<float>(byte >> 4) + m;
    }
  }
}

// Row ``n`` of the packed weight, [k] float32.
inline void unpack_row(const uint8_t* qw, const c10::Half* sw, const c10::Half* mw, int64_t qtype, int64_t nb, int64_t k,
                       int64_t n, float* out) {
  const int64_t g = n / kCols, c = n % kCols;
  const uint8_t* group = qw + g * nb * group_bytes(qtype);
  const c10::Half* scales = sw + g * nb * halves(qtype) * kCols;
  const c10::Half* mins = mw == nullptr ? nullptr : mw + g * nb * kCols;
  for (int64_t b = 0; b < k / kBlock; ++b) unpack_block(group, scales, mins, qtype, b, c, out + b * kBlock);
}

#ifdef SLOTSERVE_INT8
constexpr bool kReady = true;

// One call's activations, quantized per 32-block: quants [M, K] int8, and per block its scale d,
// d x its quants' sum (for the offsets), and 128 x that sum as an integer (for the flip); for Q6_K
// also 128 x the sum of its first 16 quants (the second half's is c - c0).
struct Activations {
  const int8_t* q;
  const float *d, *s;
  const int32_t *c, *c0;
  int64_t k, nb;
};

// One block of a bfloat16 row as float32 (exact: bfloat16 is float32's upper half).
inline const float* widen_block(const c10::BFloat16* xb, float* tmp) {
  for (int64_t j = 0; j < kBlock; ++j) {
    const uint32_t bits = static_cast<uint32_t>(xb[j].x) << 16;
    std::memcpy(tmp + j, &bits, 4);
  }
  return tmp;
}
inline const float* widen_block(const float* xb, float*) { return xb; }

// x [M, K] quantized block by block: ``quantize_block(xb, qb, d)`` rounds the 32 floats at xb to qb
// with scale d and returns their quants' sum.
template <class T, class QuantizeBlock>
Activations quantize_with(const at::Tensor& x, bool halves, QuantizeBlock quantize_block) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / kBlock, ldx = x.stride(0);
  // The calling thread's scratch, reused call after call: five tensors a call were ~600 allocations a
  // decode step. The kernel's workers only read it, and the call returns before the thread calls again.
  thread_local std::vector<int32_t> scratch;
  const size_t per_block = static_cast<size_t>(m * nb), words = static_cast<size_t>(m * k / 4) + 4 * per_block;
  if (scratch.size() < words) scratch.resize(words);
  int8_t* q = reinterpret_cast<int8_t*>(scratch.data());
  float* dp = reinterpret_cast<float*>(scratch.data() + m * k / 4);
  float* sp = dp + per_block;
  int32_t *cp = reinterpret_cast<int32_t*>(sp + per_block), *c0p = cp + per_block;
  Activations a{q, dp, sp, cp, halves ? c0p : nullptr, k, nb};
  const T* xp = x.data_ptr<T>();
  alignas(64) float tmp[kBlock];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float d;
      int8_t* qb = q + r * k + b * kBlock;
      const int32_t sum = quantize_block(widen_block(xp + r * ldx + b * kBlock, tmp), qb, d);
      dp[r * nb + b] = d;
      sp[r * nb + b] = d * static_cast<float>(sum);
      cp[r * nb + b] = 128 * sum;
      if (halves) {
        int32_t first = 0;
        for (int64_t j = 0; j < kBlock / 2; ++j) first += qb[j];
        c0p[r * nb + b] = 128 * first;
      }
    }
  }
  return a;
}

// Blocks a group's streams are prefetched ahead (2-4 KB of operands): with AVX-512 VNNI the linear layers
// of a decode step alone at 16 rows took 9.7 ms with it against 12.4 without (8 ahead beat 4, 16 and 32),
// 4.1-4.4 ms against 4.4-4.5 at 1 row.
constexpr int64_t kAhead = 8;

// Block b + kAhead of group g's quants, scales and minimums. Past the group's end this reads into the
// next group's (the same thread's next, or a wasted hint).
template <int64_t QT>
inline void prefetch_ahead(const uint8_t* wq, const c10::Half* ws, const c10::Half* mw, int64_t g, int64_t nb,
                           int64_t b) {
  const char* ahead = reinterpret_cast<const char*>(wq + (b + kAhead) * group_bytes(QT));
  for (int64_t l = 0; l < group_bytes(QT); l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(ws + (b + kAhead) * halves(QT) * kCols), _MM_HINT_T0);
  if constexpr (has_mins(QT)) {
    _mm_prefetch(reinterpret_cast<const char*>(mw + (g * nb + b + kAhead) * kCols), _MM_HINT_T0);
  }
}

#ifdef SLOTSERVE_INT8_VNNI
constexpr int kTile = 8;  // activation rows sharing each block's unpacked operands
constexpr bool kHalfSums = true;  // Q6_K's halves take their +128 out with Activations.c0

inline int32_t quantize_block(const float* xb, int8_t* qb, float& d) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  d = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

template <class T>
Activations quantize(const at::Tensor& x, bool halves) { return quantize_with<T>(x, halves, quantize_block); }

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// 16 floats rounded to bfloat16, to nearest even; NaN stays NaN.
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(h));
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Columns of packed groups [g0, g1) for R activation rows from r0, into out.
template <int64_t QT, int R, class O>
void tile(const Activations& a, int64_t r0, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw, int64_t g0,
          int64_t g1, O* out, int64_t ldo) {
  constexpr int64_t kGroupBytes = group_bytes(QT), kHalves = halves(QT);
  const int64_t nb = a.nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wq = qw + g * nb * kGroupBytes;
    const c10::Half* ws = sw + g * nb * kHalves * kCols;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_ahead<QT>(wq, ws, mw, g, nb, b);
      __m512i w[8];  // operand s: four weights 4s..4s+3 of the block per column
      if constexpr (byte_operands(QT)) {
        for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(wq + b * kGroupBytes + 64 * s);
      } else {
        for (int v = 0; v < 4; ++v) {
          const __m512i t = _mm512_loadu_si512(wq + b * kGroupBytes + 64 * v);
          w[v] = _mm512_and_si512(t, low);
          w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
        }
      }
      __m512 d[kHalves];
      for (int h = 0; h < kHalves; ++h)
        d[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + (b * kHalves + h) * kCols)));
      __m512 m = _mm512_setzero_ps();
      if constexpr (has_mins(QT)) {
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mw + (g * nb + b) * kCols)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r, at = row * nb + b;
        const int8_t* xq = a.q + row * a.k + b * kBlock;
        const __m512 ad = _mm512_set1_ps(a.d[at]);
        if constexpr (kHalves == 2) {  // operands 0-3 and 4-7 under scales of their own
          __m512i dot0 = _mm512_set1_epi32(-a.c0[at]), dot1 = _mm512_set1_epi32(a.c0[at] - a.c[at]);
          for (int s = 0; s < 4; ++s) dot0 = _mm512_dpbusd_epi32(dot0, w[s], broadcast4(xq + 4 * s));
          for (int s = 4; s < 8; ++s) dot1 = _mm512_dpbusd_epi32(dot1, w[s], broadcast4(xq + 4 * s));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(d[0], ad), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(d[kHalves - 1], ad), acc[r]);
        } else {
          __m512i dot = flipped(QT) ? _mm512_set1_epi32(-a.c[at]) : _mm512_setzero_si512();
          for (int s = 0; s < 8; ++s) dot = _mm512_dpbusd_epi32(dot, w[s], broadcast4(xq + 4 * s));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[0], ad), acc[r]);
        }
        if constexpr (has_mins(QT)) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[at]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) store16(out + (r0 + r) * ldo + g * kCols, acc[r]);
  }
}
#else
#include "gguf_int8_avx2.h"
#endif

// Activation rows [r0, m): tiles of kTile, then one tile of the remainder.
template <int64_t QT, class O, int R = kTile>
void rows(const Activations& a, int64_t r0, int64_t m, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw,
          int64_t g0, int64_t g1, O* out, int64_t ldo) {
  if constexpr (R == kTile) {
    for (; m - r0 >= kTile; r0 += kTile) tile<QT, kTile>(a, r0, qw, sw, mw, g0, g1, out, ldo);
  }
  if constexpr (R > 1) {
    if (m - r0 < R) return rows<QT, O, R - 1>(a, r0, m, qw, sw, mw, g0, g1, out, ldo);
  }
  if (m - r0 == R) tile<QT, R>(a, r0, qw, sw, mw, g0, g1, out, ldo);
}

// out = x . packed weight, for x and out of element types T and O.
template <class T, class O>
void linear_typed(at::Tensor& out, const at::Tensor& x, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw,
                  int64_t groups, int64_t qtype) {
  const Activations a = quantize<T>(x, kHalfSums && halves(qtype) == 2);
  const int64_t m = x.size(0), ldo = out.stride(0);
  O* op = out.data_ptr<O>();
  // Chunks of 4 groups (64 columns): a few KB of weights that stay in L1 while every tile of x passes.
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    switch (qtype) {
      case kQ8_0: rows<kQ8_0, O>(a, 0, m, qw, sw, mw, g0, g1, op, ldo); break;
      case kQ5_1: rows<kQ5_1, O>(a, 0, m, qw, sw, mw, g0, g1, op, ldo); break;
      case kQ6_K: rows<kQ6_K, O>(a, 0, m, qw, sw, mw, g0, g1, op, ldo); break;
      default: rows<kQ4_1, O>(a, 0, m, qw, sw, mw, g0, g1, op, ldo);  // Q4_0 packs as Q4_1 (minimum -8 x scale)
    }
  });
}

#else
constexpr bool kReady = false;
#endif

}  // namespace

namespace slotserve::gguf {

namespace {
bool packed_type(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_1 || qtype == kQ8_0 || qtype == kQ6_K;
}
bool reads_mins(int64_t qtype) { return !flipped(qtype); }  // Q4_0's offset is packed as a minimum

// Blocks of 32 weights in each row of the packed weight.
int64_t packed_blocks(const at::Tensor& scales, int64_t qtype) { return scales.size(1) / (kCols * halves(qtype)); }

// quants [N/16, blocks x 256 (nibbles) or 512 (bytes)] bytes; scales [N/16, blocks x 16] float16 (Q6_K:
// blocks x 32, a scale per 16 weights), minimums [N/16, blocks x 16] float16 where the type has them.
void check_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(packed_type(qtype), "GGUF quant type ", qtype, " has no packed kernel");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(1) % (kCols * halves(qtype)) == 0,
              "packed scales must be contiguous float16 [N / 16, blocks x ", kCols * halves(qtype), "]");
  const int64_t groups = scales.size(0), nb = packed_blocks(scales, qtype);
  TORCH_CHECK(quants.dim() == 2 && quants.is_contiguous() && quants.element_size() == 1 && quants.size(0) == groups &&
                  quants.size(1) == nb * group_bytes(qtype),
              "packed quants must be contiguous bytes [N / 16, blocks x ", group_bytes(qtype), "]");
  TORCH_CHECK(!reads_mins(qtype) || (mins.dim() == 2 && mins.size(0) == groups && mins.size(1) == nb * kCols &&
                                     mins.scalar_type() == at::kHalf && mins.is_contiguous()),
              "packed minimums must be contiguous float16 [N / 16, blocks x 16]");
}

bool takes_dtype(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

const c10::Half* mins_of(const at::Tensor& mins, int64_t qtype) {
  return reads_mins(qtype) ? mins.data_ptr<c10::Half>() : nullptr;
}
}  // namespace

// out [M, N] float32 = quantize_int8(x [M, K] float32) . packed weight [N, K]
void linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(kReady, "gguf int8 kernels need AVX-512 VNNI or AVX2 (the library was built without either)");
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(x.dim() == 2 && takes_dtype(x) && x.stride(1) == 1 && x.size(1) == packed_blocks(scales, qtype) * kBlock,
              "x must be float32 or bfloat16 [M, K], rows contiguous, K the weight's");
  const int64_t m = x.size(0), n = scales.size(0) * kCols;
  TORCH_CHECK(out.dim() == 2 && takes_dtype(out) && out.size(0) == m && out.size(1) == n && out.stride(1) == 1,
              "out must be float32 or bfloat16 [M, N], rows contiguous");
#ifdef SLOTSERVE_INT8
  const uint8_t* qw = static_cast<const uint8_t*>(quants.data_ptr());
  const c10::Half *sw = scales.data_ptr<c10::Half>(), *mw = mins_of(mins, qtype);
  const int64_t groups = scales.size(0);
  const bool x16 = x.scalar_type() == at::kBFloat16, out16 = out.scalar_type() == at::kBFloat16;
  if (x16 && out16) linear_typed<c10::BFloat16, c10::BFloat16>(out, x, qw, sw, mw, groups, qtype);
  else if (x16) linear_typed<c10::BFloat16, float>(out, x, qw, sw, mw, groups, qtype);
  else if (out16) linear_typed<float, c10::BFloat16>(out, x, qw, sw, mw, groups, qtype);
  else linear_typed<float, float>(out, x, qw, sw, mw, groups, qtype);
#endif
}

at::Tensor dequantize_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                             int64_t qtype, int64_t k) {
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(k == packed_blocks(scales, qtype) * kBlock, "K must be the weight's");
  const int64_t n = scales.size(0) * kCols, nb = k / kBlock;
  at::Tensor out = at::empty({n, k}, scales.options().dtype(at::kFloat));
  const uint8_t* qw = static_cast<const uint8_t*>(quants.data_ptr());
  const c10::Half *sw = scales.data_ptr<c10::Half>(), *mw = mins_of(mins, qtype);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t i = n0; i < n1; ++i) unpack_row(qw, sw, mw, qtype, nb, k, i, op + i * k);
  });
  return out;
}

// Rows ``ids`` of the packed weight, [len(ids), K] float32 (an embedding's lookup).
at::Tensor take_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins, int64_t qtype,
                       int64_t k, const at::Tensor& ids) {
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(k == packed_blocks(scales, qtype) * kBlock, "K must be the weight's");
  const at::Tensor flat = ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t rows = flat.numel(), n = scales.size(0) * kCols, nb = k / kBlock;
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < n, "row ", idp[i], " is outside [0, ", n, ")");
  at::Tensor out = at::empty({rows, k}, scales.options().dtype(at::kFloat));
  const uint8_t* qw = static_cast<const uint8_t*>(quants.data_ptr());
  const c10::Half *sw = scales.data_ptr<c10::Half>(), *mw = mins_of(mins, qtype);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) unpack_row(qw, sw, mw, qtype, nb, k, idp[i], op + i * k);
  });
  auto shape = ids.sizes().vec();
  shape.push_back(k);
  return out.view(shape);
}

bool int8_ready() { return kReady; }

// gguf_mm (gguf_linear.cpp) over packed weights: the int8 kernel up to max_rows rows, else one GEMM; in
// x's dtype.
at::Tensor mm_packed(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t qtype, int64_t max_rows) {
  if (x.size(0) <= max_rows && takes_dtype(x)) {  // float32 and bfloat16 rows go in as they are
    const at::Tensor rows = x.stride(-1) == 1 ? x : x.contiguous();
    at::Tensor out = at::empty({x.size(0), scales.size(0) * kCols}, x.options());
    linear_int8(out, rows, quants, scales, mins, qtype);
    return out;
  }
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out;
  if (x32.size(0) <= max_rows) {
    out = at::empty({x32.size(0), scales.size(0) * kCols}, x32.options());
    linear_int8(out, x32, quants, scales, mins, qtype);
  } else {
    out = at::mm(x32, dequantize_packed(quants, scales, mins, qtype, x32.size(1)).t());
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace slotserve::gguf

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("gguf_linear_int8(Tensor(a!) out, Tensor x, Tensor quants, Tensor scales, Tensor mins, int qtype) -> ()");
  m.def("gguf_dequantize_packed(Tensor quants, Tensor scales, Tensor mins, int qtype, int k) -> Tensor");
  m.def("gguf_take_packed(Tensor quants, Tensor scales, Tensor mins, int qtype, int k, Tensor ids) -> Tensor");
  m.def("gguf_int8_ready() -> bool");
  m.def("gguf_mm_packed(Tensor x, Tensor quants, Tensor scales, Tensor mins, int qtype, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("gguf_linear_int8", slotserve::gguf::linear_int8);
  m.impl("gguf_dequantize_packed", slotserve::gguf::dequantize_packed);
  m.impl("gguf_take_packed", slotserve::gguf::take_packed);
  m.impl("gguf_mm_packed", slotserve::gguf::mm_packed);
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("gguf_int8_ready", slotserve::gguf::int8_ready);
}
