"""The loader: one contract for every source and every mixture of them.

The loader's unit is the *global* batch. The mixture's schedule (:mod:`.mixture`) gives each of
its ``G`` samples a source and that source's own sample number; data-parallel rank ``r`` of ``D``
reads samples ``r·G/D … (r+1)·G/D − 1`` (sample ``p`` from its source's reader with lane ``p``)
and splits them into micro-batches of ``local_batch_size`` rows. So a run on 1 rank with gradient
accumulation and a run on 4 ranks see exactly the same samples at every step, and the state
(plain integers: the schedule, plus the lanes of streamed sources) resumes on any world size with
the same global batch size.

The loader never names a source kind: a reader gives ``window(n, lane)`` (the ``seq_len + 1``
tokens of the source's sample ``n``, or of lane ``lane``), ``samples_per_epoch`` (None where epochs
are per lane), ``positions()`` / ``seek()`` for lanes, ``epochs_begun()``, ``identity()`` and
``describe()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from torchtitan_lite.data.mixture import Schedule
from torchtitan_lite.data.preference import pair_batch
from torchtitan_lite.data.windows import Documents, as_packed, window_tensors
from torchtitan_lite.errors import ConfigError, DataError

__all__ = ["BatchLoader", "LoaderSource", "MicroBatch", "Reader", "check_batch_split", "micro_batches", "rank_samples"]

logger = logging.getLogger("torchtitan_lite")


class Reader(Protocol):
    """What the loader needs from a source (see the module's docstring)."""

    samples_per_epoch: int | None
    packed: bool  # windows of (tokens, counted, samples) rather than plain tokens
    unit: str  # what a sample is, in log lines (windows, pairs, prompts)

    def window(self, n: int, lane: int) -> np.ndarray: ...
    def positions(self) -> dict[int, list[int]]: ...
    def seek(self, positions: list[list[int]]) -> None: ...
    def epochs_begun(self) -> int: ...
    def identity(self) -> dict[str, Any]: ...
    def describe(self) -> str: ...


@dataclass
class LoaderSource:
    """One source of the loader: its name (metrics, logs, the saved state), weight and epochs."""

    name: str
    reader: Reader
    weight: float = 1.0
    max_epochs: int | None = None
    where: str = ""
    """The dataset as the config names it (for the start-up log)."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the loader gives it: ``inputs`` and ``labels`` ``(rows, seq)``, the
    document ids of packed rows (block-causal attention; None: causal), and each row's source in a
    mixture (rows of one source next to each other; None: one source or no per-source metrics)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor | None = None
    sources: list[int] | None = None


def check_batch_split(global_batch_size: int, local_batch_size: int, dp_size: int) -> int:
    """Micro-batches per rank per global batch (gradient accumulation steps); one
    :class:`ConfigError` line when the global batch does not split into ``local_batch_size`` rows
    on each of ``dp_size`` data-parallel ranks. The one rule, for the job's plan and the loader."""
    per_step = local_batch_size * dp_size
    if global_batch_size % per_step:
        raise ConfigError(f"training.global_batch_size: invalid value {global_batch_size}; expected a multiple of "
                          f"local_batch_size × data-parallel degree = {local_batch_size} × {dp_size} = {per_step}")
    return global_batch_size // per_step


def micro_batches(rows: np.ndarray, local_batch_size: int, documents: Documents | None = None,
                  ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor] | None]:
    """This rank's ``rows`` (windows of ``seq_len + 1`` tokens, or packed samples) as ``(inputs,
    labels)`` micro-batches of ``local_batch_size`` rows, in order, and each micro-batch's
    document ids (None without packed samples or ``documents``: plain causal attention)."""
    if rows.ndim == 4:  # preference pairs (2, 3, seq_len + 1): each micro-batch's chosen rows, then its rejected
        return [pair_batch(rows[i:i + local_batch_size]) for i in range(0, len(rows), local_batch_size)], None
    inputs, labels, docs = window_tensors(rows, documents)
    pairs = list(zip(inputs.split(local_batch_size), labels.split(local_batch_size), strict=True))
    return pairs, None if docs is None else list(docs.split(local_batch_size))


