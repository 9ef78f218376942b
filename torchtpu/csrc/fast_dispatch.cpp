// The eager modes' fast path: a C++ kernel in front of an op's Python kernel; the view kernels,
// which need no Python at all; and the `empty` factories (see "factories" below).
//
// An op call that repeats an earlier call's layout (same dtypes, shapes, strides, storage sharing
// and static values) does what that call did. The Python kernel finds it through the op's plan
// table, but only after PyTorch's dispatch into Python and a pass over the arguments in Python
// (~12 us of a ~16 us call). This kernel is registered for PrivateUse1 and moves the Python kernel
// to PrivateUse2. Each call's layout becomes a key; a key whose call the Python kernel reported as
// plain (see torchtpu/exec/fast_dispatch.py) maps to what that call ran and its output geometry,
// and later calls with the key do it from here, new tensors out (one list of them, or, for an
// in-place op, `self` updated -- a tensor, returned, or a list): in strict mode the jitted
// executable runs on the storages' device arrays (those ever written) and the call's runtime
// numbers; in defer mode the call's plan is recorded into the pending graph
// (`deferred.record_known`, one Python call) on the storages' buffers. The runtime numbers --
// Scalar arguments, Scalar lists, Python numbers and 0-dim CPU tensors passed as tensors, as the
// Python encoder takes them -- are keyed by their types, not their values (a learning rate that
// changes every step keeps its key), and a call passes its own; new values of a class that
// PyTorch's checks never saw for the key (`fits`) take the Python kernel, which checks them. Each
// mode learns its own keys. Anything else -- another eager mode, an unknown or non-plain key, a
// sharded or untyped storage -- redispatches to the Python kernel, which is the one definition of
// what an op does.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

// The eager mode the kernels serve (`kStrict`, `kDefer`), or another one (every call then takes
// the Python kernel).
constexpr int kOther = -1, kStrict = 0, kDefer = 1;
std::atomic<int> eager_mode{kOther};
std::atomic<int64_t> precision_code{0};
std::atomic<int64_t> fast_calls{0};
std::atomic<int64_t> graph_fast_calls{0};
std::atomic<int64_t> factory_fast_calls{0};

// Set once by torchtpu_fast_init (under the GIL), then only read.
PyObject* buffer_attr = nullptr;    // the storage attribute holding its DeviceBuffer
PyObject* value_attr = nullptr;     // DeviceBuffer.value: the device array (None if unwritten)
PyObject* dtype_attr = nullptr;     // DeviceBuffer.dtype
PyObject* untyped_attr = nullptr;   // DeviceBuffer.untyped
PyObject* sharded_attr = nullptr;   // DeviceBuffer.sharded
PyObject* new_buffer = nullptr;     // DeviceBuffer(dtype, numel, device, value)
PyObject* reserve = nullptr;        // reserve(nbytes) -> first address of a new address range
PyObject* learn = nullptr;          // learn(op, mode) -> None or what the op's last call did (see .py)
PyObject* record_known = nullptr;   // record_known(plan, values, *buffers) -> the new outputs' buffers
PyObject* fits = nullptr;           // fits(classes, values) -> whether PyTorch's checks saw values like these
PyObject* as_torch = nullptr;       // as_torch(error) -> the error to raise (out_of_memory.as_torch)
PyObject* empty_tuple = nullptr;    // ()
int64_t address_chunk = 0;

// Replaces the Python error set by a runner with what `as_torch` makes of it: torch's
// out-of-memory error where the runtime ran out of device memory, as the Python executors raise.
void raise_as_torch() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr) PyException_SetTraceback(value, traceback);
  PyObject* raised = value == nullptr ? nullptr : PyObject_CallOneArg(as_torch, value);
  if (raised == nullptr || raised == value) {  // not an out-of-memory error (or as_torch failed)
    Py_XDECREF(raised);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return;
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(raised)), raised);
  Py_DECREF(raised);
}

struct Gil {
  PyGILState_STATE state = PyGILState_Ensure();
  ~Gil() { PyGILState_Release(state); }
};

// Device addresses for new storages, 64-byte aligned and reserved per thread a chunk at a time,
// as storage.py's `_Maker` hands them out.
struct Addresses {
  uint64_t next = 0, end = 0;
  // Needs the GIL when it reserves; 0 if reserving failed (a Python error is set).
  uint64_t take(int64_t nbytes) {
    uint64_t size = (static_cast<uint64_t>(std::max<int64_t>(nbytes, 1)) + 63) / 64 * 64;
    if (next + size > end) {
      int64_t chunk = std::max<int64_t>(size, address_chunk);
      PyObject* got = PyObject_CallFunction(reserve, "L", static_cast<long long>(chunk));
      if (got == nullptr) return 0;
      next = PyLong_AsUnsignedLongLong(got);
      Py_DECREF(got);
      end = next + chunk;
    }
    uint64_t address = next;
    next += size;
    return address;
  }
};
thread_local Addresses addresses;

// A number an op's program takes at run time: a Scalar argument, an element of a Scalar list, a
// Python number passed as a tensor (`x * 3`) or a 0-dim CPU tensor's value. `tag` is its Python
// type (3 float, 4 int, 5 bool), `bits` its value (a float's bit pattern).
struct Number {
  int64_t tag, bits;
  bool operator==(const Number& other) const { return tag == other.tag && bits == other.bits; }
};

struct Output {
  PyObject* dtype;   // torch.dtype
  PyObject* numel;   // int
  c10::ScalarType scalar_type;
  std::vector<int64_t> sizes, strides;
  int64_t nbytes;
};

// What a key runs; owns its references (destroyed with the GIL held: in `run`, `remember` or
// `torchtpu_fast_clear`). A call holds its own pointer, so clearing during a call is safe.
struct Executable {
  // The jitted executable (strict) or the call's plan (defer); nullptr: the Python kernel
  // handles this key.
  PyObject* runner = nullptr;
  // The numbers its program takes at run time (a tuple; `learned`, the same as Numbers), as the
  // call it learned from passed them. A later call passing other numbers of a class PyTorch's
  // checks saw (`classes`, the plan's set of value classes, see `fits`) passes its own; any other
  // takes the Python kernel.
  PyObject* values = nullptr;
  std::vector<Number> learned;
  PyObject* classes = nullptr;
  PyObject* device = nullptr;  // int
  c10::DeviceIndex index = 0;
  std::vector<Output> outputs;  // the new tensors it returns
  // An in-place update of `self` (a tensor, returned, or a tensor list, `_foreach_add_`) instead
  // of new tensors: the number of storages it writes, the key's first ones. Strict mode donates
  // their arrays and installs its results as their buffers' values.
  int64_t writes_self = 0;

