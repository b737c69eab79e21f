// DeepEpBox: the C++ runtime behind moed.deep_ep.Buffer (DeepEP's legacy Buffer), shared by
// its two binding files: deep_ep_bindings.cc (normal mode, on moed::deep_ep::NormalBuffer) and
// low_latency_bindings.cc (low-latency mode, on moed::LowLatencyBuffer). It is a Closable, so
// it is torn down before its world ends even while Python still holds the Buffer.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "moed/deep_ep.h"
#include "moed/low_latency.h"
#include "python/collective_args.h"
#include "python/world_handle.h"

namespace moed::python {

class DeepEpBox : public Closable {
 public:
  // (num_max_dispatch_tokens_per_rank, hidden, num_experts): one low-latency buffer each.
  using Shape = std::tuple<int64_t, int, int>;
  // DeepEP's zero-copy combine buffers of one shape: two bf16 [L * R * M, H] tensors (alternating
  // as DeepEP's two halves do) and which one the next combine reads. C++ memory, so that the
  // torch views handed out may be freed on any thread (a DLPack owner holds no Python object).
  struct NextCombine {
    std::array<std::shared_ptr<Tensor>, 2> buffers;
    int next = 0;
    bool pending = false;  // get_next_low_latency_combine_buffer was called for the next combine
  };
  // A receive handed out as a hook. close() runs the ones still pending, so that none runs later
  // on a world that has gone; the hook then finds it done.
  class PendingReceive {
   public:
    explicit PendingReceive(Request r) : request_(std::move(r)) {}
    // Runs the receive once (without the GIL); every later call returns its status.
    Status run() {
      std::lock_guard<std::mutex> lock(mu_);
      if (request_) {
        status_ = request_->wait();
        request_.reset();
      }
      return status_;
    }

   private:
    std::mutex mu_;
    Request request_;
    Status status_;
  };

