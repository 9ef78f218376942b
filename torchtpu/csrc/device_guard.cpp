// The tpu device guard (the current device of each thread, the device count, streams and
// events), the PrivateUse1 hooks, and the PrivateUse1 allocator (see TpuAllocator).
//
// PyTorch's Python PrivateUse1 device guard reports exactly one device and ignores set_device, so
// the autograd engine sizes its per-device ready queues for tpu:0 only and a backward pass on
// tpu:1 fails an internal assert; it has no events, streams or device synchronisation either
// (`torch.Event(device="tpu")`, `torch.accelerator.synchronize()` failed). Its Python hooks
// cannot give a pinned-memory allocator, which PyTorch asks of the device for host staging
// buffers (DDP's reducer, non_blocking copies to the host). Nor does it give an allocator:
// `torch.UntypedStorage(n, device="tpu")` crashed on a null one, and `torch.accelerator`'s memory
// functions failed an internal assert. Guard and hooks are registered for PrivateUse1 before the
// Python ones (registration is first-wins). torchtpu/device_guard.py builds and loads this
// library (the eager fast path's C++ is fast_dispatch.cpp, a library of its own).
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace {

std::atomic<c10::DeviceIndex> device_count{1};
thread_local c10::DeviceIndex current_index = 0;

// What the Python runtime does for PyTorch's device API -- synchronisation, events, memory
// figures -- passed in as ctypes functions, which take the GIL (torchtpu/device_guard.py). Each
// returns a negative number when its Python code raised, with the error's message written into
// `error` (of `size` bytes); an event is the id the runtime gave it when first recorded.
using DeviceFn = int (*)(int device, char* error, size_t size);
using RecordFn = int64_t (*)(int device, int64_t event, int timing, char* error, size_t size);
using EventFn = int (*)(int64_t event, char* error, size_t size);  // query: 1 or 0; synchronize: 0
using DestroyFn = void (*)(int64_t event);
using ElapsedFn = int (*)(int64_t start, int64_t end, double* milliseconds, char* error, size_t size);
using BytesFn = int (*)(int device, int64_t* first, int64_t* second, char* error, size_t size);
using ReleaseFn = int (*)(char* error, size_t size);

struct RuntimeCallbacks {
  DeviceFn synchronize_device;
  RecordFn record_event;
  EventFn query_event;
  EventFn synchronize_event;
  DestroyFn destroy_event;
  ElapsedFn elapsed_time;
  BytesFn memory_stats;  // (allocated, peak) bytes
  DeviceFn reset_peak_memory_stats;
  ReleaseFn empty_cache;
  BytesFn memory_info;  // (free, total) bytes
};

std::atomic<const RuntimeCallbacks*> runtime_callbacks{nullptr};

const RuntimeCallbacks& runtime() {
  const RuntimeCallbacks* callbacks = runtime_callbacks.load();
  TORCH_CHECK(callbacks != nullptr, "the tpu runtime has not registered itself with the device guard (import torchtpu)");
  return *callbacks;
}

// The result of `call(error, size)`, or its error raised as a RuntimeError.
template <typename Call>
auto checked(Call call) {
  char error[1024] = {0};
  auto result = call(error, sizeof(error));
  TORCH_CHECK(result >= 0, error);
  return result;
}

// `device`, its index resolved to the current device where none is given ("tpu").
c10::Device resolved(c10::Device device) {
  return device.has_index() ? device : c10::Device(c10::DeviceType::PrivateUse1, current_index);
}

int64_t event_id(void* event) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(event));
}

