#include "catch.h"

#include "error_text.h"
#include "temp_dir.h"
#include "zeroshard/checkpoint/checked_file.h"

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/resource.h>

using zeroshard::CheckedFileReader;
using zeroshard::CheckedFileWriter;
using zeroshard::FileDigest;
using zeroshard::testing::TempDir;
using zeroshard::testing::contains;
using zeroshard::testing::errorText;

namespace {

std::string pattern(size_t size) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>('a' + i % 23);
  return bytes;
}

FileDigest writeInPieces(const std::string& path, const std::string& bytes, int64_t chunk) {
  CheckedFileWriter writer(path, chunk);
  // Uneven pieces, so chunk boundaries fall inside writes.
  for (size_t at = 0, piece = 1; at < bytes.size(); at += piece, piece = piece * 3 % 17 + 1) {
    writer.write(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  return writer.finish("data.bin");
}

} // namespace

TEST_CASE("a checked file records one CRC per chunk and reads back any range", "[checked_file]") {
  TempDir dir;
  const std::string bytes = pattern(1000);
  const FileDigest digest = writeInPieces(dir / "data.bin", bytes, 64);
  CHECK(digest.name == "data.bin");
  CHECK(digest.bytes == 1000);
  CHECK(digest.chunkCrcs.size() == 16);  // 15 full chunks of 64 and one of 40
  CHECK(std::filesystem::file_size(dir / "data.bin") == 1000);

  CheckedFileReader reader(dir / "data.bin", digest);
  for (int64_t begin : {0, 1, 63, 64, 500, 999}) {
    for (int64_t size : {0, 1, 65, 200}) {
      if (begin + size > 1000) continue;
      std::string out(static_cast<size_t>(size), '\0');
      reader.read(begin, size, out.data());
      CHECK(out == bytes.substr(static_cast<size_t>(begin), static_cast<size_t>(size)));
    }
  }
}

TEST_CASE("a flipped byte fails only reads of its chunk, naming the file and byte range", "[checked_file]") {
  TempDir dir;
  const std::string bytes = pattern(300);
  const FileDigest digest = writeInPieces(dir / "data.bin", bytes, 100);
  {
    std::fstream f(dir / "data.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(150);
    f.put('!');
  }
  CheckedFileReader reader(dir / "data.bin", digest);
  std::string out(50, '\0');
  reader.read(0, 50, out.data());  // chunk 0 is intact
  reader.read(250, 50, out.data());
  const std::string error = errorText([&] { reader.read(120, 10, out.data()); });
  CHECK(error.find("checksum mismatch in '" + dir / "data.bin" + "' bytes [100, 200)") != std::string::npos);
}

TEST_CASE("a truncated or missing file is an error before any read", "[checked_file]") {
  TempDir dir;
  const FileDigest digest = writeInPieces(dir / "data.bin", pattern(300), 100);
  std::filesystem::resize_file(dir / "data.bin", 250);
  const std::string truncated = errorText([&] { CheckedFileReader(dir / "data.bin", digest); });
  CHECK(truncated.find("has 250 bytes but the manifest records 300 (truncated)") != std::string::npos);
  std::filesystem::remove(dir / "data.bin");
  const std::string missing = errorText([&] { CheckedFileReader(dir / "data.bin", digest); });
  CHECK(missing.find("'" + dir / "data.bin" + "' is missing") != std::string::npos);
}

TEST_CASE("a write past the file size limit names the file, the error and the free space", "[checked_file]") {
  // RLIMIT_FSIZE makes write() fail with EFBIG, a real write failure as a full disk's ENOSPC
  // (whose text the same code adds to: tests/python/test_full_disk.py fills a tmpfs).
  TempDir dir;
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = saved;
  limited.rlim_cur = 100;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limited) == 0);
  const std::string error = errorText([&] { writeInPieces(dir / "data.bin", pattern(300), 64); });
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous);
  CHECK(contains(error, "writing '" + dir / "data.bin" + "' failed after 100 bytes: File too large ("));
  CHECK(contains(error, "(the file system of '" + dir.path().string() + "' has "));
  CHECK(contains(error, " free); the file is past"));
  CHECK(contains(error, "file size limit (ulimit -f)"));
}
