// Host programs: one signature's forward and backward, recorded once in Python as a list of
// ATen calls and Triton kernel launches (timm_flashwin/host_recorder.py), replayed here with
// a C++ autograd node. An eager call of the op then pays no Python past its signature key:
// no plan lookups, no argument lists, no torch.autograd.Function, and each launch is one
// cuLaunchKernel (Triton's launcher parses every argument from Python objects).
//
// Built on first use by torch.utils.cpp_extension (timm_flashwin/native.py). No CUDA
// headers: the driver's entry points are taken from libcuda with dlsym, the stream from
// c10's device-guard interface.
#include <dlfcn.h>

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

// ------------------------------------------------------------------ the CUDA driver
using CUresult_t = int;
using cuLaunchKernel_t = CUresult_t (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        unsigned, void*, void**, void**);
using cuGetErrorString_t = CUresult_t (*)(CUresult_t, const char**);
using cuCtxGetCurrent_t = CUresult_t (*)(void**);
using cuDeviceGet_t = CUresult_t (*)(int*, int);
using cuDevicePrimaryCtxRetain_t = CUresult_t (*)(void**, int);
using cuCtxSetCurrent_t = CUresult_t (*)(void*);

struct Driver {
  cuLaunchKernel_t launch = nullptr;
  cuGetErrorString_t error_string = nullptr;
  cuCtxGetCurrent_t ctx_get_current = nullptr;
  cuDeviceGet_t device_get = nullptr;
  cuDevicePrimaryCtxRetain_t primary_ctx_retain = nullptr;
  cuCtxSetCurrent_t ctx_set_current = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "timm_flashwin host programs: cannot open libcuda.so.1");
    d.launch = reinterpret_cast<cuLaunchKernel_t>(dlsym(lib, "cuLaunchKernel"));
    d.error_string = reinterpret_cast<cuGetErrorString_t>(dlsym(lib, "cuGetErrorString"));
    d.ctx_get_current = reinterpret_cast<cuCtxGetCurrent_t>(dlsym(lib, "cuCtxGetCurrent"));
    d.device_get = reinterpret_cast<cuDeviceGet_t>(dlsym(lib, "cuDeviceGet"));
    d.primary_ctx_retain = reinterpret_cast<cuDevicePrimaryCtxRetain_t>(dlsym(lib, "cuDevicePrimaryCtxRetain_v2"));
    if (d.primary_ctx_retain == nullptr) {
      d.primary_ctx_retain = reinterpret_cast<cuDevicePrimaryCtxRetain_t>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    }
    d.ctx_set_current = reinterpret_cast<cuCtxSetCurrent_t>(dlsym(lib, "cuCtxSetCurrent"));
    TORCH_CHECK(d.launch && d.error_string && d.ctx_get_current && d.device_get && d.primary_ctx_retain &&
                    d.ctx_set_current,
                "timm_flashwin host programs: libcuda.so.1 lacks a driver entry point");
    return d;
  }();
  return d;
}

constexpr CUresult_t kCudaOutOfMemory = 2;  // CUDA_ERROR_OUT_OF_MEMORY

void check_cuda(CUresult_t code, const char* what) {
  if (code != 0) {
    const char* message = "unknown error";
    driver().error_string(code, &message);
    TORCH_CHECK(false, "timm_flashwin host programs: ", what, " failed: ", message);
  }
}

// A thread the autograd engine runs backward passes on may not have made the device's
// primary context current in the driver API (Triton's launcher does the same).
void ensure_context(int device) {
  void* context = nullptr;
  check_cuda(driver().ctx_get_current(&context), "cuCtxGetCurrent");
  if (context == nullptr) {
    int handle = 0;
    check_cuda(driver().device_get(&handle, device), "cuDeviceGet");
    check_cuda(driver().primary_ctx_retain(&context, handle), "cuDevicePrimaryCtxRetain");
    check_cuda(driver().ctx_set_current(context), "cuCtxSetCurrent");
  }
}

