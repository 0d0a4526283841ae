"""A character-level tokenizer for the built-in tiny model, wrapped as `transformers.PreTrainedTokenizerFast`.

Why characters: the tiny model learns arithmetic (and later small text envs) from scratch in seconds; one token per
character keeps the vocabulary small and makes every digit its own decision, which is what RL then improves.

Why it is a byte-level BPE with *no merges* (one token per byte, so one per ASCII character) rather than a WordLevel
model: transformers 5.19's `AutoTokenizer` ignores `tokenizer_class` for `model_type: qwen2` (it is listed in
`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`) and rebuilds the tokenizer as `Qwen2Tokenizer`, keeping only the vocabulary
and merges of `tokenizer.json` and imposing Qwen2's byte-level BPE pipeline. A WordLevel vocabulary then loses spaces
and newlines (seen: held-out accuracy 29.5% -> 1%). Built here *as* that pipeline (NFC, Qwen2's split, byte-level
with all 256 bytes, no merges), the tokenizer encodes and decodes identically whichever class loads it, and any UTF-8
text round-trips (non-ASCII characters become several byte tokens). `save_char_tokenizer` still pins
`tokenizer_class`, then reloads through `AutoTokenizer` and checks a round trip, so a regression fails at build time.

Extending: change the vocabulary or specials only with a bump of `KIT_VERSION` in `astratk.models.cache` (ids move).

Example:
    >>> tok = build_char_tokenizer()
    >>> tok.decode(tok("1 + 2\\n")["input_ids"])
    '1 + 2\\n'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS = "<|endoftext|>"  # end of text; also the padding token
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of turn: where a completion stops
# Never produced (every byte has a token); named so that classes defaulting unk to <|endoftext|> (Qwen2Tokenizer)
# do not alias it with eos, which `astratk.models.chat.stop_token_ids` would then drop.
UNK = "<|unk|>"
SPECIALS = (EOS, IM_START, IM_END, UNK)  # ids 0..3; byte b has id 4 + b
# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2): without merges it changes nothing, it
# is here so the pipeline equals the one Qwen2Tokenizer rebuilds on reload.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen-style ChatML, without Qwen's default system prompt (the tiny model never saw one). The first version, kept to
# recognise tokenizers saved with it (`upgrade_chat_template`), rendered plain messages exactly as the current one.
CHAT_TEMPLATE_V1 = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# With tools (OpenAI-style function definitions) the template opens with a compact system turn, short enough for a
# character-level model: "tools: name(arg, ...) ..." after the system message's own content. An assistant message's
# `tool_calls` follow its content as Hermes/Qwen-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (the
# format `astratk.models.chat.parse_tool_calls` reads); a tool result is a `tool` turn. Plain messages render exactly
# as in the first version.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] + '\n' }}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{{ 'tools:' }}"
    "{%- for tool in tools -%}"
    "{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set props = (f['parameters'] or {}).get('properties', {}) if f['parameters'] is defined else {} -%}"
    "{{ ' ' + f['name'] + '(' + (props.keys() | list | join(',')) + ')' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) -%}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (space -> 'Ġ', newline -> 'Ċ'), as ByteLevel expects."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (so per ASCII character) plus the ChatML special tokens; 260 ids."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({sym: len(SPECIALS) + b for b, sym in enumerate(_byte_symbols())})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    # Special tokens are atomic in text: "<|im_end|>" is one id, not ten characters.
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=EOS, unk_token=UNK,
        extra_special_tokens=[IM_START, IM_END], padding_side="left", model_max_length=256,
    )
    tok.chat_template = CHAT_TEMPLATE
    assert [tok.convert_tokens_to_ids(t) for t in SPECIALS] == [0, 1, 2, 3] and len(tok) == 260
    return tok


def upgrade_chat_template(tok: Any) -> Any:
    """Give a tokenizer saved with the tiny model's first template the current one (same rendering of plain messages,
    plus tools and tool calls); any other template is left alone. Returns `tok`."""
    if getattr(tok, "chat_template", None) == CHAT_TEMPLATE_V1:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save_char_tokenizer(tok: PreTrainedTokenizerFast, directory: str | Path) -> None:
    """Save with the class pinned, then reload through `AutoTokenizer` and verify (see the module docstring)."""
    directory = Path(directory)
    tok.save_pretrained(str(directory))
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    check_round_trip(AutoTokenizer.from_pretrained(str(directory)), tok)


ROUND_TRIP_SAMPLE = "12+345=357\n  a b\tZ~ é{}"


def check_round_trip(loaded: object, reference: PreTrainedTokenizerFast) -> None:
    """Raise if `loaded` does not tokenize like `reference`: ids, decoding, specials and chat template."""
    chat = [{"role": "user", "content": "1 +\n2="}]
    ids = reference(ROUND_TRIP_SAMPLE)["input_ids"]
    problems = []
    if loaded(ROUND_TRIP_SAMPLE)["input_ids"] != ids:  # type: ignore[operator]
        problems.append("ids differ")
    if loaded.decode(ids) != ROUND_TRIP_SAMPLE:  # type: ignore[attr-defined]
        problems.append("decode changes the text")
    for name in ("eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(loaded, name) != getattr(reference, name):
            problems.append(f"{name} differs")
    if loaded.convert_tokens_to_ids(IM_END) != reference.convert_tokens_to_ids(IM_END):  # type: ignore[attr-defined]
        problems.append("<|im_end|> id differs")
    want = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    got = loaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    if got != want:
        problems.append("chat template differs")
    if problems:
        raise RuntimeError(f"the character tokenizer does not survive AutoTokenizer.from_pretrained as "
                           f"{type(loaded).__name__} ({'; '.join(problems)}); this transformers version rebuilds it "
                           "differently: see astratk/models/tokenizer.py's docstring")
