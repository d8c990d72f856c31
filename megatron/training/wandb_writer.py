"""Weights & Biases logging as Megatron-LM's ``_set_wandb_writer``: ``--wandb-project``,
``--wandb-exp-name``, ``--wandb-save-dir`` (default ``{--save}/wandb``), one run opened by the
last rank, the same scalars as TensorBoard under the same names, each at its iteration.

``wandb`` is an optional extra (``pip install -e '.[wandb]'``); :func:`wandb_flag_error` names it
when the flags ask for W&B and the library is absent, before anything is started. Offline runs
(``WANDB_MODE=offline``) write their files under the save folder for ``wandb sync``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional


def wandb_flag_error(project: Optional[str], exp_name: Optional[str], save_dir: Optional[str],
                     save: Optional[str]) -> Optional[str]:
    """The message for W&B flags that cannot work, else None (no project: W&B off)."""
    if not project:
        return None
    if not exp_name:
        return ("--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
    if not (save_dir or save):
        return ("--wandb-project needs --wandb-save-dir DIR or --save DIR (W&B's files go to "
                "{--save}/wandb by default)")
    if importlib.util.find_spec("wandb") is None:
        return ("--wandb-project needs the wandb library, an optional extra: pip install -e "
                "'.[wandb]' (or pip install wandb)")
    return None


class WandbWriter:
    """One W&B run; :meth:`log` writes a dict of scalars at an iteration."""

    def __init__(self, project: str, exp_name: str, save_dir: str, run_config: dict):
        import wandb

        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=exp_name, dir=save_dir, config=run_config)

    def log(self, values: dict, iteration: int) -> None:
        self.run.log(values, step=iteration)

    def close(self) -> None:
        self.run.finish()


def open_wandb(logging, checkpoint, run_config: dict, is_last_rank: bool):
    """The run's writer on the last rank when ``--wandb-project`` is set, else None.

    Args:
        logging / checkpoint: the run's LoggingConfig and CheckpointConfig.
        run_config: the run's arguments (W&B's config panel).
    """
    if not (logging.wandb_project and is_last_rank):
        return None
    save_dir = logging.wandb_save_dir or os.path.join(checkpoint.save, "wandb")
    return WandbWriter(logging.wandb_project, logging.wandb_exp_name, save_dir, run_config)
