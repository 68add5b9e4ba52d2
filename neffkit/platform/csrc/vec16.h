// A 16-lane float32 vector for the kernels of this directory, one source for both CPU classes
// (neffkit/platform/isa.py): one zmm register where the library is compiled for AVX-512
// (__AVX512F__), two ymm registers (lanes 0..7, 8..15) for the AVX2 class (AVX2 + FMA + F16C).
//
// Lane for lane the AVX2 forms compute what the AVX-512 instructions compute (a product added
// with one FMA, the same widening of bf16 and e4m3 bits, the horizontal sums and maxima in the
// order of GCC's _mm512_reduce_*_ps), so a kernel written once over these gives the same bits in
// either class. What differs between the classes is the register budget (32 zmm, 16 ymm: a
// 16-lane vector costs two ymm), which the kernels' tile widths follow (kVectorRegs).

#pragma once

#include <immintrin.h>

#include <cstdint>

// Before a loop over a tile's rows or blocks (fixed counts): unrolled before GCC's scalar
// replacement of the accumulator arrays. Without it GCC 12 kept AVX2's two-register vectors in a
// stack array and stored them every K step (tile<4, 1> float32: 8 stores a step). The AVX-512
// build keeps its code of before (its one-register vectors never hit this).
#ifdef __AVX512F__
#define NEFFKIT_UNROLL
#else
#define NEFFKIT_UNROLL _Pragma("GCC unroll 16")
#endif

namespace neffkit_vec {

#ifdef __AVX512F__
constexpr int kVectorRegs = 32;  // 16-lane vectors that fit the register file

struct V16 {
  __m512 v;
};
struct Tail {  // lanes 0 .. n-1 of a vector
  __mmask16 m;
};

inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
// 16 bf16 values widened to float32 (their bits moved to the high half: exact)
inline V16 load(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
// One K step of a blocked weight's 16 lanes, in the order the class widens them fastest, and
// accumulators of such lanes stored in lane order: here the lane order itself.
inline V16 load_weights(const float* p) { return load(p); }
inline V16 load_weights(const uint16_t* p) { return load(p); }
template <typename W>
inline void store_lanes(float* p, V16 a) {
  store(p, a);
}
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 round_nearest(V16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^k for integral k, rounded once (the AVX2 form: for |a| in [1/2, 2), k in [-189, 63])
inline V16 scalef(V16 a, V16 k) { return {_mm512_scalef_ps(a.v, k.v)}; }

// e4m3fn bytes -> float16 bits (sign to bit 15, exponent and mantissa to bits 7..13: the byte
// sign-extended to 16 bits, shifted left by 7, bit 14 cleared), widened by VCVTPH2PS: the value
// times 2^-8, subnormals included
inline V16 load_fp8_half(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7),
                                        _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
  return {_mm512_cvtph_ps(half)};
}

inline Tail first(int64_t n) { return {static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1)}; }
inline V16 load(Tail t, const float* p) { return {_mm512_maskz_loadu_ps(t.m, p)}; }  // else 0
inline void store(Tail t, float* p, V16 a) { _mm512_mask_storeu_ps(p, t.m, a.v); }
// lanes of the tail: max(a, b) and a + b; others keep a's
inline V16 max(Tail t, V16 a, V16 b) { return {_mm512_mask_max_ps(a.v, t.m, a.v, b.v)}; }
inline V16 add(Tail t, V16 a, V16 b) { return {_mm512_mask_add_ps(a.v, t.m, a.v, b.v)}; }

#else  // AVX2 + FMA + F16C
constexpr int kVectorRegs = 8;  // 16 ymm

struct V16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};
struct Tail {
  __m256i lo, hi;  // all ones in the lanes of the tail
};

inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float a) {
  const __m256 v = _mm256_set1_ps(a);
  return {v, v};
}
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V16 load(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
// One K step of a blocked weight's 16 lanes, in the order the class widens them fastest, and
// accumulators of such lanes stored in lane order. bf16: VPUNPCKLWD / VPUNPCKHWD of the 32
// bytes against zero, two shuffles for 16 lanes (lanes 0-3 and 8-11 in `lo`, 4-7 and 12-15 in
// `hi`), where `load` takes two widening loads and two shifts, the shifts on the FMA ports.
inline V16 load_weights(const float* p) { return load(p); }
inline V16 load_weights(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero16 = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero16, raw)),
          _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero16, raw))};
}
template <typename W>
inline void store_lanes(float* p, V16 a) {
  if constexpr (sizeof(W) == 2) {  // the bf16 order back to lanes 0..15
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(a.lo, a.hi, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(a.lo, a.hi, 0x31));
  } else {
    store(p, a);
  }
}
inline V16 fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
// GCC's _mm512_reduce_add_ps order: the halves added lane by lane, then the 128-bit halves of
// that, then lanes (2, 3) onto (0, 1), then lane 1 onto lane 0
inline float reduce_add(V16 a) {
  const __m256 s8 = _mm256_add_ps(a.hi, a.lo);
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
inline float reduce_max(V16 a) {
  const __m256 s8 = _mm256_max_ps(a.hi, a.lo);
  const __m128 s4 = _mm_max_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
inline V16 round_nearest(V16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// a * 2^k as two power-of-two factors, 2^(k + 64) and 2^-64: for |a| in [1/2, 2) and k in
// [-189, 63] the first product is normal (exact), the second rounds once, subnormal results
// included, as VSCALEFPS rounds
inline __m256 scalef8(__m256 a, __m256 k) {
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127 + 64)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(a, _mm256_castsi256_ps(e)), _mm256_set1_ps(0x1p-64f));
}
inline V16 scalef(V16 a, V16 k) { return {scalef8(a.lo, k.lo), scalef8(a.hi, k.hi)}; }

// as the AVX-512 form, 8 bytes at a time (VCVTPH2PS of F16C widens 8 halves)
inline __m256 fp8_half8(const uint8_t* p) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(
      _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<int16_t>(0xbfff))));
}
inline V16 load_fp8_half(const uint8_t* p) { return {fp8_half8(p), fp8_half8(p + 8)}; }

inline Tail first(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i count = _mm256_set1_epi32(static_cast<int>(n < 16 ? n : 16));
  return {_mm256_cmpgt_epi32(count, lane),
          _mm256_cmpgt_epi32(count, _mm256_add_epi32(lane, _mm256_set1_epi32(8)))};
}
inline V16 load(Tail t, const float* p) {
  return {_mm256_maskload_ps(p, t.lo), _mm256_maskload_ps(p + 8, t.hi)};
}
inline void store(Tail t, float* p, V16 a) {
  _mm256_maskstore_ps(p, t.lo, a.lo), _mm256_maskstore_ps(p + 8, t.hi, a.hi);
}
inline __m256 pick(__m256i m, __m256 yes, __m256 no) {
  return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(m));
}
inline V16 max(Tail t, V16 a, V16 b) {
  return {pick(t.lo, _mm256_max_ps(a.lo, b.lo), a.lo), pick(t.hi, _mm256_max_ps(a.hi, b.hi), a.hi)};
}
inline V16 add(Tail t, V16 a, V16 b) {
  return {pick(t.lo, _mm256_add_ps(a.lo, b.lo), a.lo), pick(t.hi, _mm256_add_ps(a.hi, b.hi), a.hi)};
}
#endif

}  // namespace neffkit_vec
