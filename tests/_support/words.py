"""Tiny MLM data that needs no hub: a word-level tokenizer and sentences whose lengths vary (so HF's collators pad
each batch to its own longest sample). Used by the dynamic-padding, Trainer and TRL tests and the Trainer benchmark.

Importing this module imports transformers (after :func:`tests._support.vision.define_torchvision_schemas`)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from tests._support.vision import define_torchvision_schemas

define_torchvision_schemas()  # transformers imports torchvision when it is installed
import transformers  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
#: the words of :class:`Sentences` (ids 5..31 of a default :class:`WordTokenizer`)
WORDS = [f"w{i}" for i in range(27)]


class WordTokenizer(transformers.PreTrainedTokenizer):
    """A word-level tokenizer: ids 0-4 are ``SPECIAL``, then ``words`` words ``w0, w1, ...``; what
    ``DataCollatorForLanguageModeling`` pads and masks with."""

    def __init__(self, words: int = len(WORDS), **kwargs: Any) -> None:
        self._tokens = SPECIAL + [f"w{i}" for i in range(words)]
        self._vocab = {t: i for i, t in enumerate(self._tokens)}
        super().__init__(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                         mask_token="[MASK]", **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict:
        return dict(self._vocab)

    def _tokenize(self, text: str) -> list:
        return text.split()

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, 1)

    def _convert_id_to_token(self, index: int) -> str:
        return self._tokens[index]


class Sentences(Dataset):
    """``n`` samples; sample ``i``: ``[CLS]``, 3 to 11 of ``WORDS``, ``[SEP]`` (a length that varies)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        words = 3 + (i * 5) % 9
        return {"input_ids": [2] + [5 + (i * 7 + 3 * j) % 27 for j in range(words)] + [3]}
