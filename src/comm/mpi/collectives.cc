// MPI backend collectives: MPI non-blocking collectives polled against failure and the
// timeout. Arguments are checked on every rank first and the verdict agreed, so a bad size
// is the same error everywhere instead of an MPI truncation on one rank. Float sums are
// never MPI_SUM: contributions are gathered and added here in ascending rank order.
#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <string>

#include "comm/backend.h"
#include "comm/mpi/mpi_world.h"
#include "comm/sum_rows.h"

namespace moed::mpi {
namespace {

Status fits_int(size_t n, const char* op) {
  if (n > size_t(INT_MAX)) {
    return unimplemented(op, ": ", n, " bytes in one part is more than the MPI backend's limit ",
                         INT_MAX);
  }
  return ok_status();
}

// Every rank's `n` words (rank r's at all[r * n]), so every rank can name a disagreement.
StatusOr<const uint64_t*> gather_words(MpiWorld& w, CallBuffers& buf, const uint64_t* words,
                                       size_t n, const std::function<std::string()>& what) {
  const uint64_t* mine = buf.make_from(words, n);
  uint64_t* all = buf.make<uint64_t>(n * size_t(w.size()));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Iallgather(mine, int(n), MPI_UINT64_T, all, int(n), MPI_UINT64_T, w.comm(), &req),
            "MPI_Iallgather"));
  MOED_RETURN_IF_ERROR(w.wait(&req, what, &buf));
  return all;
}

}  // namespace

Status MpiWorld::barrier() {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "barrier"));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier"));
  auto what = [&] { return str_cat("rank ", rank_, " in barrier"); };
  return wait(&req, what, /*buffers=*/nullptr);
}

Status MpiWorld::broadcast_bytes(void* data, size_t bytes, int root) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "broadcast"));
  // Everyone's (root, bytes), so every rank can name the disagreement.
  CallBuffers buf;
  const uint64_t root_and_bytes[2] = {uint64_t(int64_t(root)), bytes};
  auto what = [&] { return str_cat("rank ", rank_, " in broadcast"); };
  MOED_ASSIGN_OR_RETURN(const uint64_t* all, gather_words(*this, buf, root_and_bytes, 2, what));
  MOED_RETURN_IF_ERROR(internal::check_broadcast(
      size_, root, [&](int r) { return int64_t(all[2 * size_t(r)]); },
      [&](int r) { return all[2 * size_t(r) + 1]; }));
  MOED_RETURN_IF_ERROR(agree_verdict(fits_int(bytes, "broadcast"), "broadcast"));
  if (bytes == 0) return ok_status();
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Ibcast(data, int(bytes), MPI_BYTE, root, comm_, &req), "MPI_Ibcast"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf, Completion::kEvenAfterFailure));
  if (rank_ == root) {
    internal::count_send_to_all(*this, bytes);
  }
  return ok_status();
}

Status MpiWorld::all_gather_v_bytes(const void* send, size_t send_bytes, void* recv,
                                    std::span<const size_t> recv_bytes) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "all_gather_v"));
  auto what = [&] { return str_cat("rank ", rank_, " in all_gather_v"); };
  CallBuffers buf;
  const uint64_t mine = send_bytes;
  MOED_ASSIGN_OR_RETURN(const uint64_t* sizes, gather_words(*this, buf, &mine, 1, what));
  Status local = internal::check_all_gather_v(rank_, size_, recv_bytes,
                                              [&](int s) { return sizes[size_t(s)]; });
  int* counts = buf.make<int>(size_t(size_));
  int* displs = buf.make<int>(size_t(size_));
  size_t off = 0;
  for (int s = 0; s < size_ && local.ok(); ++s) {
    local = fits_int(off + sizes[size_t(s)], "all_gather_v");
    counts[s] = int(sizes[size_t(s)]);
    displs[s] = int(off);
    off += sizes[size_t(s)];
  }
  MOED_RETURN_IF_ERROR(agree_verdict(local, "all_gather_v"));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(check(
      MPI_Iallgatherv(send, int(send_bytes), MPI_BYTE, recv, counts, displs, MPI_BYTE, comm_, &req),
      "MPI_Iallgatherv"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf, Completion::kEvenAfterFailure));
  internal::count_send_to_all(*this, send_bytes);
  return ok_status();
}