def rank_samples(global_batch_size: int, *, dp_rank: int, dp_size: int) -> range:
    """The samples (positions in a global batch) data-parallel rank ``dp_rank`` reads: its own
    contiguous slice, so a global batch is the same samples on any world size."""
    per_rank = global_batch_size // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def _any_rank(flags: list[bool], dp_size: int, group: Any) -> list[bool]:
    """``flags`` or-ed over the data-parallel ranks (``group``; None: the default group)."""
    if dp_size == 1:
        return flags
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, flags, group=group)
    return [any(g[i] for g in gathered) for i in range(len(flags))]


class BatchLoader:
    """Yields this rank's micro-batches ``(inputs, labels)`` of each global batch (see the module's
    docstring). After :meth:`next_batch`, :attr:`batch_sources` holds the source of each row of
    each micro-batch; rows of one source are next to each other within a micro-batch.

    ``named``: the sources are a ``[[training.datasets]]`` mixture, reported per source. A
    changed mixture in a saved state is refused unless ``allow_mixture_change``. ``documents``
    (block-causal attention): the tokenizer's BOS/EOS, where plain windows' documents begin and
    end; then, and with packed sources, :attr:`batch_documents` holds each micro-batch's
    document ids, and :attr:`masked` says labels may be ignored (the loss counts fewer tokens).
    """

    def __init__(self, sources: list[LoaderSource], *, seq_len: int, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_size: int, named: bool = False, allow_mixture_change: bool = False,
                 documents: Documents | None = None, epoch_log_steps: int = 1) -> None:
        self.grad_accum_steps = check_batch_split(global_batch_size, local_batch_size, dp_size)
        self.sources = sources
        self.seq_len, self.global_batch_size, self.local_batch_size = seq_len, global_batch_size, local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # The data-parallel process group its collectives run on (None: the default group); the
        # trainer sets it once the mesh exists (the loader is built before any process group).
        self.group: Any = None
        self.named, self.allow_mixture_change, self.documents = named, allow_mixture_change, documents
        self.masked = any(s.reader.packed for s in sources)  # labels of packed samples may be ignored
        self.batch_documents: list[torch.Tensor] | None = None
        self.schedule = Schedule([s.name for s in sources], [s.weight for s in sources],
                                 samples_per_epoch=[s.reader.samples_per_epoch for s in sources],
                                 max_epochs=[s.max_epochs for s in sources],
                                 units=[s.reader.unit for s in sources])
        # A source that starts a new epoch is logged at its first restart, then at most once per
        # epoch_log_steps steps (a source of a few prompts begins an epoch every step).
        self.epoch_log_steps = max(1, epoch_log_steps)
        self._epoch_logged: dict[int, tuple[int, int]] = {}  # source -> (step, epoch) of its last line
        self.step = 0  # global batches consumed
        self.skipped: set[int] = set()  # global batches never to read (training.on_nonfinite = "rollback")
        self._mine = rank_samples(global_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        self.batch_sources: list[list[int]] = []  # the source of each row of each micro-batch
        self.batch_counts = [0] * len(sources)  # samples of each source in the last global batch (all ranks)
        self.trained = [0] * len(sources)  # samples of each source in the batches given out (not the skipped)
        self._lanes: dict[str, list[list[int]]] | None = None  # every lane's position at step _lanes_step
        self._lanes_step = -1

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def _read(self) -> tuple[list[np.ndarray], list[int]]:
        """The next global batch: this rank's windows and their sources."""
        assignment = self.schedule.take(self.global_batch_size)
        if len(self.sources) > 1:
            # Position p of global batch k takes sample (p + k) mod G of the schedule's batch:
            # a streamed source reads lane p at position p, and the schedule repeats with a
            # period that often divides G, so without the rotation some lanes would never be read.
            shift = self.step % self.global_batch_size
            assignment = assignment[shift:] + assignment[:shift]
        rows, sources = [], []
        for p in self._mine:
            s, n = assignment[p]
            rows.append(self.sources[s].reader.window(n, p))
            sources.append(s)
        self.batch_counts = [0] * len(self.sources)
        for s, _ in assignment:
            self.batch_counts[s] += 1
        self._retire_finished_lanes()
        if self.dp_rank == 0:
            for event in self.schedule.events:
                logger.warning("training data: %s", event)
            self._log_epochs()
        self.schedule.events.clear()
        self.schedule.epochs.clear()
        return rows, sources

    def _log_epochs(self) -> None:
        """One line for each source that began an epoch in this batch: at its first restart, then
        when ``epoch_log_steps`` steps have passed since its last line (with the epochs between)."""
        sched = self.schedule
        for s, epoch in sorted(sched.epochs.items()):
            last = self._epoch_logged.get(s)
            if last is not None and self.step - last[0] < self.epoch_log_steps:
                continue
            what = f"source {sched.names[s]!r} has used all its {sched.samples_per_epoch[s]} {sched.units[s]}"
            if last is None or epoch == last[1] + 1:
                logger.info("training data: %s and starts again (epoch %d)", what, epoch)
            else:
                logger.info("training data: %s %d more times and starts again (epoch %d; a line at most every %d "
                            "steps)", what, epoch - last[1], epoch, self.epoch_log_steps)
            self._epoch_logged[s] = (self.step, epoch)

    def _retire_finished_lanes(self) -> None:
        """Streamed sources with ``max_epochs``: retired once a lane of any rank began that epoch."""
        limited = [i for i, s in enumerate(self.sources) if s.max_epochs is not None
                   and s.reader.samples_per_epoch is None and self.schedule.active[i]]
        if not limited:
            return
        done = _any_rank([self.sources[i].reader.epochs_begun() >= self.sources[i].max_epochs
                          for i in limited], self.dp_size, self.group)
        for i, finished in zip(limited, done, strict=True):
            if finished:
                self.schedule.retire(i, f"has read all its rows {self.sources[i].max_epochs} times in some lane "
                                        f"(max_epochs = {self.sources[i].max_epochs})")

    def next_batch(self) -> list[Any]:
        """The micro-batches of this rank for the next global batch (batches in :attr:`skipped`
        are read and left out): ``(inputs, labels)`` tensors, or for prompts (online RL) lists of
        :class:`~torchtitan_lite.data.prompts.PromptRow`."""
        while self.step in self.skipped:
            self._read()
            self.step += 1
        rows, sources = self._read()
        self.step += 1
        self.trained = [n + c for n, c in zip(self.trained, self.batch_counts, strict=True)]
        if len(self.sources) > 1:  # each micro-batch's rows grouped by source (a stable sort per micro-batch)
            size = self.local_batch_size
            order = [i for first in range(0, len(rows), size)
                     for i in sorted(range(first, min(first + size, len(rows))), key=sources.__getitem__)]
            rows, sources = [rows[i] for i in order], [sources[i] for i in order]
        self.batch_sources = [
            sources[i : i + self.local_batch_size] for i in range(0, len(sources), self.local_batch_size)
        ]
        if rows and not isinstance(rows[0], np.ndarray):  # prompts (online RL): the rows themselves
            self.batch_documents = None
            return [rows[i:i + self.local_batch_size] for i in range(0, len(rows), self.local_batch_size)]
        if self.masked:
            rows = [as_packed(row, self.documents) for row in rows]
        batches, self.batch_documents = micro_batches(np.stack(rows), self.local_batch_size, self.documents)
        return batches

    def next_micro_batches(self) -> list[Any]:
        """:meth:`next_batch` as an objective takes it: :class:`MicroBatch` es (with their document
        ids, and each row's source in a mixture), or for prompts the lists of rows themselves."""
        micro_batches = self.next_batch()
        if micro_batches and not isinstance(micro_batches[0], tuple):  # prompts: the objective makes its rows
            return micro_batches
        docs = self.batch_documents
        sources = self.batch_sources if self.named else None
        return [MicroBatch(inputs, labels, None if docs is None else docs[i], None if sources is None else sources[i])
                for i, (inputs, labels) in enumerate(micro_batches)]

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens (labels) of each source in the batches given out since the run began
        (not those left out by a rollback), over all ranks."""
        return {s.name: n * self.seq_len for s, n in zip(self.sources, self.trained, strict=True)}

    # -- state ---------------------------------------------------------------------------------

    def gather_state(self) -> None:
        """Every rank's lane positions to every rank (a collective over the data-parallel group when
        there are several ranks and a streamed source); call on every rank before a save."""
        lanes = [i for i, s in enumerate(self.sources) if s.reader.samples_per_epoch is None]
        mine = {self.sources[i].name: self.sources[i].reader.positions() for i in lanes}
        if lanes and self.dp_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, (self.step, mine), group=self.group)
            if {step for step, _ in gathered} != {self.step}:
                raise RuntimeError(f"data loader: ranks are at different steps {[s for s, _ in gathered]}")
            for _, part in gathered:
                for name, positions in part.items():
                    mine[name].update(positions)
        self._lanes = {name: [positions[p] for p in range(self.global_batch_size)] for name, positions in mine.items()}
        self._lanes_step = self.step

    def state_dict(self) -> dict[str, Any]:
        """The exact position as plain data: global batches consumed, the schedule, every lane's
        position, and what gives them meaning."""
        if self._lanes_step != self.step:
            if self.dp_size > 1 and any(s.reader.samples_per_epoch is None for s in self.sources):
                raise RuntimeError("BatchLoader.state_dict: call gather_state() on every rank first")
            self.gather_state()
        return {
            "step": self.step,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "skipped": sorted(self.skipped),
            "sources": [{"name": s.name, "weight": s.weight, "max_epochs": s.max_epochs, **s.reader.identity()}
                        for s in self.sources],
            "schedule": self.schedule.state_dict(),
            "trained": list(self.trained),
            "lanes": {name: [list(p) for p in positions] for name, positions in (self._lanes or {}).items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; it may come from any world size or micro-batch split."""
        state = _upgrade(state, self)
        for name in ("global_batch_size", "seq_len"):
            if state.get(name) != getattr(self, name):
                hint = (f"; to resume at another world size, set training.global_batch_size = {state.get(name)}"
                        if name == "global_batch_size" else "")
                raise DataError(f"data loader state does not match this run: it was saved with {name}="
                                f"{state.get(name)!r}, this run has {getattr(self, name)!r}; the saved position "
                                f"would point at other samples{hint}")
        step, skipped, saved = state.get("step"), state.get("skipped", []), state.get("sources")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"data loader state: invalid step {step!r}; expected an integer >= 0")
        if not isinstance(skipped, list) or not all(isinstance(s, int) and s >= 0 for s in skipped):
            raise DataError(f"data loader state: invalid skipped {skipped!r}; expected a list of integers >= 0")
        if not isinstance(saved, list) or not all(isinstance(s, dict) and "name" in s for s in saved):
            raise DataError("data loader state: invalid sources; expected a list of tables with a name")
        by_name = {s["name"]: s for s in saved}
        self._check_identities(by_name)
        changes = self._mixture_changes(saved)
        if changes and not self.allow_mixture_change:
            raise DataError(f"data loader state does not match this run: the mixture changed ({'; '.join(changes)}); "
                            "set training.allow_mixture_change = true to apply the new mixture from the resumed step")
        schedule = state.get("schedule", {})
        order = [s["name"] for s in saved]
        columns = {k: schedule.get(k) for k in ("totals", "active", "segment")}
        if not all(isinstance(v, list) and len(v) == len(order) for v in columns.values()):
            raise DataError("data loader state: invalid schedule; expected one entry per saved source")
        mine = {k: [v[order.index(s.name)] if s.name in by_name else (0 if k != "active" else True)
                    for s in self.sources] for k, v in columns.items()}
        if changes:
            for i, s in enumerate(self.sources):  # a source given more epochs may come back
                if s.name in by_name and by_name[s.name].get("max_epochs") != s.max_epochs:
                    mine["active"][i] = True
            if self.dp_rank == 0:
                logger.warning("training data: the mixture changed on resume (%s); the new mixture applies from "
                               "global batch %d (training.allow_mixture_change = true)", "; ".join(changes), step)
        self.schedule.load_state_dict({**mine, "segment_samples": schedule.get("segment_samples")},
                                      new_segment=bool(changes))
        trained = state.get("trained", columns["totals"])  # states before it: what was read
        if not isinstance(trained, list) or len(trained) != len(order):
            raise DataError("data loader state: invalid trained; expected one sample count per saved source")
        self.trained = [int(trained[order.index(s.name)]) if s.name in by_name else 0 for s in self.sources]
        lanes = state.get("lanes", {})
        for s in self.sources:
            if s.reader.samples_per_epoch is None and s.name in by_name:
                positions = lanes.get(s.name) if isinstance(lanes, dict) else None
                if (not isinstance(positions, list) or len(positions) != self.global_batch_size or not all(
                        isinstance(p, list) and len(p) == 3 and all(isinstance(v, int) and v >= 0 for v in p)
                        for p in positions)):
                    raise DataError(f"data loader state: invalid lane positions of source {s.name!r}; expected "
                                    f"{self.global_batch_size} [epoch, document, tokens] lists of integers >= 0")
                s.reader.seek(positions)
        self.step, self.skipped = step, set(skipped)
        self._lanes = {name: [list(p) for p in positions] for name, positions in lanes.items()
                       if name in self.names} if isinstance(lanes, dict) else None
        self._lanes_step = step if not changes else -1

    def _check_identities(self, by_name: dict[str, dict[str, Any]]) -> None:
        """A source of the same name must be the same data, read the same way."""
        for s in self.sources:
            if s.name not in by_name:
                continue
            what = f"source {s.name!r} " if self.named else ""
            identity = s.reader.identity()
            if not set(identity) <= set(by_name[s.name]):
                kind = "a streamed" if s.reader.samples_per_epoch is None else "a windowed (not streamed)"
                raise DataError(f"data loader state does not match this run: {what}was saved from another kind of "
                                f"source; this run reads {kind} source ({s.where})")
            for key in sorted(identity, key=lambda k: k != "shuffle"):  # shuffle first: it explains the rest
                value, saved = identity[key], by_name[s.name].get(key)
                if saved != value:
                    hint = f"; set training.shuffle = {str(saved).lower()} to resume it" if key == "shuffle" else ""
                    raise DataError(f"data loader state does not match this run: {what or 'it '}was saved with "
                                    f"{key}={saved!r}, this run has {value!r}; the saved position would point at "
                                    f"other samples{hint}")

    def _mixture_changes(self, saved: list[dict[str, Any]]) -> list[str]:
        by_name = {s["name"]: s for s in saved}
        changes = [f"{name!r} removed" for name in by_name if name not in self.names]
        for s in self.sources:
            old = by_name.get(s.name)
            if old is None:
                changes.append(f"{s.name!r} added")
                continue
            for key in ("weight", "max_epochs"):
                if old.get(key) != getattr(s, key):
                    changes.append(f"{key} of {s.name!r} {old.get(key)!r} -> {getattr(s, key)!r}")
        return changes

    def describe(self) -> str:
        """The sources for the start-up log (one line each in a mixture)."""
        total = sum(s.weight for s in self.sources)
        parts = []
        for s in self.sources:
            share = f"{s.name!r} weight {s.weight / total:.3g}, " if self.named else ""
            epochs = f", at most {s.max_epochs} epoch(s)" if s.max_epochs is not None else ""
            parts.append(f"{share}{s.where}: {s.reader.describe()}{epochs}")
        return "\n  ".join(["a mixture of:", *parts]) if self.named else "; ".join(parts)


