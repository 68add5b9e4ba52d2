// neffkit::blocked_rows(x, [w, ...]) -> x @ W.T for the few rows of a decode step, W stored
// blocked; several weights reading the same x are one call (their outputs side by side).
//
// x: [R, K] float32, or bfloat16 with bf16 weights; w: [NB, K, 16] float32 or bfloat16, lane j of
// block b is output b*16 + j (models/projection.py's blocked layout). Returns [R, sum NB*16]
// float32. bf16 rows on bf16 weights go through AMX tiles where the CPU has them (below).
//
// Why a kernel: a decode step is bandwidth-bound only if each weight vector is loaded once for
// every row. Inductor's fused reductions get there at one row but not at eight (the row loop
// does not stay in registers). Here a tile of U output blocks keeps R x U accumulators in
// registers (R*U <= 16 zmm, 24 on AMD), loads each 16-lane weight vector once (bf16: widened
// to float32 in-register, a shift) and applies it to all R rows with one FMA each, float32
// accumulation (products exact, as the float32 form computes them). Weight lines are
// prefetched ahead: the hardware prefetcher alone keeps too few in flight once several FMAs
// consume each line.
// bf16 rows on bf16 weights take AMX tiles (Intel hosts that have them), else VDPBF16PS on
// pairs of K steps (AVX512-BF16; the default on AMD, where it measured faster), else the
// widened FMA. Blocks are split over torch's intra-op threads. Called from AOTInductor graphs
// through the dispatcher; registered by loading the library (neffkit/cpu_kernels.py).
// One source for both CPU classes (platform/isa.py) over vec16.h's 16-lane vector: one zmm, or
// two ymm on the AVX2 class, whose registers hold a quarter as many (narrower tiles); it has
// the widened FMA alone (no AMX, VDPBF16PS) and gives the bits of the AVX-512 FMA paths.

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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec16.h"