struct TpuGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return c10::DeviceType::PrivateUse1;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::PrivateUse1, current_index);
  }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.is_privateuseone(), "expected a tpu device, got ", device);
    TORCH_CHECK(
        device.index() < device_count.load(),
        "tpu:", static_cast<int>(device.index()), " does not exist: this process has ",
        static_cast<int>(device_count.load()), " tpu device(s)");
    if (device.index() >= 0) {
      current_index = device.index();
    }
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) {
      current_index = device.index();
    }
  }
  // A device runs what is issued to it as one queue (torchtpu/streams.py): every stream of a
  // device is that queue.
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, resolved(device));
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, resolved(device));
  }
  c10::Stream getNewStream(c10::Device device, int priority) const override {
    return c10::Stream(c10::Stream::DEFAULT, resolved(device));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool high_priority) const override {
    return c10::Stream(c10::Stream::DEFAULT, resolved(device));
  }
  bool queryStream(const c10::Stream& stream) const override {
    void* event = nullptr;
    record(&event, stream, stream.device_index(), c10::EventFlag::PYTORCH_DEFAULT);
    bool done = queryEvent(event);
    destroyEvent(event, stream.device_index());
    return done;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    synchronizeDevice(resolved(stream.device()).index());
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, stream.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count.load();
  }
  // `torch.accelerator.synchronize()`: everything issued to the device has finished.
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    int device = device_index < 0 ? current_index : device_index;
    checked([&](char* error, size_t size) { return runtime().synchronize_device(device, error, size); });
  }
  // Events (torchtpu/events.py): a marker of the work issued to the device when recorded.
  // `torch.Event(enable_timing=True)` records with the backend's flag: such an event is stamped
  // with the time its work finished.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    int64_t id = event_id(*event);
    int timing = flag == c10::EventFlag::BACKEND_DEFAULT;
    id = checked([&](char* error, size_t size) {
      return runtime().record_event(resolved(stream.device()).index(), id, timing, error, size);
    });
    *event = reinterpret_cast<void*>(static_cast<intptr_t>(id));
  }
  // Work on tpu values waits for the work that produces them: a stream has nothing to wait for.
  void block(void* event, const c10::Stream& stream) const override {}
  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;  // never recorded
    }
    return checked([&](char* error, size_t size) { return runtime().query_event(event_id(event), error, size); }) == 1;
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) {
      checked([&](char* error, size_t size) { return runtime().synchronize_event(event_id(event), error, size); });
    }
  }
  void destroyEvent(void* event, const c10::DeviceIndex device_index) const noexcept override {
    const RuntimeCallbacks* callbacks = runtime_callbacks.load();
    if (event != nullptr && callbacks != nullptr) {
      callbacks->destroy_event(event_id(event));
    }
  }
  // `torch.accelerator.get_device_capability("tpu")`: the dtypes a tpu tensor may have
  // (torchtpu/dtypes.py's SUPPORTED; a test keeps the two lists alike).
  c10::DeviceCapability getDeviceCapability(c10::Device device) const override {
    c10::DeviceCapability capability;
    capability.capability_data.capability_bits = 0;
    auto& types = capability.capability_data.supported_scalar_types;
    types.has_Float = types.has_Double = types.has_Half = types.has_BFloat16 = 1;
    types.has_Char = types.has_Short = types.has_Int = types.has_Long = types.has_Byte = types.has_Bool = 1;
    types.has_ComplexFloat = types.has_ComplexDouble = 1;
    return capability;
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex device_index) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "both events must be recorded before elapsed_time");
    double milliseconds = 0;
    checked([&](char* error, size_t size) {
      return runtime().elapsed_time(event_id(start), event_id(end), &milliseconds, error, size);
    });
    return milliseconds;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuard);

std::atomic<bool> runtime_started{false};

// Host memory for staging device data ("pinned" memory, which PyTorch asks of the device for
// DDP's reducer and non_blocking copies to the host): host memory from the CPU allocator, marked
// as the device's so that `is_pinned()` answers for it as PyTorch's callers check. On the CPU
// stand-in there is nothing to page-lock; on a TPU, PJRT copies from any host buffer (page-locked
// memory would only be faster).
class StagingAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t nbytes) override {
    at::DataPtr inner = c10::GetCPUAllocator()->allocate(nbytes);
    void* data = inner.get();
    auto* owned = new at::DataPtr(std::move(inner));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.insert(data);
    }
    return {data, owned, &StagingAllocator::release, at::Device(at::DeviceType::CPU)};
  }
  at::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool owns(const void* data) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(data) > 0;
  }

 private:
  static void release(void* context) {
    auto* owned = static_cast<at::DataPtr*>(context);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.erase(owned->get());
    }
    delete owned;
  }
  static std::mutex mutex_;
  static std::unordered_set<const void*> live_;
};

std::mutex StagingAllocator::mutex_;
std::unordered_set<const void*> StagingAllocator::live_;
StagingAllocator staging_allocator;

