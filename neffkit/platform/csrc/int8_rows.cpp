// neffkit::int8_rows(x, [codes, ...], [scales, ...]) -> x @ W.T for W8A8 projections
// (compressed-tensors int-quantized, kernels/intquant.py `project_w8a8`): x's rows quantized per
// token to int8, multiplied by int8 weights with integer accumulation, scaled by both scales.
// Several weights reading the same x are one call (their outputs side by side).
//
// x: [R, K] float32 or bfloat16. codes: uint8 [N, K], the bundle's codes (q + 128: kind sym,
// zero 128). scales: float32 [N, 1], one per output channel. Returns [R, sum N] float32.
//
// Each row is quantized exactly as `intquant.quantize_tokens` does it (vLLM's dynamic per-token
// int8): amax = max |x|, scale = amax / 127 (1 where amax is 0), q = x * (127 / amax) (a true
// division) rounded half to even, clamped to +-127; all in float32. The dot products are summed
// in int32 (exact for any K up to kMaxK; the graph's float32 matmul is exact only while
// 127 * 128 * K < 2^24), and vLLM's epilogue is applied in float32: x_scale * (w_scale * acc).
// So the result is `project_w8a8`'s bit for bit wherever that one's sums are exact, and a
// float64/int64 reference's of the same quantization for any K.
//
// The weight codes are read as they are stored (no second layout in the bundle): the unsigned
// operand of VPDPBUSD / TDPBUSD is the code c = q + 128, the signed one the row's int8 values,
// and the row's own sum makes up for the offset: sum(q * x) = sum(c * x) - 128 * sum(x), one
// integer a row per call. Paths (best available unless int8_rows_path asks for a lower one):
// - AMX-INT8 (Intel, where CPUID and Linux grant the tile state; built for AVX-512 only): from
//   kAmxMinRows rows on, 16 weight rows x 64 codes a tile (A, read in place with the row
//   stride) against the rows' int8 values in VNNI layout (B, one per call), C = [16 outputs,
//   16 rows] int32.
// - AVX-512 VNNI (built with -march that has it): VPDPBUSD, 64 codes a step, R x U
//   accumulators in registers, each weight vector loaded once for every row.
// - AVX2 (any build): VPMADDUBSW + VPMADDWD. VPMADDUBSW multiplies u8 by s8 and adds pairs with
//   int16 saturation: c * x pairs reach 2 * 255 * 127 > 32767, so the operands are moved to
//   |q| (u8, 0..128: VPABSB of -128 is 0x80, which is 128 read unsigned) and x * sign(q)
//   (VPSIGNB: within +-127 since x is clamped to +-127), whose pairs reach 2 * 128 * 127 =
//   32512 < 32767: never saturated. VPMADDWD by ones widens the pairs to int32 before they are
//   summed.
// Output rows of all weights are split over torch's intra-op threads in blocks of kBlock.
//
// Measured (Intel Xeon with AMX, 2 shared cores; bench/int8_rows.py, one thread, its CPU time,
// SmolLM2-135M's shapes, 30 layers of weights; bench/results/int8_rows.json): q/k/v (960 x 576)
// 1 row: VNNI 0.029 ms, AVX2 0.030, Inductor's `project_w8a8` (which widens the weight to
// float32 every call) 0.35; 8 rows: AMX 0.042, VNNI 0.059, AVX2 0.11, Inductor 0.37. LM head
// (49152 x 576) 8 rows: AMX 2.3 ms, VNNI 4.4, AVX2 6.3, Inductor 73. VNNI runs at ~100 GMAC/s
// from 8 rows (one VPDPBUSD a cycle), AVX2 at ~42, AMX at 150-400. From 256 rows the AVX2 path
// is 1.1-1.5x slower than Inductor's AVX-512 matmul here; AMX and VNNI stay 2-5x faster.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include "amx.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// sum(c * x) over K stays within int32: 255 * 127 * K < 2^31
constexpr int64_t kMaxK = 66000;
constexpr int64_t kPad = 64;  // the rows' int8 values padded with zeros to whole 64-byte steps
// weight rows a block: every row group passes over one block (in L1/L2) before the next, and
// the unit the outputs are split over threads in
constexpr int64_t kBlock = 64;

