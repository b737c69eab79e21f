// DeepEpBox: the C++ runtime behind moed.deep_ep.Buffer (DeepEP's legacy Buffer), shared by
// its two binding files: deep_ep_bindings.cc (normal mode, on moed::deep_ep::NormalBuffer) and
// low_latency_bindings.cc (low-latency mode, on moed::LowLatencyBuffer). It is a Closable, so
// it is torn down before its world ends even while Python still holds the Buffer.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "moed/deep_ep.h"
#include "moed/low_latency.h"
#include "python/collective_args.h"
#include "python/world_handle.h"

namespace moed::python {

class DeepEpBox : public Closable {
 public:
  // (num_max_dispatch_tokens_per_rank, hidden, num_experts): one low-latency buffer each.
  using Shape = std::tuple<int64_t, int, int>;
  // DeepEP's zero-copy combine buffers of one shape: two bf16 [L, R * M, H] tensors (moed's
  // memory, alternating as DeepEP's two halves do) and which one the next combine reads.
  struct NextCombine {
    std::array<py::object, 2> buffers;
    int next = 0;
    bool pending = false;  // get_next_low_latency_combine_buffer was called for the next combine
  };

  explicit DeepEpBox(std::shared_ptr<WorldHandle> world) : world_(std::move(world)) {
    World& w = world_->get();
    normal_ = check(nogil([&] { return deep_ep::NormalBuffer::create(w); }));
  }
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    normal_.reset();
    ll_.clear();
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
    World& w = world();
    auto b = check(nogil([&] {
      return LowLatencyBuffer::create(w, std::get<0>(s), std::get<1>(s), std::get<2>(s));
    }));
    return *(ll_[s] = std::move(b));
  }
  void drop_low_latency(const Shape& s) {
    ll_.erase(s);
    next_combine_.erase(s);
  }
  NextCombine& next_combine(const Shape& s) { return next_combine_[s]; }

 private:
  std::shared_ptr<WorldHandle> world_;
  std::mutex mu_;
  std::unique_ptr<deep_ep::NormalBuffer> normal_;
  std::map<Shape, std::unique_ptr<LowLatencyBuffer>> ll_;
  std::map<Shape, NextCombine> next_combine_;
};

using DeepEpClass = py::class_<DeepEpBox, std::shared_ptr<DeepEpBox>>;

// The two halves of the binding (each adds its argument / result classes to `m` and its
// methods to `buffer`).
void bind_deep_ep_normal(py::module_& m, DeepEpClass& buffer);
void bind_deep_ep_low_latency(py::module_& m, DeepEpClass& buffer);

}  // namespace moed::python
