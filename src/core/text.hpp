// Internal string helpers shared by the core modules.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tier::detail {

std::string lower(std::string_view s);
std::string trim(std::string_view s);
// Replaces control and non-ASCII bytes with \xNN so that a message can quote untrusted text.
std::string printable(std::string_view s);
// Levenshtein distance, for "did you mean" suggestions.
std::size_t edit_distance(std::string_view a, std::string_view b);
// Words longer than this get no suggestion (no key is nearly this long).
inline constexpr std::size_t kMaxMatchedWord = 256;
// The candidate closest to `word` when it is close enough to be a likely typo, else empty. Work
// is bounded: words over kMaxMatchedWord and candidates whose length alone rules them out are
// skipped.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace tier::detail
