"""The model's names for the optimizer's parameters, and the checks that the
optimizer trains exactly the model's trainable parameters."""


def name_map(named):
    """parameter -> its first name (tied parameters have several)."""
    names = {}
    for n, p in named:
        names.setdefault(p, n)
    return names


def check_in_model(params, names, first_index=0):
    for i, p in enumerate(params, first_index):
        if p not in names:
            raise ValueError(
                f"Parameter {i} of the optimizer (shape {tuple(p.shape)}) is not a parameter of the model. "
                "Build the optimizer from model.parameters() of the model you pass.")


def check_names(optimizer, model, named_parameters):
    """The names of the model's parameters (None without model= or named_parameters=),
    once the optimizer's parameters are known to be the model's trained ones."""
    if model is not None and named_parameters is not None:
        raise ValueError("Pass model= or named_parameters=, not both.")
    named = list(model.named_parameters() if model is not None else (named_parameters or []))
    if not named:
        return None
    names = name_map(named)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    check_in_model(opt_params, names)
    owned = set(opt_params)
    missing = [n for n, p in named if p.requires_grad and p not in owned]
    if missing:
        raise ValueError(
            f"Model parameters {missing[:5]} require grad but are not in the optimizer. Add them to the "
            "optimizer, or set requires_grad=False to freeze them.")
    return names
