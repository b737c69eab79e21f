// torch <-> moed interop (interop.h): attribute reads in, DLPack capsules out.
#include "python/interop.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "core/enum_names.h"

namespace moed::python {
namespace {

// DLPack's C ABI (dlpack.h v0.6+, what torch 1.13 speaks): only the structs the capsule needs.
enum DLDeviceType : int32_t { kDLCPU = 1 };
struct DLDevice {
  DLDeviceType device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// What a capsule owns: the shape and strides DLPack points at, and the memory's owner.
struct Holder {
  DLManagedTensor managed;
  int64_t shape[2];
  int64_t strides[2];
  std::shared_ptr<void> owner;
};
void holder_deleter(DLManagedTensor* self) { delete static_cast<Holder*>(self->manager_ctx); }
void capsule_destructor(PyObject* capsule) {
  // A capsule torch consumed is renamed "used_dltensor" and torch calls the deleter itself.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    m->deleter(m);
  }
}

// Torch's objects, looked up once (leaked on purpose: they must outlive interpreter teardown).
struct TorchRefs {
  PyObject* tensor_type;
  PyObject* dtypes[7];  // ElemType order up to kI64; fp8 = float8_e4m3fn or nullptr
  PyObject* uint8;
  PyObject* from_dlpack;
  PyObject* empty;
};
TorchRefs* refs() {
  static TorchRefs* r = [] {
    py::module_ torch = py::module_::import("torch");
    auto* t = new TorchRefs{};
    auto get = [&](const char* name) -> PyObject* {
      if (!py::hasattr(torch, name)) return nullptr;
      return py::object(torch.attr(name)).release().ptr();
    };
    t->tensor_type = get("Tensor");
    t->dtypes[int(ElemType::kF32)] = get("float32");
    t->dtypes[int(ElemType::kBF16)] = get("bfloat16");
    t->dtypes[int(ElemType::kFP8)] = get("float8_e4m3fn");
    t->dtypes[int(ElemType::kU8)] = get("uint8");
    t->dtypes[int(ElemType::kBool)] = get("bool");
    t->dtypes[int(ElemType::kI32)] = get("int32");
    t->dtypes[int(ElemType::kI64)] = get("int64");
    t->uint8 = t->dtypes[int(ElemType::kU8)];
    py::module_ c = torch.attr("_C");
    t->from_dlpack = py::hasattr(c, "_from_dlpack")
                         ? py::object(c.attr("_from_dlpack")).release().ptr()
                         : py::object(py::module_::import("torch.utils.dlpack").attr("from_dlpack"))
                               .release()
                               .ptr();
    t->empty = get("empty");
    return t;
  }();
  return r;
}

std::string shape_str(const TensorInfo& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}
std::string stride_str(const TensorInfo& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.stride[i]);
  return s + ")";
}

ElemType elem_of(DType t) {
  return t == DType::kF32 ? ElemType::kF32 : t == DType::kBF16 ? ElemType::kBF16 : ElemType::kFP8;
}
// The moed payload dtype a torch element type carries, if any (uint8 reads as E4M3FN bits on
// every torch: torch 1.13's only form, and still accepted where float8_e4m3fn exists).
bool payload_of(ElemType e, DType* out) {
  if (e == ElemType::kF32)
    *out = DType::kF32;
  else if (e == ElemType::kBF16)
    *out = DType::kBF16;
  else if (e == ElemType::kFP8 || e == ElemType::kU8)
    *out = DType::kFP8;
  else
    return false;
  return true;
}
std::string allowed_str(std::initializer_list<DType> allowed) {
  std::string s;
  for (DType d : allowed) {
    if (!s.empty()) s += ", ";
    if (d != DType::kFP8)
      s += elem_type_name(elem_of(d));
    else
      s += refs()->dtypes[int(ElemType::kFP8)] ? "torch.float8_e4m3fn (or torch.uint8 bits)"
                                               : "torch.uint8 (fp8 bits)";
  }
  return s;
}

}  // namespace

