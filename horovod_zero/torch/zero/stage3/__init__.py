"""Stage 3: the hooks that gather each unit's parameters before use and free them
after (hooks.py), prefetching in the order recorded on the last step (order.py). Which
modules are units is core/units.py's."""
