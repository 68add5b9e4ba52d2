// neffkit::int8_blocks(x, [codes, ...], [scales, ...], [aux, ...], bits, kind, zero) -> x @ W.T
// for integer weights (GGUF Q8_0 / Q4_0 / Q4_1 / K-quants, GPTQ / AWQ groups) with the rows
// quantized to int8 per block of 32 inputs, llama.cpp's arithmetic for those formats: the
// products are summed in integers, not decoded to float32 one weight at a time as
// neffkit::packed_rows (csrc/packed_rows.cpp) does (compute-bound: SmolLM2-135M Q8_0 decode
// took 11.2 ms a token against llama.cpp's 6.8). Opt-in (kernels/int8_blocks.py).
//
// x: [R, K] float32 or bfloat16, K a multiple of 32, any R. codes: uint8, bits 8: [N, K], one
// code a byte; bits 4: [N, K/2], input 2j in byte j's low nibble, 2j+1 in its high one
// (intquant.pack_codes). scales: float32 [N, K/G], a scale per group of G inputs (G a multiple
// of 32; G = K: per channel). aux: float32 [N, K/G], the zero points (kind 1) or additive
// minimums (kind 2); not read in kind 0 (any tensor there). A weight value is
//   kind 0 "sym"   (c - zero) * s     (zero an integer: Q8_0 stored as q + 128, zero 128)
//   kind 1 "zero"  (c - z[g]) * s[g]
//   kind 2 "min"   c * s[g] + m[g]
// Several weights reading the same x are one call (their outputs side by side). Returns
// [R, sum N] float32.
//
// Each row is quantized per block of 32 inputs exactly as `int8_blocks.quantize_blocks` does
// it (int8_rows.cpp's quantize_row, per block): amax = max |x|, d = amax / 127 (1 where amax is
// 0), q = x * (127 / amax) (a true division) rounded half to even, clamped to +-127; each step
// one float32 operation (vectorized here, the same operations). Then, with D = sum q * c and
// T = sum q over a block b's inputs (int32, exact):
//   sym   y = sum_b d_b * s_g(b) * (D_b - zero * T_b)
//   zero  y = sum_b d_b * s_g(b) * D_b  -  sum_g s_g * z_g * E_g
//   min   y = sum_b d_b * s_g(b) * D_b  +  sum_g m_g * E_g,   E_g = sum_{b in g} d_b * T_b
// The integer sums start from -zero * T (per lane: exact), the zero point and minimum terms are
// a short dot over the groups (E per row, once a call); the rest is float32: the result is
// the float64 sum of the quantized row times the weight's values up to float32 rounding
// (tests/e2e/test_int8_blocks.py: within 1e-5 of the sum of the products' magnitudes).
//
// Layout. A vector of int32 lanes, each the sum of 4 byte products (VPDPBUSD; VPMADDUBSW +
// VPMADDWD), spans 2 or 4 blocks of a row (8 or 4 lanes a block): each block's partial sums
// would have to be converted and scaled by d * s every vector, 3 float operations to each
// integer one. So the code vectors of a weight row are taken 2^S at a time (a segment: 16
// blocks on AVX-512) and passed through S shuffle stages (`stages`: each takes two vectors of p
// lanes a block and gives two of p/2 lanes a block with every block of both) that leave every
// lane with bytes of one block only, the same block in all 2^S vectors; the rows' int8 values
// are laid out by the same stages once a call (with each lane's d and integer start). The
// integer sums then add up over the whole segment in each lane, and are converted and scaled
// once (d_lane * s_lane: the row's d, the weight row's scales through a permute of its group
// map). The stages cost 3 shuffles a code vector (8-bit, AVX-512), shared by all the rows of a
// tile; at 8 rows the product is 1.2 to 1.4x faster (VNNI; AVX2 8-bit 1.5x) than with a convert
// and scale every vector, and no slower at 1 row (measured in L2).
// Paths (int8_blocks_path for the tests and the benchmark):
// - AVX-512 VNNI (built with -march that has it): VPDPBUSD(codes as u8, values as s8), 64 code
//   bytes a vector; 4-bit codes split into low and high nibbles against the rows' even and odd
//   inputs (laid out apart). Tiles of up to 8 rows x 2 to 8 outputs, each transposed code
//   vector used by every row of the tile.
// - AVX2 (any build; the only one for the AVX2 class): VPMADDUBSW + VPMADDWD, 32 code bytes a
//   vector. 4-bit: products of codes 0..15 and values in +-127, summed in int16 over up to 4
//   vectors (4 * 2 * 2 * 15 * 127 < 32767). 8-bit: codes to 255 would saturate VPMADDUBSW's
//   pairs, so as in int8_rows.cpp the operands are |c - 128| and x * sign(c - 128), which sums
//   (c - 128) * x: the integer start makes up for the 128 ((128 - zero) * T in kind 0, 128 * T
//   in kinds 1 and 2). Tiles of up to 4 rows.
// Output rows of all weights are split over torch's intra-op threads in blocks of kBlock.
//
// Measured (Intel Xeon, Emerald Rapids, VNNI + AMX, 2 shared cores; bench/int8_blocks.py: one
// thread's CPU time, medians of alternating rounds; SmolLM2-135M's shapes, as many weight
// copies as stream 32 MB a round; this host's times vary up to 30% from run to run, the ratios
// less: the ranges are two runs'), int8_blocks against packed_rows on the same weights, ms a
// call, 1 row / 8 rows:
//   AVX-512 build, VNNI path (packed_rows: its AVX-512 path)
//     Q8_0  q 576x576    0.022-0.028 vs 0.032-0.046 / 0.043 vs 0.093-0.096  (1.5-1.7x / 2.2x)
//           gate/up      0.077-0.100 vs 0.126-0.161 / 0.157-0.219 vs 0.378-0.489 (1.6x / 2.2-2.4x)
//           head 49152   1.07-1.30 vs 1.91-2.25 / 3.69-4.65 vs 7.1-8.8 (1.7-1.8x / 1.5-2.4x)
//     Q4_1  q            0.019-0.029 vs 0.031-0.045 / 0.050-0.054 vs 0.107-0.110 (1.5-1.6x / 2.1x)
//           gate/up      0.075 vs 0.143-0.147 / 0.237 vs 0.56-0.64  (1.9-2.0x / 2.4-2.7x)
//           head         1.46-1.66 vs 3.0-3.1 / 3.2-4.7 vs 8.2-13.5  (1.9-2.1x / 2.5-2.9x)
//     k/v 1.3-1.5x / 1.9-2.3x, down 1.5-1.9x / 2.1-3.7x. The AVX2 path in this build (a host
//     without VNNI): Q8_0 0.7-1.1x packed_rows' AVX-512 path, Q4_1 1.2-2.0x.
//   AVX2 class build (-march=x86-64-v3, both kernels; on this host)
//     Q8_0  1.2-1.5x / 1.2-1.4x (q 0.033 vs 0.043 ms / 0.13-0.14 vs 0.15-0.19; head 2.1-2.4 vs
//           3.0-3.2 / 10.1-10.3 vs 12.4-13.2)
//     Q4_1  1.8-3.2x / 2.2-2.7x (q 0.024-0.025 vs 0.061-0.064 / 0.085 vs 0.19; head 1.6-1.8 vs
//           4.7-4.9 / 6.3-6.7 vs 16.2-17.7)
// VNNI runs at 80-85 GMAC/s from 8 rows (in L2; kinds 1 and 2 at 67-69: their group term), one
// row streams the codes at 22-27 GB/s (this host's L3 bandwidth for one core: 22-24).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQ = 32;  // inputs a block of a row shares a scale (kernels/int8_blocks.py)
// weight rows a block: every row group passes over one block (in L1/L2) before the next, and
// the unit the outputs are split over threads in
constexpr int64_t kBlock = 64;