// ------------------------------------------------------------------ programs
// A kernel parameter: a slot's data pointer, a null pointer, or a scalar of the width the
// compiled kernel's signature gives it (host_recorder.py numbers them alike).
enum ParamKind : int64_t { kSlot = 0, kNull = 1, kI32 = 2, kI64 = 3, kU32 = 4, kU64 = 5, kF32 = 6, kF64 = 7 };

struct Param {
  ParamKind kind;
  int64_t slot_or_int;
  double real;
};

struct Launch {
  uint64_t function;  // CUfunction of the compiled kernel, loaded by Triton
  std::string name;   // the kernel's, for error messages
  unsigned grid[3];
  unsigned threads;
  unsigned shared;
  std::vector<Param> params;
};

struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> constants;  // the schema's arguments, None where a slot goes
  std::vector<int64_t> argument_slots;  // -1: the constant
  std::vector<int64_t> output_slots;
};

struct Step {
  std::optional<Launch> launch;
  std::optional<Call> call;
};

struct Program {
  int64_t num_slots = 0;
  std::vector<Step> steps;
};

// The text of a tensor's sizes and dtype, "[7, 16, 96] Half", without an ostream: messages
// are built from std::string pieces and TORCH_CHECK is given one string (a number inserted into
// c10::str's stream in this extension crashed in libstdc++'s num_put on an H200 image,
// torch 2.11: a segmentation fault in place of the error).
std::string tensor_text(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string text = "[";
  for (size_t i = 0; i < t.sizes().size(); ++i) text += (i ? ", " : "") + std::to_string(t.sizes()[i]);
  return text + "] " + c10::toString(t.scalar_type());
}

// A failed launch, as kernels/launch_errors.py words Triton's: the kernel, its grid and its
// tensors named; out of memory (after the retry) as torch.OutOfMemoryError, which
// batch-size finders look for.
[[noreturn]] void launch_failed(const Launch& launch, const std::vector<at::Tensor>& slots, CUresult_t code) {
  const char* message = "unknown error";
  driver().error_string(code, &message);
  std::string tensors;
  std::vector<int64_t> seen;  // a slot once (unused pointers repeat an input)
  for (const Param& p : launch.params) {
    if (p.kind != kSlot || std::find(seen.begin(), seen.end(), p.slot_or_int) != seen.end()) continue;
    seen.push_back(p.slot_or_int);
    if (!tensors.empty()) tensors += ", ";
    tensors += p.slot_or_int >= 0 && p.slot_or_int < static_cast<int64_t>(slots.size())
                   ? tensor_text(slots[p.slot_or_int]) : std::string("?");
  }
  const std::string call = "the Triton kernel " + launch.name + " (grid (" + std::to_string(launch.grid[0]) + ", " +
                           std::to_string(launch.grid[1]) + ", " + std::to_string(launch.grid[2]) + "); tensors " +
                           (tensors.empty() ? std::string("none") : tensors) + "; replayed by a host program)";
  TORCH_CHECK_WITH(OutOfMemoryError, code != kCudaOutOfMemory, "CUDA out of memory. timm_flashwin: launching " +
                   call + " failed (" + message + "), also after torch.cuda.empty_cache()");
  TORCH_CHECK(false, "timm_flashwin: " + call + " failed: " + message);
}

