// Multi-query attention over the paged KV pool, on CPU: 1 ... n query tokens per sequence,
// causal within the block, each query over its sequence's context read straight from the pool's
// pages (no gathered or padded copy). One op serves decode, prefill spans (up to
// paged_attention.py's limit) and speculative verification; the torch backend
// (layers/attention.py) is its oracle. A float32 or bf16 model's queries are read and its
// output written in the model's dtype; the arithmetic is float32 throughout, but for a bf16
// model's scores against a bf16 pool on a CPU with AVX512-BF16: exact bf16 products, summed
// in float32.
//
// The pool is [pages, layers, parts, kv_heads, page_size, dim] (cache/pool.py): one head's
// tokens of a page are one contiguous page_size x dim block, read once per (sequence, KV head)
// for all the query heads that share it (GQA) and all the block's query tokens. MLA attends in
// the latent space: one "KV head" whose keys are the whole latent (rank + rope) and whose values
// are its first `v_dim` values, so keys and values are the same block.
//
// Work items are (sequence, KV head, split of the context); a long context is split so that
// every thread has work at batch 1. With a head size the compiler knows (32, 64, 128) an item
// goes in two passes over its pages: every key's score (the rows of a KV head's query heads
// against each key read once; a prompt's many rows against the page's keys transposed once,
// each score summed in the same order, so a token gets the same bits in a prompt as in a
// decode step), each row's softmax once, then the values weighted, a prompt's
// rows 256 at a time and only up to the last key each tile of rows sees; other sizes
// (MLA's latent) keep a running max, sum and weighted sum per row (online softmax). A second
// pass merges the splits of a sequence that has several; an item alone in its (sequence,
// head) writes its output rows itself.
//
// This file holds the items, their order over the threads and the passes; the loops over a tile
// of query rows (scores, weighted values) are attention_tiles.h's, the 16-lane vectors lanes.h's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attention_tiles.h"
#include "bf16.h"
#include "exp.h"
#include "lanes.h"

namespace {

using tierserve_bf16::narrow;
using tierserve_bf16::wide;
using tierserve_math::exp_nonpositive;
using tierserve_lanes::kLanes;
using tierserve_lanes::max_of;
using tierserve_lanes::VecF;
using tierserve_attention::add_values;
using tierserve_attention::kBf16Scores;
using tierserve_attention::kScoreRows;
using tierserve_attention::kValueRows;
using tierserve_attention::score_rows;
using tierserve_attention::score_rows_bf16;
using tierserve_attention::kTransposedScores;
using tierserve_attention::score_row_transposed;
using tierserve_attention::score_row_transposed_bf16;
using tierserve_attention::transpose_key_pairs;
using tierserve_attention::transpose_keys;

// How the pool's bytes are read: its own dtype, or float8 values stored as bytes.
enum KVFormat : int64_t { kNative = 0, kFloat8E4M3 = 1, kFloat8E5M2 = 2 };

// A context is split every kSplitTokens, whatever the batch or the threads: a sequence's result
// is then the same bits in any batch (the splits' merge order never changes), and a long one
// still spreads over the threads at batch 1.
constexpr int64_t kSplitTokens = 512;
// How far ahead a thread asks for the pages it will read: the online path, in pages of its
// item; two passes, in blocks (one head's K or V of one page) of all the blocks it reads next.
constexpr int64_t kPrefetchPages = 2;
constexpr int64_t kAheadBlocks = 4;
// Query rows (tokens x the query heads of a KV head) a prefill item scores, weighs and sums
// at a time: 256 rows' weights over a split's 512 keys are 512 KB, which L2 holds.
constexpr int64_t kChunkRows = 256;
// From this many rows in a chunk (a prompt's span; decode has a KV head's group) its scores
// are taken with the page's keys transposed once (attention_tiles.h), the same bits.
constexpr int64_t kTransposedRows = 16;

struct Item {
  int64_t seq, head, first_page, end_page, scratch;  // scratch: first row of its partials
  bool alone;  // the only item of its (sequence, head): nothing to merge
};

template <typename E>
inline float dot(const float* a, const E* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * wide(b[i]);
  return s;
}

template <typename E>
inline void axpy(float* y, float a, const E* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * wide(x[i]);
}

// Asks for a block's cache lines ahead of their use. A head's block of one page is a few KB
// among a page's layers x parts x heads blocks: the hardware prefetchers stop at each block's
// end, so without this every block starts with a full memory latency and a decode step read its
// KV at about 40% of the copy bandwidth.
// Locality 3: into L1 (the online path's next pages); 2: into L2 (two passes' blocks ahead).
template <int Locality>
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, Locality);
}