constexpr EnumName<ElemType> kElemTypeNames[] = {
    {ElemType::kF32, "torch.float32"},       {ElemType::kBF16, "torch.bfloat16"},
    {ElemType::kFP8, "torch.float8_e4m3fn"}, {ElemType::kU8, "torch.uint8"},
    {ElemType::kBool, "torch.bool"},         {ElemType::kI32, "torch.int32"},
    {ElemType::kI64, "torch.int64"}};

const char* elem_type_name(ElemType t) { return enum_name(kElemTypeNames, t, "another dtype"); }

ElemType elem_type_of(py::handle dtype) {
  TorchRefs* r = refs();
  for (int i = 0; i < 7; ++i)
    if (r->dtypes[i] && dtype.ptr() == r->dtypes[i]) return ElemType(i);
  return ElemType::kOther;
}

py::object torch_dtype(DType t) {
  TorchRefs* r = refs();
  PyObject* d = r->dtypes[int(elem_of(t))];
  if (!d) d = r->uint8;
  return py::reinterpret_borrow<py::object>(d);
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}
bool TensorInfo::contiguous() const {
  int64_t expect = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

TensorInfo tensor_info(py::handle t, const char* name) {
  TorchRefs* r = refs();
  int is = PyObject_IsInstance(t.ptr(), r->tensor_type);
  if (is < 0) throw py::error_already_set();
  if (!is) {
    throw py::type_error(
        fmt::format("{} must be a torch.Tensor, got {}", name,
                    py::str(py::type::handle_of(t).attr("__name__")).cast<std::string>()));
  }
  // Raw C-API reads with interned names: torch's device.type builds a string stream per call,
  // so the CPU check reads is_cpu and names the device only on error.
  static PyObject* s_is_cpu = PyUnicode_InternFromString("is_cpu");
  static PyObject* s_dtype = PyUnicode_InternFromString("dtype");
  static PyObject* s_shape = PyUnicode_InternFromString("shape");
  static PyObject* s_stride = PyUnicode_InternFromString("stride");
  static PyObject* s_data_ptr = PyUnicode_InternFromString("data_ptr");
  TensorInfo info;
  py::object is_cpu = py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), s_is_cpu));
  if (!is_cpu) throw py::error_already_set();
  if (is_cpu.ptr() != Py_True) {
    throw py::type_error(fmt::format("{} must be a CPU tensor, got device {}", name,
                                     py::str(t.attr("device")).cast<std::string>()));
  }
  py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), s_dtype));
  if (!dtype) throw py::error_already_set();
  info.type = elem_type_of(dtype);
  py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(t.ptr(), s_shape));
  if (!shape) throw py::error_already_set();
  const Py_ssize_t nd = PyTuple_Size(shape.ptr());
  if (nd < 0) throw py::error_already_set();
  if (nd > 4) {
    throw py::value_error(fmt::format("{} has {} dimensions; at most 4 are supported", name, nd));
  }
  py::object stride =
      py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t.ptr(), s_stride));
  if (!stride || !PyTuple_Check(stride.ptr())) throw py::error_already_set();
  info.ndim = int(nd);
  for (int i = 0; i < info.ndim; ++i) {
    info.shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    info.stride[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride.ptr(), i));
  }
  py::object ptr =
      py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(t.ptr(), s_data_ptr));
  if (!ptr) throw py::error_already_set();
  info.data = reinterpret_cast<void*>(uintptr_t(PyLong_AsUnsignedLongLong(ptr.ptr())));
  if (PyErr_Occurred()) throw py::error_already_set();
  return info;
}

