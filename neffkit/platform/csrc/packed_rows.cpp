// neffkit::packed_rows(x, [codes, ...], [scales, ...], [aux, ...], base, mode) -> x @ W.T for the
// few rows of a decode step, W's integer codes read where they lie (kernels/intquant.py's
// layout): 4-bit codes [N, K/2] uint8, element 2i in the low nibble, or 8-bit codes [N, K], one
// a byte; float32 scales [N, K/G], one per group of G inputs. Several weights reading the same x
// are one call (their outputs side by side). Returns [R, sum N] float32.
//
// A weight value is the scheme's float32 formula on its code, as `intquant.dequantize` writes
// it, every operation rounded as torch rounds it (never contracted into an FMA), so it is
// exactly the float twin's value. `base` (16 values: 4-bit; 256: 8-bit) holds the value a
// code's formula starts from, base[code]:
//   mode 0  base[code] * scale             (sym: base[c] = c - zero; e2m1: the fp4 value)
//   mode 1  (base[code] - aux[g]) * scale  (zero points; base[c] = c)
//   mode 2  base[code] * scale + aux[g]    (an additive minimum; base[c] = c)
// 4-bit: only the 16 values a group can take are computed, once a group, into a 16-lane table;
// each code then selects its value (AVX-512: VPERMPS, one instruction for 16 codes). Inductor's
// fused reduction widens every code on its own (convert, subtract, multiply: SmolLM2 int4
// decode compute-bound on 2 cores). 8-bit: each byte is widened and the formula applied to it
// (a group's 256 values would cost more than its 32 to 128 weights), one byte a weight streamed.
// Products are accumulated with FMA in float32 (a reduction's order and rounding, as any float32
// sum). Output rows are split over torch's intra-op threads.
//
// Two CPU classes (platform/isa.py), one kernel written over a 16-lane tile: one zmm on
// AVX-512; two ymm on AVX2, in one pass over a row's codes or, where the accumulators of more
// rows would not fit in 16 ymm, in two (lanes 0-7, then 8-15, the codes still in L1). Every
// lane sums the same products in the same order and the lanes are summed in
// _mm512_reduce_add_ps's order, so both classes give the same bits. AVX2's 16-value table is
// two ymm: two VPERMPS (8 entries each) blended on code bit 3.
//
// Groups of a multiple of 32 inputs (16 bytes of 4-bit codes: one vector load never straddles
// a group), K a multiple of 32 (projection.py takes the kernel only then).
//
// Measured on the Intel host (AVX-512, one 512-bit FMA unit; 1 thread's CPU time a call, the
// variants alternating, medians; SmolLM2-135M's shapes, 10 layers' weights; GB/s of codes and
// scales streamed), 1 row / 8 rows:
//   int4 g32  AVX-512: q/k/v 46 / 141 us, head 1.76 / 8.3 ms (10.1 / 2.1 GB/s); Inductor's
//             form: the head 2.0 / 6.2x. AVX2: 2.0-2.3x / 1.6-2.2x AVX-512's time (VPERMPS: 8
//             codes, not 16); Inductor's form built for the class 6.3-6.7x / 2.4-6.7x AVX2's.
//   int8 g0   AVX-512: q/k/v 53 / 130 us, head 2.0 / 7.7 ms (14.2 / 3.7 GB/s); Inductor's form
//             1.3-1.45x / 1.0-1.65x. AVX2: 1.4-1.5x / 1.3-1.8x AVX-512's time; Inductor's form
//             for the class 6.5-14x / 3.3-5.5x AVX2's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxRows = 8;

