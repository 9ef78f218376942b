// The tpu device guard (the current device of each thread, and the device count) and the
// PrivateUse1 hooks.
//
// PyTorch's Python PrivateUse1 device guard reports exactly one device and ignores set_device, so
// the autograd engine sizes its per-device ready queues for tpu:0 only and a backward pass on
// tpu:1 fails an internal assert. Its Python hooks cannot give a pinned-memory allocator, which
// PyTorch asks of the device for host staging buffers (DDP's reducer, non_blocking copies to the
// host). Guard and hooks are registered for PrivateUse1 before the Python ones (registration is
// first-wins). torchtpu/device_guard.py builds and loads it (the eager fast path's C++ is
// fast_dispatch.cpp, a library of its own).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace {

std::atomic<c10::DeviceIndex> device_count{1};
thread_local c10::DeviceIndex current_index = 0;

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

}  // extern "C"
