// moed._C.ElasticBuffer: the C++ half of moed.deep_ep.ElasticBuffer (DeepEP V2's
// ElasticBuffer) on moed::deep_ep::ElasticBuffer, plus V2's pipeline-parallel send / receive
// over the world's point-to-point messages. One argument object in, one result object out;
// tensors are read in place and the checks are the C++ call's, on every rank.
//
// FP8 scales: float32 [T, H / 128] in either major order, or DeepEP's UE8M0 packs (int32
// [T, H / 512], four exponent bytes each), which travel as the float32 powers of two they
// stand for and are packed again on arrival (exact both ways).
#include <pybind11/stl.h>

#include <deque>

#include "comm/tags.h"
#include "moed/elastic_buffer.h"
#include "python/bindings.h"
#include "python/collective_args.h"
#include "python/interop.h"
#include "python/world_handle.h"

namespace moed::python {
namespace {

struct ElasticHandleBox {
  std::shared_ptr<const deep_ep::ElasticHandle> h;
};

// V2's pipeline-parallel ring: up to `inflight` sends per peer in flight, each from its own
// copy of the tensor (so the caller may reuse it at once, as with DeepEP's buffer).
struct Pipeline {
  size_t max_bytes = 0;
  int inflight = 0;
  struct Send {
    Request req;
    std::vector<std::byte> data;
  };
  std::map<int, std::deque<Send>> sends;  // by destination
};

class ElasticBox : public Closable {
 public:
  ElasticBox(std::shared_ptr<WorldHandle> world, const deep_ep::ElasticConfig& config)
      : world_(std::move(world)) {
    World& w = world_->get();
    buffer_ = check(nogil([&] { return deep_ep::ElasticBuffer::create(w, config); }));
  }
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (buffer_) {
      // Sends still in flight are waited for (bounded by the world's timeout).
      for (auto& [dst, q] : pipe_.sends)
        for (auto& s : q) s.req->wait().ignore();
    }
    pipe_ = Pipeline{};
    buffer_.reset();
  }
  deep_ep::ElasticBuffer& get() {
    if (!buffer_)
      throw std::runtime_error("moed.deep_ep: this ElasticBuffer was destroyed or its world ended");
    return *buffer_;
  }
  World& world() { return world_->get(); }
  Pipeline& pipe() { return pipe_; }

 private:
  std::shared_ptr<WorldHandle> world_;
  std::mutex mu_;
  std::unique_ptr<deep_ep::ElasticBuffer> buffer_;
  Pipeline pipe_;
};

struct ElasticDispatchArgs {
  py::object x, x_scales, topk_idx, topk_weights, cumulative_local_expert_recv_stats, handle;
  int num_experts = 0;
  int64_t num_max_tokens_per_rank = 0;
  int expert_alignment = 0;
  py::object do_cpu_sync;  // None or bool
  bool do_expand = false;
};

struct ElasticDispatchResult {
  py::object recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, handle;
};

struct ElasticCombineTag;
using ElasticCombineArgs = CombineArgs<ElasticCombineTag>;
using ElasticCombineResult = CombineResult<ElasticCombineTag>;

// DeepEP's packed UE8M0 scales -> the float32 powers of two they stand for.
Tensor unpack_ue8m0(py::handle sf, int64_t rows, int64_t blocks) {
  TensorInfo info = tensor_info(sf, "x scales");
  if (info.ndim != 2 || info.shape[0] != rows || info.shape[1] * 4 < blocks ||
      info.shape[1] * 4 - blocks >= 4)
    throw py::value_error("x scales (UE8M0, int32) must be [" + std::to_string(rows) + ", " +
                          std::to_string((blocks + 3) / 4) + "]");
  Tensor out = Tensor::empty(DType::kF32, rows, blocks);
  for (int64_t t = 0; t < rows; ++t) {
    const auto* packs = reinterpret_cast<const uint8_t*>(
        static_cast<const int32_t*>(info.data) + t * info.stride[0]);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* pack = packs + (b / 4) * info.stride[1] * 4;
      out.row<float>(t)[b] = bits_to_float(uint32_t(pack[b % 4]) << 23);
    }
  }
  return out;
}

