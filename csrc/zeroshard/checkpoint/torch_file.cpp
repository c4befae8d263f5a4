#include "zeroshard/checkpoint/torch_file.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <limits>

namespace zeroshard {
namespace {

// The legacy storage class torch.save names for a dtype (torch.load takes the dtype from it).
const char* storageClassOf(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "FloatStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kHalf: return "HalfStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kByte: return "ByteStorage";
    case at::kBool: return "BoolStorage";
    default: TORCH_CHECK(false, "zeroshard: dtype ", dtype, " cannot be saved in a torch file");
  }
}

// The few pickle opcodes a state dict needs, all of which torch.load(weights_only=True) reads.
class Pickle {
 public:
  Pickle() { out_ += "\x80\x02"; }  // PROTO 2
  void global(const char* module, const char* name) {
    out_ += 'c';
    out_ += module;
    out_ += '\n';
    out_ += name;
    out_ += '\n';
  }
  void text(const std::string& s) {
    out_ += 'X';  // BINUNICODE
    littleEndian(static_cast<uint64_t>(s.size()), 4);
    out_ += s;
  }
  void integer(int64_t v) {
    if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
      out_ += 'J';  // BININT
      littleEndian(static_cast<uint64_t>(v), 4);
    } else {
      out_ += '\x8a';  // LONG1: 8 bytes of two's complement
      out_ += '\x08';
      littleEndian(static_cast<uint64_t>(v), 8);
    }
  }
  void mark() { out_ += '('; }
  void tuple() { out_ += 't'; }
  void emptyTuple() { out_ += ')'; }
  void reduce() { out_ += 'R'; }
  void persistentId() { out_ += 'Q'; }  // BINPERSID
  void newFalse() { out_ += '\x89'; }
  void setItems() { out_ += 'u'; }
  void emptyDict() { out_ += '}'; }
  void orderedDict() {
    global("collections", "OrderedDict");
    emptyTuple();
    reduce();
  }
  std::string finish() {
    out_ += '.';  // STOP
    return std::move(out_);
  }

 private:
  void littleEndian(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  std::string out_;
};

const char kEmptyRecord = 0;  // a valid pointer for records of no bytes

} // namespace

std::string torchStateDictPickle(const std::vector<TensorEntry>& records,
                                 const std::vector<std::pair<std::string, size_t>>& dict) {
  Pickle p;
  // A plain dict (ordered, as every dict since Python 3.7), not the OrderedDict of a
  // state_dict(): torch's C++ unpickler (torch::pickle_load) reads an OrderedDict as None.
  p.emptyDict();
  p.mark();
  for (const auto& [name, index] : dict) {
    TORCH_CHECK(index < records.size(), "zeroshard: '", name, "' refers to record ", index, " of ", records.size());
    const TensorEntry& r = records[index];
    p.text(name);
    // torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks), as a
    // torch.save of a contiguous CPU tensor pickles it.
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.mark();
    p.mark();
    p.text("storage");
    p.global("torch", storageClassOf(r.dtype));
    p.text(std::to_string(index));
    p.text("cpu");
    p.integer(r.numel());
    p.tuple();
    p.persistentId();
    p.integer(0);
    p.mark();
    for (int64_t size : r.shape) p.integer(size);
    p.tuple();
    p.mark();
    int64_t stride = 1;
    std::vector<int64_t> strides(r.shape.size());
    for (size_t d = r.shape.size(); d-- > 0;) {
      strides[d] = stride;
      stride *= r.shape[d];
    }
    for (int64_t s : strides) p.integer(s);
    p.tuple();
    p.newFalse();
    p.orderedDict();  // backward hooks: none
    p.tuple();
    p.reduce();
  }
  p.setItems();
  return p.finish();
}

TorchFileWriter::TorchFileWriter(const std::string& path, std::vector<TensorEntry> records,
                                 std::vector<std::pair<std::string, size_t>> dict)
    : path_(path), records_(std::move(records)), dict_(std::move(dict)), file_(path) {
  for (const auto& [name, index] : dict_) {
    TORCH_CHECK(index < records_.size(), "zeroshard: '", name, "' refers to record ", index, " of ",
                records_.size(), " in '", path_, "'");
    storageClassOf(records_[index].dtype);  // an unsupported dtype fails before any data
  }
  zip_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>([this](const void* data, size_t size) -> size_t {
    if (!error_.empty()) return size;
    try {
      file_.write(data, size);
    } catch (const c10::Error& e) {
      error_ = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error_ = e.what();
    }
    return size;
  });
}

TorchFileWriter::~TorchFileWriter() = default;

void TorchFileWriter::check() const {
  TORCH_CHECK(error_.empty(), error_);
}

void TorchFileWriter::write(const at::Tensor& tensor) {
  TORCH_CHECK(next_ < records_.size(), "zeroshard: more tensors than the ", records_.size(), " announced for '",
              path_, "'");
  const size_t index = next_++;
  const TensorEntry& r = records_[index];
  TORCH_CHECK(tensor.scalar_type() == r.dtype && tensor.numel() == r.numel(), "zeroshard: tensor '", r.name,
              "' is ", tensor.scalar_type(), " with ", tensor.numel(), " elements, the file announced ", r.dtype,
              " with ", r.numel());
  const at::Tensor cpu = tensor.device().is_cpu() ? tensor.contiguous() : tensor.to(at::kCPU).contiguous();
  const size_t bytes = cpu.nbytes();
  zip_->writeRecord("data/" + std::to_string(index), bytes > 0 ? cpu.data_ptr() : &kEmptyRecord, bytes);
  check();
}

int64_t TorchFileWriter::finish() {
  TORCH_CHECK(next_ == records_.size(), "zeroshard: '", path_, "' got ", next_, " of the ", records_.size(),
              " tensors it announced");
  const std::string pickle = torchStateDictPickle(records_, dict_);
  zip_->writeRecord("data.pkl", pickle.data(), pickle.size());
  // Note [no storage order record]: no ".format_version".
  const std::string byteorder = "little";
  zip_->writeRecord("byteorder", byteorder.data(), byteorder.size());
  zip_->writeEndOfFile();
  check();
  return file_.finish(path_).bytes;
}

} // namespace zeroshard
