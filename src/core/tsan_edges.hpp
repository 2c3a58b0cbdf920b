// Happens-before edges that ThreadSanitizer cannot see by itself. Debian's oneTBB is not built
// with TSan, so the edge from a parallel_for's caller to its workers, and from the workers back
// to the caller when the loop ends, is invisible: every buffer a kernel touched would look raced
// by the next thread to use it (a pread into an optimizer buffer, say), and TSan, reporting or
// suppressing a race for each 8 bytes of a megabyte buffer, slows to a crawl. A loop names the
// two edges here; outside a TSan build these are empty inline functions.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define TIER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TIER_TSAN 1
#endif
#endif

#ifdef TIER_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace tier::detail {

// What the calling thread did before this is visible to a thread that then calls
// tsan_acquire(token).
inline void tsan_release([[maybe_unused]] void* token) noexcept {
#ifdef TIER_TSAN
  __tsan_release(token);
#endif
}

inline void tsan_acquire([[maybe_unused]] void* token) noexcept {
#ifdef TIER_TSAN
  __tsan_acquire(token);
#endif
}

// One parallel loop's two edges: the caller's work before the loop happens before every
// worker's body (start / enter), and every body happens before the caller's work after the loop
// (leave / finish). Releases into one token merge, so many workers can leave through it.
class ForkJoinEdges {
 public:
  ForkJoinEdges() noexcept { tsan_release(&fork_); }
  void enter() noexcept { tsan_acquire(&fork_); }
  void leave() noexcept { tsan_release(&join_); }
  void finish() noexcept { tsan_acquire(&join_); }

 private:
  char fork_ = 0;
  char join_ = 0;
};

}  // namespace tier::detail
