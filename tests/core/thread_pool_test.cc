#include "moed/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

namespace moed {
namespace {

// Every index in [0, n) visited exactly once, worker w on range w of the documented split.
void check_cover(ThreadPool& pool, int64_t n, int64_t min_chunk) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  std::vector<int64_t> begins(size_t(pool.num_threads()), -1), ends(size_t(pool.num_threads()), -1);
  std::atomic<int> calls{0};
  pool.parallel_for(
      n,
      [&](int64_t b, int64_t e, int w) {
        ASSERT_GE(w, 0);
        ASSERT_LT(w, pool.num_threads());
        begins[size_t(w)] = b;
        ends[size_t(w)] = e;
        for (int64_t i = b; i < e; ++i) hits[size_t(i)].fetch_add(1);
        calls.fetch_add(1);
      },
      min_chunk);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(hits[size_t(i)].load(), 1) << "n = " << n << " i = " << i;
  const int workers = calls.load();
  if (n == 0) {
    EXPECT_EQ(workers, 0);
    return;
  }
  EXPECT_LE(workers, pool.num_threads());
  for (int w = 0; w < workers; ++w) {
    int64_t b, e;
    ThreadPool::split(n, workers, w, &b, &e);
    EXPECT_EQ(begins[size_t(w)], b) << "n = " << n << " w = " << w;
    EXPECT_EQ(ends[size_t(w)], e) << "n = " << n << " w = " << w;
  }
}

TEST(ThreadPool, CoversRangeExactlyOnceWithDeterministicSplit) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 3, 4, 7, 100, 1001}) check_cover(pool, n, 1);
    check_cover(pool, 100, 40);  // min_chunk limits the workers to 2
  }
}

TEST(ThreadPool, SplitIsContiguousAndBalanced) {
  for (int64_t n : {0, 1, 5, 17, 1000}) {
    for (int workers : {1, 2, 3, 7}) {
      int64_t expect_begin = 0;
      for (int w = 0; w < workers; ++w) {
        int64_t b, e;
        ThreadPool::split(n, workers, w, &b, &e);
        EXPECT_EQ(b, expect_begin);
        EXPECT_GE(e - b, n / workers);
        EXPECT_LE(e - b, n / workers + 1);
        expect_begin = e;
      }
      EXPECT_EQ(expect_begin, n);
    }
  }
  int64_t b, e;
  ThreadPool::split(10, 4, 0, &b, &e);
  EXPECT_EQ(e - b, 3);  // the first n % workers ranges get one more
  ThreadPool::split(10, 4, 3, &b, &e);
  EXPECT_EQ(b, 8);
  EXPECT_EQ(e, 10);
}

TEST(ThreadPool, FewerItemsThanThreads) {
  ThreadPool pool(8);
  std::atomic<int> calls{0};
  pool.parallel_for(3, [&](int64_t b, int64_t e, int w) {
    EXPECT_EQ(e - b, 1);
    EXPECT_EQ(b, w);
    calls.fetch_add(1);
  });
  EXPECT_EQ(calls.load(), 3);
}

TEST(ThreadPool, SeveralThreadsEachWithTheirOwnPool) {
  // As rank threads in the threads world do: each thread drives its own pool, repeatedly.
  constexpr int kRanks = 3;
  std::vector<std::thread> ranks;
  std::vector<int64_t> sums(kRanks, 0);
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([r, &sums] {
      ThreadPool pool(r + 2);
      for (int iter = 0; iter < 50; ++iter) {
        std::vector<int64_t> partial(size_t(pool.num_threads()), 0);
        pool.parallel_for(1000 + r, [&](int64_t b, int64_t e, int w) {
          for (int64_t i = b; i < e; ++i) partial[size_t(w)] += i;
        });
        int64_t s = 0;
        for (int64_t p : partial) s += p;
        sums[size_t(r)] += s;
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kRanks; ++r) {
    const int64_t n = 1000 + r;
    EXPECT_EQ(sums[size_t(r)], 50 * n * (n - 1) / 2);
  }
}

TEST(ThreadPool, NestedCallsOnAnotherPoolAndOnTheSamePool) {
  ThreadPool outer(3), inner(2);
  std::atomic<int64_t> total{0};
  outer.parallel_for(6, [&](int64_t b, int64_t e, int w) {
    // Another pool from inside a job: a normal parallel call.
    // NOTE: the inner pool runs one job at a time, so outer workers take turns on it.
    inner.parallel_for(10, [&](int64_t ib, int64_t ie, int) { total.fetch_add(ie - ib); });
    // The same pool from inside its own job runs inline under this worker's index.
    outer.parallel_for(5, [&](int64_t ib, int64_t ie, int iw) {
      EXPECT_EQ(ib, 0);
      EXPECT_EQ(ie, 5);
      EXPECT_EQ(iw, w);
      total.fetch_add(ie - ib);
    });
  });
  EXPECT_EQ(total.load(), 3 * 10 + 3 * 5);
}

TEST(ThreadPool, ExceptionsReachTheCallerAfterAllRangesFinish) {
  ThreadPool pool(4);
  for (int thrower : {0, 2}) {
    std::atomic<int> finished{0};
    EXPECT_THROW(pool.parallel_for(8,
                                   [&](int64_t, int64_t, int w) {
                                     if (w == thrower) throw std::runtime_error("boom");
                                     finished.fetch_add(1);
                                   }),
                 std::runtime_error);
    EXPECT_EQ(finished.load(), 3);
  }
  // The pool still works afterwards.
  check_cover(pool, 9, 1);
}

TEST(ThreadPool, GlobalPoolExists) {
  EXPECT_GE(ThreadPool::global().num_threads(), 1);
  check_cover(ThreadPool::global(), 33, 1);
}

}  // namespace
}  // namespace moed