enum Path : int { kMadd = 0, kVnni = 1, kAmx = 2 };

// ---- the rows, quantized once per call ----

struct Rows {
  int64_t R, K, Kp;            // Kp: K padded to kPad
  at::Tensor values;           // int8 [R, Kp], zero past K
  std::vector<float> scale;    // per row: amax / 127, or 1
  std::vector<int32_t> sum;    // per row: sum of its int8 values (the code offset's correction)
  const int8_t* data = nullptr;  // values' (a plain pointer: the tiles read it every step)
  const int8_t* row(int64_t r) const { return data + r * Kp; }
};

// intquant.quantize_tokens, one row: every step a single float32 operation, as torch's
template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* scale, int32_t* sum) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  *scale = amax > 0.0f ? amax / 127.0f : 1.0f;
  int32_t total = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(x[k]) * inverse);  // half to even
    const int32_t i = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
    q[k] = static_cast<int8_t>(i);
    total += i;
  }
  *sum = total;
}

Rows quantize(const at::Tensor& x) {
  Rows rows;
  rows.R = x.size(0), rows.K = x.size(1), rows.Kp = (rows.K + kPad - 1) / kPad * kPad;
  rows.values = at::empty({rows.R, rows.Kp}, x.options().dtype(at::kChar));
  rows.scale.resize(rows.R), rows.sum.resize(rows.R);
  int8_t* q = rows.values.data_ptr<int8_t>();
  rows.data = q;
  at::parallel_for(0, rows.R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memset(q + r * rows.Kp + rows.K, 0, rows.Kp - rows.K);
      if (x.scalar_type() == at::kBFloat16)
        quantize_row(x.data_ptr<at::BFloat16>() + r * rows.K, rows.K, q + r * rows.Kp,
                     &rows.scale[r], &rows.sum[r]);
      else
        quantize_row(x.data_ptr<float>() + r * rows.K, rows.K, q + r * rows.Kp, &rows.scale[r],
                     &rows.sum[r]);
    }
  });
  return rows;
}

struct Weight {
  const uint8_t* codes;  // [N, K]
  const float* scale;    // [N]
  int64_t n, start;      // its output rows, its first column in the result
};

// vLLM's cutlass_scaled_mm epilogue, in float32; acc = sum(q * x), exact
inline float scaled(int32_t acc, float x_scale, float w_scale) {
  return x_scale * (w_scale * static_cast<float>(acc));
}

// ---- AVX2: VPMADDUBSW on |q| and x * sign(q) (header comment) ----

inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}

// One K step of madd_tile: 32 codes of each weight row (codes[u]) against 32 values of each row
template <int R, int U>
__attribute__((always_inline)) inline void madd_step(__m256i (&acc)[R][U], const int8_t* x,
                                                     int64_t Kp, const uint8_t* const* codes,
                                                     int64_t k) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256i q[U], a[U];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u) {
    q[u] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[u])), flip);
    a[u] = _mm256_abs_epi8(q[u]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + r * Kp + k));
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      const __m256i pairs = _mm256_maddubs_epi16(a[u], _mm256_sign_epi8(xv, q[u]));
      acc[r][u] = _mm256_add_epi32(acc[r][u], _mm256_madd_epi16(pairs, ones));
    }
  }
}

