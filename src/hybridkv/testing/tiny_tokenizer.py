"""A real ``transformers`` tokenizer over a small English word list, for the tiny random models (vocabulary 256).

Text clients (an evaluation harness, a chat client) need a tokenizer saved beside the weights, as a real model
directory has; the built-in byte tokenizer is the server's own, not one a client can load. ``word_tokenizer()`` is
a ``tokenizers`` WordLevel model over ``SPECIALS + WORDS`` that splits text on whitespace, wrapped in
``PreTrainedTokenizerFast``; ``save_tiny_model(directory)`` saves a tiny random model and that tokenizer together.

Invariants:
- Every id is below ``VOCAB`` (256, every tiny model's vocabulary): ``len(SPECIALS) + len(WORDS) <= VOCAB``.
- Ids are fixed: ``<pad>`` 0, ``<unk>`` 1, ``<eos>`` 2, then ``WORDS[i]`` is ``3 + i``; a word outside the list
  encodes to ``<unk>``. No special token is added on encoding (there is no bos).
- A text of listed words separated by single spaces encodes to one id per word and decodes back to itself, and
  ``encode(a + " " + b) == encode(a) + encode(b)`` (a harness's context/continuation split is exact).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.engine.random_models import VOCAB

SPECIALS = ("<pad>", "<unk>", "<eos>")
_WORD_TEXT = """
    the a an this that my your his her our their he she it we they one two three four five
    cat dog bird fish cow horse sheep mouse lion bee
    sun moon star sky rain snow wind cloud sea river lake hill tree leaf flower grass
    house door window roof bed table chair cup plate spoon knife book pen paper
    bread milk cheese apple egg honey water tea soup cake
    red blue green black white yellow big small hot cold
    is are was sat ran flew swam ate drank read wrote sleeps sings shines falls grows
    on in under over at to from with of and
    day night morning winter summer
"""
WORDS = tuple(_WORD_TEXT.split())


def word_tokenizer(words: tuple[str, ...] = WORDS) -> Any:
    """The ``PreTrainedTokenizerFast`` over ``SPECIALS + words`` (see the module's invariants)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    if len(vocab) > VOCAB or len(vocab) != len(SPECIALS) + len(words):
        raise ValueError(f"{len(words)} words (distinct, none special) and {len(SPECIALS)} specials exceed {VOCAB} ids")
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by single spaces
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def save_tiny_model(directory: str | Path, name: str = "tiny-qwen3-next") -> Any:
    """Save the tiny random model ``name`` (fp32) and ``word_tokenizer()`` into ``directory``, a model directory
    that ``hybridkv serve --model`` and ``transformers`` both load; returns the ``transformers`` model."""
    from hybridkv.engine.random_models import save_random

    model = save_random(name, str(directory))
    word_tokenizer().save_pretrained(str(directory))
    return model