namespace {

using namespace neffkit_vec;

constexpr int64_t kLanes = 16;

#ifdef __AVX512F__
// output blocks per tile for R rows: R * U <= 16 accumulators (of 32 zmm registers), and at
// least two weight streams in flight
constexpr int tile_blocks(int rows) { return rows >= 5 ? 2 : (rows >= 3 ? 4 : 8); }
constexpr int kTileRows = 8;
#else
// AVX2: a 16-lane vector is two of the 16 ymm. R x U accumulators, U weight vectors and a row
// value, 2RU + 2U + 1 <= 16: 3 blocks at one row, 2 at two rows, 1 from three rows to six (15
// ymm). 7 or 8 rows run as two tiles over the same blocks (for_tiles), the second reading them
// from cache: 8 rows in one tile stored and reloaded 3 of its 16 accumulators every K step.
constexpr int tile_blocks(int rows) { return rows >= 3 ? 1 : (rows == 2 ? 2 : 3); }
constexpr int kTileRows = 6;
#endif
// On AMD hosts three blocks from 5 rows on (R * U <= 24 accumulators, 28-29 zmm in all): each
// broadcast row value feeds three FMAs instead of two. SmolLM2's projections at 8 rows, 2
// threads, alternating processes on Zen: float32 18.8-19.6 -> 15.9-16.5 ms, bf16 (VDPBF16PS)
// 10.0-10.8 -> 9.4-9.5 ms. Not measured on Intel, which keeps `tile_blocks`.
constexpr int tile_blocks_amd(int rows) { return rows >= 5 ? 3 : tile_blocks(rows); }

// Weight lines are fetched this many lines ahead of use (one 64-byte line per K step of a
// float32 block, per two of a bf16 block). On the Intel host it was tuned on, with several rows
// a K step does several FMAs and the hardware prefetcher alone left too few lines in flight for
// a slowly consumed stream: batch 8 ran at 5 GB/s a core, batch 1 at 15. On AMD Zen 4 the
// hardware prefetcher alone streams faster: the 125M model's projections at one row, float32,
// alternating in one process, 13.7 vs 15.3 ms and 10.3 vs 14.7 ms in two runs, bf16 6.5 vs
// 8.8 ms; eight rows equal within the noise. $NEFFKIT_KERNEL_PREFETCH overrides (benchmarks).
bool is_amd() {
  static const bool amd = [] {
    unsigned a, b, c, d;
    char vendor[13] = {};
    if (__get_cpuid(0, &a, &b, &c, &d)) {
      std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
    }
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
}

int64_t prefetch_lines() {
  static const int64_t lines = [] {
    if (const char* env = std::getenv("NEFFKIT_KERNEL_PREFETCH")) return std::atoll(env);
    return is_amd() ? 0LL : 32LL;
  }();
  return lines;
}

// One row value as float32: read, or (bf16) widened, so bf16 rows need no converted copy.
inline float load_row(const float* p) { return *p; }
inline float load_row(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Output blocks b0..b0+U-1 for R rows: R x U accumulators, each weight vector loaded once.
template <int R, int U, typename X, typename W>
void tile(const X* x, int64_t K, const W* w, float* out, int64_t ldo, int64_t b0) {
  constexpr int64_t kStepsPerLine = 64 / (kLanes * sizeof(W));  // 1 float32, 2 bf16
  V16 acc[R][U];
  NEFFKIT_UNROLL for (int r = 0; r < R; ++r)
    NEFFKIT_UNROLL for (int u = 0; u < U; ++u) acc[r][u] = zero();
  const W* wb = w + b0 * K * kLanes;
  const int64_t ahead = kStepsPerLine * prefetch_lines();
  for (int64_t k = 0; k < K; ++k) {
    V16 wv[U];
    NEFFKIT_UNROLL for (int u = 0; u < U; ++u) {
      if (ahead && k % kStepsPerLine == 0)
        _mm_prefetch(reinterpret_cast<const char*>(wb + (u * K + k + ahead) * kLanes),
                     _MM_HINT_T0);
      wv[u] = load_weights(wb + (u * K + k) * kLanes);
    }
    NEFFKIT_UNROLL for (int r = 0; r < R; ++r) {
      const V16 xv = set1(load_row(x + r * K + k));
      NEFFKIT_UNROLL for (int u = 0; u < U; ++u) acc[r][u] = fmadd(xv, wv[u], acc[r][u]);
    }
  }
  NEFFKIT_UNROLL for (int r = 0; r < R; ++r)
    NEFFKIT_UNROLL for (int u = 0; u < U; ++u) {
      store_lanes<W>(out + r * ldo + (b0 + u) * kLanes, acc[r][u]);
    }
}

template <int N>
using Int = std::integral_constant<int, N>;

// fn(Int<R>) for a row group of `rows` (1..8 rows): each row count its own unrolled tiles.
template <typename Fn>
void with_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(Int<1>{});
    case 2: return fn(Int<2>{});
    case 3: return fn(Int<3>{});
    case 4: return fn(Int<4>{});
    case 5: return fn(Int<5>{});
    case 6: return fn(Int<6>{});
    case 7: return fn(Int<7>{});
    default: return fn(Int<8>{});
  }
}

// tile(b, Int<U>) over blocks [begin, end): U blocks at a time, then single blocks.
template <int U, typename Tile>
void run_tiles(int64_t begin, int64_t end, Tile&& tile) {
  int64_t b = begin;
  for (; b + U <= end; b += U) tile(b, Int<U>{});
  for (; b < end; ++b) tile(b, Int<1>{});
}

// tile(Int<R>, Int<U>, r0, b) over every row group r0 (8 rows at most) and blocks [begin, end),
// U = Blocks(R) blocks at a time, then single blocks. A group of more than MaxRows rows runs as
// two tiles over the same blocks, back to back: the second reads them from cache.
template <int (*Blocks)(int), int MaxRows = 8, typename Tile>
void for_tiles(int64_t R, int64_t begin, int64_t end, Tile&& tile) {
  for (int64_t r0 = 0; r0 < R; r0 += 8) {
    with_rows(R - r0 < 8 ? R - r0 : 8, [&](auto rows) {
      constexpr int kRows = decltype(rows)::value;
      run_tiles<Blocks(kRows)>(begin, end, [&](int64_t b, auto u) {
        constexpr int kFirst = kRows <= MaxRows ? kRows : (kRows + 1) / 2;
        tile(Int<kFirst>{}, u, r0, b);
        if constexpr (kFirst < kRows) tile(Int<kRows - kFirst>{}, u, r0 + kFirst, b);
      });
    });
  }
}

// for_tiles with the host's tile widths (tile_blocks_amd on AMD, else tile_blocks).
template <typename Tile>
void for_host_tiles(int64_t R, int64_t begin, int64_t end, Tile&& tile) {
  if constexpr (kVectorRegs == 32) {
    if (is_amd()) return for_tiles<tile_blocks_amd>(R, begin, end, tile);
  }
  for_tiles<tile_blocks, kTileRows>(R, begin, end, tile);
}

// Every row group (8 rows at most) over blocks [begin, end).
template <typename X, typename W>
void run_blocks(int64_t R, const X* x, int64_t K, const W* w, float* out, int64_t ldo,
                int64_t begin, int64_t end) {
  for_host_tiles(R, begin, end, [&](auto rows, auto u, int64_t r0, int64_t b) {
    tile<decltype(rows)::value, decltype(u)::value>(x + r0 * K, K, w, out + r0 * ldo, ldo, b);
  });
}

// ---- bf16 rows on bf16 weights, two K steps an instruction (AVX512-BF16's VDPBF16PS) ----
//
// VDPBF16PS multiplies 16 pairs of bf16 values and adds both products to 16 float32 lanes: 32
// MACs where the widened FMA does 16, and no widening. The blocked layout holds K steps k and
// k+1 of a block's 16 lanes in one 64-byte line; one VPERMW interleaves them into the pairs the
// instruction reads, and each row's (x[k], x[k+1]) is one broadcast 32-bit value. Products are
// exact in float32 as in the FMA form; only the summation order differs (pairs first).
// Measured on AMD Zen 4 (2 threads, SmolLM2's shapes, K = 576): 8 rows 25-28 against 18-20
// GB/s of weights for the FMA form, 1 row 44-52 against 40-48. On the Intel host the FMA form
// was faster (82 vs 62 GMAC/s, 8 rows): there it stays the default (`use_bf16_dot`).
#ifdef __AVX512BF16__
// VPERMW's order for one 64-byte line of the blocked layout (K steps k, k+1 of 16 lanes): word
// 2j <- lane j of step k, word 2j+1 <- lane j of step k+1, the pairs VDPBF16PS reads
alignas(64) constexpr uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                             15, 31};

