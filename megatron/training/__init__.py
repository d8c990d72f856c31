"""The training program: start-up, the loop, evaluation, logging (Megatron-LM's megatron/training)."""