// ---- the vector the kernel is written over: kLanes float32 lanes, kVecs of them a tile ----
#ifdef __AVX512F__
constexpr int kLanes = 16;
using Vec = __m512;
using VecI = __m512i;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
// one rounding each, as written (explicit rounding: never contracted)
inline Vec mul_r(Vec a, Vec b) { return _mm512_mul_round_ps(a, b, kRound); }
inline Vec sub_r(Vec a, Vec b) { return _mm512_sub_round_ps(a, b, kRound); }
inline Vec add_r(Vec a, Vec b) { return _mm512_add_round_ps(a, b, kRound); }
// kLanes code bytes, one a lane
inline VecI widen(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VecI high_nibble(VecI c) { return _mm512_srli_epi32(c, 4); }
inline Vec to_float(VecI c) { return _mm512_cvtepi32_ps(c); }
// 2^23 + c for 0 <= c < 2^23: c's bits under 2^23's exponent
inline Vec with_exponent(VecI c) {
  return _mm512_castsi512_ps(_mm512_or_si512(c, _mm512_set1_epi32(0x4B000000)));
}
struct Table {  // the 16 values of a 4-bit group, by code
  Vec v[1];
};
// VPERMPS reads an index's low 4 bits: the low nibble needs no mask
inline Vec lookup(const Table& t, VecI c) { return _mm512_permutexvar_ps(c, t.v[0]); }
inline float reduce(const Vec* s) { return _mm512_reduce_add_ps(s[0]); }
#else
constexpr int kLanes = 8;
using Vec = __m256;
using VecI = __m256i;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
// GCC writes _mm256_mul_ps as a vector `*`, which it may contract with an add into an FMA (AVX2
// has no explicit-rounding forms): the empty asm makes each result a value the compiler cannot
// see through (no instruction)
inline Vec opaque(Vec v) {
  asm("" : "+x"(v));
  return v;
}
inline Vec mul_r(Vec a, Vec b) { return opaque(_mm256_mul_ps(a, b)); }
inline Vec sub_r(Vec a, Vec b) { return opaque(_mm256_sub_ps(a, b)); }
inline Vec add_r(Vec a, Vec b) { return opaque(_mm256_add_ps(a, b)); }
inline VecI widen(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline VecI high_nibble(VecI c) { return _mm256_srli_epi32(c, 4); }
inline Vec to_float(VecI c) { return _mm256_cvtepi32_ps(c); }
inline Vec with_exponent(VecI c) {
  return _mm256_castsi256_ps(_mm256_or_si256(c, _mm256_set1_epi32(0x4B000000)));
}
struct Table {  // values 0-7 and 8-15
  Vec v[2];
};
// VPERMPS reads an index's low 3 bits; bit 3 (shifted to the sign) picks the table half
inline Vec lookup(const Table& t, VecI c) {
  const Vec lo = _mm256_permutevar8x32_ps(t.v[0], c);
  const Vec hi = _mm256_permutevar8x32_ps(t.v[1], c);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}
// a tile's sums (lanes 0-7, 8-15) in _mm512_reduce_add_ps's order
inline float reduce(const Vec* s) {
  const Vec t = _mm256_add_ps(s[1], s[0]);
  const __m128 h = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 q = _mm_add_ps(h, _mm_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, 1));
}
#endif
constexpr int kVecs = 16 / kLanes;
#ifdef __AVX512F__
// 8-bit codes prefetched this far ahead (bytes) into L1: 1 row, SmolLM2's MLP and head 14%
// faster (10.9 -> 12.7 GB/s), 8 rows 5%, 2048 or 8192 no better. None on AVX2, whose FP ports
// bind first (an extra instruction: 10 to 20% slower), nor for 4-bit codes (no faster).
constexpr int kBytesPrefetch = 4096;
#else
constexpr int kBytesPrefetch = 0;
#endif
constexpr float kTwo23 = 8388608.0f;

struct Weight {
  const uint8_t* codes;  // [N, K/2] (4-bit) or [N, K] (8-bit)
  const float* scale;    // [N, K/G]
  const float* aux;      // [N, K/G] or nullptr
  int64_t rows, groups, start;
};

// A 32-input chunk of a row's codes gives two value vectors for its lanes q*kLanes .., `a` and
// `b`, multiplied by the rows' inputs xa and xb at the same offset (each [R, K/2], laid out by
// `split_rows`).

// 4-bit: 16 bytes a chunk; a: the low nibbles (even inputs), b: the high ones (odd inputs).
struct Nibbles {
  static constexpr int kChunkBytes = 16;
  static constexpr int kPrefetch = 0;
  Table base;
  int mode;
  using Group = Table;
  // the 16 values a group's codes stand for, rounded as torch's float32 ops round them
  Group group(const Weight& w, int64_t n, int64_t g) const {
    const Vec s = vset(w.scale[n * w.groups + g]);
    Table t;
    for (int i = 0; i < kVecs; ++i) {
      if (mode == 1) {
        t.v[i] = mul_r(sub_r(base.v[i], vset(w.aux[n * w.groups + g])), s);
      } else {
        t.v[i] = mul_r(base.v[i], s);
        if (mode == 2) t.v[i] = add_r(t.v[i], vset(w.aux[n * w.groups + g]));
      }
    }
    return t;
  }
  void values(const Group& t, const uint8_t* chunk, int q, Vec& a, Vec& b) const {
    const VecI c = widen(chunk + q * kLanes);
    a = lookup(t, c);
    b = lookup(t, high_nibble(c));
  }
};

// 8-bit: 32 bytes a chunk; a: bytes 0-15, b: bytes 16-31. Mode 0's zero is an integer (the
// base check): (code - zero) * s, where code - zero is the exact difference of 2^23 + code (the
// code's bits under 2^23's exponent: an OR, no conversion) and 2^23 + zero: one FP op where a
// conversion and a subtraction were two (a few rows' step is bound by the FP ports: the Intel
// host has one 512-bit FMA unit, zmm FMAs at half ymm's rate; up to 12% faster).
template <int Mode>
struct Bytes {
  static constexpr int kChunkBytes = 32;
  static constexpr int kPrefetch = kBytesPrefetch;
  float zero;  // mode 0: 2^23 + zero
  struct Group {
    Vec s, z;
  };
  Group group(const Weight& w, int64_t n, int64_t g) const {
    const int64_t i = n * w.groups + g;
    return {vset(w.scale[i]), vset(Mode == 0 ? zero : w.aux[i])};
  }
  static Vec value(const Group& gr, VecI c) {
    if (Mode == 0) return mul_r(sub_r(with_exponent(c), gr.z), gr.s);
    if (Mode == 1) return mul_r(sub_r(to_float(c), gr.z), gr.s);
    return add_r(mul_r(to_float(c), gr.s), gr.z);
  }
  void values(const Group& gr, const uint8_t* chunk, int q, Vec& a, Vec& b) const {
    a = value(gr, widen(chunk + q * kLanes));
    b = value(gr, widen(chunk + 16 + q * kLanes));
  }
};

// Output rows n .. n+U-1 of one weight for rows x of xa/xb ([R, K/2] each, `half` = K/2 a
// row), the 16-lane tile in P passes over the codes. U output rows side by side keep 2*R*U
// accumulation chains in flight (AVX-512: one output's two chains alone wait on the FMA
// latency).
template <class Codes, int R, int U, int P>
void outputs(const Codes& codes, const float* xa, const float* xb, int64_t half, const Weight& w,
             int64_t n, float* out, int64_t out_stride) {
  constexpr int NV = kVecs / P;  // vectors a pass
  constexpr int64_t per_input = Codes::kChunkBytes / 16;  // code bytes a (j) offset
  const int64_t row_bytes = half * per_input;
  const int64_t per_group = half / w.groups;  // a multiple of 16
  Vec sums[U][R][kVecs];
  for (int p = 0; p < P; ++p) {
    Vec a_sum[U][R][NV], b_sum[U][R][NV];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) a_sum[u][r][v] = b_sum[u][r][v] = vzero();
    for (int64_t g = 0; g < w.groups; ++g) {
      typename Codes::Group group[U];
      for (int u = 0; u < U; ++u) group[u] = codes.group(w, n + u, g);
      for (int64_t j = g * per_group; j < (g + 1) * per_group; j += 16) {
        for (int u = 0; u < U; ++u) {
          const uint8_t* chunk = w.codes + (n + u) * row_bytes + j * per_input;
          if constexpr (Codes::kPrefetch > 0)
            _mm_prefetch(reinterpret_cast<const char*>(chunk) + Codes::kPrefetch, _MM_HINT_T0);
          for (int v = 0; v < NV; ++v) {
            const int q = p * NV + v;
            Vec a, b;
            codes.values(group[u], chunk, q, a, b);
            const int64_t at = j + q * kLanes;
            for (int r = 0; r < R; ++r) {
              a_sum[u][r][v] = vfma(vload(xa + r * half + at), a, a_sum[u][r][v]);
              b_sum[u][r][v] = vfma(vload(xb + r * half + at), b, b_sum[u][r][v]);
            }
          }
        }
      }
    }
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) sums[u][r][p * NV + v] = vadd(a_sum[u][r][v], b_sum[u][r][v]);
  }
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) out[r * out_stride + w.start + n + u] = reduce(sums[u][r]);
}

