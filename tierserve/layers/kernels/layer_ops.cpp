// The small per-layer ops of a decode step, fused, on CPU: RMSNorm, NeoX rotary on q and k in
// place, and the store of a step's new K and V into the pool's pages. Each replaces several
// torch ops of a few microseconds apiece (a decode step of the demo model ran ~150 of them);
// layers/norm.py, layers/rotary.py and cache/pool.py keep the torch code as their oracles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Rows of `x` ([N, dim] or [N, H, dim], the last dimension contiguous): the float32 row r.
struct Rows {
  const float* base;
  int64_t count, inner, outer_stride, inner_stride;
  const float* row(int64_t r) const {
    return base + (r / inner) * outer_stride + (r % inner) * inner_stride;
  }
};

Rows rows_of(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(-1) == 1, "float32, last dim contiguous");
  if (x.dim() == 2) return {x.data_ptr<float>(), x.size(0), 1, x.stride(0), 0};
  TORCH_CHECK(x.dim() == 3, "[N, dim] or [N, H, dim]");
  return {x.data_ptr<float>(), x.size(0) * x.size(1), x.size(1), x.stride(0), x.stride(1)};
}

// out = x / sqrt(mean(x^2) + eps) * weight, per row.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  const Rows in = rows_of(x);
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == dim && weight.is_contiguous(),
              "weight: [dim] float32");
  TORCH_CHECK(out.is_contiguous() && out.numel() == in.count * dim, "out: contiguous");
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, in.count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* src = in.row(r);
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) squares += src[d] * src[d];
      const float inv = 1.f / std::sqrt(squares / dim + static_cast<float>(eps));
      float* dst = o + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * inv * w[d];
    }
  });
}

// x's rows rotated in place in the half-rotation layout: (x1, x2) -> (x1 cos - x2 sin,
// x2 cos + x1 sin), token t's row of cos and sin ([T, dim / 2]).
void rotate_rows(at::Tensor& x, const float* cos, const float* sin, int64_t half) {
  Rows rows = rows_of(x);
  const int64_t heads = rows.inner;
  at::parallel_for(0, rows.count, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* a = const_cast<float*>(rows.row(r));
      float* b = a + half;
      const float* c = cos + (r / heads) * half;
      const float* s = sin + (r / heads) * half;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = a[d], x2 = b[d];
        a[d] = x1 * c[d] - x2 * s[d];
        b[d] = x2 * c[d] + x1 * s[d];
      }
    }
  });
}

void rotary_neox_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = cos.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos, sin: [T, dim / 2] float32");
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == cos.size(0) && x->size(2) == 2 * half,
                "q, k: [T, heads, 2 * (dim / 2)]");
  rotate_rows(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  rotate_rows(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tierserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("rotary_neox_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("kv_write(Tensor(a!) cache, int layer, Tensor slots, Tensor k, Tensor? v) -> ()");
}

TORCH_LIBRARY_IMPL(tierserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_neox_", &rotary_neox_);
  m.impl("kv_write", &kv_write);
}