enum Path : int { kMadd = 0, kVnni = 1 };

// ---- per-thread scratch, kept from call to call (no allocation on a decode step) ----

struct alignas(64) Line {
  uint8_t b[64];
};

template <typename T>
T* scratch(std::vector<Line>& v, int64_t count) {
  const size_t lines = (count * sizeof(T) + 63) / 64;
  if (v.size() < lines) v.resize(lines);
  return reinterpret_cast<T*>(v.data());
}

// ---- quantize_blocks, one block of 32 inputs -> q (int8), returns d, *t = sum q ----

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even

#ifdef __AVX512F__
template <typename T>
inline __m512 load16(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {  // bf16: a float32's high half
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename T>
inline float quantize_block(const T* x, int8_t* q, int32_t* t) {
  const __m512 a = load16(x), b = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, inverse), kRound);
  __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, inverse), kRound);
  qa = _mm512_min_epi32(_mm512_max_epi32(qa, lo), hi);
  qb = _mm512_min_epi32(_mm512_max_epi32(qb, lo), hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *t = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return amax > 0.0f ? amax / 127.0f : 1.0f;
}
#else
template <typename T>
inline __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <typename T>
inline float quantize_block(const T* x, int8_t* q, int32_t* t) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], magnitude));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inverse), kRound));
    qi[i] = _mm256_min_epi32(_mm256_max_epi32(qi[i], lo), hi);
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // int32 -> int8: the packs interleave the 128-bit halves, the permute puts them in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                            _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  *t = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
  return amax > 0.0f ? amax / 127.0f : 1.0f;
}
#endif

// ---- the vectors (header comment: Layout) ----

