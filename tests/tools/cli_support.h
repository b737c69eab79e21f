// Running the built `moed` program from a test, and the .npy inputs the tests write for it
// (shared by cli_test.cc and cli_mpi_test.cc). MOED_CLI_PATH is the program, set by CMake.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "moed/dtype.h"
#include "moed/npy.h"
#include "moed/tensor.h"

namespace moed::cli_test {

struct CliResult {
  int rc = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line; rc is its exit status (-1 when it did not exit normally).
inline CliResult run_command(const std::string& cmd, bool with_stderr = true) {
  CliResult r;
  FILE* p = popen((cmd + (with_stderr ? " 2>&1" : "")).c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// `moed ARGS`.
inline CliResult run_cli(const std::string& args, bool with_stderr = true) {
  return run_command(std::string(MOED_CLI_PATH) + " " + args, with_stderr);
}

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(::testing::TempDir() + "moed_cli_" + name + "_" + std::to_string(::getpid()) + "/") {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& f) const { return path_ + f; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline NpyArray read(const std::string& path) {
  StatusOr<NpyArray> a = read_npy(path);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return a.ok() ? std::move(a).value() : NpyArray{};
}

template <typename T>
std::vector<T> as_vector(const NpyArray& a) {
  std::vector<T> v(a.data.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), a.data.data(), a.data.size());
  return v;
}

inline void save(const std::string& path, NpyDType t, std::initializer_list<int64_t> shape,
                 const void* data) {
  ASSERT_TRUE(write_npy(path, t, shape, data).ok()) << path;
}

// K distinct experts per token, some slots -1; probs in [0.05, 1).
inline void random_topk(int64_t T, int K, int E, uint32_t seed, std::vector<int32_t>& idx,
                        std::vector<float>& probs) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> e(static_cast<size_t>(E));
    for (int i = 0; i < E; ++i) e[size_t(i)] = i;
    std::shuffle(e.begin(), e.end(), rng);
    for (int k = 0; k < K; ++k) {
      const bool none = rng() % 6 == 0;
      idx.push_back(none ? -1 : e[size_t(k)]);
      probs.push_back(none ? 0.0f : u(rng));
    }
  }
}

// What `moed dispatch` reads, as written to dir (x.npy, idx.npy, probs.npy): x [rows, H] f32 or
// bf16 (stored as u16) uniform in [-3, 3) from seed + 1, and random_topk's K experts of E per
// row from seed.
struct DispatchInputs {
  Tensor x;
  std::vector<int32_t> idx;
  std::vector<float> probs;
};
inline DispatchInputs write_dispatch_inputs(const TempDir& dir, DType dtype, int64_t rows,
                                            int64_t H, int K, int E, uint32_t seed) {
  DispatchInputs in;
  random_topk(rows, K, E, seed, in.idx, in.probs);
  in.x = Tensor::empty(dtype, rows, H);
  std::mt19937 rng(seed + 1);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> row(static_cast<size_t>(H));
  for (int64_t i = 0; i < rows; ++i) {
    for (float& v : row) v = u(rng);
    store_row(row.data(), in.x.view().row_ptr(i), dtype, row.size());  // bf16: float_to_bf16
  }
  save(dir / "x.npy", dtype == DType::kF32 ? NpyDType::kF32 : NpyDType::kU16, {rows, H},
       in.x.data());
  save(dir / "idx.npy", NpyDType::kI32, {rows, K}, in.idx.data());
  save(dir / "probs.npy", NpyDType::kF32, {rows, K}, in.probs.data());
  return in;
}

}  // namespace moed::cli_test