TensorView rows_arg(py::handle t, const char* name, std::initializer_list<DType> allowed,
                    int64_t rows, int64_t cols) {
  TensorInfo info = tensor_info(t, name);
  DType d{};
  bool ok = payload_of(info.type, &d);
  if (ok) {
    ok = false;
    for (DType a : allowed) ok |= a == d;
  }
  if (!ok) {
    throw py::type_error(fmt::format("{} has dtype {}; expected {}", name,
                                     py::str(t.attr("dtype")).cast<std::string>(),
                                     allowed_str(allowed)));
  }
  if (info.ndim != 2) {
    throw py::value_error(
        fmt::format("{} must be 2-D [rows, hidden], got shape {}", name, shape_str(info)));
  }
  if ((rows >= 0 && info.shape[0] != rows) || (cols >= 0 && info.shape[1] != cols)) {
    throw py::value_error(fmt::format("{} has shape {}; expected [{}, {}]", name, shape_str(info),
                                      rows >= 0 ? std::to_string(rows) : "*",
                                      cols >= 0 ? std::to_string(cols) : "*"));
  }
  // An empty tensor's strides mean nothing (torch calls an expanded [0, H] contiguous).
  const bool empty = info.shape[0] == 0 || info.shape[1] == 0;
  int64_t row_stride = info.shape[0] <= 1 || empty ? info.shape[1] : info.stride[0];
  if (!empty && ((info.shape[1] > 1 && info.stride[1] != 1) || row_stride < info.shape[1])) {
    throw py::value_error(fmt::format(
        "{} has strides {} for shape {}; rows must be dense (stride(1) == 1, stride(0) >= {})",
        name, stride_str(info), shape_str(info), info.shape[1]));
  }
  return TensorView(info.data, d, info.shape[0], info.shape[1], row_stride);
}

TokenRows token_rows_arg(py::handle x, py::handle scales, const char* name,
                         std::initializer_list<DType> allowed, py::object& keep_scales) {
  TokenRows out;
  out.x = rows_arg(x, name, allowed);
  if (out.x.dtype == DType::kFP8) {
    if (scales.is_none()) {
      throw py::value_error(fmt::format("{} is fp8 and needs its scales (float32 [{}, {}])", name,
                                        out.x.rows, out.x.cols / kFp8BlockSize));
    }
    std::string sname = std::string(name) + " scales";
    keep_scales = py::reinterpret_borrow<py::object>(scales);
    TensorInfo info = tensor_info(scales, sname.c_str());
    // DeepEP takes the scales in either major order (scale_token_stride, scale_hidden_stride;
    // its tests pass them column-major): other strides are made row-major once, a
    // [T, H / 128] copy beside the rows, which still move once.
    if (info.ndim == 2 && info.shape[0] > 1 && info.shape[1] > 1 && info.stride[1] != 1)
      keep_scales = py::reinterpret_borrow<py::object>(scales).attr("contiguous")();
    out.scales = rows_arg(keep_scales, sname.c_str(), {DType::kF32}, out.x.rows,
                          out.x.cols / kFp8BlockSize);
  } else if (!scales.is_none()) {
    throw py::value_error(fmt::format("{} is not fp8, so it takes no scales", name));
  }
  return out;
}

template <typename T>
std::span<const T> span_arg(py::handle t, const char* name, ElemType type,
                            std::initializer_list<int64_t> shape) {
  TensorInfo info = tensor_info(t, name);
  if (info.type != type) {
    throw py::type_error(fmt::format("{} has dtype {}; expected {}", name,
                                     py::str(t.attr("dtype")).cast<std::string>(),
                                     elem_type_name(type)));
  }
  bool match = info.ndim == int(shape.size());
  int i = 0;
  for (int64_t s : shape) match = match && (s < 0 || info.shape[i++] == s);
  if (!match) {
    std::string want = "[";
    i = 0;
    for (int64_t s : shape)
      want += (i++ ? ", " : "") + (s < 0 ? std::string("*") : std::to_string(s));
    throw py::value_error(
        fmt::format("{} has shape {}; expected {}]", name, shape_str(info), want));
  }
  if (!info.contiguous()) {
    throw py::value_error(fmt::format("{} must be contiguous, got strides {} for shape {}", name,
                                      stride_str(info), shape_str(info)));
  }
  return std::span<const T>(static_cast<const T*>(info.data), size_t(info.numel()));
}
template std::span<const float> span_arg<float>(py::handle, const char*, ElemType,
                                                std::initializer_list<int64_t>);
template std::span<const int32_t> span_arg<int32_t>(py::handle, const char*, ElemType,
                                                    std::initializer_list<int64_t>);
template std::span<const int64_t> span_arg<int64_t>(py::handle, const char*, ElemType,
                                                    std::initializer_list<int64_t>);
