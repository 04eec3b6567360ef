"""The byte-level BPE tokenizer against the `tokenizers` library and `transformers`.

Oracles:
- SmolLM2 (the real GGUF file): `transformers` builds a `tokenizers` BPE from the same vocabulary and
  merges. Its GGUF converter ignores `tokenizer.ggml.pre` and always uses GPT-2's split, while the
  model's own tokenizer.json (and llama.cpp's `smollm`) first splits every digit: so we compare our
  `smollm` tokenizer with that BPE under Digits(individual) + ByteLevel - the SmolLM2 tokenizer -
  and our `gpt2` tokenizer with the transformers tokenizer exactly as it loads.
- Qwen-style tokenizer.json: a small byte-level BPE trained here with `tokenizers`, using the Qwen2
  split regex as published in Qwen2's tokenizer.json and its NFC normalizer.
"""
import json
import unicodedata

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from minillm.generation.tokenizer import BYTE_TO_SYMBOL, StreamDetokenizer, Tokenizer
from minillm.model.gguf import GGUFFile

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Inference is a loop: the model reads the prompt once, then writes one token at a time, "
    "each new token appended to what it has already written. Memory, not arithmetic, sets the pace.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "import numpy as np\nx = np.arange(12).reshape(3, 4)  # (3, 4)\n",
    "3.14159265358979323846264338327950288419716939937510",
    "1234567890 9876543210 00000 42",
    "Call 555-0199 or +1 (800) 123-4567 before 2024-12-31.",
    "x = 1e-5; y = 0x1F; z = 1_000_000",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\r\nwindows line\r\n",
    "\n\n\n",
    "    indented    gaps   a   1  22   333",
    "Wait... what?! (Really?) [yes] {no} <maybe> — “quotes” ‘single’ «guillemets»",
    "!!!???...;;;:::",
    "I'm sure you'll see they've done what we'd said; it's John's.",
    "I'M SURE YOU'LL SEE THEY'VE DONE IT; IT'S JOHN'S.",
    "don't won't can't shouldn't y'all",
    "大语言模型推理是一个状态机，而不是一次前向计算。",
    "日本語のテキストも試してみましょう。カタカナとひらがな。",
    "한국어 문장도 포함합니다.",
    "Emoji: 😀😃😄 👍🏽 ❤️ 🎉",
    "Family: 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and 🏳️‍🌈",
    "Mixed: English, русский, Ελληνικά, العربية, עברית, हिन्दी.",
    "Café naïve résumé coöperate façade Ångström Zürich",
    "combining: e\u0301 a\u0308 (decomposed) vs é ä (composed)",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text before<|endoftext|>text after",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start partial tag |> and <im_end|> are not special",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∀x∈ℝ: x² ≥ 0, π ≈ 3.14159",
    "URL: https://example.com/path?query=1&lang=en#section-2",
    "email: someone.name+tag@example.co.uk",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    '<html><body><p class="x">Hello&nbsp;there</p></body></html>',
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ========== ---- ____",
    "          ",
    "non\u00a0breaking\u3000ideographic\u2009thin spaces",
    "Ünïcödé ÀÉÎÕÜ ßẞ ǅ ﬁ ligature",
    "Subscripts x₁ x₂ and superscripts x² x³, fractions ½ ¾, roman Ⅻ",
    "Arabic-Indic digits ٠١٢٣٤٥٦٧٨٩ and full-width １２３",
    "",
    "mixed中文English混合123text",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math alphanumerics 𝟘𝟙𝟚",
    "Tab\tafter\ttab\n\tindent",
]

# Qwen2's split regex, as published in Qwen2's tokenizer.json (pre_tokenizer.pretokenizers[0]).
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def mismatches(ours, oracle_ids, texts=CORPUS):
    return [(t, ours(t), oracle_ids(t)) for t in texts if ours(t) != oracle_ids(t)]


# -----------------------------------------------------------------------------------------------
# Fixtures: the real SmolLM2 tokenizer (slow) and a small Qwen-style one trained here (fast)

@pytest.fixture(scope="module")
def smollm_meta(smollm2_path):
    return GGUFFile(smollm2_path).metadata


@pytest.fixture(scope="module")
def smollm(smollm_meta):
    return Tokenizer.from_gguf_metadata(smollm_meta)


