// NumPy .npy files: read and write the arrays moed's CLI and tests exchange with Python.
//
// Versions 1.0, 2.0 and 3.0 are read; C order only; little-endian dtypes <f4, <f8, <i4, <i8,
// <u2 (bf16 bit patterns), |u1 and |b1. Errors name the file and the offending value:
//   "x.npy: fortran_order is True; moed reads C-order arrays only".
// write_npy writes version 1.0 (2.0 when the header needs more than 65535 bytes), laid out as
// numpy.save lays it out.
//
//   MOED_ASSIGN_OR_RETURN(moed::NpyArray a, moed::read_npy("topk_idx.npy"));
//   MOED_ASSIGN_OR_RETURN(std::vector<int32_t> idx, moed::npy_to_i32(a));  // <i8 if it fits
//   MOED_RETURN_IF_ERROR(moed::write_npy("out.npy", moed::NpyDType::kF32, {rows, hidden}, y));
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moed/dtype.h"
#include "moed/status.h"

namespace moed {

enum class NpyDType : uint8_t { kF32, kF64, kI32, kI64, kBool, kU16, kU8 };

// "<f4", "<f8", "<i4", "<i8", "|b1", "<u2", "|u1".
const char* npy_descr(NpyDType t);
size_t npy_dtype_size(NpyDType t);

struct NpyArray {
  std::string name;  // the file it came from, for messages
  NpyDType dtype = NpyDType::kF32;
  std::vector<int64_t> shape;  // () for a 0-d array (one element)
  std::vector<uint8_t> data;   // C order, little-endian, num_elements() * npy_dtype_size(dtype)

  int64_t num_elements() const;
  // "(2, 3)", as NumPy prints shapes.
  std::string shape_string() const;
};

StatusOr<NpyArray> read_npy(const std::string& path);
// The same parser on bytes already in memory; `name` stands in for the path in messages.
StatusOr<NpyArray> parse_npy(std::span<const uint8_t> bytes, const std::string& name);

// `data` holds product(shape) elements of `dtype` in C order.
Status write_npy(const std::string& path, NpyDType dtype, std::span<const int64_t> shape,
                 const void* data);
Status write_npy(const std::string& path, NpyDType dtype, std::initializer_list<int64_t> shape,
                 const void* data);
// The bytes write_npy would write.
StatusOr<std::vector<uint8_t>> encode_npy(NpyDType dtype, std::span<const int64_t> shape,
                                          const void* data);

// Element conversions; each names the file, the index and the value when one does not fit.
// float32: from <f4, or <f8 when every value is exactly a float32 (NaN and inf included).
StatusOr<std::vector<float>> npy_to_f32(const NpyArray& a);
// float64: from <f8 or <f4.
StatusOr<std::vector<double>> npy_to_f64(const NpyArray& a);
// int32: from <i4, |u1, <u2, |b1, or <i8 when every value fits.
StatusOr<std::vector<int32_t>> npy_to_i32(const NpyArray& a);
// int64: from <i8, <i4, |u1, <u2 or |b1.
StatusOr<std::vector<int64_t>> npy_to_i64(const NpyArray& a);
// uint8 (routing maps): from |u1, |b1, or <i4 / <i8 when every value is in [0, 255].
StatusOr<std::vector<uint8_t>> npy_to_u8(const NpyArray& a);
// bf16 bit patterns: from <u2 only.
StatusOr<std::vector<bf16>> npy_to_bf16(const NpyArray& a);

}  // namespace moed
