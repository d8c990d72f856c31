"""A one-layer model with optimizer and scheduler to save and load in checkpoint tests."""

import torch


class CountingScheduler:
    def __init__(self):
        self.num_steps = 0

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd):
        self.num_steps = sd["num_steps"]


def checkpoint_parts(seed, out_features=3):
    """``([model], optimizer, scheduler)``: the optimizer is AdamW in Megatron's fp32 wrapper
    (what the checkpoints ask of an optimizer: its kind, state dict, reload)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, torch.distributed.get_world_size())
    model_parallel_manual_seed(1234, 0)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, out_features)
    opt = FP32Optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), OptimizerConfig(lr=0.1),
                        pg_collection=ps.get_process_groups())
    model(torch.ones(2, 4)).sum().backward()
    opt.optimizer.step()
    return [model], opt, CountingScheduler()


def flip_storage_byte(path, offset=5):
    """Flip one byte inside the largest tensor storage of the ``torch.save`` zip ``path``, in
    place (the archive's structure and its stored CRCs stay as written); return the record's
    name."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename),
                   key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_len + extra_len + min(offset, info.file_size - 1)
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return info.filename
