"""What wrapping checks and changes in the user's model and optimizer: parameter
names (names.py), where the parameters train (placement.py), constructor-made
optimizer state (init_state.py), forward input casts (cast.py), and the guards against
changes after wrapping that would silently stop training (guard.py)."""
