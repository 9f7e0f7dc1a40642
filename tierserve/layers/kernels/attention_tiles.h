// The attention kernel's (paged_attention.cpp) inner loops over a tile of query rows: their
// scores against a page block's keys, and their weights times its values, in 16-lane vectors.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "lanes.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tierserve_attention {

using tierserve_lanes::fmadd;
using tierserve_lanes::kLanes;
using tierserve_lanes::load_lanes;
#if defined(__AVX2__) && !defined(__AVX512F__)
using tierserve_lanes::load_half;
#endif
using tierserve_lanes::transpose_sum;
using tierserve_lanes::VecF;
using tierserve_bf16::wide;

// Rows scored together against each key read once: R rows' queries stay in registers and
// each key is loaded once for all of them (GQA's query heads share their KV head). 16 / R keys
// x R rows of products make one shuffle tree's 16 scores.
template <int DIM>
constexpr int kScoreRows = DIM == 32 ? 4 : DIM == 64 ? 2 : 1;

// The loop both score paths share. `products_of(j, out, step)` leaves key j's R product
// vectors (one per row) at out[0], out[step], ...; K keys' make one shuffle tree's 16 scores,
// each passed through `finish` (the scale, or nothing) as it is stored; the keys short of a
// tree make one more, the missing keys' products 0, so that every score is summed in the
// tree's order (transposed_scores below relies on it). Inlined whole, so that the callers'
// queries stay in registers.
template <int R, typename Products, typename Finish>
INLINE inline void score_keys(int64_t rows, int64_t n, float* out, int64_t ld,
                              Products&& products_of, Finish&& finish) {
  constexpr int K = kLanes / R;
  int64_t j = 0;
  for (; j + K <= n; j += K) {
    VecF products[kLanes];
    for (int t = 0; t < K; ++t) products_of(j + t, products + t, K);
    float scores[kLanes];
    const VecF s = finish(transpose_sum(products));
    std::memcpy(scores, &s, sizeof s);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + r * ld + j, scores + r * K, K * sizeof(float));
  }
  if (j < n) {
    VecF products[kLanes] = {};
    for (int t = 0; j + t < n; ++t) products_of(j + t, products + t, K);
    float scores[kLanes];
    const VecF s = finish(transpose_sum(products));
    std::memcpy(scores, &s, sizeof s);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + r * ld + j, scores + r * K, (n - j) * sizeof(float));
  }
}

// `rows` (up to R) rows' scores (queries DIM apart, outputs `ld` apart) against `n` keys.
template <int DIM, int R, typename E>
inline void score_rows(const float* queries, int64_t rows, const E* keys, int64_t stride,
                       int64_t n, float* out, int64_t ld) {
  constexpr int L = DIM / kLanes;
  VecF q[R][L];
  for (int r = 0; r < R; ++r)  // a tile's missing rows repeat its last: never written out
    for (int l = 0; l < L; ++l)
      q[r][l] = load_lanes(queries + std::min<int64_t>(r, rows - 1) * DIM + l * kLanes);
  auto products_of = [&](int64_t j, VecF* out_rows, int step) INLINE {
    VecF key[L];
    for (int l = 0; l < L; ++l) key[l] = load_lanes(keys + j * stride + l * kLanes);
    for (int r = 0; r < R; ++r) {
      VecF p = q[r][0] * key[0];
      for (int l = 1; l < L; ++l) p = fmadd(q[r][l], key[l], p);
      out_rows[r * step] = p;
    }
  };
  score_keys<R>(rows, n, out, ld, products_of, [](auto x) INLINE { return x; });
}

// A bf16 model's scores on a CPU with AVX512-BF16: its bf16 queries, unscaled, against bf16
// keys as they lie in the pool. vdpbf16ps multiplies 32 query and key values exactly and adds
// them, two to a lane, in float32: half the multiply-adds of widening both first, and no
// widening; the scale is applied to each score. Where the CPU lacks the instruction, bf16
// queries are widened and scaled like float32 ones.
#if defined(__AVX512BF16__)
template <int DIM>
constexpr bool kBf16Scores = DIM > 0 && DIM % 32 == 0;