  Executable() = default;
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;
  ~Executable() {
    Py_XDECREF(runner);
    Py_XDECREF(values);
    Py_XDECREF(classes);
    Py_XDECREF(device);
    for (Output& out : outputs) {
      Py_XDECREF(out.dtype);
      Py_XDECREF(out.numel);
    }
  }
};

// Keys remembered per op at most: calls of an op with ever new static values (an int argument
// that changes every call, a Scalar that the op's lowering keeps static) would otherwise grow its
// table without end. A full table starts again empty.
constexpr size_t kMaxKeys = 4096;

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = key.size();
    for (int64_t v : key) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

// A Scalar's (or a wrapped number's) type and value; false for another kind of value.
bool number_of(const c10::IValue& v, Number& x) {
  if (v.isDouble()) {
    double d = v.toDouble();
    x.tag = 3;
    std::memcpy(&x.bits, &d, sizeof x.bits);
  } else if (v.isInt()) {
    x = {4, v.toInt()};
  } else if (v.isBool()) {
    x = {5, v.toBool()};
  } else {
    return false;
  }
  return true;
}

// How the key reads one argument of an op (`fast_dispatch._argument_codes`): by value (tensors,
// ints, static Scalars), or as runtime numbers -- a Scalar (static, keyed by value, when it equals
// its default of the same type) or a list of Scalars.
struct ArgCode {
  enum Kind { kByValue = 0, kScalar = 1, kScalarList = 2 } kind = kByValue;
  bool has_default = false;
  Number fallback{0, 0};  // the default, when `has_default`
};

// A 0-dim CPU tensor's value (a wrapped number's too) as the Python kernel reads it
// (`Tensor.item()`); false for a dtype whose value is not a float, int or bool.
bool host_number(const at::Tensor& t, Number& x) {
  at::ScalarType type = t.scalar_type();
  if (type == at::kDouble) {  // the wrapped numbers' dtypes, read without a dispatch
    x.tag = 3;
    std::memcpy(&x.bits, t.const_data_ptr<double>(), sizeof x.bits);
  } else if (type == at::kLong) {
    x = {4, *t.const_data_ptr<int64_t>()};
  } else if (type == at::kBool) {
    x = {5, *t.const_data_ptr<bool>()};
  } else if (at::isIntegralType(type, /*includeBool=*/false)) {
    x = {4, t.item<int64_t>()};
  } else if (at::isFloatingType(type)) {
    double d = t.item<double>();
    x.tag = 3;
    std::memcpy(&x.bits, &d, sizeof x.bits);
  } else {
    return false;
  }
  return true;
}

// A tensor's part of a call's key, its storage joining `storages` (in order of first use); false
// when this path does not read it (a view with an offset, another device, ...). A Python number
// passed as a tensor (`x * 3`) is a runtime value of the program: with `numbers`, keyed by its
// type and appended there; without (a compiled graph's argument), keyed by its value. With
// `numbers`, a 0-dim CPU tensor is a runtime value too (keyed by its dtype).
bool tensor_layout(const at::Tensor& t, Key& key, std::vector<c10::StorageImpl*>& storages,
                   std::vector<Number>* numbers = nullptr) {
  if (!t.defined()) {
    key.push_back(-1);
    return true;
  }
  bool wrapped = t.unsafeGetTensorImpl()->is_wrapped_number();
  if (wrapped || (numbers != nullptr && t.is_cpu() && t.dim() == 0)) {
    Number x;
    if (!host_number(t, x)) return false;
    if (wrapped) {
      key.push_back(x.tag + 4);  // 7, 8, 9
    } else {
      key.insert(key.end(), {12, static_cast<int64_t>(t.scalar_type())});
    }
    if (numbers != nullptr) {
      numbers->push_back(x);
    } else {
      key.push_back(x.bits);
    }
    return true;
  }
  if (!t.is_privateuseone() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || t.is_conj() ||
      t.is_neg() || t.storage_offset() != 0) {
    return false;
  }
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  size_t index = 0;
  while (index < storages.size() && storages[index] != s) ++index;
  if (index == storages.size()) storages.push_back(s);
  key.insert(key.end(), {1, static_cast<int64_t>(index), static_cast<int64_t>(t.scalar_type()),
                         t.device().index(), t.dim()});
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.insert(key.end(), t.strides().begin(), t.strides().end());
  return true;
}

// A list of Scalars' part of the key: each a runtime number (keyed by its type) where `runtime`,
// else keyed by its value; None elements by value. False for a list of anything else.
bool scalar_list(const c10::IValue& v, bool runtime, Key& key, std::vector<Number>& numbers) {
  auto item_of = [&](const c10::IValue& item) {
    Number x;
    if (item.isNone()) {
      key.push_back(-2);
    } else if (!number_of(item, x)) {
      return false;
    } else if (runtime) {
      key.push_back(x.tag + 20);
      numbers.push_back(x);
    } else {
      key.insert(key.end(), {x.tag, x.bits});
    }
    return true;
  };
  if (v.isDoubleList()) {
    auto list = v.toDoubleList();
    key.insert(key.end(), {11, static_cast<int64_t>(list.size())});
    for (double d : list) {
      if (!item_of(c10::IValue(d))) return false;
    }
    return true;
  }
  if (!v.isList()) return false;
  c10::ArrayRef<c10::IValue> list = v.toListRef();
  key.insert(key.end(), {11, static_cast<int64_t>(list.size())});
  for (const c10::IValue& item : list) {
    if (!item_of(item)) return false;
  }
  return true;
}