struct Ymm {  // AVX2
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8, kBytes = 32;
  static I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I load_part(const void* p, int bytes) {  // bytes: a multiple of 4
    const I lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const I mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(bytes / 4), lane);
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
  }
  static void store(void* p, I v) { _mm256_storeu_si256(reinterpret_cast<I*>(p), v); }
  static I zero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I times(I a, int32_t b) { return _mm256_mullo_epi32(a, _mm256_set1_epi32(b)); }
  // a stage on blocks of P lanes: lo and hi get the same blocks, P/2 lanes each
  template <int P>
  static void pair(I a, I b, I& lo, I& hi) {
    if constexpr (P == 8) {  // a block a vector: 128-bit halves
      lo = _mm256_permute2x128_si256(a, b, 0x20);
      hi = _mm256_permute2x128_si256(a, b, 0x31);
    } else if constexpr (P == 4) {  // blocks in lanes 0-3 and 4-7: pairs of lanes
      lo = _mm256_unpacklo_epi64(a, b);
      hi = _mm256_unpackhi_epi64(a, b);
    } else {  // P == 2: single lanes
      lo = _mm256_blend_epi32(a, _mm256_slli_epi64(b, 32), 0xAA);
      hi = _mm256_blend_epi32(_mm256_srli_epi64(a, 32), b, 0xAA);
    }
  }
  static I lane_sums(I x) {  // each lane's 4 int8 values added
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), _mm256_set1_epi16(1));
  }
  // s[first + idx[lane]], reading s[first .. first + count) only
  static F scales(const float* s, int first, int count, const int32_t* idx) {
    const I lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const I mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane);
    return _mm256_permutevar8x32_ps(_mm256_maskload_ps(s + first, mask), load(idx));
  }
  static F scale_add(I sum, const float* d, F s, F acc) {  // acc + float(sum) * (d * s)
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(_mm256_loadu_ps(d), s), acc);
  }
  static F first(const float* p, int64_t count) {  // p[0 .. count), zeros past it
    const I lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int n = static_cast<int>(std::min<int64_t>(count, kLanes));
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F minus_product(F a, F b) { return _mm256_sub_ps(fzero(), _mm256_mul_ps(a, b)); }
  // out[i]: the sum of v[i]'s lanes
  static void sums(const F* v, float* out) {
    const F a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const F b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                        _mm256_permute2f128_ps(a, b, 0x31)));
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasVnni = true;

// VPERMT2D's indices for a stage on blocks of p lanes: lo (hi) takes the first (second) half of
// each block's lanes, a's blocks, then b's
constexpr std::array<int32_t, 16> pair_index(int p, bool hi) {
  std::array<int32_t, 16> out{};
  const int n = 16 / p, h = p / 2;
  for (int j = 0; j < 16; ++j) {
    const int block = j / h, k = j % h + (hi ? h : 0);
    out[j] = block < n ? block * p + k : 16 + (block - n) * p + k;
  }
  return out;
}
template <int P, bool Hi>
alignas(64) constexpr std::array<int32_t, 16> kPairIndex = pair_index(P, Hi);

struct Zmm {  // AVX-512
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16, kBytes = 64;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I load_part(const void* p, int bytes) {
    return _mm512_maskz_loadu_epi8((1ULL << bytes) - 1, p);
  }
  static void store(void* p, I v) { _mm512_storeu_si512(p, v); }
  static I zero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I times(I a, int32_t b) { return _mm512_mullo_epi32(a, _mm512_set1_epi32(b)); }
  template <int P>
  static void pair(I a, I b, I& lo, I& hi) {
    lo = _mm512_permutex2var_epi32(a, _mm512_load_si512(kPairIndex<P, false>.data()), b);
    hi = _mm512_permutex2var_epi32(a, _mm512_load_si512(kPairIndex<P, true>.data()), b);
  }
  static I lane_sums(I x) { return _mm512_dpbusd_epi32(zero(), _mm512_set1_epi8(1), x); }
  static F scales(const float* s, int first, int count, const int32_t* idx) {
    return _mm512_permutexvar_ps(load(idx), _mm512_maskz_loadu_ps((1u << count) - 1, s + first));
  }
  static F scale_add(I sum, const float* d, F s, F acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_loadu_ps(d), s), acc);
  }
  static F first(const float* p, int64_t count) {
    return _mm512_maskz_loadu_ps(count >= kLanes ? 0xFFFF : (1u << count) - 1, p);
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F minus_product(F a, F b) { return _mm512_sub_ps(fzero(), _mm512_mul_ps(a, b)); }
  // out[i]: the sum of v[i]'s lanes (int8_rows.cpp's sum16, in float32)
  static void sums(const F* v, float* out) {
    F a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                           _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                        _mm512_shuffle_f32x4(c[0], c[1], 0xdd)));
  }
};
#else
constexpr bool kHasVnni = false;
#endif

// `Stages` stages over v[0 .. NV) whose blocks have P lanes: pair (2j, 2j+1) to j and j + NV/2,
// so that the vectors paired at every stage have the same lanes' blocks, and so do all NV at
// the end
template <class V, int NV, int P, int Stages>
__attribute__((always_inline)) inline void stages(typename V::I (&v)[NV]) {
  if constexpr (Stages > 0) {
    typename V::I o[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV / 2; ++j)
      V::template pair<P>(v[2 * j], v[2 * j + 1], o[j], o[j + NV / 2]);
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) v[j] = o[j];
    stages<V, NV, P / 2, Stages - 1>(v);
  }
}

// ---- the call's plan: segments of code vectors, and the rows laid out for them ----