template <int R, int U>
void tile_dot(const uint16_t* x, int64_t K, const uint16_t* w, float* out, int64_t ldo,
              int64_t b0) {
  const __m512i pairs = _mm512_load_si512(kPairs);
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  const uint16_t* wb = w + b0 * K * kLanes;
  for (int64_t k = 0; k < K; k += 2) {
    __m512i wv[U];
    for (int u = 0; u < U; ++u)
      wv[u] = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(wb + (u * K + k) * kLanes));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], xv, (__m512bh)wv[u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(out + r * ldo + (b0 + u) * kLanes, acc[r][u]);
}

void run_blocks_dot(int64_t R, const uint16_t* x, int64_t K, const uint16_t* w, float* out,
                    int64_t ldo, int64_t begin, int64_t end) {
  for_host_tiles(R, begin, end, [&](auto rows, auto u, int64_t r0, int64_t b) {
    tile_dot<decltype(rows)::value, decltype(u)::value>(x + r0 * K, K, w, out + r0 * ldo, ldo,
                                                        b);
  });
}
constexpr bool kHasBf16Dot = true;
#else
void run_blocks_dot(int64_t, const uint16_t*, int64_t, const uint16_t*, float*, int64_t,
                    int64_t, int64_t) {}
constexpr bool kHasBf16Dot = false;
#endif

// Whether bf16 rows on bf16 weights take VDPBF16PS: where it was built in, on AMD hosts unless
// $NEFFKIT_KERNEL_BF16_DOT says otherwise (0 or 1), and as set_bf16_dot last asked.
std::atomic<int> bf16_dot_wanted{-1};  // -1: the host's default

bool use_bf16_dot() {
  static const bool by_default = [] {
    if (const char* env = std::getenv("NEFFKIT_KERNEL_BF16_DOT")) return std::atoi(env) != 0;
    return is_amd();
  }();
  const int wanted = bf16_dot_wanted.load(std::memory_order_relaxed);
  return kHasBf16Dot && (wanted < 0 ? by_default : wanted != 0);
}

// ---- fp8 (e4m3fn) weights, widened in register, scaled per K block ----
//
// w: [NB, K, 16] float8_e4m3fn bytes; scales: [NB, KB, 16] float32, lane j of K block kb of
// output block b the scale of output b*16 + j over K values [kb*k_block, (kb+1)*k_block). One
// layout for fine-grained blocks (128 x 128), per-channel (KB = 1) and per-tensor scales. The
// bytes streamed are a quarter of float32's: a decode step reads fp8 width, not the dequantized
// weight (which Inductor's graph would widen through a software conversion first).
//
// e4m3fn -> float16 is a move of the byte's bits: sign to bit 15, exponent and mantissa to bits
// 7..13 (sign-extended to 16 bits and shifted left by 7, bit 14 then cleared). Read as float16
// that is the value times 2^-8, subnormals included (e4m3's subnormals land on float16's), and
// VCVTPH2PS widens it exactly (it ignores MXCSR's denormals-are-zero); the 2^8 goes into the
// block scale. The NaN byte (0x7f/0xff, never in a checkpoint's weights) reads as +-480.

