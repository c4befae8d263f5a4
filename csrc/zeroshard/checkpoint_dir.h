// A directory of checkpoints, one subdirectory per tag, and a `latest` file naming the newest
// (DeepSpeed's layout). Note [crash-safe publish]: a checkpoint is written under a staging name
// (.staging-<tag>), flushed, and renamed to <tag> only when every file and the manifest are on
// disk; `latest` is replaced (write, flush, rename) after that, and older checkpoints are
// removed last. A save that dies at any point leaves the previous checkpoints and `latest` as
// they were; its staging directory is removed by the next save.
//
// These functions run on one rank (rank 0); the engine orders them with the other ranks' writes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

// Throws unless `tag` can name a directory entry here (non-empty, no '/', not starting with '.').
void checkTag(const std::string& tag);
std::string checkpointPath(const std::string& dir, const std::string& tag);
std::string stagingPath(const std::string& dir, const std::string& tag);

// Creates `dir` if needed, removes what crashed saves left behind, and creates an empty
// staging directory for `tag`.
void prepareStaging(const std::string& dir, const std::string& tag);
// Makes the staged checkpoint `tag` visible (replacing an older one of the same tag) and
// points `latest` at it. Blocking: everything is on disk when it returns.
void publishCheckpoint(const std::string& dir, const std::string& tag);
// The tag `latest` names; throws when there is none.
std::string readLatestTag(const std::string& dir);
// Removes the oldest complete checkpoints (by their manifests' creation time) until at most
// `keepLast` remain, never `keepTag`; keepLast = 0 keeps all. Returns the removed tags.
std::vector<std::string> pruneCheckpoints(const std::string& dir, int64_t keepLast, const std::string& keepTag);

} // namespace zeroshard