struct Segment {
  int S;           // 2^S code vectors
  int tail;        // bytes of its last code vector inside a weight row (0: all of them)
  int64_t vec;     // its first code vector in a weight row
  int64_t block;   // its first block
  int64_t offset;  // its bytes in a row's layout: the values' vectors, d, the integer start
};

struct Plan {
  int bits, kind;
  int lanes, vbytes, p0;  // int32 lanes and bytes a vector; lanes a block in a code vector
  int32_t offset;         // the integer sums start at offset * (the lane's sum of values)
  int64_t R, K, blocks, row_bytes, stride;  // stride: a row's layout bytes
  std::vector<Segment> segs;
  int32_t map[4][16];  // per S: each lane's block in a segment, after the stages
  bool init() const { return offset != 0; }
  int xvecs() const { return bits == 8 ? 1 : 2; }  // row vectors a code vector
  int64_t inputs() const { return bits == 8 ? vbytes : 2 * vbytes; }  // inputs a code vector
};

// Segments of as many vectors as the stages can take (8-bit: 2^3, 2^2 on AVX2; 4-bit: 2^2)
// while they last, then the rest in powers of two
void plan_segments(Plan& plan) {
  const int64_t vecs = (plan.row_bytes + plan.vbytes - 1) / plan.vbytes;
  // AVX2 8-bit: 2^2 (2^3 spilled 16 ymm: a whole SmolLM2 token's projections 13.4 -> 10.6 ms
  // at 1 row, 27.5 -> 22.5 at 8, 2 threads, the class's build, alternating)
  const int most = plan.bits == 8 ? (plan.vbytes == 32 ? 2 : 3) : 2, xv = plan.xvecs();
  int64_t v = 0, offset = 0;
  for (int S = most; S >= 0; --S) {
    while (vecs - v >= (int64_t{1} << S)) {
      const int64_t nv = int64_t{1} << S, end = (v + nv) * plan.vbytes;
      const int tail = end > plan.row_bytes ? static_cast<int>(plan.row_bytes % plan.vbytes) : 0;
      plan.segs.push_back({S, tail, v, v * plan.inputs() / kQ, offset});
      offset += (nv * xv + 1 + (plan.init() ? 1 : 0)) * plan.vbytes;
      v += nv;
      if (S != most) break;
    }
  }
  plan.stride = offset;
}

// Each lane's block after S stages: the stages run on vectors of block numbers
template <class V, int S>
void plan_map(Plan& plan) {
  using I = typename V::I;
  constexpr int NV = 1 << S;
  alignas(64) int32_t ids[16];
  I v[NV];
  for (int i = 0; i < NV; ++i) {
    for (int l = 0; l < V::kLanes; ++l) ids[l] = i * (V::kLanes / plan.p0) + l / plan.p0;
    v[i] = V::load(ids);
  }
  if (plan.p0 == 8)
    stages<V, NV, 8, S>(v);
  else if constexpr (S <= 2)
    stages<V, NV, 4, S>(v);
  V::store(plan.map[S], v[0]);
}

struct Rows {
  uint8_t* layout;  // [R, stride]
  float* d;         // [R, blocks]
  int32_t* t;       // [R, blocks]
};

// One segment of a row (q: its int8 values in input order, zero past K): its values through
// the stages (4-bit: the even and the odd inputs apart), its lanes' d, its integer start
template <class V, int S>
void lay_out(const Plan& plan, const Segment& seg, const int8_t* q, const float* d,
             uint8_t* dst) {
  using I = typename V::I;
  constexpr int NV = 1 << S;
  const int64_t per = plan.inputs();
  I a[NV], b[NV];
  for (int i = 0; i < NV; ++i) {
    const int8_t* src = q + (seg.vec + i) * per;
    if (plan.bits == 8) {
      a[i] = V::load(src);
    } else {
      alignas(64) int8_t even[64], odd[64];
      for (int j = 0; j < V::kBytes; ++j) even[j] = src[2 * j], odd[j] = src[2 * j + 1];
      a[i] = V::load(even), b[i] = V::load(odd);
    }
  }
  if (plan.bits == 8) {
    stages<V, NV, 8, S>(a);
  } else if constexpr (S <= 2) {
    stages<V, NV, 4, S>(a);
    stages<V, NV, 4, S>(b);
  }
  const int xv = plan.xvecs();
  I sum = V::zero();
  for (int i = 0; i < NV; ++i) {
    V::store(dst + i * xv * V::kBytes, a[i]);
    sum = V::add(sum, V::lane_sums(a[i]));
    if (xv == 2) {
      V::store(dst + (i * xv + 1) * V::kBytes, b[i]);
      sum = V::add(sum, V::lane_sums(b[i]));
    }
  }
  float* lane_d = reinterpret_cast<float*>(dst + NV * xv * V::kBytes);
  for (int l = 0; l < V::kLanes; ++l) {
    const int64_t block = seg.block + plan.map[S][l];
    lane_d[l] = block < plan.blocks ? d[block] : 0.0f;
  }
  if (plan.init()) V::store(dst + (NV * xv + 1) * V::kBytes, V::times(sum, plan.offset));
}

