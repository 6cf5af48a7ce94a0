// core: Tensor storage, views and conversions.
#include "core/tensor.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/trace.h"

namespace infinigen {
namespace {

bool is_floating(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}

// Fills `count` elements of `T` at `data` on `device` with `pattern`.
template <typename T>
void fill_pattern(void* data, Device device, size_t count, T pattern) {
  if (device == Device::Cpu) {
    std::fill_n(static_cast<T*>(data), count, pattern);
    return;
  }
  // No fill kernel exists; a host copy of the pattern costs one transfer, fine for a debug mode.
  std::vector<T> host(count, pattern);
  device_copy(data, device, host.data(), Device::Cpu, count * sizeof(T));
}

}  // namespace

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

std::string shape_string(const Shape& shape) {
  std::ostringstream out;
  out << '(';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ')';
  return out.str();
}

void fill_nan(Tensor& tensor) {
  if (tensor.dry()) return;
  const size_t n = static_cast<size_t>(tensor.numel());
  switch (tensor.dtype()) {
    case DType::F32:
      fill_pattern<uint32_t>(tensor.raw(), tensor.device(), n, 0x7fc00000u);
      return;
    case DType::F16:
      fill_pattern<uint16_t>(tensor.raw(), tensor.device(), n, 0x7e00u);
      return;
    case DType::BF16:
      fill_pattern<uint16_t>(tensor.raw(), tensor.device(), n, 0x7fc0u);
      return;
    case DType::I32:
    case DType::I64:
      break;
  }
  fail("fill_nan: tensor of ", dtype_name(tensor.dtype()), " ", shape_string(tensor.shape()),
       " is not floating-point");
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int64_t extent : shape)
    INFINIGEN_CHECK(extent >= 0, "negative extent in shape ", shape_string(shape));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  if (dry_run()) {
    t.data_ = dry_address();
    t.dry_ = true;
    return t;
  }
  const size_t bytes = t.nbytes();
  void* data = device_alloc(device, bytes == 0 ? 1 : bytes);
  t.storage_ = std::shared_ptr<void>(data, [device](void* p) { device_free(device, p); });
  t.data_ = data;
  if (debug_poison() && is_floating(dtype)) fill_nan(t);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  if (t.dry_) return t;
  if (device == Device::Cpu) {
    std::memset(t.data_, 0, t.nbytes());
  } else {
    std::vector<char> zero(t.nbytes(), 0);
    device_copy(t.data_, device, zero.data(), Device::Cpu, zero.size());
  }
  return t;
}

Tensor Tensor::view(void* data, Shape shape, DType dtype, Device device,
                    std::shared_ptr<void> owner) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.data_ = data;
  t.storage_ = std::move(owner);
  return t;
}

Tensor Tensor::pinned(Shape shape, DType dtype, std::string_view purpose, Device device) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  void* data = pinned_alloc(bytes, purpose);
  return view(data, std::move(shape), dtype, device,
              std::shared_ptr<void>(data, [](void* p) { pinned_free(p); }));
}

Tensor Tensor::from_floats(Shape shape, const std::vector<float>& values) {
  INFINIGEN_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), "from_floats: shape ",
                  shape_string(shape), " does not hold ", values.size(), " values");
  Tensor t = empty(std::move(shape), DType::F32);
  if (!t.dry_) std::memcpy(t.data_, values.data(), values.size() * sizeof(float));
  return t;
}

int64_t Tensor::dim(int axis) const {
  const int r = rank();
  if (axis < 0) axis += r;
  INFINIGEN_CHECK(axis >= 0 && axis < r, "axis ", axis, " out of range for shape ",
                  shape_string(shape_));
  return shape_[axis];
}

Tensor Tensor::reshape(Shape shape) const {
  INFINIGEN_CHECK(shape_numel(shape) == numel(), "cannot reshape ", shape_string(shape_), " to ",
                  shape_string(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  INFINIGEN_CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "rows [", begin,
                  ", ", end, ") out of range for shape ", shape_string(shape_));
  Tensor t = *this;
  const size_t row_bytes = shape_[0] == 0 ? 0 : nbytes() / static_cast<size_t>(shape_[0]);
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin) * row_bytes;
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  if (dry_ || t.dry_) return t;
  device_copy(t.data_, device, data_, device_, nbytes());
  return t;
}

Tensor Tensor::to_dtype(DType dtype) const {
  INFINIGEN_CHECK(device_ == Device::Cpu, "to_dtype needs a CPU tensor");
  if (dtype == dtype_) return clone();
  Tensor t = empty(shape_, dtype, Device::Cpu);
  if (dry_ || t.dry_) return t;
  const size_t n = static_cast<size_t>(numel());
  if (dtype == DType::F32) {
    convert_to_f32(data_, dtype_, t.data<float>(), n);
  } else if (dtype_ == DType::F32) {
    convert_from_f32(static_cast<const float*>(data_), t.data_, dtype, n);
  } else {
    std::vector<float> staging(n);
    convert_to_f32(data_, dtype_, staging.data(), n);
    convert_from_f32(staging.data(), t.data_, dtype, n);
  }
  return t;
}

float Tensor::item_as_float(int64_t index) const {
  INFINIGEN_CHECK(device_ == Device::Cpu && index >= 0 && index < numel(), "item_as_float: index ",
                  index, " out of range or tensor not on the CPU");
  float value = 0.0f;
  convert_to_f32(static_cast<const char*>(data_) + index * dtype_size(dtype_), dtype_, &value, 1);
  return value;
}

std::vector<float> Tensor::to_floats() const {
  Tensor host = device_ == Device::Cpu ? *this : to(Device::Cpu);
  std::vector<float> out(static_cast<size_t>(numel()));
  convert_to_f32(host.data_, dtype_, out.data(), out.size());
  return out;
}

void Tensor::check_type(DType requested) const {
  INFINIGEN_CHECK(!dry_, "a dry run read the data of a tensor ", shape_string(shape_),
                  " (nothing may compute in a dry run)");
  INFINIGEN_CHECK(requested == dtype_, "tensor of ", dtype_name(dtype_), " ", shape_string(shape_),
                  " accessed as ", dtype_name(requested));
}

}  // namespace infinigen
