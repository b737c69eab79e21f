// bind_world: WorldHandle, the threads world (run_threads over a Python body), the MPI world,
// the gloo world (gloo_bindings.cc),
// and the collectives moed.dist is built on (byte level over contiguous CPU tensors).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>

#include "moed/threads_world.h"
#include "moed/world.h"
#include "python/bindings.h"
#include "python/interop.h"
#include "python/world_handle.h"
#if MOED_WITH_MPI
#include "comm/mpi/process.h"
#include "moed/mpi_world.h"
#endif

namespace moed::python {
namespace {

WorldOptions world_options(int ranks_per_node, double timeout_s, int threads_per_rank) {
  if (!(timeout_s > 0))
    throw py::value_error("timeout = " + std::to_string(timeout_s) + " must be > 0 seconds");
  WorldOptions o;
  o.ranks_per_node = ranks_per_node;
  o.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0 + 0.5));
  if (o.timeout.count() < 1) o.timeout = std::chrono::milliseconds(1);
  o.threads_per_rank = threads_per_rank;
  return o;
}

// A contiguous CPU tensor of any dtype as bytes.
std::span<std::byte> bytes_arg(py::handle t, const char* name) {
  TensorInfo info = tensor_info(t, name);
  if (!info.contiguous()) throw py::value_error(std::string(name) + " must be contiguous");
  size_t elem = t.attr("element_size")().cast<size_t>();
  return std::span<std::byte>(static_cast<std::byte*>(info.data), size_t(info.numel()) * elem);
}

#if MOED_WITH_MPI
bool g_mpi_we_initialized = false;
#endif

// out: size * bytes(in), rank order. Unequal sizes across ranks: error on every rank.
void all_gather_into(const WorldHandle& h, py::handle out, py::handle in) {
  World& w = h.get();
  std::span<std::byte> src = bytes_arg(in, "input_tensor");
  std::span<std::byte> dst = bytes_arg(out, "output_tensor");
  Status local;
  if (dst.size() != src.size() * size_t(w.size())) {
    local = invalid_argument("output_tensor has ", dst.size(), " bytes; world size ", w.size(),
                             " x input_tensor's ", src.size(),
                             " bytes = ", src.size() * size_t(w.size()), " expected");
  }
  std::vector<size_t> sizes(size_t(w.size()), src.size());
  Status s;
  {
    py::gil_scoped_release nogil;
    s = w.agree(local);
    if (s.ok()) s = w.all_gather_v_bytes(src.data(), src.size(), dst.data(), sizes);
  }
  check(s);
}

// torch.distributed.all_to_all_single on bytes: in_bytes[r] of `in` (in rank
// order) go to rank r, out_bytes[r] from rank r land in `out`. The sizes are
// exchanged first, so a rank whose out_bytes does not match what its peers send
// is every rank's error, naming both.
void all_to_all_into(const WorldHandle& h, py::handle out, py::handle in,
                     const std::vector<size_t>& out_bytes, const std::vector<size_t>& in_bytes) {
  World& w = h.get();
  const size_t R = size_t(w.size());
  std::span<std::byte> src = bytes_arg(in, "input");
  std::span<std::byte> dst = bytes_arg(out, "output");
  auto sum = [](const std::vector<size_t>& v) {
    size_t n = 0;
    for (size_t b : v) n += b;
    return n;
  };
  Status local;
  if (in_bytes.size() != R || out_bytes.size() != R)
    local = invalid_argument("split sizes have ", in_bytes.size(), " / ", out_bytes.size(),
                             " entries; world size is ", R);
  else if (sum(in_bytes) != src.size() || sum(out_bytes) != dst.size())
    local =
        invalid_argument("split sizes cover ", sum(in_bytes), " / ", sum(out_bytes),
                         " bytes of input / output, which have ", src.size(), " / ", dst.size());
  Status s;
  {
    py::gil_scoped_release nogil;
    s = w.agree(local);
    std::vector<size_t> sent;
    if (s.ok()) {
      auto got = all_to_all<uint64_t>(
          w, std::span<const uint64_t>(reinterpret_cast<const uint64_t*>(in_bytes.data()), R));
      s = got.status();
      if (s.ok()) sent.assign(got->begin(), got->end());
    }
    if (s.ok()) {
      for (size_t r = 0; r < R && local.ok(); ++r)
        if (sent[r] != out_bytes[r])
          local = invalid_argument("rank ", r, " sends ", sent[r], " bytes to rank ", w.rank(),
                                   " but output_split_sizes expects ", out_bytes[r]);
      s = w.agree(local);
    }
    if (s.ok()) {
      std::vector<size_t> so(R, 0), ro(R, 0);
      for (size_t r = 1; r < R; ++r) {
        so[r] = so[r - 1] + in_bytes[r - 1];
        ro[r] = ro[r - 1] + out_bytes[r - 1];
      }
      s = w.all_to_all_v_bytes(src.data(), in_bytes, so, dst.data(), out_bytes, ro);
    }
  }
  check(s);
}