template std::span<const uint8_t> span_arg<uint8_t>(py::handle, const char*, ElemType,
                                                    std::initializer_list<int64_t>);

MapView map_view_arg(py::handle routing_map, py::handle probs, int num_topk) {
  TensorInfo mi = tensor_info(routing_map, "routing_map");
  ElemType mt = mi.type == ElemType::kU8 ? ElemType::kU8 : ElemType::kBool;
  if (mi.ndim != 2) {
    throw py::value_error(
        fmt::format("routing_map must be 2-D [tokens, experts], got shape {}", shape_str(mi)));
  }
  std::span<const uint8_t> m = span_arg<uint8_t>(routing_map, "routing_map", mt, {-1, -1});
  std::span<const float> p =
      span_arg<float>(probs, "probs", ElemType::kF32, {mi.shape[0], mi.shape[1]});
  return {m.data(), p.data(), mi.shape[0], int(mi.shape[1]), num_topk};
}

namespace {

// num_topk <= 0: K = the most experts any token of `s` routes to.
void default_topk(SparseRouting& s) {
  if (s.num_topk > 0) return;
  int64_t k = 0;
  for (int64_t t = 0; t < s.num_tokens(); ++t) {
    k = std::max(k, s.begin[size_t(t) + 1] - s.begin[size_t(t)]);
  }
  s.num_topk = int(k);
}

}  // namespace

RoutingMap routing_map_arg(py::handle routing_map, py::handle probs, int num_topk) {
  const MapView v = map_view_arg(routing_map, probs, num_topk);
  RoutingMap r;
  r.num_tokens = v.num_tokens;
  r.num_experts = v.num_experts;
  const size_t n = size_t(v.num_tokens) * size_t(v.num_experts);
  r.routing_map.assign(v.map, v.map + n);
  r.probs.assign(v.probs, v.probs + n);
  r.num_topk = num_topk;
  if (num_topk <= 0) {
    // The map is checked by whoever reads it; nonzero cells count as routed here.
    SparseRouting s = to_sparse(v);
    default_topk(s);
    r.num_topk = s.num_topk;
  }
  return r;
}

SparseRouting sparse_routing_arg(py::handle routing_map, py::handle probs, int num_topk) {
  const MapView v = map_view_arg(routing_map, probs, num_topk);
  // The sparse form keeps only the routed cells, so a cell's byte is checked here (a bool
  // tensor holds 0/1 anyway); the probs are checked by the dispatch, on every rank.
  if (tensor_info(routing_map, "routing_map").type == ElemType::kU8) {
    const size_t n = size_t(v.num_tokens) * size_t(v.num_experts);
    for (size_t i = 0; i < n; ++i) {
      if (v.map[i] > 1) {
        throw py::value_error(fmt::format("routing_map[{}][{}] = {} is not 0 or 1",
                                          i / size_t(v.num_experts), i % size_t(v.num_experts),
                                          int(v.map[i])));
      }
    }
  }
  SparseRouting s = to_sparse(v);
  default_topk(s);
  return s;
}

namespace {

// `t` as a contiguous tensor of `want` (itself when it is one already, else torch's copy),
// `ok` saying which source dtypes may be converted; kept alive in `keep`.
TensorInfo contiguous_as(py::handle t, const char* name, ElemType want, bool ok, py::object& keep) {
  keep = py::reinterpret_borrow<py::object>(t);
  TensorInfo info = tensor_info(t, name);
  if (info.type == want && info.contiguous()) return info;
  if (!ok) {
    throw py::type_error(fmt::format("{} has dtype {}; expected {}", name,
                                     py::str(t.attr("dtype")).cast<std::string>(),
                                     elem_type_name(want)));
  }
  keep =
      t.attr("to")(py::module_::import("torch").attr(want == ElemType::kI64 ? "int64" : "float32"))
          .attr("contiguous")();
  return tensor_info(keep, name);
}

}  // namespace

