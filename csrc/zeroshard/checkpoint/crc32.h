// CRC-32 (the IEEE 802.3 polynomial, reflected), the checksum zlib.crc32 and `cksum -a crc32b`
// compute, so a checkpoint's files can be checked with standard tools too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroshard {

// Continues `crc` (0 to start) over `size` bytes at `data`.
uint32_t crc32Update(uint32_t crc, const void* data, size_t size);
// As 8 lowercase hex digits, the way manifests and messages show it.
std::string crc32Hex(uint32_t crc);

} // namespace zeroshard