// sum(q * x) for rows r0..r0+R-1 and weight rows n..n+U-1 (out[r][u]). 16 ymm: R * U
// accumulators, U weight vectors kept as |q| and q, the ones, a row vector and a product.
template <int R, int U>
void madd_tile(const Rows& rows, int64_t r0, const uint8_t* w, int32_t (*out)[4]) {
  const int64_t K = rows.K, Kp = rows.Kp;
  const int8_t* x = rows.row(r0);
  __m256i acc[R][U];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_si256();
  const uint8_t* codes[U];
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) codes[u] = w + u * K + k;
    madd_step<R, U>(acc, x, Kp, codes, k);
  }
  if (k < K) {
    // the tail copied out, padded with code 128 (q = 0; the rows' values are 0 there too), and
    // taken by the same vector step: GCC 12.2 at -O3 -march=native vectorizes a scalar loop
    // summing (c - 128) * x into VPDPBUSD wrongly (it drops the offset)
    alignas(32) uint8_t tail[U][32];
    for (int u = 0; u < U; ++u) {
      std::memset(tail[u], 0x80, 32);
      std::memcpy(tail[u], w + u * K + k, K - k);
      codes[u] = tail[u];
    }
    madd_step<R, U>(acc, x, Kp, codes, k);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) out[r][u] = hsum(acc[r][u]);
}

// rows per pass and weight rows per tile: R * U + 2 * U + 3 <= 16 ymm
constexpr int kMaddRows = 4;
template <int R>
constexpr int madd_width() { return R == 1 ? 4 : 2; }

template <int R>
void madd_rows(const Rows& rows, int64_t r0, const Weight& w, int64_t n0, int64_t n1, float* out,
               int64_t ldo) {
  constexpr int U = madd_width<R>();
  int32_t acc[kMaddRows][4];
  for (int64_t n = n0; n < n1;) {
    const int u = n + U <= n1 ? U : 1;
    if (u == U)
      madd_tile<R, U>(rows, r0, w.codes + n * rows.K, acc);
    else
      madd_tile<R, 1>(rows, r0, w.codes + n * rows.K, acc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < u; ++j)
        out[(r0 + r) * ldo + w.start + n + j] =
            scaled(acc[r][j], rows.scale[r0 + r], w.scale[n + j]);
    n += u;
  }
}

void madd_range(const Rows& rows, const Weight& w, int64_t n0, int64_t n1, float* out,
                int64_t ldo) {
  for (int64_t b0 = n0; b0 < n1; b0 += kBlock) {
    const int64_t b1 = std::min(n1, b0 + kBlock);
    for (int64_t r0 = 0; r0 < rows.R; r0 += kMaddRows) {
      switch (std::min<int64_t>(kMaddRows, rows.R - r0)) {
        case 1: madd_rows<1>(rows, r0, w, b0, b1, out, ldo); break;
        case 2: madd_rows<2>(rows, r0, w, b0, b1, out, ldo); break;
        case 3: madd_rows<3>(rows, r0, w, b0, b1, out, ldo); break;
        default: madd_rows<4>(rows, r0, w, b0, b1, out, ldo); break;
      }
    }
  }
}

#ifdef __AVX512F__
// Lane i: the sum of v[i]'s 16 lanes. A tree of 15 pair merges (45 instructions for 16 sums,
// against ~110 for 16 separate reductions: a VNNI tile of 8 rows does 144 VPDPBUSD at K = 576)
inline __m512i sum16(const __m512i (&v)[16]) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i+1] halved, interleaved
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane sums of v[4i] .. v[4i+3]
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes added in pairs
    c[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88),
                          _mm512_shuffle_i32x4(c[0], c[1], 0xdd));
}

// v[i] lane j -> v[j] lane i (a 16 x 16 int32 transpose in registers)
inline void transpose16(__m512i (&v)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

// ---- AVX-512 VNNI: VPDPBUSD on the codes and the rows' int8 values ----

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasVnni = true;
constexpr int kVnniRows = 8;
// weight rows per tile: R * U accumulators + U weight vectors + a row vector within 32 zmm
template <int R>
constexpr int vnni_width() { return R <= 2 ? 8 : (R <= 4 ? 4 : 2); }

// One K step of vnni_tile: 64 codes of each weight row (past K: masked to 0) against 64 values
// of each row
template <int R, int U>
__attribute__((always_inline)) inline void vnni_step(__m512i (&acc)[R][U], const int8_t* x,
                                                     int64_t Kp, const uint8_t* w, int64_t K,
                                                     int64_t k, __mmask64 mask) {
  __m512i wv[U];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u) wv[u] = _mm512_maskz_loadu_epi8(mask, w + u * K + k);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512i xv = _mm512_load_si512(x + r * Kp + k);
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], wv[u], xv);
  }
}

