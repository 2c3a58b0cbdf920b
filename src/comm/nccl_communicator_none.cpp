// Built without NCCL (TIER_WITH_NCCL=OFF): the NCCL entry points say so.
#include "comm/comm_impl.hpp"
#include "tier/comm.hpp"

namespace tier {
namespace {

Status no_nccl(const char* who) {
  return unsupported(str(who,
                         ": this tier was built without NCCL; configure with -DTIER_WITH_CUDA=ON -DTIER_WITH_NCCL=ON "
                         "where the CUDA toolkit and NCCL (nccl.h) are installed, or use make_callback_communicator "
                         "with the framework's own collectives"));
}

}  // namespace

Status nccl_available() {
  return no_nccl("NCCL");
}

Result<NcclUniqueId> make_nccl_unique_id() {
  return no_nccl("make_nccl_unique_id");
}

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options) {
  TIER_RETURN_IF_ERROR(detail::check_rank_world("make_nccl_communicator", options.rank, options.world));
  return no_nccl("make_nccl_communicator");
}

}  // namespace tier
