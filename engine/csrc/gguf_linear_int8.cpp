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
// eight dot products). Q4 operands come as nibbles: low ones for weights 0-15 of the block, high
// ones for 16-31, one mask or shift apiece. The blocks' offsets (Q4_0's -8 x scale, Q4_1's minimum)
// times the activations' block sums are one more FMA. Q8_0 weights are stored with their sign bit
// flipped (unsigned, + 128), and each row's int32 sums start from -128 x the activations' block sum,
// which takes the 128 out again.
//
// The cost is the activations' rounding (at most half a step of amax/127 per block): the tests bound
// every output by it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

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

// Packed bytes of one block of a group of 16 columns.
inline int64_t group_bytes(int64_t qtype) { return qtype == kQ8_0 ? 512 : 256; }

// Weights [32b, 32b + 32) of column c of the packed group at ``g`` (its bytes, scales and minimums),
// de-quantized to out: exactly what the file's block holds.
inline void unpack_block(const uint8_t* g, const c10::Half* scales, const c10::Half* mins, int64_t qtype, int64_t b,
                         int64_t c, float* out) {
  const float d = static_cast<float>(scales[b * kCols + c]);
  const uint8_t* q = g + b * group_bytes(qtype) + 4 * c;
  if (qtype == kQ8_0) {
    for (int64_t s = 0; s < 8; ++s)
      for (int64_t j = 0; j < 4; ++j) out[4 * s + j] = d * static_cast<float>(static_cast<int8_t>(q[64 * s + j] ^ 0x80));
    return;
  }
  const float m = static_cast<float>(mins[b * kCols + c]);
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
  const c10::Half* scales = sw + g * nb * kCols;
  const c10::Half* mins = mw == nullptr ? nullptr : mw + g * nb * kCols;
  for (int64_t b = 0; b < k / kBlock; ++b) unpack_block(group, scales, mins, qtype, b, c, out + b * kBlock);
}

#ifdef SLOTSERVE_INT8
constexpr bool kReady = true;

// One call's activations, quantized per 32-block: quants [M, K] int8, and per block its scale d,
// d x its quants' sum (for the offsets), and 128 x that sum as an integer (for Q8_0's flip).
struct Activations {
  at::Tensor q_, d_, s_, c_;  // owners
  const int8_t* q;
  const float *d, *s;
  const int32_t* c;
  int64_t k, nb;
};

// x [M, K] quantized block by block: ``quantize_block(xb, qb, d)`` rounds the 32 floats at xb to qb
// with scale d and returns their quants' sum.
template <class QuantizeBlock>
Activations quantize_with(const at::Tensor& x, QuantizeBlock quantize_block) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / kBlock, ldx = x.stride(0);
  Activations a{at::empty({m, k}, x.options().dtype(at::kChar)), at::empty({m, nb}, x.options()),
                at::empty({m, nb}, x.options()), at::empty({m, nb}, x.options().dtype(at::kInt)),
                nullptr, nullptr, nullptr, nullptr, k, nb};
  const float* xp = x.data_ptr<float>();
  int8_t* q = a.q_.data_ptr<int8_t>();
  float *dp = a.d_.data_ptr<float>(), *sp = a.s_.data_ptr<float>();
  int32_t* cp = a.c_.data_ptr<int32_t>();
  a.q = q, a.d = dp, a.s = sp, a.c = cp;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float d;
      const int32_t sum = quantize_block(xp + r * ldx + b * kBlock, q + r * k + b * kBlock, d);
      dp[r * nb + b] = d;
      sp[r * nb + b] = d * static_cast<float>(sum);
      cp[r * nb + b] = 128 * sum;
    }
  }
  return a;
}

#ifdef SLOTSERVE_INT8_VNNI
constexpr int kTile = 8;  // activation rows sharing each block's unpacked operands

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

