"""Reading and writing the optimizer's state, through its public view (view.py): one
rank's state dict (rank_state.py); checkpoints of any world size (checkpoint.py):
sharded in DCP's format (sharded_checkpoint.py over dcp_state.py, dcp_io.py and
dcp_layout.py) or consolidated (consolidated.py); the model's weights as safetensors
(export.py); and whether saved state fits this optimizer (compat.py)."""
