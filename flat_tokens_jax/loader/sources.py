"""What a loader reads: its source's components as records checked against
its config (:meth:`Sources.of`, once), and the samplers that order them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
from collections.abc import Sequence
from typing import Any

import jax

from flat_tokens_jax.core import fields
from flat_tokens_jax.core.limits import check_loader_memory, largest
from flat_tokens_jax.data.dataset import FlatTokens
from flat_tokens_jax.data.plans import default_cache_dir
from flat_tokens_jax.data.records import Records, check_source, recorded_info
from flat_tokens_jax.loader.blockcache import default_budget
from flat_tokens_jax.loader.config import (
    LoaderConfig,
    check_sharding,
    check_vocab,
    resolve_start_token_id,
)
from flat_tokens_jax.loader.reopen import Keep, Remix, Reopen
from flat_tokens_jax.sampling.blocks import Sampler, default_block, sampler
from flat_tokens_jax.sampling.mixture import Mixture, config_records


@dataclasses.dataclass(eq=False)
class Sources:
    """A loader's source, resolved under its config: ``mixture`` (``None`` for
    one source), its ``components``' records and ``names`` (``("0",)`` without
    a mixture), and the ``start_token_id`` in effect."""

    config: LoaderConfig
    mixture: Mixture | None
    components: tuple[Records, ...]
    names: tuple[str, ...]
    start_token_id: int
    _fingerprint: dict[str, Any] | None = dataclasses.field(default=None, init=False, repr=False)

    @classmethod
    def of(
        cls,
        source: FlatTokens | Records | Mixture,
        config: LoaderConfig,
        sharding: jax.sharding.Sharding | None,
        plan_cache: str | os.PathLike[str] | None,
    ) -> Sources:
        """Checks a loader's arguments and resolves ``source``: see ``Loader``."""
        if not isinstance(config, LoaderConfig):
            raise TypeError(
                f"config must be a LoaderConfig, got {type(config).__name__}: "
                "ftj.LoaderConfig(batch_size=..., seq_len=...)"
            )
        check_sharding(sharding)
        widest = max(size for _, size in config.schedule.entries)
        ahead, row = config.read_ahead_bytes, config.batch_layout.row_bytes
        memory = (widest, config.seq_len, config.prefetch, jax.process_count(), ahead)
        check_loader_memory(*memory, row_bytes=row, block_cache_bytes=config.block_cache_bytes or 0)
        cache = default_cache_dir() if plan_cache is None else plan_cache
        if isinstance(source, Mixture):
            components = source.records(
                config.seq_len, config.packing, plan_cache=cache, max_segments=config.max_segments
            )
            names = source.names
        else:
            if not isinstance(source, FlatTokens):
                check_source(source, "the Loader's source")
            made = config_records(
                source, config.seq_len, config.packing, cache, config.max_segments, "the source"
            )
            components = (made,)
            names = ("0",)
        for records in components:
            if len(records) == 0:
                raise ValueError(
                    f"{records!r} has no records: the split holds fewer than "
                    f"seq_len={config.seq_len} tokens or no sequences"
                )
        infos = [(n, recorded_info(r)) for n, r in zip(names, components, strict=True)]
        check_vocab(config, components, infos)
        mixture = source if isinstance(source, Mixture) else None
        start = resolve_start_token_id(config, infos)
        out = cls(config, mixture, tuple(components), tuple(names), start)
        if config.shuffle == fields.BLOCKS and config.block_cache_bytes is None:
            # The default budget is sized from the stores: checked once they are open.
            check_loader_memory(
                *memory,
                row_bytes=row,
                block_cache_bytes=out.block_cache_bytes,
                cache_fixes=out.cache_fixes,
            )
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as what opens the same sources in another process (a grain
        # worker): open stores do not cross processes. What was worked out
        # from the stores here travels as it is.
        openers = [Reopen.of(r) or Keep(r) for r in self.components]
        if any(o.in_memory for o in openers):
            raise pickle.PicklingError(
                f"{self.records!r} is in a memory:// store, which exists only in this "
                "process: write the dataset to a path or object store for grain worker "
                "processes, or leave mp_prefetch out"
            )
        remix = None if self.mixture is None else Remix.of(self.mixture)
        known = {k: self.__dict__[k] for k in ("block", "block_cache_bytes") if k in self.__dict__}
        made = (self.config, self.names, self.start_token_id, self.fingerprint(), known)
        return _reopened, (openers, remix, *made)

    @property
    def records(self) -> Records | Mixture:
        return self.components[0] if self.mixture is None else self.mixture

    def fingerprint(self) -> dict[str, Any]:
        """``Loader.fingerprint``, computed once (a split's reads samples of its data)."""
        if self._fingerprint is None:
            if self.mixture is None:
                data = self.components[0].fingerprint()
            else:
                data = self.mixture.fingerprint(self.components)
            config = {**self.config.batch_defining(), "start_token_id": self.start_token_id}
            if self.config.shuffle == fields.BLOCKS:
                config["shuffle_block"] = self.block
            batch_size = config.pop("batch_size")
            self._fingerprint = {"data": data, "config": config, "batch_size": batch_size}
        return self._fingerprint

    def seeds(self) -> list[int]:
        mix, seed = self.mixture, self.config.seed
        return (
            [seed] if mix is None else [mix.component_seed(seed, c) for c in range(len(mix.names))]
        )

    @functools.cached_property
    def block(self) -> int:
        """The block shuffle's records per block: ``shuffle_block``, or sized from the stores."""
        given = self.config.shuffle_block
        return default_block(self.components, self.config.seq_len) if given is None else given

    @functools.cached_property
    def block_cache_bytes(self) -> int:
        """``block_cache_bytes``, or ``default_budget`` of this host's lanes."""
        config = self.config
        if config.block_cache_bytes is not None:
            return config.block_cache_bytes
        return self._default_budget(self.block, config.shuffle_window)

    def _default_budget(self, block: int, window: int) -> int:
        lanes = self.config.lanes
        here = lanes if self.mixture is not None else -(-lanes // jax.process_count())
        return default_budget(self.components, block, window, here, self.config.seq_len)

    def cache_fixes(self, room: int) -> list[str]:
        """How the default ``block_cache_bytes`` comes within ``room`` bytes: the
        largest ``shuffle_window`` or ``shuffle_block`` that does, each alone."""
        block, window = self.block, self.config.shuffle_window
        fixes = []
        most = largest(lambda w: self._default_budget(block, w) <= room, 1, window - 1)
        if most is not None:
            fixes.append(f"lower shuffle_window (at most {most:,})")
        most = largest(lambda b: self._default_budget(b, window) <= room, 1, block - 1)
        if most is not None:
            fixes.append(f"lower shuffle_block (at most {most:,})")
        return fixes

    def samplers(self, streams: Sequence[tuple[int, int]] | None = None) -> list[Sampler]:
        """``[K]`` each component's sampler: from sample 0 under :meth:`seeds`, or
        where ``streams[c]``, its ``(seed, offset)``, says its stream goes on."""
        at = [(seed, 0) for seed in self.seeds()] if streams is None else streams
        config = self.config
        blocks = config.shuffle == fields.BLOCKS
        return [
            sampler(
                len(records),
                config.shuffle,
                seed=seed,
                num_epochs=config.num_epochs,
                offset=offset,
                block=self.block if blocks else 1,
                window=config.shuffle_window,
                lane_count=config.lanes,
            )
            for records, (seed, offset) in zip(self.components, at, strict=True)
        ]


def _reopened(
    openers: Sequence[Reopen | Keep],
    remix: Remix | None,
    config: LoaderConfig,
    names: tuple[str, ...],
    start_token_id: int,
    fingerprint: dict[str, Any],
    known: dict[str, int],
) -> Sources:
    components = tuple(o.open() for o in openers)
    mixture = None if remix is None else remix.open(components)
    sources = Sources(config, mixture, components, names, start_token_id)
    sources._fingerprint = fingerprint
    sources.__dict__.update(known)  # the cached properties' values
    return sources