// Tiles, per class: rows a pass over a weight row's codes (RT), output rows side by side (U)
// and passes over the codes (P), so that the accumulators (2 * RT * U tiles), a group's table or
// scales and a few temporaries stay in 32 zmm or 16 ymm. AVX2 (measured as above):
// one output row at a time (2 side by side: no faster, 1 to 10% slower), one pass up to 3 rows
// (2 passes: 10 to 15% slower at 3 rows, 4-bit), then 2 passes; up to 6 rows a pass (more
// spills: 8 rows 10 to 20% slower than 4 + 4; 4 + 4 re-reads the codes: 6 rows 20% slower than
// 6 at once, 8-bit).
#ifdef __AVX512F__
constexpr int row_tile(int rows) { return rows; }
constexpr int units(int rows) { return rows == 1 ? 4 : (rows <= 3 ? 2 : 1); }
constexpr int passes(int) { return 1; }
#else
constexpr int kRowTile = 6;
// rows split into the fewest tiles of at most kRowTile rows, as even as can be: the first
constexpr int row_tile(int rows) {
  const int tiles = (rows + kRowTile - 1) / kRowTile;
  return (rows + tiles - 1) / tiles;
}
constexpr int units(int) { return 1; }
constexpr int passes(int rows) { return rows <= 3 ? 1 : 2; }
#endif