template <class V, typename T>
void quantize_rows(const Plan& plan, const T* x, const Rows& rows) {
  const int64_t padded = (plan.row_bytes + plan.vbytes - 1) / plan.vbytes * plan.inputs();
  at::parallel_for(0, plan.R, 16, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<Line> buffer;
    int8_t* q = scratch<int8_t>(buffer, padded);
    for (int64_t r = r0; r < r1; ++r) {
      float* d = rows.d + r * plan.blocks;
      int32_t* t = rows.t + r * plan.blocks;
      for (int64_t b = 0; b < plan.blocks; ++b)
        d[b] = quantize_block(x + r * plan.K + b * kQ, q + b * kQ, t + b);
      std::memset(q + plan.K, 0, padded - plan.K);
      uint8_t* dst = rows.layout + r * plan.stride;
      for (const Segment& seg : plan.segs) {
        switch (seg.S) {
          case 0: lay_out<V, 0>(plan, seg, q, d, dst + seg.offset); break;
          case 1: lay_out<V, 1>(plan, seg, q, d, dst + seg.offset); break;
          case 2: lay_out<V, 2>(plan, seg, q, d, dst + seg.offset); break;
          default: lay_out<V, 3>(plan, seg, q, d, dst + seg.offset); break;
        }
      }
    }
  });
}

// ---- the weights ----

// A segment's lanes' scales for one group size G: lane l's group is first + idx[l]; the
// segment's groups are first .. first + count - 1
struct ScaleMap {
  alignas(64) int32_t idx[16];
  int32_t first, count;
};

void scale_maps(const Plan& plan, int64_t G, ScaleMap* out) {
  for (size_t k = 0; k < plan.segs.size(); ++k) {
    const Segment& seg = plan.segs[k];
    const int64_t blocks = (int64_t{1} << seg.S) * plan.inputs() / kQ;
    const int64_t last = std::min(plan.blocks, seg.block + blocks) - 1;
    ScaleMap& m = out[k];
    m.first = static_cast<int32_t>(seg.block * kQ / G);
    m.count = static_cast<int32_t>(last * kQ / G - m.first + 1);
    for (int l = 0; l < 16; ++l) {
      const int64_t block = seg.block + (l < plan.lanes ? plan.map[seg.S][l] : 0);
      m.idx[l] = block <= last ? static_cast<int32_t>(block * kQ / G - m.first) : 0;
    }
  }
}

struct Weight {
  const uint8_t* codes;  // [n, row_bytes]
  const float* scale;    // [n, groups]
  const float* aux;      // [n, groups] (kinds 1, 2) or nullptr
  const ScaleMap* maps;  // per segment
  const float* e;        // kinds 1, 2: [R, groups], each group's sum over its blocks of d * T
  int64_t n, groups, start;
};

// ---- the tiles: R rows x U outputs ----

// One segment of a tile: for each output row, its code vectors through the stages, then the
// segment's integer sums of every row, scaled once
template <class V, int Bits, bool Init, int S, int R, int U>
__attribute__((always_inline)) inline void segment(typename V::F (&acc)[R][U], const Plan& plan,
                                                   const Segment& seg, const ScaleMap& sm,
                                                   const uint8_t* const* xr, const Weight& w,
                                                   int64_t n) {
  using I = typename V::I;
  constexpr int NV = 1 << S, XV = Bits == 8 ? 1 : 2;
  constexpr bool kZmm = V::kLanes == 16;
  // A partial sums a row (vector i into i % A): R * A dot products in flight at each step
  constexpr int A = std::min(NV, R >= 4 ? 1 : (R == 1 ? 4 : 2));
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u) {
    const uint8_t* c = w.codes + (n + u) * plan.row_bytes + seg.vec * V::kBytes;
    I a[NV], b[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i)
      a[i] = i == NV - 1 && seg.tail ? V::load_part(c + i * V::kBytes, seg.tail)
                                     : V::load(c + i * V::kBytes);
    stages<V, NV, Bits == 8 ? 8 : 4, S>(a);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      if constexpr (Bits == 4 && kZmm) {  // a: the low nibbles (even inputs), b: the high ones
        const I low = _mm512_set1_epi8(0x0F);
        b[i] = _mm512_and_si512(_mm512_srli_epi16(a[i], 4), low);
        a[i] = _mm512_and_si512(a[i], low);
      } else if constexpr (Bits == 4) {
        const I low = _mm256_set1_epi8(0x0F);
        b[i] = _mm256_and_si256(_mm256_srli_epi16(a[i], 4), low);
        a[i] = _mm256_and_si256(a[i], low);
      } else if constexpr (!kZmm) {  // b: c - 128 signed; a: its magnitude
        b[i] = _mm256_xor_si256(a[i], _mm256_set1_epi8(static_cast<char>(0x80)));
        a[i] = _mm256_abs_epi8(b[i]);
      }
    }
    I sum[R][A];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < A; ++j)
        sum[r][j] = Init && j == 0 ? V::load(xr[r] + seg.offset + (NV * XV + 1) * V::kBytes)
                                   : V::zero();
    if constexpr (kZmm) {
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = xr[r] + seg.offset + i * XV * V::kBytes;
          I& t = sum[r][i % A];
          t = _mm512_dpbusd_epi32(t, a[i], V::load(x));
          if constexpr (Bits == 4) t = _mm512_dpbusd_epi32(t, b[i], V::load(x + V::kBytes));
        }
    } else if constexpr (Bits == 8) {
      const I ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const I x = V::load(xr[r] + seg.offset + i * V::kBytes);
          const I pairs = _mm256_maddubs_epi16(a[i], _mm256_sign_epi8(x, b[i]));
          sum[r][i % A] = _mm256_add_epi32(sum[r][i % A], _mm256_madd_epi16(pairs, ones));
        }
    } else {  // the pairs of up to 4 vectors added in int16 (header comment), then widened
      const I ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* x = xr[r] + seg.offset;
        I pairs = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) {
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(a[i], V::load(x + 2 * i * 32)));
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(b[i], V::load(x + 2 * i * 32 + 32)));
        }
        sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(pairs, ones));
      }
    }
    const auto s = V::scales(w.scale + (n + u) * w.groups, sm.first, sm.count, sm.idx);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      I total = sum[r][0];
