// Zero-copy torch <-> moed interop for the extension module, without any torch C++ ABI: a
// tensor argument is read through its Python attributes (data_ptr(), dtype, device, shape,
// stride()), and moed-owned memory goes back to torch as a DLPack capsule whose deleter drops
// the owner (torch._C._from_dlpack), so any torch with DLPack (1.13 and newer) works.
//
//   moed::TensorView x = moed::python::rows_arg(hidden, "hidden_states", kFloatRows);
//   py::object y = moed::python::to_torch(std::move(tensor));             // owns the Tensor
//   py::object e = moed::python::to_torch(out.expert_input.x, out.storage);  // keeps storage
//
// Every function here needs the GIL; none of them copies tensor data. Errors raise
// TypeError (not a tensor, wrong dtype or device) or ValueError (shape, stride), naming the
// argument and the value. Status -> exception: check(status) raises ValueError for
// kInvalidArgument, moed.AbortedError (a RuntimeError) for kAborted, RuntimeError otherwise.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moed/routing.h"
#include "moed/status.h"
#include "moed/tensor.h"

namespace moed::python {

namespace py = pybind11;

// ---- errors ----

// moed.AbortedError: a peer rank failed (kAborted); created by bind_core.
py::object& aborted_error_type();
// Raises the exception for a non-OK status (ValueError / AbortedError / RuntimeError).
[[noreturn]] void raise_status(const Status& s);
inline void check(const Status& s) {
  if (!s.ok()) raise_status(s);
}
template <typename T>
T check(StatusOr<T>&& s) {
  if (!s.ok()) raise_status(s.status());
  return std::move(s).value();
}

// ---- element types as torch spells them ----

// The torch dtypes moed reads and writes. fp8 is torch.float8_e4m3fn where torch has it, else
// torch.uint8 holding E4M3FN bits (torch 1.13).
enum class ElemType : uint8_t { kF32, kBF16, kFP8, kU8, kBool, kI32, kI64, kOther };
const char* elem_type_name(ElemType t);  // "torch.float32", ...
// Identity comparison with torch's dtype objects (imported once).
ElemType elem_type_of(py::handle dtype);
// The torch dtype object for a moed payload dtype.
py::object torch_dtype(DType t);

// A tensor argument after its attributes were read: rank <= 4.
struct TensorInfo {
  void* data = nullptr;
  ElemType type = ElemType::kOther;
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};  // in elements
  int64_t numel() const;
  bool contiguous() const;
};

// Reads a CPU torch.Tensor (TypeError otherwise: not a tensor, device not cpu, ndim > 4).
TensorInfo tensor_info(py::handle t, const char* name);

// A 2-D tensor of one of `allowed` payload dtypes as a row view: stride(1) == 1, stride(0) >=
// cols (rows may be strided; ValueError otherwise). rows / cols >= 0 are checked when given.
// A 1-D tensor is not accepted (ValueError naming the shape).
TensorView rows_arg(py::handle t, const char* name, std::initializer_list<DType> allowed,
                    int64_t rows = -1, int64_t cols = -1);
// The row formats the dispatchers take: any payload, and rows they sum (float formats).
inline constexpr std::initializer_list<DType> kPayload = {DType::kF32, DType::kBF16, DType::kFP8};
inline constexpr std::initializer_list<DType> kFloatRows = {DType::kF32, DType::kBF16};
// Token rows: x (f32, bf16, or fp8 when `scales` is a float32 [rows, cols / 128] tensor, in
// either major order: column-major scales are copied row-major into keep_scales, which must
// live as long as the view).
TokenRows token_rows_arg(py::handle x, py::handle scales, const char* name,
                         std::initializer_list<DType> allowed, py::object& keep_scales);

// A contiguous tensor of exactly `type` and `shape` (-1 = any extent), as a flat span.
template <typename T>
std::span<const T> span_arg(py::handle t, const char* name, ElemType type,
                            std::initializer_list<int64_t> shape);

// ---- routing arguments (read in place; a map is converted once, to the sparse form) ----

// Megatron's map form: routing_map bool (or uint8 0/1) [T, E], probs float32 [T, E], both
// contiguous. num_topk: K of the router (the capacity formula needs it); 0 = max experts per
// token. map_view_arg views them (num_topk as given); sparse_routing_arg converts them to the
// sparse form in one scan (what a dispatch works on); routing_map_arg copies them (the
// reference's and the C++ benchmark loop's input).
MapView map_view_arg(py::handle routing_map, py::handle probs, int num_topk);
SparseRouting sparse_routing_arg(py::handle routing_map, py::handle probs, int num_topk);
RoutingMap routing_map_arg(py::handle routing_map, py::handle probs, int num_topk);
// Top-k form, borrowed (the one top-k parser of the bindings): topk_idx [T, K] (-1 = none) and
// topk_weights [T, K] (or None: no weights) read in place when they are contiguous int32 /
// int64 and float32; a strided tensor or another integer (float) dtype is first copied by
// torch into a contiguous int64 (float32) one. keep_* hold what the view points into: keep
// them until the call that reads it has completed.
TopkView topk_view_arg(py::handle topk_idx, py::handle topk_weights, py::object& keep_idx,
                       py::object& keep_weights);
// Layout options as the Python layer passes them; capacity_factor None = dropless.
LayoutOptions layout_arg(py::handle capacity_factor, const std::string& drop_policy,
                         bool pad_to_capacity, int expert_alignment, int router_padding_multiple);
// The fields a DispatchConfig and a ReferenceProblem share, from the Python arguments.
template <typename Config>
void set_dispatch_fields(Config& c, int num_experts, int ep_size, int etp_size,
                         py::handle capacity_factor, const std::string& drop_policy,
                         bool pad_to_capacity, int expert_alignment, int router_padding_multiple,
                         bool weighted_combine) {
  c.num_experts = num_experts;
  c.ep_size = ep_size;
  c.etp_size = etp_size;
  c.layout = layout_arg(capacity_factor, drop_policy, pad_to_capacity, expert_alignment,
                        router_padding_multiple);
  c.weighted_combine = weighted_combine;
}

// ---- moed memory to torch, no copy ----

// DLPack capsule over `v` (packed or row-strided), keeping `owner` alive until torch frees
// the tensor. The result is a torch.Tensor of v.dtype (fp8 as above). NOTE: torch may free a
// tensor on a thread that does not hold the GIL (inside an op), so `owner` must hold no Python
// object, directly or through what it keeps alive.
py::object to_torch(const TensorView& v, std::shared_ptr<void> owner);
py::object to_torch(Tensor&& t);
py::object to_torch(TokenTensor&& t);  // x only; see token_to_torch for (x, scales)
// A 1-D or 2-D torch tensor over a moved-in vector (float, int32, int64, uint8).
template <typename T>
py::object vector_to_torch(std::vector<T>&& v, std::initializer_list<int64_t> shape);
// A torch tensor viewing rows x cols (cols < 0: a 1-D [rows]) of float, int32 or int64 at
// data, packed, without a copy; `owner` stays alive while torch holds it.
template <typename T>
py::object array_to_torch(const T* data, int64_t rows, int64_t cols, std::shared_ptr<void> owner);
// A copy of a span as a 1-D torch tensor (for views into handles that callers may keep).
template <typename T>
py::object span_to_torch(std::span<const T> s);

}  // namespace moed::python