// In place, deterministic: 0 + x_0 + x_1 + ... in rank order, fp32.
void all_reduce_f32_in_place(const WorldHandle& h, py::handle t) {
  World& w = h.get();
  TensorInfo info = tensor_info(t, "tensor");
  if (info.type != ElemType::kF32) throw py::type_error("tensor must be torch.float32 here");
  if (!info.contiguous()) throw py::value_error("tensor must be contiguous");
  float* data = static_cast<float*>(info.data);
  size_t n = size_t(info.numel());
  Status s;
  {
    py::gil_scoped_release nogil;
    std::vector<float> send(data, data + n);
    uint64_t count = n;
    auto counts = all_gather<uint64_t>(w, std::span<const uint64_t>(&count, 1));
    s = counts.status();
    if (s.ok()) {
      Status local;
      for (int r = 0; r < w.size(); ++r)
        if ((*counts)[size_t(r)] != n)
          local = invalid_argument("tensor has ", n, " elements on rank ", w.rank(), " but ",
                                   (*counts)[size_t(r)], " on rank ", r);
      s = w.agree(local);
    }
    if (s.ok()) s = w.all_reduce_f32(send.data(), data, n);
  }
  check(s);
}

// body(handle) -> (ok, value_or_exception), never raises (python/moed/_world.py).
py::tuple run_threads_world(int num_ranks, int ranks_per_node, double timeout_s,
                            int threads_per_rank, py::function body) {
  WorldOptions opts = world_options(ranks_per_node, timeout_s, threads_per_rank);
  std::vector<py::object> results(size_t(std::max(num_ranks, 0)));
  std::vector<py::object> errors(results.size());
  py::object aborted = aborted_error_type();
  Status st;
  {
    py::gil_scoped_release nogil;
    st = run_threads(num_ranks, opts, [&](World& w) -> Status {
      auto handle = std::make_shared<WorldHandle>(&w);
      Status result;
      {
        py::gil_scoped_acquire gil;
        try {
          py::tuple r = body(handle);
          if (r[0].cast<bool>()) {
            results[size_t(w.rank())] = r[1];
          } else {
            py::object e = r[1];
            errors[size_t(w.rank())] = e;
            std::string msg = py::str(e);
            result =
                PyObject_IsInstance(e.ptr(), aborted.ptr()) == 1
                    ? Status(StatusCode::kAborted, msg)
                    : Status(StatusCode::kInternal,
                             py::str(py::type::handle_of(e).attr("__name__")).cast<std::string>() +
                                 ": " + msg);
          }
        } catch (py::error_already_set& e) {
          result = Status(StatusCode::kInternal, e.what());
        }
      }
      handle->close();  // dispatchers go before the world does
      return result;
    });
  }
  bool any_error = false;
  for (auto& e : errors) any_error |= bool(e);
  if (!st.ok() && !any_error) check(st);  // bad arguments: nothing ran
  py::list res, errs;
  for (auto& r : results) res.append(r ? r : py::none());
  for (auto& e : errors) errs.append(e ? e : py::none());
  return py::make_tuple(res, errs, st.ok() ? std::string() : st.message());
}

std::shared_ptr<WorldHandle> mpi_world(int ranks_per_node, double timeout_s, int threads_per_rank) {
#if MOED_WITH_MPI
  WorldOptions opts = world_options(ranks_per_node, timeout_s, threads_per_rank);
  StatusOr<std::unique_ptr<World>> w = internal_error("MPI world not made");
  {
    py::gil_scoped_release nogil;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      // MULTIPLE: async steps then run on their own thread (World::calls_from_any_thread).
      mpi::init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE);
      g_mpi_we_initialized = true;
    }
    w = make_mpi_world(MPI_COMM_WORLD, opts);
  }
  return std::make_shared<WorldHandle>(check(std::move(w)));
