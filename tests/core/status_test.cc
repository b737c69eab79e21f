#include "moed/status.h"

#include <gtest/gtest.h>

namespace moed {
namespace {

StatusOr<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("v = ", v, " is not positive");
  return v;
}

Status use(int v) {
  MOED_ASSIGN_OR_RETURN(int x, parse_positive(v));
  if (x > 10) return invalid_argument("x = ", x, " is above 10");
  return ok_status();
}

TEST(Status, CarriesCodeAndMessage) {
  Status s = use(-3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "v = -3 is not positive");
  EXPECT_EQ(s.to_string(), "INVALID_ARGUMENT: v = -3 is not positive");
  EXPECT_EQ(use(11).message(), "x = 11 is above 10");
  EXPECT_TRUE(use(5).ok());
  EXPECT_EQ(s.with_context("rank 2").message(), "rank 2: v = -3 is not positive");
}

}  // namespace
}  // namespace moed
