// The gloo world from Python (moed.from_torch): a gloo rendezvous Store over a
// torch.distributed Store's Python methods, and gloo_world(), which makes the world. Only
// torch's Python API is used (set / get / wait), never its C++ ABI, so a newer torch works.
#include <gloo/rendezvous/store.h>

#include <chrono>

#include "moed/gloo_world.h"
#include "python/bindings.h"
#include "python/interop.h"
#include "python/world_handle.h"

namespace moed::python {
namespace {

// gloo calls this only inside make_gloo_world (the rendezvous), from the calling thread,
// which has released the GIL: each call takes it back.
class TorchStore final : public ::gloo::rendezvous::Store {
 public:
  TorchStore(py::object store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    call([&] { store_.attr("set")(prefix_ + key, py::bytes(data.data(), data.size())); });
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    std::string value;
    call([&] { value = store_.attr("get")(prefix_ + key).cast<std::string>(); });
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    call([&] {
      py::list full;
      for (const auto& k : keys) full.append(prefix_ + k);
      py::object td = py::module_::import("datetime").attr("timedelta")(
          py::arg("milliseconds") = double(timeout.count()));
      store_.attr("wait")(full, td);
    });
  }
  ~TorchStore() override {
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

 private:
  // Python errors become C++ ones (gloo passes them up through make_gloo_world).
  template <typename F>
  void call(F&& f) {
    py::gil_scoped_acquire gil;
    try {
      f();
    } catch (py::error_already_set& e) {
      throw std::runtime_error(std::string("torch store: ") + e.what());
    }
  }
  py::object store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

void bind_gloo(py::module_& m) {
  m.def("has_gloo", [] { return bool(MOED_WITH_GLOO + 0); });
  m.def(
      "gloo_world",
      [](py::object store, const std::string& prefix, int rank, int size,
         const std::string& address, const std::string& host_id, int ranks_per_node,
         double timeout_s, int threads_per_rank) {
        if (!(timeout_s > 0))
          throw py::value_error("timeout = " + std::to_string(timeout_s) + " must be > 0 seconds");
        GlooWorldOptions o;
        o.world.ranks_per_node = ranks_per_node;
        o.world.timeout = std::chrono::milliseconds(std::max<int64_t>(1, int64_t(timeout_s * 1000.0 + 0.5)));
        o.world.threads_per_rank = threads_per_rank;
        o.address = address;
        o.host_id = host_id;
        auto adapter = std::make_unique<TorchStore>(store, prefix, o.world.timeout);
        StatusOr<std::unique_ptr<World>> w = internal_error("gloo world not made");
        {
          py::gil_scoped_release nogil;
          w = make_gloo_world(*adapter, rank, size, o);
        }
        adapter.reset();
        return std::make_shared<WorldHandle>(check(std::move(w)));
      },
      py::arg("store"), py::arg("prefix"), py::arg("rank"), py::arg("size"), py::arg("address"),
      py::arg("host_id"), py::arg("ranks_per_node"), py::arg("timeout"),
      py::arg("threads_per_rank"));
}

}  // namespace moed::python
