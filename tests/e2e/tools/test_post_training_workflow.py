"""The user's whole post-training way (slow tier), fp32 and bf16: a transformers LLaMA with an HF
tokenizer folder (WordLevel, ChatML template) -> ``tools/checkpoint/convert.py`` at TP=2 x PP=2
-> SFT on packed chat data (``tools/preprocess_sft_data.py``) -> DPO on preference pairs -> export
to HF (the chat template travels with the tokenizer files) -> transformers generates greedily
from a chat-template prompt, and says the preferred "hello friend".

The preference data is learnable by construction: every chosen reply starts "hello friend" and
every rejected one "goodbye now", followed by the same random words; prompts are random word
sequences. A held-out 25% of the pairs (``--split 75,25,0``, pairs the policy never trained on)
must then be ranked right by the DPO rewards more often than chance: the final validation
``rewards/accuracies`` above 0.5 (the oracle: chance, 0.5, and the reference's own 0 margin).
"""

import json
import os

import numpy as np
import pytest

from tests.helpers.convert import HF_MODEL_FLAGS, convert, make_hf
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import run_finetune

pytest.importorskip("transformers")

WORDS = "what is 2 + 4 ? hi there hello friend bye now be brief".split()
SEQ = 48
FLAGS = HF_MODEL_FLAGS + [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--make-vocab-size-divisible-by", "1", "--seq-length", str(SEQ),
    "--lr-decay-style", "constant", "--weight-decay", "0.0", "--clip-grad", "1.0",
    "--log-interval", "5", "--eval-iters", "4", "--seed", "3", "--num-workers", "0",
]


def _write_data(folder, rng, pairs=160):
    """conversations.jsonl (the chosen replies) and preferences.jsonl (chosen vs rejected)."""
    conv, pref = [], []
    for _ in range(pairs):
        prompt = " ".join(rng.choice(WORDS, size=rng.randint(2, 6)))
        tail = " ".join(rng.choice(WORDS, size=rng.randint(1, 4)))
        chosen, rejected = f"hello friend {tail}", f"goodbye now {tail}"
        conv.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": chosen}]})
        pref.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    for name, rows in (("conversations.jsonl", conv), ("preferences.jsonl", pref)):
        with open(os.path.join(folder, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The HF model + tokenizer folder, its TP=2 x PP=2 conversion and the tokenized data."""
    from tests.unit.data.test_chat_templates import CHATML, _tiny_hf_folder
    from tools import preprocess_sft_data

    root = tmp_path_factory.mktemp("post_workflow")
    tokenizer = _tiny_hf_folder(root / "tokenizer", CHATML)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    hf = root / "hf"
    make_hf(str(hf), vocab=vocab)
    os.remove(hf / "tokenizer.model")  # make_hf's stand-in: the real folder goes beside the model
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(str(hf))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf, "--save-dir", root / "tp2pp2",
            "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2,
            "--make-vocab-size-divisible-by", 1)
    _write_data(str(root), np.random.RandomState(0))
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path", str(hf)]
    preprocess_sft_data.main(["--input", str(root / "conversations.jsonl"),
                              "--output-prefix", str(root / "sft"), *tok])
    preprocess_sft_data.main(["--input", str(root / "preferences.jsonl"),
                              "--output-prefix", str(root / "dpo"), *tok, "--preference-pairs"])
    return root, tok


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hf_to_sft_to_dpo_to_hf_generates(prepared, precision, tmp_path):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    root, tok = prepared
    half = ["--bf16"] if precision == "bf16" else []
    sft = FLAGS + tok + half + [
        "--load", str(root / "tp2pp2"), "--finetune", "--data-path", str(root / "sft_text_document"),
        "--split", "90,10,0", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "20", "--lr", "2e-3", "--eval-interval", "20",
        "--save", str(tmp_path / "sft"), "--save-interval", "20"]
    dpo = FLAGS + tok + half + [
        "--dpo", "--dpo-beta", "0.1", "--load", str(tmp_path / "sft"), "--finetune",
        "--data-path", str(root / "dpo_chosen_document"), "--split", "75,25,0",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "20",
        "--lr", "1e-3", "--eval-interval", "20",
        "--save", str(tmp_path / "dpo"), "--save-interval", "20"]
    out = run_distributed(4, run_finetune, [("sft", sft), ("dpo", dpo)], timeout=1800)[3]
    assert out["sft"]["lm loss"][-1] < out["sft"]["lm loss"][0]
    history = out["dpo"]
    assert history["dpo loss"][0] == pytest.approx(np.log(2), abs=1e-3 if half else 1e-6)
    held_out = history["final valid"]
    print(f"{precision}: DPO loss {history['dpo loss'][0]:.4f} -> {history['dpo loss'][-1]:.4f}, "
          f"held-out accuracy {held_out['rewards/accuracies']:.3f}, margin "
          f"{held_out['rewards/margins']:.3f}")
    assert held_out["rewards/accuracies"] > 0.5 and held_out["rewards/margins"] > 0

    export = tmp_path / "export"
    convert("--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
            "--load-dir", tmp_path / "dpo", "--save-dir", export, "--tokenizer-dir", root / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    model = LlamaForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 + 4 ?"}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=4, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    new = ids[0, prompt["input_ids"].shape[1]:]
    print(f"{precision}: generated {tokenizer.decode(new)!r}")
    # SFT and DPO both taught the reply "hello friend ..." (greedy; measured: 'hello friend').
    assert tokenizer.decode(new).split()[:2] == ["hello", "friend"]