TopkView topk_view_arg(py::handle topk_idx, py::handle topk_weights, py::object& keep_idx,
                       py::object& keep_weights) {
  TensorInfo ii = tensor_info(topk_idx, "topk_idx");
  if (ii.ndim != 2) {
    throw py::value_error(
        fmt::format("topk_idx must be 2-D [tokens, topk], got shape {}", shape_str(ii)));
  }
  py::object dtype = topk_idx.attr("dtype");
  const bool integer = !dtype.attr("is_floating_point").cast<bool>() &&
                       !dtype.attr("is_complex").cast<bool>() && ii.type != ElemType::kBool;
  if (ii.type == ElemType::kI32 && ii.contiguous()) {
    keep_idx = py::reinterpret_borrow<py::object>(topk_idx);
  } else {
    ii = contiguous_as(topk_idx, "topk_idx", ElemType::kI64, integer, keep_idx);
  }
  if (topk_weights.is_none()) {
    return TopkView{ii.data, ii.type == ElemType::kI64, nullptr, ii.shape[0], int(ii.shape[1])};
  }
  TensorInfo wi = tensor_info(topk_weights, "topk_weights");
  wi = contiguous_as(topk_weights, "topk_weights", ElemType::kF32,
                     topk_weights.attr("dtype").attr("is_floating_point").cast<bool>(),
                     keep_weights);
  if (wi.ndim != 2 || wi.shape[0] != ii.shape[0] || wi.shape[1] != ii.shape[1]) {
    throw py::value_error(fmt::format("topk_weights has shape {}; expected [{}, {}]", shape_str(wi),
                                      ii.shape[0], ii.shape[1]));
  }
  return TopkView{ii.data, ii.type == ElemType::kI64, static_cast<const float*>(wi.data),
                  ii.shape[0], int(ii.shape[1])};
}

LayoutOptions layout_arg(py::handle capacity_factor, const std::string& drop_policy,
                         bool pad_to_capacity, int expert_alignment, int router_padding_multiple) {
  LayoutOptions o;
  if (!capacity_factor.is_none()) o.capacity_factor = capacity_factor.cast<double>();
  o.drop_policy = check(parse_drop_policy(drop_policy));
  o.pad_to_capacity = pad_to_capacity;
  o.expert_alignment = expert_alignment;
  o.router_padding_multiple = router_padding_multiple;
  check(o.validate());
  return o;
}

namespace {
// A torch tensor of DLPack dtype `dt` over [rows, cols] (or [rows] when cols < 0) at data.
py::object dlpack_to_torch(void* data, DLDataType dt, int64_t rows, int64_t cols,
                           int64_t row_stride, std::shared_ptr<void> owner, PyObject* empty_dtype) {
  TorchRefs* r = refs();
  const int ndim = cols < 0 ? 1 : 2;
  if (rows == 0 || cols == 0 || data == nullptr) {
    py::tuple shape = ndim == 1 ? py::make_tuple(rows) : py::make_tuple(rows, cols);
    py::dict kw;
    kw["dtype"] = py::reinterpret_borrow<py::object>(empty_dtype);
    return py::reinterpret_borrow<py::object>(r->empty)(shape, **kw);
  }
  auto* h = new Holder{};
  h->owner = std::move(owner);
  h->shape[0] = rows;
  h->shape[1] = cols;
  h->strides[0] = ndim == 1 ? 1 : row_stride;
  h->strides[1] = 1;
  h->managed.dl_tensor = DLTensor{data, DLDevice{kDLCPU, 0}, ndim, dt, h->shape, h->strides, 0};
  h->managed.manager_ctx = h;
  h->managed.deleter = holder_deleter;
  PyObject* cap = PyCapsule_New(&h->managed, "dltensor", capsule_destructor);
  if (!cap) {
    delete h;
    throw py::error_already_set();
  }
  py::object capsule = py::reinterpret_steal<py::object>(cap);
  return py::reinterpret_borrow<py::object>(r->from_dlpack)(capsule);
}
DLDataType dl_type(DType t) {
  if (t == DType::kF32) return {2, 32, 1};
  if (t == DType::kBF16) return {4, 16, 1};
  return {1, 8, 1};  // fp8 travels as uint8 bits; viewed as float8_e4m3fn where torch has it
}
template <typename T>
DLDataType dl_type_of() {
  if constexpr (std::is_same_v<T, float>) return {2, 32, 1};
  if constexpr (std::is_same_v<T, int32_t>) return {0, 32, 1};
  if constexpr (std::is_same_v<T, int64_t>) return {0, 64, 1};
  return {1, 8, 1};
}
template <typename T>
PyObject* torch_dtype_of() {
  TorchRefs* r = refs();
  if constexpr (std::is_same_v<T, float>) return r->dtypes[int(ElemType::kF32)];
  if constexpr (std::is_same_v<T, int32_t>) return r->dtypes[int(ElemType::kI32)];
  if constexpr (std::is_same_v<T, int64_t>) return r->dtypes[int(ElemType::kI64)];
  return r->uint8;
}
}  // namespace