// The layout part of a call's key, its storages in order of first use and its runtime numbers in
// argument order (the order in which the Python encoder lists them); false when the call has an
// argument this path does not read (it then always takes the Python kernel).
bool layout_of(const torch::jit::Stack& stack, const std::vector<ArgCode>& codes, Key& key,
               std::vector<c10::StorageImpl*>& storages, std::vector<Number>& numbers) {
  key.push_back(precision_code.load(std::memory_order_relaxed));
  size_t first = stack.size() - codes.size();
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    const ArgCode& code = codes[i - first];
    Number x;
    if (v.isTensor()) {
      if (!tensor_layout(v.toTensor(), key, storages, &numbers)) return false;
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      key.insert(key.end(), {10, static_cast<int64_t>(list.size())});
      for (const at::Tensor& t : list) {
        if (!tensor_layout(t, key, storages, &numbers)) return false;
      }
    } else if (v.isNone()) {
      key.push_back(-2);
    } else if (number_of(v, x)) {
      if (code.kind == ArgCode::kScalar && !(code.has_default && x == code.fallback)) {
        key.push_back(x.tag + 20);  // a runtime value: keyed by its type
        numbers.push_back(x);
      } else {
        key.insert(key.end(), {x.tag, x.bits});
      }
    } else if (v.isIntList()) {
      auto list = v.toIntList();
      key.insert(key.end(), {6, static_cast<int64_t>(list.size())});
      for (int64_t item : list) key.push_back(item);
    } else if (!scalar_list(v, code.kind == ArgCode::kScalarList, key, numbers)) {
      return false;
    }
  }
  return true;
}

// The runtime numbers as a Python tuple (a new reference; nullptr with an error set). Needs the GIL.
PyObject* numbers_tuple(const std::vector<Number>& numbers) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(numbers.size()));
  for (size_t i = 0; tuple != nullptr && i < numbers.size(); ++i) {
    const Number& x = numbers[i];
    PyObject* item;
    if (x.tag == 3) {
      double d;
      std::memcpy(&d, &x.bits, sizeof d);
      item = PyFloat_FromDouble(d);
    } else if (x.tag == 4) {
      item = PyLong_FromLongLong(x.bits);
    } else {
      item = PyBool_FromLong(static_cast<long>(x.bits));
    }
    if (item == nullptr) {
      Py_CLEAR(tuple);
    } else {
      PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
    }
  }
  return tuple;
}

// A Python number as a Number; false for another object. Needs the GIL.
bool number_from_python(PyObject* obj, Number& x) {
  if (PyBool_Check(obj)) {
    x = {5, obj == Py_True};
  } else if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    x = {4, PyLong_AsLongLongAndOverflow(obj, &overflow)};
    if (overflow) return false;
  } else if (PyFloat_CheckExact(obj)) {
    double d = PyFloat_AS_DOUBLE(obj);
    x.tag = 3;
    std::memcpy(&x.bits, &d, sizeof x.bits);
  } else {
    return false;
  }
  return true;
}

bool attr_is_true(PyObject* obj, PyObject* name) {
  PyObject* got = PyObject_GetAttr(obj, name);
  if (got == nullptr) {
    PyErr_Clear();
    return true;
  }
  bool result = got != Py_False;
  Py_DECREF(got);
  return result;
}

// Each written storage's device array (new references) -- with `buffers`, every storage's
// DeviceBuffer instead -- its buffer's dtype, size and whether it was ever written joining the
// key (an unwritten storage reads as zeros: its program makes them, and takes no array for it);
// false if a storage has no DeviceBuffer, no element type, or is spread over devices. Needs the
// GIL.
bool values_of(const std::vector<c10::StorageImpl*>& storages, Key& key, std::vector<PyObject*>& values,
               bool buffers) {
  for (c10::StorageImpl* s : storages) {
    PyObject* storage = s->pyobj_slot()->load_pyobj();
    if (storage == nullptr) return false;
    PyObject* buffer = PyObject_GetAttr(storage, buffer_attr);
    if (buffer == nullptr) {
      PyErr_Clear();
      return false;
    }
    PyObject* value = PyObject_GetAttr(buffer, value_attr);
    PyObject* dtype = PyObject_GetAttr(buffer, dtype_attr);
    bool usable = value != nullptr && dtype != nullptr && !attr_is_true(buffer, untyped_attr) &&
                  !attr_is_true(buffer, sharded_attr);
    if (!usable) {
      PyErr_Clear();
      Py_DECREF(buffer);
      Py_XDECREF(value);
      Py_XDECREF(dtype);
      return false;
    }
    bool written = value != Py_None;
    key.insert(key.end(), {reinterpret_cast<intptr_t>(dtype), static_cast<int64_t>(s->nbytes()), written});
    Py_DECREF(dtype);  // torch dtypes live as long as the process
    if (buffers) {
      Py_DECREF(value);
      values.push_back(buffer);
    } else {
      Py_DECREF(buffer);
      if (written) {
        values.push_back(value);
      } else {
        Py_DECREF(value);
      }
    }
  }
  return true;
}

// New tensors' geometry as `learn` reports it, [(dtype, numel, sizes, strides, nbytes), ...],
// appended to `outputs` (which own their references).
bool read_outputs(PyObject* list, std::vector<Output>& outputs) {
  if (!PyList_Check(list)) return false;
  for (Py_ssize_t i = 0; i < PyList_Size(list); ++i) {
    PyObject *dtype, *sizes, *strides;
    long long numel, nbytes;
    if (!PyArg_ParseTuple(PyList_GetItem(list, i), "OLOOL", &dtype, &numel, &sizes, &strides, &nbytes) ||
        !THPDtype_Check(dtype)) {
      return false;
    }
    Output out;
    Py_INCREF(dtype);
    out.dtype = dtype;
    out.numel = PyLong_FromLongLong(numel);
    out.scalar_type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    for (Py_ssize_t d = 0; d < PyTuple_Size(sizes); ++d) {
      out.sizes.push_back(PyLong_AsLongLong(PyTuple_GetItem(sizes, d)));
    }
    for (Py_ssize_t d = 0; d < PyTuple_Size(strides); ++d) {
      out.strides.push_back(PyLong_AsLongLong(PyTuple_GetItem(strides, d)));
    }
    out.nbytes = nbytes;
    outputs.push_back(std::move(out));
  }
  return !PyErr_Occurred();
}

// What `learn` reported for a plain call: (jitted executable or plan, runtime values, device,
// new outputs (`read_outputs`), storages of `self` it writes in place, the plan's value classes).
bool read_executable(PyObject* info, Executable& exe) {
  PyObject *runner, *values, *device, *outputs, *classes;
  long long writes_self;
  if (!PyArg_ParseTuple(info, "OO!OOLO", &runner, &PyTuple_Type, &values, &device, &outputs, &writes_self,
                        &classes)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(values); ++i) {
    Number x;
    if (!number_from_python(PyTuple_GET_ITEM(values, i), x)) return false;
    exe.learned.push_back(x);
  }
  Py_INCREF(classes);
  exe.classes = classes;
  exe.writes_self = writes_self;
  exe.index = static_cast<c10::DeviceIndex>(PyLong_AsLong(device));
  if (!read_outputs(outputs, exe.outputs)) return false;
  Py_INCREF(runner);
  Py_INCREF(values);
  Py_INCREF(device);
  exe.runner = runner;
  exe.values = values;
  exe.device = device;
  return !PyErr_Occurred();
}