// acc += part x the K block's scale (times `factor`) of each output block of the tile; `scales`
// points at the K block's vector of output block 0 ([NB, KB, 16] layout).
template <int R, int U>
inline void add_block(V16 (&acc)[R][U], const V16 (&part)[R][U], const float* scales,
                      int64_t KB, int64_t b0, float factor) {
  NEFFKIT_UNROLL for (int u = 0; u < U; ++u) {
    const V16 s = mul(load(scales + (b0 + u) * KB * kLanes), set1(factor));
    NEFFKIT_UNROLL for (int r = 0; r < R; ++r) acc[r][u] = fmadd(part[r][u], s, acc[r][u]);
  }
}

template <int R, int U>
inline void store_tile(const V16 (&acc)[R][U], float* out, int64_t ldo, int64_t b0) {
  NEFFKIT_UNROLL for (int r = 0; r < R; ++r)
    NEFFKIT_UNROLL for (int u = 0; u < U; ++u) store(out + r * ldo + (b0 + u) * kLanes, acc[r][u]);
}

#ifdef __AVX512F__
// R x U partial sums of one K block and R x U totals stay in registers with U weight vectors:
// 2*R*U + U + 1 <= 32 zmm.
constexpr int fp8_tile_blocks(int rows) { return rows == 1 ? 8 : (rows == 2 ? 4 : (rows <= 7 ? 2 : 1)); }
constexpr int kFp8TileRows = 8;
#else
// AVX2: partial sums, weight vectors and a row value, 2RU + 2U + 1 <= 16 ymm in the K loop (the
// totals out of it): 3 blocks at one row, one to 4 rows; 5 and more (spilled) as two tiles.
constexpr int fp8_tile_blocks(int rows) { return rows == 1 ? 3 : 1; }
constexpr int kFp8TileRows = 4;
#endif
constexpr float kFp8ToHalf = 256.0f;  // load_fp8_half reads the value times 2^-8

template <int R, int U>
void tile_fp8(const float* x, int64_t K, const uint8_t* w, const float* scales, int64_t KB,
              int64_t k_block, float* out, int64_t ldo, int64_t b0) {
  constexpr int64_t kStepsPerLine = 64 / kLanes;  // 4 K steps of 16 bytes a line
  V16 acc[R][U];
  NEFFKIT_UNROLL for (int r = 0; r < R; ++r)
    NEFFKIT_UNROLL for (int u = 0; u < U; ++u) acc[r][u] = zero();
  const uint8_t* wb = w + b0 * K * kLanes;
  const int64_t ahead = kStepsPerLine * prefetch_lines();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k0 = kb * k_block, k1 = k0 + k_block < K ? k0 + k_block : K;
    V16 part[R][U];
    NEFFKIT_UNROLL for (int r = 0; r < R; ++r)
      NEFFKIT_UNROLL for (int u = 0; u < U; ++u) part[r][u] = zero();
    for (int64_t k = k0; k < k1; ++k) {
      V16 wv[U];
      NEFFKIT_UNROLL for (int u = 0; u < U; ++u) {
        if (ahead && k % kStepsPerLine == 0)
          _mm_prefetch(reinterpret_cast<const char*>(wb + (u * K + k + ahead) * kLanes),
                       _MM_HINT_T0);
        wv[u] = load_fp8_half(wb + (u * K + k) * kLanes);
      }
      NEFFKIT_UNROLL for (int r = 0; r < R; ++r) {
        const V16 xv = set1(x[r * K + k]);
        NEFFKIT_UNROLL for (int u = 0; u < U; ++u) part[r][u] = fmadd(xv, wv[u], part[r][u]);
      }
    }
    add_block(acc, part, scales + kb * kLanes, KB, b0, kFp8ToHalf);
  }
  store_tile(acc, out, ldo, b0);
}

void run_blocks_fp8(int64_t R, const float* x, int64_t K, const uint8_t* w, const float* scales,
                    int64_t KB, int64_t k_block, float* out, int64_t ldo, int64_t begin,
                    int64_t end) {
  for_tiles<fp8_tile_blocks, kFp8TileRows>(R, begin, end, [&](auto rows, auto u, int64_t r0,
                                                                int64_t b) {
    tile_fp8<decltype(rows)::value, decltype(u)::value>(x + r0 * K, K, w, scales, KB, k_block,
                                                        out + r0 * ldo, ldo, b);
  });
}