py::object to_torch(const TensorView& v, std::shared_ptr<void> owner) {
  const bool empty = v.rows == 0 || v.cols == 0 || !v.data;
  py::object dtype = torch_dtype(v.dtype);
  py::object t = dlpack_to_torch(v.data, dl_type(v.dtype), v.rows, v.cols, v.row_stride,
                                 std::move(owner), dtype.ptr());
  if (!empty && v.dtype == DType::kFP8 && refs()->dtypes[int(ElemType::kFP8)])
    t = t.attr("view")(dtype);
  return t;
}

py::object to_torch(Tensor&& t) {
  auto owned = std::make_shared<Tensor>(std::move(t));
  TensorView v = owned->view();
  return to_torch(v, std::move(owned));
}

py::object to_torch(TokenTensor&& t) { return to_torch(std::move(t.x)); }

template <typename T>
py::object vector_to_torch(std::vector<T>&& v, std::initializer_list<int64_t> shape) {
  auto owned = std::make_shared<std::vector<T>>(std::move(v));
  int64_t rows = *shape.begin();
  int64_t cols = shape.size() > 1 ? *(shape.begin() + 1) : -1;
  void* data = owned->data();
  return dlpack_to_torch(data, dl_type_of<T>(), rows, cols, cols < 0 ? 1 : cols, std::move(owned),
                         torch_dtype_of<T>());
}
template py::object vector_to_torch<float>(std::vector<float>&&, std::initializer_list<int64_t>);
template py::object vector_to_torch<int32_t>(std::vector<int32_t>&&,
                                             std::initializer_list<int64_t>);
template py::object vector_to_torch<int64_t>(std::vector<int64_t>&&,
                                             std::initializer_list<int64_t>);
template py::object vector_to_torch<uint8_t>(std::vector<uint8_t>&&,
                                             std::initializer_list<int64_t>);

template <typename T>
py::object array_to_torch(const T* data, int64_t rows, int64_t cols, std::shared_ptr<void> owner) {
  return dlpack_to_torch(const_cast<T*>(data), dl_type_of<T>(), rows, cols, cols < 0 ? 1 : cols,
                         std::move(owner), torch_dtype_of<T>());
}
template py::object array_to_torch<float>(const float*, int64_t, int64_t, std::shared_ptr<void>);
template py::object array_to_torch<int32_t>(const int32_t*, int64_t, int64_t,
                                            std::shared_ptr<void>);
template py::object array_to_torch<int64_t>(const int64_t*, int64_t, int64_t,
                                            std::shared_ptr<void>);

template <typename T>
py::object span_to_torch(std::span<const T> s) {
  return vector_to_torch<T>(std::vector<T>(s.begin(), s.end()), {int64_t(s.size())});
}
template py::object span_to_torch<float>(std::span<const float>);
template py::object span_to_torch<int32_t>(std::span<const int32_t>);
template py::object span_to_torch<int64_t>(std::span<const int64_t>);

// ---- errors ----

py::object& aborted_error_type() {
  static py::object* t = new py::object();
  return *t;
}

void raise_status(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      throw py::value_error(s.message());
    case StatusCode::kAborted:
      if (aborted_error_type()) {
        PyErr_SetString(aborted_error_type().ptr(), s.message().c_str());
        throw py::error_already_set();
      }
      [[fallthrough]];
    default:
      throw std::runtime_error(s.message());
  }
}

}  // namespace moed::python
