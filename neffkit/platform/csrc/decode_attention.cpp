// neffkit::paged_decode_attention: one query token a row against its visible keys, read straight
// from the paged K/V cache.
//
// q: [B, H, D]; k_cache: [NB, BS, KV, D] and v_cache [NB, BS, KV, Dv] of q's dtype (float32 or
// bfloat16); block_tables: [B, MB] int64; lo, hi: [B] int64, the visible keys lo..hi of each
// row (a padding row has hi < lo and gets zeros); sinks: [H] or empty (GPT-OSS: exp(sink) joins
// each head's softmax denominator); softcap > 0: scores become softcap * tanh(scores / softcap)
// (Gemma 2). Returns [B, H * Dv] in q's dtype; query head h reads KV head h / (H / KV).
//
// Why a kernel: the graph's form gathers every row's whole context bucket (C slots through the
// block table), scores all C keys and masks the ones past the row's length. A decode row of 52
// tokens in a 256-slot bucket reads and scores five times the keys it needs, for every layer;
// on SmolLM2 at 8 rows that was a fifth of the step. Here each (row, KV head) pair walks only
// its visible keys, scores the group's queries against each key once it is loaded, and takes
// the softmax and the value sum in float32. Pairs are split over torch's intra-op threads.
// Written over vec16.h's 16-lane vector: one zmm, or two ymm on the AVX2 class, which gives the
// same bits (the same FMAs, sums in the same order, exp's 2^k as two exact factors).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "vec16.h"

namespace {

using namespace neffkit_vec;

constexpr int64_t kLanes = 16;

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void store(float* out, float v) { *out = v; }
inline void store(uint16_t* out, float v) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) {
    *out = uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *out = uint16_t(bits >> 16);
}

// q (float32, n values) · key (n values of T)
template <typename T>
inline float dot(const float* q, const T* key, int64_t n) {
  V16 acc = zero();
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) acc = fmadd(load(q + d), load(key + d), acc);
  float sum = reduce_add(acc);
  // std::fma, not `sum += a * b`: whether the compiler contracts that differs between the
  // native and class builds (the class's tails must equal the native ones bit for bit)
  for (; d < n; ++d) sum = std::fma(q[d], to_float(key[d]), sum);
  return sum;
}

// exp(x) for 16 lanes, x <= 0 (scores less their maximum): 2^(x log2 e) split into 2^k 2^f,
// |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative error below 1e-7), 2^k by scalef
// (which underflows to 0 cleanly; k >= -150 here).
inline V16 exp16(V16 x) {
  const V16 t = mul(max(x, set1(-104.0f)), set1(1.44269504f));
  const V16 k = round_nearest(t);
  const V16 f = sub(t, k);
  V16 p = set1(1.525273e-5f);
  for (float c : {1.540353e-4f, 1.333355e-3f, 9.618129e-3f, 5.550411e-2f, 2.402265e-1f,
                  6.931472e-1f, 1.0f}) {
    p = fmadd(p, f, set1(c));
  }
  return scalef(p, k);
}

// The n scores of one head (in place) as softmax probabilities, float32; `sink` joins the
// denominator (-inf: none).
inline void softmax(float* scores, int64_t n, float sink) {
  V16 top = set1(sink);
  for (int64_t j = 0; j < n; j += kLanes) {
    const Tail m = first(n - j);
    top = max(m, top, load(m, scores + j));
  }
  const float most = reduce_max(top);
  const V16 shift = set1(most);
  V16 total = zero();
  for (int64_t j = 0; j < n; j += kLanes) {
    const Tail m = first(n - j);
    const V16 e = exp16(sub(load(m, scores + j), shift));
    store(m, scores + j, e);
    total = add(m, total, e);
  }
  float sum = reduce_add(total) + (std::isinf(sink) ? 0.0f : std::exp(sink - most));
  const V16 inv = set1(1.0f / sum);
  for (int64_t j = 0; j < n; j += kLanes) {
    const Tail m = first(n - j);
    store(m, scores + j, mul(load(m, scores + j), inv));
  }
}

// out[d] = sum_j probs[j] * value_j[d] for one head, the 16-lane columns kept in registers
// across the keys (two accumulators each, for the FMA latency).
template <typename T>
inline void weighted_sum(const float* probs, const T* vc, const int64_t* rows, int64_t n,
                         int64_t Dv, float* out) {
  int64_t d = 0;
  for (; d + kLanes <= Dv; d += kLanes) {
    V16 a0 = zero(), a1 = zero();
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
      a0 = fmadd(set1(probs[j]), load(vc + rows[j] * Dv + d), a0);
      a1 = fmadd(set1(probs[j + 1]), load(vc + rows[j + 1] * Dv + d), a1);
    }
    if (j < n) a0 = fmadd(set1(probs[j]), load(vc + rows[j] * Dv + d), a0);
    store(out + d, add(a0, a1));
  }
  for (; d < Dv; ++d) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      sum = std::fma(probs[j], to_float(vc[rows[j] * Dv + d]), sum);
    }
    out[d] = sum;
  }
}