// ---- fp8 weights on bf16 rows, two K steps an instruction (VDPBF16PS) ----
//
// At one row the path above is bound by its widening (five operations per 16 weights before
// the FMA: ~17 GB/s of fp8 bytes on two Zen 4 cores). e4m3fn -> bf16 is a move of bits as well:
// sign to bit 15, exponent and mantissa to bits 4..10 (sign-extended, shifted left by 4, bits
// 11..14 cleared), read as the value times 2^-120. Three operations and the VPERMW that pairs
// K steps k and k+1 (adjacent 16-byte rows of the blocked layout) feed 32 MACs. VDPBF16PS treats
// bf16 denormals as zero: the e4m3 subnormals (exponent 0, magnitudes below 2^-6 in units of the
// block scale) read as 0, the one difference from the FMA path; and so that its products of
// 2^-120-scaled weights stay normal, the rows are scaled by 2^96 first (exact: a power of two,
// |x| < 2^31) and the remaining 2^24 goes into the block scale.
#ifdef __AVX512BF16__
constexpr double kFp8DotRowScale = 79228162514264337593543950336.0;  // 2^96
constexpr float kFp8DotToValue = 16777216.0f;                         // 2^(120 - 96)

template <int R, int U>
void tile_fp8_dot(const uint16_t* x, int64_t K, const uint8_t* w, const float* scales,
                  int64_t KB, int64_t k_block, float* out, int64_t ldo, int64_t b0) {
  const __m512i pairs = _mm512_load_si512(kPairs);
  const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0x87ff));
  V16 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = zero();
  const uint8_t* wb = w + b0 * K * kLanes;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k0 = kb * k_block, k1 = k0 + k_block < K ? k0 + k_block : K;
    V16 part[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) part[r][u] = zero();
    for (int64_t k = k0; k < k1; k += 2) {
      __m512i wv[U];
      for (int u = 0; u < U; ++u) {
        const __m256i bytes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (u * K + k) * kLanes));
        const __m512i bits = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 4),
                                              keep);
        wv[u] = _mm512_permutexvar_epi16(pairs, bits);
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + k, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int u = 0; u < U; ++u)
          part[r][u].v = _mm512_dpbf16_ps(part[r][u].v, xv, (__m512bh)wv[u]);
      }
    }
    add_block(acc, part, scales + kb * kLanes, KB, b0, kFp8DotToValue);
  }
  store_tile(acc, out, ldo, b0);
}

void run_blocks_fp8_dot(int64_t R, const uint16_t* x, int64_t K, const uint8_t* w,
                        const float* scales, int64_t KB, int64_t k_block, float* out,
                        int64_t ldo, int64_t begin, int64_t end) {
  for_tiles<fp8_tile_blocks>(R, begin, end, [&](auto rows, auto u, int64_t r0, int64_t b) {
    tile_fp8_dot<decltype(rows)::value, decltype(u)::value>(x + r0 * K, K, w, scales, KB,
                                                            k_block, out + r0 * ldo, ldo, b);
  });
}
#else
constexpr double kFp8DotRowScale = 1.0;
void run_blocks_fp8_dot(int64_t, const uint16_t*, int64_t, const uint8_t*, const float*, int64_t,
                        int64_t, float*, int64_t, int64_t, int64_t) {}
#endif

// ---- bf16 rows on bf16 weights: AMX tiles (where the CPU and the OS have them) ----
//
// The FMA path above tops out at ~60 GMAC/s for bf16 on two cores (the widening and one FMA per
// 16 MACs per row), which puts a batch-8 step of the 125M model at >= 13 ms before any memory
// traffic. TDPBF16PS does 16 x 16 x 32 MACs an instruction. Its B operand must be in VNNI
// layout (pairs of K rows interleaved); the blocked layout holds the 32 K rows of a block's
// chunk in 1 KB, so each 64-byte pair of rows becomes one VNNI row with one vpermw into an L1
// scratch: no second weight layout in the bundle, and prefill's bmm reads the same tensor.
// A is x's bf16 rows read straight from x; C is [rows, 16] float32, the output's own layout.
// Products of bf16 values are exact in float32, as in the FMA path; only the summation order
// differs. Each thread streams its contiguous range of blocks once.

constexpr int64_t kChunk = 32;  // K values per tile step (32 bf16 = one 64-byte tile row)
// A single row stays on the FMA path: it streams as fast there (36 vs 33 GB/s on the LM head)
// and needs no tile state.
constexpr int64_t kAmxMinRows = 2;