@pytest.fixture(scope="module")
def hf_gguf(smollm2_path):
    """transformers' tokenizer for the GGUF file, as `AutoTokenizer` loads it (a few seconds)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def smollm_oracle(hf_gguf):
    """The same BPE with SmolLM2's published pre-tokenizer: each digit alone, then byte-level GPT-2."""
    tok = HFTokenizer.from_str(hf_gguf.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


def train_qwen_style(extra_added: tuple[str, ...] = ()) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    tok.add_tokens(list(extra_added))
    return tok


@pytest.fixture(scope="module")
def qwen_oracle():
    return train_qwen_style(extra_added=("<custom>",))


@pytest.fixture(scope="module")
def qwen_dir(qwen_oracle, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_style")
    qwen_oracle.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": "{{ messages[0]['content'] }}",
    }))
    return folder


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return Tokenizer.from_hf_json(qwen_dir)


# -----------------------------------------------------------------------------------------------
# SmolLM2 from the real GGUF file

def test_corpus_is_big_enough():
    assert len(CORPUS) >= 40


@pytest.mark.slow
def test_smollm_ids_match_the_tokenizers_library(smollm, smollm_oracle):
    assert mismatches(smollm.encode, lambda t: smollm_oracle.encode(t).ids) == []


@pytest.mark.slow
def test_gpt2_pretokenizer_ids_match_transformers_loading_the_gguf(smollm_meta, hf_gguf):
    """transformers' GGUF loader splits like GPT-2 whatever tokenizer.ggml.pre says; so do we with "gpt2"."""
    as_gpt2 = Tokenizer.from_gguf_metadata({**smollm_meta, "tokenizer.ggml.pre": "gpt2"})
    assert mismatches(as_gpt2.encode, hf_gguf.encode) == []


@pytest.mark.slow
def test_smollm_digit_split_changes_ids_where_whitespace_meets_a_digit(smollm, hf_gguf, smollm_oracle):
    # "a   1": GPT-2 gives "a" "  " " 1"; SmolLM first isolates "1", leaving "a" "   " "1".
    assert smollm.encode("a   1") == smollm_oracle.encode("a   1").ids != hf_gguf.encode("a   1")


@pytest.mark.slow
def test_pretokenizer_pieces_match_the_tokenizers_library(smollm, smollm_oracle):
    for text in CORPUS:
        ours = ["".join(BYTE_TO_SYMBOL[b] for b in w.encode()) for w in smollm.pretokenize(text)]
        theirs = [w for w, _ in smollm_oracle.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == theirs, text


@pytest.mark.slow
def test_smollm_facts(smollm):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_id, smollm.eos_id, smollm.pad_id, smollm.unk_id) == (1, 2, 2, 0)
    assert (smollm.bos_token, smollm.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm.add_bos is False and smollm.encode("hi")[0] != smollm.bos_id
    assert smollm.encode("hi", add_bos=True)[0] == smollm.bos_id
    assert smollm.chat_template.startswith("{% for message in messages %}")
    assert sorted(smollm.special_ids) == list(range(17))
    assert smollm.id_to_token[1] == "<|im_start|>" and smollm.token_to_id["<|im_end|>"] == 2


@pytest.mark.slow
def test_from_gguf_takes_a_path_or_an_open_file(smollm, smollm2_path):
    text = "Hello 12345 <|im_start|>user"
    assert Tokenizer.from_gguf(smollm2_path).encode(text) == smollm.encode(text)
    assert Tokenizer.from_gguf(GGUFFile(smollm2_path)).encode(text) == smollm.encode(text)


@pytest.mark.slow
def test_smollm_decode_round_trips_and_matches_the_oracle(smollm, smollm_oracle):
    for text in CORPUS:
        ids = smollm.encode(text)
        assert smollm.decode(ids) == text
        for skip in (False, True):
            assert smollm.decode(ids, skip_special_tokens=skip) == smollm_oracle.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_bytes_without_a_token_are_dropped_like_the_oracle(smollm, smollm_oracle):
    # SmolLM2's vocabulary has no token for the byte 0x04 (nor 0x06, 0x13, ...): both drop it.
    for text in ("a\x04b", "\x04", "x\x06\x13y"):
        assert smollm.encode(text) == smollm_oracle.encode(text).ids


@pytest.mark.slow
def test_smollm_tokenizer_json_gives_the_same_ids(smollm, smollm_oracle, tmp_path):
    smollm_oracle.save(str(tmp_path / "tokenizer.json"))
    from_json = Tokenizer.from_hf_json(tmp_path / "tokenizer.json")
    assert mismatches(from_json.encode, smollm.encode) == []


@pytest.mark.slow
@pytest.mark.ch06_bpe_merge
def test_bpe_merge_matches_the_tokenizers_model_on_smollm_merges(impl, smollm_meta, smollm_oracle):
    g = impl("ch06_generation")
    ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(smollm_meta["tokenizer.ggml.merges"])}
    for text in CORPUS:
        for word, _ in smollm_oracle.pre_tokenizer.pre_tokenize_str(text):
            assert g.bpe_merge(list(word), ranks) == [t.value for t in smollm_oracle.model.tokenize(word)], word


