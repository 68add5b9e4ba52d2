// neffkit::lora_rows: LoRA deltas of a few rows (decode, verify), each row through its own
// adapter slot, for every projection that reads the same input, in one call.
//
// delta_p[n] = (x[n] @ A_p[:, s_n - 1, :]) @ B_p[s_n - 1]   (zeros where s_n == 0: the base)
//
// x [N, in], A_p [in, L, R], B_p [L, R, out_p] (the adapter slots, contract/lora.py), slots [N]
// int64 (clamped to 0 .. L). Only the slots rows use are read: a batch of base rows reads no
// adapter at all, and a batch of 4 distinct adapters reads those 4 (punica's BGMV). The graph's
// own form (kernels/lora.py) multiplies every slot and masks; at a few rows its ~3 small ops per
// projection cost more in dispatch and thread syncs than the arithmetic (bench/lora.py).
// Float32 accumulation; x, A and B float32 or bf16 alike; the output [N, sum out_p] in x's dtype.

#include <ATen/ATen.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using neffkit_vec::V16;

constexpr int64_t kMaxRank = 256;  // the manifest's limit (manifest/lora.py)
constexpr int64_t kOutBlock = 64;  // outputs a pass of the B stage holds: 4 vectors a row
constexpr int64_t kSpan = 256;     // outputs a task of the B stage streams, kOutBlock at a time
#ifdef __AVX512F__
constexpr int kTileA = 8;  // rows a pass of the A stage carries (one zmm accumulator each)
#else
constexpr int kTileA = 4;  // ... two ymm each: 8 of 16 registers
#endif
constexpr int kRowsB = 2;          // ... of B (kRowsB x 4 accumulators and 4 loads fit AVX2)

// Adapter lines are fetched ahead of use: a call reads ~0.1-1 MB in many short streams (a
// slot's R values a row of A, R rows of B a block), too short for the hardware prefetcher to
// ramp up; cold, both stages ran at ~13 GB/s on the Intel host (bench/lora.py's shapes).
constexpr int64_t kAheadBytes = 2048;

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline V16 load(const float* p) { return neffkit_vec::load(p); }
inline V16 load(const c10::BFloat16* p) {
  return neffkit_vec::load(reinterpret_cast<const uint16_t*>(p));
}

template <typename T>
struct Projection {
  const T* a;
  const T* b;
  int64_t out;
  int64_t offset;  // its first column in the output
};

struct Group {  // one slot's rows: order[first .. first + count)
  int64_t slot, first, count;
};

// xa[n] += x[n, i0 .. i1) @ A[i0 .. i1, slot_n, :] for `count` rows, each through its own slot:
// one forward sweep over the chunk of A (a row of A holds every slot's R values side by side),
// kTileA independent accumulators a pass. A short tile is padded with its last row, whose
// products are dropped: the padded FMAs ride in the latency of the real ones.
template <typename T>
void a_chunk(const T* x, int64_t in, const T* a, int64_t loras, int64_t rank, const int64_t* rows,
             const int64_t* slot_of, int64_t count, int64_t i0, int64_t i1, float* xa) {
  const int64_t stride = loras * rank;
  for (int64_t j0 = 0; j0 < count; j0 += kTileA) {
    const int n = static_cast<int>(std::min<int64_t>(kTileA, count - j0));
    const T* xr[kTileA];
    const T* ar[kTileA];
    for (int j = 0; j < kTileA; ++j) {
      const int64_t k = j0 + std::min(j, n - 1);
      xr[j] = x + rows[k] * in;
      ar[j] = a + (slot_of[k] - 1) * rank;
    }
    if (rank % 16 != 0) {  // small ranks: scalar
      for (int j = 0; j < n; ++j)
        for (int64_t r = 0; r < rank; ++r) {
          float acc = 0.0f;
          for (int64_t i = i0; i < i1; ++i) acc += widen(xr[j][i]) * widen(ar[j][i * stride + r]);
          xa[rows[j0 + j] * rank + r] = acc;
        }
      continue;
    }
    int distinct = 0;  // the tile's slots (rows come sorted by slot): the streams to prefetch
    const T* streams[kTileA];
    for (int j = 0; j < n; ++j)
      if (distinct == 0 || streams[distinct - 1] != ar[j]) streams[distinct++] = ar[j];
    const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(T));
    const int64_t ahead = (kAheadBytes + row_bytes - 1) / row_bytes;
    const int64_t span = rank * static_cast<int64_t>(sizeof(T));
    for (int64_t c = 0; c < rank; c += 16) {
      V16 acc[kTileA];
      for (int j = 0; j < kTileA; ++j) acc[j] = neffkit_vec::zero();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t at = i * stride + c;
        if (c == 0 && i + ahead < i1)
          for (int d = 0; d < distinct; ++d) prefetch_span(streams[d] + (i + ahead) * stride, span);
        for (int j = 0; j < kTileA; ++j)
          acc[j] = neffkit_vec::fmadd(neffkit_vec::set1(widen(xr[j][i])), load(ar[j] + at), acc[j]);
      }
      for (int j = 0; j < n; ++j) neffkit_vec::store(xa + rows[j0 + j] * rank + c, acc[j]);
    }
  }
}

