"""The toy target's byte-level tokenizer, in the transformers format.

Token id b (0..255) is the byte b, so any text round-trips; four special tokens follow:

    256 <|endoftext|>  end of a document, also the pad token
    257 <|im_start|>   chat turn start
    258 <|im_end|>     chat turn end, the EOS of a chat completion
    259 <|mask|>       reserved for the drafter's mask token; never in training text

The chat template is ChatML, as in Qwen models:
`<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID = 256, 257, 258, 259
VOCAB_SIZE = 260

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer: BPE with no merges over the 256 byte symbols, plus the specials."""
    vocab = {char: b for b, char in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        chat_template=CHAT_TEMPLATE,
    )
    ids = fast.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != [ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID] or len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"byte tokenizer built with unexpected special ids {ids} / size {len(fast)}")
    return fast
