"""Bad input, fuzzed: checkpoint manifests and safetensors headers (issue 19).

Damaged copies of a real checkpoint (stage 3, saved by the engine) and of a real safetensors file
(written by safetensors.torch): manifests edited and given a matching checksum (so the checks
behind the checksum are reached), manifests cut short or with bytes flipped, safetensors headers
edited, with lying lengths, junk or damaged bytes. Every read either succeeds or raises
RuntimeError naming the file, never another exception and never a crash; and under an
address-space bound of 1 GiB over what the process holds, no reader allocates a size a file
claims (the generated sizes start at gigabytes)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeroshard import _C
from fuzz_strategies import (MANIFEST_SIZES as SIZES, ALLOCATION_FAILED, address_space_headroom, assert_named_error, damaged_bytes,
                             damaged_safetensors, fuzz_settings, json_values, mutated, seeded)

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "fuzz_engine_job.py")


def run_job(*args, timeout=600):
    done = subprocess.run([sys.executable, JOB, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=HERE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-source")
    run_job("save", str(out))
    ckpt = out / "ckpt"
    tag = (ckpt / "latest").read_text().strip()
    return {"dir": out, "checkpoint": ckpt / tag, "tag": tag,
            "manifest": json.loads((ckpt / tag / "manifest.json").read_text())["manifest"],
            "safetensors": (out / "model.safetensors").read_bytes()}


def outside_config(path):
    # The manifest's copy of the config is for people: edits there only test the JSON parser.
    return path[:1] != ("config",)


def read_everything(path, out):
    reader = _C.CheckpointReader(path)
    for name in reader.state_dict_names():
        reader.read(name)
    reader.client_state()
    reader.write_safetensors(out)


def read_or_named_error(read, names, what):
    try:
        with address_space_headroom():
            read()
        return True
    except Exception as error:  # held to a named RuntimeError, or the test fails
        assert_named_error(error, names, what)
        assert isinstance(error, RuntimeError), f"{what}: {type(error).__name__}: {error}"
        return False


def fresh_copy(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(saved["checkpoint"], copy)
    return copy


@seeded
@fuzz_settings(1000)
@given(data=st.data())
def test_damaged_manifests_read_or_name_the_file(saved, tmp_path, data):
    copy = fresh_copy(saved, tmp_path)
    manifest = copy / "manifest.json"
    if data.draw(st.booleans()):
        body = data.draw(mutated(saved["manifest"], json_values(), focus=outside_config, sizes=SIZES))
        manifest.write_text(_C._manifest_text_for_body(json.dumps(body)))
    else:
        manifest.write_bytes(data.draw(damaged_bytes(manifest.read_bytes())))
    read_or_named_error(lambda: read_everything(str(copy), str(tmp_path / "out.safetensors")), [str(copy)],
                        "manifest")
    assert not (tmp_path / ".out.safetensors.partial").exists()


@seeded
@fuzz_settings(1000)
@given(damaged=st.data())
def test_damaged_safetensors_headers_read_or_name_the_file(saved, tmp_path, damaged):
    path = tmp_path / "model.safetensors"
    path.write_bytes(damaged.draw(damaged_safetensors(saved["safetensors"])))
    read_or_named_error(lambda: _C.pretrained_tensor_names(str(path)), [str(path)], "safetensors")


def test_engine_loads_of_damaged_files_fail_cleanly_or_load(saved):
    """engine.load_checkpoint and engine.load_pretrained of damaged files, in a rank of its own:
    a named RuntimeError that leaves the engine as it was, or a load (fuzz_engine_job.py)."""
    examples = 300
    report = json.loads(run_job("fuzz", str(saved["dir"]), str(examples)).strip().splitlines()[-1])
    for target, (loaded, failed) in report["counts"].items():
        # The damage reaches both outcomes: not every example stops at the first check.
        assert failed > 0 and loaded > 0, (target, report)


# --- the readers' bugs the fuzzing found, one case each ---------------------------------------

def edited(saved, tmp_path, edit):
    copy = fresh_copy(saved, tmp_path)
    body = json.loads(json.dumps(saved["manifest"]))
    edit(body)
    (copy / "manifest.json").write_text(_C._manifest_text_for_body(json.dumps(body)))
    return str(copy)


@pytest.mark.parametrize("edit, message", [
    # A shard of 0 elements: the reader divided by it (SIGFPE).
    (lambda b: b["buffers"][0].update(shard_numel=0), r"buffers\[0\].numel \d+ does not fit world_size 1 shards"),
    # Claimed sizes the files do not hold: allocated before a byte was read.
    (lambda b: [x.update(numel=2**40, shard_numel=2**40) for x in b["buffers"]],
     r"rank_00000.safetensors' has \d+ bytes; the manifest records \d+ and its buffers need"),
    (lambda b: b["params"][0].update(shape=[2**32, 2**32]), r"params\[0\].shape .* holds more than"),
    (lambda b: b["params"][0].update(shape=[-4, 2]), r"params\[0\].shape\[0\] is -4, not a whole number"),
    # get<int> truncated these; get<int64_t> of 1e300 is undefined.
    (lambda b: b.update(world_size=2**32 + 1), r"world_size is 4294967297, not a whole number in \[1, 1048576\]"),
    (lambda b: b["params"][0].update(offset=1e300), r"params\[0\].offset is 1e\+300, not a whole number"),
    (lambda b: b["files"][0].update(chunk_bytes=0), r"files\[0\].chunk_bytes is 0"),
    (lambda b: b.update(world_size=2), r"the manifest lists no file 'rank_00001.safetensors'"),
])
def test_manifest_values_are_checked(saved, tmp_path, edit, message):
    path = edited(saved, tmp_path, edit)
    with address_space_headroom(), pytest.raises(RuntimeError, match=message) as raised:
        read_everything(path, str(tmp_path / "out.safetensors"))
    assert path in str(raised.value) and ALLOCATION_FAILED not in str(raised.value)


def test_deep_nesting_in_a_manifest_is_an_error_not_a_crash(saved, tmp_path):
    # dump() recursed once per level (the checksum dumps the body): 100,000 levels overflowed the
    # stack. Refused while parsing, before the checksum is computed (Note [JSON nesting bound]).
    copy = fresh_copy(saved, tmp_path)
    text = json.dumps({"body_crc32": "00000000", "manifest": dict(saved["manifest"], config=0)})
    (copy / "manifest.json").write_text(text.replace('"config": 0', '"config": ' + "[" * 100_000 + "]" * 100_000))
    with pytest.raises(RuntimeError, match="is not valid JSON .*JSON nested more than 64 levels deep"):
        _C.CheckpointReader(str(copy))


def test_safetensors_values_are_checked(saved, tmp_path):
    from fuzz_strategies import join_safetensors, split_safetensors
    header, body = split_safetensors(saved["safetensors"])
    name = next(k for k in header if k != "__metadata__")
    path = tmp_path / "model.safetensors"
    for value, message in [([1e300, 2], r"shape value 1e\+300, not a whole number"),
                           ([2**64 - 1], r"shape value 18446744073709551615"),
                           ("x", r"needs \"shape\" as an array")]:
        header2 = json.loads(json.dumps(header))
        header2[name]["shape"] = value
        path.write_bytes(join_safetensors(header2, body))
        with pytest.raises(RuntimeError, match=message):
            _C.pretrained_tensor_names(str(path))
    # A header that is not text: the parser's message quotes its bytes, which were not UTF-8.
    path.write_bytes(join_safetensors(b'{"\xff\xfe": 1}', body))
    with pytest.raises(RuntimeError, match="is not valid JSON"):
        _C.pretrained_tensor_names(str(path))