// out[n, o0 .. o0 + cols) of one projection for a slot's rows, kRowsB rows per pass over B
template <typename T>
void b_block(const Projection<T>& pr, const T* b, int64_t rank, const float* xa,
             const int64_t* members, int64_t count, int64_t o0, int64_t cols, T* out,
             int64_t width) {
  for (int64_t j0 = 0; j0 < count; j0 += kRowsB) {
    const int n = static_cast<int>(std::min<int64_t>(kRowsB, count - j0));
    float acc[kRowsB][kOutBlock] = {};
    if (cols == kOutBlock) {
      V16 v[kRowsB][4];
      for (int j = 0; j < n; ++j)
        for (int k = 0; k < 4; ++k) v[j][k] = neffkit_vec::zero();
      const bool next = j0 == 0 && o0 + 2 * kOutBlock <= pr.out;
      for (int64_t r = 0; r < rank; ++r) {
        const T* br = b + r * pr.out + o0;
        if (next) prefetch_span(br + kOutBlock, kOutBlock * static_cast<int64_t>(sizeof(T)));
        const V16 w0 = load(br), w1 = load(br + 16), w2 = load(br + 32), w3 = load(br + 48);
        for (int j = 0; j < n; ++j) {
          const V16 s = neffkit_vec::set1(xa[members[j0 + j] * rank + r]);
          v[j][0] = neffkit_vec::fmadd(s, w0, v[j][0]);
          v[j][1] = neffkit_vec::fmadd(s, w1, v[j][1]);
          v[j][2] = neffkit_vec::fmadd(s, w2, v[j][2]);
          v[j][3] = neffkit_vec::fmadd(s, w3, v[j][3]);
        }
      }
      for (int j = 0; j < n; ++j)
        for (int k = 0; k < 4; ++k) neffkit_vec::store(acc[j] + 16 * k, v[j][k]);
    } else {  // a projection's last, narrower block
      for (int j = 0; j < n; ++j)
        for (int64_t r = 0; r < rank; ++r) {
          const float s = xa[members[j0 + j] * rank + r];
          for (int64_t o = 0; o < cols; ++o) acc[j][o] += s * widen(b[r * pr.out + o0 + o]);
        }
    }
    for (int j = 0; j < n; ++j) {
      T* dst = out + members[j0 + j] * width + pr.offset + o0;
      for (int64_t o = 0; o < cols; ++o) dst[o] = static_cast<T>(acc[j][o]);
    }
  }
}