// sum(c * x) for rows r0..r0+R-1 and weight rows n..n+U-1 (out[r][u])
template <int R, int U>
void vnni_tile(const Rows& rows, int64_t r0, const uint8_t* w, int32_t (*out)[8]) {
  const int64_t K = rows.K, Kp = rows.Kp;
  const int8_t* x = rows.row(r0);
  __m512i acc[R][U];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) vnni_step<R, U>(acc, x, Kp, w, K, k, ~0ULL);
  if (k < K) vnni_step<R, U>(acc, x, Kp, w, K, k, (1ULL << (K - k)) - 1);
  __m512i all[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) all[i] = i < R * U ? acc[i / U][i % U] : _mm512_setzero_si512();
  alignas(64) int32_t sums[16];
  _mm512_store_si512(sums, sum16(all));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) out[r][u] = sums[r * U + u];
}

template <int R>
void vnni_rows(const Rows& rows, int64_t r0, const Weight& w, int64_t n0, int64_t n1, float* out,
               int64_t ldo) {
  constexpr int U = vnni_width<R>();
  int32_t acc[kVnniRows][8];
  for (int64_t n = n0; n < n1;) {
    const int u = n + U <= n1 ? U : 1;
    if (u == U)
      vnni_tile<R, U>(rows, r0, w.codes + n * rows.K, acc);
    else
      vnni_tile<R, 1>(rows, r0, w.codes + n * rows.K, acc);
    for (int r = 0; r < R; ++r) {
      const int32_t offset = 128 * rows.sum[r0 + r];
      for (int j = 0; j < u; ++j)
        out[(r0 + r) * ldo + w.start + n + j] =
            scaled(acc[r][j] - offset, rows.scale[r0 + r], w.scale[n + j]);
    }
    n += u;
  }
}

void vnni_range(const Rows& rows, const Weight& w, int64_t n0, int64_t n1, float* out,
                int64_t ldo) {
  for (int64_t b0 = n0; b0 < n1; b0 += kBlock) {
    const int64_t b1 = std::min(n1, b0 + kBlock);
    for (int64_t r0 = 0; r0 < rows.R; r0 += kVnniRows) {
      switch (std::min<int64_t>(kVnniRows, rows.R - r0)) {
        case 1: vnni_rows<1>(rows, r0, w, b0, b1, out, ldo); break;
        case 2: vnni_rows<2>(rows, r0, w, b0, b1, out, ldo); break;
        case 3: vnni_rows<3>(rows, r0, w, b0, b1, out, ldo); break;
        case 4: vnni_rows<4>(rows, r0, w, b0, b1, out, ldo); break;
        case 5: vnni_rows<5>(rows, r0, w, b0, b1, out, ldo); break;
        case 6: vnni_rows<6>(rows, r0, w, b0, b1, out, ldo); break;
        case 7: vnni_rows<7>(rows, r0, w, b0, b1, out, ldo); break;
        default: vnni_rows<8>(rows, r0, w, b0, b1, out, ldo); break;
      }
    }
  }
}
#else
constexpr bool kHasVnni = false;
void vnni_range(const Rows&, const Weight&, int64_t, int64_t, float*, int64_t) {}
#endif

// ---- AMX-INT8 tiles (Intel; AVX-512 builds) ----

#ifdef __AVX512F__
#define AMX_INT8 __attribute__((target("amx-tile,amx-int8")))
constexpr bool kHasAmxCode = true;
// AMX from 4 rows (one tile of 16 rows holds them all; fewer rows waste most of it): at 3 rows
// VNNI measured faster (69 vs 64 GMAC/s, 49152 x 576), at 4 AMX (84 vs 76)
constexpr int64_t kAmxMinRows = 4;

