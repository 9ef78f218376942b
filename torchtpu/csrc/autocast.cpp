// Autocast for tpu tensors: `torch.autocast("tpu", dtype=torch.bfloat16)`.
//
// Under autocast PyTorch casts an op's inputs in a dispatch key of the device's own
// (AutocastPrivateUse1 for tpu), and fills that key only for its own devices: without these
// registrations every op under `torch.autocast("tpu")` failed to dispatch. The policy is CUDA's,
// taken from the op lists PyTorch publishes for other backends (ATen/autocast_mode.h): matmuls
// and convolutions run in the autocast dtype (what a TPU's MXU multiplies in), ops that lose
// accuracy in 16 bits (exp, log, norms, softmax, losses, ...) in float32, ops with mixed inputs
// promote them to the widest, and every other op passes through untouched. torchtpu/autocast.py
// builds and loads this library.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

// The names PyTorch's op lists spell their signatures with.
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// As on CUDA: binary_cross_entropy's backward is not defined for 16-bit inputs in a way that is
// safe, so it is refused under autocast rather than run in float32 behind the caller's back.
Tensor binary_cross_entropy_refused(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t) {
  TORCH_CHECK(
      false,
      "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on tpu "
      "(as on cuda). Use torch.nn.functional.binary_cross_entropy_with_logits or "
      "torch.nn.BCEWithLogitsLoss, which combine the sigmoid and the loss and are safe to autocast, "
      "or run the loss outside the autocast region on float32 inputs.");
}

}  // namespace

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TPU_IN_AUTOCAST_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_IN_FLOAT32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TPU_IN_FLOAT32_BY_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TPU_PROMOTED(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TPU_IN_AUTOCAST_DTYPE)
  AT_FORALL_FP32(TPU_IN_FLOAT32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_IN_FLOAT32_BY_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TPU_PROMOTED)
#undef TPU_IN_AUTOCAST_DTYPE
#undef TPU_IN_FLOAT32
#undef TPU_IN_FLOAT32_BY_DTYPE
#undef TPU_PROMOTED
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_refused));
}