// Both stages in one parallel region, barriers between them: a decode step calls this four
// times a layer, and a region's start and end cost about as much as its arithmetic. A's tasks
// are (projection, a chunk of the inputs) over every adapted row, each writing its own partial
// sums (added up before B); B's (projection, slot, kSpan columns): a task streams its slot's R
// rows of B over contiguous columns.
template <typename T>
void stages(const T* x, int64_t rows, int64_t in, const std::vector<int64_t>& order,
            const std::vector<int64_t>& slot_of, const std::vector<Group>& groups,
            const std::vector<Projection<T>>& projs, int64_t loras, int64_t rank, T* out,
            int64_t width) {
  const int64_t np = static_cast<int64_t>(projs.size());
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t chunks = std::clamp<int64_t>(threads, 1, std::max<int64_t>(1, in / 64));
  const int64_t step = (in + chunks - 1) / chunks;
  const int64_t part = np * rows * rank;  // one chunk's partial sums: [p][row][rank]
  std::vector<float> xa(chunks * part, 0.0f);
  std::vector<std::array<int64_t, 3>> b_tasks;  // (p, group, first column)
  for (int64_t p = 0; p < np; ++p)
    for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
      for (int64_t o = 0; o < projs[p].out; o += kSpan) b_tasks.push_back({p, g, o});
  const int64_t na = np * chunks;
  const int64_t nb = static_cast<int64_t>(b_tasks.size());
  const int64_t count = static_cast<int64_t>(order.size());
#pragma omp parallel num_threads(static_cast<int>(std::min(threads, std::max(na, nb))))
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < na; ++t) {
      const int64_t p = t / chunks, k = t % chunks;
      a_chunk<T>(x, in, projs[p].a, loras, rank, order.data(), slot_of.data(), count, k * step,
                 std::min(in, (k + 1) * step), xa.data() + k * part + p * rows * rank);
    }
    if (chunks > 1) {
#pragma omp for schedule(static)
      for (int64_t e = 0; e < part; ++e)
        for (int64_t k = 1; k < chunks; ++k) xa[e] += xa[k * part + e];
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < nb; ++t) {
      const auto [p, g, o] = b_tasks[t];
      const Projection<T>& pr = projs[p];
      const Group& gr = groups[g];
      const T* b = pr.b + (gr.slot - 1) * rank * pr.out;
      for (int64_t o0 = o; o0 < std::min(o + kSpan, pr.out); o0 += kOutBlock)
        b_block<T>(pr, b, rank, xa.data() + p * rows * rank, order.data() + gr.first, gr.count,
                   o0, std::min(kOutBlock, pr.out - o0), out, width);
    }
  }
}

template <typename T>
at::Tensor run(const at::Tensor& x, at::TensorList a, at::TensorList b, const at::Tensor& slots) {
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t loras = a[0].size(1), rank = a[0].size(2);
  const int64_t* given = slots.data_ptr<int64_t>();
  std::vector<Projection<T>> projs;
  int64_t width = 0;
  for (size_t p = 0; p < a.size(); ++p) {
    projs.push_back({a[p].data_ptr<T>(), b[p].data_ptr<T>(), b[p].size(2), width});
    width += b[p].size(2);
  }
  at::Tensor out = at::zeros({rows, width}, x.options());  // the base's rows stay zero
  std::vector<int64_t> order, slot_of;                      // rows by slot, the base's left out
  std::vector<Group> groups;
  for (int64_t s = 1; s <= loras; ++s) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t n = 0; n < rows; ++n)
      if (std::clamp<int64_t>(given[n], 0, loras) == s) order.push_back(n), slot_of.push_back(s);
    if (static_cast<int64_t>(order.size()) > first)
      groups.push_back({s, first, static_cast<int64_t>(order.size()) - first});
  }
  if (groups.empty()) return out;
  stages<T>(x.data_ptr<T>(), rows, in, order, slot_of, groups, projs, loras, rank,
            out.data_ptr<T>(), width);
  return out;
}

at::Tensor lora_rows(const at::Tensor& x, at::TensorList a, at::TensorList b,
                     const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "lora_rows: x must be a contiguous [N, in]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong,
              "lora_rows: slots must be int64 [N]");
  TORCH_CHECK(!a.empty() && a.size() == b.size(), "lora_rows: one A and one B per projection");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_rows: float32 or bf16 rows");
  for (size_t p = 0; p < a.size(); ++p) {
    TORCH_CHECK(a[p].dim() == 3 && b[p].dim() == 3 && a[p].is_contiguous() && b[p].is_contiguous(),
                "lora_rows: A [in, L, R] and B [L, R, out], contiguous");
    TORCH_CHECK(a[p].scalar_type() == dtype && b[p].scalar_type() == dtype,
                "lora_rows: A and B in the rows' dtype");
    TORCH_CHECK(a[p].size(0) == x.size(1) && a[p].size(1) == b[p].size(0) &&
                    a[p].size(2) == b[p].size(1) && a[p].size(1) == a[0].size(1) &&
                    a[p].size(2) == a[0].size(2),
                "lora_rows: A and B shapes do not agree");
  }
  TORCH_CHECK(a[0].size(2) <= kMaxRank, "lora_rows: rank above ", kMaxRank);
  if (dtype == at::kFloat) return run<float>(x, a, b, slots);
  return run<c10::BFloat16>(x, a, b, slots);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neffkit, m) {
  m.def("lora_rows(Tensor x, Tensor[] a, Tensor[] b, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(neffkit, CPU, m) { m.impl("lora_rows", &lora_rows); }
