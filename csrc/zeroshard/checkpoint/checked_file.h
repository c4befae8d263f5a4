// Files that carry a CRC-32 per fixed-size chunk, written durably and read back with every
// byte checked.
//
// Note [chunk checksums]: a checkpoint's files are read in slices (a rank loading at another
// world size needs only parts of other ranks' files), so one checksum over a whole file would
// force every reader to read every byte. A CRC per 4 MiB chunk lets a reader check exactly the
// chunks it touches, and still catches any flipped byte in them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

// What a checkpoint's manifest records about one file.
struct FileDigest {
  std::string name;  // relative to the checkpoint directory
  int64_t bytes = 0;
  int64_t chunkBytes = 0;
  std::vector<uint32_t> chunkCrcs;
};

constexpr int64_t kChecksumChunkBytes = int64_t{4} << 20;

// Writes a new file (truncating one at `path`), checksumming as it goes. Blocking.
class CheckedFileWriter {
 public:
  explicit CheckedFileWriter(std::string path, int64_t chunkBytes = kChecksumChunkBytes);
  ~CheckedFileWriter();
  CheckedFileWriter(const CheckedFileWriter&) = delete;
  CheckedFileWriter& operator=(const CheckedFileWriter&) = delete;

  void write(const void* data, size_t size);
  // Flushes the file to disk (fsync) and closes it. `name` is what the digest calls it.
  FileDigest finish(const std::string& name);

 private:
  std::string path_;
  int fd_ = -1;
  FileDigest digest_;
  uint32_t chunkCrc_ = 0;
  int64_t chunkFill_ = 0;
};

// Reads ranges of a file written by CheckedFileWriter, checking each chunk it touches against
// `expected` (and the file's size first: a truncated file is an error before any read).
class CheckedFileReader {
 public:
  CheckedFileReader(std::string path, FileDigest expected);
  ~CheckedFileReader();
  CheckedFileReader(const CheckedFileReader&) = delete;
  CheckedFileReader& operator=(const CheckedFileReader&) = delete;

  // Copies bytes [offset, offset + size) into `out`. Throws naming the file and byte range on
  // a checksum mismatch or a short read.
  void read(int64_t offset, int64_t size, void* out);
  const std::string& path() const { return path_; }
  int64_t size() const { return expected_.bytes; }

 private:
  const std::vector<char>& chunk(int64_t index);

  std::string path_;
  FileDigest expected_;
  int fd_ = -1;
  int64_t cachedIndex_ = -1;  // the last chunk read and checked, kept for neighbouring reads
  std::vector<char> cached_;
};

// Writes `bytes` to `path` through CheckedFileWriter (for small files: manifests, client state).
FileDigest writeCheckedFile(const std::string& path, const std::string& name, const std::string& bytes);
// The whole file, checked.
std::string readCheckedFile(const std::string& path, const FileDigest& expected);
// Makes a directory's entries (new files, renames) durable.
void syncDirectory(const std::string& path);

} // namespace zeroshard
