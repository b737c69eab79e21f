// MPI backend point-to-point: MPI_Isend / MPI_Irecv on the world's communicator, waited on by
// polling MPI_Test against failure and the timeout. Counted like the threads backend:
// network bytes between nodes, shared bytes within a node (where MPI itself uses its
// shared-memory transport).
#include <climits>
#include <vector>

#include "comm/mpi/mpi_world.h"
#include "comm/wait.h"

namespace moed::mpi {
namespace {

class MpiRequest final : public PendingOp {
 public:
  MpiRequest(MpiWorld* world, MPI_Request request, bool is_recv, int peer, int tag, size_t bytes)
      : world_(world),
        request_(request),
        is_recv_(is_recv),
        peer_(peer),
        tag_(tag),
        bytes_(bytes) {}
  ~MpiRequest() override { abandon(); }

  bool ready() override {
    if (done_) return true;
    int flag = 0;
    MPI_Status st;
    const int rc = MPI_Test(&request_, &flag, &st);
    if (rc == MPI_SUCCESS && flag == 0) return false;
    finish(rc, st, ok_status());
    return true;
  }

  Status wait() override {
    if (done_) return result_;
    MPI_Status st;
    int rc = MPI_SUCCESS;
    MpiWorld* w = world_;
    Status s = internal::poll_until(
        *w,
        [&] {
          int flag = 0;
          rc = MPI_Test(&request_, &flag, &st);
          return rc != MPI_SUCCESS || flag != 0;
        },
        [&] {
          return is_recv_ ? str_cat("rank ", w->rank(), " receiving ", bytes_, " bytes from rank ",
                                    peer_, " with tag ", tag_)
                          : str_cat("rank ", w->rank(), " sending ", bytes_, " bytes to rank ",
                                    peer_, " with tag ", tag_);
        });
    // As a collective's wait does: a timeout names the ranks that gave no sign of life (the
    // peer waited for may itself be waiting on a stalled one).
    if (!s.ok()) s = w->after_failed_wait(std::move(s));
    finish(rc, st, s);
    return result_;
  }

  Status wait_for(std::chrono::milliseconds timeout) override {
    if (done_) return result_;
    MPI_Status st;
    int rc = MPI_SUCCESS;
    Status s = internal::poll(
        timeout,
        [&] {
          int flag = 0;
          rc = MPI_Test(&request_, &flag, &st);
          return rc != MPI_SUCCESS || flag != 0;
        },
        [&] { return internal::peer_failure(*world_, peer_); },
        [&] {
          return str_cat("rank ", world_->rank(), is_recv_ ? " receiving from" : " sending to",
                         " rank ", peer_, " with tag ", tag_);
        });
    finish(rc, st, s);
    return result_;
  }

 private:
  // Records the outcome once MPI_Test said done (or the wait failed with `s`).
  void finish(int rc, const MPI_Status& st, Status s) {
    if (s.ok()) s = check(rc, is_recv_ ? "MPI_Irecv" : "MPI_Isend");
    if (s.ok() && is_recv_) {
      int got = 0;
      MPI_Get_count(&st, MPI_BYTE, &got);
      if (size_t(got) != bytes_) {
        s = invalid_argument("rank ", world_->rank(), " receives ", bytes_, " bytes from rank ",
                             peer_, " with tag ", tag_, ", which sends ", got);
      }
    }
    if (!s.ok()) abandon();
    done_ = true;
    result_ = s;
  }

  // A receive that never completes must not write into the caller's buffer later: cancel it.
  // A send is released to MPI (it completes, or dies with the job).
  void abandon() {
    if (request_ == MPI_REQUEST_NULL) return;
    if (is_recv_) {
      MPI_Cancel(&request_);
      MPI_Wait(&request_, MPI_STATUS_IGNORE);
    } else {
      MPI_Request_free(&request_);
    }
  }

  MpiWorld* world_;
  MPI_Request request_;
  bool is_recv_;
  int peer_, tag_;
  size_t bytes_;
  bool done_ = false;
  Status result_;
};

Status check_p2p(const MpiWorld& w, const char* op, const char* peer_name, int peer, int tag,
                 const void* data, size_t bytes) {
  if (peer < 0 || peer >= w.size()) {
    return invalid_argument(op, ": ", peer_name, " = ", peer, " is outside [0, ", w.size(), ")");
  }
  if (tag < 0 || tag > w.tag_ub()) {
    return invalid_argument(op, ": tag = ", tag, " is outside [0, ", w.tag_ub(), "]");
  }
  if (data == nullptr && bytes > 0) return invalid_argument(op, ": data is null");
  if (bytes > size_t(INT_MAX)) {
    return unimplemented(op, ": ", bytes, " bytes is more than the MPI backend's limit ", INT_MAX);
  }
  return ok_status();
}

}  // namespace

StatusOr<Request> MpiWorld::isend(int dst, int tag, const void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, dst, "isend"));
  MOED_RETURN_IF_ERROR(check_p2p(*this, "isend", "dst", dst, tag, data, bytes));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Isend(data, int(bytes), MPI_BYTE, dst, tag, comm_, &req), "MPI_Isend"));
  count_send(dst, bytes);
  return Request(std::make_unique<MpiRequest>(this, req, false, dst, tag, bytes));
}

// The pieces as one hindexed datatype at absolute addresses (MPI_BOTTOM), so MPI reads them
// where they lie. The type can go once the send is posted (MPI keeps it as long as it needs).
StatusOr<Request> MpiWorld::isend_gather(int dst, int tag, std::span<const Piece> pieces) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, dst, "isend_gather"));
  std::vector<int> lengths;
  std::vector<MPI_Aint> at;
  size_t bytes = 0;
  for (const Piece& p : pieces) {
    MOED_RETURN_IF_ERROR(check_p2p(*this, "isend_gather", "dst", dst, tag, p.data, p.bytes));
    if (p.bytes == 0) continue;
    MPI_Aint a;
    MOED_RETURN_IF_ERROR(check(MPI_Get_address(p.data, &a), "MPI_Get_address"));
    lengths.push_back(int(p.bytes));
    at.push_back(a);
    bytes += p.bytes;
  }
  if (bytes > size_t(INT_MAX)) {
    return unimplemented("isend_gather: ", bytes, " bytes is more than the MPI backend's limit ",
                         INT_MAX);
  }
  MPI_Datatype type;
  MOED_RETURN_IF_ERROR(check(
      MPI_Type_create_hindexed(int(lengths.size()), lengths.data(), at.data(), MPI_BYTE, &type),
      "MPI_Type_create_hindexed"));
  MOED_RETURN_IF_ERROR(check(MPI_Type_commit(&type), "MPI_Type_commit"));
  MPI_Request req;
  const int rc = MPI_Isend(MPI_BOTTOM, 1, type, dst, tag, comm_, &req);
  MPI_Type_free(&type);
  MOED_RETURN_IF_ERROR(check(rc, "MPI_Isend"));
  count_send(dst, bytes);
  return Request(std::make_unique<MpiRequest>(this, req, false, dst, tag, bytes));
}

StatusOr<Request> MpiWorld::irecv(int src, int tag, void* data, size_t bytes) {
  MOED_RETURN_IF_ERROR(internal::start_p2p(*this, src, "irecv"));
  MOED_RETURN_IF_ERROR(check_p2p(*this, "irecv", "src", src, tag, data, bytes));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Irecv(data, int(bytes), MPI_BYTE, src, tag, comm_, &req), "MPI_Irecv"));
  return Request(std::make_unique<MpiRequest>(this, req, true, src, tag, bytes));
}

}  // namespace moed::mpi
