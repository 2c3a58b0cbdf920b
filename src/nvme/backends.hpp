// The backend factories behind make_io_engine(). Each returns kUnsupported, with the reason, when
// its backend cannot run here.
#pragma once

#include <memory>

#include "tier/ext/io_engine.hpp"

namespace tier::nvme::detail {

Result<std::unique_ptr<IoEngine>> make_uring_engine(const IoEngineOptions& options);
Result<std::unique_ptr<IoEngine>> make_aio_engine(const IoEngineOptions& options);
Result<std::unique_ptr<IoEngine>> make_posix_engine(const IoEngineOptions& options);

// Checks a request's shape (length, buffer); returns 0 or the errno to complete it with.
int check_request(const IoRequest& r) noexcept;

}  // namespace tier::nvme::detail