Activations quantize(const at::Tensor& x) { return quantize_with(x, quantize_block); }

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Columns of packed groups [g0, g1) for R activation rows from r0, into out.
template <int64_t QT, int R>
void tile(const Activations& a, int64_t r0, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw, int64_t g0,
          int64_t g1, float* out, int64_t ldo) {
  constexpr int64_t kGroupBytes = QT == kQ8_0 ? 512 : 256;
  const int64_t nb = a.nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wq = qw + g * nb * kGroupBytes;
    const c10::Half* ws = sw + g * nb * kCols;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i w[8];  // operand s: four weights 4s..4s+3 of the block per column
      if constexpr (QT == kQ8_0) {
        for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(wq + b * kGroupBytes + 64 * s);
      } else {
        for (int v = 0; v < 4; ++v) {
          const __m512i t = _mm512_loadu_si512(wq + b * kGroupBytes + 64 * v);
          w[v] = _mm512_and_si512(t, low);
          w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + b * kCols)));
      __m512 m = _mm512_setzero_ps();
      if constexpr (QT != kQ8_0) {
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mw + (g * nb + b) * kCols)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = a.q + row * a.k + b * kBlock;
        __m512i dot = QT == kQ8_0 ? _mm512_set1_epi32(-a.c[row * nb + b]) : _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) dot = _mm512_dpbusd_epi32(dot, w[s], broadcast4(xq + 4 * s));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.d[row * nb + b])), acc[r]);
        if constexpr (QT != kQ8_0) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[row * nb + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * ldo + g * kCols, acc[r]);
  }
}
#else
#include "gguf_int8_avx2.h"
#endif

// Activation rows [r0, m): tiles of kTile, then one tile of the remainder.
template <int64_t QT, int R = kTile>
void rows(const Activations& a, int64_t r0, int64_t m, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw,
          int64_t g0, int64_t g1, float* out, int64_t ldo) {
  if constexpr (R == kTile) {
    for (; m - r0 >= kTile; r0 += kTile) tile<QT, kTile>(a, r0, qw, sw, mw, g0, g1, out, ldo);
  }
  if constexpr (R > 1) {
    if (m - r0 < R) return rows<QT, R - 1>(a, r0, m, qw, sw, mw, g0, g1, out, ldo);
  }
  if (m - r0 == R) tile<QT, R>(a, r0, qw, sw, mw, g0, g1, out, ldo);
}

#else
constexpr bool kReady = false;
#endif

}  // namespace

namespace slotserve::gguf {

namespace {
// quants [N/16, blocks x 256 (Q4) or 512 (Q8_0)] bytes, scales and minimums [N/16, blocks x 16] float16.
void check_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "GGUF quant type ", qtype, " has no packed kernel");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(1) % kCols == 0,
              "packed scales must be contiguous float16 [N / 16, blocks x 16]");
  const int64_t groups = scales.size(0), nb = scales.size(1) / kCols;
  TORCH_CHECK(quants.dim() == 2 && quants.is_contiguous() && quants.element_size() == 1 && quants.size(0) == groups &&
                  quants.size(1) == nb * group_bytes(qtype),
              "packed quants must be contiguous bytes [N / 16, blocks x ", group_bytes(qtype), "]");
  TORCH_CHECK(qtype == kQ8_0 || (mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous()),
              "packed minimums must be float16 [N / 16, blocks x 16] like the scales");
}

const c10::Half* mins_of(const at::Tensor& mins, int64_t qtype) {
  return qtype == kQ8_0 ? nullptr : mins.data_ptr<c10::Half>();
}
}  // namespace

// out [M, N] float32 = quantize_int8(x [M, K] float32) . packed weight [N, K]
void linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(kReady, "gguf int8 kernels need AVX-512 VNNI or AVX2 (the library was built without either)");
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) == scales.size(1) / kCols * kBlock,
              "x must be float32 [M, K], rows contiguous, K the weight's");
  const int64_t m = x.size(0), n = scales.size(0) * kCols;
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == m && out.size(1) == n &&
                  out.stride(1) == 1, "out must be float32 [M, N], rows contiguous");
#ifdef SLOTSERVE_INT8
  const Activations a = quantize(x);
  const uint8_t* qw = static_cast<const uint8_t*>(quants.data_ptr());
  const c10::Half *sw = scales.data_ptr<c10::Half>(), *mw = mins_of(mins, qtype);
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  // Chunks of 4 groups (64 columns): a few KB of weights that stay in L1 while every tile of x passes.
  at::parallel_for(0, scales.size(0), 4, [&](int64_t g0, int64_t g1) {
    if (qtype == kQ8_0) {
      rows<kQ8_0>(a, 0, m, qw, sw, mw, g0, g1, op, ldo);
    } else {
      rows<kQ4_1>(a, 0, m, qw, sw, mw, g0, g1, op, ldo);  // Q4_0 packs as Q4_1 (minimum -8 x scale)
    }
  });
#endif
}

at::Tensor dequantize_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                             int64_t qtype, int64_t k) {
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(k == scales.size(1) / kCols * kBlock, "K must be the weight's");
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
  TORCH_CHECK(k == scales.size(1) / kCols * kBlock, "K must be the weight's");
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

// gguf_mm (gguf_linear.cpp) over packed weights: the int8 kernel up to max_rows rows, else one GEMM.
at::Tensor mm_packed(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t qtype, int64_t max_rows) {
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
