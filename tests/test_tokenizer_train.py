"""train_tokenizer (tokenizers' BPE trainer) and the shipped gutenberg-8k tokenizer: round trips
and the EOS id the token files rely on."""
from echo_tp.models.tokenize import build_tokenizer, train_tokenizer

TEXT = "It was the best of times, it was the worst of times; naïve café — 1862.\n" * 50


def test_train_tokenizer_round_trip(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(TEXT, encoding="utf-8")
    path = train_tokenizer([src], 300, tmp_path / "tok")
    tok = build_tokenizer(path.parent)
    ids = tok.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    assert tok.get_vocab_size() <= 300 and tok.token_to_id("<|endoftext|>") == 0
    assert len(ids) < len(TEXT.encode()) / 2          # it learned merges


def test_shipped_gutenberg_tokenizer():
    tok = build_tokenizer("gutenberg-8k")
    assert tok.get_vocab_size() == 8192 and tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode(tok.encode(TEXT).ids) == TEXT
