#pragma once

// Untrusted JSON (configs, checkpoint manifests, safetensors headers, index files): parsed with a
// bound on its nesting, and quoted in messages only as valid UTF-8.
//
// Note [JSON nesting bound]: nlohmann's parser keeps its own stack, but dump() recurses once per
// level, so a few hundred kilobytes of '[' in a damaged or hostile file would exhaust the stack
// (a crash, not an error) the first time a message or a checksum dumps the value. No file
// zeroshard reads nests more than a handful of levels (a manifest holding a config: 7), so
// anything deeper than kMaxJsonNesting is refused while parsing, before the value exists.

#include <cstdint>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace zeroshard {

constexpr int kMaxJsonNesting = 64;

class JsonTooDeep : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline std::string jsonTooDeepMessage() {
  return "JSON nested more than " + std::to_string(kMaxJsonNesting) + " levels deep";
}

// Whether a parse event opens an object or array at `depth` (the containers already open)
// past the bound.
inline bool opensTooDeep(int depth, nlohmann::json::parse_event_t event) {
  using Event = nlohmann::json::parse_event_t;
  return (event == Event::object_start || event == Event::array_start) && depth >= kMaxJsonNesting;
}

// Json::parse(text), throwing JsonTooDeep past kMaxJsonNesting levels and nlohmann's exceptions
// for text that is not JSON.
template <typename Json>
Json parseNestingBounded(const std::string& text) {
  return Json::parse(text, [](int depth, nlohmann::json::parse_event_t event, Json& /*parsed*/) {
    if (opensTooDeep(depth, event)) throw JsonTooDeep(jsonTooDeepMessage());
    return true;
  });
}

// `text` with every byte that is not part of a well-formed UTF-8 character replaced by '?'.
// Parser messages quote the bytes they stopped at ("last read: ..."), which may be half a
// character or not text at all; Python builds its exceptions from UTF-8 and would raise a
// UnicodeDecodeError in place of the error that names the file or key.
inline std::string validUtf8(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    size_t length = byte < 0x80 ? 1 : (byte >> 5) == 0x6 ? 2 : (byte >> 4) == 0xE ? 3 : (byte >> 3) == 0x1E ? 4 : 0;
    // Overlong forms, surrogates and code points past U+10FFFF are not well-formed either.
    uint32_t code = length == 1 ? byte : length == 2 ? byte & 0x1F : length == 3 ? byte & 0x0F : byte & 0x07;
    bool ok = length > 0 && i + length <= text.size();
    for (size_t k = 1; ok && k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      ok = (next & 0xC0) == 0x80;
      code = (code << 6) | (next & 0x3F);
    }
    constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && code >= kSmallest[length] && code <= 0x10FFFF && !(code >= 0xD800 && code <= 0xDFFF);
    if (ok) {
      out.append(text, i, length);
      i += length;
    } else {
      out.push_back('?');
      ++i;
    }
  }
  return out;
}

// validUtf8(text), cut to at most `limit` bytes at a character boundary (a UTF-8 continuation
// byte, 10xxxxxx, does not start one), with "..." when cut.
inline std::string shortText(const std::string& text, size_t limit) {
  std::string valid = validUtf8(text);
  if (valid.size() <= limit) return valid;
  size_t cut = limit > 3 ? limit - 3 : 0;
  while (cut > 0 && (static_cast<unsigned char>(valid[cut]) & 0xC0) == 0x80) --cut;
  valid.resize(cut);
  valid += "...";
  return valid;
}

}  // namespace zeroshard
