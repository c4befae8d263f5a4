#include "zeroshard/checkpoint/manifest.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <unordered_set>

#include "zeroshard/checkpoint/crc32.h"
#include "zeroshard/checkpoint/safetensors.h"
#include "zeroshard/config/json_input.h"

namespace zeroshard {
namespace {

using Json = nlohmann::ordered_json;

uint32_t fromHex(const std::string& text) {
  TORCH_CHECK(text.size() == 8 && text.find_first_not_of("0123456789abcdef") == std::string::npos,
              "'", text, "' is not an 8-digit CRC-32");
  return static_cast<uint32_t>(std::stoul(text, nullptr, 16));
}

Json hyperJson(const AdamWHyper& h) {
  return {{"lr", h.lr}, {"betas", {h.beta1, h.beta2}}, {"eps", h.eps}, {"weight_decay", h.weightDecay}};
}

Json fileJson(const FileDigest& f) {
  Json crcs = Json::array();
  for (uint32_t c : f.chunkCrcs) crcs.push_back(crc32Hex(c));
  return {{"name", f.name}, {"bytes", f.bytes}, {"chunk_bytes", f.chunkBytes}, {"chunk_crc32", crcs}};
}

// Note [manifest values checked]: a manifest passed its checksum, but it is still a file: one
// written by a bug, edited by hand or made to match its checksum. Every number is read as a
// whole number in its range (nlohmann's get<int> would truncate a larger one, and converting a
// float out of range is undefined), every shape's element count is computed without overflow,
// and every size is held to the sizes it must fit, so that a bad value is an error naming its
// key, never a division by zero, a wrapped offset or an allocation of what a file claims.
// CheckpointReader then holds the sizes to the files on disk (Note [claims backed by files]).
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

int64_t wholeValue(const Json& v, const std::string& name, int64_t min, int64_t max) {
  const bool whole = v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(kInt64Max));
  const int64_t x = whole ? v.get<int64_t>() : 0;
  TORCH_CHECK(whole && x >= min && x <= max, name, " is ", shortText(v.dump(), 40),
              ", not a whole number in [", min, ", ", max, "]");
  return x;
}

int64_t wholeNumber(const Json& j, const std::string& path, const char* key, int64_t min, int64_t max) {
  return wholeValue(j.at(key), path + key, min, max);
}

int wholeInt(const Json& j, const std::string& path, const char* key, int min, int max) {
  return static_cast<int>(wholeNumber(j, path, key, min, max));
}

// A shape's dimensions (each >= 0) and its element count, at most `limit`.
std::vector<int64_t> checkedShape(const Json& j, const std::string& path, int64_t limit, int64_t& numel) {
  const Json& shape = j.at("shape");
  TORCH_CHECK(shape.is_array(), path, "shape is not an array");
  std::vector<int64_t> dims;
  numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = wholeValue(shape[i], path + "shape[" + std::to_string(i) + "]", 0, kInt64Max);
    dims.push_back(d);
    TORCH_CHECK(d == 0 || numel <= limit / d, path, "shape ", shortText(shape.dump(), 60),
                " holds more than the ", limit, " elements it may");
    numel *= d;
  }
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) numel = 0;
  return dims;
}

FileDigest fileFromJson(const Json& f, const std::string& path) {
  FileDigest d;
  d.name = f.at("name").get<std::string>();
  d.bytes = wholeNumber(f, path, "bytes", 0, kInt64Max);
  d.chunkBytes = wholeNumber(f, path, "chunk_bytes", 1, kInt64Max);
  const Json& crcs = f.at("chunk_crc32");
  TORCH_CHECK(crcs.is_array() && crcs.size() == static_cast<size_t>(d.bytes / d.chunkBytes + (d.bytes % d.chunkBytes != 0)),
              path, "chunk_crc32 does not hold one checksum per chunk_bytes of the file's bytes");
  for (const auto& c : crcs) d.chunkCrcs.push_back(fromHex(c.get<std::string>()));
  return d;
}

