// WorldHandle: what a Python moed.Group holds. A threads world lives only while its rank's
// function runs (moed.launch); an MPI world until moed's exit hook. Objects built on a world
// (dispatchers, buffers) register a Closable so they are torn down before the world goes,
// even when Python still references them; using them afterwards raises RuntimeError.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "moed/world.h"

namespace moed::python {

class Closable {
 public:
  virtual ~Closable() = default;
  // Drops every C++ object that refers to the world. Called without the GIL.
  virtual void close() = 0;
};

class WorldHandle {
 public:
  explicit WorldHandle(World* w) : world_(w) {}
  explicit WorldHandle(std::unique_ptr<World> w) : world_(w.get()), owned_(std::move(w)) {}
  ~WorldHandle() { close(); }

  // The world, or RuntimeError once it has ended.
  World& get() const {
    if (!world_)
      throw std::runtime_error(
          "moed: this group's world has ended (moed.launch returned or moed was shut down)");
    return *world_;
  }
  bool alive() const { return world_ != nullptr; }
  void add(std::weak_ptr<Closable> c) {
    std::lock_guard<std::mutex> lock(mu_);
    closables_.push_back(std::move(c));
  }
  // Closes the registered objects (newest first), then forgets the world (and frees an owned
  // one). Idempotent; call it without the GIL.
  void close() {
    std::vector<std::weak_ptr<Closable>> cs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cs.swap(closables_);
    }
    for (auto it = cs.rbegin(); it != cs.rend(); ++it)
      if (auto c = it->lock()) c->close();
    world_ = nullptr;
    owned_.reset();
  }

 private:
  World* world_;
  std::unique_ptr<World> owned_;
  std::mutex mu_;
  std::vector<std::weak_ptr<Closable>> closables_;
};

}  // namespace moed::python
