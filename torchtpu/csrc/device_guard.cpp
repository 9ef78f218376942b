// The tpu device guard: the current device of each thread, and the device count.
//
// PyTorch's Python PrivateUse1 device guard reports exactly one device and ignores set_device, so
// the autograd engine sizes its per-device ready queues for tpu:0 only and a backward pass on
// tpu:1 fails an internal assert. This guard is registered for PrivateUse1 before the Python one
// (registration is first-wins) and is the only C++ in torchtpu; torchtpu/device_guard.py builds
// and loads it.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>

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

}  // namespace

extern "C" {

void torchtpu_set_device_count(int count) {
  device_count.store(static_cast<c10::DeviceIndex>(count));
}

int torchtpu_current_device() {
  return current_index;
}

void torchtpu_set_current_device(int index) {
  current_index = static_cast<c10::DeviceIndex>(index);
}

}  // extern "C"
