"""How another process (a grain worker) opens a loader's sources again: its
records (:class:`Reopen`, or :class:`Keep` for a custom type) and a
``Mixture``'s blend (:class:`Remix`); open stores do not cross processes."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from flat_tokens_jax.core import fields
from flat_tokens_jax.data.bins import BinRecords, PackingPlan, make_records
from flat_tokens_jax.data.dataset import open_dataset
from flat_tokens_jax.data.records import PackedRecords, PaddedRecords, Records
from flat_tokens_jax.sampling.mixture import Mixture
from flat_tokens_jax.store.options import StoreOptions


@dataclasses.dataclass(frozen=True)
class Reopen:
    """What opens the same records again, in another process."""

    url: str
    split: str
    sequences: tuple[int, int]
    options: StoreOptions
    packing: fields.Packing
    seq_len: int
    in_memory: bool
    plan: PackingPlan | None = None

    @classmethod
    def of(cls, records: Records) -> Reopen | None:
        """How to reopen ``records``; ``None`` for records of another type than ours."""
        kinds = (PackedRecords, PaddedRecords, BinRecords)
        # A subclass may read differently from the class it would reopen as.
        if type(records) not in kinds or not isinstance(records, kinds):
            return None
        ft = records.ft
        spec = ft.store.spec
        # The resolved path, not the one given: a later chdir must not move the data.
        url = spec["path"] if spec["driver"] == "file" else ft.url
        return cls(
            url=url,
            split=ft.split_name,
            sequences=ft.seq_range,
            # A tensorstore Context cannot cross processes: each opens its own.
            options=dataclasses.replace(ft.store.options, context=None),
            packing=records.packing,
            seq_len=records.seq_len,
            in_memory=spec["driver"] == "memory",
            plan=records.plan if isinstance(records, BinRecords) else None,
        )

    def open(self) -> Records:
        ft = open_dataset(self.url, self.options)[self.split]
        if ft.seq_range != self.sequences:
            ft = ft.view(*self.sequences)
        if self.plan is not None:
            return BinRecords(ft, self.seq_len, plan=self.plan)
        return make_records(ft, self.seq_len, self.packing)


@dataclasses.dataclass(frozen=True)
class Keep:
    """Records of a type that cannot be reopened from a URL: pickled as they are."""

    records: Records
    in_memory = False

    def open(self) -> Records:
        return self.records


@dataclasses.dataclass(frozen=True)
class Remix:
    """What blends a Mixture's components again in another process."""

    names: tuple[str, ...]
    weights: tuple[tuple[float, ...], ...]
    steps: tuple[int, ...]
    periods: tuple[int, ...]
    seed: int
    allow_mixed_tokenizers: bool
    tables: str  # a digest of the tables that route each sample (`Period`s)

    @classmethod
    def of(cls, mixture: Mixture) -> Remix:
        digest = hashlib.sha256()
        for p in mixture.periods:
            for table in (p.counts, p.component, p.rank):
                digest.update(np.ascontiguousarray(table).tobytes())
        return cls(
            names=mixture.names,
            weights=tuple(tuple(map(float, w)) for w in mixture.weights),
            steps=tuple(mixture.steps.tolist()),
            periods=tuple(p.period for p in mixture.periods),
            seed=mixture.seed,
            allow_mixed_tokenizers=mixture.allow_mixed_tokenizers,
            tables=digest.hexdigest(),
        )

    def open(self, components: Sequence[Records]) -> Mixture:
        """The same blend over this process's records of the components."""
        first, *later = self.weights
        named = {n: (r, w) for n, r, w in zip(self.names, components, first, strict=True)}
        schedule = list(zip(self.steps[1:], later, strict=True))
        # A period given to the Mixture is the same for every weight; one left
        # out is each weight's default, found again by leaving it out.
        for period in (None, self.periods[0]):
            mixture = Mixture(
                named,
                self.seed,
                period=period,
                schedule=schedule,
                allow_mixed_tokenizers=self.allow_mixed_tokenizers,
            )
            if Remix.of(mixture) == self:
                return mixture
        raise RuntimeError(f"the Mixture {self} could not be made again in this process")
