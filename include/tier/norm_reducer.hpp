// tier/norm_reducer.hpp — the gradient norm across data-parallel ranks, as an interface of the
// optimizer's step (optim::StepOptions::norm). tier::CommunicatorNorm (tier/comm.hpp) is the one
// over a tier::Communicator.
#pragma once

#include "tier/status.hpp"

namespace tier::optim {

// Data-parallel ranks that each own part of the state: combines this rank's sum of squares of its
// gradients with every other rank's (an all-reduce sum), so that clipping and the overflow check
// use the global norm and every rank takes the same decision (inf and nan propagate through the
// sum). Called once per step, before anything is updated; every rank must step for it to return.
// An error fails the step with nothing changed.
class NormReducer {
 public:
  virtual ~NormReducer() = default;
  virtual Status all_reduce_sumsq(double& sumsq) = 0;
};

}  // namespace tier::optim
