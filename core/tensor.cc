// core: Tensor storage, views and conversions.
#include "core/tensor.h"

#include <cstring>
#include <sstream>

namespace infinigen {

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

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int64_t extent : shape)
    INFINIGEN_CHECK(extent >= 0, "negative extent in shape ", shape_string(shape));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  const size_t bytes = t.nbytes();
  void* data = device_alloc(device, bytes == 0 ? 1 : bytes);
  t.storage_ = std::shared_ptr<void>(data, [device](void* p) { device_free(device, p); });
  t.data_ = data;
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
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

Tensor Tensor::from_floats(Shape shape, const std::vector<float>& values) {
  INFINIGEN_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), "from_floats: shape ",
                  shape_string(shape), " does not hold ", values.size(), " values");
  Tensor t = empty(std::move(shape), DType::F32);
  std::memcpy(t.data_, values.data(), values.size() * sizeof(float));
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
  device_copy(t.data_, device, data_, device_, nbytes());
  return t;
}

Tensor Tensor::to_dtype(DType dtype) const {
  INFINIGEN_CHECK(device_ == Device::Cpu, "to_dtype needs a CPU tensor");
  if (dtype == dtype_) return clone();
  Tensor t = empty(shape_, dtype, Device::Cpu);
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
  INFINIGEN_CHECK(requested == dtype_, "tensor of ", dtype_name(dtype_), " ", shape_string(shape_),
                  " accessed as ", dtype_name(requested));
}

}  // namespace infinigen