inline void scale_row(float* y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// Each row's running weighted sum of values (at row + 2 of its `stride` floats) rescaled, plus
// its weights times the page's `n` values.
template <typename E>
void accumulate(float* part, int64_t stride, int64_t rows, const float* weights,
                const float* rescales, const E* values, int64_t dim, int64_t n,
                int64_t page_size, int64_t v_dim) {
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = part + r * stride + 2;
    scale_row(acc, rescales[r], v_dim);
    for (int64_t j = 0; j < n; ++j) {
      const float weight = weights[r * page_size + j];
      if (weight != 0.f) axpy(acc, weight, values + j * dim, v_dim);
    }
  }
}

// What the dot products and sums read a pool's values as: float32 and bf16 as they lie (a bf16
// value widens in a register, a shift), other formats converted to float32 per page block.
template <typename T>
using Read = std::conditional_t<std::is_same_v<T, c10::BFloat16>, c10::BFloat16, float>;

// A page block of `n` rows of `dim` as `Read<T>`: a view of a float32 or bf16 pool, else
// converted into `buffer`.
template <typename T>
const Read<T>* readable(const T* src, int64_t n, int64_t dim, float* buffer, const float* lut) {
  if constexpr (std::is_same_v<Read<T>, T>) {
    return src;
  } else {
    if constexpr (std::is_same_v<T, uint8_t>) {
      for (int64_t i = 0; i < n * dim; ++i) buffer[i] = lut[src[i]];
    } else {
      for (int64_t i = 0; i < n * dim; ++i) buffer[i] = static_cast<float>(src[i]);
    }
    return buffer;
  }
}

// `n` values of a float32 or bf16 tensor's data from element `at`, times `scale`, as float32.
inline void load_row(const void* data, bool bf16, int64_t at, int64_t n, float scale, float* dst) {
  if (bf16) {
    const c10::BFloat16* src = static_cast<const c10::BFloat16*>(data) + at;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = wide(src[d]) * scale;
  } else {
    const float* src = static_cast<const float*>(data) + at;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = src[d] * scale;
  }
}

// `n` float32 values rounded into a bf16 row.
inline void store_bf16_row(const float* src, c10::BFloat16* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = narrow<c10::BFloat16>(src[d]);
}

// Blocks a thread takes at a time: several a thread, so that threads that finish early take
// more.
constexpr int64_t kBlocksPerThread = 4;

// Where each block of `items` starts (then the end): consecutive items, each block about an
// equal share of the work, counted as the keys each query row sees in the item (a prompt's
// causal half is not scored), plus a page's worth an item.
inline std::vector<int64_t> balanced_blocks(const std::vector<Item>& items, int64_t group,
                                            const int64_t* q_len, const int64_t* kv_len,
                                            int64_t page_size) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<int64_t> cost(n + 1, 0);  // prefix sums
  for (int64_t i = 0; i < n; ++i) {
    const Item& w = items[i];
    const int64_t first_key = w.first_page * page_size;
    const int64_t keys = std::min(w.end_page * page_size, kv_len[w.seq]) - first_key;
    int64_t seen = 0;
    for (int64_t pos = kv_len[w.seq] - q_len[w.seq]; pos < kv_len[w.seq]; ++pos)
      seen += std::clamp<int64_t>(pos + 1 - first_key, 0, keys);
    cost[i + 1] = cost[i] + group * seen + page_size;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = std::max<int64_t>(1, std::min(n, threads * kBlocksPerThread));
  std::vector<int64_t> bounds{0};
  for (int64_t b = 1; b < blocks; ++b) {
    const int64_t share = cost[n] * b / blocks;
    const int64_t at = std::lower_bound(cost.begin(), cost.end(), share) - cost.begin();
    if (at > bounds.back() && at < n) bounds.push_back(at);
  }
  bounds.push_back(n);
  return bounds;
}

