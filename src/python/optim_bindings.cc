// Bindings of the CPU optimizer replay (nonstop/optim.h) as nonstop._core.optim.
// Buffers arrive as plain numbers (data_ptr(), numel): this module never sees
// torch. Hyperparameters arrive as dicts shaped like torch's param_groups.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "nonstop/optim.h"
#include "nonstop/status.h"
#include "nonstop/types.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

using optim::Algorithm;
using optim::BiasCorrection2Sqrt;
using optim::FirstMoment;

template <typename T>
T* Pointer(const py::dict& d, const char* key) {
  return reinterpret_cast<T*>(DictGet<uintptr_t>(d, key, 0));
}

Algorithm ParseAlgorithm(const std::string& name) {
  if (name == "adamw") return Algorithm::kAdamW;
  if (name == "adam") return Algorithm::kAdam;
  if (name == "sgd") return Algorithm::kSgd;
  throw py::value_error("optim.replay: unknown algorithm '" + name +
                        "'; use 'adamw', 'adam' or 'sgd'");
}

optim::StepRecord ParseStep(const py::dict& d) {
  optim::StepRecord r;
  r.hyper = HyperparametersFromGroup(d);
  optim::StepHyperparameters& h = r.hyper;
  h.beta1 = DictGet<double>(d, "beta1", h.beta1);  // override 'betas'
  h.beta2 = DictGet<double>(d, "beta2", h.beta2);
  h.skipped = DictGet<bool>(d, "skipped", h.skipped);
  h.step = DictGet<double>(d, "step", h.step);
  r.grad.data = Pointer<const void>(d, "grad");
  const std::string dtype = DictGet<std::string>(d, "grad_dtype", "float32");
  if (!ParseDType(dtype, &r.grad.dtype)) {
    throw py::value_error("optim.replay: unknown grad_dtype '" + dtype + "'");
  }
  return r;
}

py::dict Replay(const std::string& algorithm, const py::dict& state, const py::list& steps,
                bool amsgrad, const std::string& first_moment,
                const std::string& bias_correction2_sqrt, int num_threads,
                size_t block_elements, uintptr_t mkl_vms_sqrt) {
  optim::OptimizerConfig config;
  config.algorithm = ParseAlgorithm(algorithm);
  config.amsgrad = amsgrad;
  if (first_moment == "lerp") {
    config.first_moment = FirstMoment::kLerp;
  } else if (first_moment == "mul_add") {
    config.first_moment = FirstMoment::kMulAdd;
  } else {
    throw py::value_error("optim.replay: first_moment must be 'lerp' (torch >= 2.0) or "
                          "'mul_add' (torch 1.x)");
  }
  if (bias_correction2_sqrt == "pow") {
    config.bias_correction2_sqrt = BiasCorrection2Sqrt::kPowHalf;
  } else if (bias_correction2_sqrt == "sqrt") {
    config.bias_correction2_sqrt = BiasCorrection2Sqrt::kSqrt;
  } else {
    throw py::value_error("optim.replay: bias_correction2_sqrt must be 'pow' or 'sqrt'");
  }

  optim::PartState s;
  s.numel = DictGet<size_t>(state, "numel", 0);
  s.param = Pointer<float>(state, "param");
  s.exp_avg = Pointer<float>(state, "exp_avg");
  s.exp_avg_sq = Pointer<float>(state, "exp_avg_sq");
  s.max_exp_avg_sq = Pointer<float>(state, "max_exp_avg_sq");
  s.momentum_buffer = Pointer<float>(state, "momentum_buffer");
  s.step = DictGet<double>(state, "step", 0.0);
  s.has_momentum_buffer = DictGet<bool>(state, "has_momentum_buffer", false);

  std::vector<optim::StepRecord> records;
  records.reserve(steps.size());
  for (const auto& item : steps) records.push_back(ParseStep(item.cast<py::dict>()));

  optim::ReplayOptions options;
  options.num_threads = num_threads;
  options.block_elements = block_elements;
  options.mkl_vms_sqrt = reinterpret_cast<optim::MklVmsSqrtFn>(mkl_vms_sqrt);
  Status st;
  {
    py::gil_scoped_release release;
    st = optim::Replay(config, records, &s, options);
  }
  if (!st.ok()) {
    if (st.code() == StatusCode::kInvalidArgument) throw py::value_error(st.message());
    throw std::runtime_error(st.ToString());
  }
  py::dict out;
  out["step"] = s.step;
  out["has_momentum_buffer"] = s.has_momentum_buffer;
  return out;
}

}  // namespace

void InitOptim(py::module_& m) {
  py::module_ optim_module = m.def_submodule(
      "optim", "CPU optimizer replay matching torch's CPU AdamW/Adam/SGD bit for bit");
  optim_module.def("kernel_isa", &optim::KernelIsa,
                   "The kernel variant this CPU runs: 'avx512', 'avx2' or 'generic'.");
  optim_module.def(
      "find_mkl_vms_sqrt",
      [](const std::string& path) {
        return reinterpret_cast<uintptr_t>(optim::FindMklVmsSqrt(path));
      },
      py::arg("loaded_library_path"),
      "Address of vmsSqrt in an already loaded library (torch/lib/libtorch_cpu.so), or 0.");
  optim_module.def(
      "replay", &Replay, py::arg("algorithm"), py::arg("state"), py::arg("steps"),
      py::kw_only(), py::arg("amsgrad") = false, py::arg("first_moment") = "lerp",
      py::arg("bias_correction2_sqrt") = "pow", py::arg("num_threads") = 0,
      py::arg("block_elements") = 8192, py::arg("mkl_vms_sqrt") = 0,
      R"doc(Applies logged optimizer steps to one part's fp32 host buffers, in place.

algorithm: 'adamw', 'adam' or 'sgd'.
state: {'numel', 'param', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq',
        'momentum_buffer' (data pointers as ints, 0/None when unused),
        'step' (Adam's state['step'] before replay),
        'has_momentum_buffer' (SGD: False while torch's buffer is None)}.
steps: one dict per step, like a param_group: 'lr', 'betas' or 'beta1'/'beta2',
       'eps', 'weight_decay', 'momentum', 'dampening', 'nesterov', 'maximize',
       plus 'skipped' (GradScaler overflow: nothing applied, step not counted),
       'step' (optional: the count torch reached, checked), 'grad' (pointer)
       and 'grad_dtype' ('float32', 'bfloat16', 'float16').
mkl_vms_sqrt: address of torch's MKL vmsSqrt (find_mkl_vms_sqrt), 0 for a
correctly rounded sqrt. torch's x86 Linux wheels need it to match bit for bit.
Returns {'step', 'has_momentum_buffer'} after replay. Raises ValueError on bad
input, leaving the buffers untouched.)doc");
}

}  // namespace nonstop::py_bindings
