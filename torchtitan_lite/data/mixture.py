"""The mixture: which source each sample of the run comes from.

Sample ``j`` of the run (sample ``j mod G`` of global batch ``j // G``) is given to a source by a
deterministic schedule over the sources' normalised weights ``w``: at every prefix of ``n``
samples each source has ``c_s`` samples with ``|c_s − w_s·n| < 1`` (Tijdeman's chairman
assignment: among the sources not ahead of their share, the one whose next sample is due
first). The schedule depends on the weights and the sample count only, never on the world size,
and its state is a few integers per source.

Each source keeps its own count of samples, so its own epochs: a source with known windows per
epoch is *exhausted* after ``max_epochs`` of them, exactly at a sample; a streamed source (epochs
per lane) is retired by the loader at the end of the global batch in which one of its lanes
began epoch ``max_epochs``. A retired source leaves the mix and the remaining weights are
normalised again from that sample on. Imports nothing of the package but
:mod:`torchtitan_lite.errors`.
"""

from __future__ import annotations

import math
from typing import Any

from torchtitan_lite.errors import DataError

__all__ = ["Schedule"]

_EPS = 1e-9


class Schedule:
    """The source of every sample, one global batch at a time (see the module's docstring)."""

    def __init__(self, names: list[str], weights: list[float], *, samples_per_epoch: list[int | None],
                 max_epochs: list[int | None], units: list[str] | None = None) -> None:
        self.names, self.base_weights = names, weights
        self.samples_per_epoch, self.max_epochs = samples_per_epoch, max_epochs
        self.units = units or ["windows"] * len(names)  # what a source's samples are, in its log lines
        self.totals = [0] * len(names)  # samples of each source since the run began
        self.active = [True] * len(names)
        self.events: list[str] = []  # what happened since the caller last looked (retirements)
        self.epochs: dict[int, int] = {}  # source -> the epoch it began last, since the caller last looked
        self._new_segment()

    def _new_segment(self) -> None:
        """Weights normalised over the active sources, counted again from here."""
        total = sum(w for w, a in zip(self.base_weights, self.active, strict=True) if a)
        self.weights = [w / total if a else 0.0 for w, a in zip(self.base_weights, self.active, strict=True)]
        self.segment = [0] * len(self.names)
        self.segment_samples = 0
        self._active = [s for s, a in enumerate(self.active) if a]
        self._delta = 1 / (2 * (len(self._active) - 1)) if len(self._active) > 1 else 0.0
        self._eligible = [(self._delta - _EPS) / w if w else math.inf for w in self.weights]
        self._due = [(1 - self._delta) / w if w else math.inf for w in self.weights]

    def take(self, count: int) -> list[tuple[int, int]]:
        """The next ``count`` samples as ``(source, n)``: the source's index and its own sample
        number. Among the sources not ahead of their share (``w·t − c ≥ δ`` at sample ``t``),
        the one whose next sample is due first (``(c + 1 − δ) / w``); each source's two
        thresholds are kept and updated when it is picked (this runs for every sample)."""
        out: list[tuple[int, int]] = []
        totals, weights, per_epoch = self.totals, self.weights, self.samples_per_epoch
        active, eligible, due, segment, delta = self._active, self._eligible, self._due, self.segment, self._delta
        t = self.segment_samples
        for _ in range(count):
            t += 1
            if len(active) == 1:
                s = active[0]
            else:
                s = -1
                for candidate in active:
                    if eligible[candidate] <= t and (s < 0 or due[candidate] < due[s]):
                        s = candidate
                if s < 0:
                    s = min(active, key=due.__getitem__)
                c = segment[s] + 1
                eligible[s] = (c + delta - _EPS) / weights[s]
                due[s] = (c + 1 - delta) / weights[s]
            segment[s] += 1
            n = totals[s]
            totals[s] = n + 1
            out.append((s, n))
            if per_epoch[s] is not None and (n + 1) % per_epoch[s] == 0:
                self.segment_samples = t
                self._epoch_done(s, (n + 1) // per_epoch[s])
                # A source that retired starts a new segment: its lists are new.
                active, eligible, due, segment, delta = (
                    self._active,
                    self._eligible,
                    self._due,
                    self.segment,
                    self._delta,
                )
                weights, t = self.weights, self.segment_samples
        self.segment_samples = t
        return out

    def _epoch_done(self, s: int, epoch: int) -> None:
        per_epoch, limit = self.samples_per_epoch[s], self.max_epochs[s]
        if limit is not None and epoch >= limit:
            self.retire(s, f"has used its {per_epoch} {self.units[s]} {epoch} times (max_epochs = {limit})")
        else:
            self.epochs[s] = epoch

    def retire(self, source: int, why: str) -> None:
        """``source`` leaves the mix from the next sample on; the others' weights are normalised again."""
        self.active[source] = False
        if not any(self.active):
            raise DataError(f"training data: every source is done: {self.names[source]!r} {why}, and no "
                            "other source is left; raise max_epochs of [[training.datasets]] or lower "
                            "training.steps")
        self._new_segment()
        left = ", ".join(f"{self.names[s]!r} {self.weights[s]:.3g}" for s, a in enumerate(self.active) if a)
        self.events.append(f"source {self.names[source]!r} {why} and leaves the mixture; weights now {left}")

    def state_dict(self) -> dict[str, Any]:
        return {"totals": list(self.totals), "active": list(self.active), "segment": list(self.segment),
                "segment_samples": self.segment_samples}

    def load_state_dict(self, state: dict[str, Any], *, new_segment: bool = False) -> None:
        """Continue from ``state`` (lists in the order of this schedule's sources). ``new_segment``:
        the weights changed, so the schedule counts its shares again from here."""
        m = len(self.names)
        lists = [state.get(k) for k in ("totals", "active", "segment")]
        if not all(isinstance(v, list) and len(v) == m for v in lists) or not isinstance(
                state.get("segment_samples"), int):
            raise DataError(f"data loader state: invalid schedule; expected totals, active and segment lists of "
                            f"{m} entries and an integer segment_samples")
        self.totals, self.active = [int(v) for v in state["totals"]], [bool(v) for v in state["active"]]
        if not any(self.active):
            self.active = [True] * m
        self._new_segment()
        if not new_segment:
            self.segment, self.segment_samples = [int(v) for v in state["segment"]], int(state["segment_samples"])
            for s in self._active:
                self._eligible[s] = (self.segment[s] + self._delta - _EPS) / self.weights[s]
                self._due[s] = (self.segment[s] + 1 - self._delta) / self.weights[s]
