"""Chat tokenizers built locally with `tokenizers` (no model hub) for the agent tests: a
Qwen2-style one (ChatML, `<|im_end|>` then a newline, tool schemas in the system prompt,
tool results grouped into one user turn of `<tool_response>` blocks) and a Llama-3-style
one (`<|eot_id|>` with no separator, an `ipython` role for tool results, a tokenizer
`eos_token` that is NOT the end-of-turn token, as Llama-3 base tokenizers have, and the
end-of-turn ids as a generation-config list). Both are real byte-level BPEs with merges,
so token boundaries matter.
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|finetune_right_pad_id|>",
]

QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within "
    "<tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none and tools is defined %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{%- if tools is not none and tools is defined %}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role in ['ipython', 'tool'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' "
    "+ message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_CORPUS = [
    "What is 123 times 456? Use the calculator.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>',
    "The answer is 56088. The result of the calculation is shown above.",
    "You are a helpful assistant. Hello there. General Kenobi.",
    "error: unknown tool; timed out after 5 seconds",
    "multiply add subtract divide numbers digits 0123456789 + - * / ( ) = ,.:;",
    "system user assistant tool ipython environment function arguments expression name",
] * 20


@functools.cache
def _bpe(special: tuple[str, ...]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=2,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _wrap(tok: Tokenizer, template: str, **special: str):
    from transformers import PreTrainedTokenizerFast

    out = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()), **special)
    out.chat_template = template
    return out


def qwen2_tokenizer():
    """Qwen2-style: eos `<|im_end|>` (the end-of-turn token), separator a newline."""
    return _wrap(
        _bpe(tuple(QWEN_SPECIAL)), QWEN_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def llama3_tokenizer():
    """Llama-3-style: the tokenizer's eos is `<|end_of_text|>`; turns end with
    `<|eot_id|>`, which only the generation config's eos list names (`llama3_eos_ids`)."""
    return _wrap(
        _bpe(tuple(LLAMA_SPECIAL)),
        LLAMA_TEMPLATE,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|finetune_right_pad_id|>",
    )


def llama3_eos_ids(tok) -> list[int]:
    """generation_config.eos_token_id of Llama-3 instruct models: a list."""
    return [tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
