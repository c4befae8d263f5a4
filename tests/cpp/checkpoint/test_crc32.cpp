#include "catch.h"

#include "zeroshard/checkpoint/crc32.h"

#include <string>
#include <vector>

using zeroshard::crc32Update;

TEST_CASE("CRC-32 gives the standard check value and zlib's results", "[crc32]") {
  const std::string check = "123456789";
  CHECK(crc32Update(0, check.data(), check.size()) == 0xCBF43926u);  // the CRC-32/ISO-HDLC check value
  CHECK(crc32Update(0, "", 0) == 0u);
  const std::string fox = "The quick brown fox jumps over the lazy dog";
  CHECK(crc32Update(0, fox.data(), fox.size()) == 0x414FA339u);  // zlib.crc32 of the same bytes
}

TEST_CASE("CRC-32 continued over pieces equals the CRC of the whole, at every split", "[crc32]") {
  std::vector<unsigned char> bytes(100);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 37 + 11);
  const uint32_t whole = crc32Update(0, bytes.data(), bytes.size());
  for (size_t split = 0; split <= bytes.size(); ++split) {
    const uint32_t head = crc32Update(0, bytes.data(), split);
    CHECK(crc32Update(head, bytes.data() + split, bytes.size() - split) == whole);
  }
  bytes[50] ^= 1;
  CHECK(crc32Update(0, bytes.data(), bytes.size()) != whole);
}