// Output rows n .. n+U-1 for all R rows, RT rows a pass over the codes (the codes of U output
// rows stay in L1 for the next tile of rows).
template <class Codes, int R, int U>
void row_tiles(const Codes& codes, const float* xa, const float* xb, int64_t half,
               const Weight& w, int64_t n, float* out, int64_t out_stride) {
  constexpr int RT = row_tile(R);
  outputs<Codes, RT, U, passes(RT)>(codes, xa, xb, half, w, n, out, out_stride);
  if constexpr (RT < R)
    row_tiles<Codes, R - RT, U>(codes, xa + RT * half, xb + RT * half, half, w, n,
                                out + RT * out_stride, out_stride);
}

template <class Codes, int R>
void run(const Codes& codes, const float* xa, const float* xb, int64_t half,
         const std::vector<Weight>& ws, int64_t total, float* out) {
  constexpr int U = units(row_tile(R));
  // output rows of all weights as one range, split over threads
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    int64_t m = begin;
    while (m < end) {
      while (m >= ws[i].start + ws[i].rows) ++i;
      const Weight& w = ws[i];
      const int64_t n = m - w.start;
      if (n + U <= w.rows && m + U <= end) {
        row_tiles<Codes, R, U>(codes, xa, xb, half, w, n, out, total);
        m += U;
      } else {
        row_tiles<Codes, R, 1>(codes, xa, xb, half, w, n, out, total);
        m += 1;
      }
    }
  });
}

template <class Codes>
void run_rows(const Codes& codes, int64_t R, const float* xa, const float* xb, int64_t half,
              const std::vector<Weight>& ws, int64_t total, float* out) {
  switch (R) {
    case 1: run<Codes, 1>(codes, xa, xb, half, ws, total, out); break;
    case 2: run<Codes, 2>(codes, xa, xb, half, ws, total, out); break;
    case 3: run<Codes, 3>(codes, xa, xb, half, ws, total, out); break;
    case 4: run<Codes, 4>(codes, xa, xb, half, ws, total, out); break;
    case 5: run<Codes, 5>(codes, xa, xb, half, ws, total, out); break;
    case 6: run<Codes, 6>(codes, xa, xb, half, ws, total, out); break;
    case 7: run<Codes, 7>(codes, xa, xb, half, ws, total, out); break;
    default: run<Codes, 8>(codes, xa, xb, half, ws, total, out); break;
  }
}

// x [R, K] as the a and b inputs of each 32-input chunk ([R, K/2] each): 4-bit, the even and
// odd inputs; 8-bit, each chunk's first and last 16.
void split_rows(const float* x, int64_t R, int64_t K, bool bytes, float* xa, float* xb) {
  const int64_t half = K / 2;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < half; ++j) {
      const int64_t i = bytes ? j / 16 * 32 + j % 16 : 2 * j;
      const int64_t o = bytes ? 16 : 1;
      xa[r * half + j] = x[r * K + i];
      xb[r * half + j] = x[r * K + i + o];
    }
}

