// A directory of checkpoints, one subdirectory per tag, and a `latest` file naming the newest
// (DeepSpeed's layout). Note [crash-safe publish]: a checkpoint is written under a staging name
// (.staging-<tag>), flushed, and renamed to <tag> only when every file and the manifest are on
// disk, and the new `latest` too (as .staging-latest, the last write, so that a full disk fails
// the save before anything is visible); `latest` is renamed into place after that, and older
// checkpoints are removed last. A save that dies at any point leaves the previous checkpoints
// and `latest` as they were; its staging entries are removed by the next save, or at once by a
// save that fails (discardStaging). Re-saving an existing tag swaps the new directory in with
// one atomic rename (renameat2 RENAME_EXCHANGE).
//
// These functions run on one rank (rank 0); the engine orders them with the other ranks' writes.
#pragma once

#include <cstdint>
#include <optional>
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
// Removes what a failed save of `tag` staged (its directory, the new `latest`), giving its space
// back; never throws (a leftover is removed by the next save).
void discardStaging(const std::string& dir, const std::string& tag) noexcept;
// Makes the staged checkpoint `tag` visible (replacing an older one of the same tag) and
// points `latest` at it. Blocking: everything is on disk when it returns.
void publishCheckpoint(const std::string& dir, const std::string& tag);
// The tag `latest` names; throws when there is none.
std::string readLatestTag(const std::string& dir);
// Removes the oldest complete checkpoints with default tags ("global_step<N>", oldest = lowest
// N) until at most `keepLast` of them remain, never `keepTag`; tags a person chose ("best")
// are never removed, and keepLast = 0 keeps all. Returns the removed tags.
std::vector<std::string> pruneCheckpoints(const std::string& dir, int64_t keepLast, const std::string& keepTag);
// The default tag of a save after `step` accumulation boundaries, and back (nullopt for others).
std::string defaultTag(int64_t step);
std::optional<int64_t> defaultTagStep(const std::string& tag);

} // namespace zeroshard
