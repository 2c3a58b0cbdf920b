#include "tier/status.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>

namespace tier {
namespace {

TEST(Status, DefaultIsOkAndCarriesNothing) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.sys_errno(), 0);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(Status, ErrorKeepsCodeErrnoAndMessage) {
  Status s(StatusCode::kIoError, "swap file /x: read failed", EIO);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_EQ(s.to_string(), "io_error (EIO): swap file /x: read failed");
}

TEST(Status, NegativeErrnoIsStoredPositive) {
  Status s(StatusCode::kIoError, "x", -ENOSPC);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
}

TEST(Status, OkCodeWithMessageIsStillOk) {
  Status s(StatusCode::kOk, "nothing wrong");
  EXPECT_TRUE(s.ok());
}

TEST(Status, WithContextPrefixesTheMessage) {
  Status s = invalid_argument("bad size").with_context("tensor 'w'");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tensor 'w': bad size");
  EXPECT_TRUE(Status().with_context("ignored").ok());
}

TEST(Status, ErrnoStatusPicksTheCode) {
  EXPECT_EQ(errno_status(ENOSPC, "w").code(), StatusCode::kNoSpace);
  EXPECT_EQ(errno_status(-ENOSPC, "w").code(), StatusCode::kNoSpace);
  EXPECT_EQ(errno_status(EDQUOT, "w").code(), StatusCode::kNoSpace);
  EXPECT_EQ(errno_status(EIO, "r").code(), StatusCode::kIoError);
  EXPECT_EQ(errno_status(EINVAL, "r").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(errno_status(ENOENT, "r").code(), StatusCode::kNotFound);
  EXPECT_EQ(errno_status(ETIMEDOUT, "r").code(), StatusCode::kTimedOut);
  EXPECT_EQ(errno_status(EOPNOTSUPP, "r").code(), StatusCode::kUnsupported);
  EXPECT_EQ(errno_status(EACCES, "r").code(), StatusCode::kFailedPrecondition);
  Status s = errno_status(EIO, "swap file /x");
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_NE(s.message().find("swap file /x: "), std::string::npos);
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos);
}

TEST(Status, CopiesShareAndCompareEqual) {
  Status a = not_found("tensor 'x'");
  Status b = a;
  EXPECT_EQ(a, b);
  EXPECT_FALSE(a == not_found("tensor 'y'"));
}

TEST(Status, EveryCodeHasAName) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    EXPECT_STRNE(status_code_name(static_cast<StatusCode>(c)), "unknown") << c;
  }
}

Result<int> half(int x) {
  if (x % 2) return invalid_argument(str(x, " is odd"));
  return x / 2;
}

Result<int> quarter(int x) {
  TIER_ASSIGN_OR_RETURN(int h, half(x));
  TIER_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

Status check_even(int x) {
  TIER_RETURN_IF_ERROR(half(x).status());
  return Status::Ok();
}

TEST(Result, HoldsValueOrError) {
  Result<int> r = half(8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 4);
  EXPECT_TRUE(r.status().ok());
  Result<int> e = half(3);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.status().message(), "3 is odd");
  EXPECT_EQ(e.value_or(-1), -1);
}

TEST(Result, MacrosPropagateErrors) {
  EXPECT_EQ(*quarter(8), 2);
  Result<int> e = quarter(6);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().message(), "3 is odd");
  EXPECT_TRUE(check_even(2).ok());
  EXPECT_FALSE(check_even(5).ok());
}

TEST(Result, OkStatusWithoutValueBecomesInternalError) {
  Result<int> r{Status::Ok()};
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Result, HoldsMoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  Result<int> e = half(3);
  EXPECT_DEATH((void)e.value(), "3 is odd");
}

}  // namespace
}  // namespace tier
