// Linear layers over GGUF weights with int8 dot products (AVX-512 VNNI), for steps of a few rows.
//
// The float32 kernel (gguf_linear.cpp) widens every weight and does 16 multiply-adds an instruction.
// Here the activations are quantized per 32-block to int8 once a call (a float scale each, as
// llama.cpp's Q8 activations), and one VPDPBUSD multiplies 64 weight bytes by 64 activation bytes.
// The file's blocks are packed once at load (engine/model/quant.py, pack_int8) so that the loop does
// little but that: the float16 scales (and minimums) apart from the quants, widened 4 or 16 at a time; Q4 quants in groups of 4 blocks
// whose 64 bytes hold blocks 0-1 in their low nibbles and 2-3 in their high ones (one mask, one shift
// and mask give both unsigned operands); Q8_0 quants contiguous. The blocks' offsets (Q4_0's -8 x scale,
// Q4_1's minimum) times the activations' block sums are one more dot product a row. Q8_0 is signed on
// both sides: the activations go in with 128 added (a sign-bit flip) and the accumulator starts from
// the weights' sums x 128, which takes it out again.
//
// The cost is the activations' rounding (at most half a step of amax/127 per block): the tests bound
// every output by it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>

#include "gguf_blocks.h"

namespace {

using namespace slotserve::gguf;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kReady = true;

constexpr int kTile = 8;  // activation rows sharing each unpacked group of weight blocks

// One call's activations, quantized per block, K padded to the packed weights' (zeros):
// quants [M, Kp] int8; per block its scale repeated over the 8 int32 lanes its products land in
// (one load gives the 16 lanes of a pair of blocks); and its scale times its quants' sum.
struct Activations {
  at::Tensor q_, scale_, sum_;  // owners
  const int8_t* q;
  const float *scale, *sum;
  int64_t kp, blocks;  // padded K, its blocks
};

Activations quantize(const at::Tensor& x, int64_t blocks) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / kBlock, ldx = x.stride(0), kp = blocks * kBlock;
  Activations a{at::zeros({m, kp}, x.options().dtype(at::kChar)), at::zeros({m, blocks * 8}, x.options()),
                at::zeros({m, blocks}, x.options()), nullptr, nullptr, nullptr, kp, blocks};
  const float* xp = x.data_ptr<float>();
  int8_t* q = a.q_.data_ptr<int8_t>();
  float *scale = a.scale_.data_ptr<float>(), *sum = a.sum_.data_ptr<float>();
  a.q = q;
  a.scale = scale;
  a.sum = sum;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xp + r * ldx + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float d = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      int8_t* qb = q + r * kp + b * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
      _mm256_storeu_ps(scale + (r * blocks + b) * 8, _mm256_set1_ps(d));
      sum[r * blocks + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
  return a;
}

// Per row of x, the blocks' offsets (Q4_0's -8 x scale, Q4_1's minimum) times its block sums.
inline __m512 offsets(const c10::Half* mins, const float* sums, int64_t blocks, __m512 acc) {
  for (int64_t b = 0; b < blocks; b += 16) {
    const __mmask16 mask = blocks - b >= 16 ? 0xFFFF : (1u << (blocks - b)) - 1;
    const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + b));
    acc = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, sums + b), acc);
  }
  return acc;
}

// Dot products of R activation rows (from r0) with packed weight rows [n0, n1) into out.
// Q4: a group of 4 blocks is 64 bytes, weight j of the group in byte j's low nibble (j < 64) or
// byte j - 64's high one, so two masks give blocks 0-1 and 2-3 as the unsigned operand. Q8_0: pairs
// of blocks, signed, the activations flipped to unsigned and the flip's 128 x the weights' sums taken out.
template <int64_t QT, int R>
void tile(const Activations& a, int64_t r0, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw, int64_t n0,
          int64_t n1, float* out, int64_t ldo) {
  const int64_t nb = a.blocks, row_bytes = QT == kQ8_0 ? nb * kBlock : nb * kBlock / 2;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(2));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = qw + n * row_bytes;
    const c10::Half* scales = sw + n * nb;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    if constexpr (QT == kQ8_0) {
      for (int64_t b = 0; b < nb; b += 2) {
        const __m512i wv = _mm512_loadu_si512(row + b * kBlock);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, wv));
        const __m512 dw = _mm512_permutexvar_ps(first, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadu_si32(scales + b))));
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(a.q + (r0 + r) * a.kp + b * kBlock), flip);
          const __m512 s = _mm512_mul_ps(dw, _mm512_loadu_ps(a.scale + ((r0 + r) * nb + b) * 8));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, xv, wv)), s, acc[r]);
        }
      }
    } else {
      for (int64_t b = 0; b < nb; b += 4) {
        const __m512i v = _mm512_loadu_si512(row + b * kBlock / 2);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + b))));
        const __m512 da = _mm512_permutexvar_ps(first, d4), db = _mm512_permutexvar_ps(second, d4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.q + (r0 + r) * a.kp + b * kBlock;
          const float* xs = a.scale + ((r0 + r) * nb + b) * 8;
          const __m512i pa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
          const __m512i pb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(xq + 64));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pa), _mm512_mul_ps(da, _mm512_loadu_ps(xs)), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pb), _mm512_mul_ps(db, _mm512_loadu_ps(xs + 16)), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) acc[r] = offsets(mw + n * nb, a.sum + (r0 + r) * nb, nb, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[(r0 + r) * ldo + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

// Activation rows [r0, m): tiles of kTile, then one tile of the remainder.
template <int64_t QT, int R = kTile>
void rows(const Activations& a, int64_t r0, int64_t m, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw,
          int64_t n0, int64_t n1, float* out, int64_t ldo) {
  if constexpr (R == kTile) {
    for (; m - r0 >= kTile; r0 += kTile) tile<QT, kTile>(a, r0, qw, sw, mw, n0, n1, out, ldo);
  }
  if constexpr (R > 1) {
    if (m - r0 < R) return rows<QT, R - 1>(a, r0, m, qw, sw, mw, n0, n1, out, ldo);
  }
  if (m - r0 == R) tile<QT, R>(a, r0, qw, sw, mw, n0, n1, out, ldo);
}

// The packed weight de-quantized, [N, K] float32 (steps of many rows run one GEMM over it).
template <int64_t QT>
void widen_rows(const uint8_t* qw, const c10::Half* sw, const c10::Half* mw, int64_t nb, int64_t k, int64_t n0, int64_t n1,
                float* out) {
  const int64_t row_bytes = QT == kQ8_0 ? nb * kBlock : nb * kBlock / 2;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const __m512 d = _mm512_set1_ps(static_cast<float>(sw[n * nb + b]));
      float* o = out + n * k + b * kBlock;
      __m512i w0, w1;
      if constexpr (QT == kQ8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(qw + n * row_bytes + b * kBlock);
        w0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        w1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(w0), d));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(w1), d));
      } else {  // block b is bytes (b % 2) * 32 of its group, low nibbles for b % 4 < 2
        const uint8_t* q = qw + n * row_bytes + (b / 4) * 64 + (b % 2) * 32;
        const int shift = b % 4 < 2 ? 0 : 4;
        const __m512i fifteen = _mm512_set1_epi32(15);
        w0 = _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), shift), fifteen);
        w1 = _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))), shift), fifteen);
        const __m512 m = _mm512_set1_ps(static_cast<float>(mw[n * nb + b]));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(w0), d, m));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(w1), d, m));
      }
    }
  }
}

