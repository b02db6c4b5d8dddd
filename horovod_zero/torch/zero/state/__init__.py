"""Reading and writing the optimizer's state, through its public view (view.py): one
rank's state dict (rank_state.py), consolidated checkpoints of any world size
(checkpoint.py), the model's weights as safetensors (export.py), and whether saved
state fits this optimizer (compat.py)."""
