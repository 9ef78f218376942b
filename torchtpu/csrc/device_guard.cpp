// The tpu device guard (the current device of each thread, and the device count), the
// PrivateUse1 hooks, and the PrivateUse1 allocator (see TpuAllocator).
//
// PyTorch's Python PrivateUse1 device guard reports exactly one device and ignores set_device, so
// the autograd engine sizes its per-device ready queues for tpu:0 only and a backward pass on
// tpu:1 fails an internal assert. Its Python hooks cannot give a pinned-memory allocator, which
// PyTorch asks of the device for host staging buffers (DDP's reducer, non_blocking copies to the
// host). Nor does it give an allocator: `torch.UntypedStorage(n, device="tpu")` crashed on a null
// one, and `torch.accelerator`'s memory functions failed an internal assert. Guard and hooks are
// registered for PrivateUse1 before the Python ones (registration is first-wins). torchtpu/device_guard.py builds and loads it (the eager fast path's C++ is
// fast_dispatch.cpp, a library of its own).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace {

std::atomic<c10::DeviceIndex> device_count{1};
thread_local c10::DeviceIndex current_index = 0;

// `torch.tpu.synchronize(device)`, passed in from Python (a ctypes function, which takes the GIL):
// 0 when it returned, else its error's message written into `error` (of `size` bytes).
using SynchronizeFn = int (*)(int device, char* error, size_t size);
std::atomic<SynchronizeFn> synchronize_device{nullptr};

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
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, stream.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count.load();
  }
  // `torch.accelerator.synchronize()`: everything issued to the device has finished.
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    SynchronizeFn synchronize = synchronize_device.load();
    TORCH_CHECK(synchronize != nullptr, "the tpu runtime has not registered its synchronize yet (import torchtpu)");
    char error[1024] = {0};
    TORCH_CHECK(synchronize(device_index < 0 ? current_index : device_index, error, sizeof(error)) == 0, error);
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
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new TpuHooks());
  return true;
}();

// What torchtpu.device reports of device memory, passed in as callbacks (ctypes functions, which
// take the GIL): the bytes of live tpu storages are counted in Python (torchtpu.storage).
using MemoryStatsFn = void (*)(int device, int64_t* allocated, int64_t* peak);
using DeviceFn = void (*)(int device);
using EmptyCacheFn = void (*)();
using MemoryInfoFn = void (*)(int device, int64_t* free, int64_t* total);

struct MemoryCallbacks {
  MemoryStatsFn stats = nullptr;
  DeviceFn reset_peak = nullptr;
  EmptyCacheFn empty_cache = nullptr;
  MemoryInfoFn memory_info = nullptr;
};

std::atomic<const MemoryCallbacks*> memory_callbacks{nullptr};

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
    return memory_callbacks.load() != nullptr;
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    if (const MemoryCallbacks* callbacks = memory_callbacks.load()) {
      callbacks->empty_cache();
    }
  }
  void recordStream(const at::DataPtr& ptr, c10::Stream stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    const MemoryCallbacks* callbacks = memory_callbacks.load();
    if (callbacks == nullptr) {
      return stats;
    }
    int64_t allocated = -1;  // left so if the callback raised (ctypes prints its error)
    int64_t peak = -1;
    callbacks->stats(device, &allocated, &peak);
    TORCH_CHECK(allocated >= 0 && peak >= 0, "torchtpu could not count tpu:", static_cast<int>(device),
                "'s memory (its Python error is printed above)");
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
    if (const MemoryCallbacks* callbacks = memory_callbacks.load()) {
      callbacks->reset_peak(device);
    }
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    const MemoryCallbacks* callbacks = memory_callbacks.load();
    TORCH_CHECK(callbacks != nullptr, "the tpu runtime has not registered its memory figures yet (import torchtpu)");
    int64_t free = -1;
    int64_t total = -1;
    callbacks->memory_info(device, &free, &total);
    TORCH_CHECK(free >= 0 && total >= 0, "torchtpu could not read tpu:", static_cast<int>(device),
                "'s free and total memory (its Python error is printed above)");
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

void torchtpu_set_synchronize(SynchronizeFn synchronize) {
  synchronize_device.store(synchronize);
}

void torchtpu_set_memory_callbacks(MemoryStatsFn stats, DeviceFn reset_peak, EmptyCacheFn empty_cache,
                                   MemoryInfoFn memory_info) {
  memory_callbacks.store(new MemoryCallbacks{stats, reset_peak, empty_cache, memory_info});
}

}  // extern "C"