ElasticDispatchResult elastic_dispatch(ElasticBox& b, const ElasticDispatchArgs& a) {
  deep_ep::ElasticDispatchInput in;
  in.num_experts = a.num_experts;
  in.num_max_tokens_per_rank = a.num_max_tokens_per_rank;
  in.expert_alignment = a.expert_alignment;
  in.do_expand = a.do_expand;
  if (!a.do_cpu_sync.is_none()) in.do_cpu_sync = a.do_cpu_sync.cast<bool>();
  py::object keep_scales, keep_idx, keep_weights;
  std::shared_ptr<Tensor> unpacked;
  bool ue8m0 = false;
  std::exception_ptr error;
  const Status parsed = parse_collectively(
      [&] {
        py::object scales = a.x_scales;
        if (!scales.is_none() && tensor_info(scales, "x scales").type == ElemType::kI32) {
          ue8m0 = true;
          TensorView xv = rows_arg(a.x, "x", {DType::kFP8});
          unpacked = std::make_shared<Tensor>(unpack_ue8m0(scales, xv.rows, xv.cols / 128));
          scales = to_torch(unpacked->view(), unpacked);
        }
        in.x = token_rows_arg(a.x, scales, "x", {DType::kF32, DType::kBF16, DType::kFP8},
                              keep_scales);
        if (!a.handle.is_none()) in.handle = a.handle.cast<ElasticHandleBox&>().h;
        if (!a.topk_idx.is_none()) {
          in.topk = topk_view_arg(a.topk_idx, a.topk_weights, keep_idx, keep_weights);
        } else if (!a.topk_weights.is_none()) {
          // Cached mode: weights only (the handle has the indices).
          TensorInfo w = tensor_info(a.topk_weights, "topk_weights");
          if (w.type != ElemType::kF32 || !w.contiguous())
            throw py::value_error("topk_weights must be a contiguous float32 tensor");
          in.cached_weights = {static_cast<const float*>(w.data), size_t(w.numel())};
        }
        if (!a.cumulative_local_expert_recv_stats.is_none()) {
          std::span<const int32_t> s = span_arg<int32_t>(a.cumulative_local_expert_recv_stats,
                                                         "cumulative_local_expert_recv_stats",
                                                         ElemType::kI32, {-1});
          in.cumulative_local_expert_recv_stats = {const_cast<int32_t*>(s.data()), s.size()};
        }
      },
      &error, "handle must be the EPHandle of an ElasticBuffer dispatch");
  if (error) in.handle.reset();
  deep_ep::ElasticBuffer& eb = b.get();
  deep_ep::ElasticDispatchOutput out = finish(nogil([&] { return eb.dispatch(in, parsed); }), error);
  const deep_ep::ElasticHandle& h = *out.handle;
  ElasticDispatchResult r;
  const int64_t rows = out.recv_x.x.rows, K = h.num_topk;
  r.recv_x = to_torch(out.recv_x.x, out.storage);
  r.recv_x_scales = py::none();
  if (out.recv_x.has_scales()) {
    if (ue8m0) {
      auto packed = std::make_shared<std::vector<int32_t>>(
          size_t(rows) * size_t((out.recv_x.scales.cols + 3) / 4), 0);
      check(deep_ep::pack_ue8m0(out.recv_x.scales, *packed));
      r.recv_x_scales = array_to_torch(packed->data(), rows, (out.recv_x.scales.cols + 3) / 4, packed);
    } else {
      r.recv_x_scales = to_torch(out.recv_x.scales, out.storage);
    }
  }
  r.recv_topk_idx =
      h.do_expand ? py::none() : array_to_torch(out.recv_topk_idx.data(), rows, K, out.storage);
  r.recv_topk_weights = py::none();
  if (!a.topk_weights.is_none()) {
    r.recv_topk_weights = array_to_torch(out.recv_topk_weights.data(), rows,
                                         h.do_expand ? -1 : K, out.storage);
  }
  r.handle = py::cast(ElasticHandleBox{out.handle});
  return r;
}

ElasticCombineResult elastic_combine(ElasticBox& b, const ElasticCombineArgs& a) {
  deep_ep::ElasticCombineInput in;
  std::exception_ptr error;
  const Status parsed = parse_collectively(
      [&] {
        in.handle = a.handle.cast<ElasticHandleBox&>().h;
        in.x = rows_arg(a.x, "x", {DType::kF32, DType::kBF16});
        if (!a.topk_weights.is_none()) {
          TensorInfo w = tensor_info(a.topk_weights, "topk_weights");
          const int64_t want = in.handle->do_expand ? in.x.rows : in.x.rows * in.handle->num_topk;
          if (w.type != ElemType::kF32 || !w.contiguous() || w.numel() != want)
            throw py::value_error("topk_weights must be a contiguous float32 tensor of " +
                                  std::string(in.handle->do_expand ? "[num_rows]" : "[num_rows, num_topk]") +
                                  " (" + std::to_string(want) + " values)");
          in.topk_weights = static_cast<const float*>(w.data);
        }
        if (!a.bias_0.is_none()) in.bias_0 = rows_arg(a.bias_0, "bias_0", {DType::kF32, DType::kBF16});
        if (!a.bias_1.is_none()) in.bias_1 = rows_arg(a.bias_1, "bias_1", {DType::kF32, DType::kBF16});
        if (!a.out.is_none()) in.out = rows_arg(a.out, "out", {DType::kF32, DType::kBF16});
      },
      &error, "handle must be the EPHandle of an ElasticBuffer dispatch");
  if (error) in.handle.reset();
  deep_ep::ElasticBuffer& eb = b.get();
  deep_ep::ElasticCombineOutput out = finish(nogil([&] { return eb.combine(in, parsed); }), error);
  ElasticCombineResult r;
  const int64_t T = out.result().rows;
  r.combined_x = in.out ? a.out : to_torch(std::move(out.combined_x));
  r.combined_topk_weights =
      in.topk_weights ? vector_to_torch<float>(std::move(out.combined_topk_weights),
                                               {T, in.handle->num_topk})
                      : py::none();
  return r;
}

