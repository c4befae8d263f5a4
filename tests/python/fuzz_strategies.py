"""What the fuzz tests (test_fuzz_*.py, fuzz_engine_job.py) generate, and the limits they run under.

Values are JSON-shaped but hostile: huge and negative numbers, floats where whole numbers belong,
"auto", unicode (lone surrogates where the input is Python text), deep and odd nesting. Files
are mutations of real ones (a checkpoint the engine saved, a file safetensors wrote), so that most
of them get past the first check and reach the readers' later ones.

Every example runs under `address_space_headroom()`: an allocation of a size a damaged file
claims (the generated sizes reach gigabytes) fails there, with the allocator's error, which the
tests refuse to accept as a named error."""

import contextlib
import json
import os
import resource
import struct

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# ZEROSHARD_FUZZ_EXAMPLES scales every test's example count (1.0 on CI; e.g. 20 for a long run).
# derandomize: CI runs the same examples every time; ZEROSHARD_FUZZ_SEED picks other ones.
SCALE = float(os.environ.get("ZEROSHARD_FUZZ_EXAMPLES", "1"))
SEED = os.environ.get("ZEROSHARD_FUZZ_SEED")


def fuzz_settings(examples):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    derandomize=SEED is None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def seeded(test):
    """Applies ZEROSHARD_FUZZ_SEED when it is set."""
    if SEED is None:
        return test
    from hypothesis import seed
    return seed(int(SEED))(test)


HUGE_INTS = st.sampled_from([2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
                             2**64, 2**100, -1, -(2**31), -(2**63), -(2**63) - 1, -(2**100)])
NUMBERS = st.one_of(
    st.integers(-3, 70), HUGE_INTS, st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 0.5, 1.5, 5e8, 1e18, 9.3e18, 1e300, -1e300, 2.0**63, 1e-300]))
WORDS = st.sampled_from(["auto", "none", "cpu", "nvme", "node", "AdamW", "adam", "SGD", "WarmupLR",
                         "WarmupCosineLR", "WarmupDecayLR", "OneCycle", "bf16", "fp16", "fp32", "float32",
                         "error", "warn", "skip", "off", "linear", "log", "F32", "BF16", "I64", "BOOL",
                         "", " ", "\u00e9", "\U0001f600", "\x00", "zero_optimisation", "global_step1"])


def text(surrogates=False):
    # Lone surrogates exist only in Python text; JSON files and manifests are UTF-8.
    chars = st.characters(exclude_categories=()) if surrogates else st.characters(exclude_categories=["Cs"])
    return st.one_of(WORDS, st.text(chars, max_size=12))


def leaves(surrogates=False, non_finite=False):
    floats = [st.floats()] if non_finite else []
    return st.one_of(st.none(), st.booleans(), NUMBERS, text(surrogates), *floats)


def json_values(surrogates=False, non_finite=False, keys=None):
    key = st.one_of(keys, text(surrogates)) if keys is not None else text(surrogates)
    return st.recursive(leaves(surrogates, non_finite),
                        lambda kids: st.one_of(st.lists(kids, max_size=4),
                                               st.dictionaries(key, kids, max_size=4)),
                        max_leaves=8)


# --- mutating a parsed JSON document ------------------------------------------------------------