at::Tensor packed_rows(const at::Tensor& x_in, at::TensorList codes, at::TensorList scales,
                       at::TensorList aux, const at::Tensor& base_in, int64_t mode) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "packed_rows: expects float32 x [R, K]");
  const int64_t R = x_in.size(0), K = x_in.size(1), half = K / 2;
  TORCH_CHECK(R >= 1 && R <= kMaxRows, "packed_rows: 1 to 8 rows");
  TORCH_CHECK(K % 32 == 0, "packed_rows: K must be a multiple of 32");
  TORCH_CHECK(!codes.empty() && scales.size() == codes.size(), "packed_rows: a scale a weight");
  // aux: one tensor a weight, read in modes 1 and 2 only (mode 0 passes any: AOTInductor's
  // proxy executor hands an empty tensor list on as None)
  TORCH_CHECK(mode >= 0 && mode <= 2, "packed_rows: mode must be 0, 1 or 2");
  TORCH_CHECK(aux.size() == codes.size(), "packed_rows: an aux tensor a weight");
  const at::Tensor base_c = base_in.contiguous();
  TORCH_CHECK((base_c.numel() == 16 || base_c.numel() == 256) && base_c.scalar_type() == at::kFloat,
              "packed_rows: base must be 16 (4-bit) or 256 (8-bit) float32 values");
  const bool bytes = base_c.numel() == 256;
  const float* base = base_c.data_ptr<float>();
  if (bytes) {
    // the kernel computes code - zero itself: base[c] = c - zero, zero an integer (mode 0)
    const float offset = base[0];
    bool ok = offset == static_cast<int>(offset) && offset <= 0 && offset >= -255;
    ok = ok && (mode == 0 || offset == 0);
    for (int c = 0; c < 256; ++c) ok = ok && base[c] == static_cast<float>(c) + offset;
    TORCH_CHECK(ok, "packed_rows: 8-bit base must be code - zero (zero 0 to 255; 0 in modes 1, 2)");
  }
  const int64_t width = bytes ? K : half;
  std::vector<at::Tensor> keep;  // contiguous copies (none for graph inputs) live to the end
  std::vector<Weight> ws;
  int64_t total = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor c = codes[i].contiguous(), s = scales[i].contiguous();
    TORCH_CHECK(c.dim() == 2 && c.size(1) == width && c.scalar_type() == at::kByte,
                "packed_rows: codes must be uint8 [N, K/2] (4-bit) or [N, K] (8-bit)");
    TORCH_CHECK(s.dim() == 2 && s.size(0) == c.size(0) && s.scalar_type() == at::kFloat &&
                    s.size(1) > 0 && half % s.size(1) == 0 && (half / s.size(1)) % 16 == 0,
                "packed_rows: scales must be float32 [N, K/G], G a multiple of 32");
    keep.push_back(c);
    keep.push_back(s);
    const float* a = nullptr;
    if (mode != 0) {
      const at::Tensor t = aux[i].contiguous();
      TORCH_CHECK(t.sizes() == s.sizes() && t.scalar_type() == at::kFloat,
                  "packed_rows: aux must be float32, shaped as the scales");
      keep.push_back(t);
      a = t.data_ptr<float>();
    }
    ws.push_back({c.data_ptr<uint8_t>(), s.data_ptr<float>(), a, c.size(0), s.size(1), total});
    total += c.size(0);
  }
  const at::Tensor x = x_in.contiguous();
  std::vector<float> xa(R * half), xb(R * half);
  split_rows(x.data_ptr<float>(), R, K, bytes, xa.data(), xb.data());
  at::Tensor out = at::empty({R, total}, x_in.options());
  float* o = out.data_ptr<float>();
  if (!bytes) {
    Nibbles nibbles{{}, static_cast<int>(mode)};
    for (int i = 0; i < kVecs; ++i) nibbles.base.v[i] = vload(base + i * kLanes);
    run_rows(nibbles, R, xa.data(), xb.data(), half, ws, total, o);
  } else if (mode == 2) {
    run_rows(Bytes<2>{}, R, xa.data(), xb.data(), half, ws, total, o);
  } else if (mode == 1) {
    run_rows(Bytes<1>{}, R, xa.data(), xb.data(), half, ws, total, o);
  } else {
    run_rows(Bytes<0>{kTwo23 - base[0]}, R, xa.data(), xb.data(), half, ws, total, o);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neffkit, m) {
  m.def(
      "packed_rows(Tensor x, Tensor[] codes, Tensor[] scales, Tensor[] aux, Tensor base, "
      "int mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(neffkit, CPU, m) { m.impl("packed_rows", &packed_rows); }