// ---- pipeline parallelism (V2's pp_send / pp_recv) ----

std::span<std::byte> contiguous_bytes(py::handle t, const char* name) {
  TensorInfo info = tensor_info(t, name);
  if (!info.contiguous()) throw py::value_error(std::string(name) + " must be contiguous");
  return {static_cast<std::byte*>(info.data),
          size_t(info.numel()) * t.attr("element_size")().cast<size_t>()};
}

void check_neighbour(World& w, int peer, const char* what) {
  const int R = w.size(), r = w.rank();
  if (peer < 0 || peer >= R || R < 2 || (peer != (r + 1) % R && peer != (r + R - 1) % R))
    throw py::value_error(std::string(what) + " = " + std::to_string(peer) +
                          " is not a neighbour of rank " + std::to_string(r) + " in the ring of " +
                          std::to_string(R));
}

void pp_send(ElasticBox& b, py::handle t, int dst) {
  World& w = b.world();
  Pipeline& p = b.pipe();
  check_neighbour(w, dst, "dst_rank_idx");
  std::span<std::byte> bytes = contiguous_bytes(t, "t");
  if (p.inflight == 0) throw py::value_error("pp_send before pp_set_config");
  if (bytes.size() > p.max_bytes)
    throw py::value_error("t has " + std::to_string(bytes.size()) +
                          " bytes, more than num_max_tensor_bytes = " + std::to_string(p.max_bytes));
  std::deque<Pipeline::Send>& q = p.sends[dst];
  nogil([&] {
    // A full ring waits for its oldest send (the peer's receive), as DeepEP's does.
    while (!q.empty() && (q.front().req->ready() || int(q.size()) >= p.inflight)) {
      check(q.front().req->wait());
      q.pop_front();
    }
    q.push_back({Request(), std::vector<std::byte>(bytes.begin(), bytes.end())});
    auto r = w.isend(dst, tags::kPipeline, q.back().data.data(), q.back().data.size());
    if (!r.ok()) q.pop_back();
    check(r.status());
    q.back().req = std::move(*r);
    return 0;
  });
}

void pp_recv(ElasticBox& b, py::handle t, int src) {
  World& w = b.world();
  check_neighbour(w, src, "src_rank_idx");
  std::span<std::byte> bytes = contiguous_bytes(t, "t");
  check(nogil([&] { return w.recv(src, tags::kPipeline, bytes.data(), bytes.size()); }));
}

}  // namespace

