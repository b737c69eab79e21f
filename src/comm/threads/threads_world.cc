// The threads backend: run_threads, the shared failure state and the internal barrier.
#include "comm/threads/threads_world.h"

#include <algorithm>
#include <exception>
#include <thread>

#include "comm/wait.h"
#include "core/enum_names.h"
#include "moed/threads_world.h"

namespace moed {
namespace threads {

namespace {
constexpr EnumName<Op> kOpNames[] = {
    {Op::kBarrier, "barrier"},
    {Op::kBroadcast, "broadcast"},
    {Op::kAllGatherV, "all_gather_v"},
    {Op::kAllToAllV, "all_to_all_v"},
    {Op::kReduceScatterV, "reduce_scatter_v_f32"},
    {Op::kAllReduce, "all_reduce_f32"},
};
}  // namespace

const char* op_name(Op op) { return enum_name(kOpNames, op, "?"); }

Context::Context(int size, int ranks_per_node)
    : size(size),
      ranks_per_node(ranks_per_node),
      slots(size_t(size)),
      entered(new std::atomic<uint64_t>[size_t(size)]),
      mailboxes(size_t(size)),
      nodes(size_t(size / ranks_per_node)),
      rank_failed_(new std::atomic<bool>[size_t(size)]) {
  for (int r = 0; r < size; ++r) {
    entered[size_t(r)].store(0, std::memory_order_relaxed);
    rank_failed_[size_t(r)].store(false, std::memory_order_relaxed);
  }
}

void Context::fail(int rank, const Status& reason) {
  std::lock_guard<std::mutex> lock(fail_mu_);
  // The first failure before the rank's flag: whoever sees a rank failed finds the cause.
  if (failed_rank_ < 0) {
    failed_rank_ = rank;
    failure_ = aborted("rank ", rank, " failed: ",
                       reason.ok() ? std::string("abort() with an OK status") : reason.message());
    failed_.store(true, std::memory_order_release);
  }
  rank_failed_[size_t(rank)].store(true, std::memory_order_release);
}

Status Context::failure() const {
  if (!failed()) return ok_status();
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failure_;
}

int Context::failed_rank() const {
  std::lock_guard<std::mutex> lock(fail_mu_);
  return failed_rank_;
}

ThreadsWorld::ThreadsWorld(Context* ctx, int rank, std::chrono::milliseconds timeout,
                           int threads_per_rank)
    : World(rank, ctx->size, ctx->ranks_per_node, timeout, threads_per_rank), ctx_(ctx) {}

void ThreadsWorld::abort(const Status& reason) { ctx_->fail(rank_, reason); }

Status ThreadsWorld::fail_on_timeout(const Status& s) {
  if (s.code() == StatusCode::kDeadlineExceeded) ctx_->fail(rank_, s);
  return s;
}

Status ThreadsWorld::internal_barrier(Op op) {
  // NOTE: a rank that arrives after the world has failed would complete a barrier the others
  // left on the failure and go on to read their (released) slots; it leaves instead.
  MOED_RETURN_IF_ERROR(ctx_->failure());
  const uint64_t mine = ++barriers_entered_;
  ctx_->entered[size_t(rank_)].store(mine, std::memory_order_relaxed);
  // NOTE: read the generation before arriving: it cannot move until every rank (this one
  // included) has arrived, so the value read is the one this barrier waits to change.
  const uint64_t gen = ctx_->generation.load(std::memory_order_acquire);
  if (ctx_->arrived.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
    ctx_->arrived.store(0, std::memory_order_relaxed);
    ctx_->generation.store(gen + 1, std::memory_order_release);
    return ok_status();
  }
  Status s = internal::poll_until(
      *this, [&] { return ctx_->generation.load(std::memory_order_acquire) != gen; },
      [&] {
        std::string missing;
        for (int r = 0; r < size_; ++r) {
          if (ctx_->entered[size_t(r)].load(std::memory_order_relaxed) < mine) {
            missing += str_cat(missing.empty() ? "" : ", ", r);
          }
        }
        return str_cat("rank ", rank_, " in ", op_name(op), " waiting for rank(s) ", missing);
      });
  return fail_on_timeout(s);
}

StatusOr<ShrunkWorld> ThreadsWorld::shrink() {
  Context& c = *ctx_;
  std::unique_lock<std::mutex> lock(c.shrink_mu);
  if (c.shrink_arrived.empty()) c.shrink_arrived.assign(size_t(size_), false);
  if (!c.shrink_sealed) c.shrink_arrived[size_t(rank_)] = true;
  c.shrink_cv.notify_all();
  // Everyone who has not failed comes, or the timeout passes. (Failures need no notify: the
  // wait wakes every few milliseconds to look.)
  auto everyone = [&] {
    for (int r = 0; r < size_; ++r) {
      if (!c.shrink_arrived[size_t(r)] && !c.rank_failed(r)) return false;
    }
    return true;
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (!c.shrink_sealed && !everyone() && std::chrono::steady_clock::now() < deadline) {
    c.shrink_cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  if (!c.shrink_sealed) {
    for (int r = 0; r < size_; ++r) {
      if (c.shrink_arrived[size_t(r)]) c.shrink_members.push_back(r);
    }
    c.shrink_next = std::make_shared<Context>(
        int(c.shrink_members.size()), internal::shrunk_ranks_per_node(*this, c.shrink_members));
    c.shrink_sealed = true;
    c.shrink_cv.notify_all();
  }
  const auto it = std::find(c.shrink_members.begin(), c.shrink_members.end(), rank_);
  if (it == c.shrink_members.end()) {
    return aborted("rank ", rank_, " came to shrink() after the ", c.shrink_members.size(),
                   " others had made the new world without it (timeout ", timeout_.count(), " ms)");
  }
  auto w = std::make_unique<ThreadsWorld>(c.shrink_next.get(), int(it - c.shrink_members.begin()),
                                          timeout_, pool().num_threads());
  w->owned_ctx_ = c.shrink_next;
  return ShrunkWorld{std::move(w), c.shrink_members};
}

}  // namespace threads

Status run_threads(int world_size, const WorldOptions& options,
                   const std::function<Status(World&)>& body) {
  if (world_size < 1) return invalid_argument("world_size = ", world_size, " must be >= 1");
  const int g = options.ranks_per_node == 0 ? world_size : options.ranks_per_node;
  if (g < 1 || world_size % g != 0) {
    return invalid_argument("ranks_per_node = ", options.ranks_per_node,
                            " must divide world_size = ", world_size);
  }
  if (options.timeout.count() <= 0) {
    return invalid_argument("timeout = ", options.timeout.count(), " ms must be > 0");
  }
  if (options.threads_per_rank < 0) {
    return invalid_argument("threads_per_rank = ", options.threads_per_rank, " must be >= 0");
  }
  const int threads_per_rank = resolve_threads_per_rank(options.threads_per_rank, world_size);

  threads::Context ctx(world_size, g);
  std::vector<std::unique_ptr<threads::ThreadsWorld>> worlds;
  for (int r = 0; r < world_size; ++r) {
    worlds.push_back(
        std::make_unique<threads::ThreadsWorld>(&ctx, r, options.timeout, threads_per_rank));
  }
  std::vector<Status> results(static_cast<size_t>(world_size));
  auto run_rank = [&](int r) {
    Status s;
    try {
      s = body(*worlds[size_t(r)]);
    } catch (const std::exception& e) {
      s = internal_error("rank ", r, " threw: ", e.what());
    } catch (...) {
      s = internal_error("rank ", r, " threw an exception that is not a std::exception");
    }
    if (!s.ok()) ctx.fail(r, s);
    results[size_t(r)] = std::move(s);
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world_size; ++r) threads.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : threads) t.join();
  // Drop the worlds (and their pools) before reading the verdict: nothing runs after this.
  worlds.clear();

  if (!ctx.failed()) return ok_status();
  for (const Status& s : results) {
    if (!s.ok() && s.code() != StatusCode::kAborted) return s;
  }
  // Every returned error was an echo (or a rank called abort() and returned OK).
  const int root = ctx.failed_rank();
  if (!results[size_t(root)].ok()) return results[size_t(root)];
  return ctx.failure();
}

}  // namespace moed
