// HyScale's binding to FlashMLA's SM90 sparse-prefill forward, built on the GPU machine by
// scripts/build_flashmla.py from a FlashMLA checkout (deepseek-ai/FlashMLA, branch nv_dev).
// FlashMLA's own api.cpp also binds its SM100 and decode kernels, whose sources take many
// minutes to compile; this one binds only the kernel megatron-core's cudnn DSA backend calls
// (`flash_mla_sparse_fwd`), under the same Python name and signature, so FlashMLA's Python
// package (flash_mla/flash_mla_interface.py) runs on it unchanged.
#include <limits>
#include <optional>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

namespace {

constexpr float kLog2E = 1.44269504f;

int as_int_stride(int64_t stride) {
  TORCH_CHECK(stride <= std::numeric_limits<int>::max(), "stride exceeds int32: ", stride);
  return static_cast<int>(stride);
}

template <typename T>
T* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<T*>(t->data_ptr()) : nullptr;
}

// q [s_q, h_q, d_qk] bf16, kv [s_kv, h_kv, d_qk] bf16, indices [s_q, h_kv, topk] int32 (-1 or
// >= s_kv: ignored); returns (out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q], lse [s_q, h_q]
// fp32, natural log).
std::vector<at::Tensor> sparse_prefill_fwd(const at::Tensor& q, const at::Tensor& kv,
                                           const at::Tensor& indices, double sm_scale, int64_t d_v,
                                           const std::optional<at::Tensor>& attn_sink,
                                           const std::optional<at::Tensor>& topk_length,
                                           int64_t indexer_topk) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major == 9 && prop->minor == 0, "this FlashMLA build holds SM90a kernels only");
  TORCH_CHECK(indexer_topk == 0, "this FlashMLA build has no indexer_topk variants");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && indices.dim() == 3, "q, kv, indices must be 3-D");
  TORCH_CHECK(q.is_cuda() && kv.is_cuda() && indices.is_cuda(), "inputs must be on CUDA");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16,
              "q and kv must be bfloat16");
  TORCH_CHECK(indices.scalar_type() == at::kInt, "indices must be int32");
  const int s_q = q.size(0), h_q = q.size(1), d_qk = q.size(2);
  const int s_kv = kv.size(0), h_kv = kv.size(1);
  const int topk = indices.size(2);
  TORCH_CHECK(d_qk == 576 || d_qk == 512, "d_qk must be 576 or 512, got ", d_qk);
  TORCH_CHECK(d_v == 512, "d_v must be 512, got ", d_v);
  TORCH_CHECK(h_q == 64 || h_q == 128, "h_q must be 64 or 128, got ", h_q);
  TORCH_CHECK(kv.size(2) == d_qk && indices.size(0) == s_q && indices.size(1) == h_kv,
              "kv / indices shapes do not match q");
  TORCH_CHECK(q.stride(2) == 1 && kv.stride(2) == 1 && indices.stride(2) == 1,
              "q, kv, indices need a contiguous last dimension");
  if (attn_sink.has_value()) {
    TORCH_CHECK(attn_sink->scalar_type() == at::kFloat && attn_sink->numel() == h_q &&
                    attn_sink->is_contiguous(), "attn_sink must be contiguous fp32 [h_q]");
  }
  if (topk_length.has_value()) {
    TORCH_CHECK(topk_length->scalar_type() == at::kInt && topk_length->numel() == s_q &&
                    topk_length->is_contiguous(), "topk_length must be contiguous int32 [s_q]");
  }

  at::cuda::CUDAGuard guard{q.device()};
  auto opts = q.options();
  at::Tensor out = torch::empty({s_q, h_q, d_v}, opts);
  at::Tensor lse = torch::empty({s_q, h_q}, opts.dtype(torch::kFloat));
  at::Tensor max_logits = torch::empty({s_q, h_q}, opts.dtype(torch::kFloat));

  const float scale = static_cast<float>(sm_scale);
  SparseAttnFwdParams params = {
      s_q, s_kv, h_q, h_kv, d_qk, static_cast<int>(d_v), topk, scale, scale * kLog2E,
      reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr()),
      reinterpret_cast<cutlass::bfloat16_t*>(kv.data_ptr()),
      reinterpret_cast<int*>(indices.data_ptr()),
      optional_ptr<float>(attn_sink), optional_ptr<int>(topk_length),
      as_int_stride(q.stride(0)), as_int_stride(q.stride(1)),
      as_int_stride(kv.stride(0)), as_int_stride(kv.stride(1)),
      as_int_stride(indices.stride(0)), as_int_stride(indices.stride(1)),
      reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr()),
      reinterpret_cast<float*>(max_logits.data_ptr()), reinterpret_cast<float*>(lse.data_ptr()),
      nullptr, prop->multiProcessorCount, at::cuda::getCurrentCUDAStream().stream(), 0};
  const bool with_length = topk_length.has_value();
  if (d_qk == 576) {
    with_length ? sm90::fwd::run_fwd_phase1_kernel<576, true>(params)
                : sm90::fwd::run_fwd_phase1_kernel<576, false>(params);
  } else {
    with_length ? sm90::fwd::run_fwd_phase1_kernel<512, true>(params)
                : sm90::fwd::run_fwd_phase1_kernel<512, false>(params);
  }
  return {out, max_logits, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashMLA's SM90 sparse prefill forward (HyScale's minimal build)";
  m.def("sparse_prefill_fwd", &sparse_prefill_fwd, pybind11::arg("q"), pybind11::arg("kv"),
        pybind11::arg("indices"), pybind11::arg("sm_scale"), pybind11::arg("d_v"),
        pybind11::arg("attn_sink"), pybind11::arg("topk_length"),
        pybind11::arg("indexer_topk") = 0);
}
