"""Tokenizer: `tokenizer.json` through the `tokenizers` library."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the model folder needs tokenizer.json to take text")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
            raise ValueError(f"{path}: not a readable tokenizer ({exc})") from None
        self._byte_level = _byte_level_table() if isinstance(self._tok.decoder, decoders.ByteLevel) else None
        self._special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False`: text that writes its special tokens itself (a rendered chat template)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, also when they are only part of a UTF-8 character
        (a byte-level BPE piece, a `<0xNN>` byte-fallback token); a special token's are those of
        its decoded text (empty)."""
        piece = self._tok.id_to_token(token)
        if piece is not None and token not in self._special:
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
        return self.decode([token]).encode("utf-8")

    def to_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what the grammar engine reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
