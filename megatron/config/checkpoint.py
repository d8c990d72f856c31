"""The checkpoint section of the configuration: the formats, what to save and load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and come from (``iter_XXXXXXX/`` in either format) and which parts
    are saved and loaded."""

    save: Optional[str] = None
    """``--save``: checkpoint folder to write. Default None (no checkpoints)."""
    load: Optional[str] = None
    """``--load``: checkpoint folder to resume from. Default None."""
    save_interval: Optional[int] = None
    """``--save-interval``: iterations between saves. Default None (only at the end)."""
    no_save_optim: bool = False
    """``--no-save-optim``: leave the optimizer state out. Default off."""
    no_save_rng: bool = False
    """``--no-save-rng``: leave the RNG states out. Default off."""
    no_load_optim: bool = False
    """``--no-load-optim``: do not load the optimizer state. Default off."""
    no_load_rng: bool = False
    """``--no-load-rng``: do not load the RNG states. Default off."""
    finetune: bool = False
    """``--finetune``: load the weights only; iteration and optimizer start afresh. Default off."""
    ckpt_format: str = "torch"
    """``--ckpt-format``: ``torch`` (Megatron's legacy layout, one file per TP x PP rank) or
    ``torch_dist`` (distributed: layout-free shards, loaded at any layout). Default torch."""
    async_save: bool = False
    """``--async-save``: write ``torch_dist`` checkpoints in the background. Default off."""
    ckpt_convert_format: Optional[str] = None
    """``--ckpt-convert-format``: save the loaded checkpoint in this format under
    ``--ckpt-convert-save/FORMAT`` and stop. Default None (train)."""
    ckpt_convert_save: Optional[str] = None
    """``--ckpt-convert-save``: the folder of ``--ckpt-convert-format``. Default None."""
    keep_last_checkpoints: Optional[int] = None
    """``--keep-last-checkpoints``: delete older checkpoints, keeping this many. Default None
    (all)."""
