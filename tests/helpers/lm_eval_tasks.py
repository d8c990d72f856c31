"""A tiny model and three harness tasks over local JSON files for the lm-evaluation-harness
backend's test: a byte-pair tokenizer trained here, the three request types of the harness
(multiple choice: ``loglikelihood``; ``loglikelihood_rolling``; ``generate_until``)."""

from __future__ import annotations

import json
import os

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot and the sky is blue",
         "birds sing in the morning", "we eat bread and drink milk", "the sea is deep and wide",
         "she reads a book at night", "the old man walks to town", "rain falls on the green hill",
         "my friend plays the drum"]
TASKS = ("tiny_choice", "tiny_rolling", "tiny_until")


def make_tokenizer(folder: str, vocab_size: int = 200) -> None:
    """A byte-pair tokenizer trained on :data:`TEXTS` (``<s>`` BOS 0, ``</s>`` EOS 1, ``<unk>``),
    saved as ``tokenizer.json`` + ``tokenizer_config.json`` that ``transformers`` and our
    ``HuggingFaceTokenizer`` both read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(TEXTS * 4, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 256,
                   "clean_up_tokenization_spaces": False}, f)


def make_tasks(folder: str) -> str:
    """Write the three task YAMLs and their JSON-lines data under ``folder``; returns it (the
    harness's ``include_path``)."""
    docs = []
    for i, text in enumerate(TEXTS):
        words = text.split()
        wrong = [" ".join(words[:-1] + [TEXTS[(i + k) % len(TEXTS)].split()[-1]]) for k in (1, 2, 3)]
        docs.append({"prefix": " ".join(words[:3]), "rest": " " + " ".join(words[3:]),
                     "choices": [" " + " ".join(c.split()[3:]) for c in [text] + wrong],
                     "answer": 0, "text": text})
    data = os.path.join(folder, "docs.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\n")
    yamls = {
        "tiny_choice": "output_type: multiple_choice\ndoc_to_text: '{{prefix}}'\n"
                       "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
                       "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "tiny_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
                        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "tiny_until": "output_type: generate_until\ndoc_to_text: '{{prefix}}'\n"
                      "doc_to_target: '{{rest}}'\ngeneration_kwargs:\n  until: [\"\\n\", \"park\"]\n"
                      "  max_gen_toks: 6\n  do_sample: false\n"
                      "metric_list:\n  - metric: exact_match\n",
    }
    for name, body in yamls.items():
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(f"task: {name}\n{common}{body}")
    return folder
