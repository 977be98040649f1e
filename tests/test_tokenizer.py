"""Tokenizer loading, chat templates, streaming detokenization and stop strings.

Detokenization runs two ways: tokenizers' DecodeStream on a fast tokenizer's backend, and
the windowed fallback over ``decode`` for tokenizers without one (``SlowTokenizer`` here).
Both must add up to ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine.errors import InvalidRequestError, ModelLoadError
from engine.detokenizer import _MAX_HOLD_TOKENS, IncrementalDetokenizer, TextStream
from engine.tokenizer import load_tokenizer
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


class SlowTokenizer:
    """A tokenizer with ``decode`` only (no Rust backend): the detokenizer's fallback path.
    Counts how many ids it decodes."""

    def __init__(self, tok):
        self._tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingFastTokenizer(SlowTokenizer):
    """The real fast tokenizer (DecodeStream runs on its backend), counting Python decodes."""

    @property
    def hf(self):
        return self._tok.hf


@pytest.fixture(params=["fast", "slow"])
def both(request, tok):
    """The tiny tokenizer, once through DecodeStream, once through the fallback."""
    return tok if request.param == "fast" else SlowTokenizer(tok)


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
    ([{"role": "user", "content": "hi"}, "hi"], r"messages\.1 must be"),
    ([{"role": "bot", "content": "hi"}], r"messages\.0\.role must be 'system', 'user', 'assistant', 'tool'"),
    ([{"content": "hi"}], r"messages\.0\.role is required"),
    ([{"role": "user", "content": "a\ud800"}], r"messages\.0\.content must be valid UTF-8"),
    ([{"role": "user", "content": 3}], r"messages\.0\.content must be a valid string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     r"messages\.0\.content must be a string or a list of text parts"),
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
def test_detok_one_token_at_a_time(both, tok, text):
    ids = tok.encode(text)
    _, pieces, tail = stream(both, [[i] for i in ids])
    assert "".join(pieces) == tok.decode(ids) == text
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("seed", range(8))
def test_detok_random_chunks(both, tok, seed):
    rng = random.Random(seed)
    text = " ".join(rng.sample(TEXTS, len(TEXTS)))
    ids = tok.encode(text)
    _, pieces, tail = stream(both, chunked(ids, rng, max_chunk=rng.randint(2, 9)))
    assert "".join(pieces) + tail == text
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_detok_special_tokens(both, tok, skip):
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("日本語 🙂") + [im_end] + tok.encode("é 🚀") + [im_end]
    _, pieces, tail = stream(both, [[i] for i in ids], skip_special_tokens=skip)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is (not skip)


def test_detok_holds_incomplete_character_until_complete(both, tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:-1])
    detok = IncrementalDetokenizer(both)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🙂"


def test_detok_flush_releases_unfinished_character(both, tok):
    ids = tok.encode("ab🙂")
    detok = IncrementalDetokenizer(both)
    assert detok.push(ids[:-1]) == "ab"
    assert detok.flush() == tok.decode(ids[:-1])[2:]  # the broken character, as decoded
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(100))
def test_detok_random_token_soup_matches_whole_decode(both, tok, seed):
    # Arbitrary ids (invalid byte sequences, specials, anything): the stream still adds up.
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 120))]
    for skip in (True, False):
        _, pieces, tail = stream(both, chunked(ids, rng, max_chunk=4), skip_special_tokens=skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(30))
def test_detok_multibyte_text_with_random_ids_between(both, tok, seed):
    # Emoji and CJK split over tokens, with random ids (often lone bytes) spliced in.
    rng = random.Random(seed)
    ids = []
    for _ in range(rng.randint(2, 8)):
        ids += tok.encode(rng.choice(TEXTS))
        ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 3))]
    _, pieces, tail = stream(both, chunked(ids, rng, max_chunk=3))
    assert "".join(pieces) + tail == tok.decode(ids)


def test_fast_tokenizers_stream_in_rust(tok):
    ids = tok.encode(" ".join(TEXTS))
    counting = CountingFastTokenizer(tok)
    _, pieces, tail = stream(counting, [[i] for i in ids])
    assert "".join(pieces) + tail == tok.decode(ids)
    assert counting.decoded == 0  # DecodeStream did it all: no Python-side decode


def lone_byte_ids(tok):
    return [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]


def test_detok_garbage_bytes_keep_window_bounded(tok):
    rng = random.Random(0)
    garbage = lone_byte_ids(tok)
    assert len(garbage) > 50
    ids = [rng.choice(garbage) for _ in range(2000)] + tok.encode(" 日本語 done")
    slow = SlowTokenizer(tok)
    _, pieces, tail = stream(slow, [[i] for i in ids])
    assert "".join(pieces) + tail == tok.decode(ids)
    assert slow.decoded < 20 * len(ids)
    detok = IncrementalDetokenizer(tok)  # DecodeStream: its window is what is held
    held, pieces = [], []
    for i in ids:
        pieces.append(detok.push([i]))
        held.append(detok.held_tokens)
    assert "".join(pieces) + detok.flush() == tok.decode(ids)
    assert max(held) <= _MAX_HOLD_TOKENS + 1


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_detok_work_per_token_is_constant(tok, chunk):
    ids = tok.encode(" ".join(TEXTS * 40))
    slow = SlowTokenizer(tok)
    stream(slow, [ids[i:i + chunk] for i in range(0, len(ids), chunk)])
    assert slow.decoded < 6 * len(ids)  # re-decoding everything would be ~len(ids)**2 / 2


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


# --- detokenizer + stop strings, as the offline LLM and serving run them ---------------------

def run_text_stream(tokenizer, chunks, **kw):
    ts = TextStream(tokenizer, **kw)
    text, used = "", 0
    for chunk in chunks:
        piece, n = ts.push(chunk)
        text, used = text + piece, used + n
        if ts.stopped:
            break
    return text + ts.finish(), used, ts.stopped


@pytest.mark.parametrize("stop", ["STOP here", "日本", "🙂🚀", "Привет"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_split_across_steps_ends_at_its_token(both, tok, stop, chunk):
    before, after = "naïve café — テキスト 🙂 ", " and the rest 🙂🚀 日本 é — "
    ids = tok.encode(before + stop + after)
    first = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))  # the completing token
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop string really spans tokens
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    for include in (False, True):
        text, used, stopped = run_text_stream(both, chunks, stop=[stop], include_stop_str_in_output=include)
        assert stopped and used == first
        assert text == before + (stop if include else "")


def test_text_stream_without_a_stop_is_the_whole_decode(both, tok):
    ids = tok.encode(" ".join(TEXTS))
    text, used, stopped = run_text_stream(both, [ids[:3], ids[3:4], ids[4:]], stop=["never there"])
    assert (text, used, stopped) == (tok.decode(ids), len(ids), False)


def test_text_stream_finish_releases_held_text_and_can_still_stop(tok):
    ids = tok.encode("ab🙂")
    # held by the matcher ("a" may begin "ab🙂x"), then by the detokenizer (an unfinished 🙂)
    text, used, stopped = run_text_stream(tok, [ids[:-1]], stop=["ab🙂x"])
    assert (text, used, stopped) == (tok.decode(ids[:-1]), len(ids) - 1, False)
    ts = TextStream(tok, stop=["b\ufffd"])  # the flushed broken character completes this stop
    assert ts.push(ids[:-1]) == ("a", len(ids) - 1)
    assert ts.finish() == "" and ts.stopped


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
