#include "moed/thread_pool.h"

#include <algorithm>
#include <exception>
#include <memory>

namespace moed {

namespace {
// The pool whose job this thread is running (as caller or worker), and its worker index.
// NOTE: a parallel_for on that same pool from inside its own job would wait for itself
// (run_mu_ is held and every worker is busy), so it runs inline instead.
thread_local const ThreadPool* t_current_pool = nullptr;
thread_local int t_current_worker = 0;

struct ScopedCurrent {
  const ThreadPool* saved_pool = t_current_pool;
  int saved_worker = t_current_worker;
  ScopedCurrent(const ThreadPool* pool, int worker) {
    t_current_pool = pool;
    t_current_worker = worker;
  }
  ~ScopedCurrent() {
    t_current_pool = saved_pool;
    t_current_worker = saved_worker;
  }
};
}  // namespace

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
  if (t_current_pool == this) {
    // Nested on this pool: one range on this thread, under its own worker index so per-worker
    // scratch stays private to one thread.
    fn(0, n, t_current_worker);
    return;
  }
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int workers = int(std::min<int64_t>(num_threads_, std::max<int64_t>(1, n / min_chunk)));
  ScopedCurrent current(this, 0);
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
    error_ = nullptr;
    ++generation_;
  }
  cv_work_.notify_all();
  int64_t b, e;
  split(n, workers, 0, &b, &e);
  std::exception_ptr caller_error;
  // NOTE: the workers hold a pointer to fn, so even when fn throws here the caller waits for
  // them before leaving.
  try {
    fn(b, e, 0);
  } catch (...) {
    caller_error = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  std::exception_ptr error = caller_error ? caller_error : error_;
  error_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

void ThreadPool::worker_loop(int index) {
  ScopedCurrent current(this, index);
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
      std::exception_ptr error;
      try {
        (*job)(b, e, index);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) cv_done_.notify_all();
    }
  }
}

namespace {
struct GlobalPool {
  std::mutex mu;
  int wanted = 0;  // 0 = one per core
  ThreadPool* current = nullptr;
  // NOTE: replaced pools are never destroyed: a caller may still hold a reference from an
  // earlier global(), and idle workers only sleep on their condition variable.
  std::vector<std::unique_ptr<ThreadPool>> pools;
};
GlobalPool& global_pool() {
  static GlobalPool* g = new GlobalPool();  // never destroyed: no exit-order hazards
  return *g;
}
int cores() { return int(std::max(1u, std::thread::hardware_concurrency())); }
}  // namespace

ThreadPool& ThreadPool::global() {
  GlobalPool& g = global_pool();
  std::lock_guard<std::mutex> lock(g.mu);
  if (g.current == nullptr) {
    g.pools.push_back(std::make_unique<ThreadPool>(g.wanted));
    g.current = g.pools.back().get();
  }
  return *g.current;
}

bool ThreadPool::set_global_threads(int num_threads) {
  if (num_threads < 0) return false;
  GlobalPool& g = global_pool();
  std::lock_guard<std::mutex> lock(g.mu);
  g.wanted = num_threads;
  const int n = num_threads > 0 ? num_threads : cores();
  if (g.current != nullptr && g.current->num_threads() != n) g.current = nullptr;
  return true;
}

int ThreadPool::global_threads() {
  GlobalPool& g = global_pool();
  std::lock_guard<std::mutex> lock(g.mu);
  if (g.current != nullptr) return g.current->num_threads();
  return g.wanted > 0 ? g.wanted : cores();
}

}  // namespace moed