#pragma GCC unroll 4
      for (int j = 1; j < A; ++j) total = V::add(total, sum[r][j]);
      const float* d = reinterpret_cast<const float*>(xr[r] + seg.offset + NV * XV * V::kBytes);
      acc[r][u] = V::scale_add(total, d, s, acc[r][u]);
    }
  }
}

// sum(x_hat * w) for rows r0..r0+R-1 and weight rows n..n+U-1 (out[r][u])
template <class V, int Bits, bool Init, int R, int U>
void tile(const Plan& plan, const Rows& rows, int64_t r0, const Weight& w, int64_t n,
          float (*out)[8]) {
  using F = typename V::F;
  F acc[R][U];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc[r][u] = V::fzero();
  const uint8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = rows.layout + (r0 + r) * plan.stride;
  for (size_t k = 0; k < plan.segs.size(); ++k) {
    const Segment& seg = plan.segs[k];
    switch (seg.S) {
      case 0: segment<V, Bits, Init, 0, R, U>(acc, plan, seg, w.maps[k], xr, w, n); break;
      case 1: segment<V, Bits, Init, 1, R, U>(acc, plan, seg, w.maps[k], xr, w, n); break;
      case 2: segment<V, Bits, Init, 2, R, U>(acc, plan, seg, w.maps[k], xr, w, n); break;
      default:
        if constexpr (Bits == 8)
          segment<V, Bits, Init, 3, R, U>(acc, plan, seg, w.maps[k], xr, w, n);
        break;
    }
  }
  if (plan.kind != 0) {  // + sum_g coef_g * e[r][g], coef = -s * z (kind 1) or m (kind 2)
    const int64_t groups = w.groups;
    const float* e = w.e + r0 * groups;
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const float* s = w.scale + (n + u) * groups;
      const float* a = w.aux + (n + u) * groups;
      for (int64_t g = 0; g < groups; g += V::kLanes) {
        F coef = V::first(a + g, groups - g);
        if (plan.kind == 1) coef = V::minus_product(V::first(s + g, groups - g), coef);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][u] = V::fma(coef, V::first(e + r * groups + g, groups - g), acc[r][u]);
      }
    }
  }
  F all[V::kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < V::kLanes; ++i) all[i] = i < R * U ? acc[i / U][i % U] : V::fzero();
  float sums[16];
  V::sums(all, sums);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) out[r][u] = sums[r * U + u];
}

// ---- tiles over a weight's output rows ----

// Rows a pass over a weight block and outputs a tile (measured, SmolLM2 shapes): AVX-512,
// R * U accumulators + 8 code vectors a segment within 32 zmm; AVX2 within 16 ymm
template <class V>
struct Tiles;