def paths(doc, prefix=()):
    """Every path (a tuple of keys and indexes) to a value inside doc, doc itself first."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, prefix + (i,))
    return out


def _parent(doc, path):
    for step in path[:-1]:
        doc = doc[step]
    return doc


@st.composite
def mutated(draw, doc, value_strategy, focus=None, sizes=()):
    """doc (a deep copy) with one to three edits: a number replaced by another (often at the
    edges: 0, -1, 2^31, 2^63, a float), one key's numbers replaced everywhere, any value
    replaced, a key removed or added, a list element removed or duplicated, or (given the
    names of the keys that hold sizes) every size multiplied by one factor: the claims of a
    bigger model, coherent with each other, which the files do not back. focus(path) -> False
    keeps edits out of a part of the document (a manifest's config, which nothing interprets)
    so that they land where the sizes are."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        where = [p for p in paths(doc)[1:] if focus is None or focus(p)]
        if not where:
            doc = draw(value_strategy)
            continue
        numbers = [p for p in where if _is_number(_get(doc, p))]
        edit = draw(st.sampled_from(["number", "number", "every", "every", "replace", "remove", "add", "duplicate"]
                                    + ["grow", "grow"] * bool(sizes)))
        if edit == "grow":
            factor = draw(st.sampled_from([2, 3, 2**10, 2**20, 2**31]))
            for p in where:
                # A shape grows in its first dimension, so its element count grows by the factor too.
                key = p[-1] if isinstance(p[-1], str) else p[-2] if len(p) > 1 and p[-1] == 0 else None
                if key in sizes and _is_number(_get(doc, p)):
                    _parent(doc, p)[p[-1]] *= factor
            continue
        if edit == "every":
            # One key set to one value wherever it is: a size claimed consistently, the way a
            # buggy writer would, which one edit at one place rarely reaches.
            keys = sorted({str(p[-1]) for p in numbers if isinstance(p[-1], str)} |
                          {str(p[-2]) for p in numbers if len(p) > 1 and isinstance(p[-1], int)})
            if keys:
                key = draw(st.sampled_from(keys))
                value = draw(st.one_of(HUGE_INTS, st.sampled_from([0, 1, -1, 2**40]), NUMBERS))
                for p in (p for p in where if p[-1] == key):
                    try:
                        parent = _parent(doc, p)
                        parent[key] = [value, value] if isinstance(parent[key], list) else value
                    except (KeyError, IndexError, TypeError):  # inside a value replaced already
                        pass
                continue
            edit = "replace"
        path = draw(st.sampled_from(numbers if edit == "number" and numbers else where))
        parent = _parent(doc, path)
        if edit == "number":
            parent[path[-1]] = draw(st.one_of(HUGE_INTS, NUMBERS, st.sampled_from([0, 1, -1])))
        elif edit == "replace":
            parent[path[-1]] = draw(value_strategy)
        elif edit == "remove":
            del parent[path[-1]]
        elif edit == "add":
            if isinstance(parent, dict):
                parent[draw(text())] = draw(value_strategy)
            else:
                parent.insert(path[-1], draw(value_strategy))
        else:  # duplicate
            item = parent[path[-1]]
            if isinstance(parent, list):
                parent.append(json.loads(json.dumps(item)))
            else:
                parent[draw(text())] = json.loads(json.dumps(item))
    return doc


def _get(doc, path):
    for step in path:
        doc = doc[step]
    return doc


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The keys of a checkpoint manifest that hold element counts and offsets.
MANIFEST_SIZES = ("numel", "shard_numel", "shape", "offset")


@st.composite
def damaged_bytes(draw, data):
    """data truncated, with bytes flipped, or with bytes inserted."""
    data = bytearray(data)
    how = draw(st.sampled_from(["truncate", "flip", "insert"]))
    if how == "truncate":
        return bytes(data[:draw(st.integers(0, max(0, len(data) - 1)))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return bytes(data)
    i = draw(st.integers(0, len(data)))
    return bytes(data[:i]) + draw(st.binary(min_size=1, max_size=16)) + bytes(data[i:])


# --- safetensors files ----------------------------------------------------------------------------

def split_safetensors(data):
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def join_safetensors(header, body, length=None):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + body


@st.composite
def damaged_safetensors(draw, data):
    """A safetensors file made wrong in one of the ways a reader must survive: cut short, a
    header length that lies, a header edited (dtypes, shapes, offsets, metadata, tensors added
    or removed) and written back with its true length, a header that is not JSON, or bytes
    damaged anywhere."""
    header, body = split_safetensors(data)
    how = draw(st.sampled_from(["header", "header", "header", "length", "junk header", "bytes"]))
    if how == "header":
        edit = draw(mutated(header, json_values()))
        return join_safetensors(edit, body[:draw(st.sampled_from([len(body), len(body), 0, len(body) // 2]))])
    if how == "length":
        length = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, len(data)),
                                st.sampled_from([2**63, 2**64 - 1, 100 << 20, (100 << 20) + 1])))
        return join_safetensors(header, body, length=length)
    if how == "junk header":
        return join_safetensors(draw(st.binary(max_size=64)), body)
    return draw(damaged_bytes(data))


# --- allocation bound -----------------------------------------------------------------------------

HEADROOM_BYTES = 1 << 30
# Who speaks when an allocation fails: torch's CPU allocator (c10/core/impl/alloc_cpu.cpp:
# "DefaultCPUAllocator: can't allocate memory" / "not enough memory"), or C++'s.
ALLOCATION_FAILED = "DefaultCPUAllocator"


def _address_space_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def address_space_headroom(headroom=HEADROOM_BYTES):
    """RLIMIT_AS at this process's address space plus `headroom` while inside: an allocation of
    a size claimed by a damaged file (gigabytes or more) fails instead of succeeding lazily."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space_bytes() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def assert_named_error(error, names, what):
    """A RuntimeError or ValueError from zeroshard that names one of `names` (a file, a key) and is
    not an allocation of a claimed size."""
    message = str(error)
    assert isinstance(error, (RuntimeError, ValueError)), f"{what}: {type(error).__name__}: {message}"
    assert ALLOCATION_FAILED not in message and "bad_alloc" not in message, f"{what}: allocated a claimed size: {message}"
    assert "zeroshard" in message, f"{what}: not zeroshard's error: {message}"
    assert any(n in message for n in names), f"{what}: the error names none of {names!r}: {message}"
