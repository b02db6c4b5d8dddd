"""Dynamic loss scaling for fp16 parameters, with torch.cuda.amp.GradScaler's
knobs: multiply the loss by `scale`; a step whose gradients overflow on any rank
is skipped on every rank and the scale backs off; after `growth_interval` clean
steps the scale grows."""

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    _clean_steps: int = 0

    def update(self, found_inf: bool):
        if found_inf:
            self.scale *= self.backoff_factor
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self):
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state):
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
