"""Read committed samples of a store version: a torch Dataset with random access by sample.

The index (which sample lives where) is built from unit attributes and commit records at construction;
Zarr arrays are opened lazily, per process, on first access, so the dataset is safe to use with
DataLoader worker processes (each worker opens its own handles after fork/spawn).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_pipeline.storage.layout import from_storage
from dflash_pipeline.storage.store import Store


@dataclass(frozen=True)
class SampleRef:
    sample_id: str
    unit: str
    start: int
    length: int


class HiddenStateDataset(torch.utils.data.Dataset):
    """Items: {'sample_id', 'input_ids' [T] long, 'loss_mask' [T] bool, 'hidden' [T, K, H],
    and 'last_hidden' [T, H] when captured}; hidden states in the store's logical dtype."""

    def __init__(self, store_root: str | Path, version: str | None = None, store_options: dict | None = None):
        """`store_root`: a local path or s3://bucket/prefix; `store_options`: its non-secret fsspec options
        (e.g. {"endpoint_url": ...}); credentials come from the standard AWS chain."""
        self.store = Store(store_root, store_options)
        self.store.check_readable()
        self.version = version or self.store.current() or (self.store.versions() or [None])[-1]
        if self.version is None:
            raise FileNotFoundError(f"no store version under {self.store.url}")
        self.attrs = self.store.attrs(self.version)
        self.logical = self.attrs["logical_dtype"]
        self.layer_ids: list[int] = self.attrs["layer_ids"]
        self.samples: list[SampleRef] = []
        for unit in self.store.units(self.version):
            committed = self.store.commit_record(self.version, unit)["committed_tokens"]
            for sid, start, length in self.store.unit_attrs(self.version, unit)["samples"]:
                if start + length <= committed:  # readers see committed samples only
                    self.samples.append(SampleRef(sid, unit, start, length))
        self._by_id = {s.sample_id: i for i, s in enumerate(self.samples)}
        self._arrays: dict[str, dict] = {}
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def index_of(self, sample_id: str) -> int:
        return self._by_id[sample_id]

    def _unit_arrays(self, unit: str) -> dict:
        if self._pid != os.getpid():  # new process (DataLoader worker): drop inherited handles
            self._arrays, self._pid = {}, os.getpid()
        if unit not in self._arrays:
            g = self.store.open_unit(self.version, unit)
            self._arrays[unit] = {k: g[k] for k in ("hidden", "last_hidden", "input_ids", "loss_mask") if k in g}
        return self._arrays[unit]

    def __getitem__(self, i: int) -> dict:
        ref = self.samples[i]
        a = self._unit_arrays(ref.unit)
        sl = slice(ref.start, ref.start + ref.length)
        item = {
            "sample_id": ref.sample_id,
            "input_ids": torch.from_numpy(a["input_ids"][sl].astype("int64")),
            "loss_mask": torch.from_numpy(a["loss_mask"][sl]).bool(),
            "hidden": from_storage(a["hidden"][sl], self.logical),
        }
        if "last_hidden" in a:
            item["last_hidden"] = from_storage(a["last_hidden"][sl], self.logical)
        return item