template <>
struct Tiles<Ymm> {
  static constexpr int kRows = 4;
  // 8-bit from 2 rows: one output a tile (two spilled, with plan_segments' 2^2 vectors)
  static constexpr int width(int R, int bits) { return R == 1 ? 4 : (bits == 4 && R == 2 ? 2 : 1); }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <>
struct Tiles<Zmm> {
  static constexpr int kRows = 8;
  static constexpr int width(int R, int) { return R == 1 ? 8 : (R <= 4 ? 4 : 2); }
};
#endif

template <class V, int Bits, bool Init, int R>
void tile_rows(const Plan& plan, const Rows& rows, int64_t r0, const Weight& w, int64_t n0,
               int64_t n1, float* o, int64_t ldo) {
  constexpr int U = Tiles<V>::width(R, Bits);
  float acc[8][8];
  for (int64_t n = n0; n < n1;) {
    const int u = n + U <= n1 ? U : 1;
    if (u == U)
      tile<V, Bits, Init, R, U>(plan, rows, r0, w, n, acc);
    else
      tile<V, Bits, Init, R, 1>(plan, rows, r0, w, n, acc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < u; ++j) o[(r0 + r) * ldo + w.start + n + j] = acc[r][j];
    n += u;
  }
}

template <class V, int Bits, bool Init>
void range(const Plan& plan, const Rows& rows, const Weight& w, int64_t n0, int64_t n1, float* o,
           int64_t ldo) {
  constexpr int64_t most = Tiles<V>::kRows;
  for (int64_t b0 = n0; b0 < n1; b0 += kBlock) {
    const int64_t b1 = std::min(n1, b0 + kBlock);
    for (int64_t r0 = 0; r0 < plan.R; r0 += most) {
      switch (std::min(most, plan.R - r0)) {
        case 1: tile_rows<V, Bits, Init, 1>(plan, rows, r0, w, b0, b1, o, ldo); break;
        case 2: tile_rows<V, Bits, Init, 2>(plan, rows, r0, w, b0, b1, o, ldo); break;
        case 3: tile_rows<V, Bits, Init, 3>(plan, rows, r0, w, b0, b1, o, ldo); break;
        case 4: tile_rows<V, Bits, Init, 4>(plan, rows, r0, w, b0, b1, o, ldo); break;
        default:
          if constexpr (most == 8) {
            switch (plan.R - r0) {
              case 5: tile_rows<V, Bits, Init, 5>(plan, rows, r0, w, b0, b1, o, ldo); break;
              case 6: tile_rows<V, Bits, Init, 6>(plan, rows, r0, w, b0, b1, o, ldo); break;
              case 7: tile_rows<V, Bits, Init, 7>(plan, rows, r0, w, b0, b1, o, ldo); break;
              default: tile_rows<V, Bits, Init, 8>(plan, rows, r0, w, b0, b1, o, ldo); break;
            }
          }
          break;
      }
    }
  }
}

template <class V>
void weight_range(const Plan& plan, const Rows& rows, const Weight& w, int64_t n0, int64_t n1,
                  float* o, int64_t ldo) {
  if (plan.bits == 8 && plan.init())
    range<V, 8, true>(plan, rows, w, n0, n1, o, ldo);
  else if (plan.bits == 8)
    range<V, 8, false>(plan, rows, w, n0, n1, o, ldo);
  else if (plan.init())
    range<V, 4, true>(plan, rows, w, n0, n1, o, ldo);
  else
    range<V, 4, false>(plan, rows, w, n0, n1, o, ldo);
}

// ---- the call ----

struct Part {
  const uint8_t* codes;
  const float *scale, *aux;
  int64_t n, groups;
};

// Kinds 1, 2: per row and group of G inputs, the sum over its blocks of d * T
void group_sums(const Plan& plan, const Rows& rows, int64_t G, float* e) {
  const int64_t groups = plan.K / G, per = G / kQ;
  for (int64_t r = 0; r < plan.R; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t b = g * per; b < (g + 1) * per; ++b)
        sum += rows.d[r * plan.blocks + b] * static_cast<float>(rows.t[r * plan.blocks + b]);
      e[r * groups + g] = sum;
    }
}

template <class V>
void run(Plan& plan, const at::Tensor& x, const std::vector<Part>& parts, int64_t total,
         float* o) {
  plan.lanes = V::kLanes, plan.vbytes = V::kBytes, plan.p0 = plan.bits == 8 ? 8 : 4;
  plan_segments(plan);
  plan_map<V, 0>(plan), plan_map<V, 1>(plan), plan_map<V, 2>(plan);
  if (plan.bits == 8) plan_map<V, 3>(plan);
  thread_local std::vector<Line> layout, d, t, e, maps;
  const Rows rows{scratch<uint8_t>(layout, plan.R * plan.stride),
                  scratch<float>(d, plan.R * plan.blocks),
                  scratch<int32_t>(t, plan.R * plan.blocks)};
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows<V>(plan, x.data_ptr<at::BFloat16>(), rows);
  else
    quantize_rows<V>(plan, x.data_ptr<float>(), rows);
  // per group size: the segments' scale maps and (kinds 1, 2) the rows' group sums
  std::vector<int64_t> sizes, at;  // at: where a size's group sums begin
  int64_t sums = 0;
  for (const Part& p : parts) {
    const int64_t G = plan.K / p.groups;
    if (std::find(sizes.begin(), sizes.end(), G) != sizes.end()) continue;
    sizes.push_back(G), at.push_back(sums);
    sums += plan.kind != 0 ? plan.R * p.groups : 0;
  }
  const size_t nseg = plan.segs.size();
  ScaleMap* map = scratch<ScaleMap>(maps, sizes.size() * nseg);
  float* sum = scratch<float>(e, sums);
  for (size_t i = 0; i < sizes.size(); ++i) {
    scale_maps(plan, sizes[i], map + i * nseg);
    if (plan.kind != 0) group_sums(plan, rows, sizes[i], sum + at[i]);
  }
  std::vector<Weight> ws;
  int64_t start = 0;
  for (const Part& p : parts) {
    const size_t i = std::find(sizes.begin(), sizes.end(), plan.K / p.groups) - sizes.begin();
    ws.push_back({p.codes, p.scale, p.aux, map + i * nseg, sum + at[i], p.n, p.groups, start});
    start += p.n;
  }
  // output rows of all weights as one range, split over threads in whole blocks
  at::parallel_for(0, (total + kBlock - 1) / kBlock, 1, [&](int64_t t0, int64_t t1) {
    const int64_t m0 = t0 * kBlock, m1 = std::min(total, t1 * kBlock);
    for (const Weight& w : ws) {
      const int64_t lo = std::max(m0, w.start), hi = std::min(m1, w.start + w.n);
      if (lo < hi) weight_range<V>(plan, rows, w, lo - w.start, hi - w.start, o, total);
    }
  });
}