// The body, so that its CRC can be computed over exactly the text that is written.
Json bodyJson(const CheckpointManifest& m) {
  Json j;
  j["format"] = "zeroshard-checkpoint";
  j["format_version"] = m.formatVersion;
  j["tag"] = m.tag;
  j["world_size"] = m.worldSize;
  j["stage"] = m.stage;
  j["compute_dtype"] = dtypeName(m.computeDtype);
  j["global_steps"] = m.globalSteps;
  j["boundaries"] = m.boundaries;
  j["skipped_steps"] = m.skippedSteps;
  j["created_unix_ns"] = m.createdUnixNs;
  if (m.lossScaler) {
    const auto& s = *m.lossScaler;
    j["loss_scaler"] = {{"scale", s.scale}, {"hysteresis_left", s.hysteresisLeft}, {"iteration", s.iteration},
                        {"last_overflow_iteration", s.lastOverflowIteration}};
  } else {
    j["loss_scaler"] = nullptr;
  }
  if (m.batch) {
    j["batch"] = {{"train_batch_size", m.batch->train},
                  {"train_micro_batch_size_per_gpu", m.batch->microPerRank},
                  {"gradient_accumulation_steps", m.batch->accumulationSteps},
                  {"world_size", m.batch->worldSize}};
  }
  if (m.lrSchedule) {
    j["lr_scheduler"] = {{"type", m.lrSchedule->type}, {"last_batch_iteration", m.lrSchedule->lastBatchIteration}};
  } else {
    j["lr_scheduler"] = nullptr;
  }
  j["config"] = Json::parse(m.configJson);
  j["param_groups"] = Json::array();
  for (const auto& g : m.groups) j["param_groups"].push_back(hyperJson(g));
  j["buffers"] = Json::array();
  for (const auto& b : m.buffers) j["buffers"].push_back({{"numel", b.numel}, {"shard_numel", b.shardNumel}});
  j["params"] = Json::array();
  for (const auto& p : m.params) {
    // "dtype" is the model's (the compute dtype); the saved values are the fp32 master weights.
    j["params"].push_back({{"name", p.name}, {"shape", p.shape}, {"dtype", dtypeName(m.computeDtype)},
                           {"group", p.group}, {"buffer", p.buffer}, {"offset", p.offset}});
  }
  j["aliases"] = Json::object();
  for (const auto& [alias, target] : m.aliases) j["aliases"][alias] = target;
  j["module_state"] = Json::array();
  for (const auto& t : m.moduleState) {
    j["module_state"].push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", dtypeName(t.dtype)}});
  }
  j["state_dict_keys"] = m.stateDictKeys;
  if (m.frozenExcluded) j["frozen_excluded"] = true;
  j["files"] = Json::array();
  for (const auto& f : m.files) j["files"].push_back(fileJson(f));
  return j;
}

// "name[i]." for messages.
std::string item(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "].";
}

