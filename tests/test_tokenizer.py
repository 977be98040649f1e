"""Tokenizer loading, chat templates, streaming detokenization and stop strings."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine.errors import InvalidRequestError, ModelLoadError
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer
from factories import build_tokenizer

TEXTS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "naïve café — テキスト 🚀🙂 done.",
    "日本語日本語 ok 🙂🙂🙂 é",
    "  leading spaces,\n\tnew lines and    runs of spaces  ",
    "mixed: αβγ δ Привет мир 😀 ẞ",  # letters the tokenizer never saw: pure byte tokens
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def chunked(ids, rng, max_chunk=5):
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        yield ids[i:i + n]
        i += n


def stream(tok, chunks, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    pieces = [detok.push(c) for c in chunks]
    tail = detok.flush()
    return detok, pieces, tail


class CountingTokenizer:
    """Stands in for a Tokenizer and counts how many ids the detokenizer decodes."""

    def __init__(self, tok):
        self._tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


# --- loading ---------------------------------------------------------------------------------

def test_load_basic(tok, tiny_dir):
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == frozenset({im_end})
    assert tok.vocab_size == len(tok.hf) >= 384
    assert tok.name == tiny_dir.name
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_eos_ids_merge_generation_and_model_config(tiny_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 5, "model_type": "llama"}))
    tok = load_tokenizer(path)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == frozenset({im_end, 7, 0, 5})


def test_load_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load_tokenizer(broken)


def test_encode_rejects_non_text(tok):
    with pytest.raises(InvalidRequestError, match="prompt must be a string"):
        tok.encode([1, 2, 3])


# --- chat template ---------------------------------------------------------------------------

def test_chat_template_chatml(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🙂"}]
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo 🙂<|im_end|>\n"
                "<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == expected
    start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3  # specials are single tokens, not text
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == expected.removesuffix("<|im_start|>assistant\n")


def test_chat_content_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "🙂"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "héllo 🙂"}])


@pytest.mark.parametrize("messages, field", [
    ([], "messages must not be empty"),
    ("hello", "messages must be a list"),
    ([{"role": "user", "content": "hi"}, "hi"], r"messages\[1\] must be an object"),
    ([{"role": "bot", "content": "hi"}], r"messages\[0\]\.role must be one of system, user, assistant, tool"),
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"messages\[0\]\.content\[0\]"),
])
def test_chat_validation_names_the_field(tok, messages, field):
    with pytest.raises(InvalidRequestError, match=field):
        tok.apply_chat_template(messages)


def test_no_chat_template(tmp_path):
    hf = build_tokenizer()
    hf.chat_template = None
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_become_invalid_request(tmp_path):
    hf = build_tokenizer()
    hf.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}"
                        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(InvalidRequestError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


# --- incremental detokenization --------------------------------------------------------------

def test_texts_really_split_characters_across_tokens(tok):
    # Guards the tests below: they only prove something if some tokens are partial characters.
    partial = [i for t in TEXTS for i in tok.encode(t) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 10


@pytest.mark.parametrize("text", TEXTS)
def test_detok_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    detok, pieces, tail = stream(tok, [[i] for i in ids])
    assert "".join(pieces) == tok.decode(ids) == text
    assert tail == ""
    assert detok.text == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(8))
def test_detok_random_chunks(tok, seed):
    rng = random.Random(seed)
    text = " ".join(rng.sample(TEXTS, len(TEXTS)))
    ids = tok.encode(text)
    detok, pieces, tail = stream(tok, chunked(ids, rng, max_chunk=rng.randint(2, 9)))
    assert "".join(pieces) + tail == text
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_detok_special_tokens(tok, skip):
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("日本語 🙂") + [im_end] + tok.encode("é 🚀") + [im_end]
    _, pieces, tail = stream(tok, [[i] for i in ids], skip_special_tokens=skip)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is (not skip)


def test_detok_holds_incomplete_character_until_complete(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:-1])
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🙂"


def test_detok_flush_releases_unfinished_character(tok):
    ids = tok.encode("ab🙂")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == "ab"
    assert detok.flush() == tok.decode(ids[:-1])[2:]  # the broken character, as decoded
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_detok_random_token_soup_matches_whole_decode(tok, seed):
    # Arbitrary ids (invalid byte sequences, specials, anything): the stream still adds up.
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 120))]
    for skip in (True, False):
        _, pieces, tail = stream(tok, chunked(ids, rng, max_chunk=4), skip_special_tokens=skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def lone_byte_ids(tok):
    return [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]


def test_detok_garbage_bytes_keep_window_bounded(tok):
    rng = random.Random(0)
    garbage = lone_byte_ids(tok)
    assert len(garbage) > 50
    ids = [rng.choice(garbage) for _ in range(2000)] + tok.encode(" 日本語 done")
    counting = CountingTokenizer(tok)
    _, pieces, tail = stream(counting, [[i] for i in ids])
    assert "".join(pieces) + tail == tok.decode(ids)
    assert counting.decoded < 12 * len(ids)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_detok_work_per_token_is_constant(tok, chunk):
    ids = tok.encode(" ".join(TEXTS * 40))
    counting = CountingTokenizer(tok)
    stream(counting, [ids[i:i + chunk] for i in range(0, len(ids), chunk)])
    assert counting.decoded < 6 * len(ids)  # re-decoding everything would be ~len(ids)**2 / 2


def build_metaspace_tokenizer(path):
    """A Llama-2-style tokenizer: "▁" word marks, byte fallback, first leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in "▁abcdefghijklmnopqrstuvwxyzHSW.,!?":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in ["▁Hello", "▁world", "▁Say", "▁the"]:
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                vocab[word[:k]] = len(vocab)
                merges.append((word[:k - 1], word[k - 1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return load_tokenizer(path)


def test_detok_metaspace_byte_fallback(tmp_path):
    tok = build_metaspace_tokenizer(tmp_path)
    text = "Say Hello wörld 日本 🙂, the world!"
    ids = tok.encode(text, add_special_tokens=False)
    assert sum(tok.hf.convert_ids_to_tokens(i).startswith("<0x") for i in ids) >= 10
    for chunk in (1, 2, 5):
        _, pieces, tail = stream(tok, [ids[i:i + chunk] for i in range(0, len(ids), chunk)])
        assert "".join(pieces) == text and tail == ""
        assert not any("\ufffd" in p for p in pieces)
    # Decoded alone, the first output token loses its leading space; prompt context keeps it.
    prompt, output = ids[:1], ids[1:]
    _, pieces, _ = stream(tok, [[i] for i in output], context_ids=prompt)
    assert "".join(pieces) == text[len("Say"):] == " Hello wörld 日本 🙂, the world!"
    _, pieces, _ = stream(tok, [[i] for i in output])
    assert "".join(pieces) == tok.decode(output) == "Hello wörld 日本 🙂, the world!"


# --- stop strings ----------------------------------------------------------------------------

def reference_stop(text, stops, include):
    """Character by character: the first stop string to complete (longest on a tie)."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return (text[:end] if include else text[:end - len(s)]), True
    return text, False


def run_matcher(stops, chunks, include=False):
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    out, stopped = [], False
    for chunk in chunks:
        piece, stopped = matcher.push(chunk)
        out.append(piece)
        if stopped:
            break
    out.append(matcher.flush())
    return "".join(out), stopped, matcher


def test_stop_no_stops_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", False) and matcher.flush() == ""


def test_stop_single_push():
    assert run_matcher(["STOP"], ["hello STOP world"])[:2] == ("hello ", True)
    text, stopped, matcher = run_matcher(["STOP"], ["hello STOP world"], include=True)
    assert (text, stopped, matcher.stop_reason) == ("hello STOP", True, "STOP")
    assert matcher.push("more") == ("", True)


def test_stop_across_pushes():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hel") == ("hel", False)
    assert matcher.push("lo ST") == ("lo ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("P and more") == ("", True)
    assert matcher.flush() == ""
    matcher = StopStringMatcher("STOP", include_stop_str_in_output=True)
    assert [matcher.push(c) for c in ["a S", "TO", "Pz"]] == [("a ", False), ("", False), ("STOP", True)]


def test_stop_held_text_released_when_it_diverges_or_at_flush():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xab") == ("x", False)
    assert matcher.push("d") == ("abd", False)
    assert matcher.push("ab") == ("", False)
    assert matcher.flush() == "ab"


@pytest.mark.parametrize("include", [False, True])
def test_stop_first_completed_wins(include):
    # "b" completes before "abc" does, whatever the chunking.
    for chunks in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        text, stopped, matcher = run_matcher(["abc", "b"], chunks, include)
        assert (text, stopped, matcher.stop_reason) == (("xab" if include else "xa"), True, "b")
    text, _, matcher = run_matcher(["b", "ab"], ["xab"], include)  # tie on the end: the longer one
    assert (text, matcher.stop_reason) == (("xab" if include else "x"), "ab")


@pytest.mark.parametrize("seed", range(40))
def test_stop_matches_reference_for_any_chunking(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab 日") for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice("ab 日") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    include = rng.random() < 0.5
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunks.append(text[i:i + n])
        i += n
    got_text, got_stopped, _ = run_matcher(stops, chunks, include)
    assert (got_text, got_stopped) == reference_stop(text, stops, include)


@pytest.mark.parametrize("stop, message", [
    ([""], r"stop\[0\] must be a non-empty string"),
    (["ok", 3], r"stop\[1\] must be a non-empty string"),
])
def test_stop_validation(stop, message):
    with pytest.raises(InvalidRequestError, match=message):
        StopStringMatcher(stop)


# --- the real default model ------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_tokenizer(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    assert tok.vocab_size == 49152
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    ids = tok.apply_chat_template([{"role": "user", "content": "Bonjour, ça va? 日本語 🙂"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nBonjour, ça va? 日本語 🙂<|im_end|>\n" in text
    sample = "Le café coûte 3 €. 日本語のテキスト 🙂🚀 — naïve façade."
    ids = tok.encode(sample)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for chunk in (1, 3):
        _, pieces, tail = stream(tok, [ids[i:i + chunk] for i in range(0, len(ids), chunk)])
        assert "".join(pieces) == sample and tail == ""
        assert not any("\ufffd" in p for p in pieces)