// A tpu generator (`torch.Generator(device="tpu")`): a (seed, offset) pair, as each device's own
// generator is (torchtpu/random.py). A random op given it takes the key of its offset and moves
// the offset on by one (`random.next_key_words`); nothing here draws numbers.
class TpuGenerator final : public c10::GeneratorImpl {
 public:
  explicit TpuGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  uint64_t current_seed() const override {
    return seed_;
  }
  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }
  void set_offset(uint64_t offset) override {
    offset_ = offset;
  }
  uint64_t get_offset() const override {
    return offset_;
  }
  // The state is 16 bytes, the seed then the offset, as `torch.tpu.get_rng_state()`'s.
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.device().is_cpu() && state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && state.numel() == 16,
                "a tpu generator's state is a CPU uint8 tensor of 16 bytes (from its get_state())");
    const auto* bytes = static_cast<const char*>(state.data());
    std::memcpy(&seed_, bytes, sizeof seed_);
    std::memcpy(&offset_, bytes + sizeof seed_, sizeof offset_);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor state = at::empty({16}, at::kByte);
    std::memcpy(state.data_ptr(), &seed_, sizeof seed_);
    std::memcpy(static_cast<char*>(state.data_ptr()) + sizeof seed_, &offset_, sizeof offset_);
    return state.getIntrusivePtr();
  }
  static c10::DeviceType device_type() {
    return c10::DeviceType::PrivateUse1;
  }

 private:
  TpuGenerator* clone_impl() const override {
    auto* copy = new TpuGenerator(device().index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }
  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    return runtime_started.load();
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return &staging_allocator;
  }
  bool isPinnedPtr(const void* data) const override {
    return staging_allocator.owns(data);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return at::make_generator<TpuGenerator>(device_index < 0 ? current_index : device_index);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new TpuHooks());
  return true;
}();

// The PrivateUse1 allocator PyTorch asks for tpu storage (`torch.UntypedStorage(n,
// device="tpu")`) and for the device-generic memory API (`torch.accelerator.memory_allocated`,
// `empty_cache`, ...). A tpu storage holds no host data: its device data is a PJRT buffer that
// torchtpu attaches to the storage on first use (torchtpu/storage.py), so the storage's data
// pointer is null, and its bytes cannot be copied on the host. Device memory itself belongs to
// PJRT; the statistics are torchtpu's count of live storages' bytes (reserved = allocated: the
// memory torchtpu keeps beyond live storages is what `empty_cache` releases).
class TpuAllocator final : public c10::DeviceAllocator {
 public:
  at::DataPtr allocate(size_t nbytes) override {
    return {nullptr, at::Device(at::DeviceType::PrivateUse1, current_index)};
  }
  at::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(count == 0, "a tpu storage's bytes live in a device buffer, not in host memory: "
                "copy tpu tensors (or move them to the cpu) instead of copying their storage's bytes");
  }
  bool initialized() override {
    return runtime_callbacks.load() != nullptr;
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    checked([&](char* error, size_t size) { return runtime().empty_cache(error, size); });
  }
  void recordStream(const at::DataPtr& ptr, c10::Stream stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    int64_t allocated = 0;
    int64_t peak = 0;
    checked([&](char* error, size_t size) { return runtime().memory_stats(device, &allocated, &peak, error, size); });
    c10::CachingDeviceAllocator::DeviceStats stats;
    for (auto* bytes : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                        &stats.requested_bytes}) {
      auto& all = (*bytes)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      all.current = allocated;
      all.peak = peak;
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {}
  void resetPeakStats(c10::DeviceIndex device) override {
    checked([&](char* error, size_t size) { return runtime().reset_peak_memory_stats(device, error, size); });
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    int64_t free = 0;
    int64_t total = 0;
    checked([&](char* error, size_t size) { return runtime().memory_info(device, &free, &total, error, size); });
    return {static_cast<size_t>(free), static_cast<size_t>(total)};
  }
};

TpuAllocator tpu_allocator;

const bool allocator_registered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &tpu_allocator);
  return true;
}();

}  // namespace

extern "C" {

void torchtpu_set_device_count(int count) {
  device_count.store(static_cast<c10::DeviceIndex>(count));
}

void torchtpu_set_runtime_started() {
  runtime_started.store(true);
}

int torchtpu_current_device() {
  return current_index;
}

void torchtpu_set_current_device(int index) {
  current_index = static_cast<c10::DeviceIndex>(index);
}

void torchtpu_set_runtime_callbacks(const RuntimeCallbacks* callbacks) {
  runtime_callbacks.store(new RuntimeCallbacks(*callbacks));
}

}  // extern "C"
