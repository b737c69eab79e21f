// Shared by the routing tests: the check of an invalid-argument status, and a router config of
// a given expert count and K.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "moed/router.h"
#include "moed/status.h"

namespace moed::routing_test {

inline void expect_invalid(const Status& s, const std::string& message) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.message(), message);
}

// E experts, top-K, every other field at its default.
inline RouterConfig router_config(int num_experts, int num_topk) {
  RouterConfig c;
  c.num_experts = num_experts;
  c.num_topk = num_topk;
  return c;
}

}  // namespace moed::routing_test