// A new tpu tensor of this geometry, dtype and device over a storage of `nbytes` that owns
// `buffer` (a DeviceBuffer; stolen). Undefined (a Python error may be set) if `buffer` is nullptr
// or the tensor cannot be made. Needs the GIL.
at::Tensor tensor_over(PyObject* buffer, c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType scalar_type,
                       c10::DeviceIndex index, int64_t nbytes) {
  uint64_t address = buffer != nullptr ? addresses.take(nbytes) : 0;
  at::Tensor t;
  if (address != 0) {
    try {
      c10::Device device(c10::DeviceType::PrivateUse1, index);
      t = at::from_blob(reinterpret_cast<void*>(address), sizes, strides, [](void*) {},
                        at::TensorOptions().dtype(scalar_type).device(device), device);
      PyObject* storage = THPStorage_Wrap(t.storage());
      if (storage == nullptr || PyObject_SetAttr(storage, buffer_attr, buffer) != 0) t = at::Tensor();
      Py_XDECREF(storage);
    } catch (const std::exception&) {
      t = at::Tensor();  // the caller reports it
    }
  }
  Py_XDECREF(buffer);
  return t;
}

// A new tpu tensor of `out`'s geometry over `value`: a DeviceBuffer (`is_buffer`: what a recorded
// call gives), or a device array that a new DeviceBuffer on `exe`'s device takes (what an
// executable returns). Steals `value`; undefined (a Python error may be set) if it cannot be
// made. Needs the GIL.
at::Tensor new_output(const Output& out, PyObject* value, const Executable& exe, bool is_buffer) {
  PyObject* buffer = value == nullptr || is_buffer
                         ? value
                         : PyObject_CallFunctionObjArgs(new_buffer, out.dtype, out.numel, exe.device, value, nullptr);
  if (buffer != value) Py_XDECREF(value);
  return tensor_over(buffer, out.sizes, out.strides, out.scalar_type, exe.index, out.nbytes);
}

// Strict mode, in place: output `i` of an executable becomes the value of the buffer of the
// storage it writes (whose array it was given, donated). False with a Python error set if that
// fails. Needs the GIL.
bool install(c10::StorageImpl* written, PyObject* outs, int64_t i) {
  PyObject* storage = written->pyobj_slot()->load_pyobj();
  PyObject* buffer = storage == nullptr ? nullptr : PyObject_GetAttr(storage, buffer_attr);
  PyObject* value = buffer == nullptr ? nullptr : PySequence_GetItem(outs, static_cast<Py_ssize_t>(i));
  bool ok = value != nullptr && PyObject_SetAttr(buffer, value_attr, value) == 0;
  Py_XDECREF(value);
  Py_XDECREF(buffer);
  if (!ok && !PyErr_Occurred()) {
    PyErr_SetString(PyExc_RuntimeError, "torchtpu: a storage the call writes has no device buffer");
  }
  return ok;
}

using Cache = std::unordered_map<Key, std::shared_ptr<const Executable>, KeyHash>;

enum Outcome { kDone, kDeclined, kFailed };

