#include "moed/thread_pool.h"

#include <algorithm>

namespace moed {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  num_threads_ = num_threads;
  // The caller is worker 0; the pool owns the rest.
  for (int i = 1; i < num_threads_; ++i) threads_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::split(int64_t n, int workers, int w, int64_t* begin, int64_t* end) {
  const int64_t base = n / workers, extra = n % workers;
  *begin = w * base + std::min<int64_t>(w, extra);
  *end = *begin + base + (w < extra ? 1 : 0);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                              int64_t min_chunk) {
  if (n <= 0) return;
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int workers = int(std::min<int64_t>(num_threads_, std::max<int64_t>(1, n / min_chunk)));
  if (workers == 1) {
    fn(0, n, 0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_workers_ = workers;
    pending_ = workers - 1;
    ++generation_;
  }
  cv_work_.notify_all();
  int64_t b, e;
  split(n, workers, 0, &b, &e);
  fn(b, e, 0);
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n;
    int workers;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      workers = job_workers_;
    }
    if (index < workers) {
      int64_t b, e;
      split(n, workers, index, &b, &e);
      (*job)(b, e, index);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) cv_done_.notify_all();
    }
  }
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool(0);
  return pool;
}

}  // namespace moed
