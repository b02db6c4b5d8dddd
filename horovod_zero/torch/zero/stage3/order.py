"""The order in which units run in one phase (forward or backward), recorded on
each step and used to prefetch on the next.

[Note: order changes]
A step's order is compared with the last step's as it happens: the k-th unit
visited must be the k-th recorded. At the first difference prefetching stops for
the rest of that phase (the gathers already issued are used later or freed at
the end of backward), and at the end of the phase this step's order replaces the
recording. A data-dependent path therefore costs one phase without prefetch, never
a wrong result, and a change is an O(1) comparison per unit, not an event to warn
about. `changes` counts them."""


class OrderTrace:
    def __init__(self):
        self.last = None    # the previous phase's order (unit indices), or a prediction
        self.now = []
        self.matching = True
        self.changes = 0
        self._predicted = False  # `last` is a guess, not a recording: a miss is no change

    def visit(self, unit):
        k = len(self.now)
        self.now.append(unit)
        if self.matching and (self.last is None or k >= len(self.last) or self.last[k] != unit):
            self.matching = False

    def upcoming(self, depth):
        """The next `depth` units the recording predicts, while this phase follows it."""
        if not (self.matching and self.last and depth):
            return []
        k = len(self.now)
        return self.last[k:k + depth]

    def end(self):
        if not self.now:
            return
        if self.last is not None and not self._predicted and self.now != self.last:
            self.changes += 1
        self.last, self.now, self.matching, self._predicted = self.now, [], True, False

    def predict(self, order):
        """Before the first recording: prefetch in `order`."""
        if self.last is None:
            self.last, self._predicted = list(order), True