struct FastKernel final : public c10::OperatorKernel {
  FastKernel(PyObject* op, std::vector<ArgCode> codes, bool returns_list)
      : op(op), codes(std::move(codes)), returns_list(returns_list) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
    size_t n = codes.size();
    int mode = eager_mode.load(std::memory_order_relaxed);
    Key key;
    std::vector<c10::StorageImpl*> storages;
    std::vector<Number> numbers;
    bool unknown = false;  // a readable call whose key this mode never saw: learn it
    if (mode != kOther && layout_of(*stack, codes, key, storages, numbers)) {
      Gil gil;
      std::vector<PyObject*> values;
      Outcome done = kDeclined;
      if (values_of(storages, key, values, mode == kDefer)) {
        Cache& cache = caches[mode];
        std::shared_ptr<const Executable> exe;
        auto found = cache.find(key);
        if (found != cache.end()) {
          exe = found->second;
        } else {
          unknown = true;
        }
        done = exe && exe->runner != nullptr ? run(*exe, values, numbers, storages, mode, n, stack) : kDeclined;
      }
      for (PyObject* v : values) Py_DECREF(v);  // values_of may have taken some before it failed
      if (done == kFailed) {
        // A recorded call (or a flush it caused), or a strict call that was given `self`'s
        // buffer, failed: its error is the call's, raised as it is -- running the Python kernel
        // instead would record the call twice, lose the error, or read a donated buffer.
        raise_as_torch();
        python_error error;
        error.persist();
        throw error;
      }
      if (done == kDone) return;
    }
    handle.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
    if (unknown) remember(std::move(key), numbers, mode);
  }

  // The runtime numbers to pass for a call of `exe`'s key: `exe`'s own tuple when the call's are
  // the same, a new tuple of the call's when PyTorch's checks saw numbers of their class for this
  // key (`fits`), else nullptr (the Python kernel checks them: a call that PyTorch rejects raises
  // there, one it accepts adds the class). Needs the GIL.
  static PyObject* runtime_numbers(const Executable& exe, const std::vector<Number>& numbers) {
    if (numbers == exe.learned) {
      Py_INCREF(exe.values);
      return exe.values;
    }
    PyObject* own = numbers_tuple(numbers);
    PyObject* fit = own == nullptr ? nullptr : PyObject_CallFunctionObjArgs(fits, exe.classes, own, nullptr);
    bool ok = fit != nullptr && PyObject_IsTrue(fit) == 1;
    Py_XDECREF(fit);
    if (!ok) {
      PyErr_Clear();
      Py_CLEAR(own);
    }
    return own;
  }

  // Do a known plain call from here: kDone; kDeclined (the stack unchanged) when the Python
  // kernel must; kFailed (a Python error set) when the call failed after it was recorded or
  // given `self`'s buffer. Strict runs the executable on the storages' arrays and the runtime
  // numbers, whose results become new buffers (or `self`'s buffer's value); defer records the
  // plan on the storages' buffers, which gives the new buffers (and makes `self`'s a promise).
  // Needs the GIL.
  Outcome run(const Executable& exe, std::vector<PyObject*>& values, const std::vector<Number>& numbers,
              const std::vector<c10::StorageImpl*>& storages, int mode, size_t n, torch::jit::Stack* stack) {
    PyObject* given = runtime_numbers(exe, numbers);
    if (given == nullptr) return kDeclined;
    // Borrowed references: `values` (released by the caller), `given` (released below) and `exe`'s.
    std::vector<PyObject*> args;
    if (mode == kDefer) args = {exe.runner, given};
    args.insert(args.end(), values.begin(), values.end());
    if (mode == kStrict) {
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(given); ++i) args.push_back(PyTuple_GET_ITEM(given, i));
    }
    PyObject* outs = PyObject_Vectorcall(mode == kStrict ? exe.runner : record_known, args.data(), args.size(),
                                         nullptr);
    Py_DECREF(given);
    if (outs == nullptr) {
      if (mode == kDefer || exe.writes_self) return kFailed;
      PyErr_Clear();  // the Python kernel runs the call again and reports what went wrong
      return kDeclined;
    }
    if (exe.writes_self) {
      bool ok = true;
      for (int64_t i = 0; i < exe.writes_self && ok && mode == kStrict; ++i) ok = install(storages[i], outs, i);
      Py_DECREF(outs);
      if (!ok) return kFailed;
      c10::IValue self = (*stack)[stack->size() - n];
      torch::jit::drop(*stack, n);
      if (self.isTensor()) stack->emplace_back(std::move(self));  // a list is not returned
      fast_calls.fetch_add(1, std::memory_order_relaxed);
      return kDone;
    }
    bool ok = true;
    std::vector<at::Tensor> results;
    for (size_t i = 0; i < exe.outputs.size() && ok; ++i) {
      PyObject* value = PySequence_GetItem(outs, static_cast<Py_ssize_t>(i));
      at::Tensor t = new_output(exe.outputs[i], value, exe, mode == kDefer);
      ok = t.defined();
      if (ok) results.push_back(std::move(t));
    }
    Py_DECREF(outs);
    if (!ok) {
      if (mode == kDefer) {
        if (!PyErr_Occurred()) {
          PyErr_SetString(PyExc_RuntimeError, "torchtpu: a recorded call's outputs could not be made into tensors");
        }
        return kFailed;
      }
      PyErr_Clear();
      return kDeclined;
    }
    torch::jit::drop(*stack, n);
    if (returns_list) {
      stack->emplace_back(c10::List<at::Tensor>(results));
    } else {
      for (at::Tensor& t : results) stack->emplace_back(std::move(t));
    }
    fast_calls.fetch_add(1, std::memory_order_relaxed);
    return kDone;
  }

  // After the Python kernel did a call of a key `mode` never saw: remember what it did, or that
  // the key is not plain (in that mode) -- also when the runtime numbers it passed are not the
  // ones this kernel read (the two would then disagree on which Scalars are runtime values).
  void remember(Key key, const std::vector<Number>& numbers, int mode) {
    Gil gil;
    PyObject* info = PyObject_CallFunction(learn, "Oi", op, mode);
    if (info == nullptr) {
      PyErr_Clear();
      return;
    }
    auto exe = std::make_shared<Executable>();
    if (info != Py_None && (!read_executable(info, *exe) || exe->learned != numbers)) {
      PyErr_Clear();
      exe = std::make_shared<Executable>();
    }
    Py_DECREF(info);
    Cache& cache = caches[mode];
    if (cache.size() >= kMaxKeys) cache.clear();
    cache.emplace(std::move(key), std::move(exe));
  }

  PyObject* op;  // the OpOverload, passed to `learn`
  std::vector<ArgCode> codes;  // how the key reads each argument
  bool returns_list;  // the op returns its new tensors as one list (`_foreach_sqrt`)
  Cache caches[2];  // per mode (kStrict, kDefer); guarded by the GIL
};

