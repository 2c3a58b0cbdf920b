// Must NOT compile: a Status is dropped on the floor (checked by check_nodiscard.cmake).
#include "tier/status.hpp"

tier::Status might_fail() {
  return tier::invalid_argument("x");
}
tier::Result<int> might_fail_with_value() {
  return 1;
}

int main() {
#ifdef TIER_DROP_STATUS
  might_fail();
#endif
#ifdef TIER_DROP_RESULT
  might_fail_with_value();
#endif
  might_fail().ignore();  // explicitly dropped: allowed
  return might_fail_with_value().ok() ? 0 : 1;
}