Status MpiWorld::all_to_all_v_bytes(const void* send, std::span<const size_t> send_bytes,
                                    std::span<const size_t> send_offsets, void* recv,
                                    std::span<const size_t> recv_bytes,
                                    std::span<const size_t> recv_offsets) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "all_to_all_v"));
  auto what = [&] { return str_cat("rank ", rank_, " in all_to_all_v"); };
  const size_t n = size_t(size_);
  Status local = internal::check_exchange_lengths("all_to_all_v", rank_, n, send_bytes,
                                                  send_offsets, recv_bytes, recv_offsets);
  // Exchange the sizes (zeros where this rank's spans are malformed; the verdict below
  // carries that error), then agree once on everything checked.
  CallBuffers buf;
  uint64_t* mine = buf.make<uint64_t>(n);
  uint64_t* sent = buf.make<uint64_t>(n);
  if (local.ok()) std::copy(send_bytes.begin(), send_bytes.end(), mine);
  MPI_Request req;
  MOED_RETURN_IF_ERROR(check(
      MPI_Ialltoall(mine, 1, MPI_UINT64_T, sent, 1, MPI_UINT64_T, comm_, &req), "MPI_Ialltoall"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf));
  int* sc = buf.make<int>(n);
  int* sd = buf.make<int>(n);
  int* rc = buf.make<int>(n);
  int* rd = buf.make<int>(n);
  if (local.ok()) {
    local = internal::check_recv_sizes(
        "all_to_all_v", rank_, size_, [&](int s) { return recv_bytes[size_t(s)]; },
        [&](int s) { return sent[size_t(s)]; });
  }
  for (size_t i = 0; i < n && local.ok(); ++i) {
    local = fits_int(std::max(send_offsets[i] + send_bytes[i], recv_offsets[i] + recv_bytes[i]),
                     "all_to_all_v");
    sc[i] = int(send_bytes[i]);
    sd[i] = int(send_offsets[i]);
    rc[i] = int(recv_bytes[i]);
    rd[i] = int(recv_offsets[i]);
  }
  MOED_RETURN_IF_ERROR(agree_verdict(local, "all_to_all_v"));
  MOED_RETURN_IF_ERROR(
      check(MPI_Ialltoallv(send, sc, sd, MPI_BYTE, recv, rc, rd, MPI_BYTE, comm_, &req),
            "MPI_Ialltoallv"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf, Completion::kEvenAfterFailure));
  for (int d = 0; d < size_; ++d) count_send(d, send_bytes[size_t(d)]);
  return ok_status();
}

Status MpiWorld::reduce_scatter_v_f32(const float* send, std::span<const size_t> counts,
                                      float* recv) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "reduce_scatter_v_f32"));
  auto what = [&] { return str_cat("rank ", rank_, " in reduce_scatter_v_f32"); };
  const size_t n = size_t(size_);
  Status local = internal::check_counts_length(rank_, counts.size(), n);
  MOED_RETURN_IF_ERROR(agree_verdict(local, "reduce_scatter_v_f32"));
  // Everyone's counts, so every rank can name the first disagreement.
  CallBuffers buf;
  const std::vector<uint64_t> mine(counts.begin(), counts.end());
  MOED_ASSIGN_OR_RETURN(const uint64_t* all, gather_words(*this, buf, mine.data(), n, what));
  for (size_t r = 0; r < n; ++r) {
    MOED_RETURN_IF_ERROR(internal::check_counts_match(r, all + r * n, all, n));
  }
  // Block d of every rank goes to rank d; rank d adds the R blocks in rank order.
  const size_t mine_count = counts[size_t(rank_)];
  float* blocks = buf.make<float>(mine_count * n);
  int* sc = buf.make<int>(n);
  int* sd = buf.make<int>(n);
  int* rc = buf.make<int>(n);
  int* rd = buf.make<int>(n);
  size_t off = 0;
  for (size_t d = 0; d < n && local.ok(); ++d) {
    local = fits_int(std::max((off + counts[d]) * 4, mine_count * n * 4), "reduce_scatter_v_f32");
    sc[d] = int(counts[d]);
    sd[d] = int(off);
    rc[d] = int(mine_count);
    rd[d] = int(d * mine_count);
    off += counts[d];
  }
  MOED_RETURN_IF_ERROR(agree_verdict(local, "reduce_scatter_v_f32"));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Ialltoallv(send, sc, sd, MPI_FLOAT, blocks, rc, rd, MPI_FLOAT, comm_, &req),
            "MPI_Ialltoallv"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf, Completion::kEvenAfterFailure));
  internal::sum_rows(pool(), blocks, size_, mine_count, recv);
  for (int d = 0; d < size_; ++d) count_send(d, counts[size_t(d)] * sizeof(float));
  return ok_status();
}

Status MpiWorld::all_reduce_f32(const float* send, float* recv, size_t count) {
  MOED_RETURN_IF_ERROR(internal::start_collective(*this, "all_reduce_f32"));
  auto what = [&] { return str_cat("rank ", rank_, " in all_reduce_f32"); };
  CallBuffers buf;
  const uint64_t mine = count;
  MOED_ASSIGN_OR_RETURN(const uint64_t* counts, gather_words(*this, buf, &mine, 1, what));
  MOED_RETURN_IF_ERROR(internal::check_same_as_rank0("all_reduce_f32", "count", size_,
                                                     [&](int r) { return counts[size_t(r)]; }));
  MOED_RETURN_IF_ERROR(agree_verdict(
      fits_int(count * sizeof(float) * size_t(size_), "all_reduce_f32"), "all_reduce_f32"));
  if (count == 0) return ok_status();
  // Gathering everything costs R times the data of a reduction tree, but fixes the order.
  float* rows = buf.make<float>(count * size_t(size_));
  MPI_Request req;
  MOED_RETURN_IF_ERROR(
      check(MPI_Iallgather(send, int(count), MPI_FLOAT, rows, int(count), MPI_FLOAT, comm_, &req),
            "MPI_Iallgather"));
  MOED_RETURN_IF_ERROR(wait(&req, what, &buf, Completion::kEvenAfterFailure));
  internal::sum_rows(pool(), rows, size_, count, recv);
  internal::count_send_to_all(*this, count * sizeof(float));
  return ok_status();
}

}  // namespace moed::mpi