// A view only changes metadata: PyTorch's CPU kernel makes it for a tpu tensor as well (the
// Python view kernels in torchtpu/exec/kernels.py do the same, through Python).
void cpu_view(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
  handle.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// --- factories -----------------------------------------------------------------------------------
//
// `torch.empty` and `torch.empty_strided` (so `empty_like` and `new_empty` too) on tpu: a new
// tensor over a new DeviceBuffer, which holds no device memory until it is written. Made here,
// as the fast path makes its outputs, instead of by the Python kernel (`memory.empty_*`: ~22 us a
// call through PyTorch's dispatch into Python, against ~7 here). In every eager mode: an empty
// tensor is the same in all. Any call but the plain one -- symbolic, negative or overflowing
// geometry, another layout, pinned memory, a memory format other than contiguous or preserve, a
// dtype torchtpu does not support, or a device the Python kernel has not yet made a tensor on (it
// validates the index and takes the device's process lock) -- goes to the Python kernel on
// PrivateUse2, which checks it and raises what is wrong.

PyObject* supported_dtypes = nullptr;  // the torch.dtypes torchtpu supports (a frozenset)
std::atomic<uint64_t> devices_made_on{0};  // bit i: the Python kernel made a tensor on tpu:i

// The concrete ints of a (Sym)Int list argument, or false.
bool int_list(const c10::IValue& value, std::vector<int64_t>& out) {
  if (value.isIntList()) {
    out = value.toIntVector();
    return true;
  }
  if (!value.isList()) return false;
  for (const c10::IValue& item : value.toListRef()) {
    if (item.isInt()) {
      out.push_back(item.toInt());
    } else if (item.isSymInt() && !item.toSymInt().is_symbolic()) {
      out.push_back(item.toSymInt().as_int_unchecked());
    } else {
      return false;
    }
  }
  return true;
}

// The new empty tensor of a factory call whose arguments (the last `n` on the stack) are
// `size, [stride,] dtype, layout, device, pin_memory[, memory_format]`; undefined where the
// Python kernel must make it.
at::Tensor plain_empty(torch::jit::Stack* stack, bool strided) {
  const size_t n = 6;
  const c10::IValue* arg = &(*stack)[stack->size() - n];
  std::vector<int64_t> sizes, strides;
  if (!int_list(arg[0], sizes)) return {};
  if (strided && (!int_list(arg[1], strides) || strides.size() != sizes.size())) return {};
  const c10::IValue* rest = arg + (strided ? 2 : 1);  // dtype, layout, device, pin_memory
  if (!rest[1].isNone() && rest[1].toLayout() != c10::kStrided) return {};
  if (!rest[3].isNone() && rest[3].toBool()) return {};
  if (!strided && !rest[4].isNone()) {
    c10::MemoryFormat format = rest[4].toMemoryFormat();
    if (format != c10::MemoryFormat::Contiguous && format != c10::MemoryFormat::Preserve) return {};
  }
  c10::ScalarType scalar_type =
      rest[0].isNone() ? c10::typeMetaToScalarType(c10::get_default_dtype()) : rest[0].toScalarType();
  if (!rest[2].isNone() && !rest[2].toDevice().is_privateuseone()) return {};
  c10::DeviceIndex index = rest[2].isNone() ? -1 : rest[2].toDevice().index();
  if (index < 0) index = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  if (index < 0 || index >= 64 || !(devices_made_on.load(std::memory_order_relaxed) >> index & 1)) return {};
  // The storage's elements, as storage.py's `storage_numel` counts them.
  int64_t numel = 1, acc = 1;
  bool none = false;
  if (!strided) strides.assign(sizes.size(), 0);
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] < 0 || (strided && strides[i] < 0)) return {};
    if (!strided) {
      strides[i] = acc;
      if (__builtin_mul_overflow(acc, std::max<int64_t>(sizes[i], 1), &acc)) return {};
    }
    none = none || sizes[i] == 0;
    int64_t span;
    if (sizes[i] > 0 && (__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) ||
                         __builtin_add_overflow(numel, span, &numel))) {
      return {};
    }
  }
  int64_t nbytes;
  if (none) numel = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(scalar_type)), &nbytes)) return {};
  Gil gil;
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(scalar_type));
  if (PySet_Contains(supported_dtypes, dtype) != 1) {
    PyErr_Clear();
    return {};
  }
  PyObject* buffer = PyObject_CallFunction(new_buffer, "OLiO", dtype, static_cast<long long>(numel),
                                           static_cast<int>(index), Py_None);
  at::Tensor t = tensor_over(buffer, sizes, strides, scalar_type, index, nbytes);
  if (!t.defined()) PyErr_Clear();  // the Python kernel makes it, or says what went wrong
  return t;
}

template <bool kStrided>
void empty_kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
  at::Tensor t = plain_empty(stack, kStrided);
  if (t.defined()) {
    torch::jit::drop(*stack, 6);
    stack->emplace_back(std::move(t));
    factory_fast_calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  handle.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
  c10::DeviceIndex index = stack->back().toTensor().device().index();
  if (index >= 0 && index < 64) devices_made_on.fetch_or(uint64_t{1} << index, std::memory_order_relaxed);
}

std::mutex libraries_lock;
std::vector<std::unique_ptr<torch::Library>> libraries;
std::vector<FastKernel*> kernels;  // guarded by the GIL

void keep(std::unique_ptr<torch::Library> library) {
  std::lock_guard<std::mutex> guard(libraries_lock);
  libraries.push_back(std::move(library));
}

std::unique_ptr<torch::Library> impl_library(const char* ns) {
  return std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1, __FILE__,
                                          __LINE__);
}

// --- compiled graphs ----------------------------------------------------------------------------
//
// A compiled graph's call (torchtpu/exec/compile.py) that repeats an earlier call's layout does
// what that call did, as an op call does: `torchtpu_graph_call` keys the call's arguments (tensors
// as above, numbers and None by value) and, for a key whose call the Python path reported as
// plain (`fast_dispatch.learn_graph`: one executable (strict) or plan (defer), no runtime values
// but a random graph's RNG key, which each call draws, no device-side checks or host values), in
// strict mode runs the executable on the written storages' arrays and installs the values of the
// storages it writes (donated to it), in defer mode records the plan on the storages' buffers
// (`deferred.record_known`, which makes the written ones promises); then returns the graph's
// outputs: new tensors, arguments passed through, constants. Each mode learns its own keys;
// anything else is the Python path's.

struct GraphExecutable {
  Executable exe;  // runner, device and new outputs (no runtime values, nothing written in place)
  std::vector<int64_t> written;  // storages whose buffers its first outputs replace (strict), in order
  // The graph's result, per entry: a new tensor (kind 0, index), an argument (1, index) or a
  // constant (2, value).
  struct Entry {
    int kind;
    Py_ssize_t index;
    PyObject* value;
  };
  std::vector<Entry> result;
  // A random graph's source of RNG keys (a callable drawing the next key words of its device,
  // the one runtime value it takes), or nullptr.
  PyObject* keys = nullptr;

  GraphExecutable() = default;
  GraphExecutable(const GraphExecutable&) = delete;
  GraphExecutable& operator=(const GraphExecutable&) = delete;
  ~GraphExecutable() {
    for (Entry& entry : result) Py_XDECREF(entry.value);
    Py_XDECREF(keys);
  }
};

// One compiled graph's known keys (owned by a capsule the graph holds); guarded by the GIL.
struct GraphCache {
  std::unordered_map<Key, std::shared_ptr<const GraphExecutable>, KeyHash> executables;
};
std::vector<GraphCache*> graph_caches;  // the live ones, for torchtpu_fast_clear; guarded by the GIL

constexpr const char* kGraphCapsule = "torchtpu.graph_cache";

// A compiled graph's call arguments' key and storages; false for an argument this path does not
// read (a CPU tensor, a list, ...).
bool graph_layout(PyObject* args, Key& key, std::vector<c10::StorageImpl*>& storages) {
  key.push_back(precision_code.load(std::memory_order_relaxed));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (THPVariable_Check(a)) {
      if (!tensor_layout(THPVariable_Unpack(a), key, storages)) return false;
    } else if (a == Py_None) {
      key.push_back(-2);
    } else if (PyBool_Check(a)) {
      key.insert(key.end(), {5, a == Py_True});
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow) return false;
      key.insert(key.end(), {4, v});
    } else if (PyFloat_CheckExact(a)) {
      double d = PyFloat_AS_DOUBLE(a);
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.insert(key.end(), {3, bits});
    } else {
      return false;
    }
  }
  return !storages.empty();
}

