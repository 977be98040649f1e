// The int8 GGUF kernel's AVX2 path (gguf_linear_int8.cpp), for hosts without AVX-512 VNNI: the same
// packed weights, the same activation rounding, the same int32 dot products, so the same outputs.
// Included inside that file's anonymous namespace, after ``Activations`` and ``quantize_with``.
//
// AVX2 has no VPDPBUSD. VPMADDUBSW multiplies unsigned by signed bytes and adds pairs into int16,
// saturating; VPMADDWD by ones then adds int16 pairs into the int32 lanes VPDPBUSD would fill.
// - Q4 nibbles (0-15) times activations (|q| <= 127): a pair is at most 3810, so the eight operands
//   of a block add up in int16 (at most 30480) before one widening.
// - Q5_1 bytes (0-31): a pair is at most 7874, so four operands add up in int16 (31496) before widening.
// - Signed weights (Q8_0, Q6_K; their stored flip undone): |w| goes in as the unsigned operand and w's
//   sign moves onto the activation (VPSIGNB), a pair at most 2 x 128 x 127 = 32512; each operand
//   widens on its own, and no -128 x sum correction is needed.
// One 64-byte operand of 16 columns is two 32-byte halves of 8 columns each.

constexpr int kTile = 4;  // activation rows sharing each block's unpacked operands (16 ymm registers)
constexpr bool kHalfSums = false;  // signed weights go in as |w| and sign: no +128 to take out

inline __m256i broadcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t quantize_block(const float* xb, int8_t* qb, float& d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  const float top = hmax8(amax);
  d = top / 127.0f;
  const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  alignas(32) int32_t ints[kBlock];
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    qb[j] = static_cast<int8_t>(std::min(127, std::max(-128, ints[j])));
    sum += ints[j];
  }
  return sum;
}

template <class T>
Activations quantize(const at::Tensor& x, bool halves) { return quantize_with<T>(x, halves, quantize_block); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// 8 floats rounded to bfloat16, to nearest even; NaN stays NaN.
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // packus works per 128-bit lane: 64-bit quarters 0 and 2 hold the eight halves in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// One row's int32 dot products of a block's operands [s0, s1) with 8 columns' operands w (see above).
template <int64_t QT>
inline __m256i dot8(const __m256i* w, const int8_t* xq, int s0, int s1) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i dot = _mm256_setzero_si256();
  if constexpr (flipped(QT)) {
    for (int s = s0; s < s1; ++s) {
      const __m256i x = _mm256_sign_epi8(broadcast4_256(xq + 4 * s), w[s]);
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[s]), x), ones));
    }
  } else {
    constexpr int kRun = byte_operands(QT) ? 4 : 8;  // operands whose pairs add up in int16
    for (int s = s0; s < s1; s += kRun) {
      __m256i pairs = _mm256_maddubs_epi16(w[s], broadcast4_256(xq + 4 * s));
      for (int t = s + 1; t < std::min(s1, s + kRun); ++t)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[t], broadcast4_256(xq + 4 * t)));
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
    }
  }
  return dot;
}

// Columns of packed groups [g0, g1) for R activation rows from r0, into out.
template <int64_t QT, int R, class O>
void tile(const Activations& a, int64_t r0, const uint8_t* qw, const c10::Half* sw, const c10::Half* mw, int64_t g0,
          int64_t g1, O* out, int64_t ldo) {
  constexpr int64_t kGroupBytes = group_bytes(QT), kHalves = halves(QT);
  const int64_t nb = a.nb;
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wq = qw + g * nb * kGroupBytes;
    const c10::Half* ws = sw + g * nb * kHalves * kCols;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_ahead<QT>(wq, ws, mw, g, nb, b);
      for (int h = 0; h < 2; ++h) {  // columns 8h..8h+7: bytes 32h..32h+31 of every operand
        const uint8_t* wb = wq + b * kGroupBytes + 32 * h;
        __m256i w[8];
        if constexpr (byte_operands(QT)) {
          for (int s = 0; s < 8; ++s) {
            w[s] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * s));
            if constexpr (flipped(QT)) w[s] = _mm256_xor_si256(w[s], flip);
          }
        } else {
          for (int v = 0; v < 4; ++v) {
            const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * v));
            w[v] = _mm256_and_si256(t, low);
            w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
          }
        }
        __m256 d[kHalves];
        for (int i = 0; i < kHalves; ++i)
          d[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + (b * kHalves + i) * kCols + 8 * h)));
        __m256 m = _mm256_setzero_ps();
        if constexpr (has_mins(QT)) {
          m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + (g * nb + b) * kCols + 8 * h)));
        }
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r, at = row * nb + b;
          const int8_t* xq = a.q + row * a.k + b * kBlock;
          const __m256 ad = _mm256_set1_ps(a.d[at]);
          for (int i = 0; i < kHalves; ++i) {
            const __m256i dot = dot8<QT>(w, xq, 8 * i / kHalves, 8 * (i + 1) / kHalves);
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[i], ad), acc[r][h]);
          }
          if constexpr (has_mins(QT)) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[at]), acc[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(out + (r0 + r) * ldo + g * kCols, acc[r][0]);
      store8(out + (r0 + r) * ldo + g * kCols + 8, acc[r][1]);
    }
  }
}