using neffkit_amx::TileConfig;

// CPUID says AMX-TILE and AMX-INT8, and Linux grants this process the tile state (amx.h)
bool amx_supported() {
  static const bool ok = neffkit_amx::supported(neffkit_amx::kInt8Bit);
  return ok;
}

// The rows' int8 values as TDPBUSD's B operand, per group of 16 rows: [Kp/4][16 rows][4],
// row i of a K chunk's tile holding values 4i..4i+3 of each row (rows past R are zeros)
std::vector<int8_t> vnni_layout(const Rows& rows) {
  const int64_t groups = (rows.R + 15) / 16, quads = rows.Kp / 4;
  std::vector<int8_t> b(groups * quads * 64, 0);
  for (int64_t r = 0; r < rows.R; ++r) {
    const int8_t* x = rows.row(r);
    int8_t* dst = b.data() + (r / 16) * quads * 64 + (r % 16) * 4;
    for (int64_t i = 0; i < quads; ++i) std::memcpy(dst + i * 64, x + 4 * i, 4);
  }
  return b;
}

// Weight rows [n0, n0 + 16 * G) (G <= 4 tiles of 16) for every row group, K a multiple of 64.
// Tiles 0-3 accumulate C (16 weight rows x 16 rows, int32) per weight tile, 4 and 5 alternate
// as A (16 weight rows x 64 codes, read in place: stride K), 6 holds B (the rows' K chunk).
AMX_INT8 void amx_tiles(const Rows& rows, const int8_t* b, const Weight& w, int64_t n0, int G,
                        float* out, int64_t ldo) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t K = rows.K, chunks = K / 64;
  const uint8_t* a = w.codes + n0 * K;
  alignas(64) int32_t c[16][16];
  for (int64_t g = 0; g * 16 < rows.R; ++g) {
    const int8_t* bg = b + g * (rows.Kp / 4) * 64;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < chunks; ++k) {
      _tile_loadd(6, bg + k * 16 * 64, 64);
      const uint8_t* ak = a + k * 64;
      _tile_loadd(4, ak, K);
      _tile_dpbusd(0, 4, 6);
      if (G > 1) {
        _tile_loadd(5, ak + 16 * K, K);
        _tile_dpbusd(1, 5, 6);
      }
      if (G > 2) {
        _tile_loadd(4, ak + 32 * K, K);
        _tile_dpbusd(2, 4, 6);
      }
      if (G > 3) {
        _tile_loadd(5, ak + 48 * K, K);
        _tile_dpbusd(3, 5, 6);
      }
    }
    const int64_t m = std::min<int64_t>(16, rows.R - g * 16);
    for (int t = 0; t < G; ++t) {
      switch (t) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      // C is [16 outputs][16 rows]: transposed, each row's 16 outputs are one vector
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_load_si512(c[i]);
      transpose16(v);
      const int64_t n = n0 + t * 16;
      const __m512 w_scale = _mm512_loadu_ps(w.scale + n);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t r = g * 16 + j;
        const __m512i acc = _mm512_sub_epi32(v[j], _mm512_set1_epi32(128 * rows.sum[r]));
        // scaled(): x_scale * (w_scale * float(acc)), each step one rounding
        const __m512 y = _mm512_mul_ps(w_scale, _mm512_cvtepi32_ps(acc));
        const __m512 x_scale = _mm512_set1_ps(rows.scale[r]);
        _mm512_storeu_ps(out + r * ldo + w.start + n, _mm512_mul_ps(x_scale, y));
      }
    }
  }
  _tile_release();
}
#else
constexpr bool kHasAmxCode = false;
constexpr int64_t kAmxMinRows = 0;
bool amx_supported() { return false; }
std::vector<int8_t> vnni_layout(const Rows&) { return {}; }
void amx_tiles(const Rows&, const int8_t*, const Weight&, int64_t, int, float*, int64_t) {}
#endif

// ---- path choice ----

std::atomic<int> path_wanted{kAmx};  // int8_rows_path: the highest path to take