// Run (strict) or record (defer) a known graph call: its result list, or nullptr with a Python
// error set (the call failed after it was recorded or its written storages' arrays were given
// away: raised, not re-run). `values`: the written storages' arrays (strict) or every storage's
// buffer (defer). Needs the GIL.
PyObject* run_graph(const GraphExecutable& graph, std::vector<PyObject*>& values,
                    const std::vector<c10::StorageImpl*>& storages, PyObject* args, int mode) {
  const Executable& exe = graph.exe;
  PyObject* key = graph.keys == nullptr ? nullptr : PyObject_CallNoArgs(graph.keys);
  if (graph.keys != nullptr && key == nullptr) return nullptr;
  PyObject* runtime = key == nullptr ? empty_tuple : PyTuple_Pack(1, key);
  if (runtime == nullptr) {
    Py_XDECREF(key);
    return nullptr;
  }
  PyObject* outs;
  int64_t n_written = 0;  // the results before the new tensors': the written storages' (strict)
  if (mode == kDefer) {
    std::vector<PyObject*> recorded = {exe.runner, runtime};
    recorded.insert(recorded.end(), values.begin(), values.end());
    outs = PyObject_Vectorcall(record_known, recorded.data(), recorded.size(), nullptr);
  } else {
    std::vector<PyObject*> inputs(values.begin(), values.end());
    if (key != nullptr) inputs.push_back(key);
    outs = PyObject_Vectorcall(exe.runner, inputs.data(), inputs.size(), nullptr);
    n_written = static_cast<int64_t>(graph.written.size());
  }
  if (runtime != empty_tuple) Py_DECREF(runtime);
  Py_XDECREF(key);
  if (outs == nullptr) {
    raise_as_torch();
    return nullptr;
  }
  bool ok = true;
  for (int64_t k = 0; k < n_written && ok; ++k) ok = install(storages[graph.written[k]], outs, k);
  std::vector<PyObject*> fresh;  // the new tensors, wrapped
  for (size_t i = 0; i < exe.outputs.size() && ok; ++i) {
    PyObject* value = PySequence_GetItem(outs, static_cast<Py_ssize_t>(n_written + i));
    at::Tensor t = new_output(exe.outputs[i], value, exe, mode == kDefer);
    PyObject* wrapped = t.defined() ? THPVariable_Wrap(std::move(t)) : nullptr;
    ok = wrapped != nullptr;
    if (ok) fresh.push_back(wrapped);
  }
  Py_DECREF(outs);
  PyObject* list = ok ? PyList_New(static_cast<Py_ssize_t>(graph.result.size())) : nullptr;
  for (size_t j = 0; list != nullptr && j < graph.result.size(); ++j) {
    const GraphExecutable::Entry& entry = graph.result[j];
    PyObject* item = entry.kind == 0 ? fresh[entry.index]
                     : entry.kind == 1 ? PyTuple_GET_ITEM(args, entry.index)
                                       : entry.value;
    Py_INCREF(item);
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(j), item);
  }
  for (PyObject* w : fresh) Py_DECREF(w);
  if (list == nullptr && !PyErr_Occurred()) {
    PyErr_SetString(PyExc_RuntimeError, "torchtpu: a compiled graph's outputs could not be made into tensors");
  }
  if (list != nullptr) graph_fast_calls.fetch_add(1, std::memory_order_relaxed);
  return list;
}

// What `learn_graph` reported for a plain graph call: (jitted executable or plan, device, new
// outputs, written storages, result entries ((kind, index or value), ...), RNG key source or None).
bool read_graph_executable(PyObject* info, GraphExecutable& graph) {
  PyObject *runner, *device, *outputs, *written, *result, *keys;
  if (!PyArg_ParseTuple(info, "OOOO!O!O", &runner, &device, &outputs, &PyTuple_Type, &written, &PyTuple_Type,
                        &result, &keys)) {
    return false;
  }
  if (keys != Py_None) {
    Py_INCREF(keys);
    graph.keys = keys;
  }
  Executable& exe = graph.exe;
  exe.index = static_cast<c10::DeviceIndex>(PyLong_AsLong(device));
  if (!read_outputs(outputs, exe.outputs)) return false;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(written); ++k) {
    graph.written.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(written, k)));
  }
  for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(result); ++j) {
    int kind;
    PyObject* what;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(result, j), "iO", &kind, &what)) return false;
    GraphExecutable::Entry entry{kind, 0, nullptr};
    if (kind == 2) {
      Py_INCREF(what);
      entry.value = what;
    } else {
      entry.index = PyLong_AsSsize_t(what);
      size_t bound = kind == 0 ? exe.outputs.size() : static_cast<size_t>(PY_SSIZE_T_MAX);
      if (entry.index < 0 || static_cast<size_t>(entry.index) >= bound) return false;
    }
    graph.result.push_back(entry);
  }
  Py_INCREF(runner);
  Py_INCREF(device);
  exe.runner = runner;
  exe.device = device;
  return !PyErr_Occurred();
}

void drop_graph_cache(PyObject* capsule) {
  auto* cache = static_cast<GraphCache*>(PyCapsule_GetPointer(capsule, kGraphCapsule));
  graph_caches.erase(std::remove(graph_caches.begin(), graph_caches.end(), cache), graph_caches.end());
  delete cache;
}

}  // namespace