std::atomic<int> path_wanted{kVnni};  // int8_blocks_path: the highest path to take

int best_path() {
  return std::min<int>(kHasVnni ? kVnni : kMadd, path_wanted.load(std::memory_order_relaxed));
}

at::Tensor int8_blocks(const at::Tensor& x_in, at::TensorList codes, at::TensorList scales,
                       at::TensorList aux, int64_t bits, int64_t kind, int64_t zero) {
  TORCH_CHECK(x_in.dim() == 2, "int8_blocks: expects x [R, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "int8_blocks: x must be float32 or bfloat16");
  const int64_t R = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(K >= kQ && K % kQ == 0, "int8_blocks: K must be a multiple of 32");
  TORCH_CHECK(bits == 4 || bits == 8, "int8_blocks: bits must be 4 or 8");
  TORCH_CHECK(kind >= 0 && kind <= 2, "int8_blocks: kind must be 0, 1 or 2");
  TORCH_CHECK(zero >= 0 && zero <= 255, "int8_blocks: zero must be 0 to 255");
  TORCH_CHECK(!codes.empty() && scales.size() == codes.size(), "int8_blocks: a scale a weight");
  // aux: one tensor a weight, read in kinds 1 and 2 only (kind 0 passes any: AOTInductor's
  // proxy executor hands an empty tensor list on as None)
  TORCH_CHECK(aux.size() == codes.size(), "int8_blocks: an aux tensor a weight");
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  std::vector<at::Tensor> keep;  // contiguous copies (none for graph inputs) live to the end
  std::vector<Part> parts;
  int64_t total = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor c = codes[i].contiguous(), s = scales[i].contiguous();
    TORCH_CHECK(c.dim() == 2 && c.size(1) == row_bytes && c.scalar_type() == at::kByte,
                "int8_blocks: codes must be uint8 [N, K] (8-bit) or [N, K/2] (4-bit)");
    TORCH_CHECK(s.dim() == 2 && s.size(0) == c.size(0) && s.scalar_type() == at::kFloat &&
                    s.size(1) > 0 && K % s.size(1) == 0 && (K / s.size(1)) % kQ == 0,
                "int8_blocks: scales must be float32 [N, K/G], G a multiple of 32");
    keep.push_back(c), keep.push_back(s);
    const float* a = nullptr;
    if (kind != 0) {
      const at::Tensor t = aux[i].contiguous();
      TORCH_CHECK(t.sizes() == s.sizes() && t.scalar_type() == at::kFloat,
                  "int8_blocks: aux must be float32, shaped as the scales");
      keep.push_back(t);
      a = t.data_ptr<float>();
    }
    parts.push_back({c.data_ptr<uint8_t>(), s.data_ptr<float>(), a, c.size(0), s.size(1)});
    total += c.size(0);
  }
  at::Tensor out = at::empty({R, total}, x_in.options().dtype(at::kFloat));
  if (R == 0 || total == 0) return out;
  const int path = best_path();
  Plan plan{};
  plan.bits = static_cast<int>(bits), plan.kind = static_cast<int>(kind);
  plan.R = R, plan.K = K, plan.blocks = K / kQ, plan.row_bytes = row_bytes;
  plan.offset = kind == 0 ? -static_cast<int32_t>(zero) : 0;
  if (path == kMadd && bits == 8) plan.offset += 128;  // VPMADDUBSW sums (c - 128) * x
  const at::Tensor x = x_in.contiguous();
  float* o = out.data_ptr<float>();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (path == kVnni) {
    run<Zmm>(plan, x, parts, total, o);
    return out;
  }
#endif
  run<Ymm>(plan, x, parts, total, o);
  return out;
}

// The path int8_blocks takes (1 VNNI, 0 AVX2) after asking for at most `want` (-1: the best
// this build has). For the tests and the benchmark.
int64_t int8_blocks_path(int64_t want) {
  path_wanted.store(want < 0 ? kVnni : static_cast<int>(std::min<int64_t>(want, kVnni)));
  return best_path();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neffkit, m) {
  m.def(
      "int8_blocks(Tensor x, Tensor[] codes, Tensor[] scales, Tensor[] aux, int bits, int kind, "
      "int zero) -> Tensor");
  m.def("int8_blocks_path(int want) -> int", &int8_blocks_path);
}

TORCH_LIBRARY_IMPL(neffkit, CPU, m) { m.impl("int8_blocks", &int8_blocks); }