#ifdef __AVX512F__  // AMX hosts run the avx512 class's library
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

// Weight lines fetched this many 64-byte lines ahead (8 KB: 8 chunks). Streaming 320 MB of
// weights at 8 rows (two threads, this noisy host), 0 to 16 lines ahead gave 15 GB/s and 128
// to 1024 gave 20-21 GB/s, against 22-30 GB/s for one row on the FMA path: the tile loop keeps
// fewer misses in flight on its own.
constexpr int64_t kAmxAhead = 128;

using neffkit_amx::TileConfig;

// CPUID says AMX-TILE and AMX-BF16, and Linux grants this process the tile state (amx.h)
bool amx_supported() {
  static const bool ok = neffkit_amx::supported(neffkit_amx::kBf16Bit);
  return ok;
}

// Blocks [begin, end) for M <= 16 bf16 rows; K a multiple of kChunk. Tiles 0/1 accumulate the
// even/odd chunks (two independent chains), 2 holds x's chunk, 3/4 the VNNI weight chunks.
AMX_TARGET void amx_blocks(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                           float* out, int64_t ldo, int64_t begin, int64_t end) {
  TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.rows[t] = static_cast<uint8_t>(M), cfg.colsb[t] = 64;
  for (int t : {3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  // VNNI row i from rows 2i, 2i+1 (32 lanes each half): word 2j <- j, word 2j+1 <- 16 + j
  alignas(64) int16_t order[32];
  for (int j = 0; j < 16; ++j) order[2 * j] = j, order[2 * j + 1] = 16 + j;
  const __m512i interleave = _mm512_load_si512(order);
  alignas(64) uint16_t vnni[2][kChunk * kLanes];
  alignas(64) float sums[2][16 * kLanes];
  const int64_t chunks = K / kChunk;
  for (int64_t b = begin; b < end; ++b) {
    const uint16_t* wb = w + b * K * kLanes;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* src = wb + c * kChunk * kLanes;
      uint16_t* dst = vnni[c & 1];
      for (int i = 0; i < 16; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(src + (kAmxAhead + i) * kChunk), _MM_HINT_T0);
        const __m512i pair = _mm512_loadu_si512(src + i * kChunk);
        _mm512_store_si512(dst + i * kChunk, _mm512_permutexvar_epi16(interleave, pair));
      }
      _tile_loadd(2, x + c * kChunk, K * sizeof(uint16_t));
      if (c & 1) {
        _tile_loadd(4, dst, 64);
        _tile_dpbf16ps(1, 2, 4);
      } else {
        _tile_loadd(3, dst, 64);
        _tile_dpbf16ps(0, 2, 3);
      }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    for (int64_t r = 0; r < M; ++r)
      _mm512_storeu_ps(out + r * ldo + b * kLanes,
                       _mm512_add_ps(_mm512_load_ps(sums[0] + r * kLanes),
                                     _mm512_load_ps(sums[1] + r * kLanes)));
  }
  _tile_release();
}

#else  // the AVX2 class: no AMX, bf16 rows take the widened FMA
bool amx_supported() { return false; }
void amx_blocks(const uint16_t*, int64_t, int64_t, const uint16_t*, float*, int64_t, int64_t,
                int64_t) {}
#endif

std::atomic<bool> amx_wanted{true};

bool use_amx() { return amx_wanted.load(std::memory_order_relaxed) && amx_supported(); }

// Blocks split over torch's intra-op threads: enough per task to amortise the task, few enough
// to share 2..N threads evenly.
int64_t grain(int64_t blocks) { return blocks >= 64 ? 8 : 1; }

// Several weights that read the same rows (a layer's q/k/v, its gate/up) as one projection: their
// blocks numbered one after another, so one parallel region covers them all, and weight i's
// outputs fill columns [start[i] * 16, start[i + 1] * 16) of one [R, N] result. SmolLM2's fp8
// layer projections, 2 threads (bench/kernels.py): 1 row 4.05 ms as 7 calls a layer, 3.92 as
// 4; 8 rows 8.24 and 7.48.
struct Weights {
  std::vector<at::Tensor> w;     // each [NB_i, K, 16], contiguous
  std::vector<int64_t> start;    // first block of each weight; start.back(): every block
  int64_t blocks() const { return start.back(); }
};

Weights check_weights(at::TensorList ws, int64_t K, const char* op) {
  TORCH_CHECK(!ws.empty(), op, ": expects at least one weight");
  Weights out;
  out.start.push_back(0);
  for (const at::Tensor& w : ws) {
    TORCH_CHECK(w.dim() == 3 && w.size(2) == kLanes, op, ": expects weights [NB, K, 16]");
    TORCH_CHECK(w.size(1) == K, op, ": x and a weight disagree on K");
    TORCH_CHECK(w.scalar_type() == ws[0].scalar_type(), op, ": weights of one dtype");
    out.w.push_back(w.contiguous());
    out.start.push_back(out.start.back() + w.size(0));
  }
  return out;
}

// run(i, b0, b1): weight i's blocks [b0, b1), every block of every weight once, in one region.
template <typename Run>
void for_weights(const Weights& ws, Run&& run) {
  const std::vector<int64_t>& start = ws.start;
  at::parallel_for(0, ws.blocks(), grain(ws.blocks()), [&](int64_t b0, int64_t b1) {
    size_t i = std::upper_bound(start.begin(), start.end(), b0) - start.begin() - 1;
    for (int64_t b = b0; b < b1; ++i) {
      const int64_t end = std::min(b1, start[i + 1]);
      if (end > b) run(i, b - start[i], end - start[i]);
      b = end;
    }
  });
}

template <typename T>
const T* weight_data(const Weights& ws, size_t i) {
  return reinterpret_cast<const T*>(ws.w[i].data_ptr());
}

// The FMA path over every block and row group.
template <typename X, typename W>
void fma_rows(int64_t R, const X* x, int64_t K, const Weights& ws, float* out) {
  const int64_t N = ws.blocks() * kLanes;
  for_weights(ws, [&](size_t i, int64_t b0, int64_t b1) {
    run_blocks(R, x, K, weight_data<W>(ws, i), out + ws.start[i] * kLanes, N, b0, b1);
  });
}

const uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// x @ [W_0; W_1; ...].T, float32 [R, sum of N_i]
at::Tensor blocked_rows(const at::Tensor& x_in, at::TensorList w_in) {
  TORCH_CHECK(x_in.dim() == 2, "blocked_rows: expects x [R, K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  const Weights ws = check_weights(w_in, K, "blocked_rows");
  const int64_t N = ws.blocks() * kLanes;
  at::Tensor out = at::empty({R, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const at::ScalarType dtype = ws.w[0].scalar_type();
  if (dtype == at::kFloat) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "blocked_rows: float32 weights need float32 x");
    fma_rows<float, float>(R, x.data_ptr<float>(), K, ws, o);
    return out;
  }
  TORCH_CHECK(dtype == at::kBFloat16, "blocked_rows: weights must be float32 or bf16");
  if (x.scalar_type() != at::kBFloat16) {
    const at::Tensor xf = x.to(at::kFloat);
    fma_rows<float, uint16_t>(R, xf.data_ptr<float>(), K, ws, o);
  } else if (K % kChunk == 0 && R >= kAmxMinRows && use_amx()) {
    const uint16_t* xp = bf16_data(x);
    for_weights(ws, [&](size_t i, int64_t b0, int64_t b1) {
      for (int64_t r0 = 0; r0 < R; r0 += 16) {
        const int64_t rows = R - r0 < 16 ? R - r0 : 16;
        amx_blocks(xp + r0 * K, rows, K, weight_data<uint16_t>(ws, i),
                   o + r0 * N + ws.start[i] * kLanes, N, b0, b1);
      }
    });
  } else if (K % 2 == 0 && use_bf16_dot()) {
    const uint16_t* xp = bf16_data(x);
    for_weights(ws, [&](size_t i, int64_t b0, int64_t b1) {
      run_blocks_dot(R, xp, K, weight_data<uint16_t>(ws, i), o + ws.start[i] * kLanes, N, b0,
                     b1);
    });
  } else if (kVectorRegs == 32) {
    fma_rows<uint16_t, uint16_t>(R, bf16_data(x), K, ws, o);  // bf16 rows widened as read
  } else {
    // AVX2 broadcasts a bf16 row value in four instructions (two on the shuffle port), a
    // float32 one in a load: the rows widened once (exact), into a buffer of the call's own
    std::vector<float> xf(R * K);
    const uint16_t* xp = bf16_data(x);
    for (int64_t i = 0; i < R * K; ++i) xf[i] = load_row(xp + i);
    fma_rows<float, uint16_t>(R, xf.data(), K, ws, o);
  }
  return out;
}

// The rows times kFp8DotRowScale (exact: a power of two on bf16 values below 2^31), in a buffer
// of the call's own: a tensor op here (its allocation and dispatch) made SmolLM2's 120 fp8
// calls a step, 1 row, 5.4-7.1 ms where this takes 4.2-5.1 (alternating processes, noisy host).
std::vector<uint16_t> scaled_rows(const uint16_t* x, int64_t n) {
  std::vector<uint16_t> out(n);
  const float by = static_cast<float>(kFp8DotRowScale);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    value *= by;
    std::memcpy(&bits, &value, sizeof bits);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// x @ [W_0; W_1; ...].T for fp8 weights, each with its lane scales [NB_i, ceil(K / k_block), 16]
at::Tensor blocked_rows_fp8(const at::Tensor& x_in, at::TensorList w_in,
                            at::TensorList scales_in, int64_t k_block) {
  TORCH_CHECK(x_in.dim() == 2, "blocked_rows_fp8: expects x [R, K]");
  const int64_t R = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(k_block > 0, "blocked_rows_fp8: k_block must be positive");
  const Weights ws = check_weights(w_in, K, "blocked_rows_fp8");
  TORCH_CHECK(ws.w[0].scalar_type() == at::kFloat8_e4m3fn, "blocked_rows_fp8: w must be e4m3fn");
  TORCH_CHECK(scales_in.size() == ws.w.size(), "blocked_rows_fp8: one scales tensor a weight");
  const int64_t KB = (K + k_block - 1) / k_block, N = ws.blocks() * kLanes;
  std::vector<at::Tensor> scales;
  for (size_t i = 0; i < ws.w.size(); ++i) {
    const at::Tensor& s = scales_in[i];
    TORCH_CHECK(s.dim() == 3 && s.size(0) == ws.w[i].size(0) && s.size(1) == KB &&
                    s.size(2) == kLanes && s.scalar_type() == at::kFloat,
                "blocked_rows_fp8: scales must be float32 [NB, ceil(K / k_block), 16]");
    scales.push_back(s.contiguous());
  }
  at::Tensor out = at::empty({R, N}, x_in.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  // bf16 rows take VDPBF16PS where bf16 rows on bf16 weights do (K steps in pairs)
  if (x_in.scalar_type() == at::kBFloat16 && use_bf16_dot() && K % 2 == 0 && k_block % 2 == 0) {
    const std::vector<uint16_t> scaled = scaled_rows(bf16_data(x_in.contiguous()), R * K);
    const uint16_t* xp = scaled.data();
    for_weights(ws, [&](size_t i, int64_t b0, int64_t b1) {
      run_blocks_fp8_dot(R, xp, K, weight_data<uint8_t>(ws, i), scales[i].data_ptr<float>(), KB,
                         k_block, o + ws.start[i] * kLanes, N, b0, b1);
    });
    return out;
  }
  const at::Tensor x = x_in.contiguous().to(at::kFloat);
  const float* xp = x.data_ptr<float>();
  for_weights(ws, [&](size_t i, int64_t b0, int64_t b1) {
    run_blocks_fp8(R, xp, K, weight_data<uint8_t>(ws, i), scales[i].data_ptr<float>(), KB,
                   k_block, o + ws.start[i] * kLanes, N, b0, b1);
  });
  return out;
}

}  // namespace

// Whether bf16 rows go through AMX (and can: CPU and OS), after asking for `enable`. For the
// tests and the benchmark, which compare both paths in one process.
bool set_amx(bool enable) {
  amx_wanted.store(enable);
  return use_amx();
}

// Whether bf16 rows on bf16 weights take VDPBF16PS (and can: built with AVX512-BF16), after
// asking for `mode` (1 on, 0 off, -1 the host's default). For the tests and benchmarks, which
// compare the paths in one process.
bool set_bf16_dot(int64_t mode) {
  bf16_dot_wanted.store(mode < 0 ? -1 : (mode ? 1 : 0));
  return use_bf16_dot();
}

TORCH_LIBRARY(neffkit, m) {
  m.def("blocked_rows(Tensor x, Tensor[] w) -> Tensor");
  m.def("blocked_rows_fp8(Tensor x, Tensor[] w, Tensor[] scales, int k_block) -> Tensor");
  m.def("set_amx(bool enable) -> bool", &set_amx);
  m.def("set_bf16_dot(int mode) -> bool", &set_bf16_dot);
}

TORCH_LIBRARY_IMPL(neffkit, CPU, m) {
  m.impl("blocked_rows", &blocked_rows);
  m.impl("blocked_rows_fp8", &blocked_rows_fp8);
}