void run_launch(const Launch& launch, const std::vector<at::Tensor>& slots, void* stream) {
  constexpr size_t kMaxParams = 160;
  TORCH_CHECK(launch.params.size() <= kMaxParams, "timm_flashwin host programs: too many kernel parameters");
  uint64_t storage[kMaxParams];
  void* params[kMaxParams];
  for (size_t i = 0; i < launch.params.size(); ++i) {
    const Param& p = launch.params[i];
    storage[i] = 0;
    switch (p.kind) {
      case kSlot:
        storage[i] = reinterpret_cast<uint64_t>(slots[p.slot_or_int].data_ptr());
        break;
      case kNull:
        break;
      case kI32: {
        int32_t v = static_cast<int32_t>(p.slot_or_int);
        std::memcpy(&storage[i], &v, sizeof v);
        break;
      }
      case kU32: {
        uint32_t v = static_cast<uint32_t>(p.slot_or_int);
        std::memcpy(&storage[i], &v, sizeof v);
        break;
      }
      case kI64:
      case kU64:
        std::memcpy(&storage[i], &p.slot_or_int, sizeof p.slot_or_int);
        break;
      case kF32: {
        float v = static_cast<float>(p.real);
        std::memcpy(&storage[i], &v, sizeof v);
        break;
      }
      case kF64:
        std::memcpy(&storage[i], &p.real, sizeof p.real);
        break;
    }
    params[i] = &storage[i];
  }
  if (launch.grid[0] == 0 || launch.grid[1] == 0 || launch.grid[2] == 0) {
    return;
  }
  auto go = [&] {
    return driver().launch(reinterpret_cast<void*>(launch.function), launch.grid[0], launch.grid[1], launch.grid[2],
                           launch.threads, 1, 1, launch.shared, stream, params, nullptr);
  };
  CUresult_t code = go();
  if (code == kCudaOutOfMemory) {
    // as for Triton's launches (kernels/launch_errors.py): PyTorch's cached blocks given
    // back once, and the launch tried again
    {
      py::gil_scoped_acquire gil;
      py::module_::import("torch.cuda").attr("empty_cache")();
    }
    code = go();
  }
  if (code != 0) launch_failed(launch, slots, code);
}

void run_call(const Call& call, std::vector<at::Tensor>& slots) {
  torch::jit::Stack stack;
  stack.reserve(call.constants.size());
  for (size_t i = 0; i < call.constants.size(); ++i) {
    const int64_t slot = call.argument_slots[i];
    if (slot < 0) {
      stack.push_back(call.constants[i]);
    } else {
      stack.emplace_back(slots[slot]);
    }
  }
  call.op.callBoxed(&stack);
  TORCH_CHECK(stack.size() >= call.output_slots.size(), "timm_flashwin host programs: " + call.op.schema().name() +
              " returned " + std::to_string(stack.size()) + " values");
  for (size_t i = 0; i < call.output_slots.size(); ++i) {
    slots[call.output_slots[i]] = stack[i].toTensor();
  }
}

void run_program(const Program& program, std::vector<at::Tensor>& slots, int device) {
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  // the program's ATen calls are below autograd (the node is the whole op's) and autocast
  // (they were recorded below it)
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  void* stream = nullptr;
  bool context_checked = false;
  for (const Step& step : program.steps) {
    if (step.call) {
      run_call(*step.call, slots);
    } else {
      if (!context_checked) {
        ensure_context(device);
        stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                     ->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)))
                     .native_handle();
        context_checked = true;
      }
      run_launch(*step.launch, slots, stream);
    }
  }
}

Program build_program(int64_t num_slots, const py::list& steps) {
  Program program;
  program.num_slots = num_slots;
  for (const py::handle& item : steps) {
    py::tuple step = py::reinterpret_borrow<py::tuple>(item);
    const std::string kind = step[0].cast<std::string>();
    Step s;
    if (kind == "launch") {
      // ("launch", function, (gx, gy, gz), threads, shared, [(kind, int, float), ...], name)
      Launch launch;
      launch.function = step[1].cast<uint64_t>();
      py::tuple grid = step[2].cast<py::tuple>();
      for (int i = 0; i < 3; ++i) launch.grid[i] = grid[i].cast<unsigned>();
      launch.threads = step[3].cast<unsigned>();
      launch.shared = step[4].cast<unsigned>();
      launch.name = step.size() > 6 ? step[6].cast<std::string>() : std::string("?");
      for (const py::handle& p : step[5].cast<py::list>()) {
        py::tuple param = py::reinterpret_borrow<py::tuple>(p);
        launch.params.push_back(Param{static_cast<ParamKind>(param[0].cast<int64_t>()), param[1].cast<int64_t>(),
                                      param[2].cast<double>()});
      }
      s.launch = std::move(launch);
    } else {
      TORCH_CHECK(kind == "call", "timm_flashwin host programs: unknown step ", kind);
      // ("call", "aten::name", "overload", [argument or None], [slot or -1], [output slots])
      const std::string name = step[1].cast<std::string>();
      const std::string overload = step[2].cast<std::string>();
      c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
      const auto& arguments = op.schema().arguments();
      py::list values = step[3].cast<py::list>();
      py::list argument_slots = step[4].cast<py::list>();
      TORCH_CHECK(values.size() == arguments.size(), "timm_flashwin host programs: " + name + " takes " +
                  std::to_string(arguments.size()) + " arguments, got " + std::to_string(values.size()));
      Call call{op, {}, {}, {}};
      for (size_t i = 0; i < arguments.size(); ++i) {
        const int64_t slot = argument_slots[i].cast<int64_t>();
        call.argument_slots.push_back(slot);
        call.constants.push_back(slot >= 0 ? c10::IValue() : torch::jit::toIValue(values[i], arguments[i].type()));
      }
      for (const py::handle& o : step[5].cast<py::list>()) call.output_slots.push_back(o.cast<int64_t>());
      s.call = std::move(call);
    }
    program.steps.push_back(std::move(s));
  }
  return program;
}