  // Shrink mode: the low-latency segment (num_rdma_bytes) is made here, while every rank is
  // there, so that the low-latency buffer can be made on first use without a collective.
  // num_channels: the normal mode's token ranges per sender (DeepEP's Config.num_sms / 2;
  // 0 = the world pool's threads).
  DeepEpBox(std::shared_ptr<WorldHandle> world, const LowLatencyOptions& ll, size_t num_rdma_bytes,
            int num_channels = 0)
      : world_(std::move(world)), ll_options_(ll) {
    World& w = world_->get();
    normal_ = check(nogil([&] { return deep_ep::NormalBuffer::create(w, num_channels); }));
    manual_mask_.assign(size_t(w.size()), -1);
    if (!ll.enable_shrink) return;
    ll_options_.segment = check(nogil([&]() -> StatusOr<std::shared_ptr<SharedBuffer>> {
      MOED_RETURN_IF_ERROR(w.agree(num_rdma_bytes > 0
                                       ? ok_status()
                                       : invalid_argument("enable_shrink needs num_rdma_bytes "
                                                          "(get_low_latency_rdma_size_hint)")));
      MOED_ASSIGN_OR_RETURN(std::shared_ptr<SharedBuffer> seg, w.alloc_shared(num_rdma_bytes));
      std::memset(seg->local(), 0, seg->bytes());
      MOED_RETURN_IF_ERROR(w.barrier());
      return seg;
    }));
  }
  void close() override {
    std::vector<std::weak_ptr<PendingReceive>> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending.swap(pending_);
    }
    for (auto& p : pending)
      if (auto r = p.lock()) r->run().ignore();
    std::lock_guard<std::mutex> lock(mu_);
    normal_.reset();
    ll_.clear();
    next_combine_.clear();
    closed_ = true;
  }
  // Registers a hook's receive with close() (called with the GIL, by the rank's own thread).
  std::shared_ptr<PendingReceive> pending_receive(Request r) {
    auto p = std::make_shared<PendingReceive>(std::move(r));
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(pending_, [](const std::weak_ptr<PendingReceive>& w) { return w.expired(); });
    pending_.push_back(p);
    return p;
  }
  void check_open() const {
    if (closed_)
      throw std::runtime_error("moed.deep_ep: this Buffer was destroyed or its world has ended");
  }
  World& world() { return world_->get(); }
  deep_ep::NormalBuffer& normal() {
    if (!normal_)
      throw std::runtime_error("moed.deep_ep: this Buffer was destroyed or its world has ended");
    return *normal_;
  }
  // Created on first use (collective: every rank calls the same op).
  LowLatencyBuffer& low_latency(const Shape& s) {
    auto it = ll_.find(s);
    if (it != ll_.end()) return *it->second;
    if (!normal_)
      throw std::runtime_error("moed.deep_ep: this Buffer was destroyed or its world has ended");
    if (shrink() && !ll_.empty()) {
      const Shape& had = ll_.begin()->first;
      check(invalid_argument(
          "moed.deep_ep: in shrink mode a Buffer has one low-latency shape; it has (",
          std::get<0>(had), ", ", std::get<1>(had), ", ", std::get<2>(had), "), asked for (",
          std::get<0>(s), ", ", std::get<1>(s), ", ", std::get<2>(s), ")"));
    }
    World& w = world();
    auto b = check(nogil([&] {
      return LowLatencyBuffer::create(w, std::get<0>(s), std::get<1>(s), std::get<2>(s),
                                      ll_options_);
    }));
    // Masks set by hand before this shape's buffer existed apply to it too.
    for (size_t r = 0; r < manual_mask_.size(); ++r) {
      if (manual_mask_[r] >= 0) check(b->update_mask(int(r), manual_mask_[r] != 0));
    }
    return *(ll_[s] = std::move(b));
  }
  bool shrink() const { return ll_options_.enable_shrink; }
  // DeepEP's one mask buffer per Buffer over moed's buffer per shape: a rank is masked when
  // any of them masked it; by hand, it is (un)masked in all of them, now and later.
  std::vector<int32_t> query_mask() const {
    std::vector<int32_t> mask(manual_mask_.size(), 0);
    for (const auto& [shape, b] : ll_) {
      std::vector<int32_t> m = b->query_mask();
      for (size_t r = 0; r < mask.size(); ++r) mask[r] |= m[r];
    }
    for (size_t r = 0; r < mask.size(); ++r) {
      if (manual_mask_[r] == 1) mask[r] = 1;
    }
    return mask;
  }
  void update_mask(int rank, bool mask) {
    if (!shrink())
      throw std::runtime_error("moed.deep_ep: rank masking needs Buffer(..., enable_shrink=True)");
    if (rank < 0 || size_t(rank) >= manual_mask_.size()) {
      check(invalid_argument("low_latency_update_mask_buffer: rank_to_mask = ", rank,
                             " is outside [0, ", manual_mask_.size(), ")"));
    }
    for (auto& [shape, b] : ll_) check(b->update_mask(rank, mask));
    manual_mask_[size_t(rank)] = mask ? 1 : 0;
  }
  void clean_mask() {
    if (!shrink())
      throw std::runtime_error("moed.deep_ep: rank masking needs Buffer(..., enable_shrink=True)");
    for (auto& [shape, b] : ll_) check(b->clean_mask());
    std::fill(manual_mask_.begin(), manual_mask_.end(), -1);
  }
  void drop_low_latency(const Shape& s) {
    ll_.erase(s);
    next_combine_.erase(s);
  }
  NextCombine& next_combine(const Shape& s) {
    check_open();
    return next_combine_[s];
  }

 private:
  std::shared_ptr<WorldHandle> world_;
  LowLatencyOptions ll_options_;
  std::vector<int8_t> manual_mask_;  // [R]: -1 untouched, else the last update_mask by hand
  std::mutex mu_;
  std::unique_ptr<deep_ep::NormalBuffer> normal_;
  std::map<Shape, std::unique_ptr<LowLatencyBuffer>> ll_;
  std::map<Shape, NextCombine> next_combine_;
  std::vector<std::weak_ptr<PendingReceive>> pending_;
  bool closed_ = false;
};

using DeepEpClass = py::class_<DeepEpBox, std::shared_ptr<DeepEpBox>>;

// The two halves of the binding (each adds its argument / result classes to `m` and its
// methods to `buffer`).
void bind_deep_ep_normal(py::module_& m, DeepEpClass& buffer);
void bind_deep_ep_low_latency(py::module_& m, DeepEpClass& buffer);

}  // namespace moed::python
