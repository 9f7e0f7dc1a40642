// The small per-layer ops of a decode step, fused, on CPU: RMSNorm, NeoX rotary on q and k in
// place, the store of a step's new K and V into the pool's pages, and the gated MLP's
// SiLU(gate) x up. Each replaces several torch ops of a few microseconds apiece (a decode step
// of the demo model ran ~150 of them); layers/norm.py, layers/rotary.py, layers/mlp.py and
// cache/pool.py keep the torch code as their oracles. A float32 or a bf16 model's rows are
// taken; arithmetic is float32 in both.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "exp.h"

namespace {

using tierserve_bf16::narrow;
using tierserve_bf16::wide;
using tierserve_math::exp_nonpositive;

// Rows of `x` ([N, dim] or [N, H, dim], the last dimension contiguous): row r.
template <typename T>
struct Rows {
  T* base;
  int64_t count, inner, outer_stride, inner_stride;
  T* row(int64_t r) const { return base + (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& x) {
  TORCH_CHECK(x.stride(-1) == 1, "last dim contiguous");
  T* base = x.data_ptr<T>();
  if (x.dim() == 2) return {base, x.size(0), 1, x.stride(0), 0};
  TORCH_CHECK(x.dim() == 3, "[N, dim] or [N, H, dim]");
  return {base, x.size(0) * x.size(1), x.size(1), x.stride(0), x.stride(1)};
}

// Torch's dtypes this file's ops take: a float32 or a bf16 model's rows.
template <typename F>
void for_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "float32 or bfloat16 rows, not ", dtype);
    f(c10::BFloat16{});
  }
}

// out = x / sqrt(mean(x^2) + eps) * weight, per row, in float32. A bf16 row is normalised,
// rounded, then multiplied by the weight and rounded again: transformers' order, which
// layers/norm.py's torch code keeps.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const Rows<T> in = rows_of<T>(x);
  const int64_t dim = x.size(-1);
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, in.count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = in.row(r);
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) squares += wide(src[d]) * wide(src[d]);
      const float inv = 1.f / std::sqrt(squares / dim + eps);
      T* dst = o + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d)
        dst[d] = narrow<T>(wide(narrow<T>(wide(src[d]) * inv)) * wide(w[d]));
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "x, weight and out in one dtype");
  TORCH_CHECK(weight.numel() == dim && weight.is_contiguous(), "weight: [dim]");
  TORCH_CHECK(out.is_contiguous() && out.numel() == x.numel(), "out: contiguous, x's size");
  for_dtype(x.scalar_type(), [&](auto tag) {
    rms_norm_rows<decltype(tag)>(x, weight, static_cast<float>(eps), out);
  });
}

// x's rows rotated in place in the half-rotation layout: (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin), token t's row of cos and sin ([T, dim / 2], float32), in float32.
template <typename T>
void rotate_rows(const at::Tensor& x, const float* cos, const float* sin, int64_t half) {
  const Rows<T> rows = rows_of<T>(x);
  const int64_t heads = rows.inner;
  at::parallel_for(0, rows.count, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* a = rows.row(r);
      T* b = a + half;
      const float* c = cos + (r / heads) * half;
      const float* s = sin + (r / heads) * half;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = wide(a[d]), x2 = wide(b[d]);
        a[d] = narrow<T>(x1 * c[d] - x2 * s[d]);
        b[d] = narrow<T>(x2 * c[d] + x1 * s[d]);
      }
    }
  });
}

void rotary_neox_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = cos.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos, sin: [T, dim / 2] float32");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k in one dtype");
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == cos.size(0) && x->size(2) == 2 * half,
                "q, k: [T, heads, 2 * (dim / 2)]");
  for_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotate_rows<T>(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
    rotate_rows<T>(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  });
}

// Token t's rows of each part ([T, heads, dim], the pool's dtype) into slot slots[t] of layer
// `layer` of the pool ([pages, layers, parts, heads, page_size, dim]).
void kv_write(at::Tensor cache, int64_t layer, const at::Tensor& slots, const at::Tensor& k,
              const c10::optional<at::Tensor>& v) {
  TORCH_CHECK(cache.dim() == 6 && cache.is_contiguous(), "cache: the pool's page buffer");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64");
  const int64_t layers = cache.size(1), parts = cache.size(2), heads = cache.size(3);
  const int64_t page_size = cache.size(4), dim = cache.size(5);
  const int64_t item = cache.element_size();
  const int64_t tokens = slots.numel();
  const int64_t given = v.has_value() ? 2 : 1;
  TORCH_CHECK(given <= parts, "more parts than the pool holds");
  const at::Tensor* xs[2] = {&k, v.has_value() ? &*v : nullptr};
  for (int64_t i = 0; i < given; ++i) {
    const at::Tensor& x = *xs[i];
    TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "new tokens in the pool's dtype");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == tokens && x.size(1) == heads && x.size(2) == dim &&
                    x.stride(2) == 1,
                "new tokens: [T, heads, dim]");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* pool = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = slot[t] / page_size, offset = slot[t] % page_size;
    TORCH_CHECK(slot[t] >= 0 && page < cache.size(0), "slot ", slot[t], " outside the pool");
    for (int64_t i = 0; i < given; ++i) {
      const at::Tensor& x = *xs[i];
      const char* src = static_cast<const char*>(x.data_ptr()) + t * x.stride(0) * item;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = ((((page * layers + layer) * parts + i) * heads + h) * page_size +
                            offset) * dim;
        std::memcpy(pool + at * item, src + h * x.stride(1) * item, dim * item);
      }
    }
  }
}

// out = SiLU(gate) x up per element, gate and up [N, I] (rows strided: the halves of the packed
// gate/up GEMM's output). SiLU(x) = x / (1 + e^-x), through e^-|x| so the exponential never
// overflows; rounded to T before the product, as torch's F.silu(gate).mul_(up) is (float32:
// within a few ulps of torch's). Torch's two ops and temporary took 0.55 ms for a 2,048-token
// chunk of the demo model's layer and 17 us for 64 decode rows; this, 0.35 ms and 11 us (2
// threads).
template <typename T>
void silu_mul_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t rows = gate.size(0), width = gate.size(1);
  const int64_t gate_row = gate.stride(0), up_row = up.stride(0);
  const T* g = gate.data_ptr<T>();
  const T* u = up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = g + r * gate_row;
      const T* ur = u + r * up_row;
      T* dst = o + r * width;
#pragma omp simd
      for (int64_t d = 0; d < width; ++d) {
        const float x = wide(gr[d]);
        const float e = exp_nonpositive(-std::fabs(x));  // e^-x for x >= 0, else e^x
        const float silu = (x >= 0.f ? x : x * e) / (1.f + e);  // one division: the slow op
        dst[d] = narrow<T>(wide(narrow<T>(silu)) * wide(ur[d]));
      }
    }
  });
}

void silu_and_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor out) {
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() && out.scalar_type() == gate.scalar_type(),
              "gate, up and out in one dtype");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "gate, up: [N, I], rows contiguous");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == gate.sizes(), "out: contiguous [N, I]");
  for_dtype(gate.scalar_type(), [&](auto tag) { silu_mul_rows<decltype(tag)>(gate, up, out); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("rotary_neox_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("kv_write(Tensor(a!) cache, int layer, Tensor slots, Tensor k, Tensor? v) -> ()");
  m.def("silu_and_mul(Tensor gate, Tensor up, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tierserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_neox_", &rotary_neox_);
  m.impl("kv_write", &kv_write);
  m.impl("silu_and_mul", &silu_and_mul);
}
