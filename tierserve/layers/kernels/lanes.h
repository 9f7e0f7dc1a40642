// The 16-lane vectors the attention kernel (paged_attention.cpp) computes in, for the head
// sizes the compiler knows, and its sums and maxima across lanes.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The kernel's steps are lambdas over its shared state; left to itself GCC called them out of
// line, and a batch-64 decode took a third longer.
#define INLINE __attribute__((always_inline))

// SHUFFLE: __builtin_shufflevector is Clang's and GCC 12's; older GCC has __builtin_shuffle.
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, VecI{__VA_ARGS__})
#endif

namespace tierserve_lanes {

// GCC and Clang vector types: whole AVX-512 registers here, pairs of AVX2 ones elsewhere.

typedef float VecF __attribute__((vector_size(64)));
typedef uint32_t VecU __attribute__((vector_size(64)));
typedef uint16_t VecH __attribute__((vector_size(32)));
typedef int32_t VecI __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline VecF load_lanes(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline VecF load_lanes(const c10::BFloat16* p) {  // widened as wide() does: a shift
  VecH h;
  std::memcpy(&h, p, sizeof h);
  const VecU u = __builtin_convertvector(h, VecU) << 16;
  VecF v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
#if defined(__AVX2__) && !defined(__AVX512F__)
// Half a vector's lanes in one AVX2 register, widened as load_lanes does.
inline __m256 load_half(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_half(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif
// a * b + c, rounded once, in this order. Written out because -fassociative-math lets the
// compiler regroup a chain of `p += a * b` as it likes wherever the chain is inlined: the
// float32 scores' bits depended on which function held the loop.
inline VecF fmadd(VecF a, VecF b, VecF c) {
#if defined(__AVX512F__)
  return (VecF)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

// Lane j of the result is the sum of v[j]'s lanes: 16 dot products' sums in one tree of
// shuffles and adds (four levels, each adding the halves of pairs; the lanes end in
// bit-reversed order, undone last), where a sum per key took a tree each.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 holds a vector in two 8-lane halves, and GCC built the 16-lane shuffles below out of
// single floats (~490 instructions a tree, ~100 here). The same pairs added at each level, so
// the same bits, from in-lane shuffles of the halves.
struct Halves {
  __m256 lo, hi;
};
INLINE inline Halves halves(VecF v) {
  Halves h;
  std::memcpy(&h, &v, sizeof v);
  return h;
}
inline VecF transpose_sum(const VecF* v) {
  Halves w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k) {  // pair (a, b): [a's 8 halves' sums | b's]
    const Halves a = halves(v[2 * k]), b = halves(v[2 * k + 1]);
    w[k] = {_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi)};
  }
  auto quarters = [](__m256 a, __m256 b) INLINE {  // [a0-3 b0-3] + [a4-7 b4-7]
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  };
  for (int k = 0; k < 4; ++k)
    x[k] = {quarters(w[2 * k].lo, w[2 * k + 1].lo), quarters(w[2 * k].hi, w[2 * k + 1].hi)};
  auto pairs = [](__m256 a, __m256 b) INLINE {  // [a0 a1 b0 b1 ..] + [a2 a3 b2 b3 ..]
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
  };
  for (int k = 0; k < 2; ++k)
    y[k] = {pairs(x[2 * k].lo, x[2 * k + 1].lo), pairs(x[2 * k].hi, x[2 * k + 1].hi)};
  auto singles = [](__m256 a, __m256 b) INLINE {  // [a0 a2 b0 b2 ..] + [a1 a3 b1 b3 ..]
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  };
  // z's lanes 0-7 as [z0 z2 z1 z3 z4 z6 z5 z7], 8-15 likewise; the result's lane j is
  // z[0 8 4 12 2 10 6 14 | 1 9 5 13 3 11 7 15][j], its even lanes from the first half
  const __m256 lo = singles(y[0].lo, y[1].lo), hi = singles(y[0].hi, y[1].hi);
  const __m256i first = _mm256_setr_epi32(0, 0, 4, 4, 1, 1, 5, 5);
  const __m256i second = _mm256_setr_epi32(2, 2, 6, 6, 3, 3, 7, 7);
  const Halves out = {
      _mm256_blend_ps(_mm256_permutevar8x32_ps(lo, first), _mm256_permutevar8x32_ps(hi, first),
                      0xAA),
      _mm256_blend_ps(_mm256_permutevar8x32_ps(lo, second),
                      _mm256_permutevar8x32_ps(hi, second), 0xAA)};
  VecF r;
  std::memcpy(&r, &out, sizeof r);
  return r;
}
#else
inline VecF transpose_sum(const VecF* v) {
  VecF w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)  // pair (a, b): [a's 8 halves' sums | b's]
    w[k] = SHUFFLE(v[2 * k], v[2 * k + 1],
                   0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(v[2 * k], v[2 * k + 1],
                   8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)  // 4 sums each of 4 vectors
    x[k] = SHUFFLE(w[2 * k], w[2 * k + 1],
                   0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE(w[2 * k], w[2 * k + 1],
                   4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // 2 sums each of 8 vectors
    y[k] = SHUFFLE(x[2 * k], x[2 * k + 1],
                   0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE(x[2 * k], x[2 * k + 1],
                   2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const VecF z = SHUFFLE(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                 SHUFFLE(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return SHUFFLE(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#endif

// The largest of `n` floats (-inf for none), 16 lanes at a time: GCC left a max loop scalar
// even under `omp simd`, and a decode step spent an eighth of its attention there.
inline float max_of(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  float best = lowest;
  int64_t j = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2 holds a 16-lane select in two halves, and GCC built it lane by lane through the stack
  // (a tenth of a batch-64 decode's attention); vmaxps(v, m) is `v > m ? v : m` itself.
  __m256 m8 = _mm256_set1_ps(lowest);
  for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(x + j), m8);
  float m[8];
  _mm256_storeu_ps(m, m8);
  for (int i = 0; i < 8; ++i) best = m[i] > best ? m[i] : best;
#else
  VecF m = VecF{} + lowest;
  for (; j + kLanes <= n; j += kLanes) {
    const VecF v = load_lanes(x + j);
    m = v > m ? v : m;
  }
  for (int i = 0; i < kLanes; ++i) best = m[i] > best ? m[i] : best;
#endif
  for (; j < n; ++j) best = x[j] > best ? x[j] : best;
  return best;
}

}  // namespace tierserve_lanes