@pytest.mark.slow
@pytest.mark.ch06_stream_detokenizer
def test_stream_detokenizer_on_smollm(impl, smollm):
    g = impl("ch06_generation")
    for text in CORPUS:
        ids = smollm.encode(text)
        stream = g.StreamDetokenizer(smollm)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == smollm.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces), text


# -----------------------------------------------------------------------------------------------
# A Qwen-style tokenizer.json (trained here, fast)

def test_qwen_style_ids_match_the_tokenizers_library(qwen, qwen_oracle):
    assert mismatches(qwen.encode, lambda t: qwen_oracle.encode(t).ids) == []


def test_qwen_style_decode_matches_the_oracle(qwen, qwen_oracle):
    for text in CORPUS + ["a <custom> b"]:
        ids = qwen.encode(text)
        assert qwen.decode(ids) == unicodedata.normalize("NFC", text)  # the normalizer composes é
        for skip in (False, True):
            assert qwen.decode(ids, skip_special_tokens=skip) == qwen_oracle.decode(ids, skip_special_tokens=skip)


def test_qwen_style_added_tokens_and_config(qwen, qwen_oracle):
    assert qwen.encode("a <custom> b<|im_end|>") == qwen_oracle.encode("a <custom> b<|im_end|>").ids
    assert qwen.eos_id == qwen.token_to_id["<|im_end|>"] and qwen.bos_id is None
    assert qwen.pad_id == qwen.token_to_id["<|endoftext|>"]
    assert qwen.chat_template == "{{ messages[0]['content'] }}"
    assert qwen.vocab_size == qwen_oracle.get_vocab_size(with_added_tokens=True)


def test_qwen2_gguf_pretokenizer_matches_the_tokenizers_library(qwen_oracle):
    """The same vocabulary as GGUF metadata with tokenizer.ggml.pre = "qwen2" (no normalizer: NFC text)."""
    spec = json.loads(qwen_oracle.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]],
        "tokenizer.ggml.token_type": [3 if t in special else 4 if t == "<custom>" else 1 for t in tokens],
    }
    ours = Tokenizer.from_gguf_metadata(meta)
    texts = [unicodedata.normalize("NFC", t) for t in CORPUS]
    assert mismatches(ours.encode, lambda t: qwen_oracle.encode(t).ids, texts) == []


@pytest.mark.ch06_bpe_merge
def test_bpe_merge_textbook_example(impl):
    g = impl("ch06_generation")
    ranks = {("l", "o"): 0, ("lo", "w"): 1, ("e", "r"): 2, ("low", "er"): 3, ("n", "e"): 4}
    assert g.bpe_merge(list("lower"), ranks) == ["lower"]
    assert g.bpe_merge(list("newer"), ranks) == ["ne", "w", "er"]
    assert g.bpe_merge(list("lowlow"), ranks) == ["low", "low"]
    assert g.bpe_merge(list("xyz"), ranks) == ["x", "y", "z"]
    assert g.bpe_merge(["a"], ranks) == ["a"]
    # every occurrence of the best pair merges, left to right: "aaa" -> "aa" "a"
    assert g.bpe_merge(list("aaa"), {("a", "a"): 0}) == ["aa", "a"]


@pytest.mark.ch06_bpe_merge
def test_bpe_merge_matches_the_tokenizers_model(impl, qwen_oracle):
    g = impl("ch06_generation")
    spec = json.loads(qwen_oracle.to_str())
    ranks = {tuple(m.split(" ") if isinstance(m, str) else m): r for r, m in enumerate(spec["model"]["merges"])}
    for text in CORPUS:
        for word, _ in qwen_oracle.pre_tokenizer.pre_tokenize_str(unicodedata.normalize("NFC", text)):
            assert g.bpe_merge(list(word), ranks) == [t.value for t in qwen_oracle.model.tokenize(word)], word


@pytest.mark.ch06_stream_detokenizer
def test_stream_detokenizer_never_splits_a_character(impl, qwen):
    g = impl("ch06_generation")
    texts = [unicodedata.normalize("NFC", t) for t in CORPUS]
    for text in texts:
        ids = qwen.encode(text)
        stream = g.StreamDetokenizer(qwen)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == qwen.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces), text
    # a 600-token vocabulary spells CJK and emoji byte by byte: the held-back bytes show
    ids = qwen.encode("语")
    assert len(ids) == 3
    stream = g.StreamDetokenizer(qwen)
    assert [stream.push(i) for i in ids] == ["", "", "语"] and stream.flush() == ""