struct Shape {
  int64_t B, H, D, Dv, NB, BS, KV, MB;
};

// Scratch of one thread: the key rows, the group's scaled queries, scores and output.
struct Work {
  std::vector<int64_t> rows;
  std::vector<float> values;
};

// One (row, KV head) pair: its G query heads against keys lo..hi.
template <typename T>
void attend(const Shape& s, int64_t b, int64_t kvh, const T* q, const T* kc, const T* vc,
            const int64_t* tables, int64_t lo, int64_t hi, const float* sinks, float scale,
            float softcap, T* out, Work& work) {
  const int64_t G = s.H / s.KV, n = hi - lo + 1;
  T* o = out + (b * s.H + kvh * G) * s.Dv;
  if (n <= 0) {  // padding row: nothing visible
    for (int64_t i = 0; i < G * s.Dv; ++i) store(o + i, 0.0f);
    return;
  }
  work.rows.resize(n);
  work.values.resize(G * s.D + G * n + s.Dv);
  int64_t* rows = work.rows.data();  // cache row (slot * KV + kvh) of each visible key
  float* qf = work.values.data();    // [G, D] the group's queries, scaled
  float* scores = qf + G * s.D;      // [G, n]
  float* acc = scores + G * n;       // [Dv]
  for (int64_t j = lo; j <= hi;) {   // block ids clamped: host-given
    const int64_t block = std::clamp<int64_t>(tables[b * s.MB + j / s.BS], 0, s.NB - 1);
    for (int64_t off = j % s.BS; off < s.BS && j <= hi; ++off, ++j) {
      rows[j - lo] = (block * s.BS + off) * s.KV + kvh;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const T* qh = q + (b * s.H + kvh * G + g) * s.D;
    for (int64_t d = 0; d < s.D; ++d) qf[g * s.D + d] = to_float(qh[d]) * scale;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* key = kc + rows[j] * s.D;
    for (int64_t g = 0; g < G; ++g) {
      float score = dot(qf + g * s.D, key, s.D);
      if (softcap > 0) score = softcap * std::tanh(score / softcap);
      scores[g * n + j] = score;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    softmax(scores + g * n, n, sinks ? sinks[kvh * G + g] : -INFINITY);
    weighted_sum(scores + g * n, vc, rows, n, s.Dv, acc);
    for (int64_t d = 0; d < s.Dv; ++d) store(o + g * s.Dv + d, acc[d]);
  }
}

template <typename T>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
         const int64_t* tables, const int64_t* lo, const int64_t* hi, const float* sinks,
         float scale, float softcap, at::Tensor& out) {
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t context = s.MB * s.BS;
  at::parallel_for(0, s.B * s.KV, 1, [&](int64_t p0, int64_t p1) {
    Work work;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / s.KV, kvh = p % s.KV;
      const int64_t first = std::max<int64_t>(lo[b], 0);
      const int64_t last = std::min<int64_t>(hi[b], context - 1);
      attend(s, b, kvh, qp, kp, vp, tables, first, last, sinks, scale, softcap, op, work);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& lo_in, const at::Tensor& hi_in,
                                  const std::optional<at::Tensor>& sinks_in, double scale,
                                  double softcap) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_decode_attention: expects q [B, H, D] and caches [NB, BS, KV, D]");
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_decode_attention: q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_decode_attention: the caches must have q's dtype");
  const at::Tensor q = q_in.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const at::Tensor tables = block_tables.contiguous().to(at::kLong);
  const at::Tensor lo = lo_in.contiguous().to(at::kLong), hi = hi_in.contiguous().to(at::kLong);
  Shape s{q.size(0), q.size(1), q.size(2), vc.size(3), kc.size(0), kc.size(1), kc.size(2),
          tables.size(1)};
  TORCH_CHECK(kc.size(3) == s.D && vc.size(0) == s.NB && vc.size(1) == s.BS &&
                  vc.size(2) == s.KV && s.KV > 0 && s.H % s.KV == 0,
              "paged_decode_attention: q and the caches disagree on heads or widths");
  TORCH_CHECK(tables.size(0) == s.B && lo.numel() == s.B && hi.numel() == s.B,
              "paged_decode_attention: block_tables, lo and hi need one row per query row");
  at::Tensor sinks;
  if (sinks_in.has_value() && sinks_in->defined()) {
    sinks = sinks_in->contiguous().to(at::kFloat);
    TORCH_CHECK(sinks.numel() == s.H, "paged_decode_attention: sinks must be [H]");
  }
  const float* sp = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({s.B, s.H * s.Dv}, q.options());
  const int64_t* tp = tables.data_ptr<int64_t>();
  if (dtype == at::kFloat) {
    run<float>(s, q, kc, vc, tp, lo.data_ptr<int64_t>(), hi.data_ptr<int64_t>(), sp,
               float(scale), float(softcap), out);
  } else {
    run<uint16_t>(s, q, kc, vc, tp, lo.data_ptr<int64_t>(), hi.data_ptr<int64_t>(), sp,
                  float(scale), float(softcap), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neffkit, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor lo, Tensor hi, Tensor? sinks, float scale, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(neffkit, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
