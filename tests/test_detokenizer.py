"""IncrementalDetokenizer against whole-sequence decoding with a real byte-level BPE tokenizer,
and find_stop."""

import random

import pytest

from tutorserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from tutorserve.models.synth import SynthSpec, synth_model
from tutorserve.models.tokenizer import Tokenizer

TEXTS = [
    "café 東京 ✓",
    "The tutor asks a question and waits for the student to think.",
    "Solve x^2 - 5x + 6 = 0 → (x - 2)(x - 3) = 0 ✓ 🙂🙂 naïve façade",
    "<|im_start|>assistant\nCafé in 東京 costs ¥500 — ok?<|im_end|>\n",
    "  leading and trailing spaces  \n\n\ttabs\t",
    "日本語のテキスト、句読点。😀👍🏽 ok",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = synth_model(tmp_path_factory.mktemp("synth"), SynthSpec())
    return Tokenizer.from_hf_dir(path)


def stream(tokenizer, ids, skip_special=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == detok.text
    return detok, pieces


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer, text, skip_special):
    ids = tokenizer.encode(text)
    detok, _ = stream(tokenizer, ids, skip_special)
    assert detok.text == tokenizer.decode(ids, skip_special)
    if not skip_special:
        assert detok.text == text  # byte-level BPE round-trips exactly


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer):
    text = "café 東京 ✓"
    ids = tokenizer.encode(text)
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial, "the test needs characters split over several byte-level tokens"
    detok, pieces = stream(tokenizer, ids)
    assert detok.text == text
    assert "\ufffd" not in "".join(pieces)
    assert "" in pieces  # some tokens completed no character
    # Every released piece ends on a whole character of the final text.
    released = ""
    for piece in pieces:
        released += piece
        assert text.startswith(released)
    assert {"東", "京", "✓", "é"} <= set("".join(pieces))


def test_special_tokens_skipped_or_kept(tokenizer):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer.encode(text)
    assert len(ids) >= 4
    kept, _ = stream(tokenizer, ids, skip_special=False)
    skipped, pieces = stream(tokenizer, ids, skip_special=True)
    assert kept.text == text
    assert skipped.text == "user\nhi"
    assert pieces[0] == "" and pieces[-1] == ""


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_release_a_prefix_of_the_full_decode(tokenizer, seed):
    """Arbitrary id streams (broken UTF-8 included): text released so far is always a prefix of
    the whole decode, and anything held back ends in an incomplete character."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        detok = IncrementalDetokenizer(tokenizer)
        for n, i in enumerate(ids, 1):
            detok.add(i)
            full = tokenizer.decode(ids[:n])
            assert full.startswith(detok.text)
            assert full == detok.text or full.endswith("\ufffd")


def test_random_text_roundtrip(tokenizer):
    rng = random.Random(0)
    alphabet = "abc xyz,.!é東京✓😀ßñ\n"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tokenizer.encode(text)
        detok, _ = stream(tokenizer, ids)
        assert detok.text == text


# ---- find_stop -----------------------------------------------------------------------------


def reference_find_stop(text, new_len, stops):
    """Earliest stop occurrence that ends inside the last `new_len` characters."""
    old = len(text) - new_len
    best = -1
    for stop in stops:
        for start in range(len(text) - len(stop) + 1):
            if text.startswith(stop, start) and start + len(stop) > old:
                if best == -1 or start < best:
                    best = start
                break
    return best


def test_find_stop_basic():
    assert find_stop("hello world", 5, ["world"]) == 6
    assert find_stop("hello world", 5, ["xyz"]) == -1
    assert find_stop("hello world", 5, []) == -1
    assert find_stop("hello world", 0, ["world"]) == -1


def test_find_stop_earliest_of_several():
    text = "answer: 42. END ### more"
    new = len(text)
    assert find_stop(text, new, ["###", "END", "more"]) == text.index("END")
    assert find_stop(text, new, ["more", "."]) == text.index(".")


def test_find_stop_only_where_new_text_completes_a_stop():
    text = "abcSTOPxyz"
    assert find_stop(text, 3, ["STOP"]) == -1  # it lies entirely in already-checked text
    text = "abcSTxyz"  # not a stop: nothing to find
    assert find_stop(text, 3, ["STOP"]) == -1
    # A stop straddling old and new text is found at its start.
    assert find_stop("abcST" + "OPx", 3, ["STOP"]) == 3
    assert find_stop("abcSTO" + "P", 1, ["STOP"]) == 3
    # One that was complete before must not be reported even if another occurrence is new.
    assert find_stop("STOP..STOP", 4, ["STOP"]) == 6


def test_find_stop_matches_reference_on_random_strings():
    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(rng.choice("ab東") for _ in range(rng.randrange(0, 15)))
        new_len = rng.randrange(0, len(text) + 1)
        stops = [
            "".join(rng.choice("ab東") for _ in range(rng.randrange(1, 4)))
            for _ in range(rng.randrange(0, 4))
        ]
        old = text[: len(text) - new_len]
        # find_stop's contract assumes the checked prefix held no stop (streaming would have
        # stopped there); keep to that.
        if any(s in old for s in stops):
            continue
        assert find_stop(text, new_len, stops) == reference_find_stop(text, new_len, stops)


def test_streaming_stop_detection(tokenizer):
    """Feed a text token by token and cut at the first stop, like the engine does."""
    text = "The student explains the idea. ### then the tutor gives a hint"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    cut = -1
    for i in ids:
        new = detok.add(i)
        cut = find_stop(detok.text, len(new), ["hint", "###"])
        if cut != -1:
            break
    assert cut == text.index("###")
    assert detok.text[:cut] == "The student explains the idea. "
