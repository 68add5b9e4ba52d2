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
constexpr int kRowsA = 4;          // rows of one slot sharing each loaded vector of A
constexpr int kRowsB = 2;          // ... of B (kRowsB x 4 accumulators and 4 loads fit AVX2)

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

// xa[n] = x[n] @ A[:, slot, :] for `count` rows of one slot (a points at the slot's first R)
template <typename T>
void a_rows(const T* x, int64_t in, const T* a, int64_t loras, int64_t rank, const int64_t* rows,
            int count, float* xa) {
  if (rank % 16 != 0) {  // small ranks: one scalar pass per row
    for (int j = 0; j < count; ++j) {
      float acc[kMaxRank] = {};
      for (int64_t i = 0; i < in; ++i) {
        const float xv = widen(x[rows[j] * in + i]);
        for (int64_t r = 0; r < rank; ++r) acc[r] += xv * widen(a[i * loras * rank + r]);
      }
      std::copy(acc, acc + rank, xa + rows[j] * rank);
    }
    return;
  }
  for (int64_t c = 0; c < rank; c += 16) {
    V16 acc[kRowsA];
    for (int j = 0; j < count; ++j) acc[j] = neffkit_vec::zero();
    for (int64_t i = 0; i < in; ++i) {
      const V16 av = load(a + i * loras * rank + c);
      for (int j = 0; j < count; ++j)
        acc[j] = neffkit_vec::fmadd(neffkit_vec::set1(widen(x[rows[j] * in + i])), av, acc[j]);
    }
    for (int j = 0; j < count; ++j) neffkit_vec::store(xa + rows[j] * rank + c, acc[j]);
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
      for (int64_t r = 0; r < rank; ++r) {
        const T* br = b + r * pr.out + o0;
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

// Both stages in one parallel region, a barrier between them: a decode step calls this four
// times a layer, and a region's start and end cost about as much as its arithmetic. A's tasks
// are (projection, slot, up to kRowsA rows), B's (projection, slot, kSpan columns): a task
// streams its slot's R rows of B over contiguous columns.
template <typename T>
void stages(const T* x, int64_t rows, int64_t in, const std::vector<int64_t>& order,
            const std::vector<Group>& groups, const std::vector<Projection<T>>& projs,
            int64_t loras, int64_t rank, float* xa, T* out, int64_t width) {
  std::vector<std::array<int64_t, 3>> a_tasks, b_tasks;  // (p, group, first row | column)
  for (int64_t p = 0; p < static_cast<int64_t>(projs.size()); ++p)
    for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
      for (int64_t j = 0; j < groups[g].count; j += kRowsA) a_tasks.push_back({p, g, j});
      for (int64_t o = 0; o < projs[p].out; o += kSpan) b_tasks.push_back({p, g, o});
    }
  const int64_t na = static_cast<int64_t>(a_tasks.size());
  const int64_t nb = static_cast<int64_t>(b_tasks.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), nb));
#pragma omp parallel num_threads(std::max(1, threads))
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < na; ++t) {
      const auto [p, g, j] = a_tasks[t];
      const Group& gr = groups[g];
      const int count = static_cast<int>(std::min<int64_t>(kRowsA, gr.count - j));
      a_rows<T>(x, in, projs[p].a + (gr.slot - 1) * rank, loras, rank,
                order.data() + gr.first + j, count, xa + p * rows * rank);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < nb; ++t) {
      const auto [p, g, o] = b_tasks[t];
      const Projection<T>& pr = projs[p];
      const Group& gr = groups[g];
      const T* b = pr.b + (gr.slot - 1) * rank * pr.out;
      for (int64_t o0 = o; o0 < std::min(o + kSpan, pr.out); o0 += kOutBlock)
        b_block<T>(pr, b, rank, xa + p * rows * rank, order.data() + gr.first, gr.count, o0,
                   std::min(kOutBlock, pr.out - o0), out, width);
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
  std::vector<int64_t> order;                               // rows by slot, the base's left out
  std::vector<Group> groups;
  for (int64_t s = 1; s <= loras; ++s) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t n = 0; n < rows; ++n)
      if (std::clamp<int64_t>(given[n], 0, loras) == s) order.push_back(n);
    if (static_cast<int64_t>(order.size()) > first)
      groups.push_back({s, first, static_cast<int64_t>(order.size()) - first});
  }
  if (groups.empty()) return out;
  std::vector<float> xa(projs.size() * rows * rank, 0.0f);
  stages<T>(x.data_ptr<T>(), rows, in, order, groups, projs, loras, rank, xa.data(),
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