@pytest.mark.ch06_stream_detokenizer
def test_stream_detokenizer_skips_special_tokens_when_asked(impl, qwen):
    g = impl("ch06_generation")
    ids = qwen.encode("<|im_start|>user 你好<|im_end|> <custom>")
    for skip in (False, True):
        stream = g.StreamDetokenizer(qwen, skip_special_tokens=skip)
        text = "".join(stream.push(i) for i in ids) + stream.flush()
        assert text == qwen.decode(ids, skip_special_tokens=skip)


@pytest.mark.ch06_stream_detokenizer
def test_stream_detokenizer_flushes_an_unfinished_character(impl, qwen):
    g = impl("ch06_generation")
    ids = qwen.encode("ok 语")[:-1]  # the last byte of 语 never arrives
    stream = g.StreamDetokenizer(qwen)
    assert "".join(stream.push(i) for i in ids) == "ok "
    assert stream.flush() == "\ufffd"
    assert qwen.decode(ids) == "ok \ufffd"


# -----------------------------------------------------------------------------------------------
# Errors

def test_unknown_pretokenizer_is_refused_with_the_supported_list(qwen_oracle):
    spec = json.loads(qwen_oracle.to_str())
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get),
            "tokenizer.ggml.merges": []}
    with pytest.raises(ValueError, match=r"llama-bpe.*gpt2.*qwen2.*smollm"):
        Tokenizer.from_gguf_metadata(meta)


def test_unsupported_tokenizer_model_is_refused():
    with pytest.raises(ValueError, match="llama"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


def test_unknown_hf_pretokenizer_is_refused(qwen_oracle, tmp_path):
    spec = json.loads(qwen_oracle.to_str())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="Metaspace"):
        Tokenizer.from_hf_json(tmp_path / "tokenizer.json")


def test_decode_refuses_ids_outside_the_vocabulary(qwen):
    with pytest.raises(ValueError, match=str(qwen.vocab_size)):
        qwen.decode([qwen.vocab_size])


# -----------------------------------------------------------------------------------------------
# Issue 21: what a client can make the tokenizer do

@pytest.mark.slow
def test_a_32k_character_word_is_merged_in_n_log_n_and_equals_the_oracle(smollm, smollm_oracle):
    import random
    import time
    rng = random.Random(0)
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(32_000))
    start = time.perf_counter()
    ids = smollm.encode(word)
    seconds = time.perf_counter() - start
    assert ids == smollm_oracle.encode(word).ids
    assert seconds < 5  # about 0.1 s; the quadratic merge loop took over 20 s


def test_encode_refuses_a_text_too_long_for_max_tokens_before_any_merge(qwen, monkeypatch):
    from minillm.generation import tokenizer as tokenizer_module
    monkeypatch.setattr(tokenizer_module, "bpe_merge", lambda *a: pytest.fail("BPE ran on a text known too long"))
    with pytest.raises(tokenizer_module.TooManyTokens, match="characters long"):
        qwen.encode("x" * (10 * qwen.max_token_chars + 1), max_tokens=10)


def test_encode_stops_as_soon_as_the_count_passes_max_tokens(qwen, qwen_oracle):
    from minillm.generation.tokenizer import TooManyTokens
    text = CORPUS[0]
    n = len(qwen_oracle.encode(text).ids)
    assert qwen.encode(text, max_tokens=n) == qwen_oracle.encode(text).ids
    with pytest.raises(TooManyTokens):
        qwen.encode(text, max_tokens=n - 1)


def test_special_tokens_can_be_plain_text(qwen):
    special = next(iter(qwen.added_token_ids))
    text = f"a{special}b"
    assert qwen.added_token_ids[special] not in qwen.encode(text, special=False)
    assert qwen.decode(qwen.encode(text, special=False)) == text


def test_the_word_cache_is_bounded_by_bytes_and_skips_long_words(qwen, monkeypatch):
    monkeypatch.setattr(qwen, "CACHE_BYTES", 20_000)
    qwen._word_cache.clear()
    qwen._word_cache_bytes = 0
    long_word = "q" * (qwen.CACHE_LONGEST_WORD + 1)
    qwen.encode(long_word)
    assert long_word not in qwen._word_cache
    for i in range(400):
        qwen.encode("".join(chr(ord("a") + (i // 26**k) % 26) for k in range(3)) * 60)  # distinct 180-letter words
        held = sum(len(w.encode()) + 8 * len(ids) + 100 for w, ids in qwen._word_cache.items())
        assert held <= 20_000