extern "C" {

// Called once with the GIL held: the Python objects the kernels use.
int torchtpu_fast_init(PyObject* new_buffer_fn, PyObject* reserve_fn, PyObject* learn_fn, PyObject* record_fn,
                       PyObject* fits_fn, PyObject* as_torch_fn, long long chunk) {
  buffer_attr = PyUnicode_InternFromString("_tpu_buffer");
  value_attr = PyUnicode_InternFromString("value");
  dtype_attr = PyUnicode_InternFromString("dtype");
  untyped_attr = PyUnicode_InternFromString("untyped");
  sharded_attr = PyUnicode_InternFromString("sharded");
  Py_INCREF(new_buffer_fn);
  Py_INCREF(reserve_fn);
  Py_INCREF(learn_fn);
  Py_INCREF(record_fn);
  Py_INCREF(fits_fn);
  Py_INCREF(as_torch_fn);
  new_buffer = new_buffer_fn;
  reserve = reserve_fn;
  learn = learn_fn;
  record_known = record_fn;
  fits = fits_fn;
  as_torch = as_torch_fn;
  empty_tuple = PyTuple_New(0);
  address_chunk = chunk;
  return 0;
}

// Registers the fast kernel for PrivateUse1 on `name.overload` (the Python kernel goes to
// PrivateUse2); `codes` says how to read each argument: ((kind, default or None), ...), see
// `ArgCode`; `returns_list`, whether the op returns one list of tensors. Called with the GIL
// held; 0 on success.
int torchtpu_fast_install(const char* ns, const char* name, PyObject* op, PyObject* codes, int returns_list) {
  if (!PyTuple_Check(codes)) {
    PyErr_SetString(PyExc_TypeError, "torchtpu_fast_install: codes must be a tuple");
    return 1;
  }
  std::vector<ArgCode> read;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(codes); ++i) {
    int kind;
    PyObject* fallback;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(codes, i), "iO", &kind, &fallback)) return 1;
    ArgCode code;
    code.kind = static_cast<ArgCode::Kind>(kind);
    code.has_default = fallback != Py_None && number_from_python(fallback, code.fallback);
    read.push_back(code);
  }
  try {
    Py_INCREF(op);
    auto kernel = std::make_unique<FastKernel>(op, std::move(read), returns_list != 0);
    kernels.push_back(kernel.get());
    auto library = impl_library(ns);
    library->impl(name, torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
    keep(std::move(library));
    return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 1;
  }
}

// Registers the CPU-redispatching view kernel for PrivateUse1 on `name.overload`; 0 on success.
int torchtpu_view_install(const char* ns, const char* name) {
  try {
    auto library = impl_library(ns);
    library->impl(name, torch::CppFunction::makeFromBoxedFunction<&cpu_view>());
    keep(std::move(library));
    return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 1;
  }
}

// Registers the factory kernels for PrivateUse1 on aten::empty.memory_format and
// aten::empty_strided (their Python kernels go to PrivateUse2); `dtypes`: a frozenset of the
// torch.dtypes torchtpu supports. Called with the GIL held; 0 on success.
int torchtpu_empty_install(PyObject* dtypes) {
  try {
    Py_INCREF(dtypes);
    supported_dtypes = dtypes;
    auto library = impl_library("aten");
    library->impl("empty.memory_format", torch::CppFunction::makeFromBoxedFunction<&empty_kernel<false>>());
    library->impl("empty_strided", torch::CppFunction::makeFromBoxedFunction<&empty_kernel<true>>());
    keep(std::move(library));
    return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 1;
  }
}

long long torchtpu_factory_calls() { return factory_fast_calls.load(); }

void torchtpu_factory_reset_calls() { factory_fast_calls.store(0); }

// The eager mode the kernels serve: 0 strict, 1 defer, -1 any other (the Python kernels).
void torchtpu_fast_set_mode(int mode) { eager_mode.store(mode == kStrict || mode == kDefer ? mode : kOther); }

void torchtpu_fast_set_precision(long long code) { precision_code.store(code); }

long long torchtpu_fast_calls() { return fast_calls.load(); }

void torchtpu_fast_reset_calls() { fast_calls.store(0); }

// Forget every remembered key (their executables too). Called with the GIL held.
void torchtpu_fast_clear() {
  for (FastKernel* kernel : kernels) {
    for (Cache& cache : kernel->caches) cache.clear();
  }
  for (GraphCache* cache : graph_caches) cache->executables.clear();
}

long long torchtpu_graph_fast_calls() { return graph_fast_calls.load(); }

void torchtpu_graph_reset_calls() { graph_fast_calls.store(0); }

// A new, empty cache of one compiled graph's calls: a capsule the graph keeps.
PyObject* torchtpu_graph_cache_new() {
  auto* cache = new GraphCache();
  PyObject* capsule = PyCapsule_New(cache, kGraphCapsule, drop_graph_cache);
  if (capsule == nullptr) {
    delete cache;
    return nullptr;
  }
  graph_caches.push_back(cache);
  return capsule;
}

// A compiled graph's call on `args` (a tuple), done from here if its key is known and plain: the
// result list. Otherwise the key as bytes, for `torchtpu_graph_learn` after the Python path ran
// the call, if this mode learns it and never saw it, else None. Called with the GIL held.
PyObject* torchtpu_graph_call(PyObject* capsule, PyObject* args) {
  auto* cache = static_cast<GraphCache*>(PyCapsule_GetPointer(capsule, kGraphCapsule));
  if (cache == nullptr || !PyTuple_Check(args)) return nullptr;
  int mode = eager_mode.load(std::memory_order_relaxed);
  Key key = {mode};
  std::vector<c10::StorageImpl*> storages;
  if (mode == kOther || !graph_layout(args, key, storages)) Py_RETURN_NONE;
  std::vector<PyObject*> values;
  PyObject* result = nullptr;
  if (values_of(storages, key, values, mode == kDefer)) {
    auto found = cache->executables.find(key);
    if (found == cache->executables.end()) {
      result = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(key.data()),
                                         static_cast<Py_ssize_t>(key.size() * sizeof(int64_t)));
    } else if (found->second->exe.runner != nullptr) {
      std::shared_ptr<const GraphExecutable> graph = found->second;
      result = run_graph(*graph, values, storages, args, mode);
    }
  }
  for (PyObject* v : values) Py_DECREF(v);
  if (result == nullptr && !PyErr_Occurred()) Py_RETURN_NONE;
  return result;
}

// Remember what the Python path did for the graph call whose key `torchtpu_graph_call` returned:
// `info` as `read_graph_executable` reads it, or None (the key always takes the Python path).
// 0 on success. Called with the GIL held.
int torchtpu_graph_learn(PyObject* capsule, PyObject* key_bytes, PyObject* info) {
  auto* cache = static_cast<GraphCache*>(PyCapsule_GetPointer(capsule, kGraphCapsule));
  if (cache == nullptr || !PyBytes_Check(key_bytes)) return 1;
  const auto* data = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(key_bytes));
  Key key(data, data + PyBytes_GET_SIZE(key_bytes) / sizeof(int64_t));
  auto graph = std::make_shared<GraphExecutable>();
  if (info != Py_None && !read_graph_executable(info, *graph)) {
    PyErr_Clear();
    graph = std::make_shared<GraphExecutable>();
  }
  if (cache->executables.size() >= kMaxKeys) cache->executables.clear();
  cache->executables.emplace(std::move(key), std::move(graph));
  return 0;
}

}  // extern "C"