int best_path() {
  int best = kMadd;
  if (kHasVnni) best = kVnni;
  if (kHasAmxCode && amx_supported()) best = kAmx;
  return std::min(best, path_wanted.load(std::memory_order_relaxed));
}

// Weight rows [n0, n1) of one weight: whole tiles of 16 through AMX, the rest by vectors
void rows_range(int path, const Rows& rows, const int8_t* b, const Weight& w, int64_t n0,
                int64_t n1, float* out, int64_t ldo) {
  if (path == kAmx) {
    while (n0 + 16 <= n1) {
      const int G = static_cast<int>(std::min<int64_t>(4, (n1 - n0) / 16));
      amx_tiles(rows, b, w, n0, G, out, ldo);
      n0 += 16 * G;
    }
    path = kHasVnni ? kVnni : kMadd;
  }
  if (n0 >= n1) return;
  if (path == kVnni)
    vnni_range(rows, w, n0, n1, out, ldo);
  else
    madd_range(rows, w, n0, n1, out, ldo);
}

at::Tensor int8_rows(const at::Tensor& x_in, at::TensorList codes, at::TensorList scales) {
  TORCH_CHECK(x_in.dim() == 2, "int8_rows: expects x [R, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "int8_rows: x must be float32 or bfloat16");
  const int64_t K = x_in.size(1);
  TORCH_CHECK(K >= 1 && K <= kMaxK, "int8_rows: K must be 1 to ", kMaxK);
  TORCH_CHECK(!codes.empty() && scales.size() == codes.size(), "int8_rows: a scale a weight");
  std::vector<at::Tensor> keep;  // contiguous copies (none for graph inputs) live to the end
  std::vector<Weight> ws;
  int64_t total = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor c = codes[i].contiguous(), s = scales[i].contiguous();
    TORCH_CHECK(c.dim() == 2 && c.size(1) == K && c.scalar_type() == at::kByte,
                "int8_rows: codes must be uint8 [N, K]");
    TORCH_CHECK(s.numel() == c.size(0) && s.scalar_type() == at::kFloat,
                "int8_rows: scales must be float32 [N, 1]");
    keep.push_back(c), keep.push_back(s);
    ws.push_back({c.data_ptr<uint8_t>(), s.data_ptr<float>(), c.size(0), total});
    total += c.size(0);
  }
  const Rows rows = quantize(x_in.contiguous());
  int path = best_path();
  if (path == kAmx && (rows.R < kAmxMinRows || K % 64)) path = kHasVnni ? kVnni : kMadd;
  const std::vector<int8_t> b = path == kAmx ? vnni_layout(rows) : std::vector<int8_t>();
  at::Tensor out = at::empty({rows.R, total}, x_in.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  // output rows of all weights as one range, split over threads in whole blocks
  at::parallel_for(0, (total + kBlock - 1) / kBlock, 1, [&](int64_t t0, int64_t t1) {
    const int64_t m0 = t0 * kBlock, m1 = std::min(total, t1 * kBlock);
    for (const Weight& w : ws) {
      const int64_t lo = std::max(m0, w.start), hi = std::min(m1, w.start + w.n);
      if (lo < hi) rows_range(path, rows, b.data(), w, lo - w.start, hi - w.start, o, total);
    }
  });
  return out;
}

// The path int8_rows takes from kAmxMinRows rows on (2 AMX, 1 VNNI, 0 AVX2), after asking for
// at most `want` (-1: the best this build and CPU have). For the tests and the benchmark.
int64_t int8_rows_path(int64_t want) {
  path_wanted.store(want < 0 ? kAmx : static_cast<int>(std::min<int64_t>(want, kAmx)));
  return best_path();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neffkit, m) {
  m.def("int8_rows(Tensor x, Tensor[] codes, Tensor[] scales) -> Tensor");
  m.def("int8_rows_path(int want) -> int", &int8_rows_path);
}

TORCH_LIBRARY_IMPL(neffkit, CPU, m) { m.impl("int8_rows", &int8_rows); }
