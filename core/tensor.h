// core: Tensor, a typed, shaped view of memory on one device (row-major, contiguous).
//
// A Tensor shares its storage: copies are cheap handles, `clone()` copies the bytes. Memory is
// owned either by the tensor (allocated on its device) or by something else that outlives the
// view (a memory-mapped checkpoint), kept alive through `owner`. In a dry run (core/trace.h) a
// tensor has a shape and no memory: raw() is an address that faults when touched, data<T>() an
// Error, and conversions and fills do nothing.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace infinigen {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& shape);

class Tensor;
// Fills a floating-point tensor with NaN (quiet NaN bit patterns of its dtype), on any device.
void fill_nan(Tensor& tensor);
std::string shape_string(const Shape& shape);  // "(2, 3, 4)"

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised memory on `device` (NaN-filled when debug_poison() is on).
  static Tensor empty(Shape shape, DType dtype, Device device = Device::Cpu);
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::Cpu);
  // A view of memory someone else owns; `owner` keeps it alive for the tensor's lifetime.
  static Tensor view(void* data, Shape shape, DType dtype, Device device,
                     std::shared_ptr<void> owner);
  // Pinned host memory (pinned_alloc: mapped, so a kernel may read or write it over the link),
  // uninitialised, for `purpose` (named when it cannot be pinned); `device` is the device whose
  // ops take it (Device::Cuda for what kernels read in place).
  static Tensor pinned(Shape shape, DType dtype, std::string_view purpose,
                       Device device = Device::Cpu);
  // fp32 CPU tensor holding a copy of `values`.
  static Tensor from_floats(Shape shape, const std::vector<float>& values);

  bool defined() const { return data_ != nullptr; }
  bool dry() const { return dry_; }  // made in a dry run: no memory behind it
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int axis) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() { return data_; }
  const void* raw() const { return data_; }
  template <typename T>
  T* data() {
    check_type(dtype_of<T>());
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* data() const {
    check_type(dtype_of<T>());
    return static_cast<const T*>(data_);
  }

  // Same bytes, another shape with the same number of elements.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along the first axis, sharing storage.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // A deep copy on `device`.
  Tensor to(Device device) const;
  Tensor clone() const { return to(device_); }
  // A CPU copy converted to `dtype` (floating-point types only).
  Tensor to_dtype(DType dtype) const;
  // Element i as fp32 (CPU, floating-point); for tests and diagnostics, not hot loops.
  float item_as_float(int64_t index) const;
  std::vector<float> to_floats() const;

 private:
  void check_type(DType requested) const;

  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::Cpu;
  bool dry_ = false;
};

}  // namespace infinigen
