// neffkit::packed_rows(x, [codes, ...], [scales, ...], [aux, ...], base, mode) -> x @ W.T for the
// few rows of a decode step, W 4-bit codes read where they lie (kernels/intquant.py's layout:
// codes [N, K/2] uint8, element 2i in the low nibble; float32 scales [N, K/G], one per group of
// G inputs). Several weights reading the same x are one call (their outputs side by side).
// Returns [R, sum N] float32.
//
// A weight value is the scheme's float32 formula on its code, as `intquant.dequantize` writes
// it, every operation rounded as torch rounds it (explicit-rounding intrinsics: no contraction
// into an FMA), so it is exactly the float twin's value:
//   mode 0  base[code] * scale             (sym: base[c] = c - zero; e2m1: the fp4 value)
//   mode 1  (base[code] - aux[g]) * scale  (zero points; base[c] = c)
//   mode 2  base[code] * scale + aux[g]    (an additive minimum; base[c] = c)
// Only the 16 values a group can take are computed, once a group, into one register; each code
// then selects its value with VPERMPS (one instruction for 16 codes). Inductor's fused reduction
// widens every code on its own (convert, subtract, multiply: SmolLM2 int4 decode compute-bound
// on 2 cores). Products are accumulated with FMA in float32 (a reduction's order and rounding,
// as any float32 sum). Output rows are split over torch's intra-op threads.
//
// Needs AVX-512F; groups of a multiple of 32 inputs (16 bytes of codes: one vector load), K a
// multiple of 32 (projection.py takes the kernel only then).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxRows = 8;  // 2 accumulators a row: 16 of 32 zmm
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

struct Weight {
  const uint8_t* codes;  // [N, K/2]
  const float* scale;    // [N, K/G]
  const float* aux;      // [N, K/G] or nullptr
  int64_t rows, groups, start;
};

// The 16 values a group's codes stand for, rounded as torch's float32 ops round them.
inline __m512 group_values(__m512 base, const Weight& w, int64_t n, int64_t g, int mode) {
  const __m512 s = _mm512_set1_ps(w.scale[n * w.groups + g]);
  if (mode == 1) {
    const __m512 z = _mm512_set1_ps(w.aux[n * w.groups + g]);
    return _mm512_mul_round_ps(_mm512_sub_round_ps(base, z, kRound), s, kRound);
  }
  const __m512 v = _mm512_mul_round_ps(base, s, kRound);
  if (mode == 2) return _mm512_add_round_ps(v, _mm512_set1_ps(w.aux[n * w.groups + g]), kRound);
  return v;
}

// Output rows n .. n+U-1 of one weight for R rows: xe/xo are the rows' even and odd inputs
// [R, K/2]. U rows side by side keep 2*R*U accumulation chains in flight (one row's two chains
// alone wait on the FMA latency).
template <int R, int U>
void outputs(const float* xe, const float* xo, int64_t half, const Weight& w, int64_t n,
             __m512 base, int mode, float* out, int64_t out_stride) {
  __m512 even[U][R], odd[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) even[u][r] = odd[u][r] = _mm512_setzero_ps();
  const int64_t per_group = half / w.groups;  // bytes a group: a multiple of 16
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 values[U];
    for (int u = 0; u < U; ++u) values[u] = group_values(base, w, n + u, g, mode);
    for (int64_t j = g * per_group; j < (g + 1) * per_group; j += 16) {
      for (int u = 0; u < U; ++u) {
        const uint8_t* codes = w.codes + (n + u) * half + j;
        const __m512i c =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
        // VPERMPS reads an index's low 4 bits: the low nibble needs no mask
        const __m512 lo = _mm512_permutexvar_ps(c, values[u]);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), values[u]);
        for (int r = 0; r < R; ++r) {
          even[u][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xe + r * half + j), lo, even[u][r]);
          odd[u][r] = _mm512_fmadd_ps(_mm512_loadu_ps(xo + r * half + j), hi, odd[u][r]);
        }
      }
    }
  }
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      out[r * out_stride + w.start + n + u] =
          _mm512_reduce_add_ps(_mm512_add_ps(even[u][r], odd[u][r]));
}

template <int R>
void run(const float* xe, const float* xo, int64_t half, const std::vector<Weight>& ws,
         int64_t total, __m512 base, int mode, float* out) {
  constexpr int U = R == 1 ? 4 : (R <= 3 ? 2 : 1);
  // output rows of all weights as one range, split over threads
  at::parallel_for(0, total, 16, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    int64_t m = begin;
    while (m < end) {
      while (m >= ws[i].start + ws[i].rows) ++i;
      const Weight& w = ws[i];
      const int64_t n = m - w.start;
      if (n + U <= w.rows && m + U <= end) {
        outputs<R, U>(xe, xo, half, w, n, base, mode, out, total);
        m += U;
      } else {
        outputs<R, 1>(xe, xo, half, w, n, base, mode, out, total);
        m += 1;
      }
    }
  });
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
  TORCH_CHECK(base_in.numel() == 16 && base_in.scalar_type() == at::kFloat,
              "packed_rows: base must be 16 float32 values");
  std::vector<at::Tensor> keep;  // contiguous copies (none for graph inputs) live to the end
  std::vector<Weight> ws;
  int64_t total = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor c = codes[i].contiguous(), s = scales[i].contiguous();
    TORCH_CHECK(c.dim() == 2 && c.size(1) == half && c.scalar_type() == at::kByte,
                "packed_rows: codes must be uint8 [N, K/2]");
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
  // the rows' even and odd inputs, each contiguous [R, K/2]
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  std::vector<float> xe(R * half), xo(R * half);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < half; ++j) {
      xe[r * half + j] = xp[r * K + 2 * j];
      xo[r * half + j] = xp[r * K + 2 * j + 1];
    }
  const __m512 base = _mm512_loadu_ps(base_in.contiguous().data_ptr<float>());
  at::Tensor out = at::empty({R, total}, x_in.options());
  float* o = out.data_ptr<float>();
  const int m = static_cast<int>(mode);
  switch (R) {
    case 1: run<1>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    case 2: run<2>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    case 3: run<3>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    case 4: run<4>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    case 5: run<5>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    case 6: run<6>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    case 7: run<7>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
    default: run<8>(xe.data(), xo.data(), half, ws, total, base, m, o); break;
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
