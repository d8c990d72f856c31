"""Conversation formats, built-in chat templates and the assistant-only loss mask.

Oracles: transformers' own ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on a
template with ``{% generation %}``; the published strings of each built-in format; HF's
sandboxed Jinja rendering of the same formats written as templates.
"""

import json
import os

import numpy as np
import pytest

from megatron.data import chat_templates as ct
from tests.helpers.paths import SHARED_DATA

SP_MODEL = os.path.join(SHARED_DATA, "sentencepiece-llama-32k.model")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "bye now"},
        {"role": "assistant", "content": "goodbye friend"}]

# ChatML with {% generation %} around what the model writes (content, end marker, newline).
CHATML_GEN = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
              "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
              "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same format without markers: the prefix rule must give the same mask.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_hf_folder(path, template, model="wordlevel"):
    """A PreTrainedTokenizerFast (WordLevel or BPE) with ChatML specials, saved to ``path``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = "system user assistant be brief . hi there hello friend bye now goodbye what is 2 + 4 ?".split()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
    if model == "wordlevel":
        vocab = {w: i for i, w in enumerate(specials + words + ["\n", " "])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[ \n.?+]"), behavior="isolated")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([" ".join(words)] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", additional_special_tokens=specials[1:3])
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("model", ["wordlevel", "bpe"])
@pytest.mark.parametrize("template", [CHATML_GEN, CHATML], ids=["generation", "no-generation"])
def test_mask_equals_transformers_generation_mask(tmp_path, model, template):
    from transformers import AutoTokenizer

    folder = _tiny_hf_folder(tmp_path / "tok", template, model)
    chat = ct.HFChatTokenizer(folder)
    ref = AutoTokenizer.from_pretrained(folder)
    ref.chat_template = CHATML_GEN  # the oracle: transformers' own generation mask
    for messages in (CHAT, CHAT[1:3], CHAT[:3]):
        ids, mask = chat.encode(messages)
        out = ref.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.tolist() == list(out["assistant_masks"])
        assert 0 < mask.sum() < len(mask)


def test_mask_covers_each_assistant_turn_and_end_marker(tmp_path):
    folder = _tiny_hf_folder(tmp_path / "tok", CHATML)
    chat = ct.HFChatTokenizer(folder)
    ids, mask = chat.encode(CHAT)
    toks = chat.tok.convert_ids_to_tokens(ids.tolist())
    assert [t for t, m in zip(toks, mask) if m] == ["hello", " ", "friend", "<|im_end|>", "\n",
                                                    "goodbye", " ", "friend", "<|im_end|>", "\n"]


def test_hf_folder_with_custom_code_is_refused(tmp_path):
    folder = _tiny_hf_folder(tmp_path / "tok", CHATML)
    (tmp_path / "tok" / "tokenization_evil.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(ValueError, match="ships Python code"):
        ct.HFChatTokenizer(folder)
    os.remove(tmp_path / "tok" / "tokenization_evil.py")
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.Evil", None]}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="auto_map"):
        ct.HFChatTokenizer(folder)


# Drops earlier assistant turns unless last: prefixes are not prefixes of the whole.
REWRITING = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
             "{{ m['role'] }} {{ m['content'] }} {% endif %}{% endfor %}")
STRICT = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
          "{% endif %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("template, match", [(REWRITING, "not a prefix"), (STRICT, "no system role")],
                         ids=["rewrites-history", "raises"])
def test_unmaskable_conversation_is_reported(tmp_path, template, match):
    chat = ct.HFChatTokenizer(_tiny_hf_folder(tmp_path / "tok", template))
    with pytest.raises(ct.ConversationError, match=match):
        chat.encode(CHAT)
    if template is STRICT:
        assert chat.encode(CHAT[1:3])[1].sum() > 0


def test_formats_detected_and_converted():
    assert ct.to_messages({"messages": CHAT}) == CHAT
    share = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}]}
    assert ct.detect_format(share) == "sharegpt"
    assert ct.to_messages(share) == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "a"}]
    alpaca = {"instruction": "Add", "input": "2 and 2", "output": "4"}
    assert ct.detect_format(alpaca) == "alpaca"
    assert ct.to_messages(alpaca) == [{"role": "user", "content": "Add\n\n2 and 2"},
                                      {"role": "assistant", "content": "4"}]
    assert ct.to_messages({"instruction": "Hi", "input": "", "output": "Yo"})[0]["content"] == "Hi"
    # A named format (--conversation-format) is not guessed: a line of another format is an error.
    with pytest.raises(ct.ConversationError, match="Alpaca record without"):
        ct.to_messages({"messages": CHAT}, "alpaca")
    with pytest.raises(ct.ConversationError, match="no 'conversations'"):
        ct.to_messages({"messages": CHAT}, "sharegpt")
    for bad, match in (({"text": "x"}, "no conversation"),
                       ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                       ({"messages": [{"role": "user", "content": 3}]}, "expected a string"),
                       ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown speaker"),
                       ({"messages": []}, "non-empty")):
        with pytest.raises(ct.ConversationError, match=match):
            ct.to_messages(bad)


def test_builtin_strings():
    """The published strings of each format, character for character."""
    two = CHAT[:3]
    assert ct.render_llama2(CHAT, False) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi there [/INST] hello friend </s>"
        "<s>[INST] bye now [/INST] goodbye friend </s>")
    assert ct.render_llama3(two, True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nhello friend<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ct.render_chatml(two[1:2], True) == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ct.ConversationError, match="alternating"):
        ct.render_llama2([{"role": "assistant", "content": "x"}], False)


# HF's Llama-2-chat template (meta-llama/Llama-2-7b-chat-hf tokenizer_config.json), run in the
# sandbox: the built-in llama2 renderer must give the same text.
LLAMA2_HF = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")


def test_builtin_llama2_and_chatml_equal_hf_templates():
    from transformers.utils.chat_template_utils import render_jinja_template

    def hf(template, messages, gen):
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                            add_generation_prompt=gen, bos_token="<s>", eos_token="</s>")
        return rendered[0]

    for messages in (CHAT, CHAT[1:], CHAT[:2]):
        assert ct.render_llama2(messages, False) == hf(LLAMA2_HF, messages, False)
        for gen in (False, True):
            assert ct.render_chatml(messages, gen) == hf(CHATML, messages, gen)


@pytest.mark.skipif(not os.path.isfile(SP_MODEL), reason=f"{SP_MODEL} is not present on this machine")
@pytest.mark.parametrize("template", sorted(ct.BUILTIN_TEMPLATES))
def test_sentencepiece_mask_is_exactly_the_assistant_text(template):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=SP_MODEL)
    chat = ct.SentencePieceChatTokenizer(SP_MODEL, template)
    ids, mask = chat.encode(CHAT)
    assert ids.shape == mask.shape and 0 < mask.sum() < len(mask)
    # Decoding the masked runs gives each assistant turn with its end marker.
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    assert len(runs) == 2
    end = {"llama2": "</s>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>"}[template]
    for run, want in zip(runs, ("hello friend", "goodbye friend")):
        pieces = [sp.id_to_piece(i) for i in run]
        text = "".join(pieces).replace("\u2581", " ")
        assert want in text and end in text, (template, pieces)
    if template == "llama2":  # BOS/EOS are the model's ids, never text; ids equal Meta's dialog encoding
        assert ids.tolist() == ([sp.bos_id()] + sp.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi there "
                                                          "[/INST] hello friend ") + [sp.eos_id(), sp.bos_id()]
                                + sp.encode("[INST] bye now [/INST] goodbye friend ") + [sp.eos_id()])
        assert [sp.id_to_piece(i) for i, m in zip(ids, mask) if m][-1] == "</s>"


def test_mask_from_offsets():
    got = ct.mask_from_offsets([(0, 2), (2, 5), (5, 6), (6, 9)], [(2, 6)])
    assert got.tolist() == [0, 1, 1, 0] and got.dtype == np.uint8


@pytest.mark.skipif(not os.path.isfile(SP_MODEL), reason=f"{SP_MODEL} is not present on this machine")
@pytest.mark.parametrize("template", sorted(ct.BUILTIN_TEMPLATES))
def test_sentencepiece_mask_with_non_ascii_text(template):
    """UTF-8 byte offsets mapped back to characters: the masked ids decode to the reply."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=SP_MODEL)
    reply = "Grüße aus Köln, 日本語も"
    messages = [{"role": "user", "content": "Schöne Grüße? ça va"}, {"role": "assistant", "content": reply}]
    ids, mask = ct.SentencePieceChatTokenizer(SP_MODEL, template).encode(messages)
    masked = sp.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if m])
    unmasked = sp.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if not m])
    assert masked.strip().startswith(reply) and "Köln" not in unmasked and "ça va" in unmasked
