#include "zeroshard/checkpoint/manifest.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <nlohmann/json.hpp>

#include "zeroshard/checkpoint/crc32.h"
#include "zeroshard/checkpoint/safetensors.h"

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

FileDigest fileFromJson(const Json& f) {
  FileDigest d;
  d.name = f.at("name").get<std::string>();
  d.bytes = f.at("bytes").get<int64_t>();
  d.chunkBytes = f.at("chunk_bytes").get<int64_t>();
  for (const auto& c : f.at("chunk_crc32")) d.chunkCrcs.push_back(fromHex(c.get<std::string>()));
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
  j["files"] = Json::array();
  for (const auto& f : m.files) j["files"].push_back(fileJson(f));
  return j;
}

CheckpointManifest fromBody(const Json& j) {
  CheckpointManifest m;
  TORCH_CHECK(j.at("format").get<std::string>() == "zeroshard-checkpoint", "not a zeroshard checkpoint manifest");
  m.formatVersion = j.at("format_version").get<int>();
  TORCH_CHECK(m.formatVersion == kCheckpointFormatVersion, "format_version ", m.formatVersion,
              " is not one this zeroshard reads (", kCheckpointFormatVersion, ")");
  m.tag = j.at("tag").get<std::string>();
  m.worldSize = j.at("world_size").get<int>();
  m.stage = j.at("stage").get<int>();
  m.computeDtype = dtypeFromName(j.at("compute_dtype").get<std::string>());
  m.globalSteps = j.at("global_steps").get<int64_t>();
  m.boundaries = j.at("boundaries").get<int64_t>();
  m.skippedSteps = j.at("skipped_steps").get<int64_t>();
  m.createdUnixNs = j.at("created_unix_ns").get<int64_t>();
  if (!j.at("loss_scaler").is_null()) {
    const auto& s = j.at("loss_scaler");
    m.lossScaler = LossScaler::State{s.at("scale").get<double>(), s.at("hysteresis_left").get<int64_t>(),
                                     s.at("iteration").get<int64_t>(), s.at("last_overflow_iteration").get<int64_t>()};
  }
  // Checkpoints written before the batch was recorded have no "batch".
  if (j.contains("batch") && !j.at("batch").is_null()) {
    const auto& b = j.at("batch");
    m.batch = SavedBatch{b.at("train_batch_size").get<int64_t>(), b.at("train_micro_batch_size_per_gpu").get<int64_t>(),
                         b.at("gradient_accumulation_steps").get<int64_t>(), b.at("world_size").get<int>()};
    TORCH_CHECK(m.batch->microPerRank > 0 && m.batch->accumulationSteps > 0 && m.batch->worldSize > 0 &&
                    m.batch->train == m.batch->microPerRank * m.batch->accumulationSteps * m.batch->worldSize,
                "batch: train_batch_size ", m.batch->train, " is not train_micro_batch_size_per_gpu ",
                m.batch->microPerRank, " x gradient_accumulation_steps ", m.batch->accumulationSteps, " x world_size ",
                m.batch->worldSize);
  }
  // Checkpoints written before schedules were saved have no "lr_scheduler".
  if (j.contains("lr_scheduler") && !j.at("lr_scheduler").is_null()) {
    const auto& s = j.at("lr_scheduler");
    m.lrSchedule = SavedSchedule{s.at("type").get<std::string>(), s.at("last_batch_iteration").get<int64_t>()};
    TORCH_CHECK(m.lrSchedule->lastBatchIteration >= -1, "lr_scheduler.last_batch_iteration is ",
                m.lrSchedule->lastBatchIteration, " (it is -1 or more)");
  }
  m.configJson = j.at("config").dump();
  for (const auto& g : j.at("param_groups")) {
    m.groups.push_back(AdamWHyper{g.at("lr").get<double>(), g.at("betas").at(0).get<double>(),
                                  g.at("betas").at(1).get<double>(), g.at("eps").get<double>(),
                                  g.at("weight_decay").get<double>()});
  }
  for (const auto& b : j.at("buffers")) {
    m.buffers.push_back(SavedBuffer{b.at("numel").get<int64_t>(), b.at("shard_numel").get<int64_t>()});
  }
  for (const auto& p : j.at("params")) {
    SavedParam param{p.at("name").get<std::string>(), p.at("shape").get<std::vector<int64_t>>(),
                     p.at("group").get<int>(), p.at("buffer").get<int>(), p.at("offset").get<int64_t>()};
    TORCH_CHECK(param.buffer >= 0 && param.buffer < static_cast<int>(m.buffers.size()) && param.offset >= 0 &&
                    param.offset + param.numel() <= m.buffers[param.buffer].numel &&
                    param.group >= 0 && param.group < static_cast<int>(m.groups.size()),
                "parameter '", param.name, "' has a place outside the saved buffers or groups");
    m.params.push_back(std::move(param));
  }
  for (const auto& [alias, target] : j.at("aliases").items()) m.aliases.emplace_back(alias, target.get<std::string>());
  for (const auto& t : j.at("module_state")) {
    m.moduleState.push_back(SavedTensor{t.at("name").get<std::string>(), t.at("shape").get<std::vector<int64_t>>(),
                                        dtypeFromName(t.at("dtype").get<std::string>())});
  }
  m.stateDictKeys = j.at("state_dict_keys").get<std::vector<std::string>>();
  for (const auto& f : j.at("files")) m.files.push_back(fileFromJson(f));
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
  for (const auto& f : Json::parse(text)) digests.push_back(fileFromJson(f));
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
std::string CheckpointManifest::toJsonText() const {
  const std::string body = bodyJson(*this).dump(1);
  return "{\"body_crc32\": \"" + crc32Hex(crc32Update(0, body.data(), body.size())) + "\",\n\"manifest\": " + body + "}\n";
}

CheckpointManifest CheckpointManifest::fromJsonText(const std::string& text, const std::string& where) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "zeroshard checkpoint: '", where, "' is not valid JSON (", e.what(),
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
    TORCH_CHECK(false, "zeroshard checkpoint: '", where, "' is not a valid manifest: ", e.what());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "zeroshard checkpoint: '", where, "': ", e.msg());
  }
}

} // namespace zeroshard