#else
  (void)ranks_per_node, (void)timeout_s, (void)threads_per_rank;
  throw std::runtime_error("moed was built without MPI (MOED_WITH_MPI=OFF)");
  return std::shared_ptr<WorldHandle>();
#endif
}

}  // namespace

#if MOED_WITH_GLOO
void bind_gloo(py::module_& m);  // gloo_bindings.cc: the gloo world over a torch.distributed store
#endif

void bind_world(py::module_& m) {
#if MOED_WITH_GLOO
  bind_gloo(m);
#else
  m.def("has_gloo", [] { return false; });
#endif
  py::class_<WorldHandle, std::shared_ptr<WorldHandle>>(m, "WorldHandle")
      .def("rank", [](const WorldHandle& h) { return h.get().rank(); })
      .def("size", [](const WorldHandle& h) { return h.get().size(); })
      .def("ranks_per_node", [](const WorldHandle& h) { return h.get().ranks_per_node(); })
      .def("num_nodes", [](const WorldHandle& h) { return h.get().num_nodes(); })
      .def("backend", [](const WorldHandle& h) { return std::string(h.get().backend_name()); })
      .def("num_threads", [](const WorldHandle& h) { return h.get().pool().num_threads(); })
      .def("alive", &WorldHandle::alive)
      .def("close",
           [](WorldHandle& h) {
             py::gil_scoped_release nogil;
             h.close();
           })
      .def("barrier",
           [](const WorldHandle& h) {
             World& w = h.get();
             Status s;
             {
               py::gil_scoped_release nogil;
               s = w.barrier();
             }
             check(s);
           })
      .def("fail",
           [](const WorldHandle& h, const std::string& message) {
             // A rank failing on purpose (an exception escaped it): tell every peer, end nothing.
             World& w = h.get();
             Status reason(StatusCode::kInternal, message);
             py::gil_scoped_release nogil;
             w.abort(reason);
           })
      .def("rank_failed", [](const WorldHandle& h, int r) { return h.get().rank_failed(r); })
      .def("timeout", [](const WorldHandle& h) { return double(h.get().timeout().count()) / 1e3; })
      .def("shrink",
           [](const WorldHandle& h) {
             // The new world is owned by its handle (moed.Group.shrink keeps it).
             World& w = h.get();
             StatusOr<ShrunkWorld> s = internal_error("shrink did not run");
             {
               py::gil_scoped_release nogil;
               s = w.shrink();
             }
             ShrunkWorld shrunk = check(std::move(s));
             return py::make_tuple(std::make_shared<WorldHandle>(std::move(shrunk.world)),
                                   shrunk.members);
           })
      .def("agree",
           [](const WorldHandle& h, const std::string& local_error) {
             // Every rank passes "" (fine) or its error; all raise the lowest failing rank's.
             World& w = h.get();
             Status local = local_error.empty() ? Status() : invalid_argument(local_error);
             Status s;
             {
               py::gil_scoped_release nogil;
               s = w.agree(local);
             }
             check(s);
           })
      .def("broadcast",
           [](const WorldHandle& h, py::handle t, int root) {
             World& w = h.get();
             std::span<std::byte> b = bytes_arg(t, "tensor");
             Status s;
             {
               py::gil_scoped_release nogil;
               s = w.broadcast_bytes(b.data(), b.size(), root);
             }
             check(s);
           })
      .def("all_gather_into", &all_gather_into)
      .def("all_to_all_into", &all_to_all_into)
      .def("all_reduce_f32", &all_reduce_f32_in_place);

  m.def("run_threads", &run_threads_world, py::arg("num_ranks"), py::arg("ranks_per_node"),
        py::arg("timeout"), py::arg("threads_per_rank"), py::arg("body"));

  m.def("has_mpi", [] { return bool(MOED_WITH_MPI + 0); });
  m.def("mpi_world", &mpi_world);
  m.def("mpi_finalize", [] {
#if MOED_WITH_MPI
    int fin = 0;
    MPI_Finalized(&fin);
    // After a failed world a peer may never reach MPI_Finalize (it waits for every process):
    // leave without it, and mpirun ends the job.
    if (g_mpi_we_initialized && !fin && !mpi_peer_may_be_gone()) {
      py::gil_scoped_release nogil;
      mpi::finalize();
    }
#endif
  });
}

}  // namespace moed::python