inline __m512bh load_bf16_pairs(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// `rows` (up to R) rows' scores against `n` keys, as score_rows's, from bf16 queries.
template <int DIM, int R>
inline void score_rows_bf16(const c10::BFloat16* queries, int64_t rows,
                            const c10::BFloat16* keys, int64_t stride, int64_t n, float scale,
                            float* out, int64_t ld) {
  constexpr int L = DIM / 32;  // a register holds 32 bf16
  __m512bh q[R][L];
  for (int r = 0; r < R; ++r)  // a tile's missing rows repeat its last: never written out
    for (int l = 0; l < L; ++l)
      q[r][l] = load_bf16_pairs(queries + std::min<int64_t>(r, rows - 1) * DIM + l * 32);
  auto products_of = [&](int64_t j, VecF* out_rows, int step) INLINE {
    __m512bh key[L];
    for (int l = 0; l < L; ++l) key[l] = load_bf16_pairs(keys + j * stride + l * 32);
    for (int r = 0; r < R; ++r) {
      __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[r][0], key[0]);
      for (int l = 1; l < L; ++l) p = _mm512_dpbf16_ps(p, q[r][l], key[l]);
      out_rows[r * step] = (VecF)p;
    }
  };
  score_keys<R>(rows, n, out, ld, products_of, [scale](auto x) INLINE { return x * scale; });
}

#else
template <int DIM>
constexpr bool kBf16Scores = false;

template <int DIM, int R>
inline void score_rows_bf16(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t,
                            int64_t, float, float*, int64_t) {}
#endif

#if defined(__AVX512F__)
// Prefill's scores with the keys across lanes: a page's keys transposed once ([dim][16 keys]),
// then each of a chunk's rows multiplies its query's dims, broadcast, into them: no shuffle
// tree a tile of rows and keys, and the transposition is paid once for up to kChunkRows rows.
// Each score is summed in the very order score_keys's tree sums it (the same products, the
// same pairs added at each level, each add rounded by itself), so a token's scores are the
// same bits in a prompt's span as in a decode step: greedy outputs stay equal between plain
// decoding, speculative verification, chunked prefill and a prefix-cache hit.
constexpr bool kTransposedScores = true;

// Adds kept as written: -fassociative-math would regroup a tree of plain vector adds.
INLINE inline VecF add_kept(VecF a, VecF b) {
  return (VecF)_mm512_add_round_ps((__m512)a, (__m512)b,
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The sum of products[0..15] lane by lane, grouped as transpose_sum groups each vector's lanes:
// lane i with i + 8, then those pairs 4 apart, then 2, then 1.
template <typename Product>
INLINE inline VecF tree_sum(Product&& product) {
  auto quad = [&](int i) INLINE {  // (p_i + p_i+8) + (p_i+4 + p_i+12)
    return add_kept(add_kept(product(i), product(i + 8)),
                    add_kept(product(i + 4), product(i + 12)));
  };
  auto half = [&](int i) INLINE { return add_kept(quad(i), quad(i + 2)); };
  return add_kept(half(0), half(1));
}

// `n` (up to 16) keys `stride` apart, DIM wide, into kt[d * 16 + j] as float32 (the same
// values load_lanes gives); the missing keys' lanes are 0.
template <int DIM, typename E>
inline void transpose_keys(const E* keys, int64_t stride, int64_t n, float* kt) {
  for (int d = 0; d < DIM; ++d) {
    float* lane = kt + d * kLanes;
    for (int64_t j = 0; j < n; ++j) lane[j] = wide(keys[j * stride + d]);
    for (int64_t j = n; j < kLanes; ++j) lane[j] = 0.f;
  }
}

// One row's scores against the 16 transposed keys, the first `n` stored.
template <int DIM>
INLINE inline void score_row_transposed(const float* query, const float* kt, int64_t n,
                                        float* out) {
  constexpr int L = DIM / kLanes;
  const VecF s = tree_sum([&](int i) INLINE {
    VecF p = (VecF)_mm512_set1_ps(query[i]) * load_lanes(kt + i * kLanes);
    for (int l = 1; l < L; ++l)
      p = fmadd((VecF)_mm512_set1_ps(query[l * kLanes + i]),
                load_lanes(kt + (l * kLanes + i) * kLanes), p);
    return p;
  });
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), (__m512)s);
}
#else
constexpr bool kTransposedScores = false;

template <int DIM, typename E>
inline void transpose_keys(const E*, int64_t, int64_t, float*) {}
template <int DIM>
inline void score_row_transposed(const float*, const float*, int64_t, float*) {}
#endif

#if defined(__AVX512BF16__)
// A bf16 model's keys as bf16 pairs: kt[m * 16 + j] is key j's dims 2m and 2m + 1, the pair
// one vdpbf16ps lane multiplies; the missing keys' lanes are 0.
template <int DIM>
inline void transpose_key_pairs(const c10::BFloat16* keys, int64_t stride, int64_t n,
                                uint32_t* kt) {
  for (int m = 0; m < DIM / 2; ++m) {
    uint32_t* lane = kt + m * kLanes;
    for (int64_t j = 0; j < n; ++j) std::memcpy(lane + j, keys + j * stride + 2 * m, 4);
    for (int64_t j = n; j < kLanes; ++j) lane[j] = 0;
  }
}