def _upgrade(state: dict[str, Any], loader: BatchLoader) -> dict[str, Any]:
    """A state saved by an earlier version (one source; ``num_windows``, or streamed ``positions``
    of ``[epoch, row, tokens]``) in this version's form."""
    if "sources" in state or len(loader.sources) != 1:
        return state
    source = loader.sources[0]
    step = state.get("step", 0) if isinstance(state.get("step"), int) else 0
    upgraded = {
        **state,
        "schedule": {
            "totals": [step * loader.global_batch_size],
            "active": [True],
            "segment": [step * loader.global_batch_size],
            "segment_samples": step * loader.global_batch_size,
        },
    }
    if "positions" in state:  # the streaming loader: rows in file order
        identity = {"dataset": state.get("dataset"), "text_column": state.get("text_column"),
                    "num_rows": state.get("num_rows"), "seed": None, "shuffle": False, "shuffle_buffer": 0}
        bounds = [p * int(state.get("num_rows") or 0) // loader.global_batch_size
                  for p in range(loader.global_batch_size)]
        positions = state["positions"] if isinstance(state["positions"], list) else []
        upgraded["lanes"] = {source.name: [[e, r - bounds[p], u] for p, (e, r, u) in enumerate(positions)]
                             if len(positions) == len(bounds) else positions}
    else:
        identity = {k: state[k] for k in ("num_windows", "seed", "shuffle") if k in state}
    upgraded["sources"] = [{"name": source.name, "weight": source.weight, "max_epochs": source.max_epochs, **identity}]
    return upgraded