// Whether t's strides are ``strides`` in every dimension of more than one element (a
// dimension of one is never stepped along: its stride is free).
bool same_layout(const at::Tensor& t, const std::vector<int64_t>& strides) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1 && t.stride(d) != strides[d]) return false;
  }
  return true;
}

// ------------------------------------------------------------------ signatures
// One op signature: its forward program (slots 0..n-1: the inputs), which forward slots
// the backward takes (saved for backward, as autograd saves tensors: version checks,
// saved-tensor hooks; then kept: inputs the backward reads that the op's Python road keeps
// as attributes, such as an index's int32 copy, which may be an inference tensor), its
// output slot, and its backward program (slots: the saved, the kept, then the output's
// gradient), whose result slots are the inputs' gradients.
struct Signature {
  Program forward;
  Program backward;
  int device = 0;
  std::vector<int64_t> saved_slots;  // forward slots; -1: None
  std::vector<int64_t> kept_slots;
  int64_t output_slot = 0;
  std::vector<int64_t> gradient_slots;  // per input, a backward slot or -1
  // the output's gradient as the backward was recorded with it: dense, in these sizes and strides
  // (contiguous, or the local operator's output in q's layout, (B, S, H, D) in memory)
  std::vector<int64_t> grad_output_sizes;
  std::vector<int64_t> grad_output_strides;
};

// Signatures are never freed: a process records a few (one per layer shape), and the
// autograd nodes refer to them by index.
std::deque<Signature>& signatures() {
  static std::deque<Signature> all;
  return all;
}
std::mutex& signatures_mutex() {
  static std::mutex m;
  return m;
}

int64_t add_signature(int64_t forward_slots, const py::list& forward_steps, int64_t backward_slots,
                      const py::list& backward_steps, int64_t device, std::vector<int64_t> saved_slots,
                      std::vector<int64_t> kept_slots, int64_t output_slot, std::vector<int64_t> gradient_slots,
                      std::vector<int64_t> grad_output_sizes, std::vector<int64_t> grad_output_strides) {
  Signature s;
  s.forward = build_program(forward_slots, forward_steps);
  s.backward = build_program(backward_slots, backward_steps);
  s.device = static_cast<int>(device);
  s.saved_slots = std::move(saved_slots);
  s.kept_slots = std::move(kept_slots);
  s.output_slot = output_slot;
  s.gradient_slots = std::move(gradient_slots);
  s.grad_output_sizes = std::move(grad_output_sizes);
  s.grad_output_strides = std::move(grad_output_strides);
  std::lock_guard<std::mutex> lock(signatures_mutex());
  signatures().push_back(std::move(s));
  return static_cast<int64_t>(signatures().size()) - 1;
}

const Signature& signature(int64_t index) {
  std::lock_guard<std::mutex> lock(signatures_mutex());
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(signatures().size()),
              "timm_flashwin host programs: no signature " + std::to_string(index));
  return signatures()[index];
}

}  // namespace