// DIM > 0: keys and values are DIM wide (GQA with a common head size), known to the compiler
// so its loops unroll into whole vectors; 0: any widths (MLA's latent).
template <typename T, int DIM>
void attend(const at::Tensor& q, const at::Tensor& cache, int64_t layer, int64_t k_part,
            int64_t v_part, int64_t v_dim_arg, const at::Tensor& page_table,
            const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
            int64_t window, double scale, int64_t kv_format, at::Tensor& out) {
  const int64_t seqs = q_start.size(0);
  const int64_t heads = q.size(1);
  const int64_t dim_k = DIM > 0 ? DIM : q.size(2);
  const int64_t v_dim = DIM > 0 ? DIM : v_dim_arg;
  const int64_t layers = cache.size(1), parts = cache.size(2), kv_heads = cache.size(3);
  const int64_t page_size = cache.size(4), dim = cache.size(5);
  const int64_t group = heads / kv_heads;
  const int64_t table_width = page_table.size(1);
  const T* kv = reinterpret_cast<const T*>(cache.data_ptr());
  // A bf16 model's queries are widened as they are read and its output rounded as it is
  // written: the same bits as converting around the call, without the two copies (unless its
  // scores are taken from its bf16 queries as they lie, below).
  const bool rows_bf16 = q.scalar_type() == at::kBFloat16;
  // bf16 queries against a bf16 pool: scored as they lie (score_rows_bf16), not widened.
  constexpr bool kBf16Pool = std::is_same_v<T, c10::BFloat16>;
  const bool bf16_scores = kBf16Scores<DIM> && kBf16Pool && rows_bf16;
  const void* qp = q.data_ptr();
  void* op = out.data_ptr();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* kl = kv_len.data_ptr<int64_t>();
  const int64_t q_row = q.stride(0), out_row = out.stride(0);
  const int64_t block = page_size * dim;  // one head's tokens of one page
  const bool same_block = k_part == v_part;
  constexpr bool kTwoPass = DIM > 0 && DIM % kLanes == 0;

  float lut[256];
  if (kv_format != kNative) {
    for (int i = 0; i < 256; ++i) {
      lut[i] = kv_format == kFloat8E4M3
                   ? static_cast<float>(c10::Float8_e4m3fn(i, c10::Float8_e4m3fn::from_bits()))
                   : static_cast<float>(c10::Float8_e5m2(i, c10::Float8_e5m2::from_bits()));
    }
  }

  // Work items: the pages a sequence's queries can see, split when long; with a window, the
  // pages before every query's window are never read.
  const int64_t per_split = std::max<int64_t>(1, kSplitTokens / page_size);
  std::vector<Item> items;
  int64_t scratch_rows = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t first_query = kl[s] - ql[s];  // the block's first position
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_query - window + 1) : 0;
    const int64_t first_page = first_key / page_size;
    const int64_t end_page = (kl[s] + page_size - 1) / page_size;
    const bool alone = end_page - first_page <= per_split;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t p = first_page; p < end_page; p += per_split) {
        items.push_back({s, h, p, std::min(end_page, p + per_split), scratch_rows, alone});
        scratch_rows += group * ql[s];
      }
    }
  }
  // Per partial row: running max, sum of weights, then the weighted sum of values.
  std::vector<float> scratch(scratch_rows * (v_dim + 2));
  const int64_t stride = v_dim + 2;

  // Where one head's block of part `part` of page p of a sequence lies, and its tokens.
  auto block_of = [&](int64_t seq, int64_t p, int64_t part, int64_t head) INLINE {
    const int64_t page = table[seq * table_width + p];
    return kv + ((((page * layers + layer) * parts) + part) * kv_heads + head) * block;
  };
  auto tokens_of = [&](int64_t seq, int64_t p) INLINE {
    return std::min(page_size, kl[seq] - p * page_size);
  };
  // Of the `n` keys from position `first_key`, the ones the query at `pos` sees: [lo, hi) of
  // them (its own position and before, within the window).
  auto visible = [&](int64_t pos, int64_t first_key, int64_t n) INLINE {
    const int64_t lo = window > 0 ? pos - window + 1 : 0;
    return std::pair{std::clamp<int64_t>(lo - first_key, 0, n),
                     std::clamp<int64_t>(pos + 1 - first_key, 0, n)};
  };

  // The online path: asks for the page this thread reads kPrefetchPages after page p of
  // items[it], in that item or a later one of [it, end).
  auto prefetch_ahead = [&](int64_t it, int64_t end, int64_t p) INLINE {
    const Item* next = &items[it];
    int64_t np = p + kPrefetchPages, next_it = it;
    while (next != nullptr && np >= next->end_page) {
      np = np - next->end_page;
      next = ++next_it < end ? &items[next_it] : nullptr;
      if (next != nullptr) np += next->first_page;
    }
    if (next == nullptr) return;
    const int64_t bytes = tokens_of(next->seq, np) * dim * static_cast<int64_t>(sizeof(T));
    prefetch_block<3>(block_of(next->seq, np, k_part, next->head), bytes);
    if (!same_block) prefetch_block<3>(block_of(next->seq, np, v_part, next->head), bytes);
  };
  // The blocks a thread reads in two passes, in order: each item's K pages, then its V pages.
  // `ahead` walks them kAheadBlocks in front of the reads, into L2, one block asked for as one
  // is read: memory reads stay in flight beside the arithmetic. Asking for a whole item's
  // pages as the one before starts (a burst of ~1,300 prefetches at batch 64) stalled the
  // thread until most had landed: six layers of a batch-64 decode (64 MB of KV) took 3.4 ms,
  // against 2.6 ms this way (between 2 and 8 blocks ahead, the same; into L1, 3.7 ms).
  struct Cursor {
    int64_t it, end, p;
    int part;
  };
  auto prefetch_next = [&](Cursor& c) INLINE {
    if (c.it >= c.end) return;
    const Item& w = items[c.it];
    const int64_t bytes = tokens_of(w.seq, c.p) * dim * static_cast<int64_t>(sizeof(T));
    prefetch_block<2>(block_of(w.seq, c.p, c.part == 0 ? k_part : v_part, w.head), bytes);
    if (++c.p < w.end_page) return;
    if (c.part == 0 && !same_block) {
      c.part = 1;
      c.p = w.first_page;
    } else if (++c.it < c.end) {
      c.part = 0;
      c.p = items[c.it].first_page;
    }
  };
  // Row r of item w's output (token r / group, head r % group): `sums` / `total`, in place.
  auto write_row = [&](const Item& w, int64_t r, float* sums, float total) INLINE {
    const int64_t at = (qs[w.seq] + r / group) * out_row + (w.head * group + r % group) * v_dim;
    scale_row(sums, 1.f / total, v_dim);
    if (rows_bf16)
      store_bf16_row(sums, static_cast<c10::BFloat16*>(op) + at, v_dim);
    else
      std::memcpy(static_cast<float*>(op) + at, sums, v_dim * sizeof(float));
  };

  // Rows [c0, c1)'s scores against a page's first `keys_seen` keys, 16 keys at a time with
  // the keys transposed once for all the rows (attention_tiles.h): `row_seen(r)` keys of the
  // page are stored for row r, which sees them.
  auto transposed_scores = [&](const auto* keys, int64_t keys_seen, auto&& row_seen, int64_t c0,
                               int64_t c1, const float* queries, float* page_scores,
                               int64_t tokens) INLINE {
    if constexpr (kTransposedScores && DIM > 0) {
      alignas(64) float kt[DIM * kLanes];
      for (int64_t j0 = 0; j0 < keys_seen; j0 += kLanes) {
        const int64_t n = std::min(kLanes, keys_seen - j0);
        const auto* group_keys = keys + j0 * dim;
        if constexpr (kBf16Scores<DIM> && kBf16Pool) {
          if (bf16_scores) {
            auto* pairs = reinterpret_cast<uint32_t*>(kt);
            transpose_key_pairs<DIM>(group_keys, dim, n, pairs);
            const auto* rows_q = reinterpret_cast<const c10::BFloat16*>(queries);
            for (int64_t r = c0; r < c1; ++r) {
              const int64_t seen = row_seen(r) - j0;
              if (seen > 0)
                score_row_transposed_bf16<DIM>(rows_q + r * DIM, pairs, std::min(seen, kLanes),
                                               static_cast<float>(scale),
                                               page_scores + r * tokens + j0);
            }
            continue;
          }
        }
        transpose_keys<DIM>(group_keys, dim, n, kt);
        for (int64_t r = c0; r < c1; ++r) {
          const int64_t seen = row_seen(r) - j0;
          if (seen > 0)
            score_row_transposed<DIM>(queries + r * DIM, kt, std::min(seen, kLanes),
                                      page_scores + r * tokens + j0);
        }
      }
    }
  };

  // Two passes over an item's pages (DIM known): every row's score of every key into
  // `weights` (rows x the item's tokens: at most kSplitTokens each, so it stays in cache), each
  // row's softmax once, then the values weighted, kValueRows rows' sums at a time in registers.
  auto two_pass = [&](int64_t it, const float* queries, float* part,
                      std::vector<float>& weights, float* k_buf, float* v_buf,
                      Cursor& ahead) INLINE {
    if constexpr (DIM > 0) {
      const Item& w = items[it];
      const int64_t rows = group * ql[w.seq], first_query = kl[w.seq] - ql[w.seq];
      const int64_t base = w.first_page * page_size;
      const int64_t tokens = std::min(w.end_page * page_size, kl[w.seq]) - base;
      const int64_t chunk = std::min(rows, kChunkRows);
      weights.resize(chunk * tokens);
      // A prefill span's rows in chunks: one chunk's weights stay in L2, and its keys and
      // values are read again from cache by the next.
      for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
        const int64_t c1 = std::min(rows, c0 + chunk);
        float* chunk_weights = weights.data() - c0 * tokens;  // indexed by the item's row
        // The chunk's last query sees the most keys; a page past them is neither scored nor read.
        const int64_t last_query = first_query + (c1 - 1) / group;
        for (int64_t p = w.first_page; p < w.end_page; ++p) {
          if (c0 == 0) prefetch_next(ahead);  // later chunks read the item's keys from cache
          const int64_t n = tokens_of(w.seq, p);
          const int64_t first_key = base + (p - w.first_page) * page_size;
          if (visible(last_query, first_key, n).second == 0) continue;
          const auto* keys = readable(block_of(w.seq, p, k_part, w.head), n, dim, k_buf, lut);
          float* page_scores = chunk_weights + (p - w.first_page) * page_size;
          if constexpr (kTransposedScores) {
            if (c1 - c0 >= kTransposedRows) {
              transposed_scores(keys, visible(last_query, first_key, n).second, [&](int64_t r) {
                return visible(first_query + r / group, first_key, n).second;
              }, c0, c1, queries, page_scores, tokens);
              continue;
            }
          }
          constexpr int SR = kScoreRows<DIM>;
          for (int64_t r = c0; r < c1; r += SR) {
            // Only the keys the tile's last query sees: a prefill span's causal half is never
            // scored (the softmax zeroes the weights past each row's last key).
            const int64_t tile = std::min<int64_t>(SR, c1 - r);
            const int64_t seen = visible(first_query + (r + tile - 1) / group, first_key, n).second;
            if (seen == 0) continue;
            float* scores = page_scores + r * tokens;
            if constexpr (kBf16Scores<DIM> && kBf16Pool) {
              if (bf16_scores) {
                const auto* rows_q = reinterpret_cast<const c10::BFloat16*>(queries) + r * DIM;
                score_rows_bf16<DIM, SR>(rows_q, tile, keys, dim, seen, static_cast<float>(scale),
                                         scores, tokens);
                continue;
              }
            }
            score_rows<DIM, SR>(queries + r * DIM, tile, keys, dim, seen, scores, tokens);
          }
        }
        for (int64_t r = c0; r < c1; ++r) {
          // The item's keys this row's query sees; weight 0 for the rest.
          const auto [j_lo, j_hi] = visible(first_query + r / group, base, tokens);
          float* weight = chunk_weights + r * tokens;
          const float best = max_of(weight + j_lo, j_hi - j_lo);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = j_lo; j < j_hi; ++j) {
            weight[j] = exp_nonpositive(weight[j] - best);
            sum += weight[j];
          }
          std::fill(weight, weight + j_lo, 0.f);
          std::fill(weight + std::max(j_lo, j_hi), weight + tokens, 0.f);
          part[r * stride] = best;
          part[r * stride + 1] = sum;
        }
        constexpr int64_t R = kValueRows<DIM>;
        for (int64_t r0 = c0; r0 < c1; r0 += R) {
          const int64_t tile = std::min(R, c1 - r0);
          VecF sums[R][DIM / kLanes] = {};
          for (int64_t p = w.first_page; p < w.end_page; ++p) {
            // Later tiles and chunks read the item's values from cache.
            if (r0 == 0) prefetch_next(ahead);
            const int64_t n = tokens_of(w.seq, p);
            const int64_t first_key = (p - w.first_page) * page_size;
            // Keys past the tile's last query weigh 0 for all its rows: not read (half of a
            // prefill span's values).
            const int64_t tile_query = first_query + (r0 + tile - 1) / group;
            const int64_t seen = visible(tile_query, base + first_key, n).second;
            if (seen == 0) continue;
            const auto* values =
                readable(block_of(w.seq, p, v_part, w.head), n, dim, v_buf, lut);
            const float* tile_weights = chunk_weights + r0 * tokens + first_key;
            add_values<DIM>(sums, tile_weights, tokens, tile, values, dim, seen);
          }
          for (int64_t t = 0; t < tile; ++t) {
            float* row = part + (r0 + t) * stride;
            std::memcpy(row + 2, sums[t], sizeof sums[t]);
            if (w.alone) write_row(w, r0 + t, row + 2, row[1]);
          }
        }
      }
    }
  };

  // Other head sizes: page by page, each row's running max, sum and weighted sum of values
  // (online softmax) in its partial row.
  auto online = [&](int64_t it, int64_t end, const float* queries, float* part,
                    std::vector<float>& weights, std::vector<float>& rescales, float* k_buf,
                    float* v_buf) INLINE {
    const Item& w = items[it];
    const int64_t rows = group * ql[w.seq], first_query = kl[w.seq] - ql[w.seq];
    rescales.resize(rows);
    weights.resize(rows * page_size);
    for (int64_t p = w.first_page; p < w.end_page; ++p) {
      prefetch_ahead(it, end, p);
      const int64_t n = tokens_of(w.seq, p);
      const auto* keys = readable(block_of(w.seq, p, k_part, w.head), n, dim, k_buf, lut);
      const auto* values =
          same_block ? keys : readable(block_of(w.seq, p, v_part, w.head), n, dim, v_buf, lut);
      // Each row's weights over the page's keys (0 where it sees none) and the factor its
      // running sum is rescaled by; the sums are then updated for all rows together.
      for (int64_t r = 0; r < rows; ++r) {
        // The page's keys this row's query sees.
        const auto [j_lo, j_hi] = visible(first_query + r / group, p * page_size, n);
        float* weight = weights.data() + r * page_size;
        std::fill(weight, weight + page_size, 0.f);
        rescales[r] = 1.f;
        if (j_lo >= j_hi) continue;
        float* row = part + r * stride;
        const float* query = queries + r * dim_k;
        float best = row[0];
        for (int64_t j = j_lo; j < j_hi; ++j) {
          weight[j] = dot(query, keys + j * dim, dim_k);
          best = std::max(best, weight[j]);
        }
        const float rescale = exp_nonpositive(row[0] - best);  // 0 on the first keys
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = j_lo; j < j_hi; ++j) {
          weight[j] = exp_nonpositive(weight[j] - best);
          sum += weight[j];
        }
        rescales[r] = rescale;
        row[0] = best;
        row[1] = row[1] * rescale + sum;
      }
      accumulate(part, stride, rows, weights.data(), rescales.data(), values, dim, n, page_size,
                 v_dim);
    }
  };

  // Blocks of consecutive items of about equal work, several a thread, taken in turn by
  // whichever thread is free: a prefill span's items cost hundreds of decode rows' (an even
  // split by count left one thread with all of them), and a thread the OS takes away for a
  // while (a busy API process or client) leaves its blocks to the other.
  const std::vector<int64_t> bounds = balanced_blocks(items, group, ql, kl, page_size);
  const int64_t blocks = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> next_block{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> k_buf(block), v_buf(block), weights, rescales, queries;
    for (int64_t b = next_block++; b < blocks; b = next_block++) {
      const int64_t end = bounds[b + 1];
      Cursor ahead{bounds[b], end, items[bounds[b]].first_page, 0};
      for (int64_t i = 0; i < kAheadBlocks && kTwoPass; ++i) prefetch_next(ahead);
      for (int64_t it = bounds[b]; it < end; ++it) {
        const Item& w = items[it];
        const int64_t rows = group * ql[w.seq];
        // This item's queries, scaled once (bf16 ones that are scored as they lie: copied,
        // the scale applied to their scores): row r is token r / group, head r % group.
        queries.resize(rows * dim_k);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (qs[w.seq] + r / group) * q_row + (w.head * group + r % group) * dim_k;
          if (bf16_scores)  // as bf16: the rows lie packed in the buffer's first half
            std::memcpy(reinterpret_cast<c10::BFloat16*>(queries.data()) + r * dim_k,
                        static_cast<const c10::BFloat16*>(qp) + at, dim_k * sizeof(c10::BFloat16));
          else
            load_row(qp, rows_bf16, at, dim_k, static_cast<float>(scale),
                     queries.data() + r * dim_k);
        }
        float* part = scratch.data() + w.scratch * stride;
        for (int64_t r = 0; r < rows; ++r) {
          part[r * stride] = -std::numeric_limits<float>::infinity();
          std::fill(part + r * stride + 1, part + (r + 1) * stride, 0.f);
        }
        if constexpr (kTwoPass)
          two_pass(it, queries.data(), part, weights, k_buf.data(), v_buf.data(), ahead);
        else
          online(it, end, queries.data(), part, weights, rescales, k_buf.data(), v_buf.data());
      }
    }
  });

  // Merge the splits of each (sequence, KV head) that has several, items [first, last), into
  // its output rows (two passes wrote a lone item's already).
  std::vector<std::pair<int64_t, int64_t>> splits;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    if (kTwoPass && items[i].alone) continue;
    if (splits.empty() || items[i].seq != items[i - 1].seq || items[i].head != items[i - 1].head)
      splits.push_back({i, i + 1});
    else
      splits.back().second = i + 1;
  }
  if (splits.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(splits.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(v_dim);
    for (int64_t g = begin; g < end; ++g) {
      const auto [first, last] = splits[g];
      const int64_t rows = group * ql[items[first].seq];
      for (int64_t r = 0; r < rows; ++r) {
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t i = first; i < last; ++i)
          best = std::max(best, scratch[(items[i].scratch + r) * stride]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t i = first; i < last; ++i) {
          const float* row = scratch.data() + (items[i].scratch + r) * stride;
          if (row[1] == 0.f) continue;
          const float w = exp_nonpositive(row[0] - best);
          total += row[1] * w;
          axpy(merged.data(), w, row + 2, v_dim);
        }
        write_row(items[first], r, merged.data(), total);
      }
    }
  });
}