CheckpointManifest fromBody(const Json& j) {
  CheckpointManifest m;
  TORCH_CHECK(j.at("format").get<std::string>() == "zeroshard-checkpoint", "not a zeroshard checkpoint manifest");
  m.formatVersion = wholeInt(j, "", "format_version", 0, std::numeric_limits<int>::max());
  TORCH_CHECK(m.formatVersion == kCheckpointFormatVersion, "format_version ", m.formatVersion,
              " is not one this zeroshard reads (", kCheckpointFormatVersion, ")");
  m.tag = j.at("tag").get<std::string>();
  // A checkpoint names one rank file per saving rank; more than this is not a checkpoint.
  m.worldSize = wholeInt(j, "", "world_size", 1, 1 << 20);
  m.stage = wholeInt(j, "", "stage", 0, 3);
  m.computeDtype = dtypeFromName(j.at("compute_dtype").get<std::string>());
  m.globalSteps = wholeNumber(j, "", "global_steps", 0, kInt64Max);
  m.boundaries = wholeNumber(j, "", "boundaries", 0, kInt64Max);
  m.skippedSteps = wholeNumber(j, "", "skipped_steps", 0, kInt64Max);
  m.createdUnixNs = wholeNumber(j, "", "created_unix_ns", std::numeric_limits<int64_t>::min(), kInt64Max);
  if (!j.at("loss_scaler").is_null()) {
    const auto& s = j.at("loss_scaler");
    const std::string p = "loss_scaler.";
    m.lossScaler = LossScaler::State{s.at("scale").get<double>(), wholeNumber(s, p, "hysteresis_left", 0, kInt64Max),
                                     wholeNumber(s, p, "iteration", 0, kInt64Max),
                                     wholeNumber(s, p, "last_overflow_iteration", -1, kInt64Max)};
  }
  // Checkpoints written before the batch was recorded have no "batch".
  if (j.contains("batch") && !j.at("batch").is_null()) {
    const auto& b = j.at("batch");
    const std::string p = "batch.";
    m.batch = SavedBatch{wholeNumber(b, p, "train_batch_size", 1, kInt64Max),
                         wholeNumber(b, p, "train_micro_batch_size_per_gpu", 1, kInt64Max),
                         wholeNumber(b, p, "gradient_accumulation_steps", 1, kInt64Max),
                         wholeInt(b, p, "world_size", 1, std::numeric_limits<int>::max())};
    int64_t product = 0;
    const bool overflow = __builtin_mul_overflow(m.batch->microPerRank, m.batch->accumulationSteps, &product) ||
                          __builtin_mul_overflow(product, int64_t{m.batch->worldSize}, &product);
    TORCH_CHECK(!overflow && m.batch->train == product, "batch: train_batch_size ", m.batch->train,
                " is not train_micro_batch_size_per_gpu ", m.batch->microPerRank, " x gradient_accumulation_steps ",
                m.batch->accumulationSteps, " x world_size ", m.batch->worldSize);
  }
  // Checkpoints written before schedules were saved have no "lr_scheduler".
  if (j.contains("lr_scheduler") && !j.at("lr_scheduler").is_null()) {
    const auto& s = j.at("lr_scheduler");
    m.lrSchedule = SavedSchedule{s.at("type").get<std::string>(),
                                 wholeNumber(s, "lr_scheduler.", "last_batch_iteration", -1, kInt64Max)};
  }
  m.configJson = j.at("config").dump();
  for (const auto& g : j.at("param_groups")) {
    m.groups.push_back(AdamWHyper{g.at("lr").get<double>(), g.at("betas").at(0).get<double>(),
                                  g.at("betas").at(1).get<double>(), g.at("eps").get<double>(),
                                  g.at("weight_decay").get<double>()});
  }
  const Json& buffers = j.at("buffers");
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Json& b = buffers.at(i);
    const std::string p = item("buffers", i);
    // Each rank file holds three fp32 tensors of shard_numel elements.
    const int64_t shard = wholeNumber(b, p, "shard_numel", 0, kInt64Max / 12);
    const int64_t numel = wholeNumber(b, p, "numel", 0, kInt64Max);
    TORCH_CHECK(shard <= kInt64Max / 12 / m.worldSize && numel <= shard * m.worldSize, p, "numel ", numel,
                " does not fit world_size ", m.worldSize, " shards of shard_numel ", shard);
    m.buffers.push_back(SavedBuffer{numel, shard});
  }
  const Json& params = j.at("params");
  for (size_t i = 0; i < params.size(); ++i) {
    const Json& q = params.at(i);
    const std::string p = item("params", i);
    SavedParam param;
    param.name = q.at("name").get<std::string>();
    param.group = wholeInt(q, p, "group", 0, static_cast<int>(m.groups.size()) - 1);
    param.buffer = wholeInt(q, p, "buffer", 0, static_cast<int>(m.buffers.size()) - 1);
    const int64_t room = m.buffers[param.buffer].numel;
    int64_t numel = 0;
    param.shape = checkedShape(q, p, room, numel);
    param.offset = wholeNumber(q, p, "offset", 0, room - numel);
    m.params.push_back(std::move(param));
  }
  for (const auto& [alias, target] : j.at("aliases").items()) m.aliases.emplace_back(alias, target.get<std::string>());
  const Json& moduleState = j.at("module_state");
  for (size_t i = 0; i < moduleState.size(); ++i) {
    const Json& t = moduleState.at(i);
    int64_t numel = 0;
    SavedTensor saved{t.at("name").get<std::string>(), checkedShape(t, item("module_state", i), kInt64Max / 8, numel),
                      dtypeFromName(t.at("dtype").get<std::string>())};
    m.moduleState.push_back(std::move(saved));
  }
  m.stateDictKeys = j.at("state_dict_keys").get<std::vector<std::string>>();
  if (j.contains("frozen_excluded")) m.frozenExcluded = j.at("frozen_excluded").get<bool>();
  // Each state-dict name once, and each one a trained parameter, a second name of one or a
  // module-state tensor (a reader and a converted file hold every name once).
  std::unordered_set<std::string> tensors;
  for (const auto& p : m.params) TORCH_CHECK(tensors.insert(p.name).second, "parameter '", p.name, "' is listed twice");
  for (const auto& [alias, target] : m.aliases) {
    TORCH_CHECK(tensors.count(target) && !tensors.count(alias), "alias '", alias, "' names no parameter ('", target,
                "') or is itself a name already");
  }
  for (const auto& [alias, target] : m.aliases) tensors.insert(alias);
  for (const auto& t : m.moduleState) {
    TORCH_CHECK(tensors.insert(t.name).second, "module-state tensor '", t.name, "' is listed twice");
  }
  std::unordered_set<std::string> keys;
  for (const auto& key : m.stateDictKeys) {
    TORCH_CHECK(keys.insert(key).second && tensors.count(key), "state_dict_keys lists '", key,
                "' twice or names no saved tensor");
  }
  const Json& files = j.at("files");
  for (size_t i = 0; i < files.size(); ++i) m.files.push_back(fileFromJson(files.at(i), item("files", i)));
  return m;
}

} // namespace