#else
constexpr bool kReady = false;
#endif

}  // namespace

namespace slotserve::gguf {

namespace {
void check_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "GGUF quant type ", qtype, " has no packed kernel");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(1) % 4 == 0,
              "packed scales must be contiguous float16 [N, blocks], blocks a multiple of 4");
  const int64_t n = scales.size(0), nb = scales.size(1);
  TORCH_CHECK(quants.dim() == 2 && quants.is_contiguous() && quants.element_size() == 1 && quants.size(0) == n &&
                  quants.size(1) == (qtype == kQ8_0 ? nb * kBlock : nb * kBlock / 2),
              "packed quants must be contiguous bytes [N, blocks x ", qtype == kQ8_0 ? 32 : 16, "]");
  TORCH_CHECK(qtype == kQ8_0 || (mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous()),
              "packed minimums must be float16 [N, blocks] like the scales");
}
}  // namespace

// out [M, N] float32 = quantize_int8(x [M, K] float32) . packed weight [N, K]
void linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t qtype) {
  TORCH_CHECK(kReady, "gguf int8 kernels need AVX-512 VNNI (the library was built without it)");
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) % kBlock == 0 &&
                  x.size(1) <= scales.size(1) * kBlock, "x must be float32 [M, K], rows contiguous, K within the weight's");
  const int64_t m = x.size(0), n = scales.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == m && out.size(1) == n &&
                  out.stride(1) == 1, "out must be float32 [M, N], rows contiguous");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const Activations a = quantize(x, scales.size(1));
  const uint8_t* qw = static_cast<const uint8_t*>(quants.data_ptr());
  const c10::Half *sw = scales.data_ptr<c10::Half>(), *mw = qtype == kQ8_0 ? nullptr : mins.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case kQ8_0: rows<kQ8_0>(a, 0, m, qw, sw, mw, n0, n1, op, ldo); break;
      default: rows<kQ4_1>(a, 0, m, qw, sw, mw, n0, n1, op, ldo); break;  // Q4_0 packs as Q4_1
    }
  });
#endif
}

at::Tensor dequantize_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                             int64_t qtype, int64_t k) {
  TORCH_CHECK(kReady, "gguf int8 kernels need AVX-512 VNNI (the library was built without it)");
  check_packed(quants, scales, mins, qtype);
  TORCH_CHECK(k % kBlock == 0 && k <= scales.size(1) * kBlock, "K must be a multiple of 32 within the weight's");
  const int64_t n = scales.size(0), nb = scales.size(1);
  at::Tensor out = at::empty({n, k}, scales.options().dtype(at::kFloat));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const uint8_t* qw = static_cast<const uint8_t*>(quants.data_ptr());
  const c10::Half *sw = scales.data_ptr<c10::Half>(), *mw = qtype == kQ8_0 ? nullptr : mins.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    if (qtype == kQ8_0) {
      widen_rows<kQ8_0>(qw, sw, mw, nb, k, n0, n1, op);
    } else {
      widen_rows<kQ4_1>(qw, sw, mw, nb, k, n0, n1, op);
    }
  });
#endif
  return out;
}

bool int8_ready() { return kReady; }

// gguf_mm (gguf_linear.cpp) over packed weights: the int8 kernel up to max_rows rows, else one GEMM.
at::Tensor mm_packed(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t qtype, int64_t max_rows) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out;
  if (x32.size(0) <= max_rows) {
    out = at::empty({x32.size(0), scales.size(0)}, x32.options());
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
  m.def("gguf_int8_ready() -> bool");
  m.def("gguf_mm_packed(Tensor x, Tensor quants, Tensor scales, Tensor mins, int qtype, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("gguf_linear_int8", slotserve::gguf::linear_int8);
  m.impl("gguf_dequantize_packed", slotserve::gguf::dequantize_packed);
  m.impl("gguf_mm_packed", slotserve::gguf::mm_packed);
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("gguf_int8_ready", slotserve::gguf::int8_ready);
}
