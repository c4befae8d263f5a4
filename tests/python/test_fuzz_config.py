"""Bad input, fuzzed: configs (issue 19).

Thousands of generated configs, most of them built on the reader's own key list (so they get past
the first key into the values and the checks between keys), with hostile values: every one
either loads or raises ValueError whose message starts "zeroshard config (<source>): " and names a
key the config holds. Never another exception, never a crash (a crash fails the whole pytest
process). A loaded config writes itself back (to_json) as a config that loads again to the same
text, and resolves its batch sizes for any world size or says which key stops it."""

import json
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

import zeroshard
from zeroshard import _C
from fuzz_strategies import fuzz_settings, json_values, mutated, seeded, text, NUMBERS, WORDS

# (section path, key) of every key the reader knows.
KNOWN = [(section, key) for section, key, _ in _C._config_keys()]
KNOWN_NAMES = st.sampled_from(sorted({key for _, key in KNOWN} | {s.split(".")[-1] for s, _ in KNOWN if s}))
VALUES = json_values(surrogates=True, non_finite=True, keys=KNOWN_NAMES)
# Values of the types configs hold, for the keys the generated configs set.
TYPED = st.one_of(st.booleans(), NUMBERS, WORDS, st.none(), st.lists(NUMBERS, max_size=3), VALUES)


@st.composite
def configs(draw):
    """A dict with some of the known keys at their places, odd values, and now and then a key
    that is not one or a section that is not an object."""
    config = {}
    for section, key in draw(st.lists(st.sampled_from(KNOWN), max_size=10, unique=True)):
        node = config
        for part in [p for p in section.split(".") if p]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[key] = draw(TYPED)
    if draw(st.booleans()):
        config = draw(mutated(config, VALUES))
    return config


def key_names(value):
    """Every key in value at any depth (their reprs too, for keys that are not str)."""
    names = set()
    if isinstance(value, dict):
        for k, v in value.items():
            names |= {k if isinstance(k, str) else repr(k)} | key_names(v)
    elif isinstance(value, list):
        for v in value:
            names |= key_names(v)
    return names


def names_one(message, names):
    # A key "" is named as "" (quoted) in messages.
    return any((name in message) if name else ('""' in message) for name in names)


def loads_or_names_a_key(load, value, source):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = load(value)
        except ValueError as e:
            message = str(e)
            assert message.startswith(f"zeroshard config ({source}): "), message
            names = key_names(value)
            assert "the top level" in message or names_one(message, names), message
            return None
    for w in caught:
        assert names_one(str(w.message), key_names(value)), str(w.message)
    return config


def written_back(config):
    """to_json's text loads, and writes the same text again."""
    text_ = config.to_json()
    again = zeroshard.Config.from_json(text_)
    assert again.to_json() == text_


def batch_sizes_or_a_named_key(config):
    for world in (1, 2, 3, 8, 2**31):
        try:
            sizes = config.batch_sizes(world)
        except ValueError as e:
            message = str(e)
            assert message.startswith("zeroshard config ("), message
            assert any(k in message for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps", "world size")), message
            continue
        assert sizes["train_batch_size"] == (sizes["train_micro_batch_size_per_gpu"] *
                                             sizes["gradient_accumulation_steps"] * world)


@seeded
@fuzz_settings(2000)
@given(configs())
def test_generated_configs_load_or_name_a_key(config):
    loaded = loads_or_names_a_key(zeroshard.Config.from_dict, config, "<dict>")
    if loaded is not None:
        written_back(loaded)
        batch_sizes_or_a_named_key(loaded)


@seeded
@fuzz_settings(1000)
@given(st.data())
def test_config_texts_load_or_raise_value_error(data):
    """The same configs as JSON text, whole or damaged (cut short, a character inserted, a
    value replaced by text that is not JSON), and text with lone surrogates: ValueError, with the
    source in the message, or a config."""
    config = data.draw(configs())
    try:
        text_ = json.dumps(config)
    except ValueError:  # NaN is not JSON: json.dumps(allow_nan=True) writes "NaN", not this
        text_ = json.dumps(config, allow_nan=True)
    how = data.draw(st.sampled_from(["whole", "cut", "insert", "surrogate"]))
    if how == "cut":
        text_ = text_[:data.draw(st.integers(0, len(text_)))]
    elif how == "insert":
        at = data.draw(st.integers(0, len(text_)))
        text_ = text_[:at] + data.draw(text(surrogates=True)) + text_[at:]
    elif how == "surrogate":
        text_ = text_.replace("}", ', "x": "\ud800"}', 1)
    try:
        loaded = zeroshard.Config.from_json(text_)
    except ValueError as e:
        assert str(e).startswith("zeroshard config (<string>): "), str(e)
        return
    written_back(loaded)


@pytest.mark.parametrize("depth", [65, 100_000])
def test_deep_nesting_is_an_error_not_a_crash(depth):
    # Note [JSON nesting bound]: past 64 levels; 100,000 would overflow the stack where dumped.
    text_ = '{"zero_optimization": ' + "[" * depth + "]" * depth + "}"
    with pytest.raises(ValueError, match=r"zero_optimization(\[\])*: JSON nested more than 64 levels deep"):
        zeroshard.Config.from_json(text_)
    loop = {"zero_optimization": {}}
    loop["zero_optimization"]["stage"] = loop
    with pytest.raises(ValueError, match=r"zero_optimization\.stage(\.zero_optimization\.stage)*: JSON nested"):
        zeroshard.Config.from_dict(loop)


def test_values_that_are_not_json_name_their_key():
    cases = [({"zero_optimization": {"stage": float("nan")}}, "zero_optimization.stage: must be a finite number"),
             ({"optimizer": {"params": {"betas": [0.9, {1, 2}]}}}, r"optimizer.params.betas\[1\]: a set is not"),
             ({"zeroshard": {1: 2}}, "zeroshard: the key 1 is a int"),
             ({"\ud800": 1}, "the top level: a key holds a lone surrogate"),
             ({"optimizer": {"type": "Adam\udfff"}}, "optimizer.type: the string holds a lone surrogate")]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            zeroshard.Config.from_dict(config)
    with pytest.raises(ValueError, match=r"^zeroshard config \(<string>\): the text holds a lone surrogate"):
        zeroshard.Config.from_json('{"optimizer": {"type": "\ud800"}}')


def test_a_long_unicode_value_is_cut_on_a_character_boundary():
    # describe() cuts a long value at 60 bytes; cut inside a character, the message was not UTF-8
    # and Python raised UnicodeDecodeError in place of the ValueError.
    for pad in range(4):
        value = "x" * pad + "\u00e9" * 40
        with pytest.raises(ValueError, match=r"optimizer.type: .*\.\.\."):
            zeroshard.Config.from_dict({"optimizer": {"type": value}})


def test_invalid_utf8_in_a_file_is_a_value_error(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_bytes(b'{"optimizer": {"type": "\xff\xfe"}}')
    with pytest.raises(ValueError, match="invalid JSON at line 1"):
        zeroshard.Config.from_file(str(path))