int64_t SavedParam::numel() const {
  return c10::multiply_integers(shape);
}

std::string digestsToJson(const std::vector<FileDigest>& digests) {
  Json j = Json::array();
  for (const auto& d : digests) j.push_back(fileJson(d));
  return j.dump();
}

std::vector<FileDigest> digestsFromJson(const std::string& text) {
  std::vector<FileDigest> digests;
  for (const auto& f : parseNestingBounded<Json>(text)) digests.push_back(fileFromJson(f, "files[]."));
  return digests;
}

std::string CheckpointManifest::rankFileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.safetensors", rank);
  return name;
}

std::string CheckpointManifest::stateTensorName(int buffer, const std::string& kind) {
  return "buffers." + std::to_string(buffer) + "." + kind;
}

bool CheckpointManifest::hasFile(const std::string& name) const {
  for (const auto& f : files) {
    if (f.name == name) return true;
  }
  return false;
}

const FileDigest& CheckpointManifest::file(const std::string& name) const {
  for (const auto& f : files) {
    if (f.name == name) return f;
  }
  TORCH_CHECK(false, "zeroshard checkpoint '", tag, "': the manifest lists no file '", name, "'");
}

// Note [manifest checksum]: the manifest carries the CRC-32 of its own body text, so a damaged
// manifest (which says how every other file is checked) is caught too. The body is
// re-serialized to check it; ordered_json keeps key order and numbers round-trip, so the text
// is the one that was written.
namespace {

std::string withChecksum(const Json& body) {
  const std::string text = body.dump(1);
  return "{\"body_crc32\": \"" + crc32Hex(crc32Update(0, text.data(), text.size())) + "\",\n\"manifest\": " + text + "}\n";
}

} // namespace

std::string CheckpointManifest::toJsonText() const {
  return withChecksum(bodyJson(*this));
}

std::string manifestTextForBody(const std::string& bodyJson) {
  return withChecksum(parseNestingBounded<Json>(bodyJson));
}

CheckpointManifest CheckpointManifest::fromJsonText(const std::string& text, const std::string& where) {
  Json j;
  try {
    j = parseNestingBounded<Json>(text);
  } catch (const std::exception& e) {  // nlohmann's, or JsonTooDeep
    TORCH_CHECK(false, "zeroshard checkpoint: '", where, "' is not valid JSON (", validUtf8(e.what()),
                "); the manifest is damaged or was not completely written");
  }
  try {
    const std::string body = j.at("manifest").dump(1);
    const uint32_t crc = crc32Update(0, body.data(), body.size());
    const std::string recorded = j.at("body_crc32").get<std::string>();
    TORCH_CHECK(crc32Hex(crc) == recorded, "checksum mismatch (CRC-32 ", crc32Hex(crc), ", recorded ", recorded,
                "): the manifest is corrupt");
    return fromBody(j.at("manifest"));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "zeroshard checkpoint: '", where, "' is not a valid manifest: ", validUtf8(e.what()));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "zeroshard checkpoint: '", where, "': ", validUtf8(e.msg()));
  }
}

} // namespace zeroshard
