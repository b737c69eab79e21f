// A small fixed-size thread pool for moed's hot loops.
//
// parallel_for splits [0, n) into contiguous ranges, one per worker ("channel" in DeepEP's
// words), so each worker owns a contiguous range of tokens. The calling thread takes part.
//
//   moed::ThreadPool pool(4);
//   pool.parallel_for(num_tokens, [&](int64_t begin, int64_t end, int worker) { ... });
//
// Rank threads in the threads world each get their own pool, so ranks don't contend for one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moed {

class ThreadPool {
 public:
  // num_threads <= 0 means one per core (std::thread::hardware_concurrency()).
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(begin, end, worker) over a split of [0, n) into at most num_threads() contiguous
  // ranges (ranges no smaller than min_chunk where possible) and waits for all of them.
  // Worker w gets the w-th range, so the split is deterministic for a given n.
  // Called from inside one of this pool's own jobs, it runs fn(0, n, w) inline on that thread
  // (w: the thread's worker index) instead of waiting on itself. If fn throws, every range
  // still finishes and the first exception is rethrown to the caller.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                    int64_t min_chunk = 1);

  // The range worker w of `workers` gets for n items (the same split parallel_for uses).
  static void split(int64_t n, int workers, int w, int64_t* begin, int64_t* end);

  // The process-wide default pool, created on first use with set_global_threads()'s size if
  // set, else one thread per core. Used by calls made without a World (permute, routing).
  static ThreadPool& global();
  // Sets the size of the global pool (0 = one per core; negative: false). A pool already made
  // with another size is replaced for later global() calls; the old one stays alive, idle,
  // so references taken earlier stay valid. Thread-safe; call it before the hot loops start
  // (e.g. right after import, with torch.get_num_threads()).
  static bool set_global_threads(int num_threads);
  // The size the global pool has or will have (without creating it).
  static int global_threads();

 private:
  void worker_loop(int index);

  int num_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::condition_variable cv_done_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_workers_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;  // the first exception a worker threw in the current job
  std::mutex run_mu_;         // one parallel_for at a time per pool
};

}  // namespace moed
