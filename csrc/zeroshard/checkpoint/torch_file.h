// torch.save's file format (a zip archive: data.pkl, the pickle of the object, refers to each
// tensor's storage by key; the bytes of storage <key> are the record data/<key>), written record
// by record: each tensor's bytes go to the file as they arrive and the pickle, which only
// refers to them, comes last. The result is what torch.load(path, weights_only=True) reads as a
// dict of name -> CPU tensor in the dict's order, as torch.save(dict(model.state_dict())) writes
// it; torch::pickle_load reads it from C++.
//
// Note [no storage order record]: torch.save also writes ".format_version" = 1, which promises
// that the records lie in the order the pickle first refers to them, so that torch.load (on the
// meta device, or with calculate_storage_offsets) may compute offsets instead of looking them
// up. The records here lie in the order the tensors became available (stage 3: unit by unit)
// while the dict keeps the model's order, so that record is left out and every reader looks
// each record up in the zip directory, as for files torch wrote before it existed.
#pragma once

#include <ATen/core/Tensor.h>

#include "zeroshard/checkpoint/checked_file.h"
#include "zeroshard/checkpoint/safetensors.h"

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace caffe2::serialize {
class PyTorchStreamWriter;
} // namespace caffe2::serialize

namespace zeroshard {

class TorchFileWriter {
 public:
  // `records`: each distinct tensor (dtype and shape; byte ranges are not used), in the order
  // write() will get them. `dict`: the saved dict's entries in order, each naming the record it
  // holds; several names may share one record (tied weights: torch.load gives them one shared
  // storage, as for a torch.save of them). Creates `path` (truncating a file there).
  TorchFileWriter(const std::string& path, std::vector<TensorEntry> records,
                  std::vector<std::pair<std::string, size_t>> dict);
  ~TorchFileWriter();
  TorchFileWriter(const TorchFileWriter&) = delete;
  TorchFileWriter& operator=(const TorchFileWriter&) = delete;

  // The next record's tensor: any device or layout; its dtype and element count must match.
  void write(const at::Tensor& tensor);
  // Writes the pickle and the archive's directory, flushes the file to disk (fsync) and closes
  // it. Returns the file's size in bytes.
  int64_t finish();

 private:
  void check() const;

  std::string path_;
  std::vector<TensorEntry> records_;
  std::vector<std::pair<std::string, size_t>> dict_;
  size_t next_ = 0;
  CheckedFileWriter file_;
  // The zip writer calls into file_ from C code: a write error is kept here (and the archive
  // told the bytes went out, so it never throws from its destructor) and raised by the caller.
  std::string error_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> zip_;
};

// The pickle (protocol 2) of the dict `dict` names, each a tensor whose storage is the
// record data/<index> of `records` (exposed for the tests).
std::string torchStateDictPickle(const std::vector<TensorEntry>& records,
                                 const std::vector<std::pair<std::string, size_t>>& dict);

} // namespace zeroshard
