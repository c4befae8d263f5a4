#include "zeroshard/checkpoint/crc32.h"

#include <array>
#include <cstdio>
#include <cstring>

namespace zeroshard {
namespace {

constexpr uint32_t kPolynomial = 0xEDB88320u;  // 0x04C11DB7 bit-reversed

// tables[k][b]: the CRC of byte b followed by k zero bytes, so eight bytes fold in one step
// ("slicing by 8"): checkpoint files are gigabytes, and a byte-at-a-time loop would make
// checksumming slower than the disk.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables makeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (size_t k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
  return t;
}

const Tables& tables() {
  static const Tables t = makeTables();
  return t;
}

} // namespace

uint32_t crc32Update(uint32_t crc, const void* data, size_t size) {
  const Tables& t = tables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (size >= 8) {
    uint32_t lo;
    uint32_t hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian hosts only, as the whole checkpoint format is
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return ~c;
}

std::string crc32Hex(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08x", crc);
  return text;
}

} // namespace zeroshard