void bind_elastic(py::module_& m) {
  py::class_<ElasticHandleBox>(m, "ElasticHandle")
      .def_property_readonly("do_expand", [](const ElasticHandleBox& b) { return b.h->do_expand; })
      .def_property_readonly("num_recv_tokens",
                             [](const ElasticHandleBox& b) { return b.h->num_recv_tokens; })
      .def_property_readonly("num_expanded_tokens",
                             [](const ElasticHandleBox& b) { return b.h->num_expanded_tokens; })
      .def_property_readonly("num_recv_tokens_per_expert_list",
                             [](const ElasticHandleBox& b) {
                               return b.h->num_recv_tokens_per_expert_list;
                             })
      .def("arrays", [](const ElasticHandleBox& b) {
        // V2's EPHandle tensors, as views of the handle (immutable once made).
        const deep_ep::ElasticHandle& h = *b.h;
        std::shared_ptr<void> owner = std::const_pointer_cast<deep_ep::ElasticHandle>(b.h);
        const int64_t T = h.num_tokens, K = h.num_topk;
        py::dict d;
        d["topk_idx"] = array_to_torch(h.topk_idx.data(), T, K, owner);
        d["psum_num_recv_tokens_per_scaleup_rank"] = array_to_torch(
            h.psum_num_recv_tokens_per_scaleup_rank.data(),
            int64_t(h.psum_num_recv_tokens_per_scaleup_rank.size()), -1, owner);
        d["psum_num_recv_tokens_per_expert"] =
            array_to_torch(h.psum_num_recv_tokens_per_expert.data(),
                           int64_t(h.psum_num_recv_tokens_per_expert.size()), -1, owner);
        d["num_unaligned_recv_tokens_per_expert"] =
            array_to_torch(h.num_unaligned_recv_tokens_per_expert.data(),
                           int64_t(h.num_unaligned_recv_tokens_per_expert.size()), -1, owner);
        d["recv_src_metadata"] =
            array_to_torch(h.recv_src_metadata.data(), h.num_recv_tokens, K + 2, owner);
        d["dst_buffer_slot_idx"] = array_to_torch(h.dst_buffer_slot_idx.data(), T, K, owner);
        return d;
      });

  py::class_<ElasticDispatchArgs>(m, "ElasticDispatchArgs")
      .def(py::init([](py::object x, py::object x_scales, py::object topk_idx,
                       py::object topk_weights, py::object stats, int num_experts,
                       int64_t num_max_tokens_per_rank, int expert_alignment, py::object handle,
                       py::object do_cpu_sync, bool do_expand) {
             return ElasticDispatchArgs{x,           x_scales,
                                        topk_idx,    topk_weights,
                                        stats,       handle,
                                        num_experts, num_max_tokens_per_rank,
                                        expert_alignment, do_cpu_sync,
                                        do_expand};
           }),
           py::kw_only(), py::arg("x"), py::arg("x_scales") = py::none(),
           py::arg("topk_idx") = py::none(), py::arg("topk_weights") = py::none(),
           py::arg("cumulative_local_expert_recv_stats") = py::none(),
           py::arg("num_experts") = 0, py::arg("num_max_tokens_per_rank") = 0,
           py::arg("expert_alignment") = 0, py::arg("handle") = py::none(),
           py::arg("do_cpu_sync") = py::none(), py::arg("do_expand") = false);
  py::class_<ElasticDispatchResult>(m, "ElasticDispatchResult")
      .def_readonly("recv_x", &ElasticDispatchResult::recv_x)
      .def_readonly("recv_x_scales", &ElasticDispatchResult::recv_x_scales)
      .def_readonly("recv_topk_idx", &ElasticDispatchResult::recv_topk_idx)
      .def_readonly("recv_topk_weights", &ElasticDispatchResult::recv_topk_weights)
      .def_readonly("handle", &ElasticDispatchResult::handle);
  bind_combine_args<ElasticCombineTag>(m, "ElasticCombineArgs", "ElasticCombineResult");

  py::class_<ElasticBox, std::shared_ptr<ElasticBox>>(m, "ElasticBuffer")
      .def(py::init([](std::shared_ptr<WorldHandle> world, int64_t num_max_tokens_per_rank,
                       bool allow_hybrid_mode, bool allow_multiple_reduction) {
             deep_ep::ElasticConfig c{num_max_tokens_per_rank, allow_hybrid_mode,
                                      allow_multiple_reduction};
             auto box = std::make_shared<ElasticBox>(world, c);
             world->add(box);
             return box;
           }),
           py::arg("world"), py::arg("num_max_tokens_per_rank"), py::arg("allow_hybrid_mode"),
           py::arg("allow_multiple_reduction"))
      .def("close",
           [](ElasticBox& b) {
             nogil([&] {
               b.close();
               return 0;
             });
           })
      .def("dispatch", &elastic_dispatch, py::arg("args"))
      .def("combine", &elastic_combine, py::arg("args"))
      .def("logical_domain", [](ElasticBox& b) { return b.get().logical_domain(); })
      .def("physical_domain", [](ElasticBox& b) { return b.get().physical_domain(); })
      .def("num_channels", [](ElasticBox& b) { return b.world().pool().num_threads(); })
      .def("barrier",
           [](ElasticBox& b) {
             World& w = b.world();
             check(nogil([&] { return w.barrier(); }));
           })
      .def(
          "pp_set_config",
          [](ElasticBox& b, int64_t num_max_tensor_bytes, int num_max_inflight_tensors) {
            if (num_max_tensor_bytes <= 0 || num_max_inflight_tensors <= 0)
              throw py::value_error("num_max_tensor_bytes and num_max_inflight_tensors must be positive");
            World& w = b.world();
            Pipeline& p = b.pipe();
            // Like DeepEP's: a barrier, after every send of the earlier config has landed.
            nogil([&] {
              for (auto& [dst, q] : p.sends)
                for (auto& s : q) check(s.req->wait());
              p.sends.clear();
              check(w.barrier());
              return 0;
            });
            p.max_bytes = size_t(num_max_tensor_bytes);
            p.inflight = num_max_inflight_tensors;
          },
          py::arg("num_max_tensor_bytes"), py::arg("num_max_inflight_tensors"))
      .def("pp_send", &pp_send, py::arg("t"), py::arg("dst_rank_idx"))
      .def("pp_recv", &pp_recv, py::arg("t"), py::arg("src_rank_idx"));
}

}  // namespace moed::python
