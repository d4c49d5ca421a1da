"""`ShardLoader`: rank-sharded batches of shard sources mixed by a (staged) schedule, with per-source accounting.

The state is the global sample counter, the seed, a fingerprint of the data and the mixture, and
each source's own position (its cursor), so a run resumes exactly under any data-parallel degree.
With data.allow_mixture_change a resume may bring another mixture: each source then continues at
its saved cursor (`offsets`) and the new schedule applies from the resume point on.
"""

from __future__ import annotations

import logging
from typing import Any

from meshloom.config.errors import UserError
from meshloom.data.loader import GlobalOrderLoader, Window
from meshloom.data.schedule import Stage, StagedSchedule
from meshloom.data.stages import Mixture

logger = logging.getLogger(__name__)


class ShardLoader(GlobalOrderLoader):
    """Rank-sharded batches of weighted, mixed shard sources; state = one counter (+ what it counts)."""

    def __init__(
        self,
        sources: list,  # ShardSource
        weights: list[float],
        seed: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        mixture: Mixture | None = None,
        allow_mixture_change: bool = False,
    ):
        super().__init__(local_batch_size, dp_rank, dp_size)
        self.sources, self.weights, self.seed = sources, weights, seed
        names = [f"source{k}" for k in range(len(sources))]
        self.mixture = mixture or Mixture(names, [Stage(0, tuple(weights))], [0] * len(sources), False)
        assert len(self.mixture.names) == len(sources)
        self.allow_mixture_change = allow_mixture_change
        self.offsets: list[int] | None = None
        self._events: list[dict[str, Any]] = []
        self._build_schedule()

    def _build_schedule(self, stages: list[Stage] | None = None) -> None:
        m = self.mixture
        limits = [e * s.num_samples for e, s in zip(m.max_epochs, self.sources)]
        self.schedule = StagedSchedule(stages or m.stages, self.seed, limits, m.drop, self.offsets)
        self._reported = self.consumed

    def samples_available(self) -> int | None:
        """The first position no source may serve (data.max_epochs with data.on_exhausted = "drop"); None while the
        schedule never runs dry."""
        last = self.schedule.pieces[-1]
        return last.start if last.dead else None

    @property
    def num_samples(self) -> int:
        """Samples in one pass over every source (sources cycle independently)."""
        return sum(s.num_samples for s in self.sources)

    def locate(self, position: int) -> tuple[int, int]:
        """(source number, position in that source's order) of a global position."""
        return self.schedule.locate(position)

    def window(self, position: int) -> Window:
        k, q = self.schedule.locate(position)
        return self.sources[k].window(q)

    # ----------------------------------------------------------------- accounting

    def metrics(self) -> dict[str, float]:
        """Per source, cumulative over the run: tokens and documents seen, epochs, and its share now."""
        cursors = self.schedule.counts_before(self.consumed)
        try:
            shares = self.schedule.weights_at(self.consumed)
        except UserError:  # every source has left: nothing more will be drawn
            shares = [0.0] * len(self.sources)
        out = {}
        for name, source, q, share in zip(self.mixture.names, self.sources, cursors, shares):
            q = int(q)
            out[f"data/{name}/tokens"] = float(q * source.seq_len)
            out[f"data/{name}/documents"] = float(source.documents_before(q))
            out[f"data/{name}/epochs"] = q / source.num_samples
            out[f"data/{name}/share"] = float(share)
        return out

    def events(self) -> list[dict[str, Any]]:
        """Mixture events since the last call: a source that reached max_epochs (repeats or leaves), a changed mixture."""
        out, self._events = self._events, []
        for position, k in self.schedule.exhausted:
            if self._reported < position <= self.consumed:
                out.append({
                    "event": "data_source_dropped" if self.mixture.drop else "data_source_repeats",
                    "source": self.mixture.names[k],
                    "max_epochs": self.mixture.max_epochs[k],
                    "sample": position,
                })  # fmt: skip
        self._reported = self.consumed
        return out

    # ----------------------------------------------------------------- state

    def _fingerprint(self) -> dict[str, Any]:
        first = self.sources[0]
        return {
            "sources": [s.fingerprint() for s in self.sources],
            "weights": list(self.weights),
            "sampling": first.sampling,
            "seq_len": first.seq_len,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "data": self._fingerprint(),
            "mixture": self.mixture.describe(),
            "cursors": [int(c) for c in self.schedule.counts_before(self.consumed)],
            "offsets": self.offsets,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume from state_dict(); any data-parallel degree and batch size. The saved seed is adopted."""
        missing = {"consumed", "seed", "data"} - set(sd)
        if missing:
            raise UserError(f"data loader state is missing {sorted(missing)}")
        mine = self._fingerprint()
        fixed = ("sampling", "seq_len")
        changed = sorted(k for k in fixed if sd["data"].get(k) != mine[k])
        if changed:
            raise UserError(
                f"data loader state was saved for other data ({', '.join(changed)} differ: saved {sd['data']}); "
                "resume with the same data.sampling, data.validation_fraction and training.seq_len"
            )
        self._load_consumed(sd)
        self.seed = int(sd["seed"])
        for source in self.sources:
            source.reseed(self.seed)
        # A checkpoint from before staged mixtures holds the data.shards weights only: one stage, no limits.
        saved_mixture = sd.get("mixture") or {**self.mixture.describe(), "max_epochs": [0] * len(self.sources),
                                              "on_exhausted": "repeat", "stages": [{"start": 0, "weights": sd["data"].get("weights"), "ramp": 0}]}  # fmt: skip
        same_sources = sd["data"]["sources"] == mine["sources"]
        if same_sources and sd["data"]["weights"] == mine["weights"] and saved_mixture == self.mixture.describe():
            self.offsets = sd.get("offsets")
            self._build_schedule()
            return
        what = "sources" if not same_sources else "mixture"
        if not self.allow_mixture_change:
            gone = sorted(set(saved_mixture["names"]) - set(self.mixture.names))
            detail = f"source {gone[0]} of the checkpoint is not in data.shards; " if gone else ""
            raise UserError(
                f"data: the {what} differs from the checkpoint's ({detail}data.shards, data.stages, data.max_epochs, "
                "data.on_exhausted or the prepared folders changed); resume with the same settings and folders, or set "
                "data.allow_mixture_change = true to continue each source where it was under the new mixture"
            )
        self._rebase(sd)
        logger.warning("data: the mixture changed on resume at sample %d; each source continues where it was", self.consumed)
        self._events.append({"event": "data_mixture_change", "sample": self.consumed})

    def _rebase(self, sd: dict[str, Any]) -> None:
        """Continue each source at its saved cursor under this mixture, from the resume point on."""
        saved_cursor = {}
        if "cursors" in sd:
            for fingerprint, cursor in zip(sd["data"]["sources"], sd["cursors"]):
                saved_cursor[fingerprint["content"]] = cursor
        cursors = [int(saved_cursor.get(s.fingerprint()["content"], 0)) for s in self.sources]
        m = self.mixture
        # A source that may no longer serve (drop, past its limit) is left out from the start, so that the
        # others' counts up to the resume point are those of the schedule that continues.
        spent = [m.drop and e > 0 and c >= e * s.num_samples for e, c, s in zip(m.max_epochs, cursors, self.sources)]
        stages = [Stage(st.start, tuple(0.0 if x else w for w, x in zip(st.weights, spent)), st.ramp) for st in m.stages]
        self.offsets = None
        self._build_schedule(stages)
        counts = self.schedule.counts_before(self.consumed)
        self.offsets = [c - int(n) for c, n in zip(cursors, counts)]
        self._build_schedule(stages)