template <int DIM>
void dispatch(const at::Tensor& q, const at::Tensor& cache, int64_t layer, int64_t k_part,
              int64_t v_part, int64_t v_dim, const at::Tensor& page_table,
              const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
              int64_t window, double scale, int64_t kv_format, at::Tensor& out) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      attend<float, DIM>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len,
                         kv_len, window, scale, kv_format, out);
      break;
    case at::kBFloat16:
      attend<c10::BFloat16, DIM>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start,
                                 q_len, kv_len, window, scale, kv_format, out);
      break;
    case at::kHalf:
      attend<c10::Half, DIM>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len,
                             kv_len, window, scale, kv_format, out);
      break;
    case at::kByte:
      TORCH_CHECK(kv_format != kNative, "a byte pool holds float8 values");
      attend<uint8_t, DIM>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len,
                           kv_len, window, scale, kv_format, out);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", cache.scalar_type());
  }
}

void paged_attention(const at::Tensor& q, const at::Tensor& cache, int64_t layer, int64_t k_part,
                     int64_t v_part, int64_t v_dim, const at::Tensor& page_table,
                     const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& kv_len, int64_t window, double scale, int64_t kv_format,
                     at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_attention runs on CPU");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == q.scalar_type(),
              "queries and output: float32 or bfloat16, one dtype");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [T, H, D]");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == v_dim, "out: [T, H, Dv]");
  TORCH_CHECK(cache.dim() == 6 && cache.is_contiguous(), "cache: the pool's page buffer");
  TORCH_CHECK(q.size(2) <= cache.size(5) && v_dim <= cache.size(5), "head dims exceed the pool's");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0, "query heads are a multiple of KV heads");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.is_contiguous(), "page table");
  for (const at::Tensor* t : {&q_start, &q_len, &kv_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "int64 index tensors");
  if (q_start.size(0) == 0) return;
  const int64_t fixed = q.size(2) == v_dim ? v_dim : 0;
  if (fixed == 32) {
    dispatch<32>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len, kv_len,
                 window, scale, kv_format, out);
  } else if (fixed == 64) {
    dispatch<64>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len, kv_len,
                 window, scale, kv_format, out);
  } else if (fixed == 128) {
    dispatch<128>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len, kv_len,
                  window, scale, kv_format, out);
  } else {
    dispatch<0>(q, cache, layer, k_part, v_part, v_dim, page_table, q_start, q_len, kv_len,
                window, scale, kv_format, out);
  }
}

// Whether a bf16 model's scores are taken from its bf16 queries as they lie (score_rows_bf16):
// then its output is not the bits of widening its queries first.
bool bf16_scores() { return kBf16Scores<32>; }

}  // namespace

TORCH_LIBRARY(tierserve, m) {
  m.def("bf16_scores() -> bool", &bf16_scores);
  m.def(
      "paged_attention(Tensor q, Tensor cache, int layer, int k_part, int v_part, int v_dim, "
      "Tensor page_table, Tensor q_start, Tensor q_len, Tensor kv_len, int window, float scale, "
      "int kv_format, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tierserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