// score_row_transposed's for score_rows_bf16's products: each pair of the query, broadcast,
// against the keys' pairs, then the scale.
template <int DIM>
INLINE inline void score_row_transposed_bf16(const c10::BFloat16* query, const uint32_t* kt,
                                             int64_t n, float scale, float* out) {
  constexpr int L = DIM / 32;
  uint32_t pairs[DIM / 2];
  std::memcpy(pairs, query, sizeof pairs);
  auto bf16_pairs = [](const uint32_t* p) INLINE {
    return (__m512bh)_mm512_loadu_si512(p);
  };
  const VecF s = tree_sum([&](int i) INLINE {
    __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i])),
                                bf16_pairs(kt + i * kLanes));
    for (int l = 1; l < L; ++l)
      p = _mm512_dpbf16_ps(p, (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[l * kLanes + i])),
                           bf16_pairs(kt + (l * kLanes + i) * kLanes));
    return (VecF)p;
  }) * scale;
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), (__m512)s);
}
#else
template <int DIM>
inline void transpose_key_pairs(const c10::BFloat16*, int64_t, int64_t, uint32_t*) {}
template <int DIM>
inline void score_row_transposed_bf16(const c10::BFloat16*, const uint32_t*, int64_t, float,
                                      float*) {}
#endif

// Rows whose value sums stay in registers together: 8 vectors' worth.
template <int DIM>
constexpr int64_t kValueRows = std::max<int64_t>(1, std::min<int64_t>(4, 8 / (DIM / kLanes)));

// `rows` (up to R) rows' weights (rows `ld` apart) times `n` values of a block, added to sums.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// In AVX2's 8-lane registers, each weight broadcast once: GCC built `weight * vector` of a
// 16-lane vector from 16 single-float stores, reloaded whole (a stalled store forward each),
// and moved the sums through the stack; a batch-64 decode's attention took twice torch's time.
// The same fused multiply-add per lane, so the same bits.
template <int DIM, int64_t R, typename E>
inline void add_values(VecF (&sums)[R][DIM / kLanes], const float* weights, int64_t ld,
                       int64_t rows, const E* values, int64_t stride, int64_t n) {
  constexpr int H = DIM / 8;
  __m256 acc[R][H];
  for (int64_t t = 0; t < R; ++t)
    for (int h = 0; h < H; ++h)
      acc[t][h] = _mm256_loadu_ps(reinterpret_cast<const float*>(sums[t]) + 8 * h);
  const float* w[R];  // a tile's missing rows repeat its last: their sums are never read
  for (int64_t t = 0; t < R; ++t) w[t] = weights + std::min(t, rows - 1) * ld;
  for (int64_t j = 0; j < n; ++j) {
    __m256 v[H];
    for (int h = 0; h < H; ++h) v[h] = load_half(values + j * stride + 8 * h);
    for (int64_t t = 0; t < R; ++t) {
      const __m256 weight = _mm256_set1_ps(w[t][j]);
      for (int h = 0; h < H; ++h) acc[t][h] = _mm256_fmadd_ps(weight, v[h], acc[t][h]);
    }
  }
  for (int64_t t = 0; t < R; ++t)
    for (int h = 0; h < H; ++h)
      _mm256_storeu_ps(reinterpret_cast<float*>(sums[t]) + 8 * h, acc[t][h]);
}
#else
template <int DIM, int64_t R, typename E>
inline void add_values(VecF (&sums)[R][DIM / kLanes], const float* weights, int64_t ld,
                       int64_t rows, const E* values, int64_t stride, int64_t n) {
  constexpr int L = DIM / kLanes;
  // In locals, which stay in registers: for all the compiler knows `sums` aliases `weights`.
  VecF acc[R][L];
  for (int64_t t = 0; t < R; ++t)
    for (int l = 0; l < L; ++l) acc[t][l] = sums[t][l];
  const float* w[R];  // a tile's missing rows repeat its last: their sums are never read
  for (int64_t t = 0; t < R; ++t) w[t] = weights + std::min(t, rows - 1) * ld;
  for (int64_t j = 0; j < n; ++j) {
    VecF v[L];
    for (int l = 0; l < L; ++l) v[l] = load_lanes(values + j * stride + l * kLanes);
    for (int64_t t = 0; t < R; ++t)
      for (int l = 0; l < L; ++l) acc[t][l] += w[t][j] * v[l];
  }
  for (int64_t t = 0; t < R; ++t)
    for (int l = 0; l < L; ++l) sums[t][l] = acc[t][l];
}
#endif

}  // namespace tierserve_attention
