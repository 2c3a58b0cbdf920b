// What every communicator shares: names, argument checks and the gradient-norm reduction.
#include "comm/comm_impl.hpp"
#include "tier/comm.hpp"

namespace tier {

const char* reduce_op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

Status CommunicatorNorm::all_reduce_sumsq(double& sumsq) {
  // NaN and inf survive the sum, so an overflow on any rank reaches every rank.
  return comm_.all_reduce(&sumsq, 1, DType::kF64, ReduceOp::kSum)
      .with_context(str("gradient norm across ", comm_.world(), " ranks (", comm_.name(), ")"));
}

namespace detail {

Status check_rank_world(const char* who, int rank, int world) {
  if (world < 1) return invalid_argument(str(who, ": world ", world, " must be at least 1"));
  if (rank < 0 || rank >= world) {
    return invalid_argument(str(who, ": rank ", rank, " is outside [0, ", world, ")"));
  }
  return Status::Ok();
}

}  // namespace detail
}  // namespace tier