namespace timm_flashwin {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autograd node of a replayed call (its name shows in autograd graphs).
struct HostProgramFunction : public torch::autograd::Function<HostProgramFunction> {
  static at::Tensor forward(AutogradContext* ctx, int64_t index, at::TensorList inputs) {
    const Signature& s = signature(index);
    std::vector<at::Tensor> slots(s.forward.num_slots);
    for (size_t i = 0; i < inputs.size(); ++i) slots[i] = inputs[i];
    run_program(s.forward, slots, s.device);
    variable_list saved;
    saved.reserve(s.saved_slots.size());
    for (int64_t slot : s.saved_slots) saved.push_back(slot >= 0 ? slots[slot] : at::Tensor());
    ctx->save_for_backward(saved);
    c10::List<at::Tensor> kept;
    for (int64_t slot : s.kept_slots) kept.push_back(slots[slot]);
    ctx->saved_data["kept"] = kept;
    ctx->saved_data["signature"] = index;
    return slots[s.output_slot];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "timm_flashwin: the attention backward is not differentiable (create_graph=True)");
    const int64_t index = ctx->saved_data["signature"].toInt();
    const Signature& s = signature(index);
    variable_list saved = ctx->get_saved_variables();
    c10::List<at::Tensor> kept = ctx->saved_data["kept"].toTensorList();
    std::vector<at::Tensor> slots(s.backward.num_slots);
    size_t next = 0;
    for (const at::Tensor& t : saved) slots[next++] = t;
    for (size_t i = 0; i < kept.size(); ++i) slots[next++] = kept.get(i);
    // the gradient in the layout the backward was recorded with (its launches take those
    // strides as constants), 16-byte aligned: else a copy in that layout
    at::Tensor grad = grad_outputs[0];
    TORCH_CHECK(grad.defined() && grad.sizes().equals(s.grad_output_sizes),
                "timm_flashwin host programs: the output's gradient has another shape");
    if (!same_layout(grad, s.grad_output_strides) || reinterpret_cast<uintptr_t>(grad.data_ptr()) % 16 != 0) {
      at::Tensor laid = at::empty_strided(s.grad_output_sizes, s.grad_output_strides, grad.options());
      laid.copy_(grad);
      grad = laid;
    }
    slots[next] = grad;
    run_program(s.backward, slots, s.device);
    variable_list grads;
    grads.reserve(s.gradient_slots.size() + 1);
    grads.emplace_back();  // the signature index
    for (int64_t slot : s.gradient_slots) grads.push_back(slot >= 0 ? slots[slot] : at::Tensor());
    return grads;
  }
};

}  // namespace timm_flashwin

namespace {

at::Tensor apply(int64_t index, std::vector<at::Tensor> inputs) {
  return timm_flashwin::HostProgramFunction::apply(index, at::TensorList(inputs));
}

// A call where nothing takes a gradient: the forward program alone, no autograd node (its
// signature has an empty backward).
at::Tensor run_forward(int64_t index, std::vector<at::Tensor> inputs) {
  const Signature& s = signature(index);
  std::vector<at::Tensor> slots(s.forward.num_slots);
  for (size_t i = 0; i < inputs.size(); ++i) slots[i] = inputs[i];
  run_program(s.forward, slots, s.device);
  return slots[s.output_slot];
}

// A program's ATen calls and launches on the given slots (tests: programs of ATen calls alone
// run on CPU tensors; the device is then unused).
std::vector<at::Tensor> run_steps(int64_t num_slots, const py::list& steps, std::vector<at::Tensor> inputs) {
  Program program = build_program(num_slots, steps);
  std::vector<at::Tensor> slots(num_slots);
  for (size_t i = 0; i < inputs.size(); ++i) slots[i] = inputs[i];
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (const Step& step : program.steps) {
    TORCH_CHECK(step.call, "timm_flashwin host programs: run_steps takes ATen calls only");
    run_call(*step.call, slots);
  }
  return slots;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_signature", &add_signature);
  m.def("apply", &apply);
  m.def("run_forward", &run_forward);
  m.def("run_steps", &run_steps);
}
